"""S3 (aiobotocore against moto's real S3 server) and HTTP (httpx against aiohttp's static file
server) stores, with faults injected on the wire by a proxy in front of each server."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch
import xxhash

from delta_swap.chain import ChainReader
from delta_swap.errors import NotFoundError, ObjectTooLargeError, StoreError
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.rebuild import rebuild
from delta_swap.retry import RetryPolicy
from delta_swap.settings import Settings
from delta_swap.stores import open_store
from delta_swap.stores.http import HttpConfig, HttpStore
from delta_swap.stores.s3 import S3Config, S3Store
from delta_swap.subscriber import Subscriber
from delta_swap.testing import RecordingAdapter
from tests.support.chains import assert_state_equal, rl_steps
from tests.support.fault_proxy import Fault, LoopThread, start_proxy, start_static_server

FAST_RETRY = RetryPolicy(attempts=6, base_delay_s=0.01, max_delay_s=0.05, timeout_s=2.0)


@pytest.fixture(scope="module")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def moto(loop_thread):
    """moto's S3 server on loopback, reached through a fault proxy (endpoint from AWS env vars)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    proxy = start_proxy(loop_thread, f"http://{host}:{port}")
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": proxy.url,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    boto3.client("s3", endpoint_url=f"http://{host}:{port}").create_bucket(Bucket="rl-snapshots")
    yield proxy
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def s3(moto, request):
    """A fresh prefix per test, fault list cleared."""
    moto.clear()
    return f"s3://rl-snapshots/{request.node.name.replace('[', '-').replace(']', '')}"


def _s3(url: str, **cfg) -> S3Store:
    return S3Store(url, S3Config(retry=FAST_RETRY, **cfg))


async def test_s3_store_round_trip_multipart_and_ranges(s3, moto) -> None:
    big = os.urandom(13 << 20)
    store = _s3(s3, part_size=5 << 20, multipart_threshold=6 << 20)
    await store.put("a/small", b"hello")
    await store.put("a/big", big)
    assert await store.get("a/small") == b"hello"
    assert await store.get("a/big") == big
    assert await store.get("a/big", 7, (5 << 20) + 3) == big[7 : (5 << 20) + 3]
    assert await store.size("a/big") == len(big) and await store.size("nope") is None
    assert await store.list("a/") == ["a/big", "a/small"]
    with pytest.raises(NotFoundError):
        await store.get("missing")
    await store.delete("a/small")
    assert await store.list("a/") == ["a/big"]
    await store.close()
    methods = [(m, p) for m, p, _ in moto.log]
    assert any("uploadId" in p or m == "POST" for m, p in methods)  # multipart was used
    assert sum(1 for m, p, s in moto.log if m == "GET" and p.endswith("a/big") and s == 206) >= 3  # parallel ranges


async def test_s3_head_reads_are_conditional(s3, moto) -> None:
    store = _s3(s3)
    await store.put("HEAD", b'{"snapshot_id": "step-0000000001", "step": 1}')
    first = await store.get_if_changed("HEAD", None)
    assert first is not None
    assert await store.get_if_changed("HEAD", first[1]) is None
    await store.put("HEAD", b'{"snapshot_id": "step-0000000002", "step": 2}')
    assert (await store.get_if_changed("HEAD", first[1]))[0].startswith(b'{"snapshot_id": "step-0000000002"')
    await store.close()
    assert any(s == 304 for m, p, s in moto.log if p.endswith("/HEAD"))


def _publish(url: str, steps, start: int = 0, **cfg) -> None:
    with Publisher(url, PublisherConfig(base_every=100, **cfg)) as pub:
        for i, s in enumerate(steps):
            pub.publish(start + i, s)


async def test_publish_and_rebuild_over_s3(s3) -> None:
    steps = rl_steps(5)
    _publish(s3, steps)
    store = open_store(s3)
    manifests = await ChainReader(store).list()
    assert [m.kind for m in manifests] == ["base"] + ["delta"] * 4
    assert_state_equal((await rebuild(store))[1], steps[-1])
    await store.close()


