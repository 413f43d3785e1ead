"""Retries with exponential backoff: full jitter for flaky networks and stores, and the poller's
wait before it tries again an update that failed."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import StoreError, TransientError

T = TypeVar("T")
log = logging.getLogger("delta_swap.retry")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a store operation is retried."""

    attempts: int = 6
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0
    #: Per-request timeout (connect + read of one response).
    timeout_s: float = 30.0

    def delay(self, attempt: int) -> float:
        """Full-jitter backoff before retry number ``attempt`` (1-based)."""
        return random.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1)))


@dataclass
class UpdateBackoff:
    """When a server tries again an update that failed (a swap its engine refused, a snapshot it
    could not verify): after ``first_s``, then twice as long at each failure of the same snapshot,
    up to ``max_s``; a new snapshot is tried at once. Without it, an update that fails every time
    is rebuilt at every poll, taking the cores generation needs (a shadow build of every changed
    module each time)."""

    first_s: float
    max_s: float = 60.0
    snapshot_id: str | None = None
    failures: int = 0
    not_before: float = 0.0  # time.monotonic() seconds

    def failed(self, snapshot_id: str, now: float) -> None:
        """The update to ``snapshot_id`` failed at ``now``."""
        self.failures = self.failures + 1 if snapshot_id == self.snapshot_id else 1
        self.snapshot_id = snapshot_id
        self.not_before = now + min(self.max_s, self.first_s * 2 ** min(self.failures - 1, 32))

    def wait_s(self, snapshot_id: str, now: float) -> float:
        """Seconds until an update to ``snapshot_id`` may be tried again (0: now)."""
        return max(0.0, self.not_before - now) if snapshot_id == self.snapshot_id else 0.0

    def reset(self) -> None:
        """Forget the failures (an update succeeded, or the next try must not wait)."""
        self.snapshot_id, self.failures, self.not_before = None, 0, 0.0


async def retry(
    op: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    what: str,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Run ``op`` until it succeeds, raising the last error after ``policy.attempts`` tries.

    Only :class:`TransientError` and timeouts are retried; anything else propagates at once.
    """
    for attempt in range(1, policy.attempts + 1):
        try:
            return await asyncio.wait_for(op(), policy.timeout_s)
        except (TransientError, asyncio.TimeoutError) as exc:
            if attempt == policy.attempts:
                raise StoreError(f"{what} failed after {attempt} attempts: {exc!r}") from exc
            if on_retry:
                on_retry(exc)
            delay = policy.delay(attempt)
            log.debug("%s failed (%s); retry %d in %.2fs", what, exc, attempt, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
