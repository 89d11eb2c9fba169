"""Command-line tools that sit beside the library: checkpoint conversion, the GPU smoke test, benchmarks."""
