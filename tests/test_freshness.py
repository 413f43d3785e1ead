"""A bucket that can be written but holds no key (issue #29): it cannot get a planted rank part
committed, roll a server or a pull back, splice in another run signed with the same key, hide a
frozen HEAD, or lock the key holder out. Real files on file://, and SeaweedFS's S3 gateway (the
session's ``seaweedfs`` fixture, tests/conftest.py) with the trainer's key."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time

import pytest
import torch
from prometheus_client import REGISTRY

from delta_swap import store_keys
from delta_swap.chain import ChainReader
from delta_swap.errors import ChainError, SignatureError
from delta_swap.freshness import load_record
from delta_swap.heartbeat import Heartbeat
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.rebuild import rebuild
from delta_swap.settings import Settings
from delta_swap.signing import PART_CONTEXT, SigningKey, TrustedKeys, generate_keypair
from delta_swap.stores import FileStore, open_store
from delta_swap.subscriber import Subscriber
from delta_swap.testing import RecordingAdapter
from tests.support.chains import assert_state_equal, rl_steps
from tests.test_transports import s3  # noqa: F401  (a fresh prefix on SeaweedFS's S3 gateway per test)

CLI = [sys.executable, "-m", "delta_swap.cli"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("keys")
    return {name: str(generate_keypair(root / f"{name}.key")[0]) for name in ("trainer", "next")}


def _trusted(*key_paths: str) -> TrustedKeys:
    return TrustedKeys.load([f"{k}.pub" for k in key_paths])


def _publish(url, steps, key: str | None, start: int = 0, **cfg) -> Publisher:
    with Publisher(str(url), PublisherConfig(**{"base_every": 100, "signing_key": key, **cfg})) as pub:
        for i, s in enumerate(steps):
            pub.publish(start + i, s)
    return pub


def _manifest_doc(root, snapshot_id: str) -> dict:
    return json.loads((root / store_keys.manifest_key(snapshot_id)).read_text())


def _set_head(root, step: int) -> None:
    (root / store_keys.HEAD_KEY).write_text(json.dumps({"snapshot_id": f"step-{step:010d}", "step": step}))


def _cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)
    assert (proc.returncode == 0) == ok, proc.stderr
    return proc


# ---------------------------------------------------------------------- rank parts


def _rank_publishers(url: str, key: str) -> list[Publisher]:
    return [Publisher(url, PublisherConfig(rank=r, world_size=2, base_every=100, signing_key=key)) for r in range(2)]


@pytest.mark.parametrize("planted", ["unsigned", "another step's signed part", "signed by another key"])
async def test_a_planted_rank_part_is_never_committed_and_the_real_one_still_is(
    tmp_path, keys, caplog, planted
) -> None:
    store = tmp_path / "store"
    steps = rl_steps(2)
    names = sorted(steps[0])
    mine = [names[0::2], names[1::2]]
    ranks = _rank_publishers(str(store), keys["trainer"])
    for rank, pub in enumerate(ranks):
        pub.publish(0, {n: steps[0][n] for n in mine[rank]})
        pub.flush()
    # The attacker's part for rank 1 of step 1, before rank 1 gets there.
    old_part, old_sig = (
        (store / store_keys.part_key("step-0000000000", 1)),
        (store / store_keys.part_signature_key("step-0000000000", 1)),
    )
    part, sig = (
        store / store_keys.part_key("step-0000000001", 1),
        store / store_keys.part_signature_key("step-0000000001", 1),
    )
    part.parent.mkdir(parents=True)
    forged = json.loads(old_part.read_text())
    if planted == "another step's signed part":
        shutil.copy(old_part, part)  # a real, validly signed part: of step 0
        shutil.copy(old_sig, sig)
    else:
        forged.update(snapshot_id="step-0000000001", step=1)
        part.write_text(json.dumps(forged))
        if planted == "signed by another key":
            sig.write_bytes(SigningKey.load(keys["next"]).sign(part.read_bytes(), PART_CONTEXT))
    with caplog.at_level(logging.WARNING, logger="delta_swap.commit"):
        ranks[0].publish(1, {n: steps[1][n] for n in mine[0]})
        ranks[0].flush()
    assert not (store / store_keys.manifest_key("step-0000000001")).exists()  # the planted part was not committed
    assert "ignoring the part of rank 1 for step-0000000001" in caplog.text
    ranks[1].publish(1, {n: steps[1][n] for n in mine[1]})  # the real rank replaces it and commits
    for pub in ranks:
        pub.close()
    reader = ChainReader(FileStore(store), _trusted(keys["trainer"]))
    manifest, state, _ = await rebuild(reader.store, reader=reader)
    assert manifest.step == 1
    assert_state_equal(state, steps[1])


# ---------------------------------------------------------------------- run ids


async def test_every_snapshot_names_its_run_under_the_signature(tmp_path, keys) -> None:
    store = tmp_path / "store"
    steps = rl_steps(5)
    _publish(store, steps[:3], keys["trainer"], base_every=2)
    _publish(store, steps[3:], keys["trainer"], start=3, base_every=2)  # a restarted trainer: the same run
    reader = ChainReader(FileStore(store), _trusted(keys["trainer"]))
    manifests = await reader.list()
    assert [m.kind for m in manifests] == ["base", "delta", "base", "delta", "base"]
    assert len({m.run_id for m in manifests}) == 1 and manifests[0].run_id.startswith("run-")
    other = tmp_path / "other"
    _publish(other, steps[:1], keys["trainer"])
    assert _manifest_doc(other, "step-0000000000")["run_id"] != manifests[0].run_id  # a new chain, a new run
    doc = _manifest_doc(store, "step-0000000004")
    doc["run_id"] = "run-0000000000000000"
    (store / store_keys.manifest_key("step-0000000004")).write_text(json.dumps(doc))
    with pytest.raises(SignatureError, match="does not match"):
        await ChainReader(FileStore(store), _trusted(keys["trainer"])).manifest("step-0000000004")


def _copy_other_run(keys, tmp_path, store, steps, start: int = 4) -> None:
    """Steps ``start`` (a base) and ``start + 1`` of another run signed with the same key, copied
    into ``store``, HEAD on the second."""
    other = tmp_path / "other-run"
    _publish(other, steps[-2:], keys["trainer"], start=start)
    for step in (start, start + 1):
        sid = f"step-{step:010d}"
        shutil.copytree(other / "snapshots" / sid, store / "snapshots" / sid, dirs_exist_ok=True)
    _set_head(store, start + 1)


async def test_servers_refuse_another_run_signed_with_the_same_key(tmp_path, keys) -> None:
    store = tmp_path / "store"
    steps = rl_steps(6)
    _publish(store, steps[:4], keys["trainer"])
    engine = RecordingAdapter()
    settings = Settings(store=str(store), trusted_key=f"{keys['trainer']}.pub")
    sub = Subscriber(settings, engine)
    assert await sub.sync() and sub.current.step == 3
    run = sub.status()["run_id"]
    _copy_other_run(keys, tmp_path, store, steps)
    assert not await sub.sync()
    status = sub.status()
    assert status["current_step"] == 3 and status["last_error_kind"] == "chain"
    assert f"follows run {run}" in status["last_error"] and status["newest_step"] == 3
    await sub.stop()
    # A server restarted on this host remembers the run too.
    restarted = Subscriber(settings, RecordingAdapter())
    assert not await restarted.sync() and restarted.current is None
    assert f"follows run {run}" in restarted.status()["last_error"]
    await restarted.stop()
    assert_state_equal(engine.weights, steps[3])
    # inspect lists both runs and says so.
    proc = _cli("inspect", "--store", str(store), "--trusted-key", f"{keys['trainer']}.pub")
    assert "holds snapshots of 2 runs" in proc.stderr and run in proc.stdout


async def test_a_delta_never_follows_a_snapshot_of_another_run(tmp_path, keys) -> None:
    store, other = tmp_path / "store", tmp_path / "other"
    steps = rl_steps(6)
    _publish(store, steps[:5], keys["trainer"])
    _publish(other, steps, keys["trainer"])
    shutil.copytree(other / "snapshots" / "step-0000000005", store / "snapshots" / "step-0000000005")
    with pytest.raises(ChainError, match="of another run"):
        await ChainReader(FileStore(store), _trusted(keys["trainer"])).path_to("step-0000000005")


# ---------------------------------------------------------------------- never going back


async def test_a_restarted_server_does_not_go_back_unless_an_operator_asks(tmp_path, keys) -> None:
    store = tmp_path / "store"
    steps = rl_steps(4)
    _publish(store, steps, keys["trainer"])
    settings = Settings(store=str(store), trusted_key=f"{keys['trainer']}.pub")
    first = Subscriber(settings, RecordingAdapter())
    assert await first.sync() and first.current.step == 3
    await first.stop()
    record = load_record(first.freshness_file)
    assert record is not None and (record.step, record.run_id) == (3, first.current.run_id)
    assert first.freshness_file.parent != settings.staging_dir  # the conftest keeps records apart

    again = Subscriber(settings, RecordingAdapter())  # the same snapshot after a restart: fine
    assert await again.sync() and again.current.step == 3
    await again.stop()

    _set_head(store, 1)  # HEAD moved back to an older, validly signed snapshot
    engine = RecordingAdapter()
    restarted = Subscriber(settings, engine)
    assert not await restarted.sync()
    status = restarted.status()
    assert restarted.current is None and "back to 1" in status["last_error"] and "allow_older=1" in status["last_error"]
    assert not await restarted.resync()  # a resync alone does not go back either
    assert await restarted.resync(allow_older=True) and restarted.current.step == 1
    assert restarted.status()["last_resync"]["allow_older"] is True
    assert load_record(restarted.freshness_file).step == 1  # the operator's choice is the new floor
    await restarted.stop()
    assert_state_equal(engine.weights, steps[1])


def test_pull_does_not_replace_a_newer_pull_or_another_run_unless_asked(tmp_path, keys) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    steps = rl_steps(6)
    _publish(store, steps[:4], keys["trainer"])
    trusted = f"{keys['trainer']}.pub"
    _cli("pull", "--store", str(store), "--out", str(out), "--quiet", "--trusted-key", trusted)
    marker = json.loads((out / ".delta-swap-pull.json").read_text())
    assert marker["step"] == 3 and marker["run_id"].startswith("run-")
    _set_head(store, 1)
    err = _cli("pull", "--store", str(store), "--out", str(out), "--quiet", "--trusted-key", trusted, ok=False).stderr
    assert "from step 3 back to 1" in err and "--allow-older" in err and len(err.strip().splitlines()) == 1
    assert json.loads((out / ".delta-swap-pull.json").read_text())["step"] == 3  # untouched
    _cli("pull", "--store", str(store), "--out", str(out), "--quiet", "--trusted-key", trusted, "--allow-older")
    assert json.loads((out / ".delta-swap-pull.json").read_text())["step"] == 1
    _copy_other_run(keys, tmp_path, store, steps)
    err = _cli("pull", "--store", str(store), "--out", str(out), "--quiet", "--trusted-key", trusted, ok=False).stderr
    assert f"follows run {marker['run_id']}" in err


# ---------------------------------------------------------------------- heartbeat


def _gauge(name: str) -> float | None:
    return REGISTRY.get_sample_value(name)


async def test_a_frozen_head_shows_as_staleness_through_the_heartbeat(tmp_path, keys) -> None:
    store = tmp_path / "store"
    steps = rl_steps(4)
    _publish(store, steps[:2], keys["trainer"])
    beat_after_1 = (store / store_keys.HEARTBEAT_KEY).read_bytes()
    sub = Subscriber(Settings(store=str(store), trusted_key=f"{keys['trainer']}.pub"), RecordingAdapter())
    assert await sub.sync() and sub.current.step == 1
    assert sub.status()["published_step_seen"] == 1 and sub.status()["staleness_steps"] == 0
    _publish(store, steps[2:], keys["trainer"], start=2)
    _set_head(store, 1)  # the store holds HEAD back; steps 2 and 3 exist
    time.sleep(0.05)
    assert not await sub.sync()
    status = sub.status()
    assert status["current_step"] == 1 and status["newest_step"] == 1
    assert status["published_step_seen"] == 3 and status["staleness_steps"] == 2 and status["staleness_seconds"] > 0
    assert 0 <= status["trainer_seen_seconds"] < 60 and status["heartbeat_expired"] is False
    assert _gauge("delta_swap_published_step_seen") == 3 and _gauge("delta_swap_staleness_steps") == 2
    assert _gauge("delta_swap_trainer_seen_seconds") is not None

    (store / store_keys.HEARTBEAT_KEY).write_bytes(beat_after_1)  # an older signed heartbeat, replayed
    assert not await sub.sync() and sub.status()["published_step_seen"] == 3
    forged = json.loads(beat_after_1)
    forged["signature"] = None
    (store / store_keys.HEARTBEAT_KEY).write_text(json.dumps(forged))
    assert not await sub.sync()
    assert "not signed" in sub.status()["heartbeat_error"] and sub.status()["published_step_seen"] == 3
    await sub.stop()


def test_the_trainer_beats_while_it_publishes_nothing(tmp_path, keys) -> None:
    store = tmp_path / "store"
    trusted = _trusted(keys["trainer"])
    with Publisher(
        str(store), PublisherConfig(signing_key=keys["trainer"], heartbeat_every=0.2, heartbeat_ttl=5)
    ) as pub:
        pub.publish(7, rl_steps(1)[0])
        pub.flush()
        first = Heartbeat.decode((store / store_keys.HEARTBEAT_KEY).read_bytes(), trusted)
        time.sleep(0.7)
        later = Heartbeat.decode((store / store_keys.HEARTBEAT_KEY).read_bytes(), trusted)
    assert (first.step, first.snapshot_id, first.run_id) == (7, "step-0000000007", pub.run_id)
    assert later.step == 7 and later.at > first.at and later.expires_at == pytest.approx(later.at + 5)
    assert later.published_at == first.published_at


async def test_an_expired_heartbeat_is_reported(tmp_path, keys) -> None:
    store = tmp_path / "store"
    _publish(store, rl_steps(1), keys["trainer"], heartbeat_ttl=0.01)
    time.sleep(0.05)
    sub = Subscriber(Settings(store=str(store), trusted_key=f"{keys['trainer']}.pub"), RecordingAdapter())
    assert await sub.sync()
    assert sub.status()["heartbeat_expired"] is True and sub.status()["published_step_seen"] == 0
    await sub.stop()


# ---------------------------------------------------------------------- only signed state blocks the key holder


@pytest.fixture(params=["file", "s3"])
def store_url(request, tmp_path) -> str:
    return str(tmp_path / "store") if request.param == "file" else request.getfixturevalue("s3")


async def _plant(url: str, case: str) -> None:
    store = open_store(url)
    try:
        if case == "unsigned HEAD far ahead":
            doc = json.loads(await store.get(store_keys.manifest_key("step-0000000001")))
            doc.update(snapshot_id="step-0000900000", step=900000)
            await store.put(store_keys.manifest_key("step-0000900000"), json.dumps(doc).encode())
            await store.put(
                store_keys.HEAD_KEY, json.dumps({"snapshot_id": "step-0000900000", "step": 900000}).encode()
            )
        elif case == "oversized HEAD":
            await store.put(store_keys.HEAD_KEY, b'{"snapshot_id": "step-0000000001", "step": 1}' + b" " * 8192)
        else:  # junk manifests where the key holder's next two steps go
            for step in (2, 3):
                await store.put(store_keys.manifest_key(f"step-{step:010d}"), b'{"format": "delta-swap", "junk": 1}')
    finally:
        await store.close()


@pytest.mark.parametrize("first_base", [True, False], ids=["publish --base", "publish"])
@pytest.mark.parametrize("case", ["unsigned HEAD far ahead", "oversized HEAD", "junk manifests ahead"])
async def test_only_signed_state_can_block_the_key_holder(store_url, keys, caplog, case, first_base) -> None:
    steps = rl_steps(4)
    run = _publish(store_url, steps[:2], keys["trainer"]).run_id
    await _plant(store_url, case)
    with caplog.at_level(logging.WARNING, logger="delta_swap.publisher"):
        with Publisher(store_url, PublisherConfig(base_every=100, signing_key=keys["trainer"])) as pub:
            pub.publish(2, steps[2], force_base=first_base)
            pub.publish(3, steps[3])
    if case == "junk manifests ahead":
        assert caplog.text.count("is not this trainer's") == 2 and "overwriting it" in caplog.text
    else:
        assert caplog.text.count("ignoring the store's HEAD") == 1, caplog.text
    store = open_store(store_url)
    try:
        reader = ChainReader(store, _trusted(keys["trainer"]))
        head = await reader.head()
        assert head is not None and head.step == 3
        manifest, state, path = await rebuild(store, reader=reader)
        # A new base, unless the publisher resumed on a head that verified.
        resumed = case == "junk manifests ahead" and not first_base
        assert manifest.run_id == run and [m.step for m in path] == ([0, 1, 2, 3] if resumed else [2, 3])
        assert_state_equal(state, steps[3])
    finally:
        await store.close()


async def test_resume_builds_only_on_a_head_that_verifies(tmp_path, keys, caplog) -> None:
    store = tmp_path / "store"
    steps = rl_steps(5)
    _publish(store, steps[:3], keys["trainer"])
    _publish(store, steps[3:4], None, start=3)  # anyone with write access chains an unsigned delta on
    with caplog.at_level(logging.WARNING, logger="delta_swap.publisher"):
        _publish(store, steps[4:], keys["trainer"], start=4)
    assert "is not signed" in caplog.text and "continues after step-0000000002 with a new base" in caplog.text
    doc = _manifest_doc(store, "step-0000000004")
    assert doc["kind"] == "base" and doc["run_id"] == _manifest_doc(store, "step-0000000002")["run_id"]
    sub = Subscriber(Settings(store=str(store), trusted_key=f"{keys['trainer']}.pub"), RecordingAdapter())
    assert await sub.sync() and sub.current.step == 4
    await sub.stop()


def test_resume_reads_at_most_max_model_bytes(tmp_path, caplog) -> None:
    store = tmp_path / "store"
    steps = rl_steps(2)
    big = {**steps[0], "big.weight": torch.zeros(1024, 256, dtype=torch.bfloat16)}  # 512 KiB the next step lacks
    _publish(store, [big], None)
    with caplog.at_level(logging.WARNING, logger="delta_swap.publisher"):
        _publish(store, steps[1:], None, start=1)  # default cap: twice what it publishes
    assert "cannot be rebuilt" in caplog.text and "more than the" in caplog.text
    assert _manifest_doc(store, "step-0000000001")["kind"] == "base"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="delta_swap.publisher"):
        _publish(store, [rl_steps(3)[2]], None, start=2, max_model_bytes=1 << 30)
    assert "cannot be rebuilt" not in caplog.text and _manifest_doc(store, "step-0000000002")["kind"] == "delta"


async def test_a_signed_head_of_another_run_is_ignored_by_a_publisher_that_names_its_run(tmp_path, keys) -> None:
    store = tmp_path / "store"
    steps = rl_steps(7)
    run = _publish(store, steps[:4], keys["trainer"]).run_id
    _copy_other_run(keys, tmp_path, store, steps, start=8)  # HEAD on the other run's step 9
    _publish(store, steps[4:5], keys["trainer"], start=4, run_id=run)
    head = await ChainReader(FileStore(store), _trusted(keys["trainer"])).head()
    assert head.step == 4 and _manifest_doc(store, "step-0000000004")["run_id"] == run


async def test_a_rotated_key_resumes_on_the_previous_keys_chain(tmp_path, keys) -> None:
    store = tmp_path / "store"
    steps = rl_steps(3)
    run = _publish(store, steps[:2], keys["trainer"]).run_id
    _publish(store, steps[2:], keys["next"], start=2, trusted_key=f"{keys['trainer']}.pub")
    doc = _manifest_doc(store, "step-0000000002")
    assert doc["kind"] == "delta" and doc["run_id"] == run
    reader = ChainReader(FileStore(store), _trusted(keys["trainer"], keys["next"]))
    assert_state_equal((await rebuild(reader.store, reader=reader))[1], steps[2])


# ---------------------------------------------------------------------- chains from before run ids


async def test_chains_from_before_run_ids_stay_readable_and_move_on_to_a_run(tmp_path) -> None:
    store = tmp_path / "store"
    steps = rl_steps(4)
    _publish(store, steps[:3], None)
    for i in range(3):  # as a release before run ids wrote them
        path = store / store_keys.manifest_key(f"step-{i:010d}")
        doc = json.loads(path.read_text())
        del doc["run_id"]
        path.write_text(json.dumps(doc))
    (store / store_keys.HEARTBEAT_KEY).unlink()
    sub = Subscriber(Settings(store=str(store)), RecordingAdapter())
    assert await sub.sync() and sub.current.run_id is None
    status = sub.status()
    assert status["published_step_seen"] is None and status["trainer_seen_seconds"] is None
    _publish(store, steps[3:], None, start=3)  # an upgraded trainer continues the chain: its delta starts a run
    doc = _manifest_doc(store, "step-0000000003")
    assert doc["kind"] == "delta" and doc["run_id"].startswith("run-")
    assert await sub.sync() and sub.current.run_id == doc["run_id"]
    await sub.stop()
    assert_state_equal(sub.adapter.weights, steps[3])


def test_the_heartbeat_is_bounded_and_checked(keys) -> None:
    from delta_swap.errors import CorruptDataError

    beat = Heartbeat("run-1", 3, "step-0000000003", 1.0, 2.0, 3.0)
    signed = beat.encode(SigningKey.load(keys["trainer"]))
    assert Heartbeat.decode(signed, _trusted(keys["trainer"])) == beat
    with pytest.raises(SignatureError, match="not trusted"):
        Heartbeat.decode(signed, _trusted(keys["next"]))
    with pytest.raises(SignatureError, match="does not match"):
        Heartbeat.decode(signed.replace(b'\\"step\\": 3', b'\\"step\\": 9'), _trusted(keys["trainer"]))
    for bad in (
        b"{}",
        b" " * 5000,
        b'{"format": "delta-swap-heartbeat", "body": "{\\"step\\": NaN}", "signature": null}',
    ):
        with pytest.raises(CorruptDataError):
            Heartbeat.decode(bad, None)
