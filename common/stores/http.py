"""``http(s)://`` read-only store through httpx: a CDN or static file server in front of a bucket.

Reads use Range requests (large objects in parallel parts, short bodies resumed), the head pointer
is read with If-None-Match, and every read stops at the bound the reader gives. Static servers
cannot list, so chain listings walk back from HEAD.

Reads ask for the bytes as stored (``Accept-Encoding: identity``); a server that compresses
anyway (gzip or deflate) is decoded, never beyond the bound the reader gives. Credentials in the
URL (``https://user:password@host/...``) are sent as HTTP basic auth and kept out of every URL
that is requested, logged or shown.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from ..errors import NotFoundError, StoreError, TransientError
from ..retry import RetryPolicy, retry
from .base import RangedStore, check_key, check_size, public_url


@dataclass(frozen=True)
class HttpConfig:
    part_size: int = 8 << 20
    concurrency: int = 8
    retry: RetryPolicy = RetryPolicy()


class _RangeIgnored(Exception):
    """The server answered a Range request with the whole object (200), or with a range of a
    compressed representation: its ranges are of no use."""


#: Bytes one decompression step may produce (a compressed answer never inflates more at once).
_INFLATE_STEP = 1 << 20


class HttpStore(RangedStore):
    """Keys are paths below the base URL. Binds to the event loop of its first use.

    Redirects are not followed (a redirect to another host could serve anything). A server that
    ignores Range requests (answers 200 with the whole object) is noticed once; from then on each
    object is read with one streamed request, cut off at the bound the reader gives.
    """

    def __init__(self, url: str, config: HttpConfig = HttpConfig()) -> None:
        parts = urlsplit(url)
        if parts.query or parts.fragment:
            raise StoreError(f"an http(s) store URL may not carry a query string or fragment: {public_url(url)}")
        username, password = parts.username, parts.password
        self._auth = httpx.BasicAuth(unquote(username or ""), unquote(password or "")) if username or password else None
        self.url = public_url(url).rstrip("/")  # no credentials: they travel as auth, not in the URL
        self.config = config
        self.part_size = config.part_size
        self._client: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._ranges_ignored = False

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=self.config.concurrency * 2)
            self._client = httpx.AsyncClient(
                timeout=self.config.retry.timeout_s,
                limits=limits,
                follow_redirects=False,
                auth=self._auth,
                headers={"Accept-Encoding": "identity"},
            )
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

    async def _body(self, resp: httpx.Response, key: str) -> AsyncIterator[bytes]:
        """The body of ``resp`` as stored: raw when the server sent it as is, inflated (gzip,
        deflate) when it compressed it anyway, at most ``_INFLATE_STEP`` bytes at a time (the
        caller stops at its bound). A compressed body that ends before its end marker is short."""
        encoding = resp.headers.get("content-encoding", "").strip().lower()
        if encoding in ("", "identity"):
            async for chunk in resp.aiter_raw():
                yield chunk
            return
        if encoding not in ("gzip", "x-gzip", "deflate"):
            raise StoreError(
                f"{key}: {self.public_url} answered with Content-Encoding {encoding!r:.40}, which "
                "delta-swap does not decode (it asks for identity)"
            )
        wbits = 16 + zlib.MAX_WBITS if encoding != "deflate" else zlib.MAX_WBITS
        inflater, first = zlib.decompressobj(wbits), True
        async for chunk in resp.aiter_raw():
            data = chunk
            while data:
                try:
                    out = inflater.decompress(data, _INFLATE_STEP)
                except zlib.error:
                    if first and encoding == "deflate":  # deflate without the zlib wrapper, as some servers send
                        inflater, first = zlib.decompressobj(-zlib.MAX_WBITS), False
                        continue
                    raise StoreError(f"{key}: {self.public_url} sent a {encoding} body that does not inflate") from None
                first = False
                if out:
                    yield out
                data = inflater.unconsumed_tail
                if inflater.eof:
                    return
        if not inflater.eof:
            raise TransientError(f"short {encoding} body for {key}")

    async def size(self, key: str) -> int | None:
        """The object's size; -1 when the server does not say (no Content-Length, or the length of
        a compressed answer)."""

        async def op(client: httpx.AsyncClient) -> int | None:
            resp = await client.head(self._object_url(key))
            if resp.status_code == 404:
                return None
            self._check(resp, key)
            length = resp.headers.get("content-length", "")
            encoded = resp.headers.get("content-encoding", "").strip().lower() not in ("", "identity")
            return int(length) if length.isdigit() and not encoded else -1

        return await self._request(f"HEAD {key}", op)

    async def get(
        self, key: str, start: int | None = None, end: int | None = None, *, max_bytes: int | None = None
    ) -> bytes:
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

    async def read_pieces(self, key: str, size: int, piece_bytes: int) -> AsyncGenerator[bytes, None]:
        """Ranged pieces while the server honours Range; once it is seen to ignore it, the rest of
        the object comes from one streamed request (not one whole download per piece)."""
        start = 0
        while start < size and not self._ranges_ignored:
            end = min(start + piece_bytes, size)
            try:
                data = await RangedStore.get(self, key, start, end)
            except _RangeIgnored:
                self._ranges_ignored = True
                break
            yield data
            start = end
        if start < size:
            async for piece in self._stream_pieces(key, start, size, piece_bytes):
                yield piece

    async def _stream_pieces(self, key: str, start: int, end: int, piece_bytes: int) -> AsyncIterator[bytes]:
        """Bytes ``[start, end)`` of ``key`` from one streamed GET, in pieces of ``piece_bytes``; a
        body cut short is requested again and the bytes already delivered are skipped."""
        policy, url = self.config.retry, self._object_url(key)
        pending, delivered = bytearray(), start  # bytes [delivered, delivered + len(pending)) are held
        for attempt in range(1, policy.attempts + 1):
            pending.clear()
            try:
                client = self._http()
                first = delivered
                headers = {"Range": f"bytes={first}-{end - 1}"} if first else {}
                async with client.stream("GET", url, headers=headers) as resp:
                    self._check(resp, key)
                    ranged = resp.status_code == 206
                    if ranged and not resp.headers.get("content-range", "").startswith(f"bytes {first}-"):
                        raise StoreError(f"{key}: {self.public_url} answered a range request with something else")
                    seen = first if ranged else 0  # offset in the object of the next body byte
                    async for chunk in self._body(resp, key):
                        lo = max(delivered + len(pending) - seen, 0)
                        hi = min(len(chunk), end - seen)
                        seen += len(chunk)
                        if hi > lo:
                            pending.extend(memoryview(chunk)[lo:hi])
                        while len(pending) >= piece_bytes or (pending and delivered + len(pending) == end):
                            piece = bytes(pending[:piece_bytes])
                            del pending[:piece_bytes]
                            delivered += len(piece)
                            yield piece
                        if seen >= end:
                            break
                if delivered == end:
                    return
                raise TransientError(f"short body for {key}: {delivered - start} of {end - start} bytes")
            except (TransientError, httpx.TransportError) as exc:
                if attempt == policy.attempts:
                    raise StoreError(f"GET {key} (whole) failed after {attempt} attempts: {exc!r}") from exc
                await asyncio.sleep(policy.delay(attempt))

    async def _get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; a body cut short is resumed from the first missing byte."""
        received = bytearray()

        async def op(client: httpx.AsyncClient) -> bytes:
            first = start + len(received)
            headers = {"Range": f"bytes={first}-{end - 1}"}
            async with client.stream("GET", self._object_url(key), headers=headers) as resp:
                self._check(resp, key)
                encoded = resp.headers.get("content-encoding", "").strip().lower() not in ("", "identity")
                if resp.status_code == 200 or encoded:
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
                async for chunk in self._body(resp, key):
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

    async def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None
    ) -> tuple[bytes, str] | None:
        async def op(client: httpx.AsyncClient) -> tuple[bytes, str] | None:
            headers = {"If-None-Match": etag} if etag else {}
            async with client.stream("GET", self._object_url(key), headers=headers) as resp:
                if resp.status_code == 304:
                    return None
                self._check(resp, key)
                length = resp.headers.get("content-length", "")
                identity = resp.headers.get("content-encoding", "").strip().lower() in ("", "identity")
                if length.isdigit() and identity:
                    check_size(key, int(length), max_bytes)
                body = bytearray()
                async for chunk in self._body(resp, key):
                    body.extend(chunk)
                    check_size(key, len(body), max_bytes)
            if length.isdigit() and identity and int(length) != len(body):
                raise TransientError(f"short body for {key}")
            return bytes(body), resp.headers.get("etag", "")

        return await self._request(f"GET {key} if changed", op)

    async def list(self, prefix: str) -> list[str]:
        raise NotImplementedError("static HTTP stores cannot list keys")

    async def put(self, key: str, data: bytes | memoryview) -> None:
        raise StoreError(f"{self.public_url} is a read-only HTTP store; publish to the bucket behind it")

    async def delete(self, key: str) -> None:
        raise StoreError(f"{self.public_url} is a read-only HTTP store")
