"""S3 (aiobotocore against a real SeaweedFS S3 gateway, signature v4 and identities checked) and
HTTP (httpx against aiohttp's static file server) stores, with faults injected on the wire by a
proxy in front of each server, and a store that dies mid-transfer (its gateway killed)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from delta_swap.chain import ChainReader
from delta_swap.errors import NotFoundError, ObjectTooLargeError, PublishError, StoreError
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.rebuild import rebuild
from delta_swap.retry import RetryPolicy
from delta_swap.settings import Settings
from delta_swap.stores import open_store
from delta_swap.stores.http import HttpConfig, HttpStore
from delta_swap.stores.s3 import S3Config, S3Store
from delta_swap.subscriber import Subscriber
from delta_swap.testing import RecordingAdapter
from examples.servers.seaweedfs import SERVER, TRAINER, Identity
from tests.support.chains import assert_state_equal, rl_steps
from tests.support.fault_proxy import Fault, LoopThread, start_proxy, start_static_server

FAST_RETRY = RetryPolicy(attempts=6, base_delay_s=0.01, max_delay_s=0.05, timeout_s=2.0)
BUCKET = "rl-snapshots"  # made by the session's ``seaweedfs`` fixture (tests/conftest.py)
MIB = 1 << 20


@pytest.fixture(scope="module")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def faults(loop_thread, seaweedfs):
    """A fault proxy in front of SeaweedFS's identity-less gateway (the same data as the checked
    one): the proxy rewrites the Host header a signature covers, so it cannot front the gateway
    that checks signatures; those are tested on that gateway directly."""
    return start_proxy(loop_thread, seaweedfs.endpoint_of("s3-open"))


def _as(monkeypatch, seaweedfs, identity: Identity) -> None:
    """Point the S3 clients made from now on at the checked gateway as ``identity`` (through the
    AWS environment, as a trainer or server is configured)."""
    for k, v in seaweedfs.env(identity).items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def s3(seaweedfs, request, monkeypatch) -> str:
    """A fresh prefix per test on SeaweedFS's signature-checking gateway, as the trainer."""
    _as(monkeypatch, seaweedfs, TRAINER)
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"


@pytest.fixture
def faulty_s3(s3, faults, monkeypatch) -> str:
    """The same prefix reached through the fault proxy (fault list and log cleared)."""
    faults.clear()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", faults.url)
    return s3


def _s3(url: str, **cfg) -> S3Store:
    return S3Store(url, S3Config(retry=FAST_RETRY, **cfg))


def _prefix(url: str) -> str:
    return url.removeprefix(f"s3://{BUCKET}/")


async def test_s3_store_round_trip_multipart_and_ranges(s3, seaweedfs, faults, monkeypatch) -> None:
    big = os.urandom(13 * MIB)
    store = _s3(s3, part_size=5 * MIB, multipart_threshold=6 * MIB)
    await store.put("a/small", b"hello")
    await store.put("a/big", big)
    assert await store.get("a/small") == b"hello"
    assert await store.get("a/big") == big
    assert await store.get("a/big", 7, 5 * MIB + 3) == big[7 : 5 * MIB + 3]
    assert await store.size("a/big") == len(big) and await store.size("nope") is None
    assert await store.list("a/") == ["a/big", "a/small"]
    with pytest.raises(NotFoundError):
        await store.get("missing")
    await store.delete("a/small")
    assert await store.list("a/") == ["a/big"]
    await store.close()
    # The store holds it as a multipart object of three parts (its ETag says so) ...
    etag = seaweedfs.client().head_object(Bucket=BUCKET, Key=f"{_prefix(s3)}/a/big")["ETag"]
    assert etag.strip('"').endswith("-3"), etag
    # ... and a reader fetches it in parallel ranges (seen by the proxy in front of the store).
    faults.clear()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", faults.url)
    reader = _s3(s3, part_size=4 * MIB)
    assert await reader.get("a/big") == big
    await reader.close()
    assert sum(1 for m, p, s in faults.log if m == "GET" and p.endswith("a/big") and s == 206) == 4


async def test_s3_head_reads_are_conditional(s3) -> None:
    store = _s3(s3)
    await store.put("HEAD", b'{"snapshot_id": "step-0000000001", "step": 1}')
    first = await store.get_if_changed("HEAD", None)
    assert first is not None
    assert await store.get_if_changed("HEAD", first[1]) is None  # the store answered 304
    await store.put("HEAD", b'{"snapshot_id": "step-0000000002", "step": 2}')
    assert (await store.get_if_changed("HEAD", first[1]))[0].startswith(b'{"snapshot_id": "step-0000000002"')
    await store.close()


