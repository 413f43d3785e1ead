"""Committing snapshots: how the parts that trainer ranks upload become one manifest and a new HEAD.

Every rank uploads its own shards and describes them in a :class:`Part`. With one rank the part
is committed at once; with several, each rank also stores its part under
``snapshots/<id>/parts/`` and whichever rank completes the set commits. Commit order is what
readers rely on: shards and files first, then the manifest (its presence means the snapshot is
complete), then ``HEAD``, which only ever moves forward.

A snapshot is a base when every part is full; a delta may mix full parts (a rank whose tensors
could not be diffed) with delta parts. Committing step N first makes sure step N-1 is committed,
so the chain has no holes even when ranks finish in any order.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from . import store_keys
from .chain import ChainReader, encode_head
from .errors import ChainError, CorruptDataError, NotFoundError
from .manifest import BlobEntry, Encoding, Manifest, SnapshotKind, TensorEntry
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
        try:
            doc = json.loads(data)
            doc["tensors"] = [TensorEntry(**{**t, "shape": tuple(t["shape"]), "encoding": Encoding(t["encoding"])})
                              for t in doc["tensors"]]
            doc["shards"] = [BlobEntry(**b) for b in doc["shards"]]
            doc["files"] = [BlobEntry(**b) for b in doc["files"]]
            return cls(**doc)
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptDataError(f"malformed part record: {exc!r}") from None


async def try_commit(store: Store, snapshot_id: str, world_size: int) -> Manifest | None:
    """Commit ``snapshot_id`` if every rank's part is present; returns the manifest or None."""
    keys = await store.list(store_keys.parts_prefix(snapshot_id))
    if len(keys) < world_size:
        return None
    parts = [Part.from_json(await store.get(store_keys.part_key(snapshot_id, r))) for r in range(world_size)]
    return await commit(store, parts)


async def commit(store: Store, parts: list[Part]) -> Manifest:
    """Merge ``parts`` into a manifest, write it after the shards, then move the head forward."""
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
    base_id = first.snapshot_id if is_base else await _base_of(store, reader, prev_id, first)
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
    Manifest.from_json(manifest.to_json())  # the same validation every reader applies
    await store.put(store_keys.manifest_key(manifest.snapshot_id), manifest.to_json())
    head = await reader.head()
    if head is None or head.step < manifest.step:
        await store.put(store_keys.HEAD_KEY, encode_head(manifest))
    return manifest


async def _base_of(store: Store, reader: ChainReader, prev_id: str | None, part: Part) -> str:
    """The base of the chain a delta continues, committing its predecessor first if needed."""
    assert prev_id is not None
    try:
        return (await reader.manifest(prev_id)).base_snapshot_id
    except NotFoundError:
        # Another rank may still be committing the previous step; its parts are all here.
        committed = await try_commit(store, prev_id, part.world_size)
        if committed is None:
            raise ChainError(f"cannot commit {part.snapshot_id}: previous snapshot {prev_id} is incomplete") from None
        return committed.base_snapshot_id
