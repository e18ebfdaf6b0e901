# Two commands: `make train` (demo run) and `make test`. Both create .venv on first use.
PY      := .venv/bin/python
STAMP   := .venv/.installed

.PHONY: install train test clean
install: $(STAMP)

TESTDEV := tests/device/setup.py $(wildcard tests/device/titanite_testdev/*.py tests/device/titanite_testdev/csrc/*)

$(STAMP): pyproject.toml requirements-ci.txt $(TESTDEV)
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-ci.txt
	$(PY) -m pip install -q --no-deps lm-eval==0.4.13  # its run-time needs are in requirements-ci.txt
	$(PY) -m pip install -q --no-deps -e .
	@echo "building titanite's test device (tests/device, a PrivateUse1 backend; about a minute)"
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) -m pip install -q --no-build-isolation --no-deps ./tests/device
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m titanite.train --config configs/demo.toml

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf .venv outputs
