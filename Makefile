# Two commands: `make train` (demo run) and `make test`. Both create .venv on first use.
PY      := .venv/bin/python
STAMP   := .venv/.installed

.PHONY: install train test clean
install: $(STAMP)

$(STAMP): pyproject.toml requirements-ci.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-ci.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m titanite.train --config configs/demo.toml

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf .venv outputs