# A fault matrix: each case ends with the right snapshot applied or the last good one kept.
TRANSIENT = {
    "5xx burst": [Fault("status", path="shard-", times=3, status=503)],
    "throttled": [Fault("status", path="manifest", times=2, status=503)],
    "timeout": [Fault("delay", path="shard-", delay_s=3.0)],
    "truncated body": [Fault("truncate", path="shard-", times=2)],
    "dropped connection": [Fault("drop", path="shard-", times=2)],
}


@pytest.mark.parametrize("case", sorted(TRANSIENT))
async def test_s3_transient_faults_end_with_the_new_snapshot(s3, moto, case) -> None:
    steps = rl_steps(3)
    _publish(s3, steps[:2])
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=s3), engine, store=_s3(s3))
    assert await sub.sync() and sub.current.step == 1
    _publish(s3, steps[2:], start=2)
    moto.add(*[Fault(**vars(f)) for f in TRANSIENT[case]])
    assert await sub.sync(), sub.status()["last_error"]
    assert sub.current.step == 2 and sub.status()["last_error"] is None
    await sub.stop()
    assert not moto.faults, "every injected fault was hit"
    assert_state_equal(engine.weights, steps[2])


async def test_s3_missing_shard_and_head_ahead_of_its_shards_keep_the_last_good(s3, moto) -> None:
    steps = rl_steps(3)
    _publish(s3, steps[:2])
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=s3), engine, store=_s3(s3))
    await sub.sync()
    _publish(s3, steps[2:], start=2)
    # The head names a snapshot whose shard is not visible yet (eventual listing, a slow copy...).
    moto.add(Fault("missing", path="step-0000000002/shard-", method="*", times=100))
    assert not await sub.sync()
    st = sub.status()
    assert st["current_step"] == 1 and st["newest_step"] == 2 and "not found" in st["last_error"]
    assert len(engine.updates) == 1
    moto.clear()  # the shard becomes visible
    assert await sub.sync() and sub.current.step == 2
    await sub.stop()
    assert_state_equal(engine.weights, steps[2])


async def test_a_dead_store_fails_fast_and_keeps_serving(s3, moto) -> None:
    steps = rl_steps(2)
    _publish(s3, steps[:1])
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=s3), engine, store=_s3(s3))
    await sub.sync()
    moto.add(Fault("status", path=".*", method="*", times=1000, status=500))
    assert not await sub.sync()
    assert sub.current.step == 0 and "failed after 6 attempts" in sub.status()["last_error"]
    await sub.stop()
    assert len(engine.updates) == 1


# ---------------------------------------------------------------------- HTTP


@pytest.fixture
def http_store(tmp_path, loop_thread):
    """A file store published to directly, served read-only by aiohttp, behind a fault proxy."""
    root = tmp_path / "bucket"
    root.mkdir()
    proxy = start_proxy(loop_thread, start_static_server(loop_thread, root))
    return root, proxy


async def test_http_store_follows_a_chain_through_faults(http_store) -> None:
    root, proxy = http_store
    steps = rl_steps(4)
    _publish(str(root), steps[:2])
    engine = RecordingAdapter()
    store = HttpStore(proxy.url, HttpConfig(retry=FAST_RETRY, part_size=1024))
    sub = Subscriber(Settings(store=proxy.url), engine, store=store)
    assert await sub.sync() and sub.current.step == 1
    _publish(str(root), steps[2:], start=2)
    proxy.add(
        Fault("status", path="shard-", times=2, status=502),
        Fault("truncate", path="shard-"),
        Fault("drop", path="manifest"),
    )
    assert await sub.sync() and sub.current.step == 3, sub.status()
    assert not await sub.sync()  # unchanged head: answered 304
    manifests = await ChainReader(store).list()  # no listing over HTTP: walks back from HEAD
    assert [m.step for m in manifests] == [0, 1, 2, 3]
    with pytest.raises(StoreError, match="read-only"):
        await store.put("x", b"1")
    await sub.stop()
    assert_state_equal(engine.weights, steps[3])
    assert any(s == 206 for _, _, s in proxy.log) and any(s == 304 for _, p, s in proxy.log if p == "/HEAD")


