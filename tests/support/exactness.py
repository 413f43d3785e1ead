"""The exactness suite's model hooks for this project's engine tests: tiny random checkpoints of
each family (examples.tiny_model) and partial deltas of them. Each engine's test module adds
how to start its server and read prompt logprobs."""

from __future__ import annotations

from pathlib import Path

from delta_swap.testing.engine_exactness import EngineExactnessTests
from examples.tiny_model import make_tiny_model, perturb_weights


class TinyModelExactness(EngineExactnessTests):
    def make_checkpoint(self, family: str, out: Path) -> Path:
        return make_tiny_model(out, family=family)

    def perturb(self, src: Path, out: Path, only: str, seed: int) -> Path:
        return perturb_weights(src, out, only=only, seed=seed)
