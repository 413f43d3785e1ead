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
from .checksum import BlobDigest, checksum, verify_blob
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
    check_applicable(prev, manifest, out)

    def rebuild_one(t: TensorEntry) -> HostTensor:
        payload = None if t.shard is None else shards[t.shard][t.offset : t.offset + t.length]
        return rebuild_tensor(manifest, t, payload, prev, out)

    with ThreadPoolExecutor(threads or decode_threads(), thread_name_prefix="delta-swap-decode") as pool:
        t0 = time.perf_counter()
        rebuilt = list(pool.map(rebuild_one, manifest.tensors))
        t1 = time.perf_counter()
        list(pool.map(lambda item: verify_tensor(manifest, *item), zip(manifest.tensors, rebuilt)))
        t2 = time.perf_counter()
    timings["decode"] = timings.get("decode", 0.0) + t1 - t0
    timings["verify"] = timings.get("verify", 0.0) + t2 - t1
    return {t.name: tensor for t, tensor in zip(manifest.tensors, rebuilt)}


def check_applicable(prev: StateDict | None, manifest: Manifest, out: StateDict | None) -> None:
    """Raise ChainError unless every tensor of ``manifest`` has the previous tensor it needs in
    ``prev`` and, with ``out``, a place of its dtype and shape to be written."""
    if manifest.kind is SnapshotKind.DELTA and prev is None:
        raise ChainError(f"delta {manifest.snapshot_id} needs the state of {manifest.prev_snapshot_id}")
    for t in manifest.tensors:
        old = prev.get(t.name) if prev is not None else None
        if t.encoding in (Encoding.SAME, Encoding.DELTA) and (old is None or (old.dtype, old.shape) != (t.dtype, t.shape)):
            raise ChainError(f"{manifest.snapshot_id}: tensor {t.name} has no matching previous tensor")
        if out is not None and (t.name not in out or (out[t.name].dtype, out[t.name].shape) != (t.dtype, t.shape)):
            raise ChainError(f"{manifest.snapshot_id}: tensor {t.name} has no place to be written")


def rebuild_tensor(manifest: Manifest, t: TensorEntry, payload: np.ndarray | None, prev: StateDict | None,
                   out: StateDict | None) -> HostTensor:
    """Tensor ``t`` of ``manifest`` from its ``payload`` (None for an unchanged one) and its previous
    value; written into ``out[t.name]`` when ``out`` is given (see :func:`apply_snapshot`)."""
    old = prev.get(t.name) if prev is not None else None
    dest = None if out is None else out[t.name]
    if t.encoding is Encoding.SAME:
        assert old is not None
        if dest is None or dest.data is old.data:
            return old
        dest.data[:] = old.data
        return dest
    assert payload is not None
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


def verify_tensor(manifest: Manifest, t: TensorEntry, tensor: HostTensor) -> None:
    """Raise ChecksumMismatchError unless ``tensor`` hashes to the publisher's checksum of ``t``."""
    if checksum(tensor.data) != t.checksum:
        what = "unchanged tensor" if t.encoding is Encoding.SAME else "tensor"
        raise ChecksumMismatchError(f"{manifest.snapshot_id}: {what} {t.name} differs from the publisher's checksum")


#: With ``out`` (tensors written straight into engine memory), shards larger than this are fetched
#: in contiguous pieces of this size and applied as they arrive: a full base never sits whole in
#: host memory next to the weights it becomes.
STREAM_PIECE_BYTES = 32 << 20


async def stream_snapshot(
    store: Store,
    manifest: Manifest,
    prev: StateDict | None,
    out: StateDict,
    *,
    authenticated: bool = False,
    piece_bytes: int | None = None,
    progress: Progress | None = None,
    timings: dict[str, float] | None = None,
    threads: int | None = None,
) -> StateDict:
    """:func:`apply_snapshot` into ``out`` with every shard fetched in pieces of ``piece_bytes``
    (default :data:`STREAM_PIECE_BYTES`; the next piece is fetched while one is applied): host
    memory beyond ``out`` is two pieces and the largest encoded tensor, not the snapshot. A
    shard's size, xxh3 and (when ``authenticated``) SHA-256 are checked over its pieces, every
    tensor's checksum once all are written; as with ``out`` in :func:`apply_snapshot`, a failure
    leaves ``out`` partly written."""
    timings = {} if timings is None else timings
    piece_bytes = piece_bytes or STREAM_PIECE_BYTES
    check_applicable(prev, manifest, out)
    rebuilt: dict[str, HostTensor] = {}
    with ThreadPoolExecutor(threads or decode_threads(), thread_name_prefix="delta-swap-decode") as pool:
        for shard in manifest.shards:
            tensors = sorted((t for t in manifest.tensors if t.shard == shard.name), key=lambda t: t.offset)
            writer = _ShardWriter(manifest, shard, tensors, prev, out, pool, authenticated, rebuilt)
            await _stream_shard(store, manifest, shard, writer, piece_bytes, progress, timings)
        t0 = time.perf_counter()
        for t in manifest.tensors:
            if t.shard is None:
                rebuilt[t.name] = rebuild_tensor(manifest, t, None, prev, out)
        t1 = time.perf_counter()
        await asyncio.to_thread(lambda: list(pool.map(lambda t: verify_tensor(manifest, t, rebuilt[t.name]),
                                                      manifest.tensors)))
        t2 = time.perf_counter()
    timings["decode"] = timings.get("decode", 0.0) + t1 - t0
    timings["verify"] = timings.get("verify", 0.0) + t2 - t1
    return {t.name: rebuilt[t.name] for t in manifest.tensors}


