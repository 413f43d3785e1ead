"""The contract between the shared subscriber and an inference engine (vLLM, SGLang, ...).

The subscriber does everything engine-agnostic (poll, plan, fetch, decode, verify, stage); an
adapter only has to swap a fully verified, staged snapshot into its engine, all or nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum

from .manifest import Manifest
from .tensors import StateDict


class DrainPolicy(str, Enum):
    """What happens to in-flight requests while weights are swapped."""

    WAIT = "wait"    # stop admitting, let running requests finish (up to a timeout), then swap
    KEEP = "keep"    # freeze running requests in place, swap, resume them on the new weights
    ABORT = "abort"  # abort running requests, swap


@dataclass(frozen=True)
class StagedSnapshot:
    """A snapshot rebuilt and verified in host memory, ready to be swapped in."""

    manifest: Manifest
    #: Every tensor of the model after this snapshot (shared with the subscriber: read only).
    state: StateDict
    #: Names whose bytes differ from what the engine holds now (all of them on a first sync).
    changed: tuple[str, ...]
    #: What the engine holds now (None before the first sync): an adapter restores the
    #: ``changed`` tensors from it if a swap fails half way.
    previous: StateDict | None = None
    #: Seconds spent per phase so far: fetch, decode, verify.
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def snapshot_id(self) -> str:
        return self.manifest.snapshot_id


class EngineAdapter(ABC):
    """Swaps staged snapshots into one running engine."""

    @abstractmethod
    async def swap(self, staged: StagedSnapshot) -> dict[str, float]:
        """Pause or drain, load ``staged.changed`` tensors, invalidate caches, set the weight
        version to ``staged.snapshot_id``, resume. Returns timings (``pause``, ``swap``, ...).

        Must be transactional: on any error the engine keeps serving the previous weights
        (restoring them if it had begun loading) and the error is raised.
        """
