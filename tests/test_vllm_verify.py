"""The post-swap verification on vLLM's reload path catches each engine bug that delta-swap works
around, when that workaround is taken out (tests/support/revert_fixes puts the bug back inside the
server's processes): the swap is refused before the engine generates on it, and the status names
the tensor. Each tensor-parallel rank reads back its own shard (the tied case at TP 2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from delta_swap.testing.engine_exactness import PARTIAL_DELTAS
from examples.servers import vllm as vllm_server
from examples.tiny_model import make_tiny_model, perturb_weights
from tests.support.rollout_scenarios import publish_dirs, status, wait_for
from tests.support.vllm_cpu import vllm_int8_experts, vllm_repacks_bf16_linears

pytestmark = pytest.mark.engine

REVERT_FIXES = Path(__file__).parent / "support" / "revert_fixes"


TP2 = 2


@pytest.mark.parametrize(
    ("family", "fix", "named", "verify", "tp"),
    [
        ("qwen3", "tied", "lm_head", "always", 1),
        pytest.param(
            "qwen3_moe",
            "experts",
            "mlp.experts",
            "always",
            1,
            marks=pytest.mark.full_matrix("the experts bug under the default verify_swaps (auto) and at TP 2"),
        ),
        ("qwen2", "modules", "qkv_proj", "always", 1),
        # The default (auto) reads back at least the first sync, where the experts bug shows.
        ("qwen3_moe", "experts", "mlp.experts", None, 1),
        # Two tensor-parallel ranks (one core each): each reads back its shard of the vocabulary,
        # and its shard of one expert.
        pytest.param(
            "qwen3",
            "tied",
            "lm_head",
            "always",
            TP2,
            marks=pytest.mark.full_matrix(
                "the tied bug at TP 1; a read-back on each of two ranks: the experts bug at TP 2"
            ),
        ),
        ("qwen3_moe", "experts", "mlp.experts", "always", TP2),
        # Experts quantized to int8 as vLLM loads them, on the shadow path: the read-back runs each
        # expert through the live kernel against a fresh quantization of the published layer.
        ("qwen3_moe", "stale_quantized_experts", "mlp.experts", "always", 1),
    ],
)
def test_verification_catches_the_bug_a_reverted_fix_lets_through(family, fix, named, verify, tp, tmp_path) -> None:
    if fix == "tied" and not vllm_repacks_bf16_linears():
        pytest.skip(
            "vLLM keeps plain bf16 weights on this CPU (no AMX, no oneDNN bf16 matmul): a tied lm_head "
            "computes from the embedding itself, so there is no packed copy to leave stale"
        )
    base = make_tiny_model(tmp_path / "A", family=family)
    what, only = PARTIAL_DELTAS[family][0]
    step1 = perturb_weights(base, tmp_path / "B", only=only, seed=1)
    store = tmp_path / "store"
    publish_dirs(store, [(0, base)], None)
    env = {
        "DELTA_SWAP_REVERT_FIXES": fix,
        "PYTHONPATH": os.pathsep.join([str(REVERT_FIXES), os.environ.get("PYTHONPATH", "")]),
        **({"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp > 1 else {}),
    }
    extra = ("--tensor-parallel-size", str(tp)) if tp > 1 else ()
    quantized = fix == "stale_quantized_experts"
    if quantized and (why := vllm_int8_experts()):
        pytest.skip(why)
    if quantized:
        extra = ("--quantization", "int8_per_channel_weight_only")
    settings = {
        "store": store.as_uri(),
        "poll_interval": 0.2,
        "drain": "wait",
        "swap_path": "shadow" if quantized else "reload",
        **({"verify_swaps": verify} if verify else {}),
    }
    server = vllm_server.start(base, tmp_path, settings=settings, served_name="tiny", env=env, extra=extra)
    try:
        # The first sync reloads every tensor: the experts bug already shows there.
        st = wait_for(server.url, lambda s: s["current_step"] == 0 or s["failures"] > 0, timeout=300)
        if st["failures"] == 0:
            publish_dirs(store, [(1, step1)], None)
            st = wait_for(server.url, lambda s: s["failures"] > 0 or s["current_step"] == 1, timeout=300)
        assert st["failures"] > 0, f"{what}: the {fix} bug was served without a complaint: {st}"
        # The refusal names the tensor; if the next poll's repair (every tensor reloaded, read back
        # again) has already landed, last_error is cleared and last_failure still holds it.
        error = st["last_error"] or st["last_failure"]["error"]
        assert "other values than the snapshot" in error and named in error, st
        if st["last_error"] is None:  # repaired: a full reload serves the fix-free path's weights, verified
            assert st["current_step"] == 1 and st["verification"]["unverified_swaps"] == 0, st
            assert st["last_verification"] and st["last_verification"]["checks"] > 0, st
        if st["current_step"] == 0:  # rolled back (else the engine's state is reported unknown)
            assert status(server.url)["weight_version"] == "step-0000000000"
        if tp > 1 and st["current_step"] == 0:  # every rank read back its shard at the sync before
            assert st["last_verification"]["workers"] == tp and not st["last_verification"].get("skipped"), st
    finally:
        server.stop()
