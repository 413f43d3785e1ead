"""Transactional behaviour of ``SglangAdapter`` driven by the core's ``apply_update``, against a
scripted tokenizer manager.

Run with the SGLang environment's interpreter (tests/test_sglang_engine.py does): it uses SGLang's
real request types, RW lock and safe unpickler, but no server, so failures SGLang cannot be made
to produce on demand (a refused load, a request that will not finish) can be played out. Prints
one line per scenario and exits non-zero on the first failed check.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.aio_rwlock import RWLock

from delta_swap.checksum import checksum
from delta_swap.engine_adapter import WeightUpdate
from delta_swap.errors import DeltaSwapError, EngineError, IncompatibleSnapshotError
from delta_swap.served_model import ServedModel
from delta_swap.settings import DrainPolicy, Settings, VerifySwaps
from delta_swap.swap import apply_update
from delta_swap.tensors import HostTensor
from sglang_delta_plugin.adapter import SglangAdapter

LAYOUT = {"a.weight": ("BF16", (4, 8)), "b.weight": ("F32", (3,))}


def tensor(dtype: str, shape: tuple[int, ...], fill: int) -> HostTensor:
    size = {"BF16": 2, "F32": 4}[dtype] * int(np.prod(shape))
    return HostTensor(dtype, shape, np.full(size, fill, dtype=np.uint8))


def state(fill: int) -> dict[str, HostTensor]:
    return {name: tensor(dtype, shape, fill) for name, (dtype, shape) in LAYOUT.items()}


def update(
    sid: str, new: dict[str, HostTensor], previous: dict[str, HostTensor] | None, names: tuple[str, ...] | None = None
) -> WeightUpdate:
    return WeightUpdate(
        version=sid,
        state=new,
        names=tuple(sorted(new)) if names is None else names,
        previous=previous,
        checksums={n: checksum(t.data) for n, t in new.items()},
    )


class FakeTokenizerManager:
    """The slice of SGLang's TokenizerManager the adapter uses, with scripted answers."""

    def __init__(self, update_results: list[bool]) -> None:
        self.model_update_lock = RWLock()
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.version = "v0"
        self.update_results = list(update_results)
        self.calls: list[str] = []
        self.loaded: list[dict[str, bytes]] = []
        self.flushes: list[bool] = []
        self.during_update = None  # an optional coroutine function, awaited inside each weight update

    def config_value(self, name: str) -> str:
        assert name == "weight_version"
        return self.version

    async def pause_generation(self, obj) -> None:
        self.calls.append(f"pause:{obj.mode}")
        self.is_pause = True

    async def continue_generation(self, obj) -> None:
        self.calls.append("continue")
        self.is_pause = False

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.calls.append("abort_all" if abort_all else f"abort:{rid}")

    async def begin_weight_update(self, obj, request):
        assert self.is_pause, "weights must only move while paused"
        self.calls.append("begin")
        return True, ""

    async def end_weight_update(self, obj, request):
        self.calls.append("end")
        return True, ""

    async def update_weights_from_tensor(self, obj, request):
        assert obj.load_format == "flattened_bucket"
        self.flushes.append(obj.flush_cache)
        per_rank = []
        for payload in obj.serialized_named_tensors:  # one per TP rank, each read with SGLang's safe unpickler
            bucket = MultiprocessingSerializer.deserialize(payload)
            flat = bucket["flattened_tensor"]
            per_rank.append({m.name: flat[m.start_idx : m.end_idx].numpy().tobytes() for m in bucket["metadata"]})
        assert all(r == per_rank[0] for r in per_rank)
        self.ranks = len(per_rank)
        self.loaded.append(per_rank[0])
        self.calls.append(f"update:{obj.weight_version}")
        if self.during_update is not None:
            await self.during_update()
        ok = self.update_results.pop(0)
        if ok:
            self.version = obj.weight_version
        return ok, "ok" if ok else "refused by the scripted engine"

    async def update_weight_version(self, obj) -> None:
        self.calls.append(f"version:{obj.new_version}")
        self.version = obj.new_version


