"""The trainer's heartbeat: a small signed object that says which step it published last, and when.

HEAD can be held back by whoever controls the store (left on an old, validly signed snapshot, or
deleted), and a server that only reads HEAD then believes it is up to date. The trainer therefore
also writes ``heartbeat.json`` after every commit and every few seconds in between (in the spirit
of TUF's timestamp role): its run, the newest step it committed, when that was published, when the
heartbeat was written and until when it is valid. Servers read it on every poll, conditionally,
and report ``trainer_seen_seconds`` and ``published_step_seen``: a frozen or withheld HEAD shows as
staleness, a trainer (or heartbeat) that stopped as a growing ``trainer_seen_seconds``.

The object is one JSON document, so a reader never sees a body and a signature from different
writes: ``{"format": "delta-swap-heartbeat", "body": "<JSON text>", "signature": {...} | null}``,
the signature over the exact body text (context ``delta-swap/heartbeat/v1``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from . import store_keys
from .errors import CorruptDataError, NotFoundError, SignatureError
from .manifest import Manifest, check_run_id, check_snapshot_id, load_json
from .signing import HEARTBEAT_CONTEXT, SigningKey, TrustedKeys
from .stores import Store

FORMAT = "delta-swap-heartbeat"
#: A heartbeat is tiny; nothing larger is read.
MAX_HEARTBEAT_BYTES = 4096


@dataclass(frozen=True)
class Heartbeat:
    """What the trainer last said about itself."""

    run_id: str | None
    #: The newest step (and its snapshot) the trainer committed, and when that snapshot was made.
    step: int
    snapshot_id: str
    published_at: float
    #: When the trainer wrote this heartbeat, and until when a reader should take it as current.
    at: float
    expires_at: float

    @classmethod
    def of(cls, manifest: Manifest, ttl: float, now: float | None = None) -> Heartbeat:
        now = time.time() if now is None else now
        return cls(manifest.run_id, manifest.step, manifest.snapshot_id, manifest.created_at, now, now + ttl)

    def encode(self, key: SigningKey | None) -> bytes:
        """The stored object, signed with ``key`` when given."""
        body = json.dumps(asdict(self))
        signature = None if key is None else json.loads(key.sign(body.encode(), HEARTBEAT_CONTEXT))
        return json.dumps({"format": FORMAT, "body": body, "signature": signature}).encode()

    @classmethod
    def decode(cls, data: bytes, trusted: TrustedKeys | None) -> Heartbeat:
        """Parse (and, with ``trusted``, verify) a stored heartbeat; CorruptDataError or
        SignatureError for anything else."""
        if len(data) > MAX_HEARTBEAT_BYTES:
            raise CorruptDataError(f"the heartbeat has {len(data)} bytes, more than the {MAX_HEARTBEAT_BYTES} allowed")
        doc = load_json(data, "heartbeat")
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("body"), str):
            raise CorruptDataError("not a delta-swap heartbeat")
        if trusted is not None:
            if doc.get("signature") is None:
                raise SignatureError("the heartbeat is not signed")
            trusted.verify_object(
                doc["body"].encode(), json.dumps(doc["signature"]), "the heartbeat", "heartbeat", HEARTBEAT_CONTEXT
            )
        body = load_json(doc["body"], "heartbeat body")
        try:
            beat = cls(
                run_id=check_run_id(body["run_id"]),
                step=body["step"],
                snapshot_id=check_snapshot_id(body["snapshot_id"]),
                published_at=_time(body["published_at"]),
                at=_time(body["at"]),
                expires_at=_time(body["expires_at"]),
            )
        except (KeyError, TypeError) as exc:
            raise CorruptDataError(f"malformed heartbeat: {exc!r:.120}") from None
        if not isinstance(beat.step, int) or isinstance(beat.step, bool) or not 0 <= beat.step <= 1 << 62:
            raise CorruptDataError(f"malformed heartbeat: invalid step {beat.step!r:.40}")
        return beat


def _time(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CorruptDataError(f"malformed heartbeat: invalid time {value!r:.40}")
    return float(value)


async def write_heartbeat(store: Store, manifest: Manifest, key: SigningKey | None, ttl: float) -> Heartbeat:
    """Write the heartbeat for ``manifest``, the newest snapshot the trainer committed."""
    beat = Heartbeat.of(manifest, ttl)
    await store.put(store_keys.HEARTBEAT_KEY, beat.encode(key))
    return beat


class HeartbeatReader:
    """Reads a store's heartbeat with conditional requests (an unchanged one costs no body)."""

    def __init__(self, store: Store, trusted: TrustedKeys | None) -> None:
        self.store, self.trusted = store, trusted
        self._etag: str | None = None
        self._last: Heartbeat | None = None

    async def read(self) -> Heartbeat | None:
        """The heartbeat in the store (None if there is none); CorruptDataError or SignatureError
        for one that is malformed or not signed by a trusted key."""
        try:
            changed = await self.store.get_if_changed(
                store_keys.HEARTBEAT_KEY, self._etag, max_bytes=MAX_HEARTBEAT_BYTES
            )
        except NotFoundError:
            self._etag = self._last = None
            return None
        if changed is not None:
            data, etag = changed
            self._etag, self._last = None, None
            self._last = Heartbeat.decode(data, self.trusted)
            self._etag = etag
        return self._last
