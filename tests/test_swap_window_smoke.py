"""A CI-sized run of the swap-window benchmark (benchmarks/swap_window.py, figure 1) on vLLM: the
3M model on the in-place path, two RL-sized updates at 2% and two at 20% of elements changed, the engine's own reload of the same weights twice, and a restart,
then the table and the plot, as ``python -m benchmarks.swap_window`` makes them.

It checks what the figure claims, not this machine's speed: every update was served, its window is
the pause + swap + resume of the server's own timings and lies inside its publish-to-serving time,
and a restart stops generation far longer than an update does.
"""

from __future__ import annotations

import pytest

from benchmarks import swap_window

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    return swap_window.measure(
        "vllm", "3M", tmp_path_factory.mktemp("window"), updates=2, swap_path="inplace", changed=(0.02, 0.2)
    )


@pytest.fixture(scope="module")
def row(rows) -> dict:
    return rows[0]


def test_every_update_is_timed_from_the_servers_own_phases(row) -> None:
    assert row["engine"] == "vllm" and row["model_bytes"] > 1_000_000 and row["asked"] == "inplace"
    assert row["swap_path"] == "inplace", row["swap_path_reason"]  # vLLM keeps plain weights when asked, on any CPU
    assert len(row["updates"]) == 2
    for update in row["updates"]:
        timings = update["timings"]
        assert update["window_s"] == pytest.approx(sum(timings[p] for p in ("pause", "swap", "resume")))
        assert 0 < update["window_s"] < update["publish_to_serving_s"]
        assert {"fetch", "decode", "verify", "stage"} <= set(timings)


def test_a_sweep_of_the_changed_fraction_stages_more_elements_for_a_larger_fraction(rows) -> None:
    """A row per fraction from one server (the reload and restart shared); the in-place path
    writes the changed elements, so ten times the fraction stages several times the elements."""
    assert [r["changed"] for r in rows] == [0.02, 0.2]
    assert rows[0]["reload_s"] is rows[1]["reload_s"] and rows[0]["restart_s"] == rows[1]["restart_s"]
    few, many = (min(u["staged"] for u in r["updates"]) for r in rows)
    assert few > 0 and many > 5 * few, rows


def test_an_update_stops_generation_far_less_than_a_restart(row) -> None:
    assert len(row["reload_s"]) == 2 and all(r > 0 for r in row["reload_s"])
    assert max(u["window_s"] for u in row["updates"]) * 10 < row["restart_s"], row


def test_the_table_and_the_plot(row, tmp_path) -> None:
    header, line = swap_window.summarize([row])
    assert (
        "window" in header
        and "stage" in header
        and line.split()[:7] == ["vllm", "3M", line.split()[2], "1", "2.0%", "inplace", "inplace"]
    )
    assert swap_window.cpu_flags().count("=") == 2
    swap_window.plot([row], tmp_path / "window.png")
    assert (tmp_path / "window.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sweep_plot(rows, tmp_path) -> None:
    assert "20.0%" in swap_window.summarize(rows)[2]
    swap_window.plot_sweep(rows, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
