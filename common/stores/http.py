"""``http(s)://`` read-only store through httpx: a CDN or static file server in front of a bucket.

Reads use Range requests (large objects in parallel parts, short bodies resumed), the head pointer
is read with If-None-Match. Static servers cannot list, so chain listings walk back from HEAD.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from ..errors import NotFoundError, StoreError, TransientError
from ..retry import RetryPolicy, retry
from .base import RangedStore, check_key


@dataclass(frozen=True)
class HttpConfig:
    part_size: int = 8 << 20
    concurrency: int = 8
    retry: RetryPolicy = RetryPolicy()


class HttpStore(RangedStore):
    """Keys are paths below the base URL. Binds to the event loop of its first use."""

    def __init__(self, url: str, config: HttpConfig = HttpConfig()) -> None:
        self.url = url.rstrip("/")
        self.config = config
        self.part_size = config.part_size
        self._client: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=self.config.concurrency * 2)
            self._client = httpx.AsyncClient(timeout=self.config.retry.timeout_s, limits=limits, follow_redirects=True)
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
                    raise TransientError(f"{what}: {type(exc).__name__}: {exc}") from exc

        return await retry(attempt, self.config.retry, what)

    def _check(self, resp: httpx.Response, key: str) -> None:
        if resp.status_code == 404:
            raise NotFoundError(f"{key} not found at {self.url}")
        if resp.status_code >= 500 or resp.status_code == 429:
            raise TransientError(f"{key}: HTTP {resp.status_code}")
        if resp.status_code >= 400:
            raise StoreError(f"{key}: HTTP {resp.status_code} from {self.url}")

    async def size(self, key: str) -> int | None:
        async def op(client: httpx.AsyncClient) -> int | None:
            resp = await client.head(f"{self.url}/{check_key(key)}")
            if resp.status_code == 404:
                return None
            self._check(resp, key)
            return int(resp.headers["content-length"])

        return await self._request(f"HEAD {key}", op)

    async def _get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; a body cut short is resumed from the first missing byte."""
        received = bytearray()

        async def op(client: httpx.AsyncClient) -> bytes:
            first = start + len(received)
            headers = {"Range": f"bytes={first}-{end - 1}"}
            async with client.stream("GET", f"{self.url}/{check_key(key)}", headers=headers) as resp:
                self._check(resp, key)
                if resp.status_code != 206:
                    raise StoreError(f"{self.url} ignored a Range request for {key} (HTTP {resp.status_code})")
                async for chunk in resp.aiter_raw():
                    received.extend(chunk)
            if len(received) != end - start:
                raise TransientError(f"short body for {key}: {len(received)} of {end - start} bytes")
            return bytes(received)

        return await self._request(f"GET {key} [{start}, {end})", op)

    async def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        async def op(client: httpx.AsyncClient) -> tuple[bytes, str] | None:
            headers = {"If-None-Match": etag} if etag else {}
            resp = await client.get(f"{self.url}/{check_key(key)}", headers=headers)
            if resp.status_code == 304:
                return None
            self._check(resp, key)
            length = resp.headers.get("content-length")
            if length is not None and int(length) != len(resp.content):
                raise TransientError(f"short body for {key}")
            return resp.content, resp.headers.get("etag", "")

        return await self._request(f"GET {key} if changed", op)

    async def list(self, prefix: str) -> list[str]:
        raise NotImplementedError("static HTTP stores cannot list keys")

    async def put(self, key: str, data: bytes | memoryview) -> None:
        raise StoreError(f"{self.url} is a read-only HTTP store; publish to the bucket behind it")

    async def delete(self, key: str) -> None:
        raise StoreError(f"{self.url} is a read-only HTTP store")
