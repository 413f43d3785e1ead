"""verify_swaps: which swaps are read back, and what that costs on average."""

from __future__ import annotations

import pytest

from delta_swap.errors import ConfigError
from delta_swap.settings import Settings, VerifySwaps
from delta_swap.verify_budget import VerifyBudget


def _run(budget: VerifyBudget, swaps: int, window_s: float, check_s: float) -> float:
    """Run ``swaps`` swaps; the share of the total window that the checks added."""
    spent = 0.0
    for _ in range(swaps):
        checked = budget.due()
        budget.record(window_s, check_s if checked else None)
        spent += check_s if checked else 0.0
    return spent / (swaps * window_s)


def test_auto_reads_back_every_swap_where_the_check_is_cheap() -> None:
    budget = VerifyBudget()
    assert budget.policy is VerifySwaps.AUTO and Settings().verify_swaps is VerifySwaps.AUTO
    _run(budget, 50, window_s=2.0, check_s=0.05)  # a real model: a 2 s reload, a 50 ms check
    assert budget.describe() == {"policy": "auto", "verified_swaps": 50, "unverified_swaps": 0}


def test_auto_keeps_an_expensive_check_within_a_tenth_of_the_windows() -> None:
    budget = VerifyBudget()
    overhead = _run(budget, 200, window_s=0.1, check_s=0.05)  # a tiny model: the check is half the window
    assert 0.08 <= overhead <= 0.11, overhead
    assert budget.verified >= 30 and budget.unverified > 0
    assert budget.due() is (budget.credit >= budget.last_cost)


def test_always_and_never_ignore_the_cost() -> None:
    assert _run(VerifyBudget(VerifySwaps.ALWAYS), 10, window_s=0.1, check_s=1.0) == pytest.approx(10.0)
    assert _run(VerifyBudget(VerifySwaps.NEVER), 10, window_s=0.1, check_s=0.001) == 0.0


@pytest.mark.parametrize(
    ("value", "policy"),
    [("auto", "auto"), ("always", "always"), ("never", "never"), ("1", "always"), ("true", "always"), ("0", "never")],
)
def test_the_setting_takes_its_names_and_the_old_booleans(value, policy) -> None:
    assert Settings.load(env={"DELTA_SWAP_VERIFY_SWAPS": value}).verify_swaps.value == policy


def test_a_bad_policy_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="DELTA_SWAP_VERIFY_SWAPS"):
        Settings.load(env={"DELTA_SWAP_VERIFY_SWAPS": "sometimes"})
