"""Synthetic RL-like weight sequences, and comparing rebuilt tensors with them."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import torch


def rl_steps(
    n_steps: int, *, seed: int = 0, lr: float = 2e-5, shapes: dict | None = None
) -> list[dict[str, torch.Tensor]]:
    """bf16 snapshots of fp32 master weights nudged a little each step, as an RL optimizer does."""
    gen = torch.Generator().manual_seed(seed)
    shapes = shapes or {
        "embed.weight": (64, 32),
        "layers.0.q.weight": (32, 32),
        "layers.0.k.weight": (16, 32),
        "layers.0.norm.weight": (32,),
        "lm_head.weight": (64, 32),
    }
    master = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
    out = []
    for _ in range(n_steps):
        for v in master.values():
            v += torch.randn(v.shape, generator=gen) * lr
        out.append({k: v.to(torch.bfloat16) for k, v in master.items()})
    return out


def momentum_steps(n_steps: int, shapes: dict[str, tuple[int, int]], lr: float = 2e-5) -> list[dict[str, torch.Tensor]]:
    """bf16 snapshots of fp32 matrices that move along one sign pattern each (an outer product's,
    as a momentum does), by random amounts."""
    gen = torch.Generator().manual_seed(1)
    master = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
    pattern = {
        k: torch.outer(torch.randn(s[0], generator=gen), torch.randn(s[1], generator=gen)).sign()
        for k, s in shapes.items()
    }
    out = []
    for _ in range(n_steps):
        for k, v in master.items():
            v += lr * pattern[k] * torch.rand(v.shape, generator=gen)
        out.append({k: v.to(torch.bfloat16) for k, v in master.items()})
    return out


def assert_state_equal(state, expected: dict[str, torch.Tensor]) -> None:
    """``state`` (name -> HostTensor) holds exactly ``expected``'s tensors, bit for bit."""
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        got = state[name].to_torch()
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(
            got.view(torch.uint8) if got.dim() else got, tensor.view(torch.uint8) if tensor.dim() else tensor
        ), name


def record_host_copies(monkeypatch) -> Callable[[], list[int]]:
    """Count the publisher's host copies of the model: returns a function that gives the indices
    (in the order the copies were made) of those still alive."""
    from delta_swap import publisher as publisher_module

    copies: list[list[weakref.ref]] = []
    host_copy = publisher_module.state_to_host

    def recorded(tensors):
        state = host_copy(tensors)
        copies.append([weakref.ref(t.data) for t in state.values()])
        return state

    monkeypatch.setattr(publisher_module, "state_to_host", recorded)

    def alive() -> list[int]:
        gc.collect()
        return [i for i, refs in enumerate(copies) if any(ref() is not None for ref in refs)]

    return alive