async def swap(
    tm: FakeTokenizerManager, drain: str, up: WeightUpdate, timeout: float = 30.0, tp_size: int = 1
) -> dict[str, float]:
    """One update through the core's skeleton and the real adapter."""
    # No read-back: this scripted engine has no model (the real scheduler's is in test_sglang_exactness).
    settings = Settings(
        store="file:///unused", drain=DrainPolicy(drain), drain_timeout=timeout, verify_swaps=VerifySwaps.NEVER
    )
    adapter = SglangAdapter(tm, ServedModel("/nonexistent", LAYOUT), settings, tp_size=tp_size)
    return await apply_update(adapter, up, settings)


def check(cond: bool, what: str) -> None:
    if not cond:
        print(f"FAIL: {what}")
        sys.exit(1)


async def main() -> None:
    old, new = state(1), state(2)

    # A swap moves exactly the staged bytes to every TP rank, paused, and resumes.
    tm = FakeTokenizerManager([True])
    timings = await swap(tm, "keep", update("s1", new, old), tp_size=2)
    check(tm.calls == ["pause:in_place", "begin", "update:s1", "end", "continue"], f"keep swap calls {tm.calls}")
    check(tm.flushes == [False], "keep mode leaves the radix cache to the version salt")
    check(tm.loaded[0] == {n: t.data.tobytes() for n, t in new.items()}, "bytes arrive unchanged")
    check(tm.ranks == 2, "one payload per tensor-parallel rank")
    check({"stage", "pause", "swap", "resume"} <= set(timings), f"timings {timings}")
    print("ok: swap")

    # abort mode: new requests are held and the running one is aborted before the pause; a refused
    # load then puts the previous tensors back under the previous version, and generation resumes.
    tm = FakeTokenizerManager([False, True])
    await tm.model_update_lock.acquire_reader()  # a request in flight
    held: list[bool] = []

    async def end_when_aborted() -> None:
        while "abort_all" not in tm.calls:
            await asyncio.sleep(0.01)
        held.append(tm.is_pause)
        await tm.model_update_lock.release_reader()

    releaser = asyncio.create_task(end_when_aborted())
    try:
        await swap(tm, "abort", update("s2", new, old))
        check(False, "a refused load must raise")
    except EngineError as exc:
        check("refused by the scripted engine" in str(exc), str(exc))
    try:
        await asyncio.wait_for(releaser, 5)
    except asyncio.TimeoutError:
        check(False, f"the running request was never aborted: {tm.calls}")
    check(held == [True], "new requests are held while the running ones are aborted")
    check(
        tm.calls
        == ["abort_all", "pause:retract", "begin", "update:s2", "end", "begin", "update:v0", "end", "continue"],
        f"rollback calls {tm.calls}",
    )
    check(tm.flushes == [True, True], "abort mode flushes the radix cache")
    check(tm.loaded[1] == {n: t.data.tobytes() for n, t in old.items()}, "rollback loads the previous bytes")
    check(tm.version == "v0" and not tm.is_pause, "previous version, not paused")
    print("ok: rollback")

    # A snapshot that does not fit never reaches the engine.
    tm = FakeTokenizerManager([])
    bad = {**new, "b.weight": tensor("F32", (4,), 2), "c.bias": tensor("F32", (1,), 2)}
    try:
        await swap(tm, "wait", update("s3", bad, old))
        check(False, "a misfit must raise")
    except IncompatibleSnapshotError as exc:
        check("b.weight" in str(exc) and "c.bias" in str(exc), str(exc))
    check(tm.calls == [] and not tm.model_update_lock._writer_active, f"misfit touched the engine: {tm.calls}")
    print("ok: misfit")

    # wait: in-flight requests hold the reader side; after the timeout they are aborted, the swap
    # runs with the writer lock held, and the lock is released afterwards.
    tm = FakeTokenizerManager([True])
    await tm.model_update_lock.acquire_reader()  # a request in flight

    async def finish_when_aborted() -> None:
        while "abort_all" not in tm.calls:
            await asyncio.sleep(0.05)
        await tm.model_update_lock.release_reader()

    releaser = asyncio.create_task(finish_when_aborted())
    await swap(tm, "wait", update("s4", new, old), timeout=0.3)
    await releaser
    check(tm.calls[0] == "abort_all" and tm.calls[-1] == "continue" and "update:s4" in tm.calls, f"{tm.calls}")
    check(not tm.model_update_lock._writer_active and not tm.is_pause, "writer lock released, resumed")
    print("ok: wait timeout")

    # wait: a request that does not end when aborted (its client stopped reading) does not hold the
    # update forever; new requests queued meanwhile run once generation resumes.
    tm = FakeTokenizerManager([True])
    lock = tm.model_update_lock
    await lock.acquire_reader()  # a request that never ends
    swapping = asyncio.create_task(swap(tm, "wait", update("s6", new, old), timeout=0.2))
    while lock._waiting_writers == 0:  # the drain waits for the writer lock
        await asyncio.sleep(0.01)
    queued = asyncio.create_task(lock.acquire_reader())  # a new request, held behind the drain
    deadline = asyncio.get_running_loop().time() + 5
    while not swapping.done():
        check(
            asyncio.get_running_loop().time() < deadline, f"the update waited for a request that never ends: {tm.calls}"
        )
        check(not queued.done() or "continue" in tm.calls, f"a new request ran during the update: {tm.calls}")
        await asyncio.sleep(0.005)
    await swapping
    check("abort_all" in tm.calls and tm.calls[-4:] == ["begin", "update:s6", "end", "continue"], f"{tm.calls}")
    try:
        await asyncio.wait_for(queued, 5)
    except asyncio.TimeoutError:
        check(False, "a request queued behind the withdrawn writer stays blocked")
    check(not lock._writer_active and lock._waiting_writers == 0, "lock left clean")
    print("ok: wait gives up on a stuck request")

    # ... and when that request ends during the swap, the writer lock it then gets is released at
    # resume.
    tm = FakeTokenizerManager([True])
    lock = tm.model_update_lock
    await lock.acquire_reader()

    async def end_during_the_swap() -> None:  # the stuck request ends; the pending writer gets the lock
        await lock.release_reader()
        while not lock._writer_active:
            await asyncio.sleep(0.005)

    tm.during_update = end_during_the_swap
    await asyncio.wait_for(swap(tm, "wait", update("s7", new, old), timeout=0.2), 5)
    check(
        tm.calls[-1] == "continue" and not lock._writer_active and lock._waiting_writers == 0,
        f"lock left held: {tm.calls}",
    )
    await asyncio.wait_for(lock.acquire_reader(), 5)  # a new request runs
    print("ok: wait keeps the lock granted mid-swap")

    # Nothing changed: only the version moves.
    tm = FakeTokenizerManager([])
    await swap(tm, "wait", update("s5", old, old, names=()))
    check(tm.calls == ["pause:retract", "version:s5", "continue"], f"{tm.calls}")
    print("ok: version only")

    # SGLang's AMX backend packed some modules (a real AMX build; faked here): the scheduler's
    # hook says so, and the adapter refuses every update before a byte is fetched.
    await amx_packed_weights_are_refused()
    print("ok: amx refused")


