"""Rebuilding snapshots: fetch a snapshot's shards, decode its tensors, verify every checksum."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np

from . import codec, store_keys
from .chain import ChainReader
from .checksum import checksum, verify
from .errors import ChainError, ChecksumMismatchError, CorruptDataError
from .manifest import Encoding, Manifest, SnapshotKind
from .stores import Store
from .tensors import HostTensor, StateDict

Progress = Callable[[int], None]


async def fetch_shards(store: Store, manifest: Manifest, *, concurrency: int = 4, progress: Progress | None = None) -> dict[str, np.ndarray]:
    """Download a snapshot's shards concurrently and verify each one's size and checksum."""
    sem = asyncio.Semaphore(concurrency)

    async def one(name: str, size: int, expected: str) -> tuple[str, np.ndarray]:
        async with sem:
            data = await store.get(store_keys.shard_key(manifest.snapshot_id, name))
        if len(data) != size:
            raise CorruptDataError(f"shard {name} of {manifest.snapshot_id} has {len(data)} bytes, expected {size}")
        await asyncio.to_thread(verify, data, expected, f"shard {name} of {manifest.snapshot_id}")
        if progress:
            progress(size)
        return name, np.frombuffer(data, dtype=np.uint8)

    results = await asyncio.gather(*(one(s.name, s.size, s.checksum) for s in manifest.shards))
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
) -> tuple[Manifest, StateDict, list[Manifest]]:
    """Rebuild ``snapshot_id`` (default: the head) from its base; returns (manifest, state, path)."""
    reader = reader or ChainReader(store)
    target = snapshot_id or await reader.latest_id()
    if target is None:
        raise ChainError(f"store {store.url} has no snapshots")
    path = await reader.path_to(target)
    return path[-1], await replay(store, path, None, progress=progress), path


async def replay(
    store: Store,
    path: list[Manifest],
    state: StateDict | None,
    *,
    concurrency: int = 4,
    timings: dict[str, float] | None = None,
    progress: Progress | None = None,
) -> StateDict:
    """Apply ``path`` (oldest first) to ``state`` (None when the path starts at a base): fetch
    each snapshot's shards, then decode and verify off the event loop. Seconds spent fetching,
    decoding and verifying are added to ``timings``."""
    timings = {} if timings is None else timings
    for manifest in path:
        t0 = time.perf_counter()
        shards = await fetch_shards(store, manifest, concurrency=concurrency, progress=progress)
        timings["fetch"] = timings.get("fetch", 0.0) + time.perf_counter() - t0
        state = await asyncio.to_thread(apply_snapshot, state, manifest, shards, timings)
    if state is None:
        raise ChainError("nothing to replay")
    return state
