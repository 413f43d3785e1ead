"""Publisher + rebuild: long chains with periodic bases, base triggers, and rejected stores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from delta_swap import store_keys
from delta_swap.chain import ChainReader
from delta_swap.errors import (
    ChainError,
    ChecksumMismatchError,
    ConfigError,
    CorruptDataError,
    FormatVersionError,
    PublishError,
    StoreError,
)
from delta_swap.manifest import snapshot_id_for_step
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.rebuild import rebuild
from delta_swap.stores import FileStore
from tests.support.chains import assert_state_equal, momentum_steps, record_host_copies, rl_steps


def _publish(store_dir, steps, **cfg) -> list[str]:
    with Publisher(str(store_dir), PublisherConfig(**cfg), files={"config.json": b'{"a": 1}'}) as pub:
        ids = [pub.publish(i, s) for i, s in enumerate(steps)]
    return ids


async def test_chain_of_twelve_steps_rebuilds_every_snapshot_bit_exact(tmp_path) -> None:
    steps = rl_steps(12)
    ids = _publish(tmp_path, steps, base_every=5)
    store = FileStore(tmp_path)
    manifests = await ChainReader(store).list()
    assert [m.snapshot_id for m in manifests] == ids
    assert [m.kind for m in manifests] == ["base" if i % 5 == 0 else "delta" for i in range(12)]
    for m in manifests:
        assert m.prev_snapshot_id == (None if m.kind == "base" else snapshot_id_for_step(m.step - 1))
        assert m.base_snapshot_id == snapshot_id_for_step(m.step - m.step % 5)
        if m.kind == "delta":
            assert m.payload_bytes < 0.2 * m.model_bytes
    for i, expected in enumerate(steps):
        manifest, state, path = await rebuild(store, ids[i])
        assert manifest.snapshot_id == ids[i] and path[0].kind == "base" and len(path) == i % 5 + 1
        assert_state_equal(state, expected)
    # The head names the newest snapshot; rebuild() without an id follows it.
    assert (await rebuild(store))[0].snapshot_id == ids[-1]


async def test_stores_of_every_earlier_format_version_still_rebuild(tmp_path) -> None:
    """Stores written before codec v2 (manifest format_version 1, DSC1 payloads), before predicted
    signs (2) and before split payloads (3) stay readable; new stores are written as format_version
    4, with DSC2 payloads that may predict signs and, for large tensors, come in parts."""
    from delta_swap.codec import CodecConfig

    steps = rl_steps(5)
    stores = {version: tmp_path / f"v{version}" for version in (1, 2, 3, 4)}
    ids = _publish(stores[1], steps, base_every=10, codec=CodecConfig(version=1))
    _publish(stores[2], steps, base_every=10, codec=CodecConfig(predict_signs=False))  # as format 2 wrote them
    _publish(stores[3], steps, base_every=10)  # these tensors are below the default part size: no parts
    _publish(stores[4], steps, base_every=10, codec=CodecConfig(part_elements=1000))  # every tensor in parts
    for sid in ids:
        for version in (1, 2, 3):
            _edit_manifest(stores[version], sid, lambda d, v=version: d.update(format_version=v))
    methods = set()
    for version, root in stores.items():
        magic = b"DSC1" if version == 1 else b"DSC2"
        for m in await ChainReader(FileStore(root)).list():
            assert m.format_version == version
            for shard in m.shards if m.kind == "delta" else ():
                data = (root / store_keys.shard_key(m.snapshot_id, shard.name)).read_bytes()
                offsets = [t.offset for t in m.tensors if t.shard == shard.name]
                assert offsets and all(data[o : o + 4] == magic for o in offsets)
                methods |= {(version, data[o + 4]) for o in offsets}
        for i, expected in enumerate(steps):
            assert_state_equal((await rebuild(FileStore(root), ids[i]))[1], expected)
    assert (3, 3) not in methods and (4, 3) in methods  # split payloads (method 3) in the new store only


async def test_the_publisher_fits_a_sign_model_once_per_part_and_refines_it_after(tmp_path, monkeypatch) -> None:
    """The publisher keeps each tensor's sign models, per part, from one step to the next: matrices
    whose steps keep their sign pattern get one new fit per part (the first delta), refinements of
    it after, and every snapshot still rebuilds bit-exact."""
    from delta_swap import codec_warm_up
    from delta_swap.codec import CodecConfig
    from delta_swap.codec.v2 import FLAG_SIGN_MODEL, sign_model, split_parts

    codec_warm_up.start_warm_up().join()  # its sample payloads fit models too: not during the test
    new_fits: list[tuple[int, int]] = []
    fit_new = sign_model._fit_new
    monkeypatch.setattr(sign_model, "_fit_new", lambda shape, *args: new_fits.append(shape) or fit_new(shape, *args))
    steps = momentum_steps(5, {"a.weight": (256, 512), "b.weight": (384, 512)})
    ids = _publish(tmp_path, steps, base_every=10, codec=CodecConfig(part_elements=1 << 16))
    assert new_fits == [(128, 512)] * 5  # a in 2 parts of 128 rows, b in 3; at the first delta only
    store = FileStore(tmp_path)
    for m in (await ChainReader(store).list())[1:]:
        data = (tmp_path / store_keys.shard_key(m.snapshot_id, m.shards[0].name)).read_bytes()
        for t in m.tensors:
            parts = split_parts(memoryview(data)[t.offset : t.offset + t.length])
            assert len(parts) == (2 if t.name == "a.weight" else 3)
            assert all(part[6] == FLAG_SIGN_MODEL for _, _, part in parts)
    for i, expected in enumerate(steps):
        assert_state_equal((await rebuild(store, ids[i]))[1], expected)


async def test_shape_change_and_large_delta_force_a_base(tmp_path) -> None:
    steps = rl_steps(4)
    steps[2] = {**steps[2], "extra.bias": torch.zeros(8, dtype=torch.bfloat16)}  # tensor set changes
    steps[3] = {k: v for k, v in steps[2].items()}
    for name in ("embed.weight", "lm_head.weight"):  # most of the model rewritten
        steps[3][name] = torch.randn(64, 32).to(torch.bfloat16)
    with Publisher(str(tmp_path), PublisherConfig(max_delta_fraction=0.4)) as pub:
        for i, s in enumerate(steps):
            pub.publish(i, s)
    kinds = [m.kind for m in await ChainReader(FileStore(tmp_path)).list()]
    assert kinds == ["base", "delta", "base", "base"]
    assert_state_equal((await rebuild(FileStore(tmp_path)))[1], steps[3])


async def test_publish_copies_tensors_so_training_can_continue(tmp_path) -> None:
    w = {"w": torch.ones(64, dtype=torch.bfloat16)}
    with Publisher(str(tmp_path)) as pub:
        pub.publish(0, w)
        w["w"] += 1  # the trainer mutates in place right after publishing
    state = (await rebuild(FileStore(tmp_path)))[1]
    assert torch.equal(state["w"].to_torch(), torch.ones(64, dtype=torch.bfloat16))


async def test_resume_continues_the_chain_from_the_store(tmp_path) -> None:
    steps = rl_steps(6)
    _publish(tmp_path, steps[:3], base_every=10)
    with Publisher(str(tmp_path), PublisherConfig(base_every=10)) as pub:
        for i in range(3, 6):
            pub.publish(i, steps[i])
    manifests = await ChainReader(FileStore(tmp_path)).list()
    assert [m.kind for m in manifests] == ["base"] + ["delta"] * 5
    assert_state_equal((await rebuild(FileStore(tmp_path)))[1], steps[5])


async def test_keep_bases_prunes_snapshots_no_server_needs(tmp_path) -> None:
    steps = rl_steps(11)
    ids = _publish(tmp_path, steps, base_every=3, keep_bases=2)
    store = FileStore(tmp_path)
    kept = [m.snapshot_id for m in await ChainReader(store).list()]
    assert kept == ids[6:]  # bases at 0, 3, 6, 9: everything before the second newest base is gone
    assert not [p for p in (tmp_path / "snapshots").iterdir() if p.name not in kept]  # no leftovers
    for i in range(6, 11):
        assert_state_equal((await rebuild(store, ids[i]))[1], steps[i])


def test_errors_surface_instead_of_being_swallowed(tmp_path) -> None:
    steps = rl_steps(2)
    _publish(tmp_path, steps[:2])
    pub = Publisher(str(tmp_path))
    pub.publish(1, steps[1])  # step 1 already in the store: fails in the background
    with pytest.raises(PublishError, match="cannot publish step 1"):
        pub.flush()
    pub.close()
    with pytest.raises(ConfigError):
        Publisher(str(tmp_path), PublisherConfig(rank=2, world_size=2))


def test_publishing_a_step_not_after_the_last_is_a_config_error(tmp_path) -> None:
    with Publisher(str(tmp_path)) as pub:
        pub.publish(5, rl_steps(1)[0])
        with pytest.raises(ConfigError, match="not after"):
            pub.publish(5, rl_steps(1)[0])


def test_a_step_flushed_holds_one_copy_of_the_model(tmp_path, monkeypatch) -> None:
    """Once step N is flushed the publisher holds step N's host copy (the next delta's reference)
    and no earlier one: the step before is the undo of the step in flight only while it is in
    flight. Holding it until the next publish made a trainer's peak three copies instead of two."""
    alive_copies = record_host_copies(monkeypatch)
    steps = rl_steps(3)
    with Publisher(str(tmp_path), PublisherConfig(base_every=10, warm_up=False)) as pub:
        for step, state in enumerate(steps):
            pub.publish(step, state)
            pub.flush()
            alive = alive_copies()
            assert alive == [step], f"after flushing step {step} the copies of steps {alive} are alive"


