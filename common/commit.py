"""Committing snapshots: how the parts that trainer ranks upload become one manifest and a new HEAD.

Every rank uploads its own shards and describes them in a :class:`Part`. With one rank the part
is committed at once; with several, each rank also stores its part under
``snapshots/<id>/parts/`` and whichever rank completes the set commits. Commit order is what
readers rely on: shards and files first, then the signature (when the publisher signs), then the
manifest (its presence means the snapshot is complete), then ``HEAD``, which only ever moves
forward (a conditional write where the store has them).

A snapshot is a base when every part is full; a delta may mix full parts (a rank whose tensors
could not be diffed) with delta parts. Committing step N first makes sure step N-1 is committed,
so the chain has no holes even when ranks finish in any order.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from . import store_keys
from .chain import MAX_HEAD_BYTES, ChainReader, decode_head, encode_head
from .errors import ChainError, CorruptDataError, NotFoundError
from .manifest import MAX_MANIFEST_BYTES, BlobEntry, Encoding, Manifest, SnapshotKind, TensorEntry, load_json
from .signing import SigningKey
from .stores import Store


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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Part:
        """Parse a stored part (it is validated again as part of the merged manifest)."""
        doc = load_json(data, "part record")
        try:
            doc["tensors"] = [TensorEntry(**{**t, "shape": tuple(t["shape"]), "encoding": Encoding(t["encoding"])})
                              for t in doc["tensors"]]
            doc["shards"] = [BlobEntry(**b) for b in doc["shards"]]
            doc["files"] = [BlobEntry(**b) for b in doc["files"]]
            return cls(**doc)
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptDataError(f"malformed part record: {exc!r}") from None


async def try_commit(store: Store, snapshot_id: str, world_size: int, signing_key: SigningKey | None = None,
                     max_step_jump: int = 1_000_000) -> Manifest | None:
    """Commit ``snapshot_id`` if every rank's part is present; returns the manifest or None."""
    keys = await store.list(store_keys.parts_prefix(snapshot_id))
    if len(keys) < world_size:
        return None
    parts = [Part.from_json(await store.get(store_keys.part_key(snapshot_id, r), max_bytes=MAX_MANIFEST_BYTES))
             for r in range(world_size)]
    return await commit(store, parts, signing_key, max_step_jump)


async def commit(store: Store, parts: list[Part], signing_key: SigningKey | None = None,
                 max_step_jump: int = 1_000_000) -> Manifest:
    """Merge ``parts`` into a manifest, write its signature (with ``signing_key``) and then the
    manifest after the shards, then move the head forward."""
    first = parts[0]
    if {p.snapshot_id for p in parts} != {first.snapshot_id} or {p.prev_snapshot_id for p in parts} != {first.prev_snapshot_id}:
        raise ChainError(f"ranks disagree about snapshot {first.snapshot_id} or its predecessor")
    if sorted(p.rank for p in parts) != list(range(first.world_size)):
        raise ChainError(f"snapshot {first.snapshot_id} has parts from ranks {sorted(p.rank for p in parts)}")
    is_base = all(p.full for p in parts)
    prev_id = None if is_base else first.prev_snapshot_id
    if prev_id is None and not is_base:
        raise ChainError(f"delta {first.snapshot_id} has no predecessor")
    reader = ChainReader(store)
    base_id = first.snapshot_id if is_base else await _base_of(store, reader, prev_id, first, signing_key,
                                                                max_step_jump)
    metadata: dict[str, str] = {}
    for p in parts:
        metadata.update(p.metadata)
    manifest = Manifest(
        snapshot_id=first.snapshot_id,
        step=first.step,
        kind=SnapshotKind.BASE if is_base else SnapshotKind.DELTA,
        prev_snapshot_id=prev_id,
        base_snapshot_id=base_id,
        tensors=tuple(sorted((t for p in parts for t in p.tensors), key=lambda t: t.name)),
        shards=tuple(s for p in parts for s in p.shards),
        files=tuple(f for p in parts for f in p.files),
        created_at=time.time(),
        metadata=metadata,
    )
    data = manifest.to_json()
    Manifest.from_json(data)  # the same validation every reader applies
    if signing_key is not None:
        await store.put(store_keys.signature_key(manifest.snapshot_id), signing_key.sign(data))
    await store.put(store_keys.manifest_key(manifest.snapshot_id), data)
    await move_head(store, manifest, max_step_jump)
    return manifest


async def move_head(store: Store, manifest: Manifest, max_step_jump: int = 1_000_000) -> bool:
    """Point HEAD at ``manifest`` unless it already names a later step; True if it moved.

    A HEAD that cannot be read, names a missing manifest, disagrees with it, or runs more than
    ``max_step_jump`` steps ahead is garbage and gets replaced. Where the store supports
    conditional writes (file, S3, MinIO), HEAD is replaced only if nobody changed it since it was
    read, so concurrent committers can never move it backwards.
    """
    reader = ChainReader(store)
    for _ in range(16):
        try:
            current = await store.get_if_changed(store_keys.HEAD_KEY, None, max_bytes=MAX_HEAD_BYTES)
        except NotFoundError:
            current = None
        except CorruptDataError:  # larger than any HEAD: garbage
            current = (b"", None)
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
    return named.step == head.step and manifest.step <= head.step <= manifest.step + max_step_jump


async def _base_of(store: Store, reader: ChainReader, prev_id: str | None, part: Part,
                   signing_key: SigningKey | None, max_step_jump: int) -> str:
    """The base of the chain a delta continues, committing its predecessor first if needed."""
    assert prev_id is not None
    try:
        return (await reader.manifest(prev_id)).base_snapshot_id
    except NotFoundError:
        # Another rank may still be committing the previous step; its parts are all here.
        committed = await try_commit(store, prev_id, part.world_size, signing_key, max_step_jump)
        if committed is None:
            raise ChainError(f"cannot commit {part.snapshot_id}: previous snapshot {prev_id} is incomplete") from None
        return committed.base_snapshot_id
