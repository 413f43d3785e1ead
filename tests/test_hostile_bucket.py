"""A hostile bucket, round two (issue #29): bounded chain walks, a pull search that reads what it
must and no more, and pulls that survive a kill between their renames. Real files on file://."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from delta_swap import store_keys
from delta_swap.chain import ChainReader
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.signing import TrustedKeys, generate_keypair
from delta_swap.stores import FileStore
from tests.support.chains import rl_steps


class CountingStore(FileStore):
    """A file:// store that counts the reads of every key and the bytes they return."""

    def __init__(self, root) -> None:
        super().__init__(root, create=False)
        self.reads: Counter[str] = Counter()
        self.attempts: Counter[str] = Counter()
        self.bytes_read = 0

    async def get(self, key, start=None, end=None, *, max_bytes=None):
        self.attempts[key] += 1
        data = await super().get(key, start, end, max_bytes=max_bytes)
        self.reads[key] += 1
        self.bytes_read += len(data)
        return data

    def manifest_reads(self) -> Counter[str]:
        return Counter({k.split("/")[1]: n for k, n in self.reads.items() if k.endswith("/manifest.json")})


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> str:
    return str(generate_keypair(tmp_path_factory.mktemp("keys") / "trainer.key")[0])


def _publish(root, steps: list[int], key: str, bases: tuple[int, ...] = ()) -> None:
    states = rl_steps(len(steps), seed=3)
    with Publisher(str(root), PublisherConfig(base_every=10_000, signing_key=key)) as pub:
        for step, state in zip(steps, states):
            pub.publish(step, state, force_base=step in bases)


def _walk(root, key: str, target: str | None = None, current: str | None = None):
    store = CountingStore(root)
    reader = ChainReader(store, TrustedKeys.load([f"{key}.pub"]))

    async def run():
        head = await reader.head()
        return await reader.path_to(target or head.snapshot_id, current)

    return asyncio.run(run()), store


