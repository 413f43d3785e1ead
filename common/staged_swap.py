"""The engine-process half of the in-place and shadow swap strategies, for any engine.

Each process that holds the model (a vLLM worker, an SGLang scheduler: every tensor-parallel rank)
keeps one :class:`StagedSwap`. Before the pause it stages an update on a thread of its own while
the engine generates (:meth:`StagedSwap.stage_inplace`: the changed elements of its parameters,
:mod:`.inplace`; :meth:`StagedSwap.stage_shadow`: shadow modules, :mod:`.shadow`;
:meth:`StagedSwap.stage_switch`: new tensors of the changed parameters, :mod:`.param_switch`) and
answers whether that is done without waiting (:meth:`StagedSwap.answer`). In the pause
:meth:`StagedSwap.apply` scatters the changes or switches the modules (parameters), and undoes
itself on any failure; the undo stays available until the swap is final and
:meth:`StagedSwap.drop` forgets it.

The engine adapter's side says how its engine reaches these calls (vLLM: its weight-transfer
backend; SGLang: a channel into the scheduler and its custom weight loader).
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .host_memory import release_free_heap
from .inplace import ElementChanges, UndoLog, element_changes, save_old_values, scatter
from .param_switch import ParameterSwitch, build_parameter_switch
from .served_model import ServedModel
from .shadow import ShadowBuild, ShadowEngine, ShadowUnsupported, build_shadows
from .undo import take_back

log = logging.getLogger("delta_swap")

#: What a model's loaders run under (vLLM: its current config), entered on the staging thread.
LoadContext = Callable[[], AbstractContextManager[Any]]


@dataclass(frozen=True)
class InplaceStaged:
    """What a process staged for an in-place swap: the changed elements and the old values there."""

    changes: list[ElementChanges]
    saved: UndoLog
    seconds: float


def read_staged(path: str, wanted: set[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The tensors (those named in ``wanted``, if given) of one safetensors file or of every one
    in a folder, memory-mapped, as the engine's process reads what the adapter staged."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if os.path.isdir(path) else [Path(path)]
    out: list[tuple[str, torch.Tensor]] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out.extend((name, f.get_tensor(name)) for name in f.keys() if not wanted or name in wanted)
    return out


def _staged_spans(staged: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[int, int]]:
    """The memory ranges, sorted, of the tensors read from a staged file."""
    storages = (t.untyped_storage() for _, t in staged)
    return sorted((s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages if s.nbytes())


def _views(tensors: Iterable[Any], spans: list[tuple[int, int]]) -> Iterator[torch.Tensor]:
    """Those of ``tensors`` (other values skipped) that share memory with one of ``spans``."""
    starts = [start for start, _ in spans]
    for tensor in tensors:
        if not spans or not isinstance(tensor, torch.Tensor) or not tensor.numel():
            continue
        storage = tensor.untyped_storage()
        begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        i = bisect.bisect_right(starts, begin) - 1
        if any(begin < stop and start < end for start, stop in spans[max(i, 0) : i + 2]):
            yield tensor


def refuse_views(tensors: Iterable[Any], staged: Sequence[tuple[str, torch.Tensor]], what: str) -> None:
    """Raise RuntimeError if one of ``tensors`` shares memory with a tensor ``staged`` read from a
    staged file (:func:`read_staged` maps files, it does not copy): the engine would compute from a
    file that the next update rewrites in place (the subscriber's copy of the weights,
    :mod:`delta_swap.host_copy`). Loaders copy; one that kept the tensor it was handed is caught
    here, while the engine still generates on its old weights."""
    if next(_views(tensors, _staged_spans(staged)), None) is not None:
        raise RuntimeError(
            f"delta_swap: {what} holds a view of a staged file, not a copy (a loader that keeps the tensor "
            "it is handed): the next update would change it in place"
        )


def copy_views(model: torch.nn.Module, staged: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Give every parameter and buffer of ``model`` that shares memory with a tensor ``staged``
    read from a staged file a copy of its own (after an engine's own reload, which has replaced the
    old weights already); how many did."""
    spans = _staged_spans(staged)
    copied = 0
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and next(_views([param], spans), None) is not None:
                param.data = param.data.clone()
                copied += 1
        for name, buffer in module._buffers.items():
            if buffer is not None and next(_views([buffer], spans), None) is not None:
                module._buffers[name] = buffer.clone()
                copied += 1
    return copied


