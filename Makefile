# make test: install into .venv, lint (ruff, mypy) and run the CPU suite (GPU tests skip, with the reason, without a GPU)
# make lint: ruff and mypy only
# make serve: install and run the daemon (ARGS="--isolation mps ...")
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The paths clean so far, linted by make lint and make test:
# widened to the whole tree once every module is clean (issue 15)
# (RUFF_PATHS = meshd_mps workers tests scripts, MYPY_PATHS = meshd_mps workers).  Till then mypy
# reads the modules these import without reporting their errors (MYPY_FLAGS, dropped then).
RUFF_PATHS ?= workers meshd_mps/gpu tests/worker_rig.py tests/test_sim_limits.py tests/gpu/test_cuda_worker.py
MYPY_PATHS ?= workers meshd_mps/gpu
MYPY_FLAGS ?= --follow-imports=silent

.PHONY: install lint test test-gpu serve bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check $(RUFF_PATHS)
	$(BIN)/mypy $(MYPY_FLAGS) $(MYPY_PATHS)

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m 'gpu or mps' -v $(PYTEST_ARGS)

serve: $(STAMP)
	$(BIN)/meshd-mps serve $(ARGS)

bench: $(STAMP)
	$(BIN)/meshd-mps bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