async def amx_packed_weights_are_refused() -> None:
    import os
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from sglang_delta_plugin import engine_ops

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))
    check(engine_ops.amx_packed(scheduler) is None, "plain weights are not refused")
    model[1].use_intel_amx_backend = True
    with tempfile.TemporaryDirectory() as tmp:
        layout = Path(tmp) / "layout.json"
        os.environ[engine_ops.LAYOUT_FILE_ENV] = str(layout)
        server_args = SimpleNamespace(tp_size=1, model_path=tmp)
        engine_ops.describe_after_init(None, scheduler, server_args)
        tm = FakeTokenizerManager([])
        adapter = SglangAdapter(tm, ServedModel("/nonexistent", LAYOUT), Settings(store="file:///unused"))
        try:
            await adapter.destination({})
            check(False, "an update into AMX-packed weights must be refused")
        except EngineError as exc:
            check("AMX backend packed the weights of 1 modules (1...)" in str(exc), str(exc))
        described = await adapter.describe()
        check(described["swap_path"] == "refused" and "re-packs" in described["swap_path_reason"], f"{described}")
        check(tm.calls == [], f"a refused update touched the engine: {tm.calls}")
        del os.environ[engine_ops.LAYOUT_FILE_ENV]


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except DeltaSwapError as exc:
        print(f"FAIL: {exc!r}")
        sys.exit(1)
