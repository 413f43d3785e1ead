"""A CI-sized run of the scale benchmark (benchmarks/scale.py): a tiny Llama on vLLM, pinned to one
core in a process of its own as ``python -m benchmarks.scale`` runs each size, two RL-sized
updates each timed phase by phase beside the full-checkpoint path, then the table and the plot.
Its server keeps the memory updates free (``--keep-freed-memory on``), as the status confirms.

It checks that every phase was measured and accounted for, not this machine's speed.
"""

from __future__ import annotations

import pytest

from benchmarks import scale

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def row(tmp_path_factory) -> dict:
    return scale.run_pinned("tiny", 1, tmp_path_factory.mktemp("scale"), steps=2, level=1, keep=True)


def test_every_step_is_timed_phase_by_phase_on_one_core(row) -> None:
    assert row["size"] == "tiny" and row["cores"] == 1 and row["level"] == 1
    assert row["encode_threads"] == 1  # the publisher encodes on the cores it may use: one
    assert row["asked_swap_path"] == "auto" and row["swap_path"] in {"arena", "inplace", "shadow", "reload"}
    assert row["keep_freed_memory"] and row["freed_memory"] == "kept for the next update", row
    assert len(row["steps"]) == 2
    for step in row["steps"]:
        assert step["payload_bytes"] and step["payload_bytes"] < row["model_bytes"] / 5  # a delta, not a base
        assert {"fetch", "decode", "verify", "pause", "swap"} <= set(step["server"])
        assert 0 < step["publish_s"] < step["serving_s"]  # serving waits for the publish, then the server
        assert 0 < step["publish_cpu_s"] and 0 <= step["publish_sys_s"] <= step["publish_cpu_s"]
        assert step["write_s"] > 0 and step["reload_s"] > 0
    assert row["trainer_peak_bytes"] > row["model_bytes"] and row["server_peak_bytes"] > row["model_bytes"]


def test_the_table_and_the_plot(row, tmp_path) -> None:
    header, line = scale.summarize([row])
    assert (
        "publish s" in header
        and "CPU s" in header
        and "reload s" in header
        and line.split()[:4] == ["tiny", f"{row['model_bytes'] / 1e6:.0f}", "1", row["swap_path"] + "+keep"]
    )
    failed = {"size": "3G", "cores": 2, "asked_swap_path": "auto", "failed": "killed (SIGKILL: out of memory?)"}
    assert scale.summarize([row, failed])[-1].split()[:5] == ["3G", "-", "2", "auto", "failed:"]
    scale.plot([row, failed], tmp_path / "scale.png")  # a size that did not fit is left out of the plot
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_killed_runs_server_is_stopped_only_if_it_is_still_the_same_process(tmp_path) -> None:
    """A run killed for memory leaves its server (a process group of its own) holding memory the
    next run needs: the benchmark kills that group, but not a process that took its number since."""
    import subprocess
    import sys

    def orphan() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)

    run = tmp_path / "1G-1core-auto"
    run.mkdir()
    same, other = orphan(), orphan()
    try:
        (run / scale.SERVER_GROUP).write_text(f"{other.pid} 1")  # a number reused by another process
        scale._stop_orphaned_server(run)
        assert other.poll() is None
        (run / scale.SERVER_GROUP).write_text(f"{same.pid} {scale._started(same.pid)}")
        scale._stop_orphaned_server(run)
        assert same.wait(10) == -9
    finally:
        for proc in (same, other):
            proc.kill()
            proc.wait()
