"""The throughput benchmark's token accounting (benchmarks/throughput_under_updates.py): what it
counts as generated, as useful (requests not aborted), and as lost around an update. The benchmark
itself needs live servers and minutes; its arithmetic is checked here on made-up arrivals."""

from __future__ import annotations

import math

import pytest

from benchmarks.throughput_under_updates import LOCAL_S, TokenLog, ended_normally, local_loss, retained_useful


def steady(log: TokenLog, start: float, end: float, per_s: int) -> list[tuple[float, int]]:
    """One token every 1/per_s seconds in [start, end), logged; returns the arrivals."""
    arrivals = [(start + i / per_s, 1) for i in range(round((end - start) * per_s))]
    for t, n in arrivals:
        log.arrived(t, n)
    return arrivals


def test_length_stop_and_unfinished_requests_end_normally_aborts_and_errors_do_not() -> None:
    assert ended_normally("length") and ended_normally("stop")
    assert ended_normally(None)  # cut off when the load stopped: its tokens were not thrown away
    assert not ended_normally("abort") and not ended_normally("error: APIError")


def test_useful_tokens_leave_out_aborted_requests_only() -> None:
    log = TokenLog()
    kept = steady(log, 0.0, 10.0, 5)
    aborted = steady(log, 2.0, 6.0, 5)
    log.ended("length", None, kept)
    log.ended("abort", None, aborted)
    assert log.tokens_between(0.0, 10.0) == 70
    assert log.tokens_between(0.0, 10.0, useful=True) == 50
    assert log.tokens_between(4.0, 6.0) == 20 and log.tokens_between(4.0, 6.0, useful=True) == 10
    assert log.tokens_between(6.0, 10.0, useful=True) == log.tokens_between(6.0, 10.0) == 20
    assert [f["reason"] for f in log.finished] == ["length", "abort"]


def test_local_loss_is_the_generation_time_an_update_took() -> None:
    log = TokenLog()
    released, served = 20.0, 21.0
    steady(log, 0.0, released + 0.5, 10)  # the update's decode runs beside generation for 0.5 s
    steady(log, served + 0.7, served + LOCAL_S + 5, 10)  # then nothing is generated for 1.2 s
    assert local_loss(log, released, served) == pytest.approx(1.2, abs=0.11)
    flat = TokenLog()
    steady(flat, 0.0, 40.0, 10)
    assert local_loss(flat, released, served) == pytest.approx(0.0, abs=0.11)
    assert math.isnan(local_loss(TokenLog(), released, served))  # no speed to compare against


def test_rows_from_before_useful_tokens_use_retained_when_nothing_aborted_else_nan() -> None:
    assert retained_useful({"retained": 0.9, "aborted": 3, "retained_useful": 0.1}) == 0.1
    assert retained_useful({"retained": 0.9, "aborted": 0}) == 0.9  # nothing aborted: all useful
    assert math.isnan(retained_useful({"retained": 0.9, "aborted": 3}))
