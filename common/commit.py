"""Committing snapshots: how the parts that trainer ranks upload become one manifest and a new HEAD.

Every rank uploads its own shards and describes them in a :class:`Part`. With one rank the part
is committed at once; with several, each rank also stores its part under
``snapshots/<id>/parts/`` (signed, when the trainer signs: ``rank-R.sig`` before ``rank-R.json``)
and whichever rank completes the set commits. The committing rank reads only parts it can verify
and that name this snapshot and rank; any other (a part planted in the store) is logged and left
out, and the real rank's upload replaces it under the same key. Commit order is what readers rely
on: shards and files first, then the signature (when the publisher signs), then the manifest (its
presence means the snapshot is complete), then ``HEAD``, which only ever moves forward (a
conditional write where the store has them).

A snapshot is a base when every part is full; a delta may mix full parts (a rank whose tensors
could not be diffed) with delta parts. A base takes rank 0's run id, a delta its predecessor's.
Committing step N first makes sure step N-1 is committed, so the chain has no holes even when
ranks finish in any order.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

from . import store_keys
from .chain import MAX_HEAD_BYTES, ChainReader, decode_head, encode_head
from .errors import ChainError, CorruptDataError, NotFoundError
from .manifest import (
    MAX_MANIFEST_BYTES,
    BlobEntry,
    Encoding,
    Manifest,
    SnapshotKind,
    TensorEntry,
    load_json,
    new_run_id,
)
from .signing import MAX_SIGNATURE_BYTES, PART_CONTEXT, SigningKey, TrustedKeys
from .stores import Store

log = logging.getLogger("delta_swap.commit")


@dataclass
class Part:
    """One rank's contribution to a snapshot: its tensors, the shards holding them and, for
    rank 0 of a full part, the checkpoint's side files."""

    snapshot_id: str
    step: int
    rank: int
    world_size: int
    #: Every tensor of this part is stored in full (raw), so it needs no previous state.
    full: bool
    prev_snapshot_id: str | None
    tensors: list[TensorEntry]
    shards: list[BlobEntry]
    files: list[BlobEntry]
    metadata: dict[str, str]
    #: The run the rank continues (rank 0's names the run of a new chain).
    run_id: str | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Part:
        """Parse a stored part (it is validated again as part of the merged manifest)."""
        doc = load_json(data, "part record")
        try:
            doc["tensors"] = [
                TensorEntry(**{**t, "shape": tuple(t["shape"]), "encoding": Encoding(t["encoding"])})
                for t in doc["tensors"]
            ]
            doc["shards"] = [BlobEntry(**b) for b in doc["shards"]]
            doc["files"] = [BlobEntry(**b) for b in doc["files"]]
            return cls(**doc)
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptDataError(f"malformed part record: {exc!r}") from None


async def write_part(store: Store, part: Part, signing_key: SigningKey | None = None) -> None:
    """Store one rank's part for the committing rank: its signature first, then the record."""
    data = part.to_json()
    if signing_key is not None:
        await store.put(
            store_keys.part_signature_key(part.snapshot_id, part.rank), signing_key.sign(data, PART_CONTEXT)
        )
    await store.put(store_keys.part_key(part.snapshot_id, part.rank), data)


async def try_commit(
    store: Store,
    snapshot_id: str,
    world_size: int,
    signing_key: SigningKey | None = None,
    max_step_jump: int = 1_000_000,
    trusted: TrustedKeys | None = None,
) -> Manifest | None:
    """Commit ``snapshot_id`` if every rank's part is present and verifies; returns the manifest
    or None. With ``trusted`` (default: the signing key's own), a part needs a signature by one
    of those keys; a part that is not signed, not verifiable or not this snapshot's and rank's is
    logged and counts as absent."""
    trusted = trusted or (signing_key.trusted() if signing_key else None)
    keys = await store.list(store_keys.parts_prefix(snapshot_id))
    if sum(k.endswith(".json") for k in keys) < world_size:
        return None
    parts = []
    for rank in range(world_size):
        try:
            parts.append(await _read_part(store, snapshot_id, rank, world_size, trusted))
        except NotFoundError:
            return None
        except CorruptDataError as exc:
            log.warning("delta-swap: ignoring the part of rank %d for %s: %s", rank, snapshot_id, exc)
            return None
    return await commit(store, parts, signing_key, max_step_jump, trusted)


async def _read_part(store: Store, snapshot_id: str, rank: int, world_size: int, trusted: TrustedKeys | None) -> Part:
    data = await store.get(store_keys.part_key(snapshot_id, rank), max_bytes=MAX_MANIFEST_BYTES)
    if trusted is not None:
        try:
            signature = await store.get(store_keys.part_signature_key(snapshot_id, rank), max_bytes=MAX_SIGNATURE_BYTES)
        except NotFoundError:
            raise CorruptDataError("it is not signed") from None
        trusted.verify_object(data, signature, f"part of rank {rank}", "part", PART_CONTEXT)
    part = Part.from_json(data)
    if (part.snapshot_id, part.rank, part.world_size) != (snapshot_id, rank, world_size):
        raise CorruptDataError(f"it describes rank {part.rank} of {part.world_size} of {part.snapshot_id}")
    return part


