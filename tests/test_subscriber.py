"""The engine-agnostic subscriber: planning, staging, error handling and status.

The engine here is delta-swap's RecordingAdapter, which keeps what it was handed; the real vLLM
and SGLang servers are exercised in the engine tests. This module checks the subscriber's own
logic: which path it takes, what it hands over, and that bad snapshots never reach the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest

from delta_swap import rebuild, store_keys
from delta_swap.errors import SwapUndoneError
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.safetensors_io import read_safetensors
from delta_swap.settings import Settings
from delta_swap.stores import Store
from delta_swap.subscriber import Subscriber
from delta_swap.testing import RecordingAdapter
from tests.support.chains import assert_state_equal, rl_steps


def _publish(root, steps, start=0, **cfg):
    with Publisher(str(root), PublisherConfig(**cfg)) as pub:
        for i, s in enumerate(steps):
            pub.publish(start + i, s)


async def test_follows_deltas_and_hands_over_only_changed_tensors(tmp_path) -> None:
    steps = rl_steps(6)
    steps[3] = dict(steps[2])  # a step where nothing changed
    _publish(tmp_path, steps[:2], base_every=100)
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=str(tmp_path)), engine)
    assert sub.status()["current_since"] is None
    assert await sub.sync() and sub.current.step == 1
    first_since = sub.status()["current_since"]
    assert len(engine.updates[0].names) == len(steps[0])  # first sync: everything
    _publish(tmp_path, steps[2:4], start=2, base_every=100)
    published = time.time()
    assert await sub.sync() and sub.current.step == 3
    assert first_since < published <= sub.status()["current_since"] <= time.time()  # when step 3 began serving
    assert engine.updates[1].names  # deltas replayed from step 1
    assert engine.version == "step-0000000003" and engine.calls[-3:] == ["pause:keep", "swap:step-0000000003", "resume"]
    assert not await sub.sync()  # nothing new
    status = sub.status()
    assert status["current_snapshot_id"] == "step-0000000003" and status["staleness_steps"] == 0
    assert set(status["last_update_timings_s"]) >= {"fetch", "decode", "verify", "stage", "pause", "swap", "resume"}
    assert (await sub.describe())["weight_version"] == "step-0000000003"
    await sub.stop()
    assert_state_equal(engine.weights, steps[3])


async def test_served_since_the_resume_not_after_the_staged_update_is_dropped(tmp_path) -> None:
    """The engine serves the new weights once it resumes; dropping what was staged (vLLM's shadow
    path: an RPC whose workers free the old modules) comes after, while it generates. So
    ``current_since`` is the resume, and the drop shows as its own phase, ``unstage``."""

    class SlowToUnstage(RecordingAdapter):
        resumed_at: float | None = None

        async def resume(self) -> None:
            await super().resume()
            self.resumed_at = time.time()

        async def unstage(self, staged: object) -> None:
            await asyncio.sleep(0.5)

    _publish(tmp_path, rl_steps(1))
    engine = SlowToUnstage()
    sub = Subscriber(Settings(store=str(tmp_path)), engine)
    assert await sub.sync()
    status = sub.status()
    assert engine.resumed_at is not None
    assert engine.resumed_at - 0.05 <= status["current_since"] <= engine.resumed_at + 0.2, (status, engine.resumed_at)
    assert status["last_update_timings_s"]["unstage"] >= 0.5
    await sub.stop()


async def test_status_shows_the_phase_of_an_update_under_way_and_for_how_long(tmp_path) -> None:
    """An operator watching a slow update sees which phase it is in and since when."""
    _publish(tmp_path, rl_steps(1), base_every=100)
    entered, release = asyncio.Event(), asyncio.Event()

    class SlowToStage(RecordingAdapter):
        async def stage(self, update):
            entered.set()
            await release.wait()
            return await super().stage(update)

    sub = Subscriber(Settings(store=str(tmp_path)), SlowToStage())
    idle = sub.status()
    assert idle["update_phase"] is None and idle["update_seconds"] is None and idle["update_phase_seconds"] is None
    task = asyncio.create_task(sub.sync())
    await asyncio.wait_for(entered.wait(), 60)
    await asyncio.sleep(0.2)
    busy = sub.status()
    assert busy["update_phase"] == "stage"
    assert 0.2 <= busy["update_phase_seconds"] <= busy["update_seconds"], busy
    release.set()
    assert await task
    done = sub.status()
    assert done["current_step"] == 0 and done["update_phase"] is None and done["update_seconds"] is None
    await sub.stop()


async def test_corrupt_delta_never_reaches_the_engine_and_status_says_why(tmp_path) -> None:
    steps = rl_steps(4)
    _publish(tmp_path, steps[:2], base_every=100)
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=str(tmp_path)), engine)
    await sub.sync()
    _publish(tmp_path, steps[2:3], start=2, base_every=100)
    shard = next((tmp_path / "snapshots" / "step-0000000002").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 1
    shard.write_bytes(bytes(data))
    assert not await sub.sync()
    status = sub.status()
    assert status["current_step"] == 1 and status["newest_step"] == 2 and status["staleness_steps"] == 1
    assert "ChecksumMismatchError" in status["last_error"] and status["failures"] == 1
    assert len(engine.updates) == 1
    # The engine failing half way through a swap is rolled back: it holds step 1 again.
    data[-5] ^= 1
    shard.write_bytes(bytes(data))
    engine.fail_next_swap = True
    assert not await sub.sync()
    assert sub.current.step == 1 and "engine refused" in sub.status()["last_error"]
    assert engine.version == "step-0000000001" and engine.calls[-2:] == ["swap:step-0000000001", "resume"]
    assert_state_equal(engine.weights, steps[1])
    refused = sub.status()["last_failure"]
    assert await sub.sync() and sub.current.step == 2 and sub.status()["last_error"] is None
    # once an update succeeds, the latest failure's reason is still there for whoever asks later
    assert sub.status()["last_failure"] == refused and "engine refused" in refused["error"], refused
    assert refused["kind"] and refused["at"] <= time.time()
    await sub.stop()
    assert_state_equal(engine.weights, steps[2])


async def test_broken_chain_falls_back_to_the_newest_reachable_snapshot(tmp_path) -> None:
    steps = rl_steps(8)
    _publish(tmp_path, steps[:2], base_every=4)
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=str(tmp_path)), engine)
    await sub.sync()
    _publish(tmp_path, steps[2:7], start=2, base_every=4)  # base at 4, deltas 5, 6
    (tmp_path / store_keys.manifest_key("step-0000000005")).unlink()  # 6 is unreachable
    assert await sub.sync()
    assert sub.current.step == 4  # the newest base still reachable
    await sub.stop()
    assert_state_equal(engine.weights, steps[4])


async def test_resync_reloads_from_the_base_and_out_of_order_deltas_are_refused(tmp_path) -> None:
    steps = rl_steps(5)
    _publish(tmp_path, steps[:3], base_every=100)
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=str(tmp_path)), engine)
    await sub.sync()
    assert await sub.resync() and sub.current.step == 2
    assert len(engine.updates) == 2 and engine.updates[1].names == ()  # same bytes: nothing to push
    _publish(tmp_path, steps[3:4], start=3, base_every=100)
    manifest = tmp_path / store_keys.manifest_key("step-0000000003")
    doc = json.loads(manifest.read_text())
    doc["prev_snapshot_id"] = "step-0000000001"  # claims to follow an older snapshot
    manifest.write_text(json.dumps(doc))
    assert not await sub.sync()
    # refused: by the checksums (codec v1), or already by the decoder, since codec v2's classes
    # depend on the old tensor and a delta applied to another state does not add up
    assert sub.current.step == 2 and sub.status()["last_error"].startswith(
        ("ChecksumMismatchError", "CorruptDataError")
    )
    await sub.stop()
    assert_state_equal(engine.weights, steps[2])


@pytest.mark.parametrize("ratio, expect_base", [(1.0, False), (0.0, True)])
async def test_replay_cost_decides_between_deltas_and_base(tmp_path, ratio, expect_base) -> None:
    steps = rl_steps(4)
    _publish(tmp_path, steps[:1], base_every=100)
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=str(tmp_path), replay_cost_ratio=ratio), engine)
    await sub.sync()
    _publish(tmp_path, steps[1:], start=1, base_every=100)
    assert await sub.sync() and sub.current.step == 3
    path = sub.status()["last_update_path"]
    assert path == (["step-0000000000"] if expect_base else []) + [f"step-000000000{i}" for i in (1, 2, 3)]
    await sub.stop()
    assert_state_equal(engine.weights, steps[3])


async def test_a_snapshot_that_does_not_fit_is_refused_before_it_is_fetched(tmp_path) -> None:
    from delta_swap.served_model import ServedModel

    steps = rl_steps(2)
    _publish(tmp_path, steps[:1], base_every=100)
    engine = RecordingAdapter()
    engine.served = ServedModel(None, {"embed.weight": ("BF16", (64, 32))})  # serves one tensor only
    sub = Subscriber(Settings(store=str(tmp_path)), engine)
    for shard in (tmp_path / "snapshots" / "step-0000000000").glob("shard-*"):
        shard.unlink()  # a fetch would fail with NotFoundError instead
    assert not await sub.sync()
    assert (
        "IncompatibleSnapshotError" in sub.status()["last_error"]
        and "not in the served model" in sub.status()["last_error"]
    )
    assert engine.calls == []
    await sub.stop()


async def test_a_push_notification_wakes_the_poller_at_once(tmp_path) -> None:
    steps = rl_steps(2)
    _publish(tmp_path, steps[:1], base_every=100)
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=str(tmp_path), poll_interval=3600), engine)
    sub.start()
    for _ in range(100):
        if sub.current is not None:
            break
        await asyncio.sleep(0.05)
    _publish(tmp_path, steps[1:], start=1, base_every=100)
    await asyncio.sleep(0.3)
    assert sub.current.step == 0  # the next poll is an hour away
    sub.wake()
    for _ in range(100):
        if sub.current.step == 1:
            break
        await asyncio.sleep(0.05)
    assert sub.current.step == 1
    await sub.stop()


async def _serving_step_1_with_step_2_published(tmp_path) -> tuple[list, RecordingAdapter, Subscriber]:
    """Three RL steps; a subscriber that serves step 1, and step 2 published (a delta)."""
    steps = rl_steps(3)
    _publish(tmp_path, steps[:2], base_every=100)
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=str(tmp_path)), engine)
    await sub.sync()
    _publish(tmp_path, steps[2:], start=2, base_every=100)
    return steps, engine, sub


async def test_a_failed_rollback_makes_the_next_sync_reload_everything(tmp_path) -> None:
    steps, engine, sub = await _serving_step_1_with_step_2_published(tmp_path)
    swap = engine.swap
    calls = []

    async def fail_twice(update, staged):  # the swap fails half way, and so does the rollback
        calls.append(update.version)
        if len(calls) <= 2:
            engine.weights[update.names[0]] = update.state[update.names[0]]
            raise RuntimeError("engine died mid-load")
        await swap(update, staged)

    engine.swap = fail_twice
    assert not await sub.sync()
    st = sub.status()
    assert "EngineStateUnknownError" in st["last_error"] and st["current_step"] is None
    assert await sub.sync() and sub.current.step == 2
    assert set(engine.updates[-1].names) == set(steps[2])  # every tensor, from the base
    assert sub.status()["last_update_path"][0] == "step-0000000000"
    await sub.stop()
    assert_state_equal(engine.weights, steps[2])


async def test_a_swap_the_engine_took_back_itself_is_not_rolled_back_again(tmp_path) -> None:
    """An adapter that raises SwapUndoneError has put the previous weights back on every rank
    (an undo log, the old modules): the core runs no rollback (no second stage and swap in the
    pause), keeps the last good version, says why, and the next sync swaps the step in."""
    steps, engine, sub = await _serving_step_1_with_step_2_published(tmp_path)
    swap, stages = engine.swap, []
    stage = engine.stage

    async def counting_stage(update):
        stages.append(update.version)
        return await stage(update)

    async def undone_once(update, staged):
        engine.calls.append(f"swap:{update.version}")
        engine.swap = swap
        raise SwapUndoneError("recording: the switch failed and was taken back on every rank: rank 1 refused")

    engine.stage, engine.swap = counting_stage, undone_once
    assert not await sub.sync()
    st = sub.status()
    assert "SwapUndoneError" in st["last_error"] and "rank 1 refused" in st["last_error"], st
    assert st["current_step"] == 1 and engine.version == sub.current.snapshot_id
    assert stages == ["step-0000000002"], stages  # the update's stage, and no rollback's
    assert engine.calls[-2:] == ["swap:step-0000000002", "resume"], engine.calls
    assert_state_equal(engine.weights, steps[1])
    assert await sub.sync() and sub.current.step == 2
    assert_state_equal(engine.weights, steps[2])
    await sub.stop()


async def test_an_engine_with_weight_arenas_gets_updates_decoded_into_its_spare_copy(tmp_path) -> None:
    """An adapter offering a destination (its spare arena) gets every update decoded there, the
    swap only flips arenas, and the subscriber keeps no copy of its own; rollbacks flip back."""
    steps = rl_steps(6)
    store = tmp_path / "store"
    _publish(store, steps[:2], base_every=100)
    engine = RecordingAdapter(arena_dir=str(tmp_path))
    sub = Subscriber(Settings(store=str(store)), engine)
    assert await sub.sync() and sub.current.step == 1
    first = engine.arenas.live
    assert first is not None and all(first.holds(t.data) for t in sub._state.values())
    _publish(store, steps[2:5], start=2, base_every=100)
    assert await sub.sync() and sub.current.step == 4  # three deltas, decoded into the spare arena
    second = engine.arenas.live
    assert second is not first and all(second.holds(t.data) for t in sub._state.values())
    assert_state_equal(engine.weights, steps[4])
    _publish(store, steps[5:], start=5, base_every=100)
    engine.fail_next_swap = True
    assert not await sub.sync()
    assert engine.arenas.live is second and sub.current.step == 4  # rolled back to the live arena
    assert_state_equal(engine.weights, steps[4])
    assert await sub.sync() and engine.arenas.live is first
    assert_state_equal(engine.weights, steps[5])
    assert sorted(p.name for p in tmp_path.glob("delta-swap-arena-*"))
    await sub.stop()
    assert not list(tmp_path.glob("delta-swap-arena-*"))


def _dead_pid() -> int:
    """The pid of a process that has exited (a child run to its end)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_files_left_by_killed_servers_are_removed_and_live_ones_kept(tmp_path) -> None:
    """Arena and layout files carry their owner's pid; those of processes that are gone (a
    SIGKILLed server) are deleted, those of running processes and foreign names are kept."""
    import os

    from delta_swap.arena import remove_stale_arenas

    dead = _dead_pid()
    names = {
        f"delta-swap-arena-{dead}-a": False,
        f"delta-swap-layout-{dead}.json": False,
        f"delta-swap-layout-{dead}-0a1b2c3d.json": False,
        f"delta-swap-arena-{os.getpid()}-b": True,
        f"delta-swap-layout-{os.getpid()}.json": True,
        "delta-swap-layout-notapid.json": True,
        f"delta-swap-layout-{10**20}.json": True,  # no pid the system could have: kept, not an OverflowError
        "other-file": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_arenas(tmp_path)
    assert sorted(p.name for p in removed) == sorted(n for n, keep in names.items() if not keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, keep in names.items() if keep)


def test_a_killed_servers_update_files_and_doorbells_are_removed_once_stale(tmp_path) -> None:
    """What an update leaves in /dev/shm while it runs (its tensors, vLLM's undo record, doorbell
    folders) outlives a killed server: the next server's copy removes it once the owner's pid is
    not running and it is an hour old (nothing holds these files: the age stands in for the lock
    of a server in another PID namespace). A live owner's, a young one's and others' stay."""
    import os

    from delta_swap.host_copy import HostCopy
    from delta_swap.staging_files import STALE_TRANSIENT_S

    dead = _dead_pid()
    old = time.time() - STALE_TRANSIENT_S - 60
    stale = [
        f"delta-swap-update-step-0000000003-{dead}-0a1b2c3d.safetensors",
        f"delta-swap-check-{dead}-0a1b2c3d.safetensors",
        f"delta-swap-undo-{dead}-0a1b2c3d.json",
        f"delta-swap-staged-{dead}-0a1b2c3d.done",
        f"delta-swap-staged-{dead}-0a1b2c3d.done.1a2b3c4d.gone",
    ]
    kept = [
        f"delta-swap-update-step-0000000003-{os.getpid()}-0a1b2c3d.safetensors",  # its owner runs
        f"delta-swap-check-{dead}-1a1b2c3d.safetensors",  # young: see below
        f"delta-swap-config-{dead}-0a1b2c3d.json",  # not an update's
        "other-file",
    ]
    for name in stale + kept:
        path = tmp_path / name
        if ".done" in name:
            path.mkdir()
            (path / str(dead)).touch()
        else:
            path.write_bytes(b"x")
        if name != kept[1]:
            os.utime(path, (old, old))
    copy = HostCopy.create(str(tmp_path), {"w": ("BF16", (4, 4))})
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, Path(copy.path).name])
    finally:
        copy.close()