# ------------------------------------------------------------------ rejected stores


@pytest.fixture
def chain(tmp_path):
    steps = rl_steps(4)
    ids = _publish(tmp_path, steps, base_every=100)
    return tmp_path, ids, steps


async def _shard_path(root, snapshot_id):
    store = FileStore(root)
    manifest = await ChainReader(store).manifest(snapshot_id)
    return root / store_keys.shard_key(snapshot_id, manifest.shards[0].name)


async def test_truncated_shard_is_rejected(chain) -> None:
    root, ids, _ = chain
    path = await _shard_path(root, ids[2])
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CorruptDataError, match="bytes, expected"):
        await rebuild(FileStore(root), ids[3])


async def test_flipped_bit_in_a_shard_is_rejected(chain) -> None:
    root, ids, _ = chain
    for sid in (ids[0], ids[2]):
        path = await _shard_path(root, sid)
        original = path.read_bytes()
        data = bytearray(original)
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
        with pytest.raises(ChecksumMismatchError):
            await rebuild(FileStore(root), ids[3])
        path.write_bytes(original)
    await rebuild(FileStore(root), ids[3])


async def test_a_delta_shard_without_its_magic_is_corrupt_data_fetched_whole_or_streamed(tmp_path, monkeypatch) -> None:
    """A delta shard whose digests match the manifest but which does not start with DSWPSHD1 is
    refused once verified, before the codec reads it, by both readers (whole and in pieces)."""
    from delta_swap import publisher
    from delta_swap import rebuild as rebuild_module
    from delta_swap.rebuild import replay

    monkeypatch.setattr(publisher, "DELTA_SHARD_MAGIC", b"NOTMAGIC")  # same length: offsets unchanged
    ids = _publish(tmp_path, rl_steps(2))
    reader = ChainReader(FileStore(tmp_path))
    path = await reader.path_to(ids[1])
    assert [m.kind for m in path] == ["base", "delta"]
    with pytest.raises(CorruptDataError, match="does not start with DSWPSHD1") as whole:
        await rebuild(FileStore(tmp_path), ids[1])
    base = await replay(reader, path[:1], None)
    monkeypatch.setattr(rebuild_module, "STREAM_PIECE_BYTES", 5)  # streamed, the magic split over two pieces
    with pytest.raises(CorruptDataError, match="does not start with DSWPSHD1") as streamed:
        await replay(reader, path[1:], base, out=base)
    assert whole.type is streamed.type is CorruptDataError  # not a checksum mismatch: the digests match


