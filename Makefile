# One entry point. `make demo`, `make test` and `make bench` each set up .venv first (once).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-0.1
BENCH_STAMP := $(VENV)/.installed-bench-0.1

.PHONY: demo test test-quick lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first, pinned: a bare or ranged `torch` could pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0 numpy
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# matplotlib for the plots: a bench-only extra.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 8 -m ppclip_func.demo

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
	$(VENV)/bin/ruff check ppclip_func tests bench
	$(VENV)/bin/ruff format --check ppclip_func tests bench
	$(PY) -m pytest

test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
