"""Rebuilding snapshots: fetch a snapshot's shards, decode its tensors, verify every checksum."""

from __future__ import annotations

import asyncio
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import codec, store_keys
from .chain import ChainReader
from .checksum import BlobDigest, checksum, verify_blob
from .errors import ChainError, ChecksumMismatchError, CorruptDataError, IncompatibleSnapshotError, NotFoundError
from .manifest import BlobEntry, Encoding, Manifest, SnapshotKind, TensorEntry
from .shard_format import DELTA_SHARD_MAGIC, check_delta_shard, is_delta_shard
from .stores import Store
from .tensors import HostTensor, StateDict

Progress = Callable[[int], None]


@dataclass
class Meter:
    """What rebuilding reports as it goes: wall-clock seconds per phase (``fetch``, ``decode``,
    ``verify``) added up in ``seconds``, and the bytes fetched passed to ``progress`` as they arrive."""

    seconds: dict[str, float] = field(default_factory=dict)
    progress: Progress | None = None
    #: Set once a tensor may have been written into ``out`` (it no longer holds what it held).
    wrote_out: bool = False

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def fetched(self, nbytes: int) -> None:
        if self.progress:
            self.progress(nbytes)


async def fetch_shards(
    store: Store, manifest: Manifest, *, concurrency: int = 4, meter: Meter | None = None, authenticated: bool = False
) -> dict[str, np.ndarray]:
    """Download a snapshot's shards concurrently (never more bytes than the manifest lists) and
    verify each one's size and checksum, and its SHA-256 when ``authenticated`` (the manifest's
    signature was verified), then a delta shard's magic."""
    sem = asyncio.Semaphore(concurrency)
    meter = meter or Meter()

    async def one(shard: BlobEntry) -> tuple[str, np.ndarray]:
        what = f"shard {shard.name} of {manifest.snapshot_id}"
        async with sem:
            data = await store.get(store_keys.shard_key(manifest.snapshot_id, shard.name), max_bytes=shard.size)
        if len(data) != shard.size:
            raise CorruptDataError(f"{what} has {len(data)} bytes, expected {shard.size}")
        await asyncio.to_thread(verify_blob, data, shard.checksum, shard.sha256 if authenticated else None, what)
        if is_delta_shard(shard.name):
            check_delta_shard(data, what)
        meter.fetched(shard.size)
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
    meter: Meter | None = None,
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

    Tensors are decoded, then verified, on ``threads`` threads (default: every core); the
    seconds of each are added to ``meter``.
    """
    meter = meter or Meter()
    check_applicable(prev, manifest, out)
    meter.wrote_out = meter.wrote_out or out is not None  # the shards were verified: decoding writes into out

    with ThreadPoolExecutor(threads or decode_threads(), thread_name_prefix="delta-swap-decode") as pool:

        def rebuild_one(t: TensorEntry) -> HostTensor:
            payload = None if t.shard is None else shards[t.shard][t.offset : t.offset + t.length]
            return rebuild_tensor(manifest, t, payload, prev, out, pool)

        t0 = time.perf_counter()
        rebuilt = list(pool.map(rebuild_one, manifest.tensors))
        t1 = time.perf_counter()
        list(pool.map(lambda item: verify_tensor(manifest, *item), zip(manifest.tensors, rebuilt)))
        t2 = time.perf_counter()
    meter.add("decode", t1 - t0)
    meter.add("verify", t2 - t1)
    return {t.name: tensor for t, tensor in zip(manifest.tensors, rebuilt)}


def check_applicable(prev: StateDict | None, manifest: Manifest, out: StateDict | None) -> None:
    """Raise ChainError unless every tensor of ``manifest`` has the previous tensor it needs in
    ``prev`` and, with ``out``, a place of its dtype and shape to be written."""
    if manifest.kind is SnapshotKind.DELTA and prev is None:
        raise ChainError(f"delta {manifest.snapshot_id} needs the state of {manifest.prev_snapshot_id}")
    for t in manifest.tensors:
        old = prev.get(t.name) if prev is not None else None
        if t.encoding in (Encoding.SAME, Encoding.DELTA) and (
            old is None or (old.dtype, old.shape) != (t.dtype, t.shape)
        ):
            raise ChainError(f"{manifest.snapshot_id}: tensor {t.name} has no matching previous tensor")
        if out is not None and (t.name not in out or (out[t.name].dtype, out[t.name].shape) != (t.dtype, t.shape)):
            raise ChainError(f"{manifest.snapshot_id}: tensor {t.name} has no place to be written")


def rebuild_tensor(
    manifest: Manifest,
    t: TensorEntry,
    payload: np.ndarray | None,
    prev: StateDict | None,
    out: StateDict | None,
    executor: Executor | None = None,
) -> HostTensor:
    """Tensor ``t`` of ``manifest`` from its ``payload`` (None for an unchanged one) and its previous
    value; written into ``out[t.name]`` when ``out`` is given (see :func:`apply_snapshot`). The
    parts of a large tensor's payload decode on ``executor``'s threads, if given."""
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
            rebuilt = codec.decode(old.data if old else None, payload, t.dtype, t.nbytes, executor)
            return HostTensor(t.dtype, t.shape, rebuilt)
        if method is Encoding.DELTA:
            if old is None:
                raise CorruptDataError("delta payload but no previous tensor to apply it to")
            if not np.shares_memory(dest.data, old.data):
                dest.data[:] = old.data
        codec.decode_into(dest.data, payload, t.dtype, executor)
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

#: Encoded tensor bytes of one streamed shard kept in memory until the shard verifies; beyond
#: this they wait in an unlinked temporary file (``$TMPDIR``), so host memory stays bounded.
SPOOL_MEMORY_BYTES = 32 << 20


async def stream_snapshot(
    store: Store,
    manifest: Manifest,
    prev: StateDict | None,
    out: StateDict,
    *,
    authenticated: bool = False,
    piece_bytes: int | None = None,
    meter: Meter | None = None,
    threads: int | None = None,
) -> StateDict:
    """:func:`apply_snapshot` into ``out`` with every shard fetched in pieces of ``piece_bytes``
    (default :data:`STREAM_PIECE_BYTES`; the next piece is fetched while one is handled).

    Nothing is decoded before it is verified: a shard's size, xxh3 and (when ``authenticated``)
    SHA-256 are computed over its pieces as they arrive, raw tensors are copied into ``out``
    (which the engine does not use until the whole update has verified), and encoded tensors are
    gathered (beyond :data:`SPOOL_MEMORY_BYTES`, in a temporary file) and handed to the codec only
    once the whole shard matched its digests. Host memory beyond ``out`` is two pieces and the
    spool's memory part, not the snapshot. Every tensor's checksum is checked once all are
    written; as with ``out`` in :func:`apply_snapshot`, a failure leaves ``out`` partly written.
    Seconds and fetched bytes are reported to ``meter``."""
    meter = meter or Meter()
    piece_bytes = piece_bytes or STREAM_PIECE_BYTES
    check_applicable(prev, manifest, out)
    rebuilt: dict[str, HostTensor] = {}
    with ThreadPoolExecutor(threads or decode_threads(), thread_name_prefix="delta-swap-decode") as pool:
        for shard in manifest.shards:
            tensors = sorted((t for t in manifest.tensors if t.shard == shard.name), key=lambda t: t.offset)
            with _ShardWriter(manifest, shard, tensors, prev, out, pool, authenticated, rebuilt, meter) as writer:
                await _stream_shard(store, manifest, shard, writer, piece_bytes, meter)
        meter.wrote_out = True
        t0 = time.perf_counter()
        for t in manifest.tensors:
            if t.shard is None:
                rebuilt[t.name] = rebuild_tensor(manifest, t, None, prev, out)
        t1 = time.perf_counter()
        await asyncio.to_thread(
            lambda: list(pool.map(lambda t: verify_tensor(manifest, t, rebuilt[t.name]), manifest.tensors))
        )
        t2 = time.perf_counter()
    meter.add("decode", t1 - t0)
    meter.add("verify", t2 - t1)
    return {t.name: rebuilt[t.name] for t in manifest.tensors}


async def _stream_shard(
    store: Store, manifest: Manifest, shard: BlobEntry, writer: _ShardWriter, piece_bytes: int, meter: Meter
) -> None:
    key = store_keys.shard_key(manifest.snapshot_id, shard.name)
    what = f"shard {shard.name} of {manifest.snapshot_id}"
    size = await store.size(key)
    if size is None:
        raise NotFoundError(f"{key} not found in {store.public_url}")
    if size >= 0 and size != shard.size:  # -1: the server does not say (the pieces are counted instead)
        raise CorruptDataError(f"{what} has {size} bytes, expected {shard.size}")
    pieces = store.read_pieces(key, shard.size, piece_bytes)
    ahead: asyncio.Future | None = None
    try:
        start = 0
        ahead = asyncio.ensure_future(anext(pieces, None))
        while True:
            t0 = time.perf_counter()
            data = await ahead
            if data is None:
                break
            end = min(start + piece_bytes, shard.size)
            if len(data) != end - start:
                raise CorruptDataError(f"{what}: bytes {start}-{end} came back with {len(data)} bytes")
            ahead = asyncio.ensure_future(anext(pieces, None)) if end < shard.size else None
            t1 = time.perf_counter()
            await asyncio.to_thread(writer.add, start, data)
            meter.add("fetch", t1 - t0)
            meter.add("decode", time.perf_counter() - t1)
            meter.fetched(len(data))
            start = end
            if ahead is None:
                break
        if start != shard.size:
            raise CorruptDataError(f"{what} ended after {start} of {shard.size} bytes")
    finally:
        if ahead is not None:  # a piece fetched ahead that is no longer wanted (or failed too)
            ahead.cancel()
            try:
                await ahead
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the first error is the one raised
                pass
        await pieces.aclose()
    t0 = time.perf_counter()
    await asyncio.to_thread(writer.finish, what)  # verify the whole shard, then decode
    meter.add("decode", time.perf_counter() - t0)


class _Spool:
    """Bytes appended in order, kept in memory up to ``limit`` and in an unlinked temporary file
    beyond; :meth:`view` maps them back once they are complete."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._memory = bytearray()
        self._file: Any = None
        self._map: mmap.mmap | None = None

    def write(self, data: np.ndarray) -> None:
        if self._file is None and self.size + len(data) > self.limit:
            self._file = tempfile.TemporaryFile(prefix="delta-swap-spool-")
            self._file.write(self._memory)
            self._memory = bytearray()
        if self._file is not None:
            self._file.write(memoryview(data))  # type: ignore[arg-type]  # numpy types ndarray a Buffer on 3.12+ only
        else:
            self._memory.extend(memoryview(data))  # type: ignore[arg-type]  # numpy types ndarray a Buffer on 3.12+ only
        self.size += len(data)

    def view(self) -> np.ndarray:
        if self._file is None:
            return np.frombuffer(self._memory, dtype=np.uint8)
        self._file.flush()
        if self._map is None and self.size:
            self._map = mmap.mmap(self._file.fileno(), self.size, access=mmap.ACCESS_READ)
        return np.frombuffer(self._map, dtype=np.uint8) if self._map is not None else np.zeros(0, np.uint8)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a decoded view still refers to it: the garbage collector closes it
                pass
            self._map = None
        if self._file is not None:
            self._file.close()
            self._file = None
        self._memory = bytearray()


