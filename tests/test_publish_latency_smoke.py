"""A CI-sized run of the publish-latency benchmark (benchmarks/publish_latency.py, figure 3) on
vLLM: the 3M model, two RL-sized updates, each followed by the full-checkpoint path (write the
weights as a checkpoint folder, the engine's own reload), then the table and the plot.

It checks that both paths ran to the end for every update, not this machine's speed: at 3M the
server's poll interval, not the bytes, decides the delta path's latency.
"""

from __future__ import annotations

import pytest

from benchmarks import publish_latency

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def row(tmp_path_factory) -> dict:
    return publish_latency.measure("vllm", "3M", tmp_path_factory.mktemp("latency"), updates=2)


def test_every_update_is_timed_on_both_paths(row) -> None:
    assert row["engine"] == "vllm" and row["size"] == "3M" and row["model_bytes"] > 1_000_000
    assert len(row["delta_s"]) == 2 and len(row["full_s"]) == 2
    assert all(0 < s < 300 for s in row["delta_s"] + row["full_s"]), row


def test_the_table_and_the_plot(row, tmp_path) -> None:
    header, line = publish_latency.summarize([row])
    assert "delta-swap s" in header and line.split()[:2] == ["vllm", "3M"]
    publish_latency.plot([row], tmp_path / "latency.png")
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
