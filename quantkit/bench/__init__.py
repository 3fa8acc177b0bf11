"""Benchmarks users run: `quantkit bench --offline` (the engine in-process, with peers side by side)."""
