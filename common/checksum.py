"""Content checksums: xxh3-128 (fast integrity of rebuilt tensors, shards and files) and SHA-256
(the cryptographic digest of shards and files that a signed manifest vouches for)."""

from __future__ import annotations

import hashlib

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


def sha256(data: bytes | bytearray | memoryview) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def verify_blob(data: bytes | bytearray | memoryview, xxh3: str, sha256_hex: str | None, what: str) -> None:
    """Raise ChecksumMismatchError unless ``data`` matches its xxh3-128 and, when given, SHA-256."""
    verify(data, xxh3, what)
    if sha256_hex is not None and sha256(data) != sha256_hex:
        raise ChecksumMismatchError(f"SHA-256 mismatch for {what}")