class _ShardWriter:
    """Takes one shard's bytes, arriving in order: a base's (raw) tensors are copied into ``out``
    piece by piece, a delta shard's tensors spooled; :meth:`finish` checks the shard's digests and
    only then copies or decodes the spooled tensors (on ``pool``). So a delta that fails its digests
    leaves ``out`` as it was (``out`` may hold the served weights being decoded over in place)."""

    def __init__(
        self,
        manifest: Manifest,
        shard: BlobEntry,
        tensors: list[TensorEntry],
        prev: StateDict | None,
        out: StateDict,
        pool: ThreadPoolExecutor,
        authenticated: bool,
        rebuilt: dict[str, HostTensor],
        meter: Meter,
    ) -> None:
        self.manifest, self.shard, self.tensors, self.prev, self.out = manifest, shard, tensors, prev, out
        self.pool, self.rebuilt, self.meter = pool, rebuilt, meter
        self.direct = not is_delta_shard(shard.name)  # raw tensors go straight into out
        self.authenticated = authenticated
        self.digest = BlobDigest(sha256=authenticated)
        self.next = 0  # the first tensor not yet complete (tensors are sorted by offset, ranges disjoint)
        self.spool = _Spool(SPOOL_MEMORY_BYTES)
        self.spooled: dict[str, int] = {}  # encoded tensor -> where its payload starts in the spool
        self.head = b""  # the shard's first bytes: a delta shard's magic

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.spool.close()

    def add(self, start: int, data: bytes) -> None:
        end = start + len(data)
        self.digest.update(data)
        if start < len(DELTA_SHARD_MAGIC):
            self.head += bytes(data[: len(DELTA_SHARD_MAGIC) - start])
        view = np.frombuffer(data, dtype=np.uint8)
        i = self.next
        while i < len(self.tensors):
            t = self.tensors[i]
            if t.offset >= end:  # starts in a later piece
                break
            lo, hi = max(t.offset, start), min(t.offset + t.length, end)
            if lo < hi and t.encoding is Encoding.RAW and self.direct:
                self.meter.wrote_out = True
                self.out[t.name].data[lo - t.offset : hi - t.offset] = view[lo - start : hi - start]
            elif lo < hi:
                self.spooled.setdefault(t.name, self.spool.size)
                self.spool.write(view[lo - start : hi - start])
            if t.offset + t.length <= end and i == self.next:
                self.next += 1
            i += 1

    def finish(self, what: str) -> None:
        for t in self.tensors[self.next :]:
            if t.offset + t.length > self.shard.size:
                raise CorruptDataError(f"{what} ends before tensor {t.name}")
        self.digest.verify(self.shard.checksum, self.shard.sha256 if self.authenticated else None, what)
        if not self.direct:  # a delta shard
            check_delta_shard(self.head, what)
        payloads = self.spool.view()  # verified: now, and only now, the codec may read it
        self.meter.wrote_out = True
        encoded = []
        for t in self.tensors:
            if t.encoding is Encoding.RAW and self.direct:
                self.rebuilt[t.name] = self.out[t.name]
            else:
                at = self.spooled.get(t.name, 0)
                encoded.append((t, payloads[at : at + t.length]))
        for (t, _), tensor in zip(
            encoded,
            self.pool.map(lambda item: rebuild_tensor(self.manifest, item[0], item[1], self.prev, self.out), encoded),
        ):
            self.rebuilt[t.name] = tensor


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
    state = await replay(reader, path, None, meter=Meter(progress=progress), max_model_bytes=max_model_bytes)
    return path[-1], state, path


