"""Fast content checksums (xxh3-128) for rebuilt tensors, shards and files."""

from __future__ import annotations

import xxhash

from .errors import ChecksumMismatchError

ALGORITHM = "xxh3_128"


def checksum(data: bytes | bytearray | memoryview) -> str:
    """``"xxh3_128:<hex>"`` of ``data`` (any buffer, including numpy arrays)."""
    return f"{ALGORITHM}:{xxhash.xxh3_128_hexdigest(data)}"


def verify(data: bytes | bytearray | memoryview, expected: str, what: str) -> None:
    """Raise ChecksumMismatchError if ``data`` does not hash to ``expected``."""
    actual = checksum(data)
    if actual != expected:
        raise ChecksumMismatchError(f"checksum mismatch for {what}: expected {expected}, got {actual}")
