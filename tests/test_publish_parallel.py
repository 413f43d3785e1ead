"""Parallel encoding (``PublisherConfig.encode_threads``) and the head cache (``head_cache``):
the same snapshots byte for byte on any number of threads, and a cache that can only save a
rebuild, never change what is published."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from delta_swap import head_cache, store_keys
from delta_swap.chain import ChainReader
from delta_swap.codec import CodecConfig
from delta_swap.errors import ConfigError, PublishError, StoreError
from delta_swap.publisher import Publisher, PublisherConfig, allowed_cores
from delta_swap.rebuild import rebuild
from delta_swap.safetensors_io import parse_header
from delta_swap.stores import FileStore
from tests.support.chains import assert_state_equal, momentum_steps, record_host_copies, rl_steps

#: More tensors than twice the threads below, of several sizes, so results arrive out of order.
SHAPES = {f"layers.{i}.w": (16 + 8 * (i % 5), 64) for i in range(14)} | {"norm.weight": (64,)}
RUN = "run-parallel-test"


def _snapshot_files(root: Path) -> dict[str, bytes]:
    """Every object of every snapshot (manifests without their creation time)."""
    out = {}
    for path in sorted((root / "snapshots").rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if path.name == "manifest.json":
                doc = json.loads(data)
                doc.pop("created_at")
                data = json.dumps(doc, sort_keys=True).encode()
            out[str(path.relative_to(root))] = data
    return out


def _publish(root: Path, steps, **cfg) -> None:
    with Publisher(str(root), PublisherConfig(run_id=RUN, **cfg)) as pub:
        for i, state in enumerate(steps):
            pub.publish(i, state)


@pytest.mark.parametrize("fraction", [0.5, 0.02])  # 0.02: some deltas are too large and become bases
def test_any_number_of_threads_writes_the_same_snapshots(tmp_path, fraction) -> None:
    steps = rl_steps(5, shapes=SHAPES, lr=1e-4)
    steps[3]["norm.weight"] = steps[2]["norm.weight"].clone()  # an unchanged tensor: SAME
    trees = {}
    for threads in (1, 3):
        _publish(tmp_path / str(threads), steps, base_every=4, encode_threads=threads, max_delta_fraction=fraction)
        trees[threads] = _snapshot_files(tmp_path / str(threads))
    assert trees[1] == trees[3] and len(trees[1]) >= 10
    kinds = [json.loads(v)["kind"] for k, v in trees[1].items() if k.endswith("manifest.json")]
    assert ("delta" in kinds) == (fraction == 0.5) and kinds[0] == "base"


async def test_parallel_chain_rebuilds_bit_exact_and_leaves_no_thread(tmp_path) -> None:
    steps = rl_steps(4, shapes=SHAPES)
    _publish(tmp_path, steps, encode_threads=4)
    assert not [t for t in threading.enumerate() if t.name.startswith("delta-swap-encode")]
    for i, expected in enumerate(steps):
        assert_state_equal((await rebuild(FileStore(tmp_path), f"step-{i:010d}"))[1], expected)


async def test_large_tensors_encode_in_parts_on_threads_for_the_same_snapshots(tmp_path) -> None:
    """Tensors of at least twice ``part_elements`` are coded in parts, which the threads share: the
    same snapshots on 1 and 3 threads, split payloads (method 3) in them, a tensor that did not
    change stays SAME, a part that did not change inside one that did is still coded, and every
    step rebuilds bit-exact."""
    shapes = {"embed.weight": (96, 64), "layers.0.w": (48, 64), "frozen.weight": (64, 64), "norm.weight": (64,)}
    steps = rl_steps(4, shapes=shapes, lr=1e-4)
    for state in steps[1:]:
        state["frozen.weight"] = steps[0]["frozen.weight"].clone()  # never changes: SAME, not coded
        state["embed.weight"][:48] = steps[0]["embed.weight"][:48]  # its first parts never change
    codec_config = CodecConfig(part_elements=1024)  # embed 6 parts, layers.0.w 3, norm.weight 1
    trees = {}
    for threads in (1, 3):
        _publish(tmp_path / str(threads), steps, encode_threads=threads, codec=codec_config)
        trees[threads] = _snapshot_files(tmp_path / str(threads))
    assert trees[1] == trees[3]
    store = FileStore(tmp_path / "3")
    deltas = [m for m in await ChainReader(store).list() if m.kind == "delta"]
    assert len(deltas) == 3
    for m in deltas:
        by_name = {t.name: t for t in m.tensors}
        assert by_name["frozen.weight"].encoding == "same"
        shard = (tmp_path / "3" / store_keys.shard_key(m.snapshot_id, m.shards[0].name)).read_bytes()
        methods = {name: shard[by_name[name].offset + 4] for name in ("embed.weight", "layers.0.w", "norm.weight")}
        assert methods == {"embed.weight": 3, "layers.0.w": 3, "norm.weight": 1}, methods
    for i, expected in enumerate(steps):
        assert_state_equal((await rebuild(store, f"step-{i:010d}"))[1], expected)


def test_encode_threads_default_and_bounds(tmp_path) -> None:
    assert allowed_cores() >= 1
    with Publisher(str(tmp_path)) as pub:
        assert pub.encode_threads == allowed_cores()
    with Publisher(str(tmp_path), PublisherConfig(encode_threads=1)) as pub:
        assert pub.encode_threads == 1
    with pytest.raises(ConfigError, match="encode_threads"):
        Publisher(str(tmp_path), PublisherConfig(encode_threads=0))


# ---------------------------------------------------------------------- the head cache


def _cache_file(cache: Path, store: Path) -> Path:
    return head_cache.cache_file(cache, FileStore(store).public_url, RUN, 0)


def _no_rebuild(monkeypatch) -> None:
    async def refuse(*args, **kwargs):
        raise AssertionError("the head was rebuilt from the store")

    monkeypatch.setattr("delta_swap.publisher.rebuild", refuse)


async def test_a_cached_head_replaces_the_rebuild(tmp_path, monkeypatch) -> None:
    steps = rl_steps(5)
    store, cache = tmp_path / "store", tmp_path / "cache"
    _publish(store, steps[:3], base_every=10, head_cache=str(cache))
    assert _cache_file(cache, store).is_file()
    _no_rebuild(monkeypatch)
    for i in (3, 4):  # a process per step, as ``delta-swap publish`` is
        _publish_one(store, i, steps[i], head_cache=str(cache), base_every=10)
    manifests = await ChainReader(FileStore(store)).list()
    assert [m.kind for m in manifests] == ["base"] + ["delta"] * 4
    for i, expected in enumerate(steps):
        assert_state_equal((await rebuild(FileStore(store), f"step-{i:010d}"))[1], expected)


def _publish_one(store: Path, step: int, state, **cfg) -> None:
    with Publisher(str(store), PublisherConfig(run_id=RUN, **cfg)) as pub:
        pub.publish(step, state)


def _tamper(path: Path, name: str) -> None:
    data = bytearray(path.read_bytes())
    _, _, offset, length = parse_header(bytes(data[: 1 << 16]), len(data))[name]
    data[offset + length // 2] ^= 0x01  # one bit of one element: a plausible but wrong weight
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["tampered", "missing", "stale", "garbage"])
async def test_a_bad_cache_is_logged_and_the_head_rebuilt(tmp_path, caplog, damage) -> None:
    steps = rl_steps(4)
    store, cache = tmp_path / "store", tmp_path / "cache"
    _publish(store, steps[:2], base_every=10, head_cache=str(cache))
    path = _cache_file(cache, store)
    if damage == "tampered":
        _tamper(path, "layers.0.q.weight")
    elif damage == "missing":
        path.unlink()
    elif damage == "stale":  # the cache of an older step of the run
        head_cache.save(path, _host(steps[0]), "step-0000000000")
    else:
        path.write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="delta_swap"):
        _publish_one(store, 2, steps[2], head_cache=str(cache), base_every=10)
    assert "rebuilding step-0000000001 from the store" in caplog.text
    _publish_one(store, 3, steps[3], head_cache=str(cache), base_every=10)  # the cache is good again
    manifests = await ChainReader(FileStore(store)).list()
    assert [m.kind for m in manifests] == ["base", "delta", "delta", "delta"]
    for i, expected in enumerate(steps):
        assert_state_equal((await rebuild(FileStore(store), f"step-{i:010d}"))[1], expected)


async def test_a_process_per_step_keeps_the_encoders_memory_beside_its_head_cache(
    tmp_path, monkeypatch, caplog
) -> None:
    """The sign models a publish fitted are kept beside the head cache, so the next process's
    fits start from them as a long-lived publisher's do; a damaged file is logged and ignored."""
    from delta_swap import codec_warm_up
    from delta_swap.codec.v2 import sign_model

    codec_warm_up.start_warm_up().join()  # its sample payloads fit models too: not during the test
    new_fits: list[tuple[int, int]] = []
    fit_new = sign_model._fit_new
    monkeypatch.setattr(sign_model, "_fit_new", lambda shape, *args: new_fits.append(shape) or fit_new(shape, *args))
    steps = momentum_steps(5, {"layers.0.w": (256, 512)})
    store, cache = tmp_path / "store", tmp_path / "cache"
    _publish(store, steps[:2], base_every=10, head_cache=str(cache))
    memory_file = head_cache.memory_file(_cache_file(cache, store))
    assert new_fits == [(256, 512)] and memory_file.is_file()
    _publish_one(store, 2, steps[2], head_cache=str(cache), base_every=10)
    assert new_fits == [(256, 512)]  # the second process refined the first one's model
    memory_file.write_bytes(b"not an encoder memory")
    with caplog.at_level(logging.WARNING, logger="delta_swap"):
        _publish_one(store, 3, steps[3], head_cache=str(cache), base_every=10)
    assert "ignoring the encoder memory" in caplog.text and len(new_fits) == 2
    _publish_one(store, 4, steps[4], head_cache=str(cache), base_every=10)
    assert len(new_fits) == 2
    manifests = await ChainReader(FileStore(store)).list()
    assert [m.kind for m in manifests] == ["base"] + ["delta"] * 4
    for i, expected in enumerate(steps):
        assert_state_equal((await rebuild(FileStore(store), f"step-{i:010d}"))[1], expected)


