"""Preference optimisation (training.objective = 'dpo'): the per-pair losses (losses.py), the
reference policy (reference.py) and the training step and evaluation (objective.py). The data
side is titanite/data/preference.py (rows -> pairs) and PairWindows in titanite/data/packing.py."""
