# One entry point. `make demo`, `make test` and `make bench` each set up .venv first (once).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-0.1
BENCH_STAMP := $(VENV)/.installed-bench-0.2

.PHONY: demo test test-quick lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first, pinned: a bare or ranged `torch` could pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0 numpy
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# matplotlib for the plots, and torchtitan's own clip as study 3's baseline: a bench-only extra.
# torchtitan without its dependencies (datasets, wandb, ...): its clip imports only what the
# bench extra brings. torchtitan 0.3.0 needs Python >= 3.11.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) -m pip install --quiet --no-deps torchtitan==0.3.0
	touch $@

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 8 -m ppclip_func.demo

# The full benchmark suite (long; `$(PY) -m bench --quick` is the CI-sized run).
bench: $(BENCH_STAMP)
	$(PY) -m bench

test: $(STAMP)
	$(VENV)/bin/ruff check ppclip_func tests bench
	$(VENV)/bin/ruff format --check ppclip_func tests bench
	$(PY) -m pytest

test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
