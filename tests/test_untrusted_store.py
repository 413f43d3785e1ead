"""An untrusted store cannot make a reader do unbounded work, read outside the store, hang, or
escape delta-swap's error types: crafted manifests, HEADs, oversized objects, links, FIFOs."""

from __future__ import annotations

import json
import os
import time

import pytest

from delta_swap import store_keys
from delta_swap.chain import ChainReader, decode_head
from delta_swap.errors import ChainError, CorruptDataError, ObjectTooLargeError, StoreError
from delta_swap.manifest import Manifest, check_relative_name, check_snapshot_id
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.rebuild import rebuild
from delta_swap.settings import Settings
from delta_swap.stores import FileStore
from delta_swap.subscriber import Subscriber
from delta_swap.testing import RecordingAdapter
from tests.support.chains import assert_state_equal, rl_steps


@pytest.fixture
def chain(tmp_path):
    with Publisher(str(tmp_path), PublisherConfig(base_every=100)) as pub:
        for i, s in enumerate(rl_steps(3)):
            pub.publish(i, s)
    return tmp_path


def _edit(root, snapshot_id, edit) -> None:
    path = root / store_keys.manifest_key(snapshot_id)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("bad", ["config.json\n", "step-1\n", "a/../b", "", "x" * 300])
def test_names_must_match_whole(bad) -> None:
    with pytest.raises(CorruptDataError):
        check_relative_name(bad, "file")
    with pytest.raises(CorruptDataError):
        check_snapshot_id(bad)


async def test_tensors_may_not_share_stored_bytes(chain) -> None:
    """200 entries pointing at one byte range would make a reader write 200x what it fetched."""

    def edit(doc):
        tensors = {t["name"]: t for t in doc["tensors"]}
        tensors["lm_head.weight"]["offset"] = tensors["embed.weight"]["offset"]  # same shape and dtype

    _edit(chain, "step-0000000000", edit)
    with pytest.raises(CorruptDataError, match="share bytes"):
        await rebuild(FileStore(chain), "step-0000000000")


@pytest.mark.parametrize(
    "field, value", [("created_at", "Infinity"), ("step", "Infinity"), ("step", "1e400"), ("created_at", "NaN")]
)
async def test_non_finite_numbers_are_refused(chain, field, value) -> None:
    path = chain / store_keys.manifest_key("step-0000000002")
    text = path.read_text()
    doc = json.loads(text)
    path.write_text(text.replace(f'"{field}": {json.dumps(doc[field])}', f'"{field}": {value}'))
    with pytest.raises(CorruptDataError):
        await ChainReader(FileStore(chain)).manifest("step-0000000002")


@pytest.mark.parametrize(
    "head",
    [
        b'{"snapshot_id": "step-0000000002", "step": Infinity}',
        b"[" * 100000,
        b'{"snapshot_id": "step-0000000002\\n", "step": 2}',
        b"{}",
        b"null",
        b'{"snapshot_id": "step-0000000002", "step": 2}' + b" " * 5000,
    ],
)
def test_malformed_heads_are_corrupt_data(head) -> None:
    with pytest.raises(CorruptDataError):
        decode_head(head)


async def test_deeply_nested_manifest_is_corrupt_data(chain) -> None:
    (chain / store_keys.manifest_key("step-0000000002")).write_bytes(
        b'{"format": ' + b"[" * 200000 + b"]" * 200000 + b"}"
    )
    with pytest.raises(CorruptDataError):
        await ChainReader(FileStore(chain)).manifest("step-0000000002")


async def test_a_head_claiming_another_step_than_its_manifest_is_refused(chain) -> None:
    (chain / "HEAD").write_text(json.dumps({"snapshot_id": "step-0000000001", "step": 10**12}))
    with pytest.raises(CorruptDataError, match="claims step"):
        await ChainReader(FileStore(chain)).head()
    # The next commit replaces the bogus HEAD: the fleet is not frozen.
    with Publisher(str(chain), PublisherConfig(base_every=100)) as pub:
        pub.publish(3, rl_steps(4)[3])
    head = await ChainReader(FileStore(chain)).head()
    assert head is not None and head.step == 3


async def test_oversized_objects_are_refused_before_they_are_read(chain) -> None:
    store = FileStore(chain)
    manifest = await ChainReader(store).manifest("step-0000000002")
    shard = chain / store_keys.shard_key("step-0000000002", manifest.shards[0].name)
    with open(shard, "ab") as fh:  # stored 64 MiB larger than the manifest says
        fh.truncate(shard.stat().st_size + (64 << 20))
    with pytest.raises(ObjectTooLargeError):
        await rebuild(store, "step-0000000002")
    (chain / "HEAD").write_bytes(b" " * 8192)
    with pytest.raises(ObjectTooLargeError):
        await ChainReader(store).head()
    big = chain / store_keys.manifest_key("step-0000000001")
    big.write_bytes(big.read_bytes() + b" " * (2 << 20))
    with pytest.raises(ObjectTooLargeError):  # a server expecting 5 tensors allows ~1 MiB
        await ChainReader(store, expected_tensors=5).manifest("step-0000000001")


