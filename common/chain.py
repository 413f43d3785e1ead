"""Reading the snapshot chain: the head pointer, manifests, and the path to a snapshot.

Everything read here is untrusted until checked: HEAD is small and must agree with the manifest it
names, manifests are read up to a bound, their signature (when the reader trusts keys) is checked
before they are parsed, and parsing runs off the event loop.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass

from . import store_keys
from .errors import ChainError, CorruptDataError, NotFoundError, SignatureError
from .manifest import (
    Manifest,
    SnapshotKind,
    check_snapshot_id,
    load_json,
    manifest_bytes_limit,
    snapshot_id_for_step,
)
from .signing import MAX_SIGNATURE_BYTES, TrustedKeys
from .stores import Store, open_store

log = logging.getLogger("delta_swap.chain")

#: HEAD is a tiny JSON document; nothing larger is read.
MAX_HEAD_BYTES = 4096
#: Manifests one chain walk reads at once (the next link and the ids predicted below it).
READ_AHEAD = 16
#: The longest chain from a snapshot back to its base that a reader follows.
MAX_CHAIN_LENGTH = 100_000
_STEP_ID_RE = re.compile(r"step-(\d{1,19})")
_warned_unauthenticated = False


@dataclass(frozen=True)
class Head:
    """The newest committed snapshot, as the head pointer names it."""

    snapshot_id: str
    step: int


def encode_head(manifest: Manifest) -> bytes:
    return json.dumps({"snapshot_id": manifest.snapshot_id, "step": manifest.step, "kind": manifest.kind}).encode()


def decode_head(data: bytes) -> Head:
    """Parse a head pointer; CorruptDataError for anything but ``{"snapshot_id", "step"}``."""
    if len(data) > MAX_HEAD_BYTES:
        raise CorruptDataError(f"HEAD has {len(data)} bytes, more than the {MAX_HEAD_BYTES} allowed")
    doc = load_json(data, "HEAD")
    if not isinstance(doc, dict):
        raise CorruptDataError("malformed HEAD: not an object")
    step = doc.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= 1 << 62:
        raise CorruptDataError(f"malformed HEAD: invalid step {step!r:.40}")
    return Head(check_snapshot_id(doc.get("snapshot_id")), step)


def warn_unauthenticated_once() -> None:
    """Say once per process that snapshots are read without checking who published them."""
    global _warned_unauthenticated
    if not _warned_unauthenticated:
        _warned_unauthenticated = True
        log.warning(
            "delta-swap: snapshots are not authenticated (no trusted key): anyone who can write to the "
            "store can change the weights served; see docs/SECURITY.md"
        )


class ChainReader:
    """Reads the manifests of one store, keeping the newest ones in a bounded cache (a manifest
    is immutable once committed)."""

    def __init__(
        self,
        store: Store,
        trusted: TrustedKeys | None = None,
        *,
        expected_tensors: int | None = None,
        cache_size: int = 64,
    ) -> None:
        """``trusted``: accept only manifests signed by one of these keys. ``expected_tensors``:
        the tensor count of the served model, which bounds the manifest size read."""
        self.store = store
        self.trusted = trusted
        self.max_manifest_bytes = manifest_bytes_limit(expected_tensors)
        self._cache: OrderedDict[str, Manifest] = OrderedDict()
        self._cache_size = cache_size
        self._head: Head | None = None
        self._head_etag: str | None = None

    async def head(self) -> Head | None:
        """The head pointer, or None for an empty store (a conditional read when it can be).

        Raises CorruptDataError when HEAD is malformed or claims another step than the manifest
        it names (and NotFoundError when that manifest does not exist).
        """
        try:
            changed = await self.store.get_if_changed(store_keys.HEAD_KEY, self._head_etag, max_bytes=MAX_HEAD_BYTES)
        except NotFoundError:
            self._head = self._head_etag = None
            return None
        if changed is not None:
            data, etag = changed
            head = decode_head(data)
            manifest = await self.manifest(head.snapshot_id)
            if manifest.step != head.step:
                raise CorruptDataError(
                    f"HEAD claims step {head.step} for {head.snapshot_id}, whose manifest says step {manifest.step}"
                )
            self._head, self._head_etag = head, etag
        return self._head

    async def manifest(self, snapshot_id: str) -> Manifest:
        """The validated (and, with trusted keys, authenticated) manifest of ``snapshot_id``;
        NotFoundError if it is not committed."""
        cached = self._cache.get(snapshot_id)
        if cached is not None:
            self._cache.move_to_end(snapshot_id)
            return cached
        data_read = self.store.get(store_keys.manifest_key(snapshot_id), max_bytes=self.max_manifest_bytes)
        if self.trusted is None:
            warn_unauthenticated_once()
            data, signature = await data_read, None
        else:  # both reads at once: a round trip less per manifest on a remote store
            data, signature = await asyncio.gather(data_read, self._signature(snapshot_id))
        manifest = await asyncio.to_thread(self._parse, snapshot_id, data, signature)
        if manifest.snapshot_id != snapshot_id:
            raise CorruptDataError(f"manifest at {snapshot_id} names itself {manifest.snapshot_id}")
        if self.trusted is not None and any(b.sha256 is None for b in (*manifest.shards, *manifest.files)):
            raise SignatureError(f"snapshot {snapshot_id} is signed but lists a file without its SHA-256")
        self._cache[snapshot_id] = manifest
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return manifest

    async def _signature(self, snapshot_id: str) -> bytes | None:
        try:
            return await self.store.get(store_keys.signature_key(snapshot_id), max_bytes=MAX_SIGNATURE_BYTES)
        except NotFoundError:
            return None

    def _parse(self, snapshot_id: str, data: bytes, signature: bytes | None) -> Manifest:
        """Verify (with trusted keys) and parse a manifest's bytes: one trip off the event loop."""
        if self.trusted is not None:
            if signature is None:
                raise SignatureError(f"snapshot {snapshot_id} is not signed")
            self.trusted.verify(data, signature, snapshot_id)
        return Manifest.from_json(data, self.max_manifest_bytes)

    async def snapshot_ids(self) -> list[str]:
        """Ids of every committed snapshot (those with a manifest), in store order."""
        keys = await self.store.list(store_keys.SNAPSHOTS_PREFIX)
        return [k.split("/")[1] for k in keys if k.count("/") == 2 and k.endswith("/manifest.json")]

    async def list(self, *, skip_bad: bool = False) -> list[Manifest]:
        """Every committed snapshot, oldest step first.

        On stores that cannot list (plain HTTP), the chain from the head back to its base. With
        ``skip_bad``, snapshots whose manifest cannot be read or verified are left out.
        """
        try:
            ids = await self.snapshot_ids()
        except NotImplementedError:
            head = await self.head()
            return [] if head is None else await self.path_to(head.snapshot_id)
        slots = asyncio.Semaphore(READ_AHEAD)

        async def read(snapshot_id: str) -> Manifest | None:
            async with slots:
                try:
                    return await self.manifest(snapshot_id)
                except (CorruptDataError, NotFoundError):
                    if not skip_bad:
                        raise
                    return None

        results = await asyncio.gather(*map(read, sorted(ids)), return_exceptions=True)
        for result in results:  # the oldest snapshot's error, whichever read finished first
            if isinstance(result, BaseException):
                raise result
        manifests = [m for m in results if isinstance(m, Manifest)]
        return sorted(manifests, key=lambda m: (m.step, m.kind is not SnapshotKind.BASE))

    async def latest_id(self) -> str | None:
        """The snapshot the head pointer names (None for an empty store)."""
        head = await self.head()
        return None if head is None else head.snapshot_id

    async def path_to(self, target_id: str, current_id: str | None = None) -> builtins.list[Manifest]:
        """Manifests to apply, oldest first, to reach ``target_id``.

        From ``current_id`` when the deltas link up from it, else from the nearest base; nothing
        before that is read. Each manifest is read once, up to :data:`READ_AHEAD` at a time: while
        one link is checked, the ids the chain's spacing predicts below it are already in flight.
        Raises ChainError when a delta's predecessor is missing, steps do not increase, or a delta
        follows a snapshot of another run (one without a run id, from before them, may start one).
        """
        if target_id == current_id:
            return []
        path: list[Manifest] = []
        ahead = _ReadAhead(self, READ_AHEAD)
        try:
            manifest = await self.manifest(target_id)
            floor = max(_step_of(manifest.base_snapshot_id) or 0, _step_of(current_id) or 0)
            while True:
                path.append(manifest)
                if manifest.snapshot_id == current_id and len(path) > 1:
                    path.pop()  # already applied
                    break
                if manifest.kind is SnapshotKind.BASE:
                    break
                prev_id = manifest.prev_snapshot_id
                assert prev_id is not None
                ahead.schedule_below(manifest, prev_id, floor)
                try:
                    prev = await ahead.take(prev_id)
                except NotFoundError:
                    raise ChainError(
                        f"snapshot {manifest.snapshot_id} needs {prev_id}, which is not in the store"
                    ) from None
                if prev.step >= manifest.step:
                    raise ChainError(
                        f"snapshot {manifest.snapshot_id} (step {manifest.step}) follows a later step {prev.step}"
                    )
                if prev.run_id is not None and prev.run_id != manifest.run_id:
                    raise ChainError(
                        f"snapshot {manifest.snapshot_id} of run {manifest.run_id} follows {prev_id} "
                        f"of another run, {prev.run_id}"
                    )
                if len(path) > MAX_CHAIN_LENGTH:
                    raise ChainError("snapshot chain does not end in a base")
                manifest = prev
        finally:
            await ahead.close()
        path.reverse()
        return path


