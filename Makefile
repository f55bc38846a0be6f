# One entry point. `make demo`, `make test` and `make bench` each set up .venv first (once).
VENV ?= .venv
# The torch the venv gets, pinned: a bare or ranged `torch` could pull a multi-GB CUDA build.
TORCH ?= 2.13.0
PY := $(VENV)/bin/python
# The stamp is named after the package version (read from ppclip_func/__init__.py, its one
# source) and the torch version: a new version of either sets the venv up again.
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' ppclip_func/__init__.py)
STAMP := $(VENV)/.installed-$(VERSION)-torch-$(TORCH)
BENCH_STAMP := $(STAMP)-bench
LINTED := ppclip_func tests bench demo

.PHONY: demo demo-spike test test-quick test-torch-2.14 lint bench clean

# torchtitan 0.3.0 is a test dependency (tests/test_torchtitan.py runs its own meshes, models and
# parallelisms), installed without its dependencies (datasets, wandb, torchdata, ...): the parts
# the tests use import only what the test extra brings. It needs Python >= 3.11.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==$(TORCH) numpy
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps torchtitan==0.3.0
	touch $@

# matplotlib for the plots: a bench-only extra (torchtitan's clip, study 3's baseline, comes with the tests').
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m demo

# A gradient spike on the same 8-rank model: fixed threshold vs adaptive vs skipping (demo/spike.py).
demo-spike: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m demo.spike

# The full benchmark suite (long; `$(PY) -m bench --quick` is the CI-sized run).
# The bandwidth study also measures the pure API under jemalloc (bench/README.md,
# "The pure API and the C allocator"): Debian's libjemalloc2 is installed if
# missing; without it that row is recorded as skipped. `make test` needs none of it.
bench: $(BENCH_STAMP)
	@$(PY) -c "import sys; from bench._allocator import find_jemalloc; sys.exit(find_jemalloc() is None)" || \
		(command -v apt-get >/dev/null && apt-get update -qq && apt-get install -y -qq libjemalloc2) || \
		echo "libjemalloc2 could not be installed: the jemalloc row of the bandwidth study will be skipped"
	$(PY) -m bench

test: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(PY) -m pytest

test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow"

# The whole suite on the newest torch the package allows, in a venv of its own. Not part of CI:
# PyPI's torch 2.14.1 wheel brings the CUDA libraries (about 5.5 GB installed).
test-torch-2.14:
	$(MAKE) test VENV=.venv-torch-2.14 TORCH=2.14.1

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