async def test_links_out_of_the_store_and_special_files_are_refused(chain, tmp_path_factory) -> None:
    outside = tmp_path_factory.mktemp("outside") / "secret.bin"
    outside.write_bytes(b"top secret" * 100)
    store = FileStore(chain)
    manifest = await ChainReader(store).manifest("step-0000000002")
    shard = chain / store_keys.shard_key("step-0000000002", manifest.shards[0].name)
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(StoreError, match="leaves the store") as info:
        await rebuild(store, "step-0000000002")
    assert "1000" not in str(info.value) and "secret" not in str(info.value)

    head = chain / "HEAD"
    head.unlink()
    head.symlink_to("/dev/zero")
    with pytest.raises(StoreError):
        await ChainReader(store).head()
    head.unlink()
    os.mkfifo(head)
    start = time.monotonic()
    with pytest.raises(StoreError, match="not a regular file"):
        await ChainReader(store).head()
    assert time.monotonic() - start < 5


async def test_status_shows_no_credentials_or_host_paths(chain) -> None:
    engine = RecordingAdapter()
    # Configured with a URL that carries credentials; the store object reads the local chain.
    sub = Subscriber(Settings(store="https://user:secret@cdn.example.com/run?sig=abc"), engine, store=FileStore(chain))
    assert await sub.sync()
    (chain / "HEAD").write_text(json.dumps({"snapshot_id": "step-0000000009", "step": 9}))
    assert not await sub.sync()
    st = sub.status()
    assert st["store"] == "https://cdn.example.com/run"
    assert st["last_error"] and str(chain) not in st["last_error"] and "secret" not in json.dumps(st)
    assert st["last_error_kind"] == "missing"
    await sub.stop()


async def test_a_runaway_step_is_refused(chain) -> None:
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=str(chain), max_step_jump=10), engine)
    assert await sub.sync() and sub.current.step == 2
    with Publisher(str(chain), PublisherConfig(base_every=100)) as pub:
        pub.publish(100, rl_steps(1)[0])
    assert not await sub.sync()
    assert "max_step_jump" in sub.status()["last_error"] and sub.current.step == 2
    assert sub.status()["last_error"].startswith(ChainError.__name__)
    await sub.stop()


async def test_manifest_parsing_is_bounded_by_the_served_model(chain) -> None:
    data = (chain / store_keys.manifest_key("step-0000000002")).read_bytes()
    assert Manifest.from_json(data).step == 2
    with pytest.raises(CorruptDataError, match="more than"):
        Manifest.from_json(data, max_bytes=100)


@pytest.mark.parametrize("streamed", [True, False])
async def test_a_tampered_shard_never_reaches_the_codec(tmp_path, monkeypatch, streamed) -> None:
    """With a trusted key, a delta shard whose last byte was changed is refused on its digests
    before the codec reads any of it: streamed into an arena in pieces (each tensor's payload is
    complete long before the shard ends) or fetched whole."""
    from delta_swap import rebuild
    from delta_swap.signing import generate_keypair

    key, pub = generate_keypair(tmp_path / "trainer.key")
    monkeypatch.setattr(rebuild, "STREAM_PIECE_BYTES", 256 if streamed else 1 << 30)
    store = tmp_path / "store"
    steps = rl_steps(2, lr=2e-4)
    with Publisher(str(store), PublisherConfig(base_every=100, signing_key=str(key))) as pub_:
        pub_.publish(0, steps[0])
    engine = RecordingAdapter(arena_dir=str(tmp_path))
    sub = Subscriber(Settings(store=str(store), trusted_key=str(pub)), engine)
    assert await sub.sync() and sub.current.step == 0
    with Publisher(str(store), PublisherConfig(base_every=100, signing_key=str(key))) as pub_:
        pub_.publish(1, steps[1])
    manifest = await ChainReader(FileStore(store)).manifest("step-0000000001")
    shard_entry = manifest.shards[0]
    assert manifest.kind == "delta" and (not streamed or shard_entry.size > 4 * 256)
    assert min(t.offset + t.length for t in manifest.tensors if t.shard) < shard_entry.size - 256
    shard = store / store_keys.shard_key("step-0000000001", shard_entry.name)
    good = shard.read_bytes()
    shard.write_bytes(good[:-1] + bytes([good[-1] ^ 0x01]))

    calls: list[str] = []
    for name in ("decode", "decode_into", "payload_method"):
        real = getattr(rebuild.codec, name)
        monkeypatch.setattr(
            rebuild.codec, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    assert not await sub.sync()
    assert "mismatch" in sub.status()["last_error"] and sub.current.step == 0
    assert calls == []  # refused on the shard's digests: not one payload was parsed
    shard.write_bytes(good)
    assert await sub.sync() and sub.current.step == 1 and calls  # the same path decodes a good shard
    assert_state_equal(engine.weights, steps[1])
    await sub.stop()
