"""The trainer side: publish each step as a full base or a lossless delta, in the background.

A training loop calls :meth:`Publisher.publish` after each optimizer step. The call copies the
tensors to host memory and returns; encoding and upload run on a background thread with at
most ``max_pending`` steps queued (bounded memory). Errors surface on the next ``publish``,
``flush`` or ``close``.

Several ranks may each publish their own subset of the tensors into one snapshot: every rank
encodes and uploads its own part, and :mod:`.commit` merges the parts into the manifest. A rank
whose tensors cannot be diffed (new tensors, changed shapes, a delta too large) stores its part
in full inside a delta.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import codec, store_keys
from .chain import ChainReader
from .checksum import checksum, sha256
from .commit import Part, commit, try_commit
from .errors import ChainError, ConfigError, CorruptDataError, NotFoundError, PublishError
from .manifest import BlobEntry, Encoding, Manifest, SnapshotKind, TensorEntry, snapshot_id_for_step
from .rebuild import rebuild
from .retention import prune
from .safetensors_io import write_safetensors
from .signing import SigningKey
from .stores import Store, open_store
from .tensors import StateDict, state_to_host

DELTA_SHARD_MAGIC = b"DSWPSHD1"
log = logging.getLogger("delta_swap.publisher")


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
    #: HEAD further ahead than this many steps of a new commit is taken for garbage and replaced.
    max_step_jump: int = 1_000_000
    #: After each new base, delete snapshots older than the newest ``keep_bases`` bases (0 keeps all).
    keep_bases: int = 0
    codec: codec.CodecConfig = field(default_factory=codec.CodecConfig)


@dataclass
class _Job:
    step: int
    state: StateDict
    force_base: bool
    metadata: dict[str, str]


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
        self.config = config
        self.files = dict(files or {})
        key_path = config.signing_key or os.environ.get("DELTA_SWAP_SIGNING_KEY") or None
        #: Signs every manifest this publisher commits (None: unsigned snapshots).
        self.signing_key = SigningKey.load(key_path) if key_path else None
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
        self._thread = threading.Thread(target=self._run, name=f"delta-swap-publisher-{config.rank}", daemon=True)
        self._thread.start()
        if config.codec.version >= 2:
            codec.start_warm_up()  # the first delta comes after a base: compile meanwhile

    # ------------------------------------------------------------------ caller side

    def publish(
        self, step: int, tensors: Mapping[str, Any] | Any, *, force_base: bool = False, metadata: Mapping[str, str] | None = None
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
        loop = asyncio.new_event_loop()
        store = self._store
        try:
            while True:
                job = self._queue.get()
                try:
                    if job is None:
                        return
                    if self._error is None:
                        loop.run_until_complete(self._publish(store, job))
                except BaseException as exc:  # surfaced to the caller
                    self._error = exc
                finally:
                    self._queue.task_done()
        finally:
            loop.run_until_complete(store.close())
            loop.close()

    async def _publish(self, store: Store, job: _Job) -> None:
        cfg = self.config
        if cfg.resume and not self._resumed:
            await self._resume(store, job)
        self._resumed = True
        snapshot_id = snapshot_id_for_step(job.step)
        if await store.exists(store_keys.manifest_key(snapshot_id)):
            raise ChainError(f"snapshot {snapshot_id} already exists in {store.url}")
        cadence = self._last_base_step is None or job.force_base or job.step - self._last_base_step >= cfg.base_every
        prev = self._prev_state
        must_full = cadence or prev is None or _layout_of(prev) != _layout_of(job.state)
        delta = None if must_full else await asyncio.to_thread(self._delta_part, job, snapshot_id)
        if delta is None:
            part = await self._full_part(store, job, snapshot_id)
        else:
            part, data = delta
            for shard in part.shards:
                await store.put(store_keys.shard_key(snapshot_id, shard.name), data)
        if cadence or (cfg.world_size == 1 and part.full):
            self._last_base_step = job.step
        sign = self.signing_key
        if cfg.world_size == 1:
            committed: Manifest | None = await commit(store, [part], sign, cfg.max_step_jump)
        else:
            await store.put(store_keys.part_key(snapshot_id, cfg.rank), part.to_json())
            committed = await try_commit(store, snapshot_id, cfg.world_size, sign, cfg.max_step_jump)
        if committed is not None and cfg.notify_urls:
            await notify(cfg.notify_urls, committed, token=self._notify_token)
        if committed is not None and cfg.keep_bases and committed.kind is SnapshotKind.BASE:
            await prune(store, cfg.keep_bases)
        self._prev_state, self._prev_id = job.state, snapshot_id
        self.published.append(snapshot_id)
        if committed is not None:
            self.last_manifest = committed

    async def _resume(self, store: Store, job: _Job) -> None:
        """Continue the chain in the store: deltas of the next steps are taken against its head.

        A damaged head (a corrupt HEAD, manifest or shard) does not stop publishing: it is logged
        and the next snapshot is a full base, which needs no previous state. The same holds when
        the first publish is a base anyway: the head is not rebuilt at all.
        """
        reader = ChainReader(store)
        try:
            head = await reader.head()
        except (CorruptDataError, NotFoundError) as exc:
            log.warning("delta-swap: the store's HEAD is unusable (%s); publishing a new base", exc)
            return
        if head is None:
            return
        if head.step >= job.step:
            raise ChainError(f"store head is at step {head.step}; cannot publish step {job.step} after it")
        if job.force_base:
            return
        try:
            manifest, state, _ = await rebuild(store, head.snapshot_id, reader=reader)
            self._last_base_step = (await reader.manifest(manifest.base_snapshot_id)).step
        except (CorruptDataError, ChainError, NotFoundError) as exc:
            log.warning("delta-swap: the store's head %s cannot be rebuilt (%s); publishing a new base",
                        head.snapshot_id, exc)
            return
        self._prev_state = {name: state[name] for name in job.state if name in state}
        self._prev_id = manifest.snapshot_id

    def _delta_part(self, job: _Job, snapshot_id: str) -> tuple[Part, bytes] | None:
        """Encode this rank's tensors against the previous step; None if a full part is better."""
        assert self._prev_state is not None
        cfg = self.config
        shard = store_keys.shard_name(cfg.rank, cfg.world_size, Encoding.DELTA)
        buf = io.BytesIO()
        buf.write(DELTA_SHARD_MAGIC)
        entries = []
        raw_bytes = sum(t.nbytes for t in job.state.values())
        for name, new in job.state.items():
            old = self._prev_state[name]
            digest = checksum(new.data)
            self._progress(new.nbytes)
            if np.array_equal(old.data, new.data):
                entries.append(TensorEntry(name, new.dtype, new.shape, Encoding.SAME, digest))
                continue
            payload = codec.encode_tensor_delta(old.data, new.data, new.dtype, cfg.codec, shape=new.shape)
            encoding = codec.payload_method(payload)
            entries.append(TensorEntry(name, new.dtype, new.shape, encoding, digest, shard, buf.tell(), len(payload)))
            buf.write(payload)
            if buf.tell() > cfg.max_delta_fraction * raw_bytes:
                return None
        data = buf.getvalue() if buf.tell() > len(DELTA_SHARD_MAGIC) else b""
        shards = [BlobEntry(shard, len(data), checksum(data), sha256(data))] if data else []
        part = Part(snapshot_id, job.step, cfg.rank, cfg.world_size, False, self._prev_id, entries, shards, [], job.metadata)
        return part, data

    async def _full_part(self, store: Store, job: _Job, snapshot_id: str) -> Part:
        cfg = self.config
        shard = store_keys.shard_name(cfg.rank, cfg.world_size, Encoding.RAW)
        buf = io.BytesIO()
        locations = await asyncio.to_thread(write_safetensors, buf, sorted(job.state.items()))
        data = buf.getbuffer()
        entries = [
            TensorEntry(name, t.dtype, t.shape, Encoding.RAW, checksum(t.data), shard, *locations[name])
            for name, t in sorted(job.state.items())
        ]
        shard_entry = await asyncio.to_thread(lambda: BlobEntry(shard, len(data), checksum(data), sha256(data)))
        await store.put(store_keys.shard_key(snapshot_id, shard), data)
        self._progress(sum(t.nbytes for t in job.state.values()))
        files = []
        if cfg.rank == 0:
            for name, content in sorted(self.files.items()):
                await store.put(store_keys.file_key(snapshot_id, name), content)
                files.append(BlobEntry(name, len(content), checksum(content), sha256(content)))
        return Part(snapshot_id, job.step, cfg.rank, cfg.world_size, True, self._prev_id, entries, [shard_entry], files, job.metadata)


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
