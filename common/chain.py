"""Reading the snapshot chain: the head pointer, manifests, and the path to a snapshot."""

from __future__ import annotations

import json
from dataclasses import dataclass

from . import store_keys
from .errors import ChainError, CorruptDataError, NotFoundError
from .manifest import Manifest, SnapshotKind, check_snapshot_id
from .stores import Store


@dataclass(frozen=True)
class Head:
    """The newest committed snapshot, as the head pointer names it."""

    snapshot_id: str
    step: int


def encode_head(manifest: Manifest) -> bytes:
    return json.dumps({"snapshot_id": manifest.snapshot_id, "step": manifest.step, "kind": manifest.kind}).encode()


def decode_head(data: bytes) -> Head:
    try:
        doc = json.loads(data)
        head = Head(check_snapshot_id(doc["snapshot_id"]), int(doc["step"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptDataError(f"malformed HEAD: {exc!r}") from None
    return head


class ChainReader:
    """Reads and caches the manifests of one store. Manifests are immutable once committed."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._manifests: dict[str, Manifest] = {}
        self._head: Head | None = None
        self._head_etag: str | None = None

    async def head(self) -> Head | None:
        """The head pointer, or None for an empty store (a conditional read when it can be)."""
        try:
            changed = await self.store.get_if_changed(store_keys.HEAD_KEY, self._head_etag)
        except NotFoundError:
            self._head = self._head_etag = None
            return None
        if changed is not None:
            data, self._head_etag = changed
            self._head = decode_head(data)
        return self._head

    async def manifest(self, snapshot_id: str) -> Manifest:
        """The validated manifest of ``snapshot_id``; NotFoundError if it is not committed."""
        cached = self._manifests.get(snapshot_id)
        if cached is not None:
            return cached
        manifest = Manifest.from_json(await self.store.get(store_keys.manifest_key(snapshot_id)))
        if manifest.snapshot_id != snapshot_id:
            raise CorruptDataError(f"manifest at {snapshot_id} names itself {manifest.snapshot_id}")
        self._manifests[snapshot_id] = manifest
        return manifest

    async def snapshot_ids(self) -> list[str]:
        """Ids of every committed snapshot (those with a manifest), in store order."""
        keys = await self.store.list(store_keys.SNAPSHOTS_PREFIX)
        return [k.split("/")[1] for k in keys if k.count("/") == 2 and k.endswith("/manifest.json")]

    async def list(self) -> list[Manifest]:
        """Every committed snapshot, oldest step first.

        On stores that cannot list (plain HTTP), the chain from the head back to its base.
        """
        try:
            ids = await self.snapshot_ids()
        except NotImplementedError:
            head = await self.head()
            return [] if head is None else await self.path_to(head.snapshot_id)
        manifests = [await self.manifest(i) for i in ids]
        return sorted(manifests, key=lambda m: (m.step, m.kind is not SnapshotKind.BASE))

    async def latest_id(self) -> str | None:
        """The snapshot the head pointer names (None for an empty store)."""
        head = await self.head()
        return None if head is None else head.snapshot_id

    async def path_to(self, target_id: str, current_id: str | None = None) -> list[Manifest]:
        """Manifests to apply, oldest first, to reach ``target_id``.

        From ``current_id`` when the deltas link up from it, else from the nearest base.
        Raises ChainError when a delta's predecessor is missing or steps do not increase.
        """
        if target_id == current_id:
            return []
        path: list[Manifest] = []
        manifest = await self.manifest(target_id)
        while True:
            path.append(manifest)
            if manifest.snapshot_id == current_id and len(path) > 1:
                path.pop()  # already applied
                break
            if manifest.kind is SnapshotKind.BASE:
                break
            prev_id = manifest.prev_snapshot_id
            assert prev_id is not None
            try:
                prev = await self.manifest(prev_id)
            except NotFoundError:
                raise ChainError(f"snapshot {manifest.snapshot_id} needs {prev_id}, which is not in the store") from None
            if prev.step >= manifest.step:
                raise ChainError(f"snapshot {manifest.snapshot_id} (step {manifest.step}) follows a later step {prev.step}")
            if len(path) > 100_000:
                raise ChainError("snapshot chain does not end in a base")
            manifest = prev
        path.reverse()
        return path