def _publish(url: str, steps, start: int = 0, **cfg) -> None:
    with Publisher(url, PublisherConfig(**{"base_every": 100, **cfg})) as pub:
        for i, s in enumerate(steps):
            pub.publish(start + i, s)


async def test_publish_and_rebuild_over_s3_with_the_servers_read_only_key(s3, seaweedfs, monkeypatch) -> None:
    steps = rl_steps(5)
    _publish(s3, steps)
    _as(monkeypatch, seaweedfs, SERVER)
    store = open_store(s3)
    manifests = await ChainReader(store).list()
    assert [m.kind for m in manifests] == ["base"] + ["delta"] * 4
    assert_state_equal((await rebuild(store))[1], steps[-1])
    with pytest.raises(StoreError, match="AccessDenied"):  # the servers' key reads, never writes
        await store.put("HEAD", b"{}")
    with pytest.raises(StoreError, match="AccessDenied"):
        await store.delete(manifests[0].snapshot_id + "/manifest.json")
    await store.close()
    assert [m.step for m in await ChainReader(_s3(s3)).list()] == [0, 1, 2, 3, 4]


BAD_ACCESS = {  # case: (store, identity, command, the S3 error the line names)
    "missing bucket": ("s3://no-such-bucket/run", TRAINER, "inspect", "NoSuchBucket"),
    "wrong secret": (
        None,
        Identity("trainer", TRAINER.access_key, "not-the-secret", ()),
        "pull",
        "SignatureDoesNotMatch",
    ),
    "unknown key": (None, Identity("nobody", "no-such-key", "x", ()), "inspect", "InvalidAccessKeyId"),
    "read-only key publishes": (None, SERVER, "publish", "AccessDenied"),
}


def _cli(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """The ``delta-swap`` command in a process of its own."""
    cmd = [sys.executable, "-m", "delta_swap.cli", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env})


@pytest.mark.parametrize("case", sorted(BAD_ACCESS))
def test_cli_bad_bucket_or_credentials_end_in_one_line(s3, seaweedfs, tmp_path, case) -> None:
    """``delta-swap`` against a bucket that does not exist, with keys the gateway refuses, or
    publishing with the servers' read-only key: exit 1 with one line naming the S3 error,
    nothing written, and the trainer's key then publishes that step onto the intact chain."""
    from safetensors.torch import save_file

    steps = rl_steps(2)
    _publish(s3, steps[:1])
    url, identity, command, code = BAD_ACCESS[case]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in steps[1].items()}, str(ckpt / "model.safetensors"))
    argv = {
        "inspect": ["inspect", "--store", url or s3],
        "pull": ["pull", "--store", url or s3, "--out", str(tmp_path / "out"), "--quiet"],
        "publish": ["publish", str(ckpt), "--store", url or s3, "--step", "1", "--quiet"],
    }[command]
    listing = {"Bucket": BUCKET, "Prefix": _prefix(s3)}
    before = [(o["Key"], o["ETag"]) for o in seaweedfs.client().list_objects_v2(**listing)["Contents"]]
    out = _cli(argv, seaweedfs.env(identity))
    errors = [line for line in out.stderr.splitlines() if ": error:" in line]  # (warnings may precede it)
    assert out.returncode == 1 and errors == out.stderr.strip().splitlines()[-1:], out.stderr
    assert errors[0].startswith(f"delta-swap {command}: error:") and code in errors[0], out.stderr
    assert not (tmp_path / "out").exists()
    after = [(o["Key"], o["ETag"]) for o in seaweedfs.client().list_objects_v2(**listing)["Contents"]]
    assert after == before  # nothing written, nothing lost
    if command == "publish":
        out = _cli(argv, seaweedfs.env(TRAINER))
        assert out.returncode == 0, out.stderr
        assert_state_equal(asyncio.run(rebuild(_s3(s3)))[1], steps[1])


@pytest.mark.parametrize("case", ["missing bucket", "wrong secret", "unknown key"])
async def test_a_server_with_a_bad_bucket_or_key_reports_it_in_its_status(s3, seaweedfs, monkeypatch, case) -> None:
    _publish(s3, rl_steps(1))
    url, identity, _, code = BAD_ACCESS[case]
    _as(monkeypatch, seaweedfs, identity)
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=url or s3), engine, store=_s3(url or s3))
    assert not await sub.sync()
    error = sub.status()["last_error"]
    assert sub.current is None and not engine.updates and code in error and "\n" not in error, error
    await sub.stop()


