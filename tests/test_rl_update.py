"""The benchmarks' synthetic RL step (``benchmarks.harness.rl_update``) moves bf16 weights by a few
ULP as a trainer's step does: never into a NaN or an Inf, never across zero. Moving the raw bits of a
zero down by two made 0xFFFE, a NaN, which a server's read-back then refused (rightly) on every try."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from benchmarks.harness import rl_update  # noqa: E402


def test_a_step_keeps_every_value_finite_and_its_sign() -> None:
    edges = [0.0, -0.0, 1e-40, -1e-40, 1.0, -1.0, 3.38e38, -3.38e38]  # zeros, subnormals, the largest finite
    weights = {"w": torch.tensor(edges * 2000, dtype=torch.bfloat16)}
    before = weights["w"].clone()
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        rl_update(weights, gen, fraction=0.5)
    after = weights["w"]
    assert bool(torch.isfinite(after).all())
    assert torch.equal(after.view(torch.int16) < 0, before.view(torch.int16) < 0)
    moved = (after.view(torch.int16) != before.view(torch.int16)).float().mean().item()
    assert moved > 0.8  # the edges still move, away from the boundary
    ulps = (after.view(torch.int16).int() - before.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 3 * 20


def test_a_step_moves_about_the_fraction_asked() -> None:
    weights = {"w": torch.randn(200_000).to(torch.bfloat16)}
    before = weights["w"].clone()
    rl_update(weights, torch.Generator().manual_seed(1), fraction=0.02)
    moved = (weights["w"] != before).float().mean().item()
    assert 0.012 < moved < 0.02  # a seventh of the moves are 0 ULP, a few indices repeat
