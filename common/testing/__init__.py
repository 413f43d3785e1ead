"""A test double for people writing an engine adapter or testing code around the subscriber.

:class:`RecordingAdapter` is a complete :class:`~delta_swap.engine_adapter.EngineAdapter` with no
engine behind it: it keeps the tensors it is given as an engine would, records every call, and
can be told to fail the next swap. With ``arena_dir`` it works as an engine that switches its
weights by reference: updates are decoded into its spare :class:`~delta_swap.arena.Arena` and a
swap only flips which arena is live. Run a real :class:`~delta_swap.subscriber.Subscriber` against
it to test publishing code, or read it as the smallest working adapter::

    adapter = RecordingAdapter()
    subscriber = Subscriber(Settings(store="file:///tmp/store"), adapter)
    await subscriber.sync()
    assert adapter.version == subscriber.current.snapshot_id
"""

from __future__ import annotations

from typing import Any

from ..arena import ArenaLayout, ArenaPair
from ..engine_adapter import EngineAdapter, WeightUpdate
from ..errors import EngineError
from ..settings import DrainPolicy
from ..tensors import HostTensor, StateDict, TensorSpecs


class RecordingAdapter(EngineAdapter):
    """Holds the tensors it was given, as an engine would; ``fail_next_swap`` makes the next
    swap fail half way (after loading the first tensor), as a real engine can."""

    name = "recording"

    def __init__(self, arena_dir: str | None = None) -> None:
        self.weights: dict[str, HostTensor] = {}
        self.version: str | None = None
        self.updates: list[WeightUpdate] = []
        self.calls: list[str] = []
        self.paused = False
        self.fail_next_swap = False
        self.arena_dir = arena_dir
        self.arenas: ArenaPair | None = None

    async def destination(self, specs: TensorSpecs) -> StateDict | None:
        if self.arena_dir is None:
            return None
        if self.arenas is None:  # one slot per tensor: this "engine" fuses nothing
            layout = ArenaLayout.build(
                [(n, d, s) for n, (d, s) in sorted(specs.items())], {n: (n, 0, d, s) for n, (d, s) in specs.items()}
            )
            self.arenas = ArenaPair(self.arena_dir, layout)
        return self.arenas.spare_tensors()

    async def stage(self, update: WeightUpdate) -> object:
        """With arenas: the arena that holds the update (the spare one, or on a rollback the live
        one); the swap makes it live."""
        return None if self.arenas is None else self.arenas.staged(update.state, "recording")

    async def pause(self, drain: DrainPolicy, timeout_s: float) -> None:
        self.calls.append(f"pause:{drain.value}")
        self.paused = True

    async def swap(self, update: WeightUpdate, staged: Any) -> None:
        assert self.paused, "weights may only move while the engine is paused"
        self.calls.append(f"swap:{update.version}")
        if staged is not None:  # switch by reference: every tensor now lives in that arena
            assert self.arenas is not None
            if self.fail_next_swap:
                self.fail_next_swap = False
                raise EngineError("engine refused the update")
            self.arenas.live = staged
            self.weights = dict(update.state)
            names: tuple[str, ...] = ()
        else:
            names = update.names
        for name in names:
            value = update.state[name]  # an engine that copies updates must not keep a reference
            self.weights[name] = (
                HostTensor(value.dtype, value.shape, value.data.copy()) if self.copies_updates else value
            )
            if self.fail_next_swap:
                self.fail_next_swap = False
                raise EngineError("engine refused the update")
        if update.version is not None:
            self.version = update.version
        self.updates.append(update)

    async def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def weight_version(self) -> str | None:
        return self.version

    async def close(self) -> None:
        if self.arenas is not None:
            self.arenas.close()
            self.arenas = None