_MAKE_WEIGHT_FILES = """
import os, sys
from delta_swap.arena import ArenaPair, ArenaLayout
from delta_swap.host_copy import HostCopy
folder = sys.argv[1]
copy = HostCopy.create(folder, {"w": ("BF16", (64, 64))})
layout = ArenaLayout.build([("s", "BF16", (64, 64))], {"w": ("s", 0, "BF16", (64, 64))})
pair = ArenaPair(folder, layout)
print(os.getpid(), flush=True)
if sys.argv[2] == "killed":
    os.kill(os.getpid(), 9)
"""


def test_a_server_process_deletes_its_weight_files_at_exit_and_the_next_one_a_killed_ones(tmp_path) -> None:
    """A weight copy or arena in /dev/shm is memory until deleted. vLLM's API server stops
    without telling its plugins, so a process deletes its own at a normal exit; a killed one's
    are deleted when the next server makes its copy (an arena-path server did that before; a
    shadow-path server, holding only a copy, did not)."""
    import subprocess
    import sys

    from delta_swap.host_copy import HostCopy

    def run(how: str, folder) -> int:
        folder.mkdir()
        done = subprocess.run(
            [sys.executable, "-c", _MAKE_WEIGHT_FILES, str(folder), how], capture_output=True, text=True
        )
        assert (done.returncode == 0) == (how == "exits"), done.stderr[-2000:]
        return int(done.stdout.split()[0])

    run("exits", tmp_path / "exited")
    assert not list((tmp_path / "exited").iterdir())
    killed = run("killed", tmp_path / "killed")
    left = sorted(p.name for p in (tmp_path / "killed").iterdir())
    assert len(left) == 2 and all(f"-{killed}-" in name for name in left)  # the weight copy and arena a
    copy = HostCopy.create(str(tmp_path / "killed"), {"w": ("BF16", (4, 4))})
    assert [p.name for p in (tmp_path / "killed").iterdir()] == [Path(copy.path).name]
    copy.close()


