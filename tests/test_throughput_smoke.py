"""A CI-sized run of the throughput benchmark (benchmarks/throughput_under_updates.py, figure 2)
on vLLM: the 3M model, drain mode ``keep``, two streaming clients, two quiet windows and two
windows with two updates each, then the table and the plot. The token accounting itself is
tested in test_throughput_accounting.py.

It checks what the figure's row claims, not this machine's speed: every update released was
served and timed, the load streamed tokens in both kinds of window, and in ``keep`` mode no
request was aborted.
"""

from __future__ import annotations

import argparse

import pytest

from benchmarks import throughput_under_updates as bench
from benchmarks.harness import make_model

pytestmark = pytest.mark.engine

ARGS = argparse.Namespace(seconds=8.0, rounds=2, interval=2.0, streams=2, max_tokens=64, warmup=1.0)


@pytest.fixture(scope="module")
def row(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("throughput")
    return bench.run_mode("vllm", make_model(work / "models", "3M"), work, "keep", ARGS)


def test_every_update_was_served_while_the_load_streamed(row) -> None:
    assert row["engine"] == "vllm" and row["mode"] == "keep"
    assert row["updates"] == 4 and len(row["window_s"]) == 4 and len(row["lost_s"]) == 4
    assert all(0 < w < 30 for w in row["window_s"]), row["window_s"]
    assert row["quiet_tokens_per_s"] > 0 and row["tokens_per_s"] > 0
    assert all(rate > 0 for kind in ("quiet", "updates") for rate in row["window_tokens_per_s"][kind])
    assert row["requests"] > 0 and row["aborted"] == 0, row


def test_the_table_and_the_plot(row, tmp_path) -> None:
    header, line = bench.summarize([row])
    assert "retained" in header and line.split()[:2] == ["vllm", "keep"]
    bench.plot([row], tmp_path / "throughput.png", "smoke")
    assert (tmp_path / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
