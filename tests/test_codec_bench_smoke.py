"""CI-sized runs of the codec benchmark (benchmarks/codec_bench.py) and of the context study
(benchmarks/context_entropy.py) on the ``smoke`` corpus: a
0.1M-parameter model built in seconds under a temporary cache, two checkpoint pairs, every default
method including Fireworks' ARC v3 (the real ``fireworks-delta-compression`` package).

It checks what the benchmark reports, not how fast this machine is: every method's round trip is
verified bit-exact by the benchmark itself (it raises otherwise), codec v2's payload is below ARC
v3's smallest and above the entropy of its own model, and the printed table has a row per method.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fireworks_delta_compression", reason="ARC v3 is the benchmark's anchor")

from benchmarks import codec_bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp("codec-bench")
    out = tmp / "report.json"
    env = {**os.environ, "DELTA_SWAP_CACHE": str(tmp / "cache")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.codec_bench",
            "--corpus",
            "smoke",
            "--steps",
            "2",
            "--repeats",
            "1",
            "--threads",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


def test_the_report_covers_every_method_on_real_rl_pairs(report) -> None:
    doc, _ = report
    result = doc["corpora"]["smoke"]["results"]["1e-05"]
    assert result["pairs"] == 2 and result["model_bytes"] > 100_000
    assert 0.001 < result["changed_fraction"] < 0.5  # an RL-like step: most elements unchanged
    assert set(result["methods"]) == set(codec_bench.DEFAULT_METHODS)
    for name, m in result["methods"].items():
        assert m["payload_bytes"] > 0 and m["encode_mb_s"] > 0 and m["rebuild_mb_s"] > 0, name


def test_codec_v2_is_smaller_than_arc_v3_and_not_below_its_entropy(report) -> None:
    doc, _ = report
    result = doc["corpora"]["smoke"]["results"]["1e-05"]
    methods = result["methods"]
    ours = methods["delta_swap"]["payload_pct"]
    best_arc = min(methods["arc_v3@1"]["payload_pct"], methods["arc_v3@19"]["payload_pct"])
    assert ours < best_arc and ours < methods["delta_swap_v1"]["payload_pct"]
    # A lossless coder cannot beat the entropy of the model it codes with (headers come on top).
    assert result["entropy_conditional_pct"] <= ours
    assert result["entropy_conditional_pct"] < result["entropy_order0_pct"]
    assert result["target"]["payload_vs_best_arc_v3"] == pytest.approx(ours / best_arc)
    # Level 1 skips the sign model: the same decoder, a payload no smaller than level 2's.
    assert ours <= methods["delta_swap@1"]["payload_pct"] < methods["delta_swap_v1"]["payload_pct"]


def test_the_printed_table_has_a_row_per_method_and_the_entropies(report) -> None:
    _, stdout = report
    assert "smoke" in stdout and "entropy: order-0" in stdout
    for name in codec_bench.DEFAULT_METHODS:
        assert f" {name} " in stdout, name


def test_the_context_study_measures_against_real_v2_payloads(tmp_path, monkeypatch) -> None:
    """context_entropy end to end on the smoke corpus: every saving is a fraction of the real v2
    payload of the same tensors."""
    from benchmarks import context_entropy, rl_corpus

    monkeypatch.setenv("DELTA_SWAP_CACHE", str(tmp_path))
    config, lrs = rl_corpus.CORPORA["smoke"]
    (checkpoints,) = rl_corpus.rl_checkpoints(lrs, 3, config).values()
    r = context_entropy.measure(checkpoints)
    assert r["v2_payload"] > 8 * 10_000
    for lever in ("rows", "previous", "both", "signs", "values"):
        assert abs(r[lever]) < r["v2_payload"], lever


def test_the_context_study_groups_rows_only_where_it_pays() -> None:
    """Rows changing at two very different rates get groups (and save bits); rows that all change
    at one rate do not (the 3 bits per row would be lost)."""
    import numpy as np

    from benchmarks import context_entropy

    rng = np.random.default_rng(0)
    shape = (256, 512)
    exp = np.full(shape[0] * shape[1], 120)
    rates = np.repeat(np.where(np.arange(shape[0]) % 2 == 0, 0.3, 0.01), shape[1])
    mixed = rng.random(exp.size) < rates
    group, g, side = context_entropy._row_groups(exp, mixed, shape)
    assert g > 1 and side == shape[0] * np.log2(g)
    grouped = context_entropy._class_bits(exp * g + group, mixed) + side
    assert grouped < 0.8 * context_entropy._class_bits(exp, mixed)
    uniform = rng.random(exp.size) < 0.05
    assert context_entropy._row_groups(exp, uniform, shape)[1] == 1
    # the same rates by column: grouped as columns, not as rows
    by_column = np.tile(np.where(np.arange(shape[1]) % 2 == 0, 0.3, 0.01), shape[0])
    mixed = rng.random(exp.size) < by_column
    group, g, side = context_entropy._row_groups(exp, mixed, shape, axis=0)
    assert g > 1 and side == shape[1] * np.log2(g) and np.array_equal(group[: shape[1]], group[shape[1] : 2 * shape[1]])
    assert context_entropy._row_groups(exp, mixed, shape)[1] == 1


def test_the_context_study_credits_values_only_when_the_previous_step_tells_something() -> None:
    """Steps that repeat the previous step's direction save about a bit each; steps whose signs
    are drawn afresh every time save nothing (the study then keeps v2's coding)."""
    import numpy as np
    import torch

    from benchmarks import context_entropy
    from delta_swap.codec import v1

    rng = np.random.default_rng(1)
    start = torch.randn(256, 512).to(torch.bfloat16)
    keys = context_entropy.bf16_keys(start.view(torch.int16).numpy().view(np.uint16))
    moving = rng.random(keys.shape) < 0.2

    def chain(directions: list[np.ndarray]) -> list[dict[str, torch.Tensor]]:
        out, k = [], keys.copy()
        for d in [np.zeros_like(keys)] + directions:
            k = k + np.where(moving, d, 0)
            bits = v1._ordered_unkey(k.astype(np.uint16), 16)
            out.append({"w": torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)})
        return out

    same = np.where(rng.random(keys.shape) < 0.5, 1, -1)
    repeated = context_entropy.measure(chain([same, same]))
    fresh = context_entropy.measure(chain([np.where(rng.random(keys.shape) < 0.5, 1, -1) for _ in range(2)]))
    changes = int(moving.sum())
    assert repeated["values"] > 0.8 * changes
    assert fresh["values"] < 0.02 * changes


def test_the_values_prototype_round_trips_and_never_costs_more_than_v2(tmp_path, monkeypatch) -> None:
    """benchmarks/values_prototype on the smoke corpus: both decoders rebuild every tensor
    bit-exact (checked inside), and a tensor keeps v2's values where the prototype's are larger."""
    from benchmarks import rl_corpus, values_prototype

    monkeypatch.setenv("DELTA_SWAP_CACHE", str(tmp_path))
    config, lrs = rl_corpus.CORPORA["smoke"]
    (checkpoints,) = rl_corpus.rl_checkpoints(lrs, 3, config).values()
    r = values_prototype.measure(checkpoints)
    assert 0 < r["v2_values"] < r["v2_payload"]
    assert 0 < r["before"] <= r["v2_values"] and 0 < r["bits"] <= r["v2_values"]
    assert r["elements"] > 0 and r["before_seconds"] > 0 and r["bits_seconds"] > 0
