"""Where things live in a store: every key delta-swap reads or writes is built here."""

from __future__ import annotations

from .manifest import Encoding, check_relative_name, check_snapshot_id
from .shard_format import DELTA_SHARD_EXT

HEAD_KEY = "HEAD"
#: The trainer's signed heartbeat: its run, newest step and when it last wrote (see heartbeat.py).
HEARTBEAT_KEY = "heartbeat.json"
SNAPSHOTS_PREFIX = "snapshots/"


def snapshot_prefix(snapshot_id: str) -> str:
    return f"{SNAPSHOTS_PREFIX}{check_snapshot_id(snapshot_id)}/"


def manifest_key(snapshot_id: str) -> str:
    """Written last of a snapshot: its presence means the snapshot is complete."""
    return snapshot_prefix(snapshot_id) + "manifest.json"


def signature_key(snapshot_id: str) -> str:
    """The publisher's signature over the manifest's bytes (written just before the manifest)."""
    return snapshot_prefix(snapshot_id) + "manifest.sig"


def shard_key(snapshot_id: str, shard: str) -> str:
    return snapshot_prefix(snapshot_id) + check_relative_name(shard, "shard")


def file_key(snapshot_id: str, name: str) -> str:
    return snapshot_prefix(snapshot_id) + "files/" + check_relative_name(name, "file")


def part_key(snapshot_id: str, rank: int) -> str:
    """One rank's contribution to a multi-rank snapshot, merged into the manifest at commit."""
    return snapshot_prefix(snapshot_id) + f"parts/rank-{rank:05d}.json"


def part_signature_key(snapshot_id: str, rank: int) -> str:
    """The rank's signature over its part record (signing trainers; written just before the part)."""
    return snapshot_prefix(snapshot_id) + f"parts/rank-{rank:05d}.sig"


def parts_prefix(snapshot_id: str) -> str:
    return snapshot_prefix(snapshot_id) + "parts/"


def shard_name(rank: int, world_size: int, encoding: Encoding) -> str:
    """A rank's shard: a plain safetensors file for raw tensors, else a delta shard (.dsd)."""
    ext = "safetensors" if encoding is Encoding.RAW else DELTA_SHARD_EXT
    return f"shard-{rank:05d}-of-{world_size:05d}.{ext}"