async def head_step_at(url: str, trusted: TrustedKeys | None = None) -> int | None:
    """The step of the head of the store at ``url`` (verified with ``trusted``), None for an empty
    store: what a restarted publisher has already published."""
    store = open_store(url, create=True)
    try:
        head = await ChainReader(store, trusted).head()
    finally:
        await store.close()
    return None if head is None else head.step


def _step_of(snapshot_id: str | None) -> int | None:
    """The step a publisher's snapshot id names (``step-0000000042`` -> 42), else None."""
    match = _STEP_ID_RE.fullmatch(snapshot_id or "")
    return int(match.group(1)) if match else None


class _ReadAhead:
    """Manifest reads of one chain walk, at most ``width`` in flight: the predecessor the walk
    needs next, and below it the ids that the chain's step spacing predicts. A prediction is a
    guess: the walk starts with one, and each guess it takes doubles the guesses allowed (up to
    ``width - 1``), each it passes halves them (down to one), so an irregular chain costs few
    missed reads."""

    def __init__(self, reader: ChainReader, width: int) -> None:
        self.reader = reader
        self.width = width
        self.guesses = 1
        self.guessed: set[str] = set()
        self.reads: dict[str, asyncio.Future[Manifest]] = {}

    def _start(self, snapshot_id: str) -> None:
        if snapshot_id not in self.reads:
            read = asyncio.ensure_future(self.reader.manifest(snapshot_id))
            read.add_done_callback(_retrieve)  # a guess dropped after it failed is no unretrieved error
            self.reads[snapshot_id] = read

    def schedule_below(self, manifest: Manifest, prev_id: str, floor: int) -> None:
        """Start reading ``prev_id`` and the ids spaced like ``manifest`` -> ``prev_id`` below it,
        down to step ``floor``; drop guesses the walk has passed."""
        prev_step = _step_of(prev_id)
        passed = [i for i in self.reads if i != prev_id and (_step_of(i) or 0) >= (prev_step or 0)]
        if passed:
            self.guesses = max(1, self.guesses // 2)
        for snapshot_id in passed:
            self.reads.pop(snapshot_id).cancel()
        self._start(prev_id)
        if prev_step is None or _step_of(manifest.snapshot_id) != manifest.step or prev_step >= manifest.step:
            return
        stride = manifest.step - prev_step
        step = prev_step - stride
        while step >= floor and len(self.reads) <= self.guesses:
            self.guessed.add(snapshot_id_for_step(step))
            self._start(snapshot_id_for_step(step))
            step -= stride

    async def take(self, snapshot_id: str) -> Manifest:
        if snapshot_id in self.guessed and snapshot_id in self.reads:
            self.guesses = min(self.width - 1, self.guesses * 2)
        self._start(snapshot_id)
        return await self.reads.pop(snapshot_id)

    async def close(self) -> None:
        for read in self.reads.values():
            read.cancel()
        await asyncio.gather(*self.reads.values(), return_exceptions=True)
        self.reads.clear()


def _retrieve(read: asyncio.Future[Manifest]) -> None:
    if not read.cancelled():
        read.exception()
