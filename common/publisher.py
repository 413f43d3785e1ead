"""The trainer side: publish each step as a full base or a lossless delta, in the background.

A training loop calls :meth:`Publisher.publish` after each optimizer step. The call copies the
tensors to host memory and returns; encoding and upload run on a background thread with at
most ``max_pending`` steps queued (bounded memory). That thread encodes a step's tensors on
``encode_threads`` threads (default: every core the process may run on; the codec's kernels run
without the GIL), a large tensor in parts that the threads share (``CodecConfig.part_elements``),
and writes their payloads into the shard in the tensors' order, so the snapshot is the same byte
for byte on any number of threads. When steps queue up, the next one is encoded
while the previous one uploads and commits (a part is one shard, so a step's own upload starts
after its encode). Errors surface on the next ``publish``, ``flush`` or ``close``.

Several ranks may each publish their own subset of the tensors into one snapshot: every rank
encodes and uploads its own part, and :mod:`.commit` merges the parts into the manifest. A rank
whose tensors cannot be diffed (new tensors, changed shapes, a delta too large) stores its part
in full inside a delta.

With a signing key, only signed state can hold the publisher back: a HEAD, manifest or part that
does not verify with its own (or ``trusted_key``'s) public key is ignored, said once in the log,
and replaced where it is in the way; the publisher resumes only on a head that verifies, and
writes a signed heartbeat (:mod:`.heartbeat`) after each commit and every ``heartbeat_every``
seconds.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import io
import logging
import math
import os
import queue
import re
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import codec, codec_warm_up, head_cache, store_keys
from .chain import ChainReader
from .checksum import checksum, sha256
from .commit import Part, commit, try_commit, write_part
from .dtypes import dtype_size
from .errors import (
    ChainError,
    ConfigError,
    CorruptDataError,
    DeltaSwapError,
    IncompatibleSnapshotError,
    NotFoundError,
    PublishError,
)
from .heartbeat import write_heartbeat
from .manifest import (
    BlobEntry,
    Encoding,
    Manifest,
    SnapshotKind,
    TensorEntry,
    check_run_id,
    new_run_id,
    snapshot_id_for_step,
)
from .rebuild import rebuild
from .retention import prune
from .safetensors_io import write_safetensors
from .shard_format import DELTA_SHARD_MAGIC
from .signing import SigningKey, TrustedKeys, split_paths
from .stores import Store, open_store
from .tensors import HostTensor, StateDict, same_bytes, state_to_host

log = logging.getLogger("delta_swap.publisher")
#: Snapshots read, newest first, to find the run of a store whose HEAD is unusable.
RUN_SEARCH_LIMIT = 64
_STEP_ID_RE = re.compile(r"step-(\d{1,19})")


@dataclass(frozen=True)
class PublisherConfig:
    """How often bases are written and how much memory the background queue may hold."""

    base_every: int = 25
    #: Publish a full part instead when its delta would exceed this fraction of its raw bytes.
    max_delta_fraction: float = 0.5
    rank: int = 0
    world_size: int = 1
    #: Steps copied and waiting for the background thread before ``publish`` blocks.
    max_pending: int = 2
    #: Continue the chain already in the store (rebuilding its head) instead of starting a base.
    resume: bool = True
    #: URLs POSTed ``{"snapshot_id", "step"}`` after each commit (e.g. servers' /delta_swap/notify);
    #: best effort, since servers also poll.
    notify_urls: tuple[str, ...] = ()
    #: Bearer token sent with each notify (default: $DELTA_SWAP_ADMIN_TOKEN, as the servers use).
    notify_token: str | None = None
    #: Private key file that signs every manifest (default: $DELTA_SWAP_SIGNING_KEY, if set).
    signing_key: str | None = None
    #: Public key files (comma-separated) whose snapshots count as this trainer's besides its own
    #: key's, e.g. the previous key during a rotation (default: $DELTA_SWAP_TRUSTED_KEY, if set).
    trusted_key: str | None = None
    #: The run this publisher writes. Default: the run of the newest snapshot of the store that
    #: verifies, or a new one for an empty store. Set it to ignore snapshots of other runs.
    run_id: str | None = None
    #: Resume refuses a head whose tensors add up to more bytes (default: twice the bytes of the
    #: first step published, times ``world_size``).
    max_model_bytes: int | None = None
    #: Seconds between heartbeats while no step is published (0: only after each commit); a
    #: heartbeat says it is current for ``heartbeat_ttl`` seconds.
    heartbeat_every: float = 30.0
    heartbeat_ttl: float = 300.0
    #: HEAD further ahead than this many steps of a new commit is taken for garbage and replaced.
    max_step_jump: int = 1_000_000
    #: After each new base, delete snapshots older than the newest ``keep_bases`` bases (0 keeps all).
    keep_bases: int = 0
    codec: codec.CodecConfig = field(default_factory=codec.CodecConfig)
    #: Threads that encode a step's tensors in parallel (None: one per core this process may run
    #: on, ``os.sched_getaffinity``); set fewer to leave cores to the trainer. The snapshot written
    #: (manifest and shards) is the same byte for byte whatever the number.
    encode_threads: int | None = None
    #: A folder for a local copy of the tensors this rank last published (:mod:`.head_cache`): a
    #: publisher that resumes uses it, once verified against the head manifest's checksums,
    #: instead of rebuilding the store's head. None: no cache (``delta-swap publish`` sets one).
    head_cache: str | None = None
    #: Compile (or load) the codec's kernels in the background from the start (:mod:`.codec_warm_up`),
    #: so that the first delta, which follows a base, does not wait for them. A process that
    #: publishes one step and exits (``delta-swap publish``) turns it off: a delta loads the
    #: kernels as it encodes, and a base does not need them.
    warm_up: bool = True

    def with_fields(self, fields: Mapping[str, Any], where: str = "publisher_options") -> PublisherConfig:
        """A copy with ``fields`` (a user's extra options) changed; ConfigError, naming ``where``,
        for a field this config does not have."""
        try:
            return replace(self, **dict(fields))
        except TypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None


@dataclass
class _Job:
    step: int
    state: StateDict
    force_base: bool
    metadata: dict[str, str]


@dataclass(frozen=True)
class _ChainState:
    """What the encode of the next step depends on, as it was before a step changed it. The
    undo of a step in flight keeps no ``prev_state`` (:meth:`_ChainState.without_weights`): a
    copy of the model for a failure that a base repairs as well."""

    prev_state: StateDict | None
    prev_id: str | None
    last_base_step: int | None
    resumed: bool

    def without_weights(self) -> _ChainState:
        """The same chain, its head's weights forgotten: the next step is a base."""
        return _ChainState(None, self.prev_id, self.last_base_step, self.resumed)


@dataclass
class _Prepared:
    """A step encoded and waiting for its upload and commit."""

    job: _Job
    snapshot_id: str
    prev_id: str | None
    part: Part
    data: bytes | memoryview
    before: _ChainState
    run_id: str | None
    encoder_memory: codec.EncoderMemory  # as this step's encode left it (the next one changes it)


class Publisher:
    """Publishes a chain of snapshots to a store from a training loop (one instance per rank)."""

    def __init__(
        self,
        store: Store | str,
        config: PublisherConfig = PublisherConfig(),
        files: Mapping[str, bytes] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """``progress`` (called from the background thread) receives tensor bytes as they are
        encoded and uploaded, e.g. a progress bar's ``update``."""
        if not 0 <= config.rank < config.world_size:
            raise ConfigError(f"rank {config.rank} is outside world size {config.world_size}")
        if config.base_every < 1 or config.max_pending < 1:
            raise ConfigError("base_every and max_pending must be at least 1")
        if config.encode_threads is not None and config.encode_threads < 1:
            raise ConfigError(f"encode_threads must be at least 1, not {config.encode_threads}")
        #: Threads encoding each step (``encode_threads``, else every core this process may use).
        self.encode_threads = config.encode_threads or allowed_cores()
        self._pool: ThreadPoolExecutor | None = None  # started with the first parallel encode
        self.config = config
        self.files = dict(files or {})
        key_path = config.signing_key or os.environ.get("DELTA_SWAP_SIGNING_KEY") or None
        #: Signs every manifest this publisher commits (None: unsigned snapshots).
        self.signing_key = SigningKey.load(key_path) if key_path else None
        extra = split_paths(config.trusted_key or os.environ.get("DELTA_SWAP_TRUSTED_KEY"))
        trusted = [self.signing_key.trusted()] if self.signing_key else []
        trusted += [TrustedKeys.load(extra)] if extra else []
        #: Keys whose snapshots, parts and heads count (None: no signing key, nothing is verified).
        self.trusted: TrustedKeys | None = None
        for keys in trusted:
            self.trusted = keys if self.trusted is None else self.trusted | keys
        check_run_id(config.run_id)
        self._notify_token = config.notify_token or os.environ.get("DELTA_SWAP_ADMIN_TOKEN") or None
        self._progress = progress or (lambda n: None)
        # Opened here so a bad URL fails now; remote stores bind to the worker's loop on first use.
        self._store = store if isinstance(store, Store) else open_store(store, create=True)
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=config.max_pending)
        self._error: BaseException | None = None
        self._last_step: int | None = None
        self._closed = False
        self.published: list[str] = []
        #: The manifest of the newest snapshot this publisher committed (after :meth:`flush`).
        self.last_manifest: Manifest | None = None
        # Owned by the background thread:
        self._prev_state: StateDict | None = None
        self._prev_id: str | None = None
        self._last_base_step: int | None = None
        self._resumed = False
        self._encoder_memory = codec.EncoderMemory()  # each tensor's last sign models: faster fits
        #: The run this publisher writes (known after the first publish).
        self.run_id: str | None = config.run_id
        self._thread = threading.Thread(target=self._run, name=f"delta-swap-publisher-{config.rank}", daemon=True)
        self._thread.start()
        if config.codec.version >= 2 and config.warm_up:
            codec_warm_up.start_warm_up()  # the first delta comes after a base: compile meanwhile

    # ------------------------------------------------------------------ caller side

    def publish(
        self,
        step: int,
        tensors: Mapping[str, Any] | Any,
        *,
        force_base: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """Queue ``tensors`` (torch tensors or numpy arrays, serving dtype, HF names) as ``step``.

        ``tensors`` may be a transformers model, or its ``state_dict()``: tied aliases are dropped
        and fused in-memory weights split back into checkpoint names (see
        :mod:`delta_swap.integrations.hf_names`); a mapping whose names no checkpoint holds raises
        ConfigError here, on the trainer, rather than being refused by every server.
        Returns the snapshot id at once; blocks only while ``max_pending`` steps are queued.
        """
        from .integrations.hf_names import check_checkpoint_names, checkpoint_tensors, is_transformers_model

        tensors = checkpoint_tensors(tensors) if is_transformers_model(tensors) else check_checkpoint_names(tensors)
        self._raise_pending_error()
        if self._closed:
            raise PublishError("publisher is closed")
        if self._last_step is not None and step <= self._last_step:
            raise ConfigError(f"step {step} is not after the last published step {self._last_step}")
        if not tensors:
            raise ConfigError("nothing to publish")
        self._last_step = step
        job = _Job(step, state_to_host(tensors), force_base, dict(metadata or {}))
        while True:
            try:
                self._queue.put(job, timeout=0.5)
                break
            except queue.Full:
                self._raise_pending_error()
        return snapshot_id_for_step(step)

    def flush(self) -> None:
        """Wait until every queued step is committed (or this rank's part is uploaded)."""
        self._queue.join()
        self._raise_pending_error()

    def close(self) -> None:
        """Flush, then stop the background thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
        self._raise_pending_error()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise PublishError(f"publishing failed: {error}") from error

    # ------------------------------------------------------------------ background thread

    def _run(self) -> None:
        """Two stages on one event loop: while step N uploads and commits (:meth:`_finish`, a task),
        step N+1, if it is already queued, is encoded (:meth:`_prepare`); N+1 commits only after
        N did. A step that fails drops the step encoded meanwhile, and the next step is a base
        (N-1's weights are not kept while N is in flight: one copy of the model less)."""
        loop = asyncio.new_event_loop()
        store = self._store
        every = self.config.heartbeat_every
        in_flight: tuple[_Prepared, asyncio.Task[None]] | None = None
        try:
            while True:
                try:
                    job = (
                        self._queue.get_nowait() if in_flight else self._queue.get(timeout=every if every > 0 else None)
                    )
                except queue.Empty:
                    if in_flight:  # nothing to encode meanwhile: finish the step in flight
                        self._settle(loop, in_flight)
                        in_flight = None
                    elif self._error is None:
                        loop.run_until_complete(self._heartbeat(store))
                    continue
                if job is None:
                    if in_flight:
                        self._settle(loop, in_flight)
                        in_flight = None
                    self._queue.task_done()
                    return
                prepared = None
                if self._error is None:
                    saved = self._chain_state()
                    try:
                        prepared = loop.run_until_complete(self._prepare(store, job, saved))  # N uploads meanwhile
                    except BaseException as exc:  # surfaced to the caller
                        self._restore(saved)
                        if in_flight:
                            self._settle(loop, in_flight)
                            in_flight = None
                        self._error = self._error or exc
                if in_flight:
                    ok = self._settle(loop, in_flight)
                    in_flight = None
                    if not ok:
                        prepared = None  # encoded against a step that was not published
                if prepared is not None:
                    in_flight = prepared, loop.create_task(self._finish(store, prepared))
                else:
                    self._queue.task_done()
                # Only the step in flight may hold the chain as it was before it (for its undo):
                # these names would keep the head before that (or a failed step) alive until the
                # next step arrives.
                job = prepared = saved = None  # type: ignore[assignment]
        finally:
            if in_flight:
                self._settle(loop, in_flight)
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            loop.run_until_complete(store.close())
            loop.run_until_complete(loop.shutdown_default_executor())  # its threads end before close returns
            loop.close()

    def _chain_state(self) -> _ChainState:
        return _ChainState(self._prev_state, self._prev_id, self._last_base_step, self._resumed)

    def _restore(self, saved: _ChainState) -> None:
        self._prev_state, self._prev_id = saved.prev_state, saved.prev_id
        self._last_base_step, self._resumed = saved.last_base_step, saved.resumed

    def _settle(self, loop: asyncio.AbstractEventLoop, in_flight: tuple[_Prepared, asyncio.Task[None]]) -> bool:
        """Wait for the step in flight; on failure record the error and put the chain back as it
        was before that step, less its head's weights (the next step is a base). Marks the step
        done; True if it was published."""
        prepared, task = in_flight
        try:
            loop.run_until_complete(task)
            return True
        except BaseException as exc:  # surfaced to the caller
            self._restore(prepared.before)
            self._error = self._error or exc
            return False
        finally:
            self._queue.task_done()

    async def _prepare(self, store: Store, job: _Job, before: _ChainState) -> _Prepared:
        """Everything of a step up to its upload: resume, the base/delta decision, the encode."""
        cfg = self.config
        if not self._resumed:
            await self._resume(store, job)
        self._resumed = True
        snapshot_id = snapshot_id_for_step(job.step)
        await self._check_free(store, snapshot_id)
        cadence = self._last_base_step is None or job.force_base or job.step - self._last_base_step >= cfg.base_every
        prev, prev_id = self._prev_state, self._prev_id
        must_full = cadence or prev is None or _layout_of(prev) != _layout_of(job.state)
        delta = None if must_full else await asyncio.to_thread(self._delta_part, job, snapshot_id)
        data: bytes | memoryview
        if delta is None:
            part, data = await self._full_part(job, snapshot_id, prev_id)
        else:
            part, data = delta
        if cadence or (cfg.world_size == 1 and part.full):
            self._last_base_step = job.step
        # The next step is encoded against this one while this one uploads.
        self._prev_state, self._prev_id = job.state, snapshot_id
        memory = self._encoder_memory.copy() if cfg.head_cache is not None else self._encoder_memory
        return _Prepared(job, snapshot_id, prev_id, part, data, before.without_weights(), self.run_id, memory)

    async def _upload(self, store: Store, part: Part, data: bytes | memoryview) -> None:
        """Store a part's shard (one per part) and side files, before anything commits it."""
        for shard in part.shards:
            await store.put(store_keys.shard_key(part.snapshot_id, shard.name), data)
        for entry in part.files:
            await store.put(store_keys.file_key(part.snapshot_id, entry.name), self.files[entry.name])

    async def _finish(self, store: Store, prepared: _Prepared) -> None:
        """Upload and commit a prepared step, then heartbeat, notify, prune and the head cache."""
        cfg = self.config
        job, snapshot_id, part = prepared.job, prepared.snapshot_id, prepared.part
        # The head cache is written while the snapshot uploads and commits (it is checked against
        # the head manifest before any use, so a publish that fails after it only costs a rebuild).
        saving = None
        if cfg.head_cache is not None:
            saving = asyncio.ensure_future(
                asyncio.to_thread(
                    self._save_head, store, job.state, snapshot_id, prepared.run_id, prepared.encoder_memory
                )
            )
        committed: Manifest | None = None
        try:
            await self._upload(store, part, prepared.data)
            sign, trusted = self.signing_key, self.trusted
            if cfg.world_size == 1:
                try:
                    committed = await commit(store, [part], sign, cfg.max_step_jump, trusted)
                except ChainError as exc:
                    if part.full or sign is None:
                        raise
                    # The predecessor was deleted or replaced by something unsigned: start again from a base.
                    log.warning("delta-swap: cannot publish %s as a delta (%s); publishing a base", snapshot_id, exc)
                    part, data = await self._full_part(job, snapshot_id, prepared.prev_id)
                    await self._upload(store, part, data)
                    self._last_base_step = max(job.step, self._last_base_step or job.step)
                    committed = await commit(store, [part], sign, cfg.max_step_jump, trusted)
            else:
                await write_part(store, part, sign)
                committed = await try_commit(store, snapshot_id, cfg.world_size, sign, cfg.max_step_jump, trusted)
            if committed is not None:
                self.run_id = committed.run_id
                await self._heartbeat(store, committed)
            if committed is not None and cfg.notify_urls:
                await notify(cfg.notify_urls, committed, token=self._notify_token)
            if committed is not None and cfg.keep_bases and committed.kind is SnapshotKind.BASE:
                await prune(store, cfg.keep_bases, ChainReader(store, trusted))
            self.published.append(snapshot_id)
        finally:
            if saving is not None:
                await saving
        if committed is not None:
            self.last_manifest = committed

    async def _resume(self, store: Store, job: _Job) -> None:
        """First publish: take the run of the store's newest snapshot and, with ``resume``,
        continue its chain: deltas of the next steps are taken against its head.

        The head counts only if it verifies (with a signing key), belongs to ``run_id`` (when
        set) and is at most ``max_step_jump`` steps ahead; otherwise it is ignored (logged once)
        and the newest such snapshot gives the run. A damaged head (a corrupt manifest or shard,
        more than ``max_model_bytes``) does not stop publishing either: it is logged and the next
        snapshot is a full base, which needs no previous state. The same holds when the first
        publish is a base anyway: the head is not rebuilt at all.
        """
        cfg = self.config
        reader = ChainReader(store, self.trusted)
        head, verified_head = await self._own_head(reader, job)
        if self.run_id is None:
            self.run_id = head.run_id if head is not None and head.run_id else new_run_id()
        if head is None or not cfg.resume:
            return
        if head.step >= job.step:
            raise ChainError(f"store head is at step {head.step}; cannot publish step {job.step} after it")
        if job.force_base or not verified_head:  # deltas only against the head, once it verified
            return
        if cfg.head_cache is not None:
            path = head_cache.cache_file(cfg.head_cache, store.public_url, head.run_id, cfg.rank)
            cached = await asyncio.to_thread(head_cache.load, path, head, list(job.state))
            if cached is not None:
                try:
                    self._last_base_step = (await reader.manifest(head.base_snapshot_id)).step
                except (CorruptDataError, NotFoundError) as exc:
                    log.warning("delta-swap: the base of the store's head cannot be read (%s)", exc)
                else:
                    log.info("delta-swap: continuing after %s from the cached head in %s", head.snapshot_id, path)
                    self._prev_state, self._prev_id = cached, head.snapshot_id
                    await asyncio.to_thread(self._load_encoder_memory, head_cache.memory_file(path))
                    return
        limit = cfg.max_model_bytes or 2 * cfg.world_size * sum(t.nbytes for t in job.state.values())
        try:
            manifest, state, _ = await rebuild(store, head.snapshot_id, reader=reader, max_model_bytes=limit)
            self._last_base_step = (await reader.manifest(manifest.base_snapshot_id)).step
        except (CorruptDataError, ChainError, NotFoundError, IncompatibleSnapshotError) as exc:
            log.warning(
                "delta-swap: the store's head %s cannot be rebuilt (%s); publishing a new base", head.snapshot_id, exc
            )
            return
        self._prev_state = {name: state[name] for name in job.state if name in state}
        self._prev_id = manifest.snapshot_id

    def _is_own(self, manifest: Manifest, job_step: int) -> bool:
        """Whether a verified manifest counts as this run's (and is not a runaway step)."""
        run_ok = self.config.run_id is None or manifest.run_id == self.config.run_id
        return run_ok and manifest.step <= job_step + self.config.max_step_jump

    async def _own_head(self, reader: ChainReader, job: _Job) -> tuple[Manifest | None, bool]:
        """The manifest HEAD names if it counts as this run's (and True), else the newest one
        that does (and False)."""
        why = "it names another run or a runaway step"
        try:
            head = await reader.head()
            if head is None:
                return None, False
            manifest = await reader.manifest(head.snapshot_id)
            if self._is_own(manifest, job.step):
                return manifest, True
        except (CorruptDataError, NotFoundError) as exc:
            why = str(exc)
        found = await self._newest_own(reader, job)
        log.warning(
            "delta-swap: ignoring the store's HEAD and what it names (%s); %s",
            why,
            f"run {found.run_id} continues after {found.snapshot_id} with a new base"
            if found
            else "publishing a new base",
        )
        return found, False

    async def _newest_own(self, reader: ChainReader, job: _Job) -> Manifest | None:
        """The newest of the :data:`RUN_SEARCH_LIMIT` newest snapshots that counts as this run's."""
        try:
            ids = await reader.snapshot_ids()
        except NotImplementedError:
            return None
        steps = sorted(((int(m.group(1)), i) for i in ids if (m := _STEP_ID_RE.fullmatch(i))), reverse=True)
        for _, snapshot_id in steps[:RUN_SEARCH_LIMIT]:
            try:
                manifest = await reader.manifest(snapshot_id)
            except (CorruptDataError, NotFoundError):
                continue
            if self._is_own(manifest, job.step):
                return manifest
        return None

    async def _check_free(self, store: Store, snapshot_id: str) -> None:
        """Raise ChainError if this run already committed ``snapshot_id``; a manifest there that
        does not verify (or is another run's) is logged and will be overwritten."""
        if not await store.exists(store_keys.manifest_key(snapshot_id)):
            return
        try:
            manifest = await ChainReader(store, self.trusted).manifest(snapshot_id)
            if self._is_own(manifest, manifest.step):
                raise ChainError(f"snapshot {snapshot_id} already exists in {store.public_url}")
            why = f"it belongs to run {manifest.run_id}"
        except (CorruptDataError, NotFoundError) as exc:
            why = str(exc)
        log.warning("delta-swap: %s in the store is not this trainer's (%s); overwriting it", snapshot_id, why)

    async def _heartbeat(self, store: Store, committed: Manifest | None = None) -> None:
        """Write the heartbeat for ``committed`` (default, on rank 0 only: the newest snapshot this
        publisher knows to be committed). Best effort: a failure is logged, never raised."""
        cfg = self.config
        try:
            if committed is None:
                if cfg.rank != 0 or not self.published:
                    return
                committed = self.last_manifest
                if committed is None or committed.snapshot_id != self.published[-1]:
                    try:
                        committed = await ChainReader(store, self.trusted).manifest(self.published[-1])
                    except (CorruptDataError, NotFoundError):
                        pass
                if committed is None:
                    return
            await write_heartbeat(store, committed, self.signing_key, cfg.heartbeat_ttl)
        except (DeltaSwapError, OSError, asyncio.TimeoutError) as exc:
            log.warning("delta-swap: writing the heartbeat failed: %s", exc)

    def _delta_part(self, job: _Job, snapshot_id: str) -> tuple[Part, bytes] | None:
        """Encode this rank's tensors against the previous step; None if a full part is better."""
        assert self._prev_state is not None
        cfg = self.config
        shard = store_keys.shard_name(cfg.rank, cfg.world_size, Encoding.DELTA)
        buf = io.BytesIO()
        buf.write(DELTA_SHARD_MAGIC)
        entries = []
        raw_bytes = sum(t.nbytes for t in job.state.values())
        prev = self._prev_state
        plan = [
            (name, new, codec.tensor_parts(math.prod(new.shape), new.shape, cfg.codec))
            for name, new in job.state.items()
        ]
        encoded = self._in_order(lambda work: work(), _encode_jobs(plan, prev, cfg.codec, self._encoder_memory))
        try:
            for name, new, parts in plan:
                digest, payload = _joined(next(encoded), encoded, prev[name], new, parts, cfg.codec)
                self._progress(new.nbytes)
                if payload is None:
                    entries.append(TensorEntry(name, new.dtype, new.shape, Encoding.SAME, digest))
                    continue
                encoding = codec.payload_method(payload)
                entry = TensorEntry(name, new.dtype, new.shape, encoding, digest, shard, buf.tell(), len(payload))
                entries.append(entry)
                buf.write(payload)
                if buf.tell() > cfg.max_delta_fraction * raw_bytes:
                    return None
        finally:
            encoded.close()  # a delta too large: the tensors not taken yet are not encoded
        data = buf.getvalue() if buf.tell() > len(DELTA_SHARD_MAGIC) else b""
        shards = [BlobEntry(shard, len(data), checksum(data), sha256(data))] if data else []
        part = Part(
            snapshot_id,
            job.step,
            cfg.rank,
            cfg.world_size,
            False,
            self._prev_id,
            entries,
            shards,
            [],
            job.metadata,
            self.run_id,
        )
        return part, data

    def _in_order(self, work: Callable[[Any], Any], items: Iterable[Any]) -> Generator[Any, None, None]:
        """``work`` of each item, in the items' order, computed on :attr:`encode_threads` threads
        with at most twice as many results done or under way at once (so the encoded payloads a
        step holds besides its shard stay bounded); one thread computes them right here."""
        if self.encode_threads == 1:
            return (work(item) for item in items)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.encode_threads, thread_name_prefix="delta-swap-encode")
        return _ordered(self._pool, work, items, 2 * self.encode_threads)

    def _save_head(
        self, store: Store, state: StateDict, snapshot_id: str, run_id: str | None, memory: codec.EncoderMemory
    ) -> None:
        """Keep ``state`` as the head cache of run ``run_id``, and the encoder's ``memory`` beside it
        (best effort: a failure is logged)."""
        assert self.config.head_cache is not None
        path = head_cache.cache_file(self.config.head_cache, store.public_url, run_id, self.config.rank)
        try:
            head_cache.save(path, state, snapshot_id)
            memory.save(head_cache.memory_file(path))
        except OSError as exc:
            log.warning("delta-swap: cannot write the head cache %s: %s", path, exc)

    def _load_encoder_memory(self, path: Path) -> None:
        """Take the sign models a previous process kept beside the head cache (a hint for the
        encoder only: a file that is missing or not one is logged and ignored)."""
        try:
            self._encoder_memory = codec.EncoderMemory.load(path)
        except FileNotFoundError:
            pass
        except (OSError, CorruptDataError) as exc:
            log.warning("delta-swap: ignoring the encoder memory beside the head cache: %s", exc)

    async def _full_part(self, job: _Job, snapshot_id: str, prev_id: str | None) -> tuple[Part, memoryview]:
        """This rank's tensors as one safetensors shard, with rank 0's side files (not uploaded)."""
        cfg = self.config
        shard = store_keys.shard_name(cfg.rank, cfg.world_size, Encoding.RAW)
        buf = io.BytesIO()
        locations = await asyncio.to_thread(write_safetensors, buf, sorted(job.state.items()))
        data = buf.getbuffer()
        items = sorted(job.state.items())
        digests = await asyncio.to_thread(
            lambda: list(self._in_order(lambda t: checksum(t.data), [t for _, t in items]))
        )
        entries = [
            TensorEntry(name, t.dtype, t.shape, Encoding.RAW, digest, shard, *locations[name])
            for (name, t), digest in zip(items, digests)
        ]
        shard_entry = await asyncio.to_thread(lambda: BlobEntry(shard, len(data), checksum(data), sha256(data)))
        self._progress(sum(t.nbytes for t in job.state.values()))
        files = []
        if cfg.rank == 0:
            for name, content in sorted(self.files.items()):
                files.append(BlobEntry(name, len(content), checksum(content), sha256(content)))
        part = Part(
            snapshot_id,
            job.step,
            cfg.rank,
            cfg.world_size,
            True,
            prev_id,
            entries,
            [shard_entry],
            files,
            job.metadata,
            self.run_id,
        )
        return part, data


def allowed_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def _encode_delta(
    old: HostTensor, new: HostTensor, config: codec.CodecConfig, memory: codec.TensorMemory
) -> tuple[str, bytes | None]:
    """The checksum of ``new`` and its payload against ``old`` (None when it did not change)."""
    digest = checksum(new.data)
    if same_bytes(old.data, new.data):
        return digest, None
    return digest, codec.encode_tensor_delta(old.data, new.data, new.dtype, config, new.shape, memory)


Plan = list[tuple[str, HostTensor, list[tuple[int, int]]]]


def _encode_jobs(
    plan: Plan, prev: StateDict, config: codec.CodecConfig, memory: codec.EncoderMemory
) -> Iterator[Callable[[], Any]]:
    """The encode work of a step, in the plan's order: a tensor in one piece is one job (checksum
    and payload); a tensor in parts (:func:`codec.tensor_parts`) is one job for its checksum and
    whether it changed, then one per part (None where the part did not change), so that threads
    share a large tensor. ``memory`` keeps each tensor's sign models for the next step."""
    for name, new, parts in plan:
        old = prev[name]
        if len(parts) == 1:
            yield functools.partial(_encode_delta, old, new, config, memory.tensor(name))
            continue
        yield functools.partial(_checksum_and_changed, old, new)
        for part in parts:
            yield functools.partial(_encode_changed_part, old, new, part, config, memory.tensor(name))


def _checksum_and_changed(old: HostTensor, new: HostTensor) -> tuple[str, bool]:
    return checksum(new.data), not same_bytes(old.data, new.data)


def _encode_changed_part(
    old: HostTensor, new: HostTensor, part: tuple[int, int], config: codec.CodecConfig, memory: codec.TensorMemory
) -> bytes | None:
    width = dtype_size(new.dtype)
    start, stop = part[0] * width, part[1] * width
    if same_bytes(old.data[start:stop], new.data[start:stop]):
        return None
    return codec.encode_part(old.data, new.data, new.dtype, part, config, new.shape, memory)


def _joined(
    first: Any,
    rest: Iterator[Any],
    old: HostTensor,
    new: HostTensor,
    parts: list[tuple[int, int]],
    config: codec.CodecConfig,
) -> tuple[str, bytes | None]:
    """A tensor's (checksum, payload or None) from its jobs' results (``first``, then as many of
    ``rest`` as it has parts); a part that did not change in a tensor that did is coded here."""
    if len(parts) == 1:
        return first
    digest, changed = first
    payloads = [next(rest) for _ in parts]
    if not changed:
        return digest, None
    coded = [
        (
            stop - start,
            payload
            if payload is not None
            else codec.encode_part(old.data, new.data, new.dtype, (start, stop), config, new.shape),
        )
        for (start, stop), payload in zip(parts, payloads, strict=True)
    ]
    return digest, codec.join_parts(new.dtype, coded)


def _ordered(
    pool: ThreadPoolExecutor, work: Callable[[Any], Any], items: Iterable[Any], window: int
) -> Generator[Any, None, None]:
    """``work(item)`` for each item, in order, with at most ``window`` submitted and not yet
    taken; closing the iterator early cancels what has not started and waits for the rest."""
    pending: collections.deque[Future[Any]] = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(work, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        for future in pending:
            if not future.cancelled():
                future.exception()  # wait: nothing of this step keeps running after it


def _layout_of(state: StateDict) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (t.dtype, t.shape) for name, t in state.items()}


# ---------------------------------------------------------------------- notifying


async def notify(urls: tuple[str, ...], manifest: Manifest, timeout_s: float = 2.0, token: str | None = None) -> None:
    """Tell servers about a new snapshot; failures are logged, never raised (they also poll)."""
    import httpx

    body = {"snapshot_id": manifest.snapshot_id, "step": manifest.step}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
        results = await asyncio.gather(*(client.post(url, json=body) for url in urls), return_exceptions=True)
    for url, result in zip(urls, results):
        if isinstance(result, BaseException) or result.status_code >= 400:
            log.warning("delta-swap: notifying %s failed: %s", url, result)