def _edit_manifest(root, snapshot_id, edit) -> None:
    path = root / store_keys.manifest_key(snapshot_id)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


async def test_tampered_manifest_checksum_is_caught(chain) -> None:
    """A consistent-looking shard whose tensor differs from the publisher's checksum."""
    root, ids, _ = chain

    def edit(doc):
        doc["tensors"][1]["checksum"] = "xxh3_128:" + "0" * 32

    _edit_manifest(root, ids[1], edit)
    with pytest.raises(ChecksumMismatchError):
        await rebuild(FileStore(root), ids[3])


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda d: d.update(format_version=99), FormatVersionError, "format version 99"),
        (lambda d: d.update(format_version=5), FormatVersionError, "format version 5"),
        (lambda d: d.update(format_version=True), FormatVersionError, "format version True"),
        (lambda d: d["tensors"][0].update(shard="../../etc/passwd"), CorruptDataError, "invalid shard"),
        (lambda d: d["shards"][0].update(name="/abs/path"), CorruptDataError, "invalid shard"),
        (lambda d: d["tensors"][0].update(shape=[2**40, 2**40]), CorruptDataError, "claims"),
        (lambda d: d["tensors"][0].update(shape=[-1]), CorruptDataError, "invalid dimension"),
        (lambda d: d["tensors"][0].update(length=2**50), CorruptDataError, "runs past"),
        (lambda d: d["tensors"][0].update(dtype="Q99"), CorruptDataError, "unknown dtype"),
        (lambda d: d.update(prev_snapshot_id="../x"), CorruptDataError, "invalid snapshot id"),
        (lambda d: d.update(kind="weird"), CorruptDataError, "unknown snapshot kind"),
    ],
)
async def test_malformed_manifests_are_rejected(chain, edit, error, match) -> None:
    root, ids, _ = chain
    _edit_manifest(root, ids[2], edit)
    with pytest.raises(error, match=match):
        await rebuild(FileStore(root), ids[3])


