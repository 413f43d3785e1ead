"""Run work on a scheduler's own thread, between its loop's iterations, while SGLang is paused.

SGLang's scheduler loop takes requests, then (unless paused) runs a batch, on one thread. While
the engine is paused it only takes requests and calls ``_record_scheduler_state_for_paused_engine``:
:func:`on_paused_iteration` is a ``HookRegistry`` AFTER hook on that method, so what it runs
cannot overlap a forward, and runs only once the scheduler itself has taken the pause. That is
where delta-swap switches weights in the pause, without SGLang's weight-update session (three
round trips, each with a barrier over the tensor-parallel ranks, and post-load processing of every
module). :func:`run_when_paused` hands a job over from another thread (the scheduler channel's)
and waits for its answer; a job not started within its timeout never runs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

#: The scheduler method SGLang 0.5.23 calls on every iteration of a paused loop.
PAUSED_ITERATION = "sglang.srt.managers.scheduler.Scheduler._record_scheduler_state_for_paused_engine"

Job = Callable[[Any], dict[str, Any]]

#: How long each paused iteration sleeps. A paused loop spins holding the GIL, which another
#: thread of the process (the channel's, handing a job over and answering) would otherwise get
#: only at Python's switch interval (5 ms) each time it wakes; a pause has nothing else to do.
YIELD_S = 0.0002


class _Pending:
    """One job and its answer; ``state`` moves from waiting to running or cancelled, once."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.lock = threading.Lock()
        self.state = "waiting"
        self.done = threading.Event()
        self.answer: dict[str, Any] = {}


_jobs: queue.SimpleQueue[_Pending] = queue.SimpleQueue()


def run_when_paused(job: Job, timeout_s: float) -> dict[str, Any]:
    """Have the scheduler run ``job(scheduler)`` on its thread in its next paused iteration; its
    answer. If the scheduler has not started it within ``timeout_s`` (the engine is not paused),
    the job is withdrawn and the answer says so."""
    pending = _Pending(job)
    _jobs.put(pending)
    if not pending.done.wait(timeout_s):
        with pending.lock:
            if pending.state == "waiting":
                pending.state = "cancelled"
                return {"error": f"the scheduler did not take the job in {timeout_s:.0f}s (is the engine paused?)"}
        pending.done.wait()  # started meanwhile: it runs to its end
    return pending.answer


def on_paused_iteration(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """The AFTER hook: run every job handed over so far, in order, on this (the scheduler's)
    thread; then let the other threads run for :data:`YIELD_S`."""
    while True:
        try:
            pending = _jobs.get_nowait()
        except queue.Empty:
            time.sleep(YIELD_S)
            return
        with pending.lock:
            if pending.state != "waiting":
                continue
            pending.state = "running"
        try:
            pending.answer = pending.job(scheduler)
        except Exception as exc:  # a job must not end the scheduler: say why instead
            pending.answer = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            pending.done.set()
