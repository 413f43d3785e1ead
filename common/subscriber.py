"""The rollout side: follow a store's chain and put each verified snapshot into an engine.

One :class:`Subscriber` runs per server (in the process that talks to the engine), so the
host-memory copy of the current weights that deltas apply to exists once, not once per worker.
It polls the head pointer, plans a path from the current snapshot to the newest (consecutive
deltas, or the nearest base when the chain is broken or replaying would cost more), checks the
target against the served model, fetches and decodes off the event loop while the engine keeps
generating, verifies every checksum, and only then hands a :class:`WeightUpdate` to
:func:`~delta_swap.swap.apply_update`. Any failure leaves the engine on the last good snapshot
and is reported in :meth:`Subscriber.status`.

It never goes back: a snapshot of another run, or older than the one it serves (or, after a
restart, than the one it last verified, kept in ``Settings.freshness_file``), is refused unless an
operator resyncs with ``allow_older``. Each poll also reads the trainer's heartbeat, so a HEAD
held back by the store shows as staleness (``published_step_seen``, ``trainer_seen_seconds``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path
from typing import Any

from . import codec_warm_up, freshness
from .chain import ChainReader
from .engine_adapter import EngineAdapter, WeightUpdate
from .errors import ChainError, ConfigError, DeltaSwapError, EngineStateUnknownError
from .heartbeat import Heartbeat, HeartbeatReader
from .host_copy import HostCopy
from .manifest import Encoding, Manifest, SnapshotKind
from .metrics import failure_kind, subscriber_metrics
from .rebuild import Meter, replay
from .retry import UpdateBackoff
from .settings import Settings
from .signing import TrustedKeys, split_paths
from .stores import Store, open_store
from .stores.base import public_url
from .swap import apply_update
from .tensors import StateDict, TensorSpecs

log = logging.getLogger("delta_swap.subscriber")


class Subscriber:
    """Keeps one engine on the newest snapshot of a store."""

    def __init__(self, settings: Settings, adapter: EngineAdapter, store: Store | None = None) -> None:
        if not settings.store and store is None:
            raise ConfigError("a subscriber needs a store")
        self.settings = settings
        self.adapter = adapter
        self._store = store
        self._trusted = TrustedKeys.load(split_paths(settings.trusted_key)) if settings.trusted_key else None
        self._reader: ChainReader | None = None
        self._lock = asyncio.Lock()
        self._resyncing = False
        self._last_resync: dict[str, Any] | None = None
        self._phase: str | None = None
        self._phase_since: float | None = None  # time.monotonic() when the phase began
        self._sync_since: float | None = None  # ... and when the sync under way began
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        #: Decoded weights (None when unknown: the next update is a base), and the snapshot they hold:
        #: the one served, or after a failed swap whose update was decoded over them, that update.
        self._state: StateDict | None = None
        self._held: Manifest | None = None
        self._host_copy: HostCopy | None = None  # for an engine that copies updates
        self._state_in_copy = False  # whether _state's tensors live in it (and are decoded over)
        self._current: Manifest | None = None
        self._current_since: float | None = None  # time.time() when the engine began serving it
        self._newest: Manifest | None = None
        self._staged_id: str | None = None
        self._last_error: str | None = None  # the failure not yet followed by an update that succeeded
        #: The most recent failure (error, kind, at), kept after a later update succeeds.
        self._last_failure: dict[str, Any] | None = None
        self._last_timings: dict[str, float] = {}
        self._last_path: list[str] = []
        self._updates = 0
        self._paused_total = 0.0
        self._failures = 0
        self._backoff = UpdateBackoff(first_s=settings.poll_interval)
        self._attempt: str | None = None  # the snapshot the sync under way moves to, once known
        self._metrics = subscriber_metrics()
        self._seen: freshness.Seen | None = None  # the record of the newest snapshot verified before
        self._seen_loaded = False
        self._heartbeats: HeartbeatReader | None = None
        self._heartbeat: Heartbeat | None = None
        self._heartbeat_error: str | None = None

    @property
    def reader(self) -> ChainReader:
        if self._reader is None:
            if self._store is None:
                assert self.settings.store
                self._store = open_store(self.settings.store, create=True)
            self._reader = ChainReader(
                self._store, self._trusted, expected_tensors=len(self.adapter.served.specs) or None
            )
        return self._reader

    @property
    def freshness_file(self) -> Path:
        """Where this server records the newest snapshot it verified."""
        if self.settings.freshness_file:
            return Path(self.settings.freshness_file)
        store = self._store.url if self._store is not None else self.settings.store
        assert store
        return freshness.record_path(self.settings.staging_dir, public_url(store))

    @property
    def resync_running(self) -> bool:
        """True while a resync is fetching or swapping (another one is refused meanwhile)."""
        return self._resyncing

    @property
    def current(self) -> Manifest | None:
        """The snapshot the engine is serving (None before the first sync)."""
        return self._current

    @property
    def served_snapshot_id(self) -> str | None:
        """The id of :attr:`current` (None before the first sync)."""
        return self._current.snapshot_id if self._current is not None else None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start polling in the background on the running event loop. The codec's compiled
        kernels are loaded after the first sync (:meth:`_poll_forever`), so the first delta does
        not wait for the JIT and a compile's memory never adds to the first sync's."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll_forever(), name="delta-swap-subscriber")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._store is not None:
            await self._store.close()
        await self.adapter.close()
        if self._host_copy is not None:
            self._host_copy.close()
            self._host_copy = None

    def wake(self) -> None:
        """Poll now instead of at the next interval (a push notification)."""
        self._wake.set()

    async def _poll_forever(self) -> None:
        # The flag, not only the cancellation, ends the loop: on Python < 3.12, asyncio.wait_for
        # swallows a cancellation that arrives just as the wake event fires (CPython gh-86296),
        # and stop() would then wait for a whole poll interval.
        while not self._stopping:
            polled = time.monotonic()
            await self.sync(backoff=True)
            codec_warm_up.start_warm_up(encoder=False)  # once per process
            try:
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_interval)
            except asyncio.TimeoutError:
                pass
            else:  # a notify: at most one poll per notify_interval; notifies meanwhile fold into it
                await asyncio.sleep(max(0.0, polled + self.settings.notify_interval - time.monotonic()))
            self._wake.clear()

    # ------------------------------------------------------------------ updates

    async def sync(self, *, force_base: bool = False, allow_older: bool = False, backoff: bool = False) -> bool:
        """Move the engine to the newest snapshot if it is not there; True if it swapped.

        With ``force_base`` (a resync) the newest base and its deltas are reloaded even if the
        current chain looks fine; that never moves the engine to an older step unless
        ``allow_older``. With ``backoff`` (the poller), a snapshot whose update failed is tried
        again only once its :class:`~delta_swap.retry.UpdateBackoff` ends. Never raises for store,
        data or engine errors: they land in :meth:`status`.
        """
        async with self._lock:
            try:
                swapped = await self._sync(force_base, allow_older, backoff)
                if swapped:
                    self._backoff.reset()
                return swapped
            except EngineStateUnknownError as exc:
                self._record_error(exc)
                self._backoff.reset()  # the repair (every tensor reloaded) is tried at the next poll
                self._current = self._state = self._held = self._current_since = None  # reload every tensor next
                return False
            except (DeltaSwapError, OSError, asyncio.TimeoutError) as exc:
                self._record_error(exc)
                return False
            except Exception as exc:  # a bug must not kill the poller
                log.exception("delta-swap update failed")
                self._record_error(exc)
                return False
            finally:
                self._staged_id = self._phase = self._phase_since = self._sync_since = self._attempt = None
                self._export_metrics()

    async def resync(self, *, allow_older: bool = False) -> bool:
        """Reload the newest full base and replay its deltas (one resync at a time: callers
        check :attr:`resync_running` first)."""
        before = self._current and self._current.step
        self._resyncing = True
        try:
            ok = await self.sync(force_base=True, allow_older=allow_older)
        finally:
            self._resyncing = False
        self._last_resync = {
            "at": time.time(),
            "ok": ok,
            "from_step": before,
            "to_step": self._current and self._current.step,
            "allow_older": allow_older,
        }
        return ok

    def _record_error(self, exc: BaseException) -> None:
        if self._attempt is not None:  # tried again later, and later at each failure (UpdateBackoff)
            self._backoff.failed(self._attempt, time.monotonic())
        kind = failure_kind(exc)
        self._metrics.failures.labels(kind).inc()
        self._failures += 1
        self._last_error = f"{type(exc).__name__}: {self._public_message(exc)}"
        self._last_failure = {"error": self._last_error, "kind": kind, "at": time.time()}
        log.warning(
            "delta-swap: staying on %s: %s: %s",
            self._current and self._current.snapshot_id,
            type(exc).__name__,
            self._without_secrets(str(exc)),
        )

    def _without_secrets(self, text: str) -> str:
        """``text`` (for the server's log) without the store URL's credentials or the admin token."""
        store, token = self.settings.store, self.settings.admin_token
        if store:
            text = text.replace(store, public_url(store))
        return text.replace(token, "<redacted>") if token else text

    def _public_message(self, exc: BaseException) -> str:
        """The error's message as anyone reaching the status route may see it: the store's URL
        (which may carry credentials) and host paths are left out."""
        text = str(exc)
        for url in {self.settings.store, self._store and self._store.url, self._store and self._store.public_url}:
            if url:
                text = text.replace(url, "<store>")
        text = re.sub(r"[a-z][a-z0-9+.-]*://[^\s'\"]+", "<url>", text)
        text = re.sub(r"(?<![\w.-])/(?:[^\s/'\"]+/)+[^\s/'\"]*", "<path>", text)
        return text[:500]

    def _enter_phase(self, phase: str) -> None:
        self._phase, self._phase_since = phase, time.monotonic()

    async def _sync(self, force_base: bool, allow_older: bool = False, backoff: bool = False) -> bool:
        self._enter_phase("poll")
        self._sync_since = self._phase_since
        await self._read_heartbeat()
        head = await self.reader.head()
        if head is None:
            return False
        newest = await self.reader.manifest(head.snapshot_id)
        current = self._current
        seen = self._floor()
        if not allow_older and seen is not None and seen.run_id is not None and newest.run_id != seen.run_id:
            freshness.refuse_going_back(newest, seen, "this server", _OVERRIDE)
        if current is not None and newest.step - current.step > self.settings.max_step_jump:
            raise ChainError(
                f"newest snapshot {newest.snapshot_id} is {newest.step - current.step} steps ahead of "
                f"{current.snapshot_id}, more than max_step_jump={self.settings.max_step_jump}"
            )
        if self._newest is None or newest.step >= self._newest.step:
            self._newest = newest
        if not force_base and current is not None and newest.step <= current.step:
            return False
        path = await self._plan(newest, force_base)
        target = path[-1] if path else self._held  # no path: a failed swap's update, decoded already
        assert target is not None
        if backoff and self._backoff.wait_s(target.snapshot_id, time.monotonic()) > 0:
            return False  # it failed a moment ago: tried again once its backoff ends
        if not force_base:  # a resync that fails is not retried by the poller: nothing to wait for
            self._attempt = target.snapshot_id
        if not allow_older:
            freshness.refuse_going_back(target, seen, "this server", _OVERRIDE)
        self.adapter.served.check_fits(target.specs)  # before a byte is fetched
        timings: dict[str, float] = {"fetch": 0.0, "decode": 0.0, "verify": 0.0}
        log.info(
            "delta-swap: updating from %s to %s (%d snapshot(s) to fetch)",
            current and current.snapshot_id,
            target.snapshot_id,
            len(path),
        )
        self._enter_phase("fetch")  # fetch, decode and verify
        start = None if path and path[0].kind is SnapshotKind.BASE else self._state
        if any(t.encoding not in (Encoding.RAW, Encoding.SAME) for m in path for t in m.tensors):
            await asyncio.to_thread(codec_warm_up.start_warm_up(encoder=False).join)  # compiled before, not during
        out = await self.adapter.destination(target.specs)  # the engine's spare weights, if it has them
        copy = None if out is not None else await asyncio.to_thread(self._host_copy_for, target.specs)
        in_place = copy is not None and self._state_in_copy  # the served weights are decoded over
        meter, decoded = Meter(timings, self._metrics.bytes_fetched.inc), False
        try:
            if path:
                state = await replay(
                    self.reader,
                    path,
                    start,
                    concurrency=self.settings.fetch_concurrency,
                    meter=meter,
                    max_model_bytes=self._max_model_bytes(),
                    out=copy.state if copy is not None else out,
                )
            else:
                assert start is not None
                state = start
            decoded = True
            update = WeightUpdate(
                version=target.snapshot_id,
                state=state,
                names=self._changed(target),
                previous=None if in_place else self._state,
                checksums={t.name: t.checksum for t in target.tensors},
                state_file=copy.path if copy is not None else None,
            )
            self._staged_id = target.snapshot_id
            restore = self._served_weights if in_place and current is not None else None
            timings.update(
                await apply_update(self.adapter, update, self.settings, on_phase=self._enter_phase, restore=restore)
            )
        except BaseException:
            if in_place and decoded:  # the copy holds the update, verified: a retry fetches nothing
                self._state, self._held = state, target
            elif in_place and meter.wrote_out:
                self._state = self._held = None
                log.warning("delta-swap: the copy of the weights holds no verified snapshot: the next update is a base")
            raise
        self._state_in_copy = copy is not None
        self._state, self._held, self._current = state, target, target
        # served since the engine resumed: the drop of what was staged (vLLM: an RPC) came after
        self._current_since = time.time() - timings.get("unstage", 0.0)
        self._remember(target)
        self._last_timings = timings
        self._last_path = [m.snapshot_id for m in path]
        self._updates += 1
        self._paused_total += sum(timings.get(p, 0.0) for p in ("pause", "swap", "resume"))
        self._metrics.updates.inc()
        for phase, seconds in timings.items():
            self._metrics.phase_seconds.labels(phase).observe(seconds)
        self._last_error = None
        log.info(
            "delta-swap: now serving %s (step %d) via the %s path: %s",
            target.snapshot_id,
            target.step,
            await self._swap_path(),
            ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items()),
        )
        return True

    def _floor(self) -> freshness.Seen | None:
        """What this server must not go back from: the snapshot it serves, or after a restart the
        one it recorded last."""
        if self._current is not None:
            return freshness.Seen.of(self._current)
        if not self._seen_loaded:
            self._seen, self._seen_loaded = freshness.load_record(self.freshness_file), True
        return self._seen

    def _remember(self, manifest: Manifest) -> None:
        """Record ``manifest`` as the newest verified snapshot (logged, never raised, on failure)."""
        self._seen, self._seen_loaded = freshness.Seen.of(manifest), True
        try:
            freshness.save_record(self.freshness_file, self._seen, public_url(self._store.url if self._store else ""))
        except OSError as exc:
            log.warning("delta-swap: cannot record the verified step in %s: %s", self.freshness_file, exc)

    async def _read_heartbeat(self) -> None:
        """Read the trainer's heartbeat; its errors land in the status, never fail the poll."""
        if self._heartbeats is None:
            self._heartbeats = HeartbeatReader(self.reader.store, self._trusted)
        try:
            beat = await self._heartbeats.read()
        except (DeltaSwapError, OSError, asyncio.TimeoutError) as exc:
            self._heartbeat_error = f"{type(exc).__name__}: {self._public_message(exc)}"
            return
        self._heartbeat_error = None
        if beat is None:
            return
        seen = self._floor()
        if seen is not None and seen.run_id is not None and beat.run_id != seen.run_id:
            self._heartbeat_error = f"the heartbeat names run {beat.run_id}, this server follows run {seen.run_id}"
            self._heartbeat = None
        elif self._heartbeat is None or beat.at >= self._heartbeat.at:  # a replayed older one is ignored
            self._heartbeat = beat

    async def _swap_path(self) -> str:
        """The adapter's swap path and why, for the log (``?`` when it cannot say)."""
        try:
            details = await self.adapter.describe()
        except Exception:
            return "?"
        reason = details.get("swap_path_reason")
        return f"{details.get('swap_path') or '?'}{f' ({reason})' if reason else ''}"

    def _max_model_bytes(self) -> int | None:
        if self.settings.max_model_bytes is not None:
            return self.settings.max_model_bytes
        return self.adapter.served.nbytes if self.adapter.served.specs else None

    def _changed(self, target: Manifest) -> tuple[str, ...]:
        if self._current is None:
            return tuple(t.name for t in target.tensors)
        before = {t.name: t.checksum for t in self._current.tensors}
        return tuple(t.name for t in target.tensors if before.get(t.name) != t.checksum)

    def _host_copy_for(self, specs: TensorSpecs) -> HostCopy | None:
        """The copy of the weights to decode ``specs`` into, for an engine that copies updates
        (None: the heap, for an engine that keeps references, or a staging folder without room)."""
        if not self.adapter.copies_updates:
            return None
        if self._host_copy is not None and self._host_copy.holds(specs):
            return self._host_copy
        if self._host_copy is not None:  # the state decoded so far keeps its pages until it goes
            self._host_copy.close()
            self._host_copy = None
        try:
            self._host_copy = HostCopy.create(self.settings.staging_dir, specs)
        except OSError as exc:
            log.warning(
                "delta-swap: no room for a copy of the weights in %s (%s): decoding into this process's memory",
                self.settings.staging_dir,
                exc,
            )
        return self._host_copy

    async def _served_weights(self) -> StateDict:
        """For a rollback: the weights of the snapshot the engine served before the update under
        way, rebuilt from the store (the copy holds the update's already), and checked against
        what was verified when it was swapped in."""
        current = self._current
        assert current is not None
        log.warning("delta-swap: rebuilding %s from the store to restore it", current.snapshot_id)
        path = await self.reader.path_to(current.snapshot_id, None)
        if {t.name: t.checksum for t in path[-1].tensors} != {t.name: t.checksum for t in current.tensors}:
            raise ChainError(f"the store now holds other tensors for {current.snapshot_id} than were served")
        return await replay(
            self.reader,
            path,
            None,
            concurrency=self.settings.fetch_concurrency,
            max_model_bytes=self._max_model_bytes(),
        )

    async def _plan(self, newest: Manifest, force_base: bool) -> list[Manifest]:
        """Snapshots to apply to the decoded weights, oldest first, ending at the newest reachable
        one (from a base when no weights are held decoded; none when they hold the newest)."""
        current = None if force_base or self._state is None else self._held
        if current is not None and newest.step < current.step:  # a failed swap's update, past the newest
            current = None
        current_id = current.snapshot_id if current is not None else None
        if current_id == newest.snapshot_id:
            return []
        candidates = [newest]
        last_error: ChainError | None = None
        while candidates:
            target = candidates.pop(0)
            try:
                path = await self.reader.path_to(target.snapshot_id, current_id)
                if path and path[0].kind is SnapshotKind.DELTA and len(path) > 1:
                    from_base = await self.reader.path_to(target.snapshot_id, None)
                    if _payload(path) > self.settings.replay_cost_ratio * _payload(from_base):
                        path = from_base
                if path:
                    return path
            except ChainError as exc:
                last_error = exc
                if not candidates and target is newest:
                    # Broken chain: fall back to the newest snapshot that can still be reached.
                    floor = -1 if current is None else current.step
                    older = [m for m in await self.reader.list() if floor < m.step < newest.step]
                    candidates = sorted(older, key=lambda m: -m.step)
        raise last_error or ChainError(f"no path to {newest.snapshot_id}")

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """A JSON-ready summary of where this server stands (no side effects)."""
        cur, newest = self._current, self._newest
        store = self.settings.store or (self._store and self._store.url)
        return {
            "store": store and public_url(store),
            "authenticated": self._trusted is not None,
            "current_snapshot_id": cur and cur.snapshot_id,
            "current_step": cur and cur.step,
            # Unix time at which its update ended (the swap's resume, then the staged files' removal):
            # with a publisher's clock, publish -> serving without asking the status at a high rate.
            "current_since": self._current_since,
            "newest_snapshot_id": newest and newest.snapshot_id,
            "newest_step": newest and newest.step,
            "staleness_steps": self._staleness_steps(),
            "staleness_seconds": round(self._staleness_seconds(), 3),
            "run_id": cur and cur.run_id,
            # From the trainer's signed heartbeat: a HEAD held back shows here and in staleness_*.
            "published_step_seen": self._heartbeat and self._heartbeat.step,
            "trainer_seen_seconds": self._trainer_seen_seconds(),
            "heartbeat_expired": self._heartbeat and time.time() > self._heartbeat.expires_at,
            "heartbeat_error": self._heartbeat_error,
            "staged_snapshot_id": self._staged_id,
            "update_phase": self._phase,
            # How long the sync under way (None when idle) and its current phase have run so far.
            "update_seconds": _since(self._sync_since),
            "update_phase_seconds": _since(self._phase_since),
            "last_error": self._last_error,
            "last_error_kind": self._last_failure["kind"] if self._last_error and self._last_failure else None,
            "last_error_at": self._last_failure and self._last_failure["at"],
            # The latest failure's reason, still there once a later update (a repair) succeeded.
            "last_failure": self._last_failure,
            "last_resync": self._last_resync,
            "last_update_timings_s": {k: round(v, 6) for k, v in self._last_timings.items()},
            "last_update_path": self._last_path,
            "updates_applied": self._updates,
            "codec_ready": codec_warm_up.warmed_up(),
            # Seconds the engine generated nothing because of updates (pause + swap + resume, summed).
            "paused_seconds_total": round(self._paused_total, 6),
            "failures": self._failures,
            # Seconds until an update that failed is tried again (None: none is waiting).
            "retry_in_s": self._retry_in_s(),
            "engine": self.adapter.name,
            "drain": self.settings.drain.value,
        }

    async def describe(self) -> dict[str, Any]:
        """:meth:`status` plus the engine's own details (its weight version, ...); an engine that
        cannot answer shows ``engine_error`` instead of failing the status route."""
        details: dict[str, Any] = {}
        try:
            details["weight_version"] = await self.adapter.weight_version()
            details.update(await self.adapter.describe())
        except Exception as exc:
            details["engine_error"] = f"{type(exc).__name__}: {self._public_message(exc)}"
        return {**self.status(), **details}

    def _retry_in_s(self) -> float | None:
        failed = self._backoff.snapshot_id
        wait = round(self._backoff.wait_s(failed, time.monotonic()), 3) if failed is not None else 0.0
        return wait if wait > 0 else None

    def _staleness_steps(self) -> int | None:
        if self._current is None:
            return None
        newest = max(self._newest.step if self._newest else 0, self._heartbeat.step if self._heartbeat else 0)
        return max(0, newest - self._current.step)

    def _staleness_seconds(self) -> float:
        """Seconds since the newest snapshot not applied yet was published (per HEAD or heartbeat)."""
        newest = [(m.step, m.created_at) for m in (self._newest,) if m is not None]
        newest += [(b.step, b.published_at) for b in (self._heartbeat,) if b is not None]
        if not newest:
            return 0.0
        step, published_at = max(newest)
        if self._current is not None and step <= self._current.step:
            return 0.0
        return max(0.0, time.time() - published_at)

    def _trainer_seen_seconds(self) -> float | None:
        """Seconds since the trainer wrote the newest heartbeat seen (None: none seen)."""
        return None if self._heartbeat is None else round(max(0.0, time.time() - self._heartbeat.at), 3)

    def _export_metrics(self) -> None:
        m = self._metrics
        if self._current is not None:
            m.current_step.set(self._current.step)
        if self._newest is not None:
            m.newest_step.set(self._newest.step)
        m.staleness_steps.set(self._staleness_steps() or 0)
        m.staleness_seconds.set(self._staleness_seconds())
        if self._heartbeat is not None:
            m.published_step_seen.set(self._heartbeat.step)
            m.trainer_seen_seconds.set(self._trainer_seen_seconds() or 0.0)


_OVERRIDE = "a resync with allow_older=1 accepts it"


def _since(start: float | None) -> float | None:
    return None if start is None else round(time.monotonic() - start, 3)


def _payload(path: list[Manifest]) -> int:
    return sum(m.payload_bytes for m in path)