async def test_missing_link_and_out_of_order_deltas_are_chain_errors(chain) -> None:
    root, ids, _ = chain
    store = FileStore(root)
    (root / store_keys.manifest_key(ids[1])).unlink()
    with pytest.raises(ChainError, match="not in the store"):
        await rebuild(store, ids[3])
    _edit_manifest(root, ids[3], lambda d: d.update(step=1))
    with pytest.raises(ChainError, match="follows a later step"):
        await rebuild(FileStore(root), ids[3])


async def test_delta_applied_to_the_wrong_state_fails_checksums(chain) -> None:
    """Pointing a delta at another predecessor (a replayed or reordered delta) is caught: by the
    checksums, or already by codec v2's decoder (its classes depend on the old tensor)."""
    root, ids, steps = chain
    _edit_manifest(root, ids[3], lambda d: d.update(prev_snapshot_id=ids[1]))
    with pytest.raises((CorruptDataError, ChainError)):
        await rebuild(FileStore(root), ids[3])


async def test_base_shards_are_plain_safetensors(chain) -> None:
    from safetensors.torch import load_file

    root, ids, steps = chain
    loaded = load_file(str(await _shard_path(root, ids[0])))
    assert set(loaded) == set(steps[0])
    for k, v in steps[0].items():
        assert torch.equal(loaded[k], v)
    manifest = await ChainReader(FileStore(root)).manifest(ids[0])
    raw = (await _shard_path(root, ids[0])).read_bytes()
    for t in manifest.tensors:  # manifest offsets address the tensor bytes directly
        assert np.array_equal(
            np.frombuffer(raw[t.offset : t.offset + t.length], np.uint8),
            steps[0][t.name].view(torch.uint8).reshape(-1).numpy(),
        )


def test_a_bad_store_url_fails_at_construction() -> None:
    with pytest.raises(StoreError, match="unsupported store URL"):
        Publisher("gopher://nowhere/x")


def test_publisher_config_with_fields_names_an_unknown_field() -> None:
    assert PublisherConfig().with_fields({"keep_bases": 2}).keep_bases == 2
    with pytest.raises(ConfigError, match=r"^engine_kwargs\.delta_swap\.publisher_options: .*keep_base"):
        PublisherConfig().with_fields({"keep_base": 2}, "engine_kwargs.delta_swap.publisher_options")
