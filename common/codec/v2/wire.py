"""Codec v2's payload layout (docs/FORMAT.md, "Codec payload v2"): its constants and its
byte-aligned parts: varints, the header, and the byte planes of full and XOR payloads."""

from __future__ import annotations

import numpy as np
import zstandard

from ...errors import CorruptDataError
from ..zstd_frames import check_frame, decompress_exact

MAGIC = b"DSC2"
METHOD_FULL, METHOD_ULP, METHOD_XOR = 0, 1, 2
#: A payload in parts: consecutive element ranges of the tensor, each a whole payload of its own
#: (method 0, 1 or 2), so that threads encode and decode one large tensor together.
METHOD_SPLIT = 3
#: At most this many parts in a split payload (a bound on the decoder's table, whatever the size).
MAX_PARTS = 1 << 16
#: Payload flag (header byte 6) of a ULP payload whose signs are predicted (:mod:`.sign_model`).
FLAG_SIGN_MODEL = 1
#: dtype -> (bytes, mantissa bits, exponent bits) of the floats coded as ULP deltas
FLOATS = {"BF16": (2, 7, 8), "F16": (2, 10, 5), "F32": (4, 23, 8)}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

QMAX = 40  # Golomb quotient at which a code escapes to an explicit length
SCALE_BITS = 12  # rANS frequency precision: tables sum to 4096
SCALE = 1 << SCALE_BITS
RANS_L = 1 << 16  # rANS state lower bound; 16-bit renormalisation
MAX_T = 64  # rANS table size (symbols 0..T-2 literal, T-1 escapes)
FLIP_STREAMS = 4  # the flip bytes are dealt to four rANS streams: byte i goes to stream i % 4


def varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class Reader:
    """Bounds-checked reader of the byte-aligned header fields."""

    def __init__(self, view: memoryview) -> None:
        self.v = view
        self.p = 0

    def u8(self) -> int:
        if self.p >= len(self.v):
            raise CorruptDataError("payload truncated")
        b = self.v[self.p]
        self.p += 1
        return b

    def varint(self, limit: int, what: str) -> int:
        x = shift = 0
        for _ in range(9):
            b = self.u8()
            x |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                if x > limit:
                    raise CorruptDataError(f"{what} = {x} exceeds its limit {limit}")
                return x
        raise CorruptDataError(f"overlong varint for {what}")

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self.v) - self.p:
            raise CorruptDataError(f"payload truncated inside {what}")
        out = self.v[self.p : self.p + n]
        self.p += n
        return out


def header(method: int, width: int, n: int, flags: int = 0) -> bytes:
    return MAGIC + bytes([method, width, flags]) + varint(n)


def planes_body(elems: np.ndarray, width: int, level: int) -> bytes:
    out = bytearray()
    as_bytes = elems.view(np.uint8).reshape(-1, width)
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
    for j in range(width):
        raw = np.ascontiguousarray(as_bytes[:, j]).tobytes()
        packed = cctx.compress(raw) if len(raw) >= 64 else raw
        if len(packed) < len(raw):
            out += bytes([1]) + varint(len(packed)) + packed
        else:
            out += bytes([0]) + varint(len(raw)) + raw
    return bytes(out)


def read_planes(rd: Reader, n: int, width: int) -> list[tuple[int, memoryview]]:
    """Read and validate every plane's framing (coder, length, zstd content size) before any
    plane is decompressed or the output allocated."""
    planes = []
    for _ in range(width):
        coder = rd.u8()
        stored = rd.take(rd.varint(len(rd.v), "plane length"), "a plane")
        if coder == 0:
            if len(stored) != n:
                raise CorruptDataError("raw plane has the wrong length")
        elif coder == 1:
            check_frame(stored, n, "plane")
        else:
            raise CorruptDataError(f"unknown plane coder {coder}")
        planes.append((coder, stored))
    return planes


def plane_bytes(coder: int, stored: memoryview, n: int) -> np.ndarray:
    if coder == 0:
        return np.frombuffer(stored, np.uint8)
    return np.frombuffer(decompress_exact(stored, n, "plane"), np.uint8)
