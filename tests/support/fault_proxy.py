"""A fault-injecting HTTP reverse proxy on loopback, in front of a real server (SeaweedFS's S3 gateway without identities,
a static file server), plus that static file server. Faults are injected on the wire, so the
stores under test run their real client code paths (aiobotocore, httpx)."""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web


@dataclass
class Fault:
    """Applied to the next ``times`` requests whose method and path match."""

    kind: str  # "status", "delay", "truncate", "drop", "missing"
    path: str = ".*"  # regex searched in the request path
    method: str = "GET"
    times: int = 1
    status: int = 503
    delay_s: float = 5.0


@dataclass
class FaultProxy:
    """Forwards to ``upstream``; records requests; applies queued faults."""

    upstream: str
    faults: list[Fault] = field(default_factory=list)
    log: list[tuple[str, str, int]] = field(default_factory=list)
    url: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *faults: Fault) -> None:
        with self._lock:
            self.faults.extend(faults)

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.log.clear()

    def _take(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.method in (method, "*") and re.search(fault.path, path):
                    fault.times -= 1
                    if fault.times <= 0:
                        self.faults.remove(fault)
                    return fault
        return None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        fault = self._take(request.method, request.path)
        if fault and fault.kind == "drop":  # connection closed before any response
            request.transport.close()
            self.log.append((request.method, request.path, -1))
            return web.Response(status=500)
        if fault and fault.kind == "status":
            self.log.append((request.method, request.path, fault.status))
            return web.Response(status=fault.status, text="injected fault")
        if fault and fault.kind == "missing":
            self.log.append((request.method, request.path, 404))
            return web.Response(status=404, text="<Error><Code>NoSuchKey</Code></Error>")
        if fault and fault.kind == "delay":
            await asyncio.sleep(fault.delay_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        body = await request.read()
        async with aiohttp.ClientSession(auto_decompress=False) as session:
            async with session.request(
                request.method,
                self.upstream + request.rel_url.raw_path_qs,
                headers=headers,
                data=body,
                allow_redirects=False,
            ) as up:
                payload = await up.read()
                self.log.append((request.method, request.path, up.status))
                resp = web.StreamResponse(
                    status=up.status,
                    headers={
                        k: v
                        for k, v in up.headers.items()
                        if k.lower() not in ("transfer-encoding", "content-length", "connection", "content-encoding")
                    },
                )
                length = up.headers.get("content-length") if request.method == "HEAD" else None
                resp.content_length = int(length) if length is not None else len(payload)
                await resp.prepare(request)
                if fault and fault.kind == "truncate" and len(payload) > 1:
                    await resp.write(payload[: len(payload) // 2])
                    request.transport.close()  # the declared length is never reached
                    return resp
                await resp.write(payload)
                await resp.write_eof()
                return resp


class LoopThread:
    """Runs aiohttp servers on an event loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._runners: list[web.AppRunner] = []

    def serve(self, app: web.Application) -> str:
        async def start() -> str:
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self._runners.append(runner)
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            return f"http://127.0.0.1:{port}"

        return asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)

    def close(self) -> None:
        async def stop() -> None:
            for runner in self._runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_proxy(loop: LoopThread, upstream: str) -> FaultProxy:
    proxy = FaultProxy(upstream)
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    proxy.url = loop.serve(app)
    return proxy


def start_static_server(loop: LoopThread, root: Path) -> str:
    """aiohttp's static file handler: Range requests, ETag and If-None-Match."""
    app = web.Application()
    app.router.add_static("/", root, show_index=False)
    return loop.serve(app)
