"""The contract between the shared subscriber and an inference engine (vLLM, SGLang, ...).

The subscriber does everything engine-agnostic (poll, plan, fetch, decode, verify, stage); an
adapter only has to swap a fully verified, staged snapshot into its engine, all or nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar

from .manifest import Manifest
from .tensors import StateDict


class DrainPolicy(str, Enum):
    """What happens to in-flight requests while weights are swapped."""

    WAIT = "wait"    # stop admitting, let running requests finish (up to a timeout), then swap
    KEEP = "keep"    # freeze running requests in place, swap, resume them on the new weights
    ABORT = "abort"  # abort running requests, swap


@dataclass(frozen=True)
class SwapConfig:
    """What every engine adapter is configured with: the store to follow and how to drain."""

    store_url: str | None
    poll_interval_s: float = 2.0
    drain: DrainPolicy = DrainPolicy.WAIT
    #: In ``wait`` mode, abort what is still running after this many seconds.
    drain_timeout_s: float = 30.0

    #: Field -> environment variable; subclasses add their own fields here.
    ENV: ClassVar[dict[str, str]] = {
        "store_url": "DELTA_SWAP_STORE",
        "poll_interval_s": "DELTA_SWAP_POLL_INTERVAL",
        "drain": "DELTA_SWAP_DRAIN",
        "drain_timeout_s": "DELTA_SWAP_DRAIN_TIMEOUT",
    }

    @classmethod
    def load(cls, given: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> SwapConfig:
        """Values from ``given`` (e.g. parsed flags; None means unset), else the environment,
        else the defaults. Raises ValueError naming a bad setting."""
        env = os.environ if env is None else env
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            value = (given or {}).get(f.name)
            if value is None:
                value = env.get(cls.ENV.get(f.name, ""), "") or None
            if value is None:
                continue
            try:
                kwargs[f.name] = _convert(f.default, value)
            except ValueError as exc:
                raise ValueError(f"bad delta-swap setting {cls.ENV.get(f.name, f.name)}={value!r}: {exc}") from None
        kwargs.setdefault("store_url", None)
        return cls(**kwargs)


def _convert(default: Any, value: Any) -> Any:
    if isinstance(default, DrainPolicy):
        return DrainPolicy(value)
    return float(value) if isinstance(default, float) else str(value)


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

    async def describe(self) -> dict[str, Any]:
        """Engine details for the status route (engine name, its weight version, drain policy)."""
        return {}
