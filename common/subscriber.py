"""The rollout side: follow a store's chain and hand verified snapshots to an engine adapter.

One :class:`Subscriber` runs per server (in the process that talks to the engine), so the
host-memory copy of the current weights that deltas apply to exists once, not once per worker.
It polls the head pointer, plans a path from the current snapshot to the newest (consecutive
deltas, or the nearest base when the chain is broken or replaying would cost more), fetches and
decodes off the event loop while the engine keeps generating, verifies every checksum, stages
the complete next state, and only then calls the adapter. Any failure leaves the engine on the
last good snapshot and is reported in :meth:`Subscriber.status`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from .chain import ChainReader
from .engine_adapter import EngineAdapter, StagedSnapshot
from .errors import ChainError, DeltaSwapError
from .manifest import Manifest
from .metrics import failure_kind, subscriber_metrics
from .rebuild import replay
from .stores import Store, open_store
from .tensors import StateDict

log = logging.getLogger("delta_swap.subscriber")


@dataclass(frozen=True)
class SubscriberConfig:
    """Where to pull from and how eagerly."""

    store_url: str
    poll_interval_s: float = 2.0
    fetch_concurrency: int = 4
    #: Replay deltas from the current snapshot while their bytes stay below this many times the
    #: bytes of loading the target's base and its deltas; otherwise reload from the base.
    replay_cost_ratio: float = 1.0


class Subscriber:
    """Keeps one engine on the newest snapshot of a store."""

    def __init__(self, config: SubscriberConfig, adapter: EngineAdapter, store: Store | None = None) -> None:
        self.config = config
        self.adapter = adapter
        self._store = store
        self._reader: ChainReader | None = None
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._state: StateDict | None = None
        self._current: Manifest | None = None
        self._newest: Manifest | None = None
        self._staged_id: str | None = None
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._last_timings: dict[str, float] = {}
        self._last_path: list[str] = []
        self._updates = 0
        self._failures = 0
        self._metrics = subscriber_metrics()

    @property
    def reader(self) -> ChainReader:
        if self._reader is None:
            if self._store is None:
                self._store = open_store(self.config.store_url, create=True)
            self._reader = ChainReader(self._store)
        return self._reader

    @property
    def current(self) -> Manifest | None:
        """The snapshot the engine is serving (None before the first sync)."""
        return self._current

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start polling in the background on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll_forever(), name="delta-swap-subscriber")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._store is not None:
            await self._store.close()

    def wake(self) -> None:
        """Poll now instead of at the next interval (a push notification)."""
        self._wake.set()

    async def _poll_forever(self) -> None:
        while True:
            await self.sync()
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.poll_interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    # ------------------------------------------------------------------ updates

    async def sync(self, *, force_base: bool = False) -> bool:
        """Move the engine to the newest snapshot if it is not there; True if it swapped.

        With ``force_base`` (a resync) the newest base and its deltas are reloaded even if the
        current chain looks fine. Never raises for store or data errors: they land in status().
        """
        async with self._lock:
            try:
                return await self._sync(force_base)
            except (DeltaSwapError, OSError, asyncio.TimeoutError) as exc:
                self._record_error(exc)
                return False
            except Exception as exc:  # an engine adapter failing must not kill the poller
                log.exception("delta-swap update failed")
                self._record_error(exc)
                return False
            finally:
                self._staged_id = None
                self.status()  # refreshes the exported gauges

    async def resync(self) -> bool:
        """Reload the newest full base and replay its deltas."""
        return await self.sync(force_base=True)

    def _record_error(self, exc: BaseException) -> None:
        self._metrics.failures.labels(failure_kind(exc)).inc()
        self._failures += 1
        self._last_error = f"{type(exc).__name__}: {exc}"
        self._last_error_at = time.time()
        log.warning("delta-swap: staying on %s: %s", self._current and self._current.snapshot_id, self._last_error)

    async def _sync(self, force_base: bool) -> bool:
        head = await self.reader.head()
        if head is None:
            return False
        newest = await self.reader.manifest(head.snapshot_id)
        if self._newest is None or newest.step >= self._newest.step:
            self._newest = newest
        if not force_base and self._current is not None and newest.step <= self._current.step:
            return False
        path = await self._plan(newest, force_base)
        timings: dict[str, float] = {"fetch": 0.0, "decode": 0.0, "verify": 0.0}
        state = await replay(self.reader.store, path, None if path[0].kind == "base" else self._state,
                             concurrency=self.config.fetch_concurrency, timings=timings,
                             progress=self._metrics.bytes_fetched.inc)
        target = path[-1]
        staged = StagedSnapshot(target, state, self._changed(target), self._state, dict(timings))
        self._staged_id = target.snapshot_id
        timings.update(await self.adapter.swap(staged))
        self._state, self._current = state, target
        self._last_timings = timings
        self._last_path = [m.snapshot_id for m in path]
        self._updates += 1
        self._metrics.updates.inc()
        for phase, seconds in timings.items():
            self._metrics.phase_seconds.labels(phase).observe(seconds)
        self._last_error = None
        log.info("delta-swap: now serving %s (step %d): %s", target.snapshot_id, target.step,
                 ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items()))
        return True

    def _changed(self, target: Manifest) -> tuple[str, ...]:
        if self._current is None:
            return tuple(t.name for t in target.tensors)
        before = {t.name: t.checksum for t in self._current.tensors}
        return tuple(t.name for t in target.tensors if before.get(t.name) != t.checksum)

    async def _plan(self, newest: Manifest, force_base: bool) -> list[Manifest]:
        """Snapshots to apply, oldest first, ending at the newest reachable one."""
        current_id = None if force_base or self._current is None else self._current.snapshot_id
        candidates = [newest]
        last_error: ChainError | None = None
        while candidates:
            target = candidates.pop(0)
            try:
                path = await self.reader.path_to(target.snapshot_id, current_id)
                if path and path[0].kind == "delta" and len(path) > 1:
                    from_base = await self.reader.path_to(target.snapshot_id, None)
                    if _payload(path) > self.config.replay_cost_ratio * _payload(from_base):
                        path = from_base
                if path:
                    return path
            except ChainError as exc:
                last_error = exc
                if not candidates and target is newest:
                    # Broken chain: fall back to the newest snapshot that can still be reached.
                    floor = -1 if current_id is None else self._current.step
                    older = [m for m in await self.reader.list() if floor < m.step < newest.step]
                    candidates = sorted(older, key=lambda m: -m.step)
        raise last_error or ChainError(f"no path to {newest.snapshot_id}")

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """A JSON-ready summary for the admin route."""
        cur, newest = self._current, self._newest
        behind = 0 if newest is None or cur is None else max(0, newest.step - cur.step)
        stale_s = 0.0
        if newest is not None and (cur is None or newest.step > cur.step):
            stale_s = max(0.0, time.time() - newest.created_at)
        self._export(behind, stale_s)
        return {
            "store": self.config.store_url,
            "current_snapshot_id": cur and cur.snapshot_id,
            "current_step": cur and cur.step,
            "newest_snapshot_id": newest and newest.snapshot_id,
            "newest_step": newest and newest.step,
            "staleness_steps": behind if cur is not None else None,
            "staleness_seconds": round(stale_s, 3),
            "staged_snapshot_id": self._staged_id,
            "last_error": self._last_error,
            "last_error_at": self._last_error_at,
            "last_update_timings_s": {k: round(v, 6) for k, v in self._last_timings.items()},
            "last_update_path": self._last_path,
            "updates_applied": self._updates,
            "failures": self._failures,
        }

    def _export(self, behind: int, stale_s: float) -> None:
        m = self._metrics
        if self._current is not None:
            m.current_step.set(self._current.step)
        if self._newest is not None:
            m.newest_step.set(self._newest.step)
        m.staleness_steps.set(behind)
        m.staleness_seconds.set(stale_s)


def _payload(path: list[Manifest]) -> int:
    return sum(m.payload_bytes for m in path)
