"""CI-sized run of benchmarks/verify_cost.py: the 3M model, two updates, with the read-back on
every swap and with none."""

from __future__ import annotations

import pytest

from benchmarks import verify_cost

pytestmark = pytest.mark.engine


def test_verify_cost_measures_both_policies_side_by_side(tmp_path) -> None:
    # "auto" (the default) is left to test_vllm_verify.py: one server fewer in the default run.
    rows = [verify_cost.measure("3M", tmp_path, 2, verify) for verify in ("always", "never")]
    on, off = rows
    assert on["path"] == off["path"] == "reload"
    assert on["check"] > 0 and off["check"] == 0  # the workers' read-back ran only where asked
    assert on["verified"] == 3 and off["verified"] == 0  # base sync + 2 updates
    assert on["window"] > on["check"] and off["window"] > 0
    lines = verify_cost.table(rows)
    assert "avx512_bf16=" in lines[0] and lines[2].split()[0] == "3M"
