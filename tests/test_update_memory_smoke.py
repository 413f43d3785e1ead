"""A CI-sized run of the update-memory benchmark (benchmarks/update_memory.py, figure 4) on vLLM:
the 3M model, the plain server and then the server with the plugin, two RL-sized updates, then
the table and the plot.

It checks that every sample series was taken and that the ratios are the ones the table prints;
at 3M (6 MB of weights against a server of hundreds of MB) the ratios themselves say nothing.
"""

from __future__ import annotations

import pytest

from benchmarks import update_memory

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def row(tmp_path_factory) -> dict:
    return update_memory.measure("vllm", "3M", tmp_path_factory.mktemp("memory"), updates=2)


def test_every_phase_was_sampled(row) -> None:
    assert row["engine"] == "vllm" and row["model_bytes"] > 1_000_000
    assert row["swap_path"] in {"arena", "inplace", "shadow", "reload"}, row  # the path auto took, from the status
    assert not row["keep_freed_memory"] and row["freed_memory"] == "given back to the system", row  # the default
    for key in ("plain", "plain_start_peak", "first_sync_peak", "steady", "update_peak"):
        assert row[key] > 100_000_000, (key, row)  # a whole vLLM server tree: hundreds of MB
    assert row["steady_over_model"] == pytest.approx((row["steady"] - row["plain"]) / row["model_bytes"])
    assert row["update_peak_over_model"] == pytest.approx((row["update_peak"] - row["plain"]) / row["model_bytes"])


def test_the_table_and_the_plot(row, tmp_path) -> None:
    header, line = update_memory.summarize([row])
    assert "update peak" in header and line.split()[:2] == ["vllm", "3M"]
    update_memory.plot([row], tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
