"""The delta-swap command as a user runs it: publish, inspect, pull, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

CLI = [sys.executable, "-m", "delta_swap.cli"]


def _run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)
    assert (proc.returncode == 0) == ok, proc.stderr
    return proc


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from examples.tiny_model import make_tiny_model, perturb_weights

    root = tmp_path_factory.mktemp("ckpt")
    dirs = [make_tiny_model(root / "s0")]
    for i in range(1, 4):
        dirs.append(perturb_weights(dirs[-1], root / f"s{i}", seed=i))
    return dirs


def test_publish_inspect_pull_round_trip(tmp_path, checkpoints) -> None:
    store = f"file://{tmp_path}/store"
    for step, ckpt in enumerate(checkpoints):
        out = _run("publish", str(ckpt), "--store", store, "--step", str(step * 10), "--base-every", "30").stdout
        assert f"step {step * 10}" in out
    rows = json.loads(_run("inspect", "--store", store, "--json").stdout)
    assert [r["kind"] for r in rows] == ["base", "delta", "delta", "base"]
    assert [r["step"] for r in rows] == [0, 10, 20, 30]
    assert rows[0]["prev_snapshot_id"] is None and rows[1]["prev_snapshot_id"] == rows[0]["snapshot_id"]
    for r in rows:
        assert {"snapshot_id", "kind", "prev_snapshot_id", "step", "payload_bytes", "model_bytes"} <= set(r)
        assert r["payload_bytes"] < 0.2 * r["model_bytes"] or r["kind"] == "base"
    assert "delta" in _run("inspect", "--store", store).stdout

    for snap, ckpt in ((rows[2]["snapshot_id"], checkpoints[2]), (None, checkpoints[3])):
        out_dir = tmp_path / f"out-{snap}"
        _run("pull", "--store", store, "--out", str(out_dir), "--quiet", *(["--snapshot", snap] if snap else []))
        got, want = load_file(str(out_dir / "model.safetensors")), load_file(str(ckpt / "model.safetensors"))
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        for side in ("config.json", "tokenizer.json"):
            assert (out_dir / side).read_bytes() == (ckpt / side).read_bytes()


def test_bad_input_gives_one_line_errors(tmp_path, checkpoints) -> None:
    cases = [
        ("pull", "--store", str(tmp_path / "missing"), "--out", str(tmp_path / "o")),
        ("publish", str(tmp_path / "no-such-dir"), "--store", str(tmp_path / "s"), "--step", "1"),
        ("inspect", "--store", str(tmp_path / "missing")),
    ]
    for args in cases:
        proc = _run(*args, ok=False)
        errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    store = tmp_path / "store"
    _run("publish", str(checkpoints[0]), "--store", str(store), "--step", "0")
    _run("publish", str(checkpoints[1]), "--store", str(store), "--step", "1")
    shard = next((store / "snapshots" / "step-0000000001").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = _run("pull", "--store", str(store), "--out", str(tmp_path / "o"), "--quiet", ok=False)
    assert "checksum mismatch" in proc.stderr
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_publish_leaves_no_process_behind(tmp_path, checkpoints) -> None:
    """The command publishes one step and exits: it starts no codec warm-up (which compiles in a
    child process that could outlive it, orphaned; such a child is slowed down here, as a cold
    compile is, by a sitecustomize that only it runs): a delta loads the kernels as it encodes,
    and a base needs none. Nothing it started runs on after it."""
    import uuid

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import time\n"
        "try:\n    cmd = open('/proc/self/cmdline', 'rb').read()\nexcept OSError:\n    cmd = b''\n"
        "if b'codec.warm_up' in cmd:\n    time.sleep(4)\n"
    )
    marker = f"leftover-{uuid.uuid4().hex}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "DELTA_SWAP_TEST_MARKER": marker,
    }
    for step in (0, 1):
        proc = subprocess.run(
            [*CLI, "publish", str(checkpoints[step]), "--store", str(tmp_path / "store"), "--step", str(step)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        assert "waiting for the codec's compile" not in proc.stderr

    def left() -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    if marker.encode() in fh.read():
                        found.append(pid)
            except OSError:
                pass
        return found

    assert left() == []


_RUN_WITH_A_HOOK_AND_A_THREAD = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
atexit.register(print, "atexit hook ran")
threading.Thread(target=lambda: (time.sleep(1.0), print("thread done"))).start()
ThreadPoolExecutor(1).submit(lambda: None).result()  # an idle worker, never shut down
sys.argv = ["delta-swap", *sys.argv[1:]]
from delta_swap import cli
cli.run()
print("not reached")
"""


