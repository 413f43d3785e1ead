"""The store interface: a flat key -> bytes namespace with atomic whole-object writes.

Backends (``file.py``, ``s3.py``, ``http.py``) implement these few async methods; everything
else (store keys, manifests, chain walking) is built on top and knows nothing of the backend.

Every read is bounded by what the reader already knows: ``max_bytes`` caps what a read may
return, and a backend stops reading (before downloading anything, where the size is known up
front) as soon as an object turns out to be larger, raising :class:`ObjectTooLargeError`.
"""

from __future__ import annotations

import asyncio
import re
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from urllib.parse import urlsplit, urlunsplit

import xxhash

from ..errors import NotFoundError, ObjectTooLargeError, StoreError, TransientError

_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*")


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key (no '..', no absolute path, no odd characters)."""
    if not isinstance(key, str) or len(key) > 1024 or not _KEY_RE.fullmatch(key) or ".." in key.split("/"):
        raise StoreError(f"invalid store key {key!r}")
    return key


def public_url(url: str) -> str:
    """``url`` without credentials, query string or fragment: safe to show anyone."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid URL>"
    if not parts.scheme or len(parts.scheme) == 1:  # a plain path (or a Windows drive letter)
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def check_size(key: str, size: int, max_bytes: int | None) -> None:
    """Raise ObjectTooLargeError if ``size`` exceeds ``max_bytes``."""
    if max_bytes is not None and size > max_bytes:
        raise ObjectTooLargeError(f"{key} has {size} bytes, more than the {max_bytes} allowed")


class Store(ABC):
    """Async key-value object store. Writes of one key are atomic: readers see all or nothing."""

    url: str

    @property
    def public_url(self) -> str:
        """The store's URL without credentials or query string."""
        return public_url(self.url)

    @abstractmethod
    async def get(
        self, key: str, start: int | None = None, end: int | None = None, *, max_bytes: int | None = None
    ) -> bytes:
        """Bytes of ``key`` (``[start, end)`` if given).

        Raises NotFoundError if absent, ObjectTooLargeError if the object (or range) holds more
        than ``max_bytes`` bytes.
        """

    @abstractmethod
    async def put(self, key: str, data: bytes | memoryview) -> None:
        """Write ``key`` atomically, replacing any previous value."""

    @abstractmethod
    async def size(self, key: str) -> int | None:
        """Size of ``key`` in bytes, or None if it does not exist."""

    @abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """Every key that starts with ``prefix``, sorted."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    async def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None
    ) -> tuple[bytes, str] | None:
        """``(data, etag)`` of ``key``, or None when it still matches ``etag``.

        Backends with conditional requests (S3, HTTP) override this so an unchanged head
        pointer costs no body transfer; this default compares a content hash.
        """
        data = await self.get(key, max_bytes=max_bytes)
        tag = content_tag(data)
        return None if tag == etag else (data, tag)

    async def put_if(self, key: str, data: bytes | memoryview, etag: str | None) -> bool:
        """Write ``key`` only if it still has ``etag`` (as :meth:`get_if_changed` returned it),
        or, with ``etag=None``, only if it does not exist. Returns False when someone else wrote
        it first. Backends override this with an atomic compare-and-swap; the default raises
        NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} has no conditional writes")

    async def read_pieces(self, key: str, size: int, piece_bytes: int) -> AsyncGenerator[bytes, None]:
        """Bytes ``[0, size)`` of ``key`` in consecutive pieces of ``piece_bytes`` (the last one
        shorter), each read when the caller asks for it: a large object never sits whole in memory.
        Backends whose servers may ignore ranges override this to read such an object once."""
        for start in range(0, size, piece_bytes):
            end = min(start + piece_bytes, size)
            yield await self.get(key, start, end, max_bytes=end - start)

    async def exists(self, key: str) -> bool:
        return await self.size(key) is not None

    async def close(self) -> None:
        """Release connections (no-op for local stores)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.public_url!r})"


def content_tag(data: bytes | memoryview) -> str:
    """The tag a store without ETags gives an object: a hash of its bytes."""
    return xxhash.xxh3_64_hexdigest(data)


class RangedStore(Store):
    """A remote store whose reads are ranged requests: whole objects are fetched as parallel
    parts of ``part_size`` bytes (the backend bounds how many run at once)."""

    part_size: int

    @abstractmethod
    async def _get_range(self, key: str, start: int, end: int) -> bytes:
        """Exactly the bytes ``[start, end)`` of ``key`` (resuming short bodies, refusing more)."""

    def _take(self, received: bytearray, chunk: bytes, start: int, end: int, key: str) -> None:
        """Add one chunk of the answer to a range request for ``[start, end)``; a server that
        sends more than asked is cut off."""
        received.extend(chunk)
        if len(received) > end - start:
            raise StoreError(f"{key}: {self.public_url} sent more bytes than the range asked for")

    @staticmethod
    def _whole(received: bytearray, start: int, end: int, key: str) -> bytes:
        """The bytes of a finished range answer; a short one is worth retrying (it resumes)."""
        if len(received) != end - start:
            raise TransientError(f"short body for {key}: {len(received)} of {end - start} bytes")
        return bytes(received)

    async def get(
        self, key: str, start: int | None = None, end: int | None = None, *, max_bytes: int | None = None
    ) -> bytes:
        begin = start or 0
        if end is None:
            end = await self.size(key)
            if end is None:
                raise NotFoundError(f"{key} not found in {self.public_url}")
        check_size(key, end - begin, max_bytes)
        if end <= begin:
            return b""
        parts = range(begin, end, self.part_size)
        chunks = await asyncio.gather(*(self._get_range(key, o, min(o + self.part_size, end)) for o in parts))
        return b"".join(chunks)