def _host(state: dict[str, torch.Tensor]):
    from delta_swap.tensors import state_to_host

    return state_to_host(state)


def test_every_codec_kernel_releases_the_gil() -> None:
    """The publisher encodes (and servers decode) tensors on threads: that is parallel only while
    every numba kernel of codec v2 runs with ``nogil=True``."""
    import importlib
    import pkgutil

    from numba.core.registry import CPUDispatcher

    import delta_swap.codec.v2 as v2

    kernels = []
    for info in pkgutil.iter_modules(v2.__path__):
        module = importlib.import_module(f"{v2.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == module.__name__:
                kernels.append((f"{info.name}.{name}", obj.targetoptions.get("nogil")))
    assert len(kernels) > 20 and [k for k, nogil in kernels if not nogil] == []


def test_a_new_run_replaces_the_cache_of_the_old_one(tmp_path) -> None:
    steps = rl_steps(2)
    store, cache = tmp_path / "store", tmp_path / "cache"
    _publish(store, steps[:1], head_cache=str(cache))
    assert _cache_file(cache, store).is_file()
    with Publisher(str(store), PublisherConfig(run_id="run-next", head_cache=str(cache))) as pub:
        pub.publish(1, steps[1])
    assert [p.name for p in _cache_file(cache, store).parent.parent.iterdir()] == ["run-next"]


# ---------------------------------------------------------------------- upload overlapping the encode


class _SlowShards(FileStore):
    """A file store whose shard uploads take a while (and may fail once, for one snapshot)."""

    def __init__(self, root, fail: str | None = None) -> None:
        super().__init__(root)
        self.uploading = 0
        self.fail = fail

    async def put(self, key, data) -> None:
        if "/shard-" not in key:
            return await super().put(key, data)
        self.uploading += 1
        try:
            await asyncio.sleep(0.3)
            if self.fail and f"/{self.fail}/" in key:
                self.fail = None
                raise StoreError(f"refused {key}")
            await super().put(key, data)
        finally:
            self.uploading -= 1


async def test_the_next_step_encodes_while_a_step_uploads(tmp_path) -> None:
    steps = rl_steps(5, shapes=SHAPES)
    store = _SlowShards(tmp_path)
    encoded_meanwhile = []
    pub = Publisher(
        store, PublisherConfig(run_id=RUN, max_pending=4), progress=lambda n: encoded_meanwhile.append(store.uploading)
    )
    with pub:
        for i, state in enumerate(steps):
            pub.publish(i, state)
    assert any(encoded_meanwhile)  # some tensors were encoded while a shard was uploading
    assert pub.published == [f"step-{i:010d}" for i in range(5)]
    manifests = await ChainReader(FileStore(tmp_path)).list()
    assert [m.kind for m in manifests] == ["base"] + ["delta"] * 4
    for i, expected in enumerate(steps):
        assert_state_equal((await rebuild(FileStore(tmp_path), f"step-{i:010d}"))[1], expected)


async def test_a_failed_upload_drops_the_step_encoded_meanwhile_and_the_chain_goes_on(tmp_path) -> None:
    steps = rl_steps(6, shapes=SHAPES)
    store = _SlowShards(tmp_path, fail="step-0000000002")
    pub = Publisher(store, PublisherConfig(run_id=RUN, max_pending=4))
    for i in range(4):
        pub.publish(i, steps[i])
    with pytest.raises(PublishError, match="refused"):
        pub.flush()
    pub.publish(4, steps[4])  # a base: step 1's weights were not kept for the failure
    pub.publish(5, steps[5])  # and the chain goes on from it
    pub.close()
    manifests = await ChainReader(FileStore(tmp_path)).list()
    assert [m.snapshot_id for m in manifests] == [f"step-{i:010d}" for i in (0, 1, 4, 5)]
    assert [m.kind for m in manifests] == ["base", "delta", "base", "delta"]
    assert manifests[-1].prev_snapshot_id == "step-0000000004"
    for i in (4, 5):
        assert_state_equal((await rebuild(FileStore(tmp_path), f"step-{i:010d}"))[1], steps[i])


def test_a_step_in_flight_keeps_no_copy_of_the_step_before_it(tmp_path, monkeypatch) -> None:
    """While step N uploads and step N+1 encodes against it, the publisher holds the host copies
    of N and N+1 only: N-1's (for a failure of N, which a base repairs too) would be a third."""
    store = _SlowShards(tmp_path)
    seen: list[list[int]] = []

    def progress(_: int) -> None:
        if not store.uploading:  # step 1's encode: slow enough for step 2 to queue behind it
            time.sleep(0.02)
            return
        seen.append(alive_copies())

    alive_copies = record_host_copies(monkeypatch)
    steps = rl_steps(3, shapes=SHAPES)
    with Publisher(store, PublisherConfig(run_id=RUN, max_pending=4, base_every=10), progress=progress) as pub:
        pub.publish(0, steps[0])
        pub.flush()
        pub.publish(1, steps[1])
        pub.publish(2, steps[2])  # encoded while step 1 uploads
    assert seen, "step 2 was not encoded while step 1 uploaded"
    assert all(alive == [1, 2] for alive in seen), seen
