"""Benchmarks: ``python -m bench.NAME``, or all of them with ``nox -s bench``."""
