"""Codec v1 (``DSC1``): kept so that stores written before codec v2 still decode bit-exact.

New payloads are written by :mod:`.v2`; :mod:`delta_swap.codec` dispatches on the magic. The encoder
stays too (``CodecConfig(version=1)``), for the benchmark's comparison and the stored test fixtures.

Adjacent RL checkpoints differ in ~1-2% of elements, and almost every change moves a float by a
few units in the last place (ULPs). A delta payload therefore stores

* the *positions* of changed elements, as gaps between them (split into byte planes) or as a
  bitmap, whichever compresses smaller, and
* the *values*: for sign-magnitude floats (bf16, fp16, fp32, fp8 e4m3fn/e5m2) the signed distance
  between old and new element in ordered-integer space (mostly +-1), zigzag-coded and split into
  byte planes; for any other dtype the XOR of old and new bits.

Each stream is compressed with zstd (or stored raw when that is smaller). A *full* payload
stores one tensor without a reference, split into byte planes.

Wire format (little endian), see docs/FORMAT.md::

    header   magic "DSC1" | method u8 | transform u8 | elem_size u8 | n_sections u8
             | n_elements u64 | n_changed u64
    section  kind u8 | coder u8 | plane u8 | pad u8 | raw_len u64 | stored_len u64 | bytes

The decoder checks every count, length and plane against the sizes implied by the expected
tensor size *before* it allocates or decompresses anything, so a crafted payload raises
:class:`CorruptDataError` instead of crashing, hanging or exhausting memory.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from ..dtypes import ORDERED_FLOAT_DTYPES, dtype_size
from ..errors import ConfigError, CorruptDataError
from ..manifest import Encoding
from .inputs import Payload, payload_view, raw_bytes
from .zstd_frames import check_frame, decompress_exact

MAGIC = b"DSC1"
_HEADER = struct.Struct("<4sBBBBQQ")
_SECTION = struct.Struct("<BBBxQQ")

METHOD_FULL, METHOD_DELTA = 0, 1
TRANSFORM_NONE, TRANSFORM_ORDERED, TRANSFORM_XOR = 0, 1, 2
KIND_PLANE, KIND_GAPS, KIND_BITMAP = 0, 1, 2
CODER_RAW, CODER_ZSTD = 0, 1

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


# --------------------------------------------------------------------------- helpers


def _elements(raw: np.ndarray, elem_size: int) -> np.ndarray:
    return raw.view(_UINT[elem_size])


def _ordered_key(u: np.ndarray, bits: int) -> np.ndarray:
    """Map sign-magnitude float bits to unsigned ints whose order is the float order."""
    sign = u.dtype.type(1 << (bits - 1))
    return np.where(u & sign, ~u, u ^ sign)


def _ordered_unkey(k: np.ndarray, bits: int) -> np.ndarray:
    sign = k.dtype.type(1 << (bits - 1))
    return np.where(k & sign, k ^ sign, ~k)


def _zigzag(d: np.ndarray, bits: int) -> np.ndarray:
    s = d.view(_INT[bits // 8])
    return ((s << 1) ^ (s >> (bits - 1))).view(d.dtype)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    signed = z.view(_INT[z.dtype.itemsize])
    return ((z >> 1).view(signed.dtype) ^ -(signed & 1)).view(z.dtype)


def _planes(values: np.ndarray) -> list[np.ndarray]:
    """Split an array of W-byte ints into W contiguous byte planes (low byte first)."""
    width = values.dtype.itemsize
    as_bytes = values.view(np.uint8).reshape(-1, width)
    return [np.ascontiguousarray(as_bytes[:, j]) for j in range(width)]


def _join_planes(planes: list[np.ndarray], width: int) -> np.ndarray:
    out = np.empty((planes[0].size, width), dtype=np.uint8)
    for j, plane in enumerate(planes):
        out[:, j] = plane
    return out.reshape(-1).view(_UINT[width])


def _section(kind: int, plane: int, data: np.ndarray | bytes, level: int) -> bytes:
    raw = data.tobytes() if isinstance(data, np.ndarray) else data
    coder, stored = CODER_RAW, raw
    if len(raw) >= 64:
        packed = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw)
        if len(packed) < len(raw):
            coder, stored = CODER_ZSTD, packed
    return _SECTION.pack(kind, coder, plane, len(raw), len(stored)) + stored


def _gap_width(n_elements: int) -> int:
    return 4 if n_elements < 2**32 else 8


# --------------------------------------------------------------------------- encoder


def encode_full(new: np.ndarray, dtype: str, zstd_level: int = 3) -> bytes:
    """Encode one tensor on its own (no reference), byte plane by byte plane."""
    new = raw_bytes(new, "new")
    width = dtype_size(dtype)
    if new.size % width:
        raise ConfigError(f"{new.size} bytes is not a whole number of {dtype} elements")
    n = new.size // width
    sections = [_section(KIND_PLANE, j, p, zstd_level) for j, p in enumerate(_planes(_elements(new, width)))]
    header = _HEADER.pack(MAGIC, METHOD_FULL, TRANSFORM_NONE, width, len(sections), n, n)
    return header + b"".join(sections)


def encode_tensor_delta(
    old: np.ndarray | None, new: np.ndarray, dtype: str, zstd_level: int = 3, dense_fraction: float = 0.25
) -> bytes:
    """Encode ``new`` against ``old`` (raw bytes of the same dtype and size).

    Returns a full payload when ``old`` is None or when that is smaller than the delta (tried
    when more than ``dense_fraction`` of the elements changed).
    """
    new = raw_bytes(new, "new")
    if old is None:
        return encode_full(new, dtype, zstd_level)
    old = raw_bytes(old, "old")
    if old.size != new.size:
        raise ConfigError(f"old has {old.size} bytes, new has {new.size}")
    width = dtype_size(dtype)
    if new.size % width:
        raise ConfigError(f"{new.size} bytes is not a whole number of {dtype} elements")
    bits = 8 * width
    a, b = _elements(old, width), _elements(new, width)
    n = a.size
    changed = np.flatnonzero(a != b)
    if dtype in ORDERED_FLOAT_DTYPES:
        transform = TRANSFORM_ORDERED
        values = _zigzag(_ordered_key(b[changed], bits) - _ordered_key(a[changed], bits), bits)
    else:
        transform = TRANSFORM_XOR
        values = a[changed] ^ b[changed]
    sections = _positions_sections(changed, n, zstd_level)
    sections += [_section(KIND_PLANE, j, p, zstd_level) for j, p in enumerate(_planes(values))]
    header = _HEADER.pack(MAGIC, METHOD_DELTA, transform, width, len(sections), n, changed.size)
    payload = header + b"".join(sections)
    if changed.size > dense_fraction * n:
        full = encode_full(new, dtype, zstd_level)
        if len(full) < len(payload):
            return full
    return payload


def _positions_sections(changed: np.ndarray, n: int, level: int) -> list[bytes]:
    """Gaps (byte planes) or a bitmap, whichever is smaller once compressed."""
    width = _gap_width(n)
    gaps = np.diff(changed, prepend=-1).astype(_UINT[width]) - _UINT[width](1)
    gap_sections = [_section(KIND_GAPS, j, p, level) for j, p in enumerate(_planes(gaps))]
    if changed.size * 16 > n // 8:  # a bitmap can only win when changes are not very sparse
        mask = np.zeros(n, dtype=bool)
        mask[changed] = True
        bitmap = _section(KIND_BITMAP, 0, np.packbits(mask, bitorder="little"), level)
        if len(bitmap) < sum(map(len, gap_sections)):
            return [bitmap]
    return gap_sections


# --------------------------------------------------------------------------- decoder


@dataclass(frozen=True)
class _Header:
    method: int
    transform: int
    width: int
    n_sections: int
    n_elements: int
    n_changed: int


def payload_method(payload: Payload) -> Encoding:
    """``Encoding.DELTA`` if the payload needs the previous tensor, else ``Encoding.FULL``."""
    return Encoding.DELTA if _read_header(payload_view(payload)).method == METHOD_DELTA else Encoding.FULL


def _read_header(view: memoryview) -> _Header:
    if len(view) < _HEADER.size:
        raise CorruptDataError(f"payload truncated: {len(view)} bytes is shorter than the header")
    magic, method, transform, width, n_sections, n_elements, n_changed = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptDataError(f"bad payload magic {bytes(magic)!r}")
    if method not in (METHOD_FULL, METHOD_DELTA):
        raise CorruptDataError(f"unknown payload method {method}")
    if width not in _UINT:
        raise CorruptDataError(f"bad element size {width}")
    return _Header(method, transform, width, n_sections, n_elements, n_changed)


def _read_sections(view: memoryview, header: _Header, expected: dict[tuple[int, int], int]) -> dict:
    """Read and decompress sections; ``expected`` maps (kind, plane) to the exact raw length."""
    out: dict[tuple[int, int], np.ndarray] = {}
    pos = _HEADER.size
    for _ in range(header.n_sections):
        if pos + _SECTION.size > len(view):
            raise CorruptDataError("payload truncated inside a section header")
        kind, coder, plane, raw_len, stored_len = _SECTION.unpack_from(view, pos)
        pos += _SECTION.size
        key = (kind, plane)
        if key not in expected:
            raise CorruptDataError(f"unexpected section kind={kind} plane={plane}")
        if key in out:
            raise CorruptDataError(f"duplicate section kind={kind} plane={plane}")
        if raw_len != expected[key]:
            raise CorruptDataError(f"section kind={kind} plane={plane}: length {raw_len}, expected {expected[key]}")
        if stored_len > len(view) - pos:
            raise CorruptDataError(f"payload truncated: section needs {stored_len} bytes, {len(view) - pos} left")
        stored = view[pos : pos + stored_len]
        pos += stored_len
        out[key] = _decode_section(coder, stored, raw_len)
    if pos != len(view):
        raise CorruptDataError(f"{len(view) - pos} trailing bytes after the last section")
    missing = set(expected) - set(out)
    if missing:
        raise CorruptDataError(f"payload lacks sections {sorted(missing)}")
    return out


def _decode_section(coder: int, stored: memoryview, raw_len: int) -> np.ndarray:
    if coder == CODER_RAW:
        if len(stored) != raw_len:
            raise CorruptDataError("raw section length disagrees with its header")
        return np.frombuffer(stored, dtype=np.uint8)
    if coder != CODER_ZSTD:
        raise CorruptDataError(f"unknown section coder {coder}")
    check_frame(stored, raw_len, "section")
    data = decompress_exact(stored, raw_len, "section")
    return np.frombuffer(data, dtype=np.uint8)


def decode_into(out: np.ndarray, payload: Payload, dtype: str) -> None:
    """Rebuild a tensor in place: ``out`` (raw bytes of ``dtype``) holds the previous tensor for a
    delta payload (anything for a full one) and receives the new bytes.

    Every count, length and position is validated before ``out`` is touched, so a crafted payload
    raises CorruptDataError and leaves ``out`` as it was.
    """
    out = raw_bytes(out, "out")
    view = payload_view(payload)
    header = _read_header(view)
    width = dtype_size(dtype)
    _check_shape(header, width, out.size)
    n, k = header.n_elements, header.n_changed
    if header.method == METHOD_FULL:
        if k != n or header.transform != TRANSFORM_NONE or header.n_sections != width:
            raise CorruptDataError("inconsistent full payload header")
        sections = _read_sections(view, header, {(KIND_PLANE, j): n for j in range(width)})
        columns = out.reshape(-1, width)
        for j in range(width):
            columns[:, j] = sections[(KIND_PLANE, j)]
        return
    if k > n:
        raise CorruptDataError(f"delta claims {k} changed elements out of {n}")
    expected_transform = TRANSFORM_ORDERED if dtype in ORDERED_FLOAT_DTYPES else TRANSFORM_XOR
    if header.transform != expected_transform:
        raise CorruptDataError(f"delta transform {header.transform} does not fit dtype {dtype}")
    gap_width = _gap_width(n)
    if header.n_sections == width + 1:
        positions = {(KIND_BITMAP, 0): (n + 7) // 8}
    elif header.n_sections == width + gap_width:
        positions = {(KIND_GAPS, j): k for j in range(gap_width)}
    else:
        raise CorruptDataError(f"delta has {header.n_sections} sections")
    expected = dict(positions)
    expected.update({(KIND_PLANE, j): k for j in range(width)})
    sections = _read_sections(view, header, expected)
    changed = _decode_positions(sections, n, k, gap_width)
    if not k:
        return
    values = _join_planes([sections[(KIND_PLANE, j)] for j in range(width)], width)
    elems = _elements(out, width)
    before = elems[changed]
    if header.transform == TRANSFORM_ORDERED:
        bits = 8 * width
        elems[changed] = _ordered_unkey(_ordered_key(before, bits) + _unzigzag(values), bits)
    else:
        elems[changed] = before ^ values


def _check_shape(header: _Header, width: int, nbytes: int) -> None:
    if header.width != width:
        raise CorruptDataError(f"payload element size {header.width} does not match dtype size {width}")
    if header.n_elements * width != nbytes:
        raise CorruptDataError(f"payload rebuilds {header.n_elements * width} bytes, expected {nbytes}")


def _decode_positions(sections: dict, n: int, k: int, gap_width: int) -> np.ndarray:
    if (KIND_BITMAP, 0) in sections:
        mask = np.unpackbits(sections[(KIND_BITMAP, 0)], count=n, bitorder="little")
        changed = np.flatnonzero(mask)
        if changed.size != k:
            raise CorruptDataError(f"bitmap marks {changed.size} changes, header says {k}")
        return changed
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    gaps = _join_planes([sections[(KIND_GAPS, j)] for j in range(gap_width)], gap_width)
    steps = gaps.astype(np.uint64) + np.uint64(1)
    if gap_width == 8 and np.any(steps == 0):
        raise CorruptDataError("position gap overflows")
    ends = np.cumsum(steps, dtype=np.uint64)
    # With 8-byte gaps a crafted cumsum could wrap: positions must keep increasing and stay < n.
    if ends[-1] > n or np.any(ends[1:] < ends[:-1]):
        raise CorruptDataError("change positions run past the end of the tensor")
    return (ends - np.uint64(1)).astype(np.int64)
