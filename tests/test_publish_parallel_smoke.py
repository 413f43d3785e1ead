"""A CI-sized run of the parallel-publish benchmark (benchmarks/publish_parallel.py): a tiny
Llama-shaped model, the library on 1 and 2 encode threads and on 2 gloo ranks, ``delta-swap
publish`` with its head cache, the busy load, the GIL check, the machine header and the table.

It checks that every configuration ran and that the thread count changes nothing of what is
stored, not this machine's speed."""

from __future__ import annotations

import asyncio

from benchmarks import publish_parallel as bench

SHAPES = bench.model_shapes(2, hidden=64, intermediate=128, vocab=256)


def test_library_rows_store_the_same_payload_on_any_thread_count(tmp_path) -> None:
    rows = [bench.measure_library(SHAPES, 2, threads, 1e-4, tmp_path) for threads in (1, 2)]
    assert rows[0]["payload_bytes"] == rows[1]["payload_bytes"] and all(rows[0]["payload_bytes"])
    assert all(len(r["seconds"]) == 2 and r["peak_rss_mb"] > 0 for r in rows)
    assert all(len(r["cpu_seconds"]) == 2 and min(r["cpu_seconds"]) > 0 for r in rows)
    queued = bench.measure_library(SHAPES, 2, 2, 1e-4, tmp_path, queued=True)
    assert queued["payload_bytes"] == rows[0]["payload_bytes"] and queued["mode"] == "library, queued"
    whole = bench.measure_library(SHAPES, 2, 2, 1e-4, tmp_path, whole=True)  # tensors this small: no parts anyway
    assert whole["payload_bytes"] == rows[0]["payload_bytes"] and whole["mode"] == "library, whole tensors"
    header, *lines = bench.summarize(rows)
    assert "s/step" in header and "peak RSS MB" in header
    assert [line.split()[:2] for line in lines] == [["library", "1"], ["library", "2"]]


def test_two_ranks_commit_the_same_snapshots_as_one(tmp_path) -> None:
    one = bench.measure_library(SHAPES, 2, 1, 1e-4, tmp_path)
    ranks = bench.measure_ranks(SHAPES, 2, 2, 1e-4, tmp_path)
    assert ranks["mode"] == "ranks x2" and len(ranks["seconds"]) == 2 and ranks["peak_rss_mb"] > 0
    assert ranks["model_bytes"] == one["model_bytes"]
    # both ranks did part of the work: the busiest rank's CPU time is below the ranks' total
    assert all(0 < busiest < total for busiest, total in zip(ranks["rank_cpu_seconds"], ranks["cpu_seconds"]))
    # each rank writes a shard of its own, so payloads differ by shard headers; the weights do not
    assert all(abs(a - b) < 64 for a, b in zip(ranks["payload_bytes"], one["payload_bytes"]))
    states = [asyncio.run(_last_state(tmp_path / name)) for name in ("library-1", "ranks-2")]
    assert sorted(states[0]) == sorted(states[1])
    assert all(bytes(states[0][n].data) == bytes(states[1][n].data) for n in states[0])


async def _last_state(folder):
    from delta_swap.chain import ChainReader
    from delta_swap.rebuild import rebuild
    from delta_swap.stores import FileStore

    store = FileStore(folder)
    reader = ChainReader(store)
    last = (await reader.list())[-1]
    return (await rebuild(store, last.snapshot_id, reader=reader))[1]


def test_load_processes_run_niced_and_stop() -> None:
    import os
    import time

    procs = bench.start_load(1)
    try:
        time.sleep(0.5)
        niced = min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)  # ten below this process, at most 19
        assert procs[0].poll() is None and os.getpriority(os.PRIO_PROCESS, procs[0].pid) == niced
    finally:
        bench.stop_load(procs)
    assert procs[0].poll() is not None


def test_cli_row_uses_the_head_cache(tmp_path) -> None:
    row = bench.measure_cli(SHAPES, 1, 1e-4, tmp_path, head_cache=True, threads=2)
    assert row["mode"] == "cli, head cache" and len(row["seconds"]) == 1 and row["payload_bytes"][0] > 0
    assert row["peak_rss_mb"] > 0 and bench.summarize([row])[1].startswith("cli, head cache")


def test_cli_watch_row_times_each_checkpoint_to_its_commit(tmp_path) -> None:
    row = bench.measure_cli_watch(SHAPES, 2, 1e-4, tmp_path, threads=1)
    one = bench.measure_library(SHAPES, 2, 1, 1e-4, tmp_path)
    assert row["mode"] == "cli watch" and len(row["seconds"]) == 2 and all(s > 0 for s in row["seconds"])
    assert row["payload_bytes"] == one["payload_bytes"] and row["peak_rss_mb"] > 0


def test_gil_check_and_machine_header() -> None:
    gil = bench.measure_gil(64, 256, 1e-4)
    assert gil["one_thread_s"] > 0 and gil["two_threads_s"] > 0
    cpu, cores = bench.machine()
    assert cpu.startswith("cpu: ") and "avx512_bf16" in cpu and "amx" in cpu and cores.startswith("cores allowed")
