"""The admin routes on an open network: bearer token, closed without one (loopback only when the
operator opens it), one resync at a time, never backwards unless asked, notifies coalesced, and a
status route that reveals nothing secret.

The routes run in a real FastAPI app (the one both engines serve with) driven through httpx's
ASGI transport, which also lets a test present a non-loopback client address; the engine is
delta-swap's RecordingAdapter."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
from fastapi import FastAPI

from delta_swap import service, store_keys
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.settings import Settings
from delta_swap.testing import RecordingAdapter
from tests.support.chains import rl_steps

REMOTE = ("203.0.113.7", 40000)  # a documentation address: no packet is sent, it only fills the ASGI scope
LOOPBACK = ("127.0.0.1", 40000)


def _publish(root, steps, start=0):
    with Publisher(str(root), PublisherConfig(base_every=100)) as pub:
        for i, s in enumerate(steps):
            pub.publish(start + i, s)


async def _app(store, **settings) -> tuple[FastAPI, object]:
    app = FastAPI()
    service.mount(app, "set DELTA_SWAP_STORE")
    sub = service.start(app.state, Settings(store=str(store), poll_interval=3600, **settings), RecordingAdapter())
    await sub.sync()
    return app, sub


def _client(app: FastAPI, client=LOOPBACK) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=client), base_url="http://server")


async def test_without_a_token_the_post_routes_are_closed_unless_loopback_is_opened(tmp_path, caplog) -> None:
    """A reverse proxy on the host connects from loopback: loopback alone is no credential."""
    _publish(tmp_path, rl_steps(1))
    with caplog.at_level(logging.INFO, logger="delta_swap"):
        app, _ = await _app(tmp_path)
    assert [r.levelname for r in caplog.records if "refused to every caller" in r.getMessage()] == ["WARNING"]
    async with _client(app, REMOTE) as remote, _client(app) as local:
        for client in (remote, local):
            assert (await client.post("/delta_swap/notify")).status_code == 403
            assert (await client.post("/delta_swap/resync")).status_code == 403
        assert (await remote.get("/delta_swap/status")).status_code == 200  # status stays open
    await service.stop(app)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="delta_swap"):
        app, _ = await _app(tmp_path, admin_open_loopback=True)
    assert [r.levelname for r in caplog.records if "reverse proxy" in r.getMessage()] == ["WARNING"]
    async with _client(app, REMOTE) as remote, _client(app) as local:
        assert (await remote.post("/delta_swap/notify")).status_code == 403
        assert (await remote.post("/delta_swap/resync")).status_code == 403
        assert (await local.post("/delta_swap/notify")).status_code == 202
    await service.stop(app)


async def test_with_a_token_every_post_needs_it(tmp_path) -> None:
    _publish(tmp_path, rl_steps(1))
    app, _ = await _app(tmp_path, admin_token="s3cret-token")
    async with _client(app, REMOTE) as remote, _client(app) as local:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-token"}):
            r = await local.post("/delta_swap/resync", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        ok = await remote.post("/delta_swap/resync", headers={"Authorization": "Bearer s3cret-token"})
        assert ok.status_code == 200 and ok.json()["resynced"]
        status = (await remote.get("/delta_swap/status")).text
        assert "s3cret" not in status
    await service.stop(app)


async def test_one_resync_at_a_time(tmp_path) -> None:
    _publish(tmp_path, rl_steps(1))
    app, sub = await _app(tmp_path, admin_open_loopback=True)
    gate = asyncio.Event()
    swap = sub.adapter.swap

    async def slow_swap(update, staged):
        await gate.wait()
        await swap(update, staged)

    sub.adapter.swap = slow_swap
    async with _client(app) as local:
        first = asyncio.create_task(local.post("/delta_swap/resync"))
        for _ in range(1000):
            if sub.resync_running:
                break
            await asyncio.sleep(0.01)
        assert sub.resync_running, "the first resync never started"
        storm = await asyncio.gather(*(local.post("/delta_swap/resync") for _ in range(20)))
        assert {r.status_code for r in storm} == {409}
        gate.set()
        assert (await first).status_code == 200
    assert len(sub.adapter.updates) == 2  # the first sync and one resync, not 21
    await service.stop(app)


async def test_a_resync_never_moves_back_unless_asked(tmp_path) -> None:
    _publish(tmp_path, rl_steps(4))
    app, sub = await _app(tmp_path, admin_open_loopback=True)
    assert sub.current.step == 3
    # HEAD is moved back to step 1 (by an operator, or by anyone who can write to the store).
    manifest = json.loads((tmp_path / store_keys.manifest_key("step-0000000001")).read_text())
    (tmp_path / store_keys.HEAD_KEY).write_text(json.dumps({"snapshot_id": manifest["snapshot_id"], "step": 1}))
    async with _client(app) as local:
        refused = await local.post("/delta_swap/resync")
        assert refused.status_code == 502 and refused.json()["current_step"] == 3
        assert "back to 1" in refused.json()["last_error"]
        moved = await local.post("/delta_swap/resync?allow_older=1")
        assert moved.status_code == 200
        status = (await local.get("/delta_swap/status")).json()
    assert status["current_step"] == 1
    assert status["last_resync"]["allow_older"] is True and status["last_resync"]["from_step"] == 3
    await service.stop(app)


async def test_status_survives_an_engine_that_cannot_answer(tmp_path) -> None:
    _publish(tmp_path / "store", rl_steps(1))
    app, sub = await _app(tmp_path / "store")

    async def broken() -> str:
        raise RuntimeError(f"engine socket {tmp_path}/run/engine.sock is gone")

    sub.adapter.weight_version = broken
    async with _client(app) as local:
        r = await local.get("/delta_swap/status")
    assert r.status_code == 200
    body = r.json()
    assert "RuntimeError" in body["engine_error"] and "run/engine.sock" not in json.dumps(body)
    await service.stop(app)


async def test_publisher_notifications_carry_the_token(tmp_path, monkeypatch) -> None:
    _publish(tmp_path, rl_steps(1))
    app, sub = await _app(tmp_path, admin_token="s3cret-token")
    transport = httpx.ASGITransport(app=app, client=REMOTE)
    sent = []
    real_client = httpx.AsyncClient

    class Recording(real_client):  # the publisher's notify, routed into the app above
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "transport": transport})

        async def post(self, url, **kwargs):
            response = await super().post(url, **kwargs)
            sent.append(response.status_code)
            return response

    monkeypatch.setattr(httpx, "AsyncClient", Recording)
    from delta_swap.publisher import notify

    await notify(("http://server/delta_swap/notify",), sub.current, token="s3cret-token")
    await notify(("http://server/delta_swap/notify",), sub.current, token=None)
    assert sent == [202, 401]
    await service.stop(app)


async def test_notifies_are_coalesced_into_one_poll_per_interval(tmp_path, monkeypatch) -> None:
    """A caller with the token who notifies in a tight loop makes the server poll the store at
    most once per notify_interval, and the newest snapshot still lands at the next poll."""
    from delta_swap.stores import FileStore

    polls: list[float] = []
    real = FileStore.get_if_changed

    async def counted(self, key, etag, **kwargs):
        if key == store_keys.HEAD_KEY:
            polls.append(time.monotonic())
        return await real(self, key, etag, **kwargs)

    monkeypatch.setattr(FileStore, "get_if_changed", counted)
    steps = rl_steps(2)
    _publish(tmp_path, steps[:1])
    app, sub = await _app(tmp_path, admin_token="s3cret-token", notify_interval=0.5)
    auth = {"Authorization": "Bearer s3cret-token"}
    async with _client(app) as local:
        await asyncio.sleep(0.2)
        _publish(tmp_path, steps[1:], start=1)
        polls.clear()
        start = time.monotonic()
        accepted = 0
        while time.monotonic() - start < 1.5:
            accepted += (await local.post("/delta_swap/notify", headers=auth)).status_code == 202
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.6)
        elapsed = time.monotonic() - start
    assert accepted > 100
    assert 2 <= len(polls) <= elapsed / 0.5 + 1, (len(polls), elapsed)
    assert all(b - a >= 0.45 for a, b in zip(polls, polls[1:])), polls
    assert sub.current.step == 1
    await service.stop(app)


@pytest.mark.parametrize("value", ["", "not-a-number"])
def test_bad_settings_fail_fast(value) -> None:
    from delta_swap.errors import ConfigError

    with pytest.raises(ConfigError):
        Settings.load(None, {"DELTA_SWAP_MAX_STEP_JUMP": value or "1.5"})


_LOGS = """
import logging, sys
from delta_swap import service
from delta_swap.subscriber import log
if sys.argv[1] == "root":
    logging.basicConfig(level=logging.WARNING, format="root %(message)s")
if sys.argv[1] == "set":
    logging.getLogger("delta_swap").setLevel(logging.ERROR)
service.show_info_logs()
service.show_info_logs()  # once is enough: no second handler
log.info("delta-swap: now serving step-1")
"""


@pytest.mark.parametrize(("setup", "expected"), [("none", 1), ("root", 1), ("set", 0)])
def test_update_lines_reach_the_server_output_once(setup: str, expected: int) -> None:
    """vLLM leaves the root logger unconfigured, SGLang configures it: either way each applied
    update's INFO line is printed once; a level the operator set on ``delta_swap`` wins."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _LOGS, setup], capture_output=True, text=True, timeout=120, check=True)
    assert out.stderr.count("now serving step-1") == expected, out.stderr
