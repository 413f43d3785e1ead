"""Snapshot manifests: the JSON document that describes one snapshot (see docs/FORMAT.md).

Parsing validates everything a reader later trusts, and turns any malformed input into
CorruptDataError: the format version, identifiers and names that become paths (whole-string
matches: no trailing newline slips through), dtypes, shapes (bounded), encodings, checksums,
byte ranges (inside their shard, never overlapping another tensor's), finite numbers, and
nesting (a hostile document cannot exhaust the parser's stack).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from .dtypes import dtype_size
from .errors import CorruptDataError, FormatVersionError

FORMAT_NAME = "delta-swap"
#: Written by this build: 4 = codec v2 (``DSC2``) payloads of large tensors may be split into
#: parts (method 3); version 3: they may have predicted signs; version 2: neither; version 1:
#: codec v1 payloads only.
FORMAT_VERSION = 4
#: Read by this build: stores of every earlier version stay readable.
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4)


class SnapshotKind(str, Enum):
    """A base holds every tensor in full; a delta holds the changes since ``prev_snapshot_id``."""

    BASE = "base"
    DELTA = "delta"

    def __str__(self) -> str:
        return self.value


class Encoding(str, Enum):
    """How one tensor of a snapshot is stored."""

    RAW = "raw"  # plain bytes in a safetensors shard
    FULL = "full"  # a codec payload of the tensor on its own
    DELTA = "delta"  # a codec payload against the same tensor in the previous snapshot
    SAME = "same"  # unchanged since the previous snapshot: no bytes

    def __str__(self) -> str:
        return self.value


#: Largest tensor a manifest may describe (1 TiB): bounds every allocation a reader makes.
MAX_TENSOR_BYTES = 1 << 40
#: Largest manifest any reader accepts; servers use a smaller bound scaled to the served model.
MAX_MANIFEST_BYTES = 256 << 20
#: Manifest bytes a reader allows per tensor it expects (plus a fixed allowance), when it knows.
MANIFEST_BYTES_PER_TENSOR = 2048
MANIFEST_BYTES_BASE = 1 << 20

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_TENSOR_NAME_RE = re.compile(r"[^\x00-\x1f\x7f]{1,1024}")
_CHECKSUM_RE = re.compile(r"xxh3_128:[0-9a-f]{32}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def manifest_bytes_limit(n_tensors: int | None) -> int:
    """The largest manifest a reader expecting ``n_tensors`` tensors should accept."""
    if not n_tensors:
        return MAX_MANIFEST_BYTES
    return min(MAX_MANIFEST_BYTES, MANIFEST_BYTES_BASE + MANIFEST_BYTES_PER_TENSOR * n_tensors)


def check_snapshot_id(snapshot_id: Any) -> str:
    """Return ``snapshot_id`` if it is a safe identifier (it becomes part of store keys)."""
    if not isinstance(snapshot_id, str) or not _ID_RE.fullmatch(snapshot_id) or ".." in snapshot_id:
        raise CorruptDataError(f"invalid snapshot id {snapshot_id!r:.80}")
    return snapshot_id


def check_relative_name(name: Any, what: str) -> str:
    """Return ``name`` if it is a relative path that cannot escape its folder."""
    if not isinstance(name, str) or not name or len(name) > 1024:
        raise CorruptDataError(f"invalid {what} name {name!r:.80}")
    for segment in name.split("/"):
        if not _SEGMENT_RE.fullmatch(segment) or segment in (".", ".."):
            raise CorruptDataError(f"invalid {what} name {name!r:.80}")
    return name


def load_json(data: bytes | str, what: str) -> Any:
    """Parse untrusted JSON: NaN and Infinity are refused, and every failure (including a
    document nested deep enough to exhaust the parser) is a CorruptDataError."""
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptDataError(f"{what} is not valid JSON: {str(exc)[:120]}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def snapshot_id_for_step(step: int) -> str:
    """The id every rank derives for ``step`` without talking to the others."""
    return f"step-{step:010d}"


def new_run_id() -> str:
    """A fresh run id (64 random bits), fixed at the first base of a chain."""
    return f"run-{secrets.token_hex(8)}"


def check_run_id(run_id: Any) -> str | None:
    """Return ``run_id`` if it is None (a chain from before run ids) or a safe identifier."""
    if run_id is None:
        return None
    if not isinstance(run_id, str) or not _ID_RE.fullmatch(run_id):
        raise CorruptDataError(f"invalid run id {run_id!r:.80}")
    return run_id


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the rebuilt model and where its bytes are."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding
    checksum: str
    shard: str | None = None
    offset: int = 0
    length: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the rebuilt tensor."""
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True)
class BlobEntry:
    """A stored file (shard or non-tensor checkpoint file) with its size and checksums: xxh3-128
    (fast integrity) and SHA-256 (what a signature over the manifest vouches for)."""

    name: str
    size: int
    checksum: str
    sha256: str | None = None