def test_a_held_file_is_kept_whatever_pid_its_name_carries(tmp_path) -> None:
    """A server in another PID namespace sharing /dev/shm (containers with ``--ipc=host``) names
    its files with pids this one cannot see: the lock its owner holds keeps them."""
    import os

    from delta_swap.arena import remove_stale_arenas
    from delta_swap.staging_files import hold

    other = tmp_path / f"delta-swap-weights-{_dead_pid()}-0a1b2c3d.safetensors"
    other.write_bytes(b"x")
    fd = hold(other)  # as its owner in the other namespace does
    assert remove_stale_arenas(tmp_path) == [] and other.exists()
    os.close(fd)  # the owner went away
    assert remove_stale_arenas(tmp_path) == [other] and not other.exists()


_FORK_AND_EXIT = """
import os, sys
from delta_swap.host_copy import HostCopy
copy = HostCopy.create(sys.argv[1], {"w": ("BF16", (4, 4))})
child = os.fork()
if child == 0:
    sys.exit(0)  # a forked child's normal exit runs the atexit hooks it inherited
os.waitpid(child, 0)
print(os.path.exists(copy.path), flush=True)
"""


def test_a_forked_child_exiting_leaves_its_parents_files(tmp_path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FORK_AND_EXIT, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]  # the child left it
    assert not list(tmp_path.iterdir())  # the parent removed it at its own exit


