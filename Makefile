# One entry point. `make demo`, `make test` and `make bench` each set up .venv first (once).
VENV ?= .venv
# The Python the venv is made with (3.10 to 3.13), e.g. `make test PYTHON=python3.12 VENV=.venv-3.12`.
PYTHON ?= python3
# The torch the venv gets, pinned: a bare or ranged `torch` could pull a newer CUDA build. PyPI's
# Linux x86_64 torch wheels are CUDA builds (sizes: docs/versions.md);
# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build from PyTorch's index.
TORCH ?= 2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
# The stamp is named after the package version (read from ppclip_func/__init__.py, its one
# source) and the torch version: a new version of either sets the venv up again.
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' ppclip_func/__init__.py)
STAMP := $(VENV)/.installed-$(VERSION)-torch-$(TORCH)
BENCH_STAMP := $(STAMP)-bench
LINTED := ppclip_func tests bench demo

# Every torch release the suite is run on (docs/versions.md). The first is the oldest supported,
# the lower bound of pyproject.toml's requirement; there is no upper bound.
TORCH_RELEASES := 2.11.0 2.12.1 2.13.0 2.14.1
TORCH_OLDEST := $(firstword $(TORCH_RELEASES))
# The tests that start real gloo ranks, fake process groups or compiled collectives: where torch's
# distributed internals (and inductor's handling of state written in place) move between releases. `make test-oldest` runs them on TORCH_OLDEST in CI.
DIST_TESTS := tests/test_agree_ranks.py tests/test_distributed_small.py tests/test_layouts.py \
	tests/test_adagc_ranks.py tests/test_param_norms_ranks.py tests/test_optimizer_handoff_ranks.py \
	tests/test_compile_fake_pg.py tests/test_pipeline_mesh.py tests/test_process_groups.py \
	tests/test_torch_versions.py tests/test_write_back.py

.PHONY: demo demo-spike test test-commands test-quick test-trainers test-dist test-torch test-torch-all test-oldest test-pythons gpu-check lint bench bench-quality clean

# OLMo-core 3.0.0 for tests/test_olmo_core.py, without its dependencies: it asks torch < 2.14, which
# would make pip replace the venv's torch, and cached-path (imported at module level) brings boto3 and
# google-cloud-storage; the tests put a local-paths-only stand-in where cached-path is missing. These are
# the small packages the modules the tests use import (pip keeps any already there). On a torch it
# refuses (>= 2.14) its tests skip, saying so, and nothing else changes.
OLMO_CORE := ai2-olmo-core==3.0.0 rich pygments markdown-it-py mdurl dataclass-extensions requests urllib3 \
	charset-normalizer certifi bettermap dill

# $(call install_no_deps,PYTHON): torchtitan 0.3.0 (Python >= 3.11 only) and OLMo-core with the list above,
# each without its own dependencies; what the `trainers` extra of pyproject.toml cannot pin.
define install_no_deps
	@if $(1) -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
		echo "$(1) -m pip install --quiet --no-deps torchtitan==0.3.0"; \
		$(1) -m pip install --quiet --no-deps torchtitan==0.3.0; \
	else \
		echo "Python < 3.11: torchtitan 0.3.0 (Python >= 3.11) is not installed; its tests will skip"; \
	fi
	$(1) -m pip install --quiet --no-deps $(OLMO_CORE)
endef

# torchtitan 0.3.0 is a test dependency (tests/test_torchtitan.py runs its own meshes, models and
# parallelisms), installed without its dependencies (datasets, wandb, torchdata, ...): the parts
# the tests use import only what the test extra brings. It needs Python >= 3.11: on 3.10 it is not
# installed, and the tests that run it skip, saying so. A venv made with another Python is made again.
$(STAMP): pyproject.toml
	@$(PY) -c 'import sys; v = sys.argv[1].split(); sys.exit(sys.version_info[:2] != (int(v[0]), int(v[1])))' \
		"$$($(PYTHON) -c 'import sys; print(*sys.version_info[:2])')" 2>/dev/null || $(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch==$(TORCH) numpy
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -e '.[test]' torch==$(TORCH)
	$(call install_no_deps,$(PY))
	touch $@

# A venv with only what a user of the trainer integrations installs: torch, the package itself (not
# editable, no test extra: no pytest, which would bring packages a trainer forgot), the `trainers` extra
# and the no-deps installs above. `make test-trainers` imports each integration with its trainer there.
TRAINERS_VENV ?= .venv-trainers
TRAINERS_PY := $(TRAINERS_VENV)/bin/python
TRAINERS_STAMP := $(TRAINERS_VENV)/.installed-$(VERSION)-torch-$(TORCH)
$(TRAINERS_STAMP): pyproject.toml
	$(PYTHON) -m venv --clear $(TRAINERS_VENV)
	$(TRAINERS_PY) -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch==$(TORCH) numpy
	$(TRAINERS_PY) -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) '.[trainers]' torch==$(TORCH)
	$(call install_no_deps,$(TRAINERS_PY))
	touch $@