def test_the_command_exits_quickly_yet_as_a_normal_exit_does(tmp_path, checkpoints) -> None:
    """``delta-swap`` ends with ``os._exit`` once main returned (the interpreter's teardown costs
    a process per step ~0.3 s): a thread that is not a daemon still finishes, an idle executor
    worker does not hold the exit up, the atexit hooks still run, what they and main printed
    still reaches a pipe, and the exit code is main's."""
    cases = [
        (["publish", str(checkpoints[0]), "--store", str(tmp_path / "s"), "--step", "0", "--quiet"], 0),
        (["publish", str(tmp_path / "no-such-dir"), "--store", str(tmp_path / "s"), "--step", "1"], 1),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe is block-buffered
    for argv, code in cases:
        proc = subprocess.run(
            [sys.executable, "-c", _RUN_WITH_A_HOOK_AND_A_THREAD, *argv],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert proc.returncode == code, proc.stderr
        lines = proc.stdout.splitlines()
        assert "not reached" not in lines and lines[-2:] == ["thread done", "atexit hook ran"], proc.stdout
        if code == 0:
            assert lines[0].startswith("published step-0000000000 (base, step 0)")
        else:
            assert proc.stderr.strip().splitlines()[-1].startswith("delta-swap publish: error: checkpoint directory")


def test_publish_continues_from_a_verified_head_cache(tmp_path, checkpoints) -> None:
    """A publish after a publish takes the previous tensors from the head cache; a cache that
    does not match the store's head (one bit of one tensor here) is said on stderr and the head
    is rebuilt from the store, so the chain still rebuilds bit-exact."""
    from delta_swap.safetensors_io import parse_header

    store, cache = tmp_path / "store", tmp_path / "own-cache"
    args = ("--store", str(store), "--head-cache", str(cache), "--quiet", "--encode-threads", "2")
    _run("publish", str(checkpoints[0]), "--step", "0", *args)
    (cached,) = cache.rglob("head-rank-*.safetensors")
    proc = _run("publish", str(checkpoints[1]), "--step", "1", *args)
    assert "rebuilding" not in proc.stderr, proc.stderr
    data = bytearray(cached.read_bytes())
    name, (_, _, offset, length) = next(iter(parse_header(bytes(data[: 1 << 16]), len(data)).items()))
    data[offset + length // 2] ^= 0x01
    cached.write_bytes(bytes(data))
    proc = _run("publish", str(checkpoints[2]), "--step", "2", *args)
    assert f"tensor {name} does not match" in proc.stderr and "rebuilding step-0000000001 from the store" in proc.stderr
    rows = json.loads(_run("inspect", "--store", str(store), "--json").stdout)
    assert [r["kind"] for r in rows] == ["base", "delta", "delta"]
    out = tmp_path / "out"
    _run("pull", "--store", str(store), "--out", str(out), "--quiet")
    got, want = load_file(str(out / "model.safetensors")), load_file(str(checkpoints[2] / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_publish_in_process_leaves_no_thread_behind(tmp_path, checkpoints) -> None:
    from delta_swap import cli

    before = set(threading.enumerate())
    for step in (0, 1):
        assert (
            cli.main(
                ["publish", str(checkpoints[step]), "--store", str(tmp_path / "s"), "--step", str(step), "--quiet"]
            )
            == 0
        )
    assert [t.name for t in threading.enumerate() if t not in before] == []


def test_watch_publishes_each_checkpoint_a_trainer_writes_in_step_order(tmp_path, checkpoints) -> None:
    """A trainer saves ``checkpoint-N`` folders one after the other; ``watch`` (one process) skips
    the steps the store already holds, publishes each new folder once it is complete (a folder
    still being written waits, and so do later ones), exits after ``--until-step``, and the store
    rebuilds the last checkpoint bit-exact. SIGTERM ends it as Ctrl-C does, with exit 130."""
    import shutil
    import time

    store, saves = f"file://{tmp_path}/store", tmp_path / "run"
    saves.mkdir()
    _run("publish", str(checkpoints[0]), "--store", store, "--step", "0", "--quiet")  # published before
    shutil.copytree(checkpoints[0], saves / "checkpoint-0")
    watch = [*CLI, "watch", str(saves), "--store", store, "--settle-s", "1", "--poll-s", "0.1", "--base-every", "30"]
    proc = subprocess.Popen([*watch, "--until-step", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def save(step: int) -> None:  # as a trainer writes a checkpoint: files written now
        shutil.copytree(checkpoints[step], saves / f"checkpoint-{step}", copy_function=shutil.copy)

    try:
        writing = saves / "checkpoint-1"  # the trainer stops half way through step 1
        writing.mkdir()
        (writing / "model.safetensors").write_bytes((checkpoints[1] / "model.safetensors").read_bytes()[:1000])
        save(2)
        time.sleep(2.5)  # step 1 settles unfinished: said, retried once it changes; step 2 waits for it
        assert not list((tmp_path / "store").rglob("*0000000002*"))
        shutil.copytree(checkpoints[1], writing, copy_function=shutil.copy, dirs_exist_ok=True)  # finished now
        save(3)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "checkpoint-1: safetensors header" in err and "waiting for it to change" in err
    published = [line.split()[1] for line in out.splitlines() if line.startswith("published")]
    assert published == ["step-0000000001", "step-0000000002", "step-0000000003"], out
    assert "watching" in out and "after step 0" in out
    rows = json.loads(_run("inspect", "--store", store, "--json").stdout)
    assert [(r["step"], r["kind"]) for r in rows] == [(0, "base"), (1, "delta"), (2, "delta"), (3, "delta")]
    pulled = tmp_path / "pulled"
    _run("pull", "--store", store, "--out", str(pulled), "--quiet")
    got, want = load_file(str(pulled / "model.safetensors")), load_file(str(checkpoints[3] / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

    idle = subprocess.Popen(watch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        idle.terminate()
        idle.communicate(timeout=60)
    finally:
        idle.kill()
    assert idle.returncode == 130


def test_checkpoint_folders_are_found_by_step_once_complete(tmp_path) -> None:
    from delta_swap.checkpoint_watch import ready_checkpoints, step_of

    assert [step_of(n) for n in ("checkpoint-500", "global_step_7", "step_0012", "iter_0000300", "runs")] == [
        500,
        7,
        12,
        300,
        None,
    ]
    for name in ("checkpoint-10", "checkpoint-2", "checkpoint-5", "logs"):
        (tmp_path / name).mkdir()
    for name in ("checkpoint-10", "checkpoint-2"):
        (tmp_path / name / "model.safetensors").write_bytes(b"x")
    (tmp_path / "checkpoint-5" / "config.json").write_text("{}")  # no weights yet
    now = (tmp_path / "checkpoint-10" / "model.safetensors").stat().st_mtime
    assert [f.step for f in ready_checkpoints(tmp_path, None, 1.0, now=now + 2)] == [2]  # 5 is not done: 10 waits
    (tmp_path / "checkpoint-5" / "model.safetensors").write_bytes(b"x")
    now = (tmp_path / "checkpoint-5" / "model.safetensors").stat().st_mtime
    assert [f.step for f in ready_checkpoints(tmp_path, 2, 1.0, now=now + 2)] == [5, 10]
    assert ready_checkpoints(tmp_path, 2, 1.0, now=now + 0.5) == []  # step 5 changed half a second ago
    assert ready_checkpoints(tmp_path / "missing", None, 1.0) == []


@pytest.mark.parametrize("cmd", ["publish", "watch", "pull", "inspect"])
def test_every_command_has_help(cmd) -> None:
    assert "--store" in _run(cmd, "--help").stdout