@dataclass(frozen=True)
class Manifest:
    """A committed snapshot: a full base, or a delta against ``prev_snapshot_id``."""

    snapshot_id: str
    step: int
    kind: SnapshotKind
    prev_snapshot_id: str | None
    base_snapshot_id: str
    tensors: tuple[TensorEntry, ...]
    shards: tuple[BlobEntry, ...]
    files: tuple[BlobEntry, ...] = ()
    created_at: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    #: The run this snapshot belongs to: fixed at the chain's first base, carried by every later
    #: snapshot, covered by the signature. None in manifests written before run ids.
    run_id: str | None = None
    format_version: int = FORMAT_VERSION

    @property
    def model_bytes(self) -> int:
        """Raw bytes of every tensor of the rebuilt model."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Name -> (dtype, shape) of every tensor of the rebuilt model."""
        return {t.name: (t.dtype, t.shape) for t in self.tensors}

    @property
    def payload_bytes(self) -> int:
        """Bytes stored for this snapshot's tensors (its shards)."""
        return sum(s.size for s in self.shards)

    def to_json(self) -> bytes:
        doc = {"format": FORMAT_NAME, **asdict(self)}
        doc["model_bytes"], doc["payload_bytes"] = self.model_bytes, self.payload_bytes
        return json.dumps(doc, indent=1, sort_keys=False).encode()

    @classmethod
    def from_json(cls, data: bytes, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
        """Parse and validate a manifest; raises CorruptDataError or FormatVersionError."""
        if len(data) > max_bytes:
            raise CorruptDataError(f"manifest has {len(data)} bytes, more than the {max_bytes} allowed")
        return _parse_manifest(load_json(data, "manifest"))


def _parse_manifest(doc: Any) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptDataError("not a delta-swap manifest")
    version = doc.get("format_version")
    if type(version) is not int or version not in READABLE_FORMAT_VERSIONS:
        raise FormatVersionError(
            f"unsupported format version {version!r} (this build reads {', '.join(map(str, READABLE_FORMAT_VERSIONS))})"
        )
    try:
        kind = _enum(SnapshotKind, doc["kind"], "snapshot kind")
        prev = doc["prev_snapshot_id"]
        if kind is SnapshotKind.BASE and prev is not None:
            raise CorruptDataError("a base snapshot has no prev_snapshot_id")
        if kind is SnapshotKind.DELTA:
            check_snapshot_id(prev)
        manifest = Manifest(
            snapshot_id=check_snapshot_id(doc["snapshot_id"]),
            step=_int(doc["step"], "step"),
            kind=kind,
            prev_snapshot_id=prev,
            base_snapshot_id=check_snapshot_id(doc["base_snapshot_id"]),
            tensors=tuple(_parse_tensor(t) for t in _list(doc["tensors"], "tensors")),
            shards=tuple(_parse_blob(b, "shard") for b in _list(doc["shards"], "shards")),
            files=tuple(_parse_blob(b, "file") for b in _list(doc.get("files", []), "files")),
            created_at=_finite(doc.get("created_at", 0.0), "created_at"),
            metadata=_metadata(doc.get("metadata", {})),
            run_id=check_run_id(doc.get("run_id")),
            format_version=version,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptDataError(f"malformed manifest: {exc!r:.200}") from None
    _check_consistency(manifest)
    return manifest


def _enum(cls: type[Enum], value: Any, what: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise CorruptDataError(f"unknown {what} {value!r}") from None


def _int(value: Any, what: str, limit: int = 1 << 62) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise CorruptDataError(f"invalid {what} {value!r:.40}")
    return value


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CorruptDataError(f"invalid {what} {value!r:.40}")
    return float(value)


def _metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or len(value) > 1024:
        raise CorruptDataError("metadata must be an object of at most 1024 strings")
    if not all(isinstance(k, str) and isinstance(v, str) and len(k) + len(v) < 65536 for k, v in value.items()):
        raise CorruptDataError("metadata keys and values must be short strings")
    return dict(value)


def _checksum(value: Any, pattern: re.Pattern[str], what: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise CorruptDataError(f"invalid {what} {value!r:.80}")
    return value


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise CorruptDataError(f"{what} must be a list")
    return value


def _parse_tensor(doc: Any) -> TensorEntry:
    if not isinstance(doc, dict):
        raise CorruptDataError("tensor entry must be an object")
    name = doc["name"]
    if not isinstance(name, str) or not _TENSOR_NAME_RE.fullmatch(name):
        raise CorruptDataError(f"invalid tensor name {name!r:.80}")
    shape = tuple(_int(d, f"dimension of {name}") for d in _list(doc["shape"], "shape"))
    if len(shape) > 16:
        raise CorruptDataError(f"tensor {name} has {len(shape)} dimensions")
    entry = TensorEntry(
        name=name,
        dtype=str(doc["dtype"]),
        shape=shape,
        encoding=_enum(Encoding, doc["encoding"], f"encoding of tensor {name}"),
        checksum=_checksum(doc["checksum"], _CHECKSUM_RE, f"checksum of tensor {name}"),
        shard=None if doc.get("shard") is None else check_relative_name(doc["shard"], "shard"),
        offset=_int(doc.get("offset", 0), "offset"),
        length=_int(doc.get("length", 0), "length"),
    )
    dtype_size(entry.dtype)
    if entry.nbytes > MAX_TENSOR_BYTES:
        raise CorruptDataError(f"tensor {name} claims {entry.nbytes} bytes")
    if (entry.encoding is Encoding.SAME) != (entry.shard is None):
        raise CorruptDataError(f"tensor {name}: encoding {entry.encoding} with shard {entry.shard!r}")
    if entry.encoding is Encoding.RAW and entry.length != entry.nbytes:
        raise CorruptDataError(f"tensor {name}: raw length {entry.length} != {entry.nbytes}")
    return entry


def _parse_blob(doc: Any, what: str) -> BlobEntry:
    if not isinstance(doc, dict):
        raise CorruptDataError(f"{what} entry must be an object")
    name = check_relative_name(doc["name"], what)
    sha256 = doc.get("sha256")
    return BlobEntry(
        name=name,
        size=_int(doc["size"], f"{what} size"),
        checksum=_checksum(doc["checksum"], _CHECKSUM_RE, f"checksum of {what} {name}"),
        sha256=None if sha256 is None else _checksum(sha256, _SHA256_RE, f"sha256 of {what} {name}"),
    )


def _check_consistency(m: Manifest) -> None:
    names = [t.name for t in m.tensors]
    if len(set(names)) != len(names):
        raise CorruptDataError("manifest lists a tensor twice")
    shards = {s.name: s for s in m.shards}
    if len(shards) != len(m.shards):
        raise CorruptDataError("manifest lists a shard twice")
    if len({f.name for f in m.files}) != len(m.files):
        raise CorruptDataError("manifest lists a file twice")
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for t in m.tensors:
        if t.shard is None:
            continue
        if t.shard not in shards:
            raise CorruptDataError(f"tensor {t.name} points at unknown shard {t.shard}")
        if t.offset + t.length > shards[t.shard].size:
            raise CorruptDataError(f"tensor {t.name} runs past the end of shard {t.shard}")
        if m.kind is SnapshotKind.BASE and t.encoding is not Encoding.RAW:
            raise CorruptDataError(f"base snapshot stores tensor {t.name} as {t.encoding}")
        ranges.setdefault(t.shard, []).append((t.offset, t.offset + t.length, t.name))
    for shard, spans in ranges.items():  # every stored byte belongs to at most one tensor
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise CorruptDataError(f"tensors {first} and {second} share bytes of shard {shard}")
    if m.kind is SnapshotKind.BASE and m.base_snapshot_id != m.snapshot_id:
        raise CorruptDataError("a base snapshot must be its own base")