async def replay(
    reader: ChainReader,
    path: list[Manifest],
    state: StateDict | None,
    *,
    concurrency: int = 4,
    meter: Meter | None = None,
    max_model_bytes: int | None = None,
    out: StateDict | None = None,
) -> StateDict:
    """Apply ``path`` (oldest first) to ``state`` (None when the path starts at a base): fetch
    each snapshot's shards, then decode and verify off the event loop (into ``out``, if given:
    see :func:`apply_snapshot`). Nothing is fetched when a snapshot of the path holds more than
    ``max_model_bytes``. Seconds spent fetching, decoding and verifying, and the bytes fetched,
    are reported to ``meter``."""
    meter = meter or Meter()
    for manifest in path:
        if max_model_bytes is not None and manifest.model_bytes > max_model_bytes:
            raise IncompatibleSnapshotError(
                f"snapshot {manifest.snapshot_id} holds {manifest.model_bytes} bytes of "
                f"tensors, more than the {max_model_bytes} allowed"
            )
    authenticated = reader.trusted is not None
    for manifest in path:
        t0 = time.perf_counter()
        if out is not None and any(shard.size > STREAM_PIECE_BYTES for shard in manifest.shards):
            state = await stream_snapshot(reader.store, manifest, state, out, authenticated=authenticated, meter=meter)
            continue
        shards = await fetch_shards(
            reader.store, manifest, concurrency=concurrency, meter=meter, authenticated=authenticated
        )
        meter.add("fetch", time.perf_counter() - t0)
        state = await asyncio.to_thread(apply_snapshot, state, manifest, shards, meter, out=out)
    if state is None:
        raise ChainError("nothing to replay")
    return state
