"""Rebuilding snapshots: fetch a snapshot's shards, decode its tensors, verify every checksum."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np

from . import codec, store_keys
from .chain import ChainReader
from .checksum import checksum, verify, verify_blob
from .errors import ChainError, ChecksumMismatchError, CorruptDataError, IncompatibleSnapshotError
from .manifest import BlobEntry, Encoding, Manifest, SnapshotKind
from .stores import Store
from .tensors import HostTensor, StateDict

Progress = Callable[[int], None]


async def fetch_shards(store: Store, manifest: Manifest, *, concurrency: int = 4, progress: Progress | None = None,
                       authenticated: bool = False) -> dict[str, np.ndarray]:
    """Download a snapshot's shards concurrently (never more bytes than the manifest lists) and
    verify each one's size and checksum, and its SHA-256 when ``authenticated`` (the manifest's
    signature was verified)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(shard: BlobEntry) -> tuple[str, np.ndarray]:
        what = f"shard {shard.name} of {manifest.snapshot_id}"
        async with sem:
            data = await store.get(store_keys.shard_key(manifest.snapshot_id, shard.name), max_bytes=shard.size)
        if len(data) != shard.size:
            raise CorruptDataError(f"{what} has {len(data)} bytes, expected {shard.size}")
        await asyncio.to_thread(verify_blob, data, shard.checksum, shard.sha256 if authenticated else None, what)
        if progress:
            progress(shard.size)
        return shard.name, np.frombuffer(data, dtype=np.uint8)

    results = await asyncio.gather(*(one(s) for s in manifest.shards))
    return dict(results)


def apply_snapshot(
    prev: StateDict | None, manifest: Manifest, shards: dict[str, np.ndarray], timings: dict[str, float] | None = None
) -> StateDict:
    """The state after ``manifest``, given the state it was published against.

    Pure and all-or-nothing: ``prev`` is never modified, and any corrupt payload or checksum
    mismatch raises before a result exists. Unchanged tensors share ``prev``'s buffers.
    Seconds spent decoding and verifying are added to ``timings["decode"]`` / ``["verify"]``.
    """
    timings = {} if timings is None else timings
    decode_s = verify_s = 0.0
    if manifest.kind is SnapshotKind.DELTA and prev is None:
        raise ChainError(f"delta {manifest.snapshot_id} needs the state of {manifest.prev_snapshot_id}")
    state: StateDict = {}
    for t in manifest.tensors:
        old = prev.get(t.name) if prev is not None else None
        if t.encoding in (Encoding.SAME, Encoding.DELTA):
            if old is None or old.dtype != t.dtype or old.shape != t.shape:
                raise ChainError(f"{manifest.snapshot_id}: tensor {t.name} has no matching previous tensor")
        if t.encoding is Encoding.SAME:
            assert old is not None
            t0 = time.perf_counter()
            unchanged = checksum(old.data) == t.checksum
            verify_s += time.perf_counter() - t0
            if not unchanged:
                raise ChecksumMismatchError(f"{manifest.snapshot_id}: unchanged tensor {t.name} differs from the publisher's")
            state[t.name] = old
            continue
        assert t.shard is not None
        payload = shards[t.shard][t.offset : t.offset + t.length]
        t0 = time.perf_counter()
        if t.encoding is Encoding.RAW:
            data = payload
        else:
            try:
                data = codec.decode(old.data if old is not None else None, payload, t.dtype, t.nbytes)
            except CorruptDataError as exc:
                raise CorruptDataError(f"{manifest.snapshot_id}: tensor {t.name}: {exc}") from None
            if t.encoding is Encoding.DELTA and codec.payload_method(payload) is not Encoding.DELTA:
                raise CorruptDataError(f"{manifest.snapshot_id}: tensor {t.name} is marked delta but is not")
        t1 = time.perf_counter()
        verify(data, t.checksum, f"tensor {t.name} of {manifest.snapshot_id}")
        decode_s += t1 - t0
        verify_s += time.perf_counter() - t1
        state[t.name] = HostTensor(t.dtype, t.shape, data)
    timings["decode"] = timings.get("decode", 0.0) + decode_s
    timings["verify"] = timings.get("verify", 0.0) + verify_s
    return state


async def rebuild(
    store: Store,
    snapshot_id: str | None = None,
    *,
    reader: ChainReader | None = None,
    progress: Progress | None = None,
    max_model_bytes: int | None = None,
) -> tuple[Manifest, StateDict, list[Manifest]]:
    """Rebuild ``snapshot_id`` (default: the head) from its base; returns (manifest, state, path)."""
    reader = reader or ChainReader(store)
    target = snapshot_id or await reader.latest_id()
    if target is None:
        raise ChainError(f"store {store.public_url} has no snapshots")
    path = await reader.path_to(target)
    state = await replay(reader, path, None, progress=progress, max_model_bytes=max_model_bytes)
    return path[-1], state, path


async def replay(
    reader: ChainReader,
    path: list[Manifest],
    state: StateDict | None,
    *,
    concurrency: int = 4,
    timings: dict[str, float] | None = None,
    progress: Progress | None = None,
    max_model_bytes: int | None = None,
) -> StateDict:
    """Apply ``path`` (oldest first) to ``state`` (None when the path starts at a base): fetch
    each snapshot's shards, then decode and verify off the event loop. Nothing is fetched when a
    snapshot of the path holds more than ``max_model_bytes``. Seconds spent fetching, decoding and
    verifying are added to ``timings``."""
    timings = {} if timings is None else timings
    for manifest in path:
        if max_model_bytes is not None and manifest.model_bytes > max_model_bytes:
            raise IncompatibleSnapshotError(f"snapshot {manifest.snapshot_id} holds {manifest.model_bytes} bytes of "
                                            f"tensors, more than the {max_model_bytes} allowed")
    authenticated = reader.trusted is not None
    for manifest in path:
        t0 = time.perf_counter()
        shards = await fetch_shards(reader.store, manifest, concurrency=concurrency, progress=progress,
                                    authenticated=authenticated)
        timings["fetch"] = timings.get("fetch", 0.0) + time.perf_counter() - t0
        state = await asyncio.to_thread(apply_snapshot, state, manifest, shards, timings)
    if state is None:
        raise ChainError("nothing to replay")
    return state
