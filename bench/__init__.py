"""Benchmarks: run as modules from the repo root, e.g. `python -m bench.engine`."""