async def _stream_shard(store: Store, manifest: Manifest, shard: BlobEntry, writer: _ShardWriter, piece_bytes: int,
                        progress: Progress | None, timings: dict[str, float]) -> None:
    key = store_keys.shard_key(manifest.snapshot_id, shard.name)
    what = f"shard {shard.name} of {manifest.snapshot_id}"
    size = await store.size(key)
    if size != shard.size:
        raise CorruptDataError(f"{what} has {size} bytes, expected {shard.size}")

    async def fetch(start: int, end: int) -> bytes:
        data = await store.get(key, start, end, max_bytes=end - start)
        if len(data) != end - start:
            raise CorruptDataError(f"{what}: bytes {start}-{end} came back with {len(data)} bytes")
        return data

    pieces = [(start, min(start + piece_bytes, shard.size)) for start in range(0, shard.size, piece_bytes)]
    ahead = asyncio.ensure_future(fetch(*pieces[0])) if pieces else None
    try:
        for i, (start, _end) in enumerate(pieces):
            t0 = time.perf_counter()
            assert ahead is not None
            data = await ahead
            ahead = asyncio.ensure_future(fetch(*pieces[i + 1])) if i + 1 < len(pieces) else None
            t1 = time.perf_counter()
            await asyncio.to_thread(writer.add, start, data)
            timings["fetch"] = timings.get("fetch", 0.0) + t1 - t0
            timings["decode"] = timings.get("decode", 0.0) + time.perf_counter() - t1
            if progress:
                progress(len(data))
    finally:
        if ahead is not None:
            ahead.cancel()
    writer.finish(what)


class _ShardWriter:
    """Applies one shard's bytes, arriving in order, to ``out``: raw tensors are copied piece by
    piece, encoded ones gathered until whole and then decoded (on ``pool``); the shard's digests
    are computed on the way."""

    def __init__(self, manifest: Manifest, shard: BlobEntry, tensors: list[TensorEntry], prev: StateDict | None,
                 out: StateDict, pool: ThreadPoolExecutor, authenticated: bool, rebuilt: dict[str, HostTensor]) -> None:
        self.manifest, self.shard, self.tensors, self.prev, self.out = manifest, shard, tensors, prev, out
        self.pool, self.rebuilt = pool, rebuilt
        self.authenticated = authenticated
        self.digest = BlobDigest(sha256=authenticated)
        self.next = 0  # the first tensor not yet complete (tensors are sorted by offset)
        self.gathering: dict[str, bytearray] = {}

    def add(self, start: int, data: bytes) -> None:
        end = start + len(data)
        self.digest.update(data)
        view = np.frombuffer(data, dtype=np.uint8)
        whole: list[tuple[TensorEntry, np.ndarray]] = []
        i = self.next
        while i < len(self.tensors):
            t = self.tensors[i]
            if t.offset > end or (t.offset == end and t.length):  # starts in a later piece
                break
            lo, hi = max(t.offset, start), min(t.offset + t.length, end)
            if lo < hi and t.encoding is Encoding.RAW:
                self.out[t.name].data[lo - t.offset:hi - t.offset] = view[lo - start:hi - start]
            elif lo < hi:
                self.gathering.setdefault(t.name, bytearray()).extend(view[lo - start:hi - start])
            if t.offset + t.length <= end:  # complete
                if t.encoding is Encoding.RAW:
                    self.rebuilt[t.name] = self.out[t.name]
                else:
                    whole.append((t, np.frombuffer(self.gathering.pop(t.name, bytearray()), dtype=np.uint8)))
                if i == self.next:
                    self.next += 1
            i += 1
        for t, tensor in zip((t for t, _ in whole), self.pool.map(
                lambda item: rebuild_tensor(self.manifest, item[0], item[1], self.prev, self.out), whole)):
            self.rebuilt[t.name] = tensor

    def finish(self, what: str) -> None:
        if self.next < len(self.tensors):  # empty tensors at the very end of the shard
            self.add(self.shard.size, b"")
        if self.next < len(self.tensors):
            raise CorruptDataError(f"{what} ends before tensor {self.tensors[self.next].name}")
        self.digest.verify(self.shard.checksum, self.shard.sha256 if self.authenticated else None, what)


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
        if out is not None and any(shard.size > STREAM_PIECE_BYTES for shard in manifest.shards):
            state = await stream_snapshot(reader.store, manifest, state, out, authenticated=authenticated,
                                          progress=progress, timings=timings)
            continue
        shards = await fetch_shards(reader.store, manifest, concurrency=concurrency, progress=progress,
                                    authenticated=authenticated)
        timings["fetch"] = timings.get("fetch", 0.0) + time.perf_counter() - t0
        state = await asyncio.to_thread(apply_snapshot, state, manifest, shards, timings, out=out)
    if state is None:
        raise ChainError("nothing to replay")
    return state
