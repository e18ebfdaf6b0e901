# Two commands: `make train` (demo run) and `make test`. Both create .venv on first use.
# `make install` (and so `make train`) installs what training needs (requirements.txt); `make test`
# adds what the suite needs (requirements-test.txt: oracles, trackers, lm-eval) and builds the test device.
PY         := .venv/bin/python
TRAIN_DEPS := .venv/.installed-train
TEST_DEPS  := .venv/.installed-test

.PHONY: install train test clean
install: $(TRAIN_DEPS)

TESTDEV := tests/fixtures/testdev/setup.py $(wildcard tests/fixtures/testdev/titanite_testdev/*.py tests/fixtures/testdev/titanite_testdev/csrc/*)

$(TRAIN_DEPS): pyproject.toml requirements.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(TRAIN_DEPS)

$(TEST_DEPS): $(TRAIN_DEPS) requirements-test.txt $(TESTDEV)
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-deps lm-eval==0.4.13  # its run-time needs are in requirements-test.txt
	@echo "building titanite's test device (tests/fixtures/testdev, a PrivateUse1 backend; about a minute)"
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) -m pip install -q --no-build-isolation --no-deps ./tests/fixtures/testdev
	touch $(TEST_DEPS)

train: $(TRAIN_DEPS)
	$(PY) -m titanite.train --config configs/demo.toml

test: $(TEST_DEPS)
	$(PY) -m pytest -q tests

clean:
	rm -rf .venv outputs