class _RangeLog:
    """A store that records every read (key, start, end) and otherwise is the store it wraps."""

    read_pieces = Store.read_pieces  # pieces through the recording get

    def __init__(self, store) -> None:
        self._store, self.reads = store, []

    def __getattr__(self, name):
        return getattr(self._store, name)

    async def get(self, key, start=None, end=None, *, max_bytes=None):
        data = await self._store.get(key, start, end, max_bytes=max_bytes)
        self.reads.append((key, start, end, len(data)))
        return data


async def test_a_large_base_streams_into_the_arena_piece_by_piece(tmp_path, monkeypatch) -> None:
    """With arenas, shards larger than a piece are read in contiguous pieces and written straight
    into the arena (no read larger than a piece), bit-exact; the second arena is only made once
    the engine computes from the first."""
    from delta_swap.stores import open_store

    monkeypatch.setattr(rebuild, "STREAM_PIECE_BYTES", 1000)
    steps = rl_steps(3, lr=2e-3)
    store = tmp_path / "store"
    _publish(store, steps[:1], base_every=100)
    logged = _RangeLog(open_store(str(store)))
    engine = RecordingAdapter(arena_dir=str(tmp_path))
    sub = Subscriber(Settings(store=str(store)), engine, store=logged)
    assert await sub.sync() and sub.current.step == 0
    assert_state_equal(engine.weights, steps[0])
    shard = sub.current.shards[0]
    base_reads = [r for r in logged.reads if r[0].endswith(shard.name)]
    assert shard.size > 5 * 1000 and len(base_reads) == -(-shard.size // 1000)
    assert all(n <= 1000 for *_, n in base_reads) and sum(n for *_, n in base_reads) == shard.size
    assert [p.name[-1] for p in tmp_path.glob("delta-swap-arena-*")] == ["a"]  # the spare one comes later
    _publish(store, steps[1:], start=1, base_every=100)
    assert await sub.sync() and sub.current.step == 2
    assert_state_equal(engine.weights, steps[2])
    assert sorted(p.name[-1] for p in tmp_path.glob("delta-swap-arena-*")) == ["a", "b"]
    await sub.stop()


@pytest.mark.parametrize("where", ["header", "middle", "end"])
async def test_a_tampered_base_is_rejected_when_streamed(tmp_path, monkeypatch, where) -> None:
    from delta_swap import rebuild

    monkeypatch.setattr(rebuild, "STREAM_PIECE_BYTES", 1000)
    steps = rl_steps(1)
    store = tmp_path / "store"
    _publish(store, steps, base_every=100)
    shard = next((store / "snapshots" / "step-0000000000").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[{"header": 3, "middle": len(data) // 2, "end": len(data) - 1}[where]] ^= 0x10
    shard.write_bytes(bytes(data))
    engine = RecordingAdapter(arena_dir=str(tmp_path))
    sub = Subscriber(Settings(store=str(store)), engine)
    assert not await sub.sync()
    st = sub.status()
    assert st["current_step"] is None and not engine.weights and engine.calls == []
    assert "mismatch" in st["last_error"] or "Corrupt" in st["last_error"], st["last_error"]
    await sub.stop()


class CopyingAdapter(RecordingAdapter):
    """An engine that copies what an update hands it, as vLLM's workers and SGLang's schedulers do:
    the subscriber decodes into one copy of the weights in the staging folder."""

    copies_updates = True


def _weights_files(folder) -> list:
    return sorted(folder.glob("delta-swap-weights-*"))


async def _copying_server(tmp_path, steps, served: int) -> tuple:
    """(store, staging folder, engine, subscriber) of an engine that copies updates, serving step
    ``served - 1`` of ``steps``."""
    store, staging = tmp_path / "store", tmp_path / "staging"
    staging.mkdir()
    _publish(store, steps[:served], base_every=100)
    engine = CopyingAdapter()
    sub = Subscriber(Settings(store=str(store), staging_dir=str(staging)), engine)
    assert await sub.sync() and sub.current.step == served - 1
    return store, staging, engine, sub


async def test_an_engine_that_copies_updates_gets_them_decoded_in_place_into_one_file(tmp_path) -> None:
    """One file holds the served weights; each delta is decoded over them (no previous copy kept
    beside the new one), the engine is handed that file, and it goes when the server stops."""
    steps = rl_steps(4)
    store, staging, engine, sub = await _copying_server(tmp_path, steps, 2)
    [copy] = _weights_files(staging)
    first = engine.updates[0]
    assert first.state_file == str(copy) and first.previous is None
    _publish(store, steps[2:4], start=2, base_every=100)
    assert await sub.sync() and sub.current.step == 3
    second = engine.updates[1]
    assert second.state_file == str(copy) and second.previous is None and _weights_files(staging) == [copy]
    changed = second.names[0]
    assert np.shares_memory(first.state[changed].data, second.state[changed].data)  # decoded in place
    on_disk = read_safetensors(copy.read_bytes())  # what the engine's processes read
    assert_state_equal(on_disk, steps[3])
    assert_state_equal(engine.weights, steps[3])
    await sub.stop()
    assert _weights_files(staging) == []


async def test_a_failed_swap_after_an_in_place_decode_rolls_back_from_the_store(tmp_path) -> None:
    """The copy holds the failed update's weights: the rollback rebuilds the served step from the
    store and the engine serves it again. The retry fetches nothing (the copy holds the update,
    verified); a newer step after another failure is fetched from the update the copy holds, and
    the engine gets every tensor changed since the step it serves."""
    steps = rl_steps(5)
    store, _staging, engine, sub = await _copying_server(tmp_path, steps, 2)
    _publish(store, steps[2:3], start=2, base_every=100)
    engine.fail_next_swap = True
    assert not await sub.sync()
    st = sub.status()
    assert st["current_step"] == 1 and "engine refused" in st["last_error"], st
    assert engine.version == "step-0000000001" and engine.calls[-2:] == ["swap:step-0000000001", "resume"]
    assert_state_equal(engine.weights, steps[1])
    shards = {shard: shard.read_bytes() for shard in (store / "snapshots").glob("*/shard-*")}
    for shard in shards:  # the retry needs no byte of the store
        shard.unlink()
    assert await sub.sync() and sub.current.step == 2, sub.status()
    assert sub.status()["last_update_path"] == []
    for shard, data in shards.items():
        shard.write_bytes(data)
    assert_state_equal(engine.weights, steps[2])

    _publish(store, steps[3:4], start=3, base_every=100)  # a delta on step 2 (the publisher keeps its head)
    engine.fail_next_swap = True
    assert not await sub.sync() and sub.current.step == 2
    _publish(store, steps[4:5], start=4, base_every=100)
    assert await sub.sync() and sub.current.step == 4
    assert sub.status()["last_update_path"] == ["step-0000000004"]
    assert_state_equal(engine.weights, steps[4])
    await sub.stop()


@pytest.mark.parametrize("fault", ["missing", "corrupt", "corrupt-streamed"])
async def test_a_delta_that_fails_before_decoding_keeps_the_copy_and_the_next_update_a_delta(
    tmp_path, monkeypatch, fault
) -> None:
    """A missing delta shard, or one that fails its digest (whole, or streamed in pieces: a delta
    shard's pieces are held back until the whole shard is verified), leaves the copy holding the
    served weights: once the store is mended, the next update fetches the delta alone, not the base."""
    if fault == "corrupt-streamed":
        monkeypatch.setattr(rebuild, "STREAM_PIECE_BYTES", 1000)
    steps = rl_steps(3)
    store, _staging, _engine, sub = await _copying_server(tmp_path, steps, 2)
    _publish(store, steps[2:], start=2, base_every=100)
    [shard] = (store / "snapshots" / "step-0000000002").glob("shard-*")
    kept = shard.read_bytes()
    if fault == "missing":
        shard.unlink()
    else:
        shard.write_bytes(kept[:-1] + bytes([kept[-1] ^ 1]))
    error = "NotFoundError" if fault == "missing" else "ChecksumMismatchError"
    assert not await sub.sync() and error in sub.status()["last_error"], sub.status()
    shard.write_bytes(kept)
    assert await sub.sync() and sub.current.step == 2
    assert sub.status()["last_update_path"] == ["step-0000000002"]
    await sub.stop()


async def test_a_staging_folder_without_room_for_the_copy_decodes_into_memory(tmp_path, monkeypatch) -> None:
    """The copy's bytes are reserved up front: a full tmpfs refuses them (a write past its room
    would kill the server with SIGBUS), and the update goes on in this process's memory."""
    import errno
    import os

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    steps = rl_steps(2)
    _store, staging, engine, sub = await _copying_server(tmp_path, steps, 2)
    assert engine.updates[0].state_file is None and _weights_files(staging) == []
    assert_state_equal(engine.weights, steps[1])
    await sub.stop()


async def test_the_poller_backs_off_from_an_update_that_keeps_failing(tmp_path) -> None:
    """An update the engine refuses every time is not rebuilt at every poll (on the shadow path that
    is a build of every changed module, on the cores generation needs): the poller tries it again
    after poll_interval, then twice as long at each failure, and says when in its status; a direct
    sync() tries at once, and a success ends the backoff."""
    steps = rl_steps(3)
    _publish(tmp_path, steps[:1], base_every=100)
    tries: list[float] = []

    class Refuses(RecordingAdapter):
        refuse = True

        async def stage(self, update):
            if update.version == "step-0000000001":
                tries.append(asyncio.get_running_loop().time())
                if self.refuse:
                    raise SwapUndoneError("the engine refused it, as it will every time")
            return await super().stage(update)

    engine = Refuses()
    sub = Subscriber(Settings(store=str(tmp_path), poll_interval=0.1), engine)
    assert await sub.sync() and sub.current.step == 0
    _publish(tmp_path, steps[1:2], start=1, base_every=100)
    sub.start()
    for _ in range(6000):  # until the fourth failure (the first try waits for the decoder's warm-up)
        if sub.status()["failures"] >= 4:
            break
        await asyncio.sleep(0.01)
    status = sub.status()
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) == status["failures"] == 4, (tries, status)
    assert all(gap >= 0.1 * 2**i for i, gap in enumerate(gaps)), gaps  # 0.1, 0.2, 0.4 s at least
    assert status["current_step"] == 0 and 0 < status["retry_in_s"] <= 0.8  # the fourth wait: 0.8 s
    await sub.stop()
    engine.refuse = False
    assert await sub.sync() and sub.current.step == 1  # a direct call does not wait
    assert sub.status()["retry_in_s"] is None


def test_the_backoff_grows_to_its_cap_and_never_overflows() -> None:
    """A snapshot refused for days (thousands of failures) waits max_s, and 2 ** n never overflows."""
    from delta_swap.retry import UpdateBackoff

    backoff = UpdateBackoff(first_s=2.0, max_s=60.0)
    waits = []
    for _ in range(2000):
        backoff.failed("step-1", now=0.0)
        waits.append(backoff.wait_s("step-1", now=0.0))
    assert waits[:6] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0] and waits[-1] == 60.0
    assert backoff.wait_s("step-2", now=0.0) == 0.0  # a newer snapshot does not wait
    backoff.failed("step-2", now=0.0)
    assert backoff.wait_s("step-2", now=0.0) == 2.0  # and starts from the first wait
    backoff.reset()
    assert backoff.wait_s("step-2", now=0.0) == 0.0
