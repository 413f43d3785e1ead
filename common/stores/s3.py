"""``s3://bucket/prefix`` store through aiobotocore (AWS S3, MinIO and other S3-compatible services).

Configured the standard AWS way: credentials and region from the environment, shared config and
profiles (``AWS_PROFILE``), and ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` to point at another
endpoint (buckets are then addressed path-style). Large objects are written with multipart uploads
(visible only once complete; a failed one is aborted) and read with parallel ranged GETs; a body
cut short is resumed from where it stopped; the head pointer is read conditionally (ETag).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from ..errors import DeltaSwapError, NotFoundError, StoreError, TransientError
from ..retry import RetryPolicy, retry
from .base import RangedStore, check_key, check_size, public_url

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class S3Config:
    """Transfer sizes and parallelism (memory in flight is about concurrency x part size)."""

    part_size: int = 8 << 20
    multipart_threshold: int = 64 << 20
    concurrency: int = 8
    retry: RetryPolicy = RetryPolicy()


_TRANSIENT_CODES = {
    "500",
    "502",
    "503",
    "504",
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestTimeTooSkewed",
}
_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
_CONDITION_CODES = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}


class _ConditionFailed(StoreError):
    """A conditional write lost: the object is not in the state the writer expected."""


class S3Store(RangedStore):
    """Keys live under ``s3://bucket/prefix/``. Binds to the event loop of its first use."""

    def __init__(self, url: str, config: S3Config = S3Config()) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise StoreError(f"not an s3:// URL: {public_url(url)}")
        self.url = url
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.config = config
        self.part_size = config.part_size
        self._client: Any = None
        self._client_cm: Any = None
        self._sem: asyncio.Semaphore | None = None

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    async def _s3(self) -> Any:
        if self._client is None:
            from aiobotocore.config import AioConfig
            from aiobotocore.session import get_session

            # Retries are ours (they also resume short bodies); botocore makes one attempt.
            aio_config = AioConfig(
                retries={"max_attempts": 1, "mode": "standard"},
                max_pool_connections=max(10, self.config.concurrency * 2),
                connect_timeout=self.config.retry.timeout_s,
                read_timeout=self.config.retry.timeout_s,
            )
            self._client_cm = get_session().create_client("s3", config=aio_config)
            self._client = await self._client_cm.__aenter__()
            self._sem = asyncio.Semaphore(self.config.concurrency)
        return self._client

    async def close(self) -> None:
        if self._client_cm is not None:
            await self._client_cm.__aexit__(None, None, None)
            self._client = self._client_cm = None

    async def _call(self, what: str, op) -> Any:
        """Run one S3 request with retries, mapping errors to the store's error types."""

        async def attempt() -> Any:
            client = await self._s3()
            assert self._sem is not None
            async with self._sem:
                try:
                    return await op(client)
                except Exception as exc:
                    raise _classify(exc, what) from exc

        return await retry(attempt, self.config.retry, what)

    # ------------------------------------------------------------------ reads

    async def size(self, key: str) -> int | None:
        try:
            head = await self._call(f"HEAD {key}", lambda c: c.head_object(Bucket=self.bucket, Key=self._key(key)))
        except NotFoundError:
            return None
        return int(head["ContentLength"])

    async def _get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; a body cut short is resumed from the first missing byte."""
        received = bytearray()

        async def op(client: Any) -> bytes:
            first = start + len(received)
            resp = await client.get_object(Bucket=self.bucket, Key=self._key(key), Range=f"bytes={first}-{end - 1}")
            async with resp["Body"] as body:
                while chunk := await body.read(1 << 20):
                    self._take(received, chunk, start, end, key)
            return self._whole(received, start, end, key)

        return await self._call(f"GET {key} [{start}, {end})", op)

    async def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None
    ) -> tuple[bytes, str] | None:
        async def op(client: Any) -> tuple[bytes, str] | None:
            kwargs = {"IfNoneMatch": etag} if etag else {}
            try:
                resp = await client.get_object(Bucket=self.bucket, Key=self._key(key), **kwargs)
            except Exception as exc:
                if _code(exc) in ("304", "NotModified"):
                    return None
                raise
            length = int(resp["ContentLength"])
            check_size(key, length, max_bytes)
            data = bytearray()
            async with resp["Body"] as body:
                while chunk := await body.read(1 << 16):
                    data.extend(chunk)
                    check_size(key, len(data), max_bytes)
            if len(data) != length:
                raise TransientError(f"short body for {key}")
            return bytes(data), resp["ETag"]

        return await self._call(f"GET {key} if changed", op)

    async def put_if(self, key: str, data: bytes | memoryview, etag: str | None) -> bool:
        """A conditional PUT (If-Match, or If-None-Match: * when ``etag`` is None), which S3 and
        MinIO evaluate atomically: False when the object changed (412) or a concurrent
        conditional write won (409)."""
        condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
        try:
            await self._call(
                f"PUT {key} if unchanged",
                lambda c: c.put_object(Bucket=self.bucket, Key=self._key(key), Body=bytes(data), **condition),
            )
        except _ConditionFailed:
            return False
        return True

    async def list(self, prefix: str) -> list[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        full, strip = root + prefix, len(root)

        async def op(client: Any) -> list[str]:
            keys: list[str] = []
            async for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
            return sorted(keys)

        return await self._call(f"LIST {prefix}", op)

    # ------------------------------------------------------------------ writes

    async def put(self, key: str, data: bytes | memoryview) -> None:
        data = memoryview(data)
        if len(data) <= self.config.multipart_threshold:
            await self._call(
                f"PUT {key}", lambda c: c.put_object(Bucket=self.bucket, Key=self._key(key), Body=bytes(data))
            )
            return
        full = self._key(key)
        upload = await self._call(
            f"CREATE MULTIPART {key}", lambda c: c.create_multipart_upload(Bucket=self.bucket, Key=full)
        )
        upload_id = upload["UploadId"]
        part = self.config.part_size

        async def send(number: int, offset: int) -> dict:
            body = bytes(data[offset : offset + part])
            resp = await self._call(
                f"PUT {key} part {number}",
                lambda c: c.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=body),
            )
            return {"PartNumber": number, "ETag": resp["ETag"]}

        sends = [asyncio.ensure_future(send(i + 1, off)) for i, off in enumerate(range(0, len(data), part))]
        try:
            parts = await asyncio.gather(*sends)
            await self._call(
                f"COMPLETE MULTIPART {key}",
                lambda c: c.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": list(parts)}
                ),
            )
        except BaseException as failed:
            # Nothing is visible until COMPLETE; the abort frees the stored parts, once no part is
            # still on its way (a part sent after it would be stored again). When the store is gone
            # the abort fails too: the upload's error is the one that counts, and the parts stay
            # invisible until a lifecycle rule (AbortIncompleteMultipartUpload) removes them.
            for task in sends:
                task.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
            try:
                await self._call(
                    f"ABORT MULTIPART {key}",
                    lambda c: c.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id),
                )
            except Exception as exc:
                log.warning("%s: left an incomplete multipart upload (%s) after %s", key, exc, type(failed).__name__)
            raise

    async def delete(self, key: str) -> None:
        await self._call(f"DELETE {key}", lambda c: c.delete_object(Bucket=self.bucket, Key=self._key(key)))


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    error = response.get("Error", {}) if isinstance(response, dict) else {}
    code = str(error.get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None
    return code or str(status or "")


def _classify(exc: BaseException, what: str) -> BaseException:
    """Map a botocore/aiohttp exception to NotFoundError, TransientError or StoreError."""
    if isinstance(exc, (DeltaSwapError, asyncio.CancelledError)):  # ours already (an oversized object: not transient)
        return exc
    code = _code(exc)
    if code in _MISSING_CODES:
        return NotFoundError(f"{what}: not found")
    if code in _CONDITION_CODES:
        return _ConditionFailed(f"{what}: {code}")
    if code in _TRANSIENT_CODES or code.startswith("5"):
        return TransientError(f"{what}: {code}")
    if code:
        return StoreError(f"{what}: S3 error {code}")
    # No S3 error document: a network-level failure (timeout, reset, truncated response).
    return TransientError(f"{what}: {type(exc).__name__}")