# ---------------------------------------------------------------------- the store dies mid-transfer

BIG = {"embed.weight": (2048, 1536), "layers.0.q.weight": (1536, 1536), "lm_head.weight": (2048, 1536)}  # ~17 MB bf16


class _KillsGatewayOn(S3Store):
    """An S3 store that kills SeaweedFS's gateway when its client is about to send the ``nth``
    request of ``operation`` (a botocore event): the store dies mid-transfer, at a known point."""

    def __init__(self, url: str, seaweedfs, operation: str, nth: int, **cfg) -> None:
        super().__init__(url, S3Config(retry=FAST_RETRY, **cfg))
        self.seaweedfs, self.operation, self.nth, self.seen = seaweedfs, operation, nth, 0

    revive_for_abort = False  # start the gateway again when the store aborts a multipart upload
    revived = False

    async def _s3(self):
        fresh = self._client is None
        client = await super()._s3()
        if fresh:
            client.meta.events.register(f"before-send.s3.{self.operation}", self._count)
            client.meta.events.register("before-send.s3.AbortMultipartUpload", self._revive)
        return client

    def _revive(self, **_) -> None:
        if self.revive_for_abort and "s3" not in self.seaweedfs.procs:
            self.seaweedfs.start_gateway()
            self.revived = True

    def _count(self, request, **_) -> None:
        if self.operation != "GetObject" or "/shard-" in request.url:
            self.seen += 1
            if self.seen == self.nth:
                self.seaweedfs.kill_gateway()


async def test_gateway_killed_mid_multipart_upload_leaves_no_object_and_head_in_place(s3, seaweedfs) -> None:
    steps = rl_steps(2, shapes=BIG)
    _publish(s3, steps[:1])
    client = seaweedfs.client()
    head_before = client.get_object(Bucket=BUCKET, Key=f"{_prefix(s3)}/HEAD")["Body"].read()
    store = _KillsGatewayOn(s3, seaweedfs, "UploadPart", 2, part_size=5 * MIB, multipart_threshold=5 * MIB)
    try:
        with pytest.raises(PublishError, match="failed after 6 attempts") as failed:
            with Publisher(store, PublisherConfig(base_every=1, heartbeat_every=0)) as pub:
                pub.publish(1, steps[1])
        # One line naming the part that failed (not the abort, which failed too: the store was gone).
        assert "\n" not in str(failed.value) and " part " in str(failed.value) and "ABORT" not in str(failed.value)
    finally:
        seaweedfs.start_gateway()
    assert store.seen >= 2
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=_prefix(s3))["Contents"]]
    assert not [k for k in keys if "step-0000000001" in k], keys  # no part of the upload is visible
    assert client.get_object(Bucket=BUCKET, Key=f"{_prefix(s3)}/HEAD")["Body"].read() == head_before
    # The trainer publishes the step again: multipart, bit-exact, on the chain.
    big = _s3(s3, part_size=5 * MIB, multipart_threshold=5 * MIB)
    with Publisher(big, PublisherConfig(base_every=1, heartbeat_every=0)) as pub:
        pub.publish(1, steps[1])
    shards = [
        o
        for o in client.list_objects_v2(Bucket=BUCKET, Prefix=_prefix(s3))["Contents"]
        if "step-0000000001/shard-" in o["Key"]
    ]
    assert shards and any(o["Size"] > 5 * MIB and "-" in o["ETag"] for o in shards)
    store = _s3(s3)
    manifest, state, path = await rebuild(store)
    assert manifest.step == 1 and [m.step for m in path] == [1]
    assert_state_equal(state, steps[1])
    await store.close()


async def test_a_multipart_upload_cut_off_by_a_store_that_comes_back_is_aborted(s3, seaweedfs) -> None:
    """The gateway dies at the second part and is back by the time the store gives up: the put
    fails naming a part, nothing is visible, and the upload is aborted (the store holds no parts)."""
    store = _KillsGatewayOn(s3, seaweedfs, "UploadPart", 2, part_size=5 * MIB, multipart_threshold=5 * MIB)
    store.revive_for_abort = True
    try:
        with pytest.raises(StoreError, match=" part .* failed after 6 attempts"):
            await store.put("big", os.urandom(11 * MIB))
    finally:
        if "s3" not in seaweedfs.procs:
            seaweedfs.start_gateway()
    assert store.seen >= 2 and store.revived
    assert await store.size("big") is None
    await store.close()
    uploads = seaweedfs.client().list_multipart_uploads(Bucket=BUCKET, Prefix=_prefix(s3))
    assert not uploads.get("Uploads"), uploads


