"""A test double for people writing an engine adapter or testing code around the subscriber.

:class:`RecordingAdapter` is a complete :class:`~delta_swap.engine_adapter.EngineAdapter` with no
engine behind it: it keeps the tensors it is given as an engine would, records every call, and
can be told to fail the next swap. Run a real :class:`~delta_swap.subscriber.Subscriber` against
it to test publishing code, or read it as the smallest working adapter::

    adapter = RecordingAdapter()
    subscriber = Subscriber(Settings(store="file:///tmp/store"), adapter)
    await subscriber.sync()
    assert adapter.version == subscriber.current.snapshot_id
"""

from __future__ import annotations

from typing import Any

from .engine_adapter import EngineAdapter, WeightUpdate
from .errors import EngineError
from .settings import DrainPolicy
from .tensors import HostTensor


class RecordingAdapter(EngineAdapter):
    """Holds the tensors it was given, as an engine would; ``fail_next_swap`` makes the next
    swap fail half way (after loading the first tensor), as a real engine can."""

    name = "recording"

    def __init__(self) -> None:
        self.weights: dict[str, HostTensor] = {}
        self.version: str | None = None
        self.updates: list[WeightUpdate] = []
        self.calls: list[str] = []
        self.paused = False
        self.fail_next_swap = False

    async def pause(self, drain: DrainPolicy, timeout_s: float) -> None:
        self.calls.append(f"pause:{drain.value}")
        self.paused = True

    async def swap(self, update: WeightUpdate, staged: Any) -> None:
        assert self.paused, "weights may only move while the engine is paused"
        self.calls.append(f"swap:{update.version}")
        for name in update.names:
            self.weights[name] = update.state[name]
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
