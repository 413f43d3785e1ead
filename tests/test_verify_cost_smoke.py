"""CI-sized run of benchmarks/verify_cost.py: the 3M model, two updates, under each policy."""

from __future__ import annotations

import pytest

from benchmarks import verify_cost

pytestmark = pytest.mark.engine


def test_verify_cost_measures_every_policy_side_by_side(tmp_path) -> None:
    rows = [verify_cost.measure("3M", tmp_path, 2, verify) for verify in verify_cost.POLICIES]
    on, off, auto = rows
    assert on["path"] == off["path"] == auto["path"] == "reload"
    assert on["check"] > 0 and off["check"] == 0  # the workers' read-back ran only where asked
    assert on["verified"] == 3 and off["verified"] == 0 and auto["verified"] >= 1  # base sync + 2 updates
    assert on["window"] > on["check"] and off["window"] > 0
    lines = verify_cost.table(rows)
    assert "avx512_bf16=" in lines[0] and lines[2].split()[0] == "3M"
