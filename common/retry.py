"""Retries with exponential backoff and full jitter for flaky networks and stores."""

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