# matplotlib for the plots: a bench-only extra (torchtitan's clip, study 3's baseline, comes with the tests').
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m demo

# A gradient spike on the same 8-rank model: fixed threshold vs adaptive vs skipping vs AdaGC (demo/spike.py);
# the adaptive run's record (JSON lines), the layers it names and its heatmap go to spike-record/.
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

# Does it help: every clip rule trained on the standard library's source, several rates and seeds (bench/quality_study.py):
# the search, then the study, about 45 minutes on 2 cores; writes bench/results/quality.{json,png}.
# QUALITY_ARGS="--reuse-search FILE" takes the search from a file written by --search --search-json FILE.
QUALITY_ARGS ?=
bench-quality: $(BENCH_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m bench.quality_study $(QUALITY_ARGS)

# Lint, types and every test of the package; the tests that run whole commands (the demos, the bench
# studies at their smoke sizes) are `make test-commands`. CI runs both (.ci/run).
test: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy
	$(PY) -m pytest -m "not command"

test-commands: $(STAMP)
	$(PY) -m pytest -m command

test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow"

# Each trainer integration imported and run once with its trainer, in the venv above (made the first time),
# this tree's package read from the checkout.
test-trainers: $(TRAINERS_STAMP)
	$(TRAINERS_PY) -m tests.trainer_imports

# The whole suite on one torch release, in a venv of its own made the first time and reused
# (`make test-torch TORCH=2.11.0`). PyPI's torch wheels for Linux x86_64 are CUDA builds, about
# 5 GB installed each: downloaded once per venv, not per run.
test-torch:
	$(MAKE) test VENV=.venv-torch-$(TORCH) TORCH=$(TORCH)

# The whole suite on every release of TORCH_RELEASES, one after the other; a summary at the end.
test-torch-all:
	@passed=; failed=; \
	for t in $(TORCH_RELEASES); do \
		echo "=== torch $$t"; \
		if $(MAKE) test-torch TORCH=$$t; then passed="$$passed $$t"; else failed="$$failed $$t"; fi; \
	done; \
	echo "make test passed on torch:$${passed:- none}; failed on:$${failed:- none}"; \
	[ -z "$$failed" ]

# CI's second run: the distributed tests (slow ones left out) on the oldest supported torch, so a
# call that only newer releases have cannot land unseen.
test-oldest:
	$(MAKE) test-dist VENV=.venv-torch-$(TORCH_OLDEST) TORCH=$(TORCH_OLDEST)

# The distributed tests alone, slow ones left out, on the venv's torch.
test-dist: $(STAMP)
	$(PY) -m pytest -m "not slow" $(DIST_TESTS)

# The quick tests on each Python from 3.10 to 3.13 this machine has (on PATH as python3.X, or
# installed by pyenv), each in a venv of its own (.venv-py3.X, made the first time: torch is
# downloaded for each Python). A Python the machine lacks is named, and fails nothing.
test-pythons:
	@ran=; missing=; failed=; \
	for v in 3.10 3.11 3.12 3.13; do \
		py=$$(for p in python$$v $$(pyenv root 2>/dev/null)/versions/$$v.*/bin/python$$v; do \
			"$$p" -c '' 2>/dev/null && command -v "$$p" && break; done); \
		if [ -z "$$py" ]; then missing="$$missing $$v"; continue; fi; \
		echo "=== Python $$v: $$py"; \
		if $(MAKE) test-quick PYTHON=$$py VENV=.venv-py$$v; then ran="$$ran $$v"; else failed="$$failed $$v"; fi; \
	done; \
	echo "test-quick passed on Python:$${ran:- none}; failed on:$${failed:- none}; not on this machine:$${missing:- none}"; \
	[ -z "$$failed" ] && [ -n "$$ran" ]

# On a machine with a CUDA GPU, in one command (under 8 minutes on one GPU): the GPU tests (CUDA-graph
# capture both ways, the write-back inside a captured graph, the ranks-agree check on CUDA), the
# write-back's CPU forms on that machine's torch, and the capture study into bench/results/gpu.json.
# GPU_PYTHON is a Python whose torch is a CUDA build, with pytest and hypothesis (the package is
# read from this tree: nothing is installed). Every step runs, under its own time limit; the target
# fails if any did. Record what it shows in bench/README.md.
GPU_PYTHON ?= python3
gpu-check:
	@$(GPU_PYTHON) -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.cuda.is_available()); sys.exit(not torch.cuda.is_available())'
	@status=0; \
	PYTHONPATH=$(CURDIR) timeout 330 $(GPU_PYTHON) -m pytest -p no:cacheprovider -q -rs \
		tests/test_cuda_graphs.py tests/test_agree_cuda.py tests/test_write_back.py || status=1; \
	PYTHONPATH=$(CURDIR) timeout 120 $(GPU_PYTHON) -m bench.gpu_study --capture-only || status=1; \
	exit $$status

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
