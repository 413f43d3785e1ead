"""Several HTTP front ends of one deployment (vLLM's ``--api-server-count`` > 1): the first runs
the subscriber, the others answer for it over its Unix socket and serve the version it serves.

Both front ends are real FastAPI apps with delta-swap's routes, driven through httpx's ASGI
transport in one event loop; the engine is delta-swap's RecordingAdapter. The live vLLM case (two
API servers in front of two data-parallel engines) is in test_vllm_exactness."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from delta_swap import service
from delta_swap.errors import ConfigError
from delta_swap.front_ends import FrontEnd, private_directory
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.settings import Settings
from delta_swap.testing import RecordingAdapter
from tests.support.chains import rl_steps

TOKEN = {"Authorization": "Bearer s3cret-token"}


def _publish(root: Path, steps: list, start: int = 0) -> None:
    with Publisher(str(root), PublisherConfig(base_every=100)) as pub:
        for i, s in enumerate(steps):
            pub.publish(start + i, s)


def _front_ends(tmp_path: Path, store: Path, poll: float = 3600) -> tuple[FastAPI, FastAPI, RecordingAdapter]:
    # A short socket path: Unix socket paths are limited to ~100 bytes.
    address = Path(f"/tmp/ds-fe-{os.getpid()}-{time.monotonic_ns()}") / "leader.sock"
    settings = Settings(store=str(store), poll_interval=poll, notify_interval=0, admin_token="s3cret-token")
    apps = [FastAPI(), FastAPI()]
    for app in apps:
        service.mount(app, "set DELTA_SWAP_STORE")
    adapter = RecordingAdapter()
    service.start(apps[0].state, settings, adapter, FrontEnd(0, 2, address))
    service.start(apps[1].state, settings, None, FrontEnd(1, 2, address))
    return apps[0], apps[1], adapter


def _client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server")


async def _until(pred: Callable[[], object], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_followers_report_the_leaders_version_and_pass_notifies_and_resyncs_on(tmp_path) -> None:
    store = tmp_path / "store"
    steps = rl_steps(3)
    _publish(store, steps[:1])
    leader, follower, adapter = _front_ends(tmp_path, store)
    try:
        await _until(lambda: service.served_version(follower.state) is not None)
        first = service.served_version(leader.state)
        assert first is not None and service.served_version(follower.state) == first
        async with _client(leader) as lead, _client(follower) as follow:
            a, b = (await lead.get("/delta_swap/status")).json(), (await follow.get("/delta_swap/status")).json()
            assert (a["api_server"], b["api_server"], a["api_servers"]) == (0, 1, 2)
            assert a["current_snapshot_id"] == b["current_snapshot_id"] == first
            assert b["current_step"] == 0 and b["engine"] == a["engine"]

            # A notify that reaches a follower makes the leader poll now (its interval is an hour).
            _publish(store, steps[1:2], start=1)
            assert (await follow.post("/delta_swap/notify")).status_code == 401  # the token is checked first
            assert (await follow.post("/delta_swap/notify", headers=TOKEN)).status_code == 202
            await _until(lambda: service.served_version(leader.state) != first)
            await _until(lambda: service.served_version(follower.state) == service.served_version(leader.state))
            assert (await follow.get("/delta_swap/status")).json()["current_step"] == 1

            # A resync through a follower runs on the leader, and the answer is the leader's.
            before = len(adapter.updates)
            r = await follow.post("/delta_swap/resync", headers=TOKEN)
            assert r.status_code == 200 and r.json()["resynced"], r.text
            assert r.json()["last_resync"]["ok"] and r.json()["api_server"] == 1
            assert len(adapter.updates) > before  # the one engine adapter, the leader's, did the work
    finally:
        await service.stop(follower)
        await service.stop(leader)


async def test_a_follower_without_its_leader_says_so_and_serves_no_version(tmp_path) -> None:
    address = Path(f"/tmp/ds-fe-{os.getpid()}-{time.monotonic_ns()}") / "leader.sock"
    app = FastAPI()
    service.mount(app, "set DELTA_SWAP_STORE")
    service.start(app.state, Settings(store=str(tmp_path), admin_token="t"), None, FrontEnd(1, 2, address))
    try:
        async with _client(app) as client:
            st = (await client.get("/delta_swap/status")).json()
        assert "does not answer" in st["leader_error"] and st["api_server"] == 1
        assert service.served_version(app.state) is None
    finally:
        await service.stop(app)


def test_the_socket_directory_must_be_private(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="closed to others"):
        private_directory(shared)
    assert private_directory(tmp_path / "mine").stat().st_mode & 0o777 == 0o700
