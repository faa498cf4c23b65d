"""Helpers shared by the test suite (``tests/conftest.py``) and the benchmarks
(``tests/bench/*.py``): importable as ``tests.support`` from the repository root."""
