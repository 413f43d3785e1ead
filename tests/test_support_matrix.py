"""benchmarks/support_matrix.py on a small synthetic record file (no engine)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import support_matrix
from delta_swap.testing.engine_exactness import MATRIX_OUT_ENV, EngineExactnessTests

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx512_bf16\n"


def record(family: str, engine: str, path: str, **fields: object) -> dict[str, object]:
    cls = f"Test{family.title()}{path.title()}"
    return {
        "engine": engine,
        "family": family,
        "path": path,
        "taken": fields.pop("taken", path),
        "layout": fields.pop("layout", ""),
        "test": f"tests/test_{engine}_exactness.py::{cls}::test_every_partial_delta_serves_what_a_fresh_server_serves",
        "time": "2026-12-02T16:00:00Z",
        **fields,
    }


RECORDS = [
    record("qwen3_moe", "sglang", "arena", skipped="sglang cannot swap qwen3_moe by reference here: experts"),
    record("qwen2", "sglang", "reload", taken="tensor", step=1, exact=True, window_s=0.010),
    record("qwen2", "sglang", "reload", taken="tensor", step=2, exact=True, window_s=0.020),
    record("qwen2", "sglang", "reload", taken="tensor", step=3, exact=True, window_s=0.050),
    record("llama", "vllm", "arena", step=1, exact=False, max_difference=0.25, window_s=0.004),
    record("llama", "sglang", "reload", taken="tensor", step=1, exact=True, window_s=0.04),
    record("llama", "vllm", "reload", step=1, exact=True, window_s=0.07),
    record("qwen3", "vllm", "reload", layout="--tensor-parallel-size 2", step=1, exact=True, window_s=0.1),
]


def rows(tmp_path, capsys) -> list[list[str]]:
    file = tmp_path / "matrix.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + "\n")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    support_matrix.main([str(file), "--cpuinfo", str(cpuinfo)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Measured 2026-12-02; CPU: amx_bf16=no avx512_bf16=yes."), out[0]
    assert out[2].startswith("| family | engine | layout | path |"), out
    return [[c.strip() for c in line.strip("|").split("|")] for line in out[4:]]


def test_the_matrix_has_one_row_per_cell_in_family_order_with_results_and_median_windows(tmp_path, capsys) -> None:
    table = rows(tmp_path, capsys)
    assert [r[:4] for r in table] == [  # families in order, vLLM before SGLang, the engine's loader before arena
        ["Llama", "vLLM", "-", "reload"],
        ["Llama", "vLLM", "-", "arena"],
        ["Llama", "SGLang", "-", "reload (tensor)"],
        ["Qwen2 (biases)", "SGLang", "-", "reload (tensor)"],
        ["Qwen3 (tied)", "vLLM", "`--tensor-parallel-size 2`", "reload"],
        ["Qwen3-MoE", "SGLang", "-", "arena"],
    ]
    llama, qwen2, qwen3, moe = table[1], *table[3:]
    assert llama[4] == "INEXACT: step 1 (max diff 0.25) of 1 swap" and llama[5] == "4.0"
    assert qwen2[4] == "exact (3 swaps)" and qwen2[5] == "20.0"  # the median, not the mean or the last
    assert qwen2[6] == "`tests/test_sglang_exactness.py::TestQwen2Reload`"
    assert qwen3[4] == "exact (1 swap)" and qwen3[5] == "100.0"
    assert moe[4] == "skipped: sglang cannot swap qwen3_moe by reference here: experts" and moe[5] == "-"


def test_the_suite_appends_one_record_per_swap_only_when_asked(tmp_path, monkeypatch) -> None:
    """What the exactness suite writes is what the script reads: the window is pause + swap + resume."""
    suite = type("TestQwen2Tp2", (EngineExactnessTests,), {"family": "qwen2", "extra": ("--tp-size", "2")})()
    request = SimpleNamespace(node=SimpleNamespace(nodeid="tests/t.py::TestQwen2Tp2::test_x"))
    st = {
        "engine": "sglang",
        "swap_path": "tensor",
        "last_update_timings_s": {"fetch": 1.0, "stage": 2.0, "pause": 0.001, "swap": 0.01, "resume": 0.002},
    }
    out = tmp_path / "matrix.jsonl"
    monkeypatch.delenv(MATRIX_OUT_ENV, raising=False)
    suite._record(request, st, step=1, exact=True)  # type: ignore[arg-type]
    assert not out.exists()
    monkeypatch.setenv(MATRIX_OUT_ENV, str(out))
    suite._record(request, st, step=1, exact=True)  # type: ignore[arg-type]
    suite._record(request, st, skipped="no arena")  # type: ignore[arg-type]
    swap, skip = support_matrix.read_records(out.read_text().splitlines())
    assert swap["window_s"] == pytest.approx(0.013) and swap["layout"] == "--tp-size 2" and swap["taken"] == "tensor"
    assert (swap["engine"], swap["family"], swap["path"], swap["exact"]) == ("sglang", "qwen2", "auto", True)
    assert skip["skipped"] == "no arena" and skip["window_s"] is None
    (cell,) = support_matrix.cells([swap, skip])
    assert cell.result() == "exact (1 swap)" and cell.tests == {"tests/t.py::TestQwen2Tp2"}
