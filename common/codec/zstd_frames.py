"""Bounded zstd frames for the codecs: a frame's declared size is checked against what the
container says before anything is allocated, and decompression never produces more."""

from __future__ import annotations

import zstandard

from ..errors import CorruptDataError


def check_frame(stored: bytes | memoryview, expected: int, what: str) -> None:
    """Raise CorruptDataError unless ``stored`` is a zstd frame declaring ``expected`` bytes."""
    try:
        size = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise CorruptDataError(f"bad zstd frame: {exc}") from None
    if size != expected:
        raise CorruptDataError(f"zstd {what} declares {size} bytes, expected {expected}")


def decompress_exact(stored: bytes | memoryview, expected: int, what: str) -> bytes:
    """The ``expected`` bytes of a zstd frame (checked first with :func:`check_frame`)."""
    try:
        data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise CorruptDataError(f"corrupt zstd {what}: {exc}") from None
    if len(data) != expected:
        raise CorruptDataError(f"zstd {what} decompressed to the wrong length")
    return data
