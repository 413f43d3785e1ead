"""Publish at scale (issue #25): the whole path, from the trainer's publish call to a live vLLM
server serving the new weights, against model size and the number of cores, beside the
full-checkpoint alternative in the same server.

    PYTHONPATH=$(bash scripts/import_root.sh):. python -m benchmarks.scale [--sizes 0.1G 0.5G 1G 2G 3G]
        [--cores 1 2] [--steps 2] [--level 2] [--swap-paths auto arena] [--keep-freed-memory off on]
        [--workdir DIR]

Models are random Llama checkpoints (hidden 2048, MLP 5632, 16 heads of which 4 for k/v, vocab
512: ~90 MB of bf16 per layer), so 3G is a 1.5B-parameter model, the largest that fits this
project's 24 GiB machine beside a live server, a trainer holding the weights and the publisher's
head. Each (size, cores) runs in a process of its own pinned to the first ``cores`` cores (the
server it starts inherits the pinning; the publisher encodes on as many threads): a base is
published and served, then ``--steps`` RL-sized updates (2% of the elements move by 1-3 ULP:
benchmarks/harness.py), each timed as

* publish: ``Publisher.publish`` + ``flush`` (host copy, encode, upload to a file:// store,
  commit), with its model MB/s and the trainer process's CPU seconds in it (user + system, and
  system alone: page faults, the kernel zeroing fresh pages);
* the server's phases from its status (``last_update_timings_s``): fetch, decode, verify, and
  the swap (stage before the pause, pause + swap + resume);
* publish -> serving: from the publish call until the server's status reports the step;

and, in the same server, the full-checkpoint alternative: write the weights as a safetensors
folder, then vLLM's own ``reload_weights`` from it. Before the publish and before the write,
``os.sync()`` (untimed) writes back what is dirty, so neither side pays for the other's writes.
Peak host memory: the trainer process's (``ru_maxrss``, which includes the trainer's own copy of
the weights) and the server's (the sum of ``VmHWM`` over its process tree). Prints the CPU and its flags, a table of medians, writes
docs/scale.png and a JSON of every measurement. ``tests/test_scale_smoke.py`` runs a CI-sized one.

The server swaps on the path its CPU gives it (``auto``: the arena where vLLM keeps plain weights,
the shadow build where it repacks them for oneDNN or AMX); ``--swap-paths`` runs each (size,
cores) once per path asked (``Settings.swap_path``: ``arena`` makes vLLM keep plain weights on any
CPU), and the table says which path each server took. ``--keep-freed-memory off on`` runs each
once more with ``Settings.keep_freed_memory`` (the server keeps the memory an update frees for the
next one: ``+keep`` in the table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    Trainer,
    add_keep_freed_memory_option,
    add_swap_paths_option,
    engine_reload,
    engine_server,
    model_bytes,
    path_label,
    process_tree,
    served_after,
    wait_ready,
    wait_step,
)
from benchmarks.machine import cpu_flags
from benchmarks.netlab import exit_on_signal
from delta_swap.codec import CodecConfig
from delta_swap.publisher import PublisherConfig
from examples.tiny_model import make_tiny_model

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: Layers of the 2048-wide Llama shape per size (~90 MB of bf16 each, plus 4 MB of embeddings).
SIZES = {"tiny": 0, "0.1G": 1, "0.5G": 6, "1G": 11, "2G": 22, "3G": 33}
SHAPE = {"hidden_size": 2048, "intermediate_size": 5632, "num_heads": 16, "num_kv_heads": 4}
TINY = {"hidden_size": 256, "intermediate_size": 768, "num_heads": 4, "num_kv_heads": 2, "num_layers": 2}
SERVER_PHASES = ("fetch", "decode", "verify", "stage", "pause", "swap", "resume")
#: The file in a run's folder naming its server's process group.
SERVER_GROUP = "server.pgid"


def run_folder(work: Path, size: str, cores: int, swap_path: str, keep: bool = False) -> Path:
    """Where one (size, cores, swap path, freed memory kept or not) run keeps its store, server and results."""
    return work / f"{size}-{cores}core-{swap_path}{'-keep' if keep else ''}"


def make_model(root: Path, size: str) -> Path:
    """The random Llama checkpoint of ``size`` (cached in ``root``)."""
    folder = root / f"llama-{size}"
    if not (folder / "model.safetensors").exists():
        shape = TINY if size == "tiny" else {**SHAPE, "num_layers": SIZES[size]}
        make_tiny_model(folder, vocab_size=512, init_std=0.02, **shape)
    return folder


def tree_peak_rss(pid: int) -> int:
    """Bytes: the sum of every process's peak resident set (``VmHWM``) in ``pid``'s tree."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def measure_one(
    size: str, cores: int, work: Path, steps: int, level: int, swap_path: str = "auto", keep: bool = False
) -> dict:
    """One (size, cores) run in this process (already pinned by the caller), its server asked for
    ``swap_path`` and, with ``keep``, to keep the memory updates free (``keep_freed_memory``)."""
    model = make_model(work / "models", size)
    run = run_folder(work, size, cores, swap_path, keep)
    (run / SERVER_GROUP).unlink(missing_ok=True)  # an earlier run's server is gone, and its number may be reused
    started = time.perf_counter()
    config = PublisherConfig(base_every=10_000, codec=CodecConfig(level=level))  # every allowed core
    trainer = Trainer(model, run / "store", publisher_config=config)  # publishes the base (untimed)
    base_s = time.perf_counter() - started
    row: dict = {"size": size, "cores": cores, "level": level, "model_bytes": model_bytes(model), "base_s": base_s}
    row["asked_swap_path"] = swap_path
    row["keep_freed_memory"] = keep
    row |= {"steps": [], "encode_threads": trainer.publisher.encode_threads}
    try:
        settings = {"swap_path": swap_path, "keep_freed_memory": keep}
        with engine_server("vllm", model, run / "server", store=run / "store", settings=settings, wait=False) as server:
            # for the caller, should this process be killed (most likely while the server loads)
            (run / SERVER_GROUP).write_text(f"{server.proc.pid} {_started(server.proc.pid)}")
            server.wait_healthy(900)
            st = wait_ready(server.url)
            row["swap_path"] = st.get("swap_path")
            row["swap_path_reason"] = st.get("swap_path_reason")
            row["freed_memory"] = st.get("freed_memory")
            for i in range(steps):
                trainer.advance()
                os.sync()  # each side starts with no dirty pages of the other's to write back
                before = resource.getrusage(resource.RUSAGE_SELF)
                started = time.time()
                publish_s = trainer.publish_current()
                used = resource.getrusage(resource.RUSAGE_SELF)
                st = wait_step(server.url, trainer.step, timeout=3600)
                serving_s = served_after(st, started)
                manifest = trainer.publisher.last_manifest
                os.sync()
                start = time.perf_counter()
                folder = trainer.write_checkpoint(run / f"checkpoint-{i}")
                write_s = time.perf_counter() - start
                reload_s = engine_reload("vllm", server.url, folder, st["current_snapshot_id"])
                row["steps"].append(
                    {
                        "publish_s": publish_s,
                        # the trainer process's CPU in the publish: its threads' user and system time
                        "publish_cpu_s": used.ru_utime - before.ru_utime + used.ru_stime - before.ru_stime,
                        "publish_sys_s": used.ru_stime - before.ru_stime,
                        "serving_s": serving_s,
                        "payload_bytes": manifest.payload_bytes if manifest else None,
                        "server": st.get("last_update_timings_s", {}),
                        "write_s": write_s,
                        "reload_s": reload_s,
                    }
                )
                for old in run.glob("checkpoint-*"):
                    subprocess.run(["rm", "-rf", str(old)], check=False)
            row["server_peak_bytes"] = tree_peak_rss(server.proc.pid)
    finally:
        (run / SERVER_GROUP).unlink(missing_ok=True)  # the server was stopped on the way out
        trainer.close()
    row["trainer_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return row


def run_pinned(
    size: str, cores: int, work: Path, steps: int, level: int, swap_path: str = "auto", keep: bool = False
) -> dict:
    """:func:`measure_one` in a child process pinned to the first ``cores`` allowed cores."""
    allowed = sorted(os.sched_getaffinity(0))[:cores]
    out = run_folder(work, size, cores, swap_path, keep).with_suffix(".json")
    cmd = [sys.executable, "-m", "benchmarks.scale", "--one", size, "--cores", str(cores)]
    cmd += ["--steps", str(steps), "--level", str(level), "--workdir", str(work), "--json", str(out)]
    cmd += ["--swap-paths", swap_path, "--keep-freed-memory", "on" if keep else "off"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, allowed))}
    subprocess.run(cmd, check=True, env=env, preexec_fn=lambda: os.sched_setaffinity(0, allowed))
    return json.loads(out.read_text())


