"""Retention: deleting snapshots that no server needs any more, so a long run's store stays bounded.

A server rebuilds the newest snapshot from the newest base at or before it, so everything older
than the ``keep_bases``-th newest base can go. The manifest of a snapshot is deleted first (its
absence marks the snapshot as gone for every reader), then the rest of its objects. A server
that was part-way through an old chain when it disappeared falls back to the newest base, as it
does for any chain it cannot follow.
"""

from __future__ import annotations

from . import store_keys
from .chain import ChainReader
from .manifest import SnapshotKind
from .stores import Store


async def prune(store: Store, keep_bases: int, reader: ChainReader | None = None) -> list[str]:
    """Delete every snapshot older than the ``keep_bases``-th newest base; returns their ids.

    Does nothing while the store holds ``keep_bases`` bases or fewer, or when ``keep_bases`` < 1.
    """
    if keep_bases < 1:
        return []
    reader = reader or ChainReader(store)
    manifests = await reader.list(skip_bad=True)
    bases = [m for m in manifests if m.kind is SnapshotKind.BASE]
    if len(bases) <= keep_bases:
        return []
    floor = bases[-keep_bases].step
    gone = [m.snapshot_id for m in manifests if m.step < floor]
    for snapshot_id in gone:
        await store.delete(store_keys.manifest_key(snapshot_id))
        for key in await store.list(store_keys.snapshot_prefix(snapshot_id)):
            await store.delete(key)
    return gone
