"""Safe pulls (only verified tensors and checkpoint side files, installed atomically) and recovery
from a damaged chain (a base can always be published; readers name what still rebuilds)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from delta_swap import store_keys
from delta_swap.chain import ChainReader
from delta_swap.checkpoint_dir import PULL_MARKER
from delta_swap.checksum import checksum, sha256
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.settings import Settings
from delta_swap.stores import FileStore
from delta_swap.subscriber import Subscriber
from delta_swap.testing import RecordingAdapter
from tests.support.chains import assert_state_equal, rl_steps

CLI = [sys.executable, "-m", "delta_swap.cli"]


def _cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)
    assert (proc.returncode == 0) == ok, proc.stderr
    if not ok:
        errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc


def _publish(root, steps, start=0, **cfg):
    with Publisher(
        str(root), PublisherConfig(**{"base_every": 100, **cfg}), files={"config.json": b'{"model_type": "llama"}'}
    ) as pub:
        for i, s in enumerate(steps):
            pub.publish(start + i, s)


def _corrupt_shard(root, snapshot_id: str) -> None:
    shard = next((root / "snapshots" / snapshot_id).glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x20
    shard.write_bytes(bytes(data))


def test_pull_writes_only_verified_tensors_and_side_files(tmp_path) -> None:
    store = tmp_path / "store"
    _publish(store, rl_steps(1))
    # Someone with write access lists files an engine would load as weights or code.
    sid = "step-0000000000"
    path = store / store_keys.manifest_key(sid)
    doc = json.loads(path.read_text())
    for name, content in (
        ("model.safetensors.index.json", b'{"weight_map": {}}'),
        ("pytorch_model.bin", b"pickle"),
        ("modeling_evil.py", b"import os"),
        ("extra.safetensors", b"\0" * 16),
    ):
        (store / store_keys.file_key(sid, name)).parent.mkdir(parents=True, exist_ok=True)
        (store / store_keys.file_key(sid, name)).write_bytes(content)
        doc["files"].append(
            {"name": name, "size": len(content), "checksum": checksum(content), "sha256": sha256(content)}
        )
    path.write_text(json.dumps(doc))
    out = tmp_path / "out"
    proc = _cli("pull", "--store", str(store), "--out", str(out), "--quiet")
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", PULL_MARKER])
    assert "not a checkpoint side file" in proc.stderr
    assert json.loads((out / PULL_MARKER).read_text())["snapshot_id"] == sid


def test_pull_replaces_an_earlier_pull_whole_and_refuses_foreign_folders(tmp_path) -> None:
    store = tmp_path / "store"
    steps = rl_steps(2)
    _publish(store, steps)
    out = tmp_path / "out"
    _cli("pull", "--store", str(store), "--out", str(out), "--quiet", "--snapshot", "step-0000000000")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"left over from an older, sharded pull")
    (out / "model.safetensors.index.json").write_text("{}")
    _cli("pull", "--store", str(store), "--out", str(out), "--quiet")
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", PULL_MARKER])
    got = load_file(str(out / "model.safetensors"))
    assert all(got[k].equal(v) for k, v in steps[1].items())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no staging folder left behind

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    err = _cli("pull", "--store", str(store), "--out", str(foreign), "--quiet", ok=False).stderr
    assert "not an earlier pull" in err and (foreign / "notes.txt").exists()
    _cli("pull", "--store", str(store), "--out", str(foreign), "--quiet", "--force")
    assert not (foreign / "notes.txt").exists()


def test_a_base_can_be_published_on_a_damaged_chain(tmp_path, caplog) -> None:
    store = tmp_path / "store"
    steps = rl_steps(5)
    _publish(store, steps[:3])
    _corrupt_shard(store, "step-0000000002")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(steps[3], str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text("{}")
    out = _cli("publish", str(ckpt), "--store", str(store), "--step", "3", "--base", "--quiet").stdout
    assert "(base, step 3)" in out
    # A publisher resuming on a damaged head says so and starts a new base instead of failing.
    with caplog.at_level(logging.WARNING, logger="delta_swap.publisher"):
        _corrupt_shard(store, "step-0000000003")
        _publish(store, steps[4:], start=4)
    assert "cannot be rebuilt" in caplog.text
    manifests = {m.step: m for m in _run_list(store)}
    assert manifests[4].kind == "base"


def _run_list(store):
    import asyncio

    return asyncio.run(ChainReader(FileStore(store)).list())


def test_pull_at_a_damaged_head_names_the_newest_snapshot_that_rebuilds(tmp_path) -> None:
    store = tmp_path / "store"
    _publish(store, rl_steps(4))
    _corrupt_shard(store, "step-0000000003")
    err = _cli("pull", "--store", str(store), "--out", str(tmp_path / "o"), "--quiet", ok=False).stderr
    assert "step-0000000003" in err and "--snapshot step-0000000002" in err
    _cli("pull", "--store", str(store), "--out", str(tmp_path / "o"), "--quiet", "--snapshot", "step-0000000002")


async def test_servers_move_on_once_a_fresh_base_lands(tmp_path) -> None:
    store = tmp_path / "store"
    steps = rl_steps(5)
    _publish(store, steps[:2])
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=str(store)), engine)
    assert await sub.sync() and sub.current.step == 1
    _publish(store, steps[2:3], start=2)
    _corrupt_shard(store, "step-0000000002")
    assert not await sub.sync() and sub.current.step == 1
    _publish(store, steps[3:4], start=3, resume=True)  # resumes on the damaged head: a base
    assert await sub.sync() and sub.current.step == 3
    assert sub.status()["last_update_path"] == ["step-0000000003"]
    await sub.stop()
    assert_state_equal(engine.weights, steps[3])


@pytest.mark.parametrize("force_base", [True, False])
async def test_a_corrupt_head_pointer_does_not_block_publishing(tmp_path, force_base) -> None:
    store = tmp_path / "store"
    _publish(store, rl_steps(2))
    (store / "HEAD").write_bytes(b"\x00garbage")
    with Publisher(str(store), PublisherConfig(base_every=100)) as pub:
        pub.publish(2, rl_steps(3)[2], force_base=force_base)
    head = await ChainReader(FileStore(store)).head()
    assert head is not None and head.step == 2
