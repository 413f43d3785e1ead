"""One update of a running engine, all or nothing: the skeleton every engine adapter plugs into.

:func:`apply_update` checks the update against the served model, stages it while the engine
generates, pauses, swaps, rolls back to the previous tensors if the swap fails (unless the adapter
raised :class:`~delta_swap.errors.SwapUndoneError`: it put them back itself, on every rank), and
always resumes, then lets the adapter drop what it staged while the engine generates on the new
weights. It times each phase (``stage``, ``pause``, ``swap``, ``rollback``, ``resume``,
``unstage``) and translates engine failures into :class:`~delta_swap.errors.EngineError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from .checkpoint_dir import read_checkpoint_dir
from .engine_adapter import EngineAdapter, WeightUpdate
from .errors import DeltaSwapError, EngineError, EngineStateUnknownError, SwapUndoneError
from .settings import Settings
from .tensors import StateDict, specs_of

T = TypeVar("T")
log = logging.getLogger("delta_swap.swap")


@contextmanager
def timed(timings: dict[str, float], phase: str, on_phase: Callable[[str], None] | None = None) -> Iterator[None]:
    """Add the seconds spent in the ``with`` block to ``timings[phase]`` (announcing the phase
    to ``on_phase`` first)."""
    if on_phase is not None:
        on_phase(phase)
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start


async def apply_update(
    adapter: EngineAdapter,
    update: WeightUpdate,
    settings: Settings,
    on_phase: Callable[[str], None] | None = None,
    restore: Callable[[], Awaitable[StateDict]] | None = None,
) -> dict[str, float]:
    """Put ``update`` into the engine behind ``adapter``; returns the seconds of each phase
    (``on_phase`` hears each phase's name as it starts). A rollback puts back ``update.previous``,
    else what ``restore`` returns (the engine's current weights rebuilt, e.g. from the store),
    else the served checkpoint (a first sync).

    Raises IncompatibleSnapshotError before touching the engine when the update does not fit
    the served model, and EngineError (after restoring the previous tensors) when the engine
    fails the swap. The engine resumes in every case.
    """
    adapter.served.check_fits(specs_of(update.state))
    version_before = await _engine_call(adapter, adapter.weight_version())
    timings: dict[str, float] = {}
    with timed(timings, "stage", on_phase):
        staged = await _engine_call(adapter, adapter.stage(update))
    try:
        with timed(timings, "pause", on_phase):
            await _engine_call(adapter, adapter.pause(settings.drain, settings.drain_timeout))
        try:
            with timed(timings, "swap", on_phase):
                await _engine_call(adapter, adapter.swap(update, staged))
        except SwapUndoneError as exc:  # every rank is back on the previous weights already
            log.error(
                "delta-swap: swapping in %s failed and the engine undid it on every rank: %s", update.version, exc
            )
            raise
        except BaseException as exc:
            with timed(timings, "rollback", on_phase):
                try:
                    await _rollback(adapter, update, version_before, restore)
                except Exception as undo:
                    raise EngineStateUnknownError(
                        f"{adapter.name}: the swap failed ({exc}) and restoring the previous weights failed too "
                        f"({undo}); the engine must be reloaded"
                    ) from undo
            if isinstance(exc, DeltaSwapError):
                raise
            raise adapter.engine_error(exc) from exc
        finally:
            with timed(timings, "resume", on_phase):
                await _quietly(adapter.resume(), "resume")
    finally:
        with timed(timings, "unstage", on_phase):  # the engine serves the new weights meanwhile
            await _quietly(adapter.unstage(staged), "unstage")
    return timings


async def _engine_call(adapter: EngineAdapter, call: Awaitable[T]) -> T:
    """Await an adapter call, translating the engine's own exceptions."""
    try:
        return await call
    except (DeltaSwapError, asyncio.CancelledError):
        raise
    except Exception as exc:
        raise adapter.engine_error(exc) from exc


async def _rollback(
    adapter: EngineAdapter,
    failed: WeightUpdate,
    version: str | None,
    restore: Callable[[], Awaitable[StateDict]] | None,
) -> None:
    """Put the tensors of ``failed.names`` and the weight version back as they were."""
    log.error("delta-swap: swapping in %s failed, restoring the previous weights", failed.version)
    previous = failed.previous
    if previous is None and restore is not None:
        previous = await restore()
    if previous is None or any(name not in previous for name in failed.names):
        # First sync: the tensors the server started with, memory-mapped from its checkpoint.
        if adapter.served.checkpoint_dir is None:
            raise EngineError(
                "the swap failed and the served checkpoint is unknown: cannot restore the previous weights"
            )
        checkpoint, _ = await asyncio.to_thread(read_checkpoint_dir, adapter.served.checkpoint_dir)
        previous = checkpoint
    back = WeightUpdate(
        version=version, state=previous, names=tuple(n for n in failed.names if n in previous), previous=failed.state
    )
    staged = await _engine_call(adapter, adapter.stage(back))
    try:
        await _engine_call(adapter, adapter.swap(back, staged))
    finally:
        await _quietly(adapter.unstage(staged), "unstage")


async def _quietly(call: Awaitable[object], what: str) -> None:
    try:
        await call
    except Exception:
        log.exception("delta-swap: %s failed", what)
