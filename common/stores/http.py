"""``http(s)://`` read-only store through httpx: a CDN or static file server in front of a bucket.

Reads use Range requests (large objects in parallel parts, short bodies resumed), the head pointer
is read with If-None-Match, and every read stops at the bound the reader gives. Static servers
cannot list, so chain listings walk back from HEAD.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from ..errors import NotFoundError, StoreError, TransientError
from ..retry import RetryPolicy, retry
from .base import RangedStore, check_key, check_size


@dataclass(frozen=True)
class HttpConfig:
    part_size: int = 8 << 20
    concurrency: int = 8
    retry: RetryPolicy = RetryPolicy()


class _RangeIgnored(Exception):
    """The server answered a Range request with the whole object (200)."""


class HttpStore(RangedStore):
    """Keys are paths below the base URL. Binds to the event loop of its first use.

    Redirects are not followed (a redirect to another host could serve anything). A server that
    ignores Range requests (answers 200 with the whole object) is read with one streamed request
    per object instead, cut off at the bound the reader gives.
    """

    def __init__(self, url: str, config: HttpConfig = HttpConfig()) -> None:
        self.url = url.rstrip("/")
        self.config = config
        self.part_size = config.part_size
        self._client: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._ranges_ignored = False

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=self.config.concurrency * 2)
            self._client = httpx.AsyncClient(timeout=self.config.retry.timeout_s, limits=limits, follow_redirects=False)
            self._sem = asyncio.Semaphore(self.config.concurrency)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _request(self, what: str, op) -> Any:
        async def attempt() -> Any:
            client = self._http()
            assert self._sem is not None
            async with self._sem:
                try:
                    return await op(client)
                except httpx.TransportError as exc:  # timeouts, resets, truncated bodies
                    raise TransientError(f"{what}: {type(exc).__name__}") from exc

        return await retry(attempt, self.config.retry, what)

    def _object_url(self, key: str) -> str:
        return f"{self.url}/{check_key(key)}"

    def _check(self, resp: httpx.Response, key: str) -> None:
        code = resp.status_code
        if code == 404:
            raise NotFoundError(f"{key} not found at {self.public_url}")
        if code >= 500 or code == 429:
            raise TransientError(f"{key}: HTTP {code}")
        if 300 <= code < 400:
            raise StoreError(f"{key}: HTTP {code} redirect from {self.public_url} (redirects are not followed)")
        if code >= 400:
            raise StoreError(f"{key}: HTTP {code} from {self.public_url}")

    async def size(self, key: str) -> int | None:
        """The object's size; -1 when the server does not say (no Content-Length)."""
        async def op(client: httpx.AsyncClient) -> int | None:
            resp = await client.head(self._object_url(key))
            if resp.status_code == 404:
                return None
            self._check(resp, key)
            length = resp.headers.get("content-length", "")
            return int(length) if length.isdigit() else -1

        return await self._request(f"HEAD {key}", op)

    async def get(self, key: str, start: int | None = None, end: int | None = None, *,
                  max_bytes: int | None = None) -> bytes:
        begin = start or 0
        if end is None:
            size = await self.size(key)
            if size is None:
                raise NotFoundError(f"{key} not found in {self.public_url}")
            if size < 0:
                return await self._get_stream(key, begin, None, max_bytes)
            end = size
        check_size(key, end - begin, max_bytes)
        if not self._ranges_ignored:
            try:
                return await super().get(key, begin, end)
            except _RangeIgnored:
                self._ranges_ignored = True
        return await self._get_stream(key, begin, end, max_bytes)

    async def _get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; a body cut short is resumed from the first missing byte."""
        received = bytearray()

        async def op(client: httpx.AsyncClient) -> bytes:
            first = start + len(received)
            headers = {"Range": f"bytes={first}-{end - 1}"}
            async with client.stream("GET", self._object_url(key), headers=headers) as resp:
                self._check(resp, key)
                if resp.status_code == 200:
                    raise _RangeIgnored()
                if resp.status_code != 206 or not resp.headers.get("content-range", "").startswith(f"bytes {first}-"):
                    raise StoreError(f"{key}: {self.public_url} answered a range request with something else")
                async for chunk in resp.aiter_raw():
                    self._take(received, chunk, start, end, key)
            return self._whole(received, start, end, key)

        return await self._request(f"GET {key} [{start}, {end})", op)

    async def _get_stream(self, key: str, start: int, end: int | None, max_bytes: int | None) -> bytes:
        """Bytes ``[start, end)`` (to the end when ``end`` is None) from one plain GET, for
        servers that ignore Range: bytes before ``start`` are skipped, reading stops at ``end``."""
        async def op(client: httpx.AsyncClient) -> bytes:
            kept, seen = bytearray(), 0
            async with client.stream("GET", self._object_url(key)) as resp:
                self._check(resp, key)
                async for chunk in resp.aiter_raw():
                    lo, hi = max(start - seen, 0), len(chunk) if end is None else min(len(chunk), end - seen)
                    seen += len(chunk)
                    if hi > lo:
                        kept.extend(chunk[lo:hi])
                    check_size(key, len(kept), max_bytes)
                    if end is not None and seen >= end:
                        break
            if end is not None and len(kept) != end - start:
                raise TransientError(f"short body for {key}: {len(kept)} of {end - start} bytes")
            return bytes(kept)

        return await self._request(f"GET {key} (whole)", op)

    async def get_if_changed(self, key: str, etag: str | None, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        async def op(client: httpx.AsyncClient) -> tuple[bytes, str] | None:
            headers = {"If-None-Match": etag} if etag else {}
            async with client.stream("GET", self._object_url(key), headers=headers) as resp:
                if resp.status_code == 304:
                    return None
                self._check(resp, key)
                length = resp.headers.get("content-length", "")
                if length.isdigit():
                    check_size(key, int(length), max_bytes)
                body = bytearray()
                async for chunk in resp.aiter_raw():
                    body.extend(chunk)
                    check_size(key, len(body), max_bytes)
            if length.isdigit() and int(length) != len(body):
                raise TransientError(f"short body for {key}")
            return bytes(body), resp.headers.get("etag", "")

        return await self._request(f"GET {key} if changed", op)

    async def list(self, prefix: str) -> list[str]:
        raise NotImplementedError("static HTTP stores cannot list keys")

    async def put(self, key: str, data: bytes | memoryview) -> None:
        raise StoreError(f"{self.public_url} is a read-only HTTP store; publish to the bucket behind it")

    async def delete(self, key: str) -> None:
        raise StoreError(f"{self.public_url} is a read-only HTTP store")