def test_cli_reads_over_http(http_store, tmp_path) -> None:
    import subprocess
    import sys

    root, proxy = http_store
    _publish(str(root), rl_steps(3))
    out = subprocess.run(
        [sys.executable, "-m", "delta_swap.cli", "inspect", "--store", proxy.url, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert [r["step"] for r in json.loads(out.stdout)] == [0, 1, 2]


# ---------------------------------------------------------------------- fleet


def _follower(url: str, env: dict, target_step: int, out: str) -> None:
    os.environ.update(env)
    engine = RecordingAdapter()

    async def follow():
        # A spawned process: the conftest's freshness folder does not reach it.
        sub = Subscriber(Settings(store=url, poll_interval=0.1, freshness_file=f"{out}.freshness"), engine)
        sub.start()
        for _ in range(600):
            if sub.current is not None and sub.current.step == target_step:
                break
            await asyncio.sleep(0.1)
        await sub.stop()
        return sub.current

    current = asyncio.run(follow())  # a process of its own, as a rollout server is
    sums = {n: xxhash.xxh3_128_hexdigest(t.data) for n, t in engine.weights.items()}
    Path(out).write_text(json.dumps({"snapshot": current and current.snapshot_id, "checksums": sums}))


def test_several_subscriber_processes_converge_on_identical_weights(s3, tmp_path) -> None:
    steps = rl_steps(6)
    _publish(s3, steps[:1])
    env = {
        k: os.environ[k]
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3")
    }
    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"sub{i}.json" for i in range(3)]
    procs = [ctx.Process(target=_follower, args=(s3, env, 5, str(o))) for o in outs]
    for p in procs:
        p.start()
    _publish(s3, steps[1:], start=1)
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    results = [json.loads(o.read_text()) for o in outs]
    assert all(r["snapshot"] == "step-0000000005" for r in results)
    assert results[0]["checksums"] and results[0]["checksums"] == results[1]["checksums"] == results[2]["checksums"]
    expected = {n: xxhash.xxh3_128_hexdigest(t.view(torch.uint8).numpy().tobytes()) for n, t in steps[5].items()}
    assert results[0]["checksums"] == expected


def test_publisher_notifies_servers_after_each_commit(tmp_path, loop_thread) -> None:
    from aiohttp import web

    received: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.json_response({"accepted": True}, status=202)

    app = web.Application()
    app.router.add_post("/delta_swap/notify", handler)
    url = loop_thread.serve(app)
    steps = rl_steps(3)
    _publish(str(tmp_path), steps, notify_urls=(f"{url}/delta_swap/notify", "http://127.0.0.1:9/unreachable"))
    assert [r["snapshot_id"] for r in received] == ["step-0000000000", "step-0000000001", "step-0000000002"]


# ---------------------------------------------------------------------- conditional HEAD writes


@pytest.mark.parametrize("backend", ["s3", "file"])
async def test_concurrent_committers_never_move_head_backwards(backend, s3, tmp_path) -> None:
    from delta_swap.commit import move_head
    from delta_swap.stores import FileStore

    url = s3 if backend == "s3" else str(tmp_path / "store")
    _publish(url, rl_steps(6))
    store = _s3(url) if backend == "s3" else FileStore(url)
    reader = ChainReader(store)
    manifests = [await reader.manifest(f"step-{i:010d}") for i in range(6)]
    for _ in range(5):
        await store.put("HEAD", b'{"snapshot_id": "step-0000000000", "step": 0}')
        moved = await asyncio.gather(*(move_head(store, m) for m in reversed(manifests[1:])))
        head = await ChainReader(store).head()
        assert head is not None and head.step == 5 and moved[0]
    assert await store.put_if("HEAD", b"x", "not-the-etag") is False
    await store.close()


# ---------------------------------------------------------------------- HTTP servers that misbehave


@pytest.fixture
def quirky_http(tmp_path, loop_thread):
    """Static files behind handlers that ignore Range, omit Content-Length, send more than asked
    or redirect elsewhere, chosen by the first path segment."""
    from aiohttp import web

    root = tmp_path / "bucket"
    root.mkdir()

    async def handle(request: web.Request) -> web.StreamResponse:
        mode, _, key = request.match_info["tail"].partition("/")
        path = root / key
        if mode == "redirect":
            raise web.HTTPFound(f"http://127.0.0.2:9/{key}")
        if not path.is_file():
            raise web.HTTPNotFound()
        data = path.read_bytes()
        if mode == "ranges-ignored" or request.headers.get("Range") is None:
            if mode == "no-length":  # chunked: no Content-Length, also on HEAD
                resp = web.StreamResponse()
                resp.enable_chunked_encoding()
                await resp.prepare(request)
                if request.method != "HEAD":
                    await resp.write(data)
                await resp.write_eof()
                return resp
            return web.Response(body=data)
        first, last = (int(x) for x in request.headers["Range"].removeprefix("bytes=").split("-"))
        extra = 1 << 20 if mode == "too-much" else 0
        body = data[first : last + 1] + b"\0" * extra
        return web.Response(status=206, body=body, headers={"Content-Range": f"bytes {first}-{last}/{len(data)}"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return root, loop_thread.serve(app)


@pytest.mark.parametrize("mode", ["ranges-ignored", "no-length"])
async def test_http_stores_that_ignore_ranges_or_omit_lengths_still_work(quirky_http, mode) -> None:
    root, url = quirky_http
    steps = rl_steps(3)
    _publish(str(root), steps)
    engine = RecordingAdapter()
    store = HttpStore(f"{url}/{mode}", HttpConfig(retry=FAST_RETRY, part_size=1024))
    sub = Subscriber(Settings(store=f"{url}/{mode}"), engine, store=store)
    assert await sub.sync(), sub.status()["last_error"]
    assert sub.current.step == 2
    shard = next(p for p in (root / "snapshots" / "step-0000000000").iterdir() if p.name.startswith("shard-"))
    key = f"snapshots/step-0000000000/{shard.name}"
    assert await store.get(key, 100, 300) == shard.read_bytes()[100:300]
    with pytest.raises(ObjectTooLargeError):
        await store.get(key, max_bytes=100)  # more than allowed: cut off
    await sub.stop()
    assert_state_equal(engine.weights, steps[2])


async def test_http_stores_refuse_oversized_answers_and_redirects(quirky_http) -> None:
    root, url = quirky_http
    _publish(str(root), rl_steps(1))
    shard = next(p for p in (root / "snapshots" / "step-0000000000").iterdir() if p.name.startswith("shard-"))
    key = f"snapshots/step-0000000000/{shard.name}"
    too_much = HttpStore(f"{url}/too-much", HttpConfig(retry=FAST_RETRY, part_size=1024))
    with pytest.raises(StoreError, match="more bytes than the range"):
        await too_much.get(key)
    redirected = HttpStore(f"{url}/redirect", HttpConfig(retry=FAST_RETRY))
    with pytest.raises(StoreError, match="redirect"):
        await redirected.get_if_changed("HEAD", None)
    await too_much.close()
    await redirected.close()


# ---------------------------------------------------------------------- servers without Range, compressing CDNs


@pytest.fixture
def plain_http_server(tmp_path):
    """``python -m http.server`` on a folder (it answers every GET with the whole file, 200), its
    request log in a file: (method, path, status) per request."""
    import re
    import subprocess
    import sys

    root = tmp_path / "bucket"
    root.mkdir()
    log = tmp_path / "http.server.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", "0", "--directory", str(root)],
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        line = proc.stdout.readline().decode()
        port = int(re.search(r"port (\d+)", line).group(1))

        def requests() -> list[tuple[str, str, int]]:
            found = re.findall(r'"(GET|HEAD) (\S+) HTTP/[\d.]+" (\d+)', log.read_text())
            return [(m, p, int(s)) for m, p, s in found]

        yield root, f"http://127.0.0.1:{port}", requests
    finally:
        proc.kill()
        proc.wait()


async def test_a_server_that_ignores_range_is_read_once_per_shard(plain_http_server, tmp_path, monkeypatch) -> None:
    """Streamed into an arena in 1000-byte pieces, each shard costs one GET (plus, once per store,
    the ranged GET that showed the server ignores Range), not one whole download per piece."""
    import httpx

    from delta_swap import rebuild

    root, url, requests = plain_http_server
    ranged = httpx.get(f"{url}/nothing-yet", headers={"Range": "bytes=0-0"})
    assert ranged.status_code == 404
    monkeypatch.setattr(rebuild, "STREAM_PIECE_BYTES", 1000)
    steps = rl_steps(3, lr=2e-4)
    _publish(str(root), steps)
    shard_paths = sorted("/" + p.relative_to(root).as_posix() for p in root.glob("snapshots/*/shard-*"))
    assert httpx.get(url + shard_paths[0], headers={"Range": "bytes=0-9"}).status_code == 200  # Range ignored
    sizes = {p: (root / p[1:]).stat().st_size for p in shard_paths}
    assert all(size > 2 * 1000 for size in sizes.values())
    before = len(requests())
    engine = RecordingAdapter(arena_dir=str(tmp_path))
    store = HttpStore(url, HttpConfig(retry=FAST_RETRY, part_size=400))
    sub = Subscriber(Settings(store=url), engine, store=store)
    assert await sub.sync(), sub.status()["last_error"]
    assert sub.current.step == 2 and sub.status()["last_update_path"] == [
        "step-0000000000",
        "step-0000000001",
        "step-0000000002",
    ]
    await sub.stop()
    assert_state_equal(engine.weights, steps[2])
    gets = [p for m, p, _ in requests()[before:] if m == "GET"]
    per_shard = [gets.count(p) for p in shard_paths]
    # The first shard: the ranged parts of its first piece (answered 200, dropped after the
    # headers) and one whole read; every later shard: one read.
    assert per_shard[0] <= 1 + -(-1000 // 400) and per_shard[1:] == [1] * (len(shard_paths) - 1), per_shard


@pytest.fixture
def gzip_http(tmp_path, loop_thread):
    """Static files behind aiohttp's own response compression: ``/polite`` compresses whole
    answers when the request accepts it (as CDNs do) and serves ranges as stored; ``/gzip`` and
    ``/deflate`` compress every answer whatever the request accepts, ignoring Range. Records each
    request's Accept-Encoding."""
    from aiohttp import web

    root = tmp_path / "bucket"
    root.mkdir()
    accepted: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        mode, _, key = request.match_info["tail"].partition("/")
        accepted.append(request.headers.get("Accept-Encoding", ""))
        path = root / key
        if not path.is_file():
            raise web.HTTPNotFound()
        data = path.read_bytes()
        rng = request.headers.get("Range")
        if rng and mode == "polite":
            first, last = (int(x) for x in rng.removeprefix("bytes=").split("-"))
            return web.Response(
                status=206, body=data[first : last + 1], headers={"Content-Range": f"bytes {first}-{last}/{len(data)}"}
            )
        resp = web.Response(body=data)
        resp.enable_compression(None if mode == "polite" else web.ContentCoding(mode))
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return root, loop_thread.serve(app), accepted


@pytest.mark.parametrize("mode", ["polite", "gzip", "deflate"])
@pytest.mark.parametrize("streamed", [False, True])
async def test_gzip_compressing_servers_are_read_as_stored(gzip_http, tmp_path, monkeypatch, mode, streamed) -> None:
    """Reads ask for ``Accept-Encoding: identity`` (a polite CDN then sends the bytes as stored);
    a server that compresses anyway is inflated, never past the size the reader allows."""
    import httpx

    from delta_swap import rebuild

    root, url, accepted = gzip_http
    steps = rl_steps(3, lr=2e-4)
    _publish(str(root), steps)
    head = httpx.get(f"{url}/{mode}/HEAD", headers={"Accept-Encoding": "gzip"})
    assert head.headers.get("content-encoding") in ("gzip", "deflate")  # it compresses when allowed
    if streamed:
        monkeypatch.setattr(rebuild, "STREAM_PIECE_BYTES", 1000)
    accepted.clear()
    engine = RecordingAdapter(arena_dir=str(tmp_path) if streamed else None)
    store = HttpStore(f"{url}/{mode}", HttpConfig(retry=FAST_RETRY, part_size=400))
    sub = Subscriber(Settings(store=f"{url}/{mode}"), engine, store=store)
    assert await sub.sync(), sub.status()["last_error"]
    assert sub.current.step == 2
    assert_state_equal(engine.weights, steps[2])
    assert accepted and set(accepted) == {"identity"}
    if mode != "polite":  # bounded: a body that inflates past the allowed size is cut off
        (root / "HEAD").write_bytes(b" " * 100_000)
        with pytest.raises(ObjectTooLargeError):
            await store.get_if_changed("HEAD", None, max_bytes=4096)
    await sub.stop()


# ---------------------------------------------------------------------- secrets


def test_no_secret_reaches_a_log_line_an_error_or_a_repr(tmp_path, loop_thread, caplog, capsys) -> None:
    """A server following an http store whose URL carries a password, with an admin token, and a
    CLI pull from the same URL, all logged at DEBUG (delta-swap's, httpx's and every other logger):
    neither secret appears in a log line, an error, the status or a repr. The password reaches the
    server only as basic auth."""
    import base64
    import logging

    import httpx
    from aiohttp import web
    from fastapi import FastAPI

    from delta_swap import cli, service

    password, token = "pw-Zq81xK", "tok-Hj27Lm"
    root = tmp_path / "bucket"
    root.mkdir()
    expected = "Basic " + base64.b64encode(f"reader:{password}".encode()).decode()
    seen_auth: list[bool] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen_auth.append(request.headers.get("Authorization") == expected)
        if not seen_auth[-1]:
            raise web.HTTPUnauthorized()
        path = root / request.match_info["tail"]
        if not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    app_http = web.Application()
    app_http.router.add_route("*", "/{tail:.*}", handle)
    base = loop_thread.serve(app_http)
    url = base.replace("http://", f"http://reader:{password}@") + "/"
    steps = rl_steps(4)
    _publish(str(root), steps[:2])
    caplog.set_level(logging.DEBUG)
    settings = Settings(store=url, admin_token=token, poll_interval=3600, notify_interval=0.1)
    texts = [repr(settings), str(settings)]

    async def serve() -> None:
        app = FastAPI()
        service.mount(app, "set DELTA_SWAP_STORE")
        sub = service.start(app.state, settings, RecordingAdapter())
        await sub.sync()
        _publish(str(root), steps[2:3], start=2)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 9)), base_url="http://s")
        async with client:
            assert (
                await client.post("/delta_swap/notify", headers={"Authorization": "Bearer wrong"})
            ).status_code == 401
            assert (
                await client.post("/delta_swap/notify", headers={"Authorization": f"Bearer {token}"})
            ).status_code == 202
            for _ in range(200):
                if sub.current is not None and sub.current.step == 2:
                    break
                await asyncio.sleep(0.05)
            assert sub.current.step == 2
            _publish(str(root), steps[3:], start=3)
            shard = next((root / "snapshots" / "step-0000000003").glob("shard-*"))
            shard.unlink()  # an error on the way: logged, and in the status
            assert not await sub.sync()
            status = (await client.get("/delta_swap/status")).text
            assert "NotFoundError" in status
            texts.extend([status, repr(sub.reader.store), str(sub.reader.store.url)])
        await service.stop(app)

    asyncio.run(serve())
    assert (
        cli.main(["pull", "--store", url, "--out", str(tmp_path / "out"), "--quiet", "--snapshot", "step-0000000002"])
        == 0
    )
    assert cli.main(["pull", "--store", url, "--out", str(tmp_path / "out"), "--quiet"]) == 1  # the missing shard
    try:
        open_store(url.replace("http", "gopher", 1))
    except StoreError as exc:
        texts.append(str(exc))
    captured = capsys.readouterr()
    texts.extend([caplog.text, captured.out, captured.err])
    assert "HTTP Request: GET" in caplog.text and "follows" in caplog.text  # httpx and delta-swap did log
    assert seen_auth and all(seen_auth)  # every request carried the password as basic auth
    for text in texts:
        assert password not in text and token not in text, text[:2000]
