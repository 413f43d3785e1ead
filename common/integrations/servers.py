"""What a trainer asks the servers it feeds: the step each serves, and waiting for a step.

Every delta-swap server answers ``GET /delta_swap/status`` with the step it serves
(``current_step``) and why it holds an older one (``last_error``); a trainer with a staleness bound
waits on that before its next step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def server_status(url: str) -> dict[str, Any] | None:
    """A delta-swap server's ``/delta_swap/status`` (None: unreachable, or not a delta-swap server)."""
    import httpx

    try:
        response = httpx.get(f"{url.rstrip('/')}/delta_swap/status", timeout=10)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def notify_urls(urls: Iterable[str]) -> tuple[str, ...]:
    """Each server's ``/delta_swap/notify`` route, which a publisher POSTs after each commit
    (``PublisherConfig.notify_urls``)."""
    return tuple(f"{url.rstrip('/')}/delta_swap/notify" for url in urls)


def served_steps(urls: Sequence[str]) -> list[int | None]:
    """The step each server serves now (None: nothing yet, or unreachable)."""
    return [(server_status(url) or {}).get("current_step") for url in urls]


def wait_for_servers(
    urls: Sequence[str], step: int, timeout_s: float = 300.0, *, before_timeout: Callable[[], None] | None = None
) -> None:
    """Wait until every server serves ``step`` or a later one. On timeout, ``before_timeout`` runs
    first (a publisher's ``flush``, whose error explains the wait best), then TimeoutError names
    what each server serves and its last error."""
    deadline = time.monotonic() + timeout_s
    statuses: list[dict[str, Any] | None] = []
    while True:
        statuses = [server_status(url) for url in urls]
        if all(s is not None and s.get("current_step") is not None and s["current_step"] >= step for s in statuses):
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if before_timeout is not None:
        before_timeout()
    where = "; ".join(
        f"{url} serves step {s.get('current_step')} (last error: {s.get('last_error')})" if s else f"{url} unreachable"
        for url, s in zip(urls, statuses)
    )
    raise TimeoutError(f"the servers did not reach step {step} in {timeout_s:.0f}s: {where}")
