"""Benchmarks, each runnable as a module (``python -m benchmarks.dispatch``).

Numbers come from these runs, never from timed assertions in tests.
"""