def _state_tensors(state: Mapping[str, Any]) -> Iterator[Any]:
    """The values of a module's state (``__dict__``), those of its parameter, buffer and submodule
    tables, and the tensors of its submodules."""
    for value in state.values():
        for item in value.values() if isinstance(value, Mapping) else (value,):
            if isinstance(item, torch.nn.Module):
                yield from item.parameters()
                yield from item.buffers()
            else:
                yield item


def inplace_possible(
    model: torch.nn.Module,
    served: ServedModel,
    packed: Mapping[str, Sequence[str]],
    default_loader: Callable[..., Any],
    context: LoadContext = nullcontext,
) -> tuple[bool, str]:
    """Whether every parameter of ``model`` holds the served checkpoint's values as plain elements
    where the model's own loaders put them (else: why not), checked by loading the checkpoint into
    scratch copies: no element may differ."""
    if served.checkpoint_dir is None:
        return False, "the served checkpoint is not a local folder"
    empty = next((name for name, param in model.named_parameters() if not param.numel()), None)
    if empty is not None:  # vLLM's CPU linears after oneDNN / AMX repacking: the weights live in the kernel
        return (
            False,
            f"the engine holds {empty} in another form than the checkpoint (an empty parameter: packed for a kernel)",
        )
    started = time.perf_counter()
    try:
        with context(), torch.inference_mode():
            weights = read_staged(served.checkpoint_dir)
            changes, _ignored = element_changes(model, weights, packed, default_loader, stop_at_first=True)
    except Exception as exc:
        return False, f"cannot map the checkpoint onto the parameters: {type(exc).__name__}: {exc}"
    if changes:
        return False, f"the engine holds {changes[0].param} in another form than the checkpoint (packed for a kernel?)"
    log.info("delta_swap: parameters hold the checkpoint's elements (checked in %.2fs)", time.perf_counter() - started)
    return True, "parameters are plain tensors holding the checkpoint's elements"


