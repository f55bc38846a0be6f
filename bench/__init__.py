"""Benchmarks for ppclip_func: ``python -m bench [--quick]`` (see ``bench/run.py``)."""
