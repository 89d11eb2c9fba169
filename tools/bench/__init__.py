"""Benchmarks, run from the repository root as ``python -m tools.bench.<name>`` (numbers: docs/benchmarks.md)."""
