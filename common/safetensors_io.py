"""Plain safetensors files, written and parsed without torch (base shards and pulled checkpoints).

Layout: u64 little-endian header length, a JSON header, then the tensor bytes. Offsets this
module returns are absolute within the file, so a reader can fetch one tensor by range.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Iterable
from typing import BinaryIO

import numpy as np

from .dtypes import dtype_size
from .errors import CorruptDataError
from .tensors import HostTensor

_ALIGN = 8
MAX_HEADER_BYTES = 100 << 20


def build_header(
    tensors: Iterable[tuple[str, HostTensor]], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The encoded header and each tensor's absolute (offset, length) in the file."""
    return specs_header(((name, t.dtype, tuple(t.shape)) for name, t in tensors), metadata)


def specs_header(
    specs: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Like :func:`build_header`, from each tensor's (name, dtype, shape) alone."""
    items = [(name, dtype, shape, math.prod(shape) * dtype_size(dtype)) for name, dtype, shape in specs]
    doc: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    rel = 0
    for name, dtype, shape, nbytes in items:
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [rel, rel + nbytes]}
        rel += nbytes
    header = json.dumps(doc, separators=(",", ":")).encode()
    header += b" " * (-(len(header) + 8) % _ALIGN)
    start = 8 + len(header)
    locations, rel = {}, 0
    for name, _dtype, _shape, nbytes in items:
        locations[name] = (start + rel, nbytes)
        rel += nbytes
    return struct.pack("<Q", len(header)) + header, locations


def write_safetensors(
    fh: BinaryIO, tensors: Iterable[tuple[str, HostTensor]], metadata: dict[str, str] | None = None
) -> dict[str, tuple[int, int]]:
    """Stream a safetensors file into ``fh``; returns absolute (offset, length) per tensor."""
    items = list(tensors)
    header, locations = build_header(items, metadata)
    fh.write(header)
    for _, t in items:
        fh.write(memoryview(t.data))  # type: ignore[arg-type]  # numpy types ndarray a Buffer on 3.12+ only
    return locations


def parse_header(prefix: bytes | memoryview, file_size: int) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """Parse a safetensors header: name -> (dtype, shape, absolute offset, length).

    ``prefix`` must hold at least the first ``8 + header length`` bytes of the file.
    """
    if len(prefix) < 8:
        raise CorruptDataError("safetensors file is shorter than its length prefix")
    (hlen,) = struct.unpack_from("<Q", prefix, 0)
    if hlen > MAX_HEADER_BYTES or 8 + hlen > file_size:
        raise CorruptDataError(f"safetensors header length {hlen} is out of bounds")
    if len(prefix) < 8 + hlen:
        raise CorruptDataError("safetensors header is truncated")
    try:
        doc = json.loads(bytes(prefix[8 : 8 + hlen]))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptDataError(f"safetensors header is not JSON: {str(exc)[:120]}") from None
    if not isinstance(doc, dict):
        raise CorruptDataError("safetensors header is not an object")
    start = 8 + hlen
    out = {}
    for name, info in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptDataError(f"bad safetensors entry for {name}: {exc!r}") from None
        if any(d < 0 for d in shape) or not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise CorruptDataError(f"bad safetensors entry for {name}")
        if end - begin != math.prod(shape) * dtype_size(dtype) or start + end > file_size:
            raise CorruptDataError(f"safetensors entry {name} has a wrong size or runs past the file")
        out[name] = (dtype, shape, start + begin, end - begin)
    return out


def read_safetensors(data: bytes | memoryview | mmap.mmap | np.ndarray) -> dict[str, HostTensor]:
    """Parse a whole safetensors file held in memory (tensors view ``data``; no copy)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    entries = parse_header(memoryview(buf), buf.size)  # type: ignore[arg-type]  # numpy types ndarray a Buffer on 3.12+ only
    return {name: HostTensor(dt, shape, buf[off : off + ln]) for name, (dt, shape, off, ln) in entries.items()}