async def test_gateway_killed_mid_download_keeps_the_last_good_and_recovers(s3, seaweedfs, monkeypatch) -> None:
    steps = rl_steps(2, shapes=BIG)
    _publish(s3, steps[:1], base_every=1)
    _as(monkeypatch, seaweedfs, SERVER)
    engine = RecordingAdapter()
    store = _KillsGatewayOn(s3, seaweedfs, "GetObject", 3, part_size=1 * MIB, concurrency=2)
    sub = Subscriber(Settings(store=s3), engine, store=store)
    try:
        store.nth = 0  # the first sync runs through
        assert await sub.sync() and sub.current.step == 0
        _as(monkeypatch, seaweedfs, TRAINER)
        _publish(s3, steps[1:], start=1, base_every=1)  # a base: one large shard per tensor file
        store.seen, store.nth = 0, 3
        try:
            assert not await sub.sync()
        finally:
            seaweedfs.start_gateway()
        st = sub.status()
        assert st["current_step"] == 0 and "failed after 6 attempts" in st["last_error"], st
        assert "\n" not in st["last_error"] and len(engine.updates) == 1
        assert await sub.sync(), sub.status()["last_error"]
        assert sub.current.step == 1 and sub.status()["last_error"] is None
        assert_state_equal(engine.weights, steps[1])
    finally:
        await sub.stop()


# A fault matrix: each case ends with the right snapshot applied or the last good one kept.
TRANSIENT = {
    "5xx burst": [Fault("status", path="shard-", times=3, status=503)],
    "throttled": [Fault("status", path="manifest", times=2, status=503)],
    "timeout": [Fault("delay", path="shard-", delay_s=3.0)],
    "truncated body": [Fault("truncate", path="shard-", times=2)],
    "dropped connection": [Fault("drop", path="shard-", times=2)],
}


@pytest.mark.parametrize("case", sorted(TRANSIENT))
async def test_s3_transient_faults_end_with_the_new_snapshot(faulty_s3, faults, case) -> None:
    steps = rl_steps(3)
    _publish(faulty_s3, steps[:2])
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=faulty_s3), engine, store=_s3(faulty_s3))
    assert await sub.sync() and sub.current.step == 1
    _publish(faulty_s3, steps[2:], start=2)
    faults.add(*[Fault(**vars(f)) for f in TRANSIENT[case]])
    assert await sub.sync(), sub.status()["last_error"]
    assert sub.current.step == 2 and sub.status()["last_error"] is None
    await sub.stop()
    assert not faults.faults, "every injected fault was hit"
    assert_state_equal(engine.weights, steps[2])


async def test_s3_missing_shard_and_head_ahead_of_its_shards_keep_the_last_good(faulty_s3, faults) -> None:
    steps = rl_steps(3)
    _publish(faulty_s3, steps[:2])
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=faulty_s3), engine, store=_s3(faulty_s3))
    await sub.sync()
    _publish(faulty_s3, steps[2:], start=2)
    # The head names a snapshot whose shard is not visible yet (eventual listing, a slow copy...).
    faults.add(Fault("missing", path="step-0000000002/shard-", method="*", times=100))
    assert not await sub.sync()
    st = sub.status()
    assert st["current_step"] == 1 and st["newest_step"] == 2 and "not found" in st["last_error"]
    assert len(engine.updates) == 1
    faults.clear()  # the shard becomes visible
    assert await sub.sync() and sub.current.step == 2
    await sub.stop()
    assert_state_equal(engine.weights, steps[2])


async def test_a_dead_store_fails_fast_and_keeps_serving(faulty_s3, faults) -> None:
    steps = rl_steps(2)
    _publish(faulty_s3, steps[:1])
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=faulty_s3), engine, store=_s3(faulty_s3))
    await sub.sync()
    faults.add(Fault("status", path=".*", method="*", times=1000, status=500))
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


def test_several_subscriber_processes_converge_on_identical_weights(s3, seaweedfs, tmp_path) -> None:
    steps = rl_steps(6)
    _publish(s3, steps[:1])
    env = seaweedfs.env(SERVER)  # the servers' read-only key
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
