"""sglang_delta_plugin.paused_loop: jobs handed to a scheduler run on its thread, only in a paused
iteration, in order; a job the scheduler did not take in time never runs. The scheduler here is
a thread playing SGLang's paused loop (the real one is exercised by the SGLang engine tests)."""

from __future__ import annotations

import threading
import time

from sglang_delta_plugin import paused_loop


class PausedScheduler:
    """A loop thread that calls the hook the way SGLang's paused loop does, while ``paused`` is set."""

    def __init__(self) -> None:
        self.paused = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.stop.is_set():
            if self.paused.is_set():
                paused_loop.on_paused_iteration(None, self)
            time.sleep(0.001)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def test_jobs_run_on_the_schedulers_thread_in_order_while_paused() -> None:
    scheduler = PausedScheduler()
    try:
        scheduler.paused.set()
        ran: list[tuple[int, str, object]] = []

        def job(n: int):
            def run(s: object) -> dict:
                ran.append((n, threading.current_thread().name, s))
                return {"ok": True, "n": n}

            return run

        answers = [paused_loop.run_when_paused(job(n), timeout_s=5) for n in range(3)]
        assert [a["n"] for a in answers] == [0, 1, 2]
        assert [n for n, _, _ in ran] == [0, 1, 2]
        assert {name for _, name, _ in ran} == {scheduler.thread.name}
        assert all(s is scheduler for _, _, s in ran)
    finally:
        scheduler.close()


def test_a_job_not_taken_in_time_is_withdrawn_and_never_runs() -> None:
    scheduler = PausedScheduler()  # not paused: the hook is never called
    try:
        ran: list[int] = []
        answer = paused_loop.run_when_paused(lambda s: ran.append(1) or {"ok": True}, timeout_s=0.1)
        assert "did not take the job" in answer["error"]
        scheduler.paused.set()  # the next paused iteration must skip the withdrawn job
        assert paused_loop.run_when_paused(lambda s: {"ok": True}, timeout_s=5) == {"ok": True}
        assert ran == []
    finally:
        scheduler.close()


def test_a_job_that_raises_answers_why_and_the_loop_goes_on() -> None:
    scheduler = PausedScheduler()
    try:
        scheduler.paused.set()

        def boom(s: object) -> dict:
            raise RuntimeError("no such parameter")

        assert paused_loop.run_when_paused(boom, timeout_s=5) == {"error": "RuntimeError: no such parameter"}
        assert paused_loop.run_when_paused(lambda s: {"ok": True}, timeout_s=5) == {"ok": True}
        assert scheduler.thread.is_alive()
    finally:
        scheduler.close()
