"""Shared fixtures: synthetic RL-like weight sequences and a tiny generated Hugging Face model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from delta_swap.engine_adapter import EngineAdapter, StagedSnapshot


def rl_steps(n_steps: int, *, seed: int = 0, lr: float = 2e-5, shapes: dict | None = None) -> list[dict[str, torch.Tensor]]:
    """bf16 snapshots of fp32 master weights nudged a little each step, as an RL optimizer does."""
    gen = torch.Generator().manual_seed(seed)
    shapes = shapes or {"embed.weight": (64, 32), "layers.0.q.weight": (32, 32), "layers.0.k.weight": (16, 32),
                        "layers.0.norm.weight": (32,), "lm_head.weight": (64, 32)}
    master = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
    out = []
    for _ in range(n_steps):
        for v in master.values():
            v += torch.randn(v.shape, generator=gen) * lr
        out.append({k: v.to(torch.bfloat16) for k, v in master.items()})
    return out


def assert_state_equal(state, expected: dict[str, torch.Tensor]) -> None:
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        got = state[name].to_torch()
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.view(torch.uint8) if got.dim() else got, tensor.view(torch.uint8) if tensor.dim() else tensor), name


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from delta_swap.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


class RecordingEngine(EngineAdapter):
    """Holds the tensors it was given, as an engine would; can be told to fail once."""

    def __init__(self) -> None:
        self.weights: dict = {}
        self.swaps: list[StagedSnapshot] = []
        self.fail_next = False

    async def swap(self, staged: StagedSnapshot) -> dict[str, float]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("engine refused")
        for name in staged.changed:
            self.weights[name] = staged.state[name]
        self.swaps.append(staged)
        return {"pause": 0.0, "swap": 0.0}