async def commit(
    store: Store,
    parts: list[Part],
    signing_key: SigningKey | None = None,
    max_step_jump: int = 1_000_000,
    trusted: TrustedKeys | None = None,
) -> Manifest:
    """Merge ``parts`` into a manifest, write its signature (with ``signing_key``) and then the
    manifest after the shards, then move the head forward. ``trusted`` (default: the signing
    key's own) is what the predecessor and HEAD must be signed by to count."""
    trusted = trusted or (signing_key.trusted() if signing_key else None)
    parts = sorted(parts, key=lambda p: p.rank)
    first = parts[0]
    if {p.snapshot_id for p in parts} != {first.snapshot_id} or {p.prev_snapshot_id for p in parts} != {
        first.prev_snapshot_id
    }:
        raise ChainError(f"ranks disagree about snapshot {first.snapshot_id} or its predecessor")
    if sorted(p.rank for p in parts) != list(range(first.world_size)):
        raise ChainError(f"snapshot {first.snapshot_id} has parts from ranks {sorted(p.rank for p in parts)}")
    is_base = all(p.full for p in parts)
    prev_id = None if is_base else first.prev_snapshot_id
    if prev_id is None and not is_base:
        raise ChainError(f"delta {first.snapshot_id} has no predecessor")
    reader = ChainReader(store, trusted)
    prev = None if is_base else await _predecessor(store, reader, prev_id, first, signing_key, max_step_jump, trusted)
    run_id = (prev and prev.run_id) or first.run_id or new_run_id()
    metadata: dict[str, str] = {}
    for p in parts:
        metadata.update(p.metadata)
    manifest = Manifest(
        snapshot_id=first.snapshot_id,
        step=first.step,
        kind=SnapshotKind.BASE if is_base else SnapshotKind.DELTA,
        prev_snapshot_id=prev_id,
        base_snapshot_id=first.snapshot_id if prev is None else prev.base_snapshot_id,
        tensors=tuple(sorted((t for p in parts for t in p.tensors), key=lambda t: t.name)),
        shards=tuple(s for p in parts for s in p.shards),
        files=tuple(f for p in parts for f in p.files),
        created_at=time.time(),
        metadata=metadata,
        run_id=run_id,
    )
    data = manifest.to_json()
    Manifest.from_json(data)  # the same validation every reader applies
    if signing_key is not None:
        await store.put(store_keys.signature_key(manifest.snapshot_id), signing_key.sign(data))
    await store.put(store_keys.manifest_key(manifest.snapshot_id), data)
    await move_head(store, manifest, max_step_jump, trusted)
    return manifest


async def move_head(
    store: Store, manifest: Manifest, max_step_jump: int = 1_000_000, trusted: TrustedKeys | None = None
) -> bool:
    """Point HEAD at ``manifest`` unless it already names a later step of the same run; True if
    it moved.

    A HEAD that cannot be read, names a missing manifest (or, with ``trusted``, one not signed by
    those keys), disagrees with it, names another run, or runs more than ``max_step_jump`` steps
    ahead is garbage and gets replaced. Where the store supports conditional writes (file, S3,
    MinIO), HEAD is replaced only if nobody changed it since it was read, so concurrent committers
    can never move it backwards.
    """
    reader = ChainReader(store, trusted)
    for _ in range(16):
        try:
            current = await store.get_if_changed(store_keys.HEAD_KEY, None, max_bytes=MAX_HEAD_BYTES)
        except NotFoundError:
            current = None
        except CorruptDataError:  # larger than any HEAD: garbage, and its tag is unknown: no condition
            await store.put(store_keys.HEAD_KEY, encode_head(manifest))
            return True
        etag = None if current is None else current[1]
        if current is not None and await _announces_later(reader, current[0], manifest, max_step_jump):
            return False
        try:
            if await store.put_if(store_keys.HEAD_KEY, encode_head(manifest), etag):
                return True
        except NotImplementedError:  # a backend without conditional writes: last writer wins
            await store.put(store_keys.HEAD_KEY, encode_head(manifest))
            return True
    raise ChainError(f"HEAD kept changing while committing {manifest.snapshot_id}; commit it again")


async def _announces_later(reader: ChainReader, data: bytes, manifest: Manifest, max_step_jump: int) -> bool:
    try:
        head = decode_head(data)
        named = await reader.manifest(head.snapshot_id)
    except (CorruptDataError, NotFoundError):
        return False
    same_run = named.run_id is None or named.run_id == manifest.run_id
    return same_run and named.step == head.step and manifest.step <= head.step <= manifest.step + max_step_jump


async def _predecessor(
    store: Store,
    reader: ChainReader,
    prev_id: str | None,
    part: Part,
    signing_key: SigningKey | None,
    max_step_jump: int,
    trusted: TrustedKeys | None,
) -> Manifest:
    """The snapshot a delta continues, committing it first if needed (a manifest that does not
    verify, with ``trusted``, is not committed: it is replaced)."""
    assert prev_id is not None
    try:
        return await reader.manifest(prev_id)
    except (NotFoundError, CorruptDataError) as exc:
        if isinstance(exc, CorruptDataError) and trusted is None:
            raise
    # Another rank may still be committing the previous step; its parts are all here.
    committed = await try_commit(store, prev_id, part.world_size, signing_key, max_step_jump, trusted)
    if committed is None:
        raise ChainError(f"cannot commit {part.snapshot_id}: previous snapshot {prev_id} is incomplete")
    return committed
