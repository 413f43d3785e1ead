"""The store interface: a flat key -> bytes namespace with atomic whole-object writes.

Backends (``file.py``, ``s3.py``, ``http.py``) implement these few async methods; everything
else (store keys, manifests, chain walking) is built on top and knows nothing of the backend.
"""

from __future__ import annotations

import asyncio
import re
from abc import ABC, abstractmethod

import xxhash

from ..errors import NotFoundError, StoreError

_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$")


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key (no '..', no absolute path, no odd characters)."""
    if not isinstance(key, str) or len(key) > 1024 or not _KEY_RE.match(key) or ".." in key.split("/"):
        raise StoreError(f"invalid store key {key!r}")
    return key


class Store(ABC):
    """Async key-value object store. Writes of one key are atomic: readers see all or nothing."""

    url: str

    @abstractmethod
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes of ``key`` (``[start, end)`` if given); raises NotFoundError if absent."""

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

    async def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        """``(data, etag)`` of ``key``, or None when it still matches ``etag``.

        Backends with conditional requests (S3, HTTP) override this so an unchanged head
        pointer costs no body transfer; this default compares a content hash.
        """
        data = await self.get(key)
        tag = xxhash.xxh3_64_hexdigest(data)
        return None if tag == etag else (data, tag)

    async def exists(self, key: str) -> bool:
        return await self.size(key) is not None

    async def close(self) -> None:
        """Release connections (no-op for local stores)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class RangedStore(Store):
    """A remote store whose reads are ranged requests: whole objects are fetched as parallel
    parts of ``part_size`` bytes (the backend bounds how many run at once)."""

    part_size: int

    @abstractmethod
    async def _get_range(self, key: str, start: int, end: int) -> bytes:
        """Exactly the bytes ``[start, end)`` of ``key`` (resuming short bodies)."""

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if end is None:
            end = await self.size(key)
            if end is None:
                raise NotFoundError(f"{key} not found in {self.url}")
        begin = start or 0
        if end <= begin:
            return b""
        parts = range(begin, end, self.part_size)
        chunks = await asyncio.gather(*(self._get_range(key, o, min(o + self.part_size, end)) for o in parts))
        return b"".join(chunks)