@pytest.mark.parametrize(
    "steps", [list(range(40)), list(range(0, 400, 10)), [0, 1, 2, 5, 6, 13, 20, 21, 22, 40, 41, 60]]
)
def test_chain_walk_reads_each_manifest_once_and_stops_at_the_nearest_base(tmp_path, key, steps):
    """Whatever the spacing of the steps, a cold walk reads every manifest from the head back to
    the nearest base exactly once (with its signature), and nothing below that base."""
    base = steps[len(steps) // 2]
    _publish(tmp_path, steps, key, bases=(steps[0], base))
    path, store = _walk(tmp_path, key)
    expected = [f"step-{s:010d}" for s in steps if s >= base]
    assert [m.snapshot_id for m in path] == expected
    assert path[0].kind == "base"
    reads = store.manifest_reads()
    assert {sid: reads[sid] for sid in expected} == {sid: 1 for sid in expected}
    below = [f"step-{s:010d}" for s in steps if s < base]
    assert not any(reads[sid] for sid in below), "read manifests below the nearest base"
    assert all(store.reads[store_keys.signature_key(sid)] == 1 for sid in expected)
    missed = [k for k in store.attempts if k.endswith("/manifest.json") and k.split("/")[1] not in reads]
    if len({b - a for a, b in zip(steps, steps[1:])}) == 1:
        assert not missed, "guessed ids that a regularly spaced chain does not have"
    else:
        assert len(missed) <= 2 * len(expected), missed


def test_chain_walk_from_the_current_snapshot_reads_only_what_follows_it(tmp_path, key):
    steps = list(range(30))
    _publish(tmp_path, steps, key, bases=(0,))
    path, store = _walk(tmp_path, key, current="step-0000000020")
    assert [m.step for m in path] == list(range(21, 30))
    reads = store.manifest_reads()
    assert all(reads[f"step-{s:010d}"] == 1 for s in range(20, 30))
    assert not any(reads[f"step-{s:010d}"] for s in range(20)), "read manifests below the current snapshot"


# ---------------------------------------------------------------------- pull's search


def _flip_shard(root, step: int) -> None:
    shard = next((root / "snapshots" / f"step-{step:010d}").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def _pull(monkeypatch, root, out, key: str) -> tuple[int, CountingStore]:
    """``delta-swap pull`` in this process, over a CountingStore of ``root``."""
    from delta_swap import cli

    store = CountingStore(root)
    monkeypatch.setattr(cli, "open_store", lambda url: store)
    code = cli.main(["pull", "--store", str(root), "--out", str(out), "--trusted-key", f"{key}.pub", "--quiet"])
    return code, store


def _shard_reads(store: CountingStore) -> Counter[str]:
    return Counter({k: n for k, n in store.reads.items() if "/shard-" in k})


def _payload(root, steps) -> int:
    return sum(f.stat().st_size for s in steps for f in (root / "snapshots" / f"step-{s:010d}").glob("shard-*"))


def test_pull_search_reuses_what_the_failed_pull_rebuilt(tmp_path, key, monkeypatch, capsys):
    """A corrupt delta under the head: the error names the snapshot before it, and no shard is
    downloaded twice to find that out."""
    root = tmp_path / "store"
    _publish(root, list(range(10)), key, bases=(0,))
    _flip_shard(root, 7)
    code, store = _pull(monkeypatch, root, tmp_path / "out", key)
    err = capsys.readouterr().err
    assert code == 1 and "mismatch" in err and "the newest snapshot that rebuilds is step-0000000006" in err, err
    assert max(_shard_reads(store).values()) == 1
    assert store.bytes_read <= _payload(root, range(8)) + 64 * 1024  # shards up to the bad one, plus manifests
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("junk", ["not json", "link", "directory"])
def test_a_junk_manifest_does_not_stop_the_search(tmp_path, key, monkeypatch, capsys, junk):
    """Junk under snapshots/ (a manifest that is not JSON, a link out of the store, a folder in
    a manifest's place), newer than every good snapshot, is skipped; a broken base is searched
    past, rebuilding the older chain once, within the search's byte bound."""
    root = tmp_path / "store"
    _publish(root, list(range(8)), key, bases=(0, 5))
    _flip_shard(root, 5)  # the head's base: nothing on the head's path rebuilds
    bad = root / "snapshots" / "step-0000000006x"
    bad.mkdir()
    if junk == "not json":
        (bad / "manifest.json").write_text("{not json")
    elif junk == "link":
        (tmp_path / "outside.json").write_text("{}")
        (bad / "manifest.json").symlink_to(tmp_path / "outside.json")
    else:
        (bad / "manifest.json").mkdir()
    code, store = _pull(monkeypatch, root, tmp_path / "out", key)
    err = capsys.readouterr().err
    assert code == 1 and "the newest snapshot that rebuilds is step-0000000004" in err, err
    assert max(_shard_reads(store).values()) == 1
    model = sum(t.nbytes for t in rl_steps(1, seed=3)[0].values())
    assert store.bytes_read <= _payload(root, [5]) + 2 * model + 64 * 1024


# ---------------------------------------------------------------------- a pull killed between its renames

_KILLED_BETWEEN_RENAMES = """
import os, signal, sys
from delta_swap import checkpoint_dir
from delta_swap.cli import main

checkpoint_dir._exchange = lambda a, b: False  # a kernel without renameat2
renames = []
real_rename = os.rename

def rename(src, dst):
    renames.append((src, dst))
    if len(renames) == 2:  # the old pull moved aside, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)
    real_rename(src, dst)

checkpoint_dir.os.rename = rename
sys.exit(main(sys.argv[1:]))
"""


def test_a_pull_killed_between_its_renames_is_finished_by_the_next_one(tmp_path, key):
    """SIGKILL between ``out -> .old`` and ``new -> out``: ``out`` is gone for a moment; the next
    pull puts the new pull in its place (so an older step is still refused) and leaves nothing
    behind."""
    import json
    import subprocess
    import sys

    from delta_swap.checkpoint_dir import PULL_MARKER

    root, out = tmp_path / "store", tmp_path / "out"
    _publish(root, list(range(3)), key, bases=(0,))
    pull = ["pull", "--store", str(root), "--out", str(out), "--trusted-key", f"{key}.pub", "--quiet"]
    assert (
        subprocess.run([sys.executable, "-m", "delta_swap.cli", *pull, "--snapshot", "step-0000000001"]).returncode == 0
    )
    killed = subprocess.run([sys.executable, "-c", _KILLED_BETWEEN_RENAMES, *pull])
    assert killed.returncode == -9
    assert not out.exists()
    leftovers = sorted(p.name.rsplit(".", 1)[-1] for p in tmp_path.glob(".out.pulling-*"))
    assert len(leftovers) == 2 and leftovers[0] == "old", leftovers
    older = subprocess.run(
        [sys.executable, "-m", "delta_swap.cli", *pull, "--snapshot", "step-0000000000"], capture_output=True, text=True
    )
    assert older.returncode == 1 and "older" in older.stderr, older.stderr
    assert json.loads((out / PULL_MARKER).read_text())["snapshot_id"] == "step-0000000002"
    assert (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".out.pulling-*"))
