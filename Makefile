# make test: install into .venv, lint (ruff, mypy) beside the CPU suite (GPU tests skip, with the reason, without a GPU);
#   as root, tmux and Prometheus installed where missing (scripts/test-tools.sh) for the see-it tests
# make lint: ruff and mypy only
# make serve: install and run the daemon (ARGS="--isolation mps ...")
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# make test runs the suite on this many pytest-xdist workers (0: in one process, as plain pytest
# does), each taking the next test module when it is free (--dist loadscope: a module's daemon and
# compiled examples are made once, not once per worker; 10 s less than test by test on 2 cores),
# the longest first, and the fleet modules on two workers, each with its Ray cluster
# (tests/conftest.py).  More workers than cores: tests wait on processes too.
PYTEST_WORKERS ?= 4

# What make lint and make test check, with zero findings (the rules: pyproject's [tool.ruff], [tool.mypy]).
RUFF_PATHS ?= meshd_mps workers tests scripts examples
MYPY_PATHS ?= meshd_mps workers

.PHONY: install lint test test-gpu serve bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# uv (from PyPI, into the venv) installs: 15 s on 2 cores where pip took 37 s of make test's 4
	# minutes (Ray's wheel among them); the same packages, compiled to bytecode as pip does.
	# compat: the checkout on sys.path through a plain .pth; the default finder hook is imported
	# by every Python process of the venv (18 ms each, ~2000 processes in a run of the suite)
	$(BIN)/pip install -q uv
	$(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode -e '.[test]' --config-settings editable_mode=compat
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check $(RUFF_PATHS)
	$(BIN)/mypy $(MYPY_PATHS)

# The suite may write bytecode caches (__pycache__, ignored by git), as Python does by default: pip
# compiles what it installs, but an editable checkout, and pytest's rewritten test modules, are
# compiled again by every process that imports them where PYTHONDONTWRITEBYTECODE is set (CI's
# machines set it): ~2000 processes, each compiling the daemon's modules, a third of the suite's CPU.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest

# The lint runs beside the suite, its output after the suite's: mypy's ~10 s on a fresh clone (no
# cache) overlap the suite's start, which waits on its Ray clusters and daemons; either failing
# fails make test.  So does scripts/test-tools.sh: tmux and Prometheus, which the see-it tests run
# (tests/serve/test_top.py, tests/serve/test_prometheus.py), installed from Debian's packages where they are
# missing and this is root (CI), while the suite starts; a test that needs one first waits for it.
test: $(STAMP)
	@scripts/test-tools.sh > $(VENV)/tools.log 2>&1 & tools=$$!; \
	$(MAKE) --no-print-directory lint > $(VENV)/lint.log 2>&1 & lint=$$!; \
	$(PYTEST) -n $(PYTEST_WORKERS) --dist loadscope $(PYTEST_ARGS); rc=$$?; \
	wait $$tools; cat $(VENV)/tools.log; \
	wait $$lint; lrc=$$?; cat $(VENV)/lint.log; \
	if [ $$lrc -ne 0 ]; then echo "make test: the lint failed (above)"; fi; \
	[ $$rc -eq 0 ] && [ $$lrc -eq 0 ]

test-gpu: $(STAMP)
	$(PYTEST) -m 'gpu or mps' -v $(PYTEST_ARGS)

serve: $(STAMP)
	$(BIN)/meshd-mps serve $(ARGS)

bench: $(STAMP)
	$(BIN)/meshd-mps bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
