"""The contract between delta-swap's core and an inference engine (vLLM, SGLang, a third one).

The core does everything engine-agnostic: it follows the store, fetches, decodes and verifies
each snapshot (into ``adapter.destination()`` when the adapter offers its spare weights), checks
it against the served model, and then drives the adapter through one update
(:func:`delta_swap.swap.apply_update`)::

    staged = await adapter.stage(update)        # the engine still generates
    await adapter.pause(drain, timeout_s)       # stop generating, per the drain policy
    await adapter.swap(update, staged)          # load the tensors, set the weight version
    # if swap raised: the previous tensors go back in through stage + swap, then the error is raised
    await adapter.resume()                      # always
    await adapter.unstage(staged)               # always

The core times every phase, owns the rollback, the HTTP routes, the app state and the
subscriber's lifecycle; an adapter is one file that implements ``pause``, ``swap`` and
``resume`` (and, if useful, ``stage``, ``unstage``, ``weight_version``, ``describe`` and
``engine_error``).

What an adapter must not do:

* block the event loop (run file I/O and copies with ``asyncio.to_thread``);
* modify the tensors of an update (they are shared with the subscriber, read only) or keep
  references to them after ``swap`` returns, except as the engine's own weights;
* touch the engine's weights outside ``swap``, or call ``resume`` itself;
* raise from ``resume`` or ``unstage`` (log instead: the engine must come back);
* fetch anything from the store: everything it needs is in the update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import ConfigError, EngineError
from .served_model import ServedModel
from .settings import DrainPolicy
from .tensors import StateDict, TensorSpecs


@dataclass(frozen=True)
class WeightUpdate:
    """A fully verified set of tensors to put into the engine, all or nothing."""

    #: The weight version the engine reports afterwards (a snapshot id); None keeps its version.
    version: str | None
    #: Every tensor of the model after the update (read only).
    state: StateDict
    #: Tensors whose bytes differ from what the engine holds now (all of them on a first sync).
    names: tuple[str, ...]
    #: What the engine holds now, when known (read only).
    previous: StateDict | None = None
    #: The publisher's checksum of each tensor of ``state``, to verify copies against.
    checksums: Mapping[str, str] | None = None
    #: A safetensors file in the staging folder that holds every tensor of ``state`` (the
    #: subscriber's :class:`~delta_swap.host_copy.HostCopy`): the engine's processes may read the
    #: update from it instead of a file of its own. Valid until the update is final.
    state_file: str | None = None


class EngineAdapter(ABC):
    """One running inference engine, driven by the core one update at a time."""

    #: Engine name shown in the status route.
    name: ClassVar[str] = "engine"
    #: The model the engine serves: every snapshot is checked against it before it is fetched.
    served: ServedModel = ServedModel(None, {})
    #: Whether the engine copies what an update hands it, never keeping a reference to
    #: ``update.state`` past the swap: the core then decodes every snapshot in place into one copy
    #: of the weights in the staging folder (:mod:`delta_swap.host_copy`), handed over as
    #: ``update.state_file``, instead of keeping the previous weights beside the new ones.
    copies_updates: ClassVar[bool] = False

    async def destination(self, specs: TensorSpecs) -> StateDict | None:
        """Writable host tensors (by checkpoint name, of these ``specs``) that the next update
        should be decoded into: the engine's spare weights, when it can switch to them by reference
        (see :mod:`delta_swap.arena`). The core then keeps no copy of its own. None (the default):
        the core decodes into buffers it allocates.
        """
        return None

    async def stage(self, update: WeightUpdate) -> Any:
        """Prepare ``update`` while the engine still generates (copy it where the engine can
        read it, build new weights off the critical path...).

        Returns: whatever ``swap`` and ``unstage`` need (default: None).
        Raises: EngineError; the engine is not touched.
        """
        return None

    @abstractmethod
    async def pause(self, drain: DrainPolicy, timeout_s: float) -> None:
        """Stop generating: finish (``WAIT``, aborting what still runs after ``timeout_s``),
        freeze (``KEEP``) or abort (``ABORT``) in-flight requests.

        Raises: any error, after undoing a partial pause (the core then skips the swap).
        """

    @abstractmethod
    async def swap(self, update: WeightUpdate, staged: Any) -> None:
        """Load ``update.names`` into the paused engine, drop every cache computed with the old
        weights, and set the engine's weight version to ``update.version``.

        Args: the update and what ``stage`` returned for it.
        Raises: any error; the core restores the previous tensors through ``stage`` + ``swap``,
        except after :class:`~delta_swap.errors.SwapUndoneError`: the adapter put the previous
        weights and version back itself on every rank (an undo log, the old modules).
        """

    @abstractmethod
    async def resume(self) -> None:
        """Let the engine generate again (called after every pause, also after failures)."""

    async def unstage(self, staged: Any) -> None:
        """Release what ``stage`` made (called once per ``stage``, after ``resume``)."""

    async def weight_version(self) -> str | None:
        """The weight version the engine reports now (restored after a failed swap)."""
        return None

    async def describe(self) -> dict[str, Any]:
        """Engine details for the status route (the core adds ``engine`` and ``weight_version``)."""
        return {}

    async def close(self) -> None:
        """Release what the adapter holds (arenas, files) when the server stops."""

    def engine_error(self, exc: BaseException) -> EngineError:
        """Translate one of the engine's exceptions into delta-swap's error type (override to
        keep the engine's message in a better shape)."""
        return EngineError(f"{self.name}: {type(exc).__name__}: {exc}")


def refuse_unverified_weights(
    quantization: str | None,
    lora_flags: str | None,
    multimodal: bool,
    exact_quantizations: Mapping[str, str | None] | None = None,
) -> None:
    """Raise ConfigError (one line) for a server whose weights are not the published tensors, as
    delta-swap cannot keep it exact yet: quantized (``--quantization``) other than as the adapter
    keeps exact (``exact_quantizations``: name -> None, or why not on this server), with LoRA
    adapters (``lora_flags``: the engine's flags that enabled them, None without), or multimodal.
    Engine adapters call it when their server starts."""
    exact = exact_quantizations or {}
    if quantization and quantization in exact and exact[quantization] is not None:
        raise ConfigError(f"delta_swap does not support --quantization {quantization} here: {exact[quantization]}")
    if quantization and quantization not in exact:
        supported = f" or {', '.join(sorted(exact))}" if exact else ""
        raise ConfigError(
            f"delta_swap does not support quantized servers yet (--quantization {quantization}: "
            f"the engine would hold re-quantized weights, not the published ones); serve bf16/fp16{supported}"
        )
    if lora_flags:
        raise ConfigError(
            f"delta_swap does not support {lora_flags} yet (base weights under loaded adapters "
            "are not verified); serve without LoRA"
        )
    if multimodal:
        raise ConfigError(
            "delta_swap does not support multimodal models yet (the vision tower and its "
            "processor are not covered by the swap's checks)"
        )
