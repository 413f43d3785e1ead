"""Rebuilding snapshots: fetch a snapshot's shards, decode its tensors, verify every checksum."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import codec, store_keys
from .chain import ChainReader
from .checksum import checksum, verify_blob
from .errors import ChainError, ChecksumMismatchError, CorruptDataError, IncompatibleSnapshotError
from .manifest import BlobEntry, Encoding, Manifest, SnapshotKind, TensorEntry
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


def decode_threads() -> int:
    """Threads that decode and verify tensors: every core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def apply_snapshot(
    prev: StateDict | None,
    manifest: Manifest,
    shards: dict[str, np.ndarray],
    timings: dict[str, float] | None = None,
    *,
    out: StateDict | None = None,
    threads: int | None = None,
) -> StateDict:
    """The state after ``manifest``, given the state it was published against.

    Without ``out`` it is pure and all-or-nothing: ``prev`` is never modified, new tensors get
    new buffers and unchanged ones share ``prev``'s, and any corrupt payload or checksum mismatch
    raises before a result exists. With ``out`` (writable tensors of every name, such as a spare
    weight arena; it may be ``prev`` itself, and deltas then apply in place) every tensor is
    written into ``out`` and only ``out`` is modified; a failure leaves it partly written.

    Tensors are decoded, then verified, on ``threads`` threads (default: every core). Wall-clock
    seconds are added to ``timings["decode"]`` and ``["verify"]``.
    """
    timings = {} if timings is None else timings
    if manifest.kind is SnapshotKind.DELTA and prev is None:
        raise ChainError(f"delta {manifest.snapshot_id} needs the state of {manifest.prev_snapshot_id}")
    for t in manifest.tensors:
        old = prev.get(t.name) if prev is not None else None
        if t.encoding in (Encoding.SAME, Encoding.DELTA) and (old is None or (old.dtype, old.shape) != (t.dtype, t.shape)):
            raise ChainError(f"{manifest.snapshot_id}: tensor {t.name} has no matching previous tensor")
        if out is not None and (t.name not in out or (out[t.name].dtype, out[t.name].shape) != (t.dtype, t.shape)):
            raise ChainError(f"{manifest.snapshot_id}: tensor {t.name} has no place to be written")

    def rebuild_one(t: TensorEntry) -> HostTensor:
        old = prev.get(t.name) if prev is not None else None
        dest = None if out is None else out[t.name]
        if t.encoding is Encoding.SAME:
            assert old is not None
            if dest is None or dest.data is old.data:
                return old
            dest.data[:] = old.data
            return dest
        assert t.shard is not None
        payload = shards[t.shard][t.offset : t.offset + t.length]
        if t.encoding is Encoding.RAW:
            if dest is None:
                return HostTensor(t.dtype, t.shape, payload)
            dest.data[:] = payload
            return dest
        try:
            method = codec.payload_method(payload)
            if t.encoding is Encoding.DELTA and method is not Encoding.DELTA:
                raise CorruptDataError("marked delta but is not")
            if dest is None:
                return HostTensor(t.dtype, t.shape, codec.decode(old.data if old else None, payload, t.dtype, t.nbytes))
            if method is Encoding.DELTA and not np.shares_memory(dest.data, old.data):
                dest.data[:] = old.data
            codec.decode_into(dest.data, payload, t.dtype)
            return dest
        except CorruptDataError as exc:
            raise CorruptDataError(f"{manifest.snapshot_id}: tensor {t.name}: {exc}") from None

    def verify_one(item: tuple[TensorEntry, HostTensor]) -> None:
        t, tensor = item
        if checksum(tensor.data) != t.checksum:
            what = "unchanged tensor" if t.encoding is Encoding.SAME else "tensor"
            raise ChecksumMismatchError(f"{manifest.snapshot_id}: {what} {t.name} differs from the publisher's checksum")

    with ThreadPoolExecutor(threads or decode_threads(), thread_name_prefix="delta-swap-decode") as pool:
        t0 = time.perf_counter()
        rebuilt = list(pool.map(rebuild_one, manifest.tensors))
        t1 = time.perf_counter()
        list(pool.map(verify_one, zip(manifest.tensors, rebuilt)))
        t2 = time.perf_counter()
    timings["decode"] = timings.get("decode", 0.0) + t1 - t0
    timings["verify"] = timings.get("verify", 0.0) + t2 - t1
    return {t.name: tensor for t, tensor in zip(manifest.tensors, rebuilt)}


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
    out: StateDict | None = None,
) -> StateDict:
    """Apply ``path`` (oldest first) to ``state`` (None when the path starts at a base): fetch
    each snapshot's shards, then decode and verify off the event loop (into ``out``, if given:
    see :func:`apply_snapshot`). Nothing is fetched when a snapshot of the path holds more than
    ``max_model_bytes``. Seconds spent fetching, decoding and verifying are added to ``timings``."""
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
        state = await asyncio.to_thread(apply_snapshot, state, manifest, shards, timings, out=out)
    if state is None:
        raise ChainError("nothing to replay")
    return state
