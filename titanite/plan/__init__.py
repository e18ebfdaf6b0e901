"""The planner: memory per rank and FLOPs per step for a config's parallel layout, before renting
the machines, and the rehearsal of the real parallel plan on the meta device.

Its entry point is `estimate(cfg, world_size, ...) -> Estimate`, for code (benchmarks, tests) and
for the `titanite estimate` command (titanite/commands/estimate.py: the command line, the world
size, the accelerator planned for, --device-memory-gib).

The modules, each importing only those listed before it:
- `counts.py`: the counting rules every part shares (parameter tensors per rank, FSDP's
  sharding and transients, activations per block);
- `context.py`: context parallelism's share (each rank's S / cp tokens, the gathered keys and
  values, the shared mask, the communication per step);
- `phases.py`: the peak of a step, moment by moment;
- `lora.py`: a LoRA run's share (frozen base, adapters, their activations);
- `preference.py`: a DPO run's share (two sequences per pair, their log-probabilities, the
  reference and its forward);
- `pipeline_costs.py`: pipeline parallelism's share (each pipeline rank's stages, the micro-batches the
  schedule keeps in flight, the bubble, the point-to-point traffic);
- `estimator.py`: `Estimate` and `estimate()`, which puts the parts together;
- `report.py`: the estimate as printed;
- `rehearse.py`: `--rehearse`, the real plan (the rank's pipeline stages included) under a fake
  process group, and a layout that fits (pp, cp, tp, ep, activation checkpointing).
"""

from __future__ import annotations

from titanite.plan.estimator import Estimate, estimate

__all__ = ["Estimate", "estimate"]
