"""Benchmarks: scripts that measure delta-swap and its anchors side by side in one run and print a
table. Run them from the repository root as modules, e.g. ``python -m benchmarks.codec_bench``."""