class StagedSwap:
    """One process's staged update (at most one at a time) and its undo."""

    def __init__(self) -> None:
        #: What is being staged; it keeps the old values (modules, tensors) until it is dropped.
        self._staging: Future[InplaceStaged | ShadowBuild | ParameterSwitch] | None = None
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="delta-swap-stage")
        self._answered = False

    def stage_inplace(
        self,
        model: torch.nn.Module,
        weights: Iterable[tuple[str, torch.Tensor]],
        packed: Mapping[str, Sequence[str]],
        default_loader: Callable[..., Any],
        context: LoadContext = nullcontext,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Start working out, through the model's own loaders, which elements of this process's
        parameters ``weights`` change (kept next to the parameters, with the old values there);
        ``on_done`` is called on the staging thread once that is done or failed."""
        weights = list(weights)

        def work() -> InplaceStaged:
            started = time.perf_counter()
            with context(), torch.inference_mode():
                changes, _ignored = element_changes(model, weights, packed, default_loader)
                saved = save_old_values(dict(model.named_parameters()), changes)
            return InplaceStaged(changes, saved, time.perf_counter() - started)

        self._start(work, on_done)

    def stage_shadow(
        self,
        model: torch.nn.Module,
        weights: Iterable[tuple[str, torch.Tensor]],
        packed: Mapping[str, Sequence[str]],
        engine: ShadowEngine,
        default_loader: Callable[..., Any],
        context: LoadContext = nullcontext,
        fail_after: int = -1,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Start building the shadows of the modules ``weights`` (whole modules) load into;
        ``fail_after`` >= 0 makes the build fail after that many modules (tests); ``on_done`` as
        in :meth:`stage_inplace`."""
        weights = list(weights)
        fault = _mid_build_fault(fail_after, "shadow modules")

        def work() -> ShadowBuild:
            with context(), torch.inference_mode():
                build, _ignored = build_shadows(model, weights, packed, engine, default_loader, fault)
            refuse_views((t for item in build.switches for t in _state_tensors(item.state)), weights, "a shadow module")
            return build

        self._start(work, on_done)

    def stage_switch(
        self,
        model: torch.nn.Module,
        weights: Iterable[tuple[str, torch.Tensor]],
        packed: Mapping[str, Sequence[str]],
        default_loader: Callable[..., Any],
        context: LoadContext = nullcontext,
        fail_after: int = -1,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Start building, through the model's own loaders, the new tensors of the parameters
        ``weights`` change (plain host tensors); ``fail_after`` >= 0 makes the build fail after that
        many modules (tests); ``on_done`` as in :meth:`stage_inplace`."""
        weights = list(weights)
        fault = _mid_build_fault(fail_after, "modules")

        def work() -> ParameterSwitch:
            # not inference mode: the new tensors become the engine's parameters, which its own
            # weight loads (SGLang's update_weights_from_disk) write into outside inference mode
            with context(), torch.no_grad():
                build, _ignored = build_parameter_switch(model, weights, packed, default_loader, fault)
            refuse_views((new for _, _, new in build.targets), weights, "a new parameter")
            return build

        self._start(work, on_done)

    def _start(
        self,
        work: Callable[[], InplaceStaged | ShadowBuild | ParameterSwitch],
        on_done: Callable[[], None] | None,
    ) -> None:
        self.drop()
        self._answered = False
        self._staging = self._stager.submit(work)
        if on_done is not None:
            self._staging.add_done_callback(lambda _: _call_logged(on_done))

    def answer(self) -> dict[str, Any]:
        """Whether staging is done (never waits for it), with what it found: ``{"done": False}``,
        or ``done`` with ``elements`` (in place) or ``modules`` (shadow), ``bytes`` and
        ``seconds``; ``fallback`` where a shadow build met a module it cannot make (the update
        must be reloaded); ``error`` where staging failed."""
        staging = self._staging
        if staging is None:
            return {"done": True, "error": "delta_swap: nothing is being staged"}
        if not staging.done():
            return {"done": False}
        first, self._answered = not self._answered, True  # logged once, not at every poll
        exc = staging.exception()
        if isinstance(exc, ShadowUnsupported):
            return {"done": True, "fallback": str(exc)}
        if exc is not None:
            if first:
                log.error("delta_swap: staging failed", exc_info=exc)
            return {"done": True, "error": f"{type(exc).__name__}: {exc}"}
        staged = staging.result()
        if isinstance(staged, ShadowBuild):
            if first:
                log.info("delta_swap: built %d shadow modules in %.3fs", len(staged.switches), staged.seconds)
            return {"done": True, "modules": len(staged.switches), "bytes": staged.nbytes, "seconds": staged.seconds}
        if isinstance(staged, ParameterSwitch):
            if first:
                log.info(
                    "delta_swap: built the new tensors of %d parameters (%.1f MB) in %.3fs",
                    len(staged.targets),
                    staged.nbytes / 1e6,
                    staged.seconds,
                )
            return {"done": True, "parameters": len(staged.targets), "bytes": staged.nbytes, "seconds": staged.seconds}
        elements = sum(c.positions.numel() for c in staged.changes)
        if first:
            log.info(
                "delta_swap: staged %d changed elements of %d parameters in %.3fs",
                elements,
                len(staged.changes),
                staged.seconds,
            )
        nbytes = sum(c.nbytes for c in staged.changes)
        return {"done": True, "elements": elements, "bytes": nbytes, "seconds": staged.seconds}

    def apply(
        self, op: str, model: torch.nn.Module, fail_after: int = -1
    ) -> tuple[int, UndoLog | ShadowBuild | ParameterSwitch]:
        """In the pause: ``scatter`` the staged changes into ``model``'s live parameters, or
        ``switch`` the changed modules to their shadows (the changed parameters to their new
        tensors); (how many parameters or modules, the undo). A failure (or, with ``fail_after``
        >= 0, one injected after that many) puts the old values (modules) back before it is raised,
        marked where that failed too (:func:`delta_swap.undo.restored`)."""
        inplace = op == "scatter"
        staged = self._staging.result() if self._staging is not None else None  # done: waited for before the pause

        def fault(done: int) -> None:
            if 0 <= fail_after <= done:
                verb = "writing" if inplace else "switching"
                unit = "modules" if isinstance(staged, ShadowBuild) else "parameters"
                raise RuntimeError(f"delta_swap: injected failure after {verb} {done} {unit}")

        after_each = fault if fail_after >= 0 else None
        with torch.inference_mode():
            if inplace and isinstance(staged, InplaceStaged):
                undo: UndoLog | ShadowBuild | ParameterSwitch = scatter(
                    dict(model.named_parameters()), staged.changes, after_each, staged.saved
                )
                count = len(staged.changes)
            elif not inplace and isinstance(staged, ShadowBuild):
                staged.switch(after_each)
                undo, count = staged, len(staged.switches)
            elif not inplace and isinstance(staged, ParameterSwitch):
                staged.switch(after_each)
                undo, count = staged, len(staged.targets)
            else:
                before = "stage_inplace" if inplace else "stage_shadow or stage_switch"
                raise RuntimeError(f"delta_swap: {op} before {before}")
            if torch.accelerator.is_available():  # a write that failed on the device shows here
                try:
                    torch.accelerator.synchronize()
                except BaseException as exc:
                    take_back(undo.undo, exc)
                    raise
        return count, undo

    def drop(self) -> None:
        """Forget what was staged, with the old values (modules) it kept (waiting for a staging
        thread still running): the swap is final, or was never made."""
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.cancel()
            wait([staging])
            del staging  # the old modules (or values) go with it: their pages back to the system
            release_free_heap()

    def shutdown(self) -> None:
        self._stager.shutdown(wait=False, cancel_futures=True)


def _call_logged(callback: Callable[[], None]) -> None:
    """``callback()``, its failure logged (the answer to the next question says the same)."""
    try:
        callback()
    except Exception as exc:
        log.warning("delta_swap: could not say that staging is done: %s", exc)


def _mid_build_fault(fail_after: int, unit: str) -> Callable[[int], None]:
    """A build's ``after_each`` that fails once ``fail_after`` >= 0 ``unit`` are built (tests)."""

    def fault(done: int) -> None:
        if 0 <= fail_after <= done:
            raise RuntimeError(f"delta_swap: injected failure mid-build after {done} {unit}")

    return fault


def merge_staged(answers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One summary of every rank's finished :meth:`StagedSwap.answer` (for the status's
    ``last_staged``): ``fallback`` where any rank must reload instead, else the changed elements
    (or shadow modules, or switched parameters) summed over the ranks, and the largest rank's
    bytes and seconds."""
    fallbacks = sorted({str(a["fallback"]) for a in answers if a.get("fallback")})
    if fallbacks:
        return {"fallback": "; ".join(fallbacks)}
    count = next((k for k in ("elements", "parameters") if all(k in a for a in answers)), "modules")
    return {
        count: sum(int(a[count]) for a in answers),
        "bytes": max(int(a["bytes"]) for a in answers),
        "seconds": max(float(a["seconds"]) for a in answers),
    }


#: Tests only: while the file this names exists and holds N, every in-place (shadow, switch) swap
#: fails after writing N parameters (switching N modules or parameters), in the engine's process;
#: ``N@R``: on tensor-parallel rank R only.
FAIL_SCATTER_ENV = "DELTA_SWAP_TEST_FAIL_SCATTER"
#: Tests only: while the file this names exists and holds N, every shadow (switch) build fails after N modules.
FAIL_BUILD_ENV = "DELTA_SWAP_TEST_FAIL_BUILD"


async def injected_swap_failure(version: str | None, served_version: Callable[[], Awaitable[str | None]]) -> int:
    """:func:`injected_failure` of :data:`FAIL_SCATTER_ENV` for a swap to ``version``; never for
    the swap back to the version the engine serves (a rollback), which tests do not fail."""
    fail_after = injected_failure(FAIL_SCATTER_ENV)
    if fail_after >= 0 and version is not None and version == await served_version():
        return -1
    return fail_after


def injected_failure(env: str) -> int:
    """The number of parameters (modules) after which the next apply (shadow build) fails, from
    the marker file ``env`` names (-1: it does not). Read by the adapter, which passes it on."""
    return _marker(env)[0]


def injected_failure_rank(env: str) -> int | None:
    """The one tensor-parallel rank the failure of :func:`injected_failure` is for (a marker
    ``N@R``), or None: every rank."""
    return _marker(env)[1]


def _marker(env: str) -> tuple[int, int | None]:
    marker = os.environ.get(env)
    if not marker or not os.path.exists(marker):
        return -1, None
    count, _, rank = Path(marker).read_text().strip().partition("@")
    return int(count or 0), int(rank) if rank else None
