"""Never going back: the newest snapshot a reader has verified, and the check against it.

A store's HEAD is only a hint that anyone with write access can move back to an older, validly
signed snapshot, or to a snapshot of another run signed with the same key. A server remembers the
run and step it last verified in a small file beside its staging dir (``Settings.freshness_file``)
and ``delta-swap pull`` in its output folder's marker; both refuse a snapshot of another run or an
older step unless an operator asks (``/delta_swap/resync?allow_older=1``, ``pull --allow-older``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .atomic_file import atomic_write
from .errors import RollbackError
from .manifest import Manifest, check_run_id, check_snapshot_id

log = logging.getLogger("delta_swap.freshness")

FORMAT = "delta-swap-freshness"
MAX_RECORD_BYTES = 64 << 10


@dataclass(frozen=True)
class Seen:
    """The newest snapshot a reader verified: its run (None before run ids) and step."""

    run_id: str | None
    step: int
    snapshot_id: str

    @classmethod
    def of(cls, manifest: Manifest) -> Seen:
        return cls(manifest.run_id, manifest.step, manifest.snapshot_id)

    @classmethod
    def from_doc(cls, doc: object) -> Seen:
        """From a record or pull marker; ValueError if it names no valid step."""
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        step = doc.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"invalid step {step!r:.40}")
        try:
            return cls(check_run_id(doc.get("run_id")), step, check_snapshot_id(doc.get("snapshot_id")))
        except Exception as exc:
            raise ValueError(str(exc)) from None


def refuse_going_back(target: Manifest, seen: Seen | None, who: str, override: str) -> None:
    """Raise RollbackError if ``target`` belongs to another run than ``seen`` or is older than it.

    A ``seen`` without a run id (a chain from before run ids) accepts any run."""
    if seen is None:
        return
    if seen.run_id is not None and target.run_id != seen.run_id:
        raise RollbackError(
            f"{target.snapshot_id} belongs to run {target.run_id}, but {who} follows run {seen.run_id} "
            f"(last verified {seen.snapshot_id}); {override}"
        )
    if target.step < seen.step:
        raise RollbackError(
            f"{target.snapshot_id} would move {who} from step {seen.step} back to {target.step}; {override}"
        )


def record_path(staging_dir: str, store_url: str) -> Path:
    """The default record of a server following ``store_url``: one file per store in its staging dir."""
    digest = hashlib.sha256(store_url.encode()).hexdigest()[:16]
    return Path(staging_dir) / f"delta-swap-freshness-{digest}.json"


def load_record(path: Path) -> Seen | None:
    """The record at ``path``; None if there is none (an unreadable one is logged and ignored)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("delta-swap: cannot read the freshness record %s (%s); starting without it", path, exc)
        return None
    try:
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError("too large")
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not a delta-swap freshness record")
        return Seen.from_doc(doc)
    except (ValueError, RecursionError) as exc:
        log.warning("delta-swap: ignoring the unreadable freshness record %s (%s)", path, exc)
        return None


def save_record(path: Path, seen: Seen, store_url: str) -> None:
    """Write the record atomically (a temporary file renamed over it)."""
    doc = {"format": FORMAT, **asdict(seen), "store": store_url, "at": time.time()}
    with atomic_write(path, prefix=f".{path.name}.") as fh:
        fh.write(json.dumps(doc).encode())
