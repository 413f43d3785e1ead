"""Content checksums: xxh3-128 (fast integrity of rebuilt tensors, shards and files) and SHA-256
(the cryptographic digest of shards and files that a signed manifest vouches for)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import xxhash

from .errors import ChecksumMismatchError

if TYPE_CHECKING:
    import numpy as np

ALGORITHM = "xxh3_128"


def checksum(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """``"xxh3_128:<hex>"`` of ``data`` (any buffer, including numpy arrays)."""
    return f"{ALGORITHM}:{xxhash.xxh3_128_hexdigest(data)}"  # type: ignore[arg-type]  # numpy types ndarray a Buffer on 3.12+ only


def verify(data: bytes | bytearray | memoryview | np.ndarray, expected: str, what: str) -> None:
    """Raise ChecksumMismatchError if ``data`` does not hash to ``expected``."""
    _check(checksum(data), expected, what)


def _check(actual: str, expected: str, what: str) -> None:
    if actual != expected:
        raise ChecksumMismatchError(f"checksum mismatch for {what}: expected {expected}, got {actual}")


def sha256(data: bytes | bytearray | memoryview) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


class BlobDigest:
    """The xxh3-128 and (with ``sha256``) SHA-256 of a blob fed in pieces, in order."""

    def __init__(self, *, sha256: bool) -> None:
        self._xxh3 = xxhash.xxh3_128()
        self._sha256 = hashlib.sha256() if sha256 else None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._xxh3.update(data)
        if self._sha256 is not None:
            self._sha256.update(data)

    def verify(self, xxh3: str, sha256_hex: str | None, what: str) -> None:
        """Raise ChecksumMismatchError unless the blob matches ``xxh3`` and, when given, ``sha256_hex``
        (which needs a digest made with ``sha256=True``)."""
        _check(f"{ALGORITHM}:{self._xxh3.hexdigest()}", xxh3, what)
        if sha256_hex is not None and (self._sha256 is None or self._sha256.hexdigest() != sha256_hex):
            raise ChecksumMismatchError(f"SHA-256 mismatch for {what}")


def verify_blob(data: bytes | bytearray | memoryview, xxh3: str, sha256_hex: str | None, what: str) -> None:
    """Raise ChecksumMismatchError unless ``data`` matches its xxh3-128 and, when given, SHA-256."""
    digest = BlobDigest(sha256=sha256_hex is not None)
    digest.update(data)
    digest.verify(xxh3, sha256_hex, what)
