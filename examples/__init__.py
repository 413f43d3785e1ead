"""Runnable examples: the demo, and the helpers they share with the tests and benchmarks (a tiny
model generator, an engine server runner). Run them from the repository root as modules:
``python -m examples.demo``."""
