"""When to read back a swap under ``verify_swaps=auto``: as often as keeps the read-backs within a
share of the swap windows, on average.

The read-back's cost is bounded per module while a reload's window grows with the bytes moved, so
on real models every swap is checked; on a tiny model (or a tiny delta) whose check costs more
than the share of its window, every k-th swap is, with k the smallest that keeps the average.
"""

from __future__ import annotations

from dataclasses import dataclass

from .settings import VERIFY_SHARE, VerifySwaps


@dataclass
class VerifyBudget:
    """Credit in seconds: each swap earns ``share`` of its window, each check spends its cost."""

    policy: VerifySwaps = VerifySwaps.AUTO
    share: float = VERIFY_SHARE
    credit: float = 0.0
    #: What the last check cost (seconds): the next one is due once the credit covers it.
    last_cost: float = 0.0
    verified: int = 0
    unverified: int = 0

    def due(self) -> bool:
        """Whether the swap about to run is read back."""
        if self.policy is VerifySwaps.ALWAYS:
            return True
        if self.policy is VerifySwaps.NEVER:
            return False
        return self.credit >= self.last_cost

    def record(self, window_s: float, check_s: float | None) -> None:
        """Account one swap: its window without the check, and the check's cost (None: not checked)."""
        self.credit += self.share * window_s
        if check_s is None:
            self.unverified += 1
        else:
            self.verified += 1
            self.credit -= check_s
            self.last_cost = check_s

    def describe(self) -> dict[str, object]:
        """For the status: the policy and how many swaps were read back."""
        return {"policy": self.policy.value, "verified_swaps": self.verified, "unverified_swaps": self.unverified}