def run_or_failure(size: str, cores: int, work: Path, steps: int, level: int, swap_path: str, keep: bool) -> dict:
    """:func:`run_pinned`, or a row that says why it failed (a size that does not fit the host's
    memory is killed by the kernel: the table shows it instead of losing the other rows)."""
    try:
        return run_pinned(size, cores, work, steps, level, swap_path, keep)
    except subprocess.CalledProcessError as exc:
        _stop_orphaned_server(run_folder(work, size, cores, swap_path, keep))
        why = "killed (SIGKILL: out of memory?)" if exc.returncode == -signal.SIGKILL else f"exit code {exc.returncode}"
        return {"size": size, "cores": cores, "asked_swap_path": swap_path, "keep_freed_memory": keep, "failed": why}


def _stop_orphaned_server(run: Path) -> None:
    """Kill the server a killed run left behind (its own process group: a run killed for memory
    cannot stop it, and it would hold the memory the next run needs), if the process of that
    number is still the one that run started."""
    try:
        pid, started = (run / SERVER_GROUP).read_text().split()
        if _started(int(pid)) == started:
            os.killpg(int(pid), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def _started(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, from /proc), or "-" if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "-"


def _median(row: dict, get) -> float:
    return statistics.median(get(s) for s in row["steps"])


def _path(row: dict, path: str) -> str:
    return path_label(path, bool(row.get("keep_freed_memory")))


def summarize(rows: list[dict]) -> list[str]:
    head = f"{'size':>5} {'MB':>6} {'cores':>5} {'path':>11} {'publish s':>9} {'MB/s':>6} {'CPU s':>6} {'sys s':>6}"
    head += "".join(f" {p + ' s':>9}" for p in SERVER_PHASES)
    head += f" {'->serving s':>11} {'write s':>8} {'reload s':>8} {'full s':>7} {'ratio':>6}"
    head += f" {'trainer GB':>10} {'server GB':>9}"
    lines = [head]
    for r in rows:
        if "failed" in r:
            lines.append(
                f"{r['size']:>5} {'-':>6} {r['cores']:>5} {_path(r, r['asked_swap_path']):>11} failed: {r['failed']}"
            )
            continue
        mb = r["model_bytes"] / 1e6
        publish = _median(r, lambda s: s["publish_s"])
        serving = _median(r, lambda s: s["serving_s"])
        full = _median(r, lambda s: s["write_s"] + s["reload_s"])
        path = _path(r, r.get("swap_path") or "-")
        line = f"{r['size']:>5} {mb:>6.0f} {r['cores']:>5} {path:>11} {publish:>9.2f} {mb / publish:>6.0f}"
        line += f" {_median(r, lambda s: s.get('publish_cpu_s', math.nan)):>6.2f}"
        line += f" {_median(r, lambda s: s.get('publish_sys_s', math.nan)):>6.2f}"
        line += "".join(f" {_median(r, lambda s, p=p: s['server'].get(p, 0.0)):>9.2f}" for p in SERVER_PHASES)
        line += (
            f" {serving:>11.2f} {_median(r, lambda s: s['write_s']):>8.2f} {_median(r, lambda s: s['reload_s']):>8.2f}"
        )
        line += f" {full:>7.2f} {serving / full:>6.2f}"
        line += f" {r['trainer_peak_bytes'] / 1e9:>10.2f} {r['server_peak_bytes'] / 1e9:>9.2f}"
        lines.append(line)
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10.5, 4.5))
    colors = iter(("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"))
    rows = [r for r in rows if "failed" not in r]

    def line_of(r: dict) -> tuple:  # one line per core count, path asked and taken, and freed memory kept or not
        return r["cores"], r.get("asked_swap_path", "auto"), r.get("swap_path") or "-", bool(r.get("keep_freed_memory"))

    for key in sorted({line_of(r) for r in rows}):
        mine = sorted((r for r in rows if line_of(r) == key), key=lambda r: r["model_bytes"])
        cores, asked, taken, keep = key
        color = next(colors, "tab:gray")
        which = f"{cores} core(s), {path_label(taken, keep)} path" + (
            f" ({asked})" if asked not in ("auto", taken) else ""
        )
        x = [r["model_bytes"] / 1e9 for r in mine]
        ax.plot(
            x,
            [_median(r, lambda s: s["serving_s"]) for r in mine],
            "o-",
            color=color,
            label=f"{which}: publish -> serving",
        )
        ax.plot(
            x,
            [_median(r, lambda s: s["publish_s"]) for r in mine],
            "^:",
            color=color,
            label=f"{which}: of which publish",
        )
        full = [_median(r, lambda s: s["write_s"] + s["reload_s"]) for r in mine]
        ax.plot(x, full, "s--", color=color, label=f"{which}: write checkpoint + vLLM reload")
    ax.set_xlabel("model size (GB of bf16 weights)")
    ax.set_ylabel("seconds per step")
    ax.set_title("Publish -> serving at scale (one host, file:// store, vLLM CPU)", fontsize=9)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the lines, not over them
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["0.1G", "0.5G", "1G", "2G", "3G"], choices=list(SIZES))
    parser.add_argument("--cores", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=2, help="timed delta steps per run")
    parser.add_argument("--level", type=int, default=2, help="codec level (CodecConfig.level)")
    add_swap_paths_option(parser, "the table shows the path each server took")
    add_keep_freed_memory_option(parser)
    parser.add_argument("--workdir", help="models are cached here between runs")
    parser.add_argument("--json", default=str(DOCS / "scale.json"))
    parser.add_argument("--plot", default=str(DOCS / "scale.png"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one pinned run
    args = parser.parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_on_signal)  # servers stop on the way out
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-scale-"))
    if args.one:
        keep = args.keep_freed_memory[0] == "on"
        row = measure_one(args.one, args.cores[0], work, args.steps, args.level, args.swap_paths[0], keep)
        Path(args.json).write_text(json.dumps(row))
        return
    cpu = cpu_flags()
    print(f"CPU: {cpu}; {len(os.sched_getaffinity(0))} cores allowed; codec level {args.level}", flush=True)
    rows = []
    for size in args.sizes:
        for cores in args.cores:
            for swap_path in args.swap_paths:
                for keep in args.keep_freed_memory:
                    rows.append(run_or_failure(size, cores, work, args.steps, args.level, swap_path, keep == "on"))
                    print(summarize(rows)[-1] if len(rows) > 1 else "\n".join(summarize(rows)), flush=True)
    print("\n".join(summarize(rows)))
    Path(args.json).write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    plot(rows, Path(args.plot))
    print(f"wrote {args.plot} and {args.json}")


if __name__ == "__main__":
    main()
