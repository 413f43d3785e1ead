"""Figure 1: how long an engine generates nothing per update, against model size, for delta-swap,
the engine's own full reload of the same weights, and a restart, on vLLM and SGLang (CPU).

    python -m benchmarks.swap_window [--engines vllm sglang] [--sizes 25M 60M 100M 160M 350M 540M moe-45M moe-190M] [--updates 5]
                                     [--swap-paths auto inplace arena shadow reload] [--no-restart]
                                     [--changed 0.02 | --changed 0.001 0.005 0.02 0.1] [--tp 1 2]

For each engine, size, path and tensor-parallel size (``--tp``, one core per rank): a server
follows a store while a trainer publishes RL-sized updates (``--changed``: the fraction of
elements moved by 1-3 ULP per step, 2% by default); delta-swap's window is the server's pause +
swap + resume time of each update. Several fractions make a sweep in one server (a row per
fraction, ``--updates`` each): on the in-place path the window grows with the changed elements,
not with the model; the status's staged elements are recorded per update. In the same server the engine then reloads the same weights itself (vLLM:
``reload_weights`` from a folder, its layerwise reload; SGLang: ``update_weights_from_disk``),
which blocks generation for its whole duration. Last, a fresh server is started on the model.
Each ``--swap-paths`` entry is a server of its own (``Settings.swap_path``; the status says which
path it took and why, e.g. ``auto`` takes ``shadow`` where vLLM repacked its weights for AMX or
AVX512-BF16). Prints the CPU flags that decide the path, then a table (medians) with the stage
(before the pause), each phase of the window, the window / reload ratio, and writes
docs/swap_window.png and a JSON of every measurement. Also records each update's
publish-to-serving latency.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    MOE_SIZES,
    SIZES,
    Trainer,
    add_swap_paths_option,
    engine_reload,
    engine_server,
    make_model,
    model_bytes,
    restart_time,
    served_after,
    status,
    wait_ready,
    wait_step,
)
from benchmarks.machine import cpu_flags
from benchmarks.netlab import exit_on_signal
from examples.servers.process import device

WINDOW_PHASES = ("pause", "swap", "resume")
DOCS = Path(__file__).resolve().parents[1] / "docs"


def measure(
    engine: str,
    size: str,
    work: Path,
    updates: int,
    swap_path: str = "auto",
    restart: bool = True,
    changed: Sequence[float] = (0.02,),
    tp: int = 1,
) -> list[dict]:
    """One server of ``engine`` on a ``size`` model at ``tp`` tensor-parallel ranks: ``updates``
    RL-sized updates at each fraction of ``changed`` (a row each), then the engine's own reload of
    the same weights (shared by the rows) and, if asked, a restart."""
    model = make_model(work / "models", size)
    run = work / f"{engine}-{size}-{swap_path}-tp{tp}"
    shutil.rmtree(run / "server", ignore_errors=True)  # a fresh server: it would refuse a new run's base
    trainer = Trainer(model, run / "store")
    rows: list[dict] = []
    try:
        with engine_server(
            engine, model, run / "server", store=run / "store", settings={"swap_path": swap_path}, tp=tp
        ) as server:
            wait_ready(server.url)
            for fraction in changed:
                trainer.fraction = fraction
                row: dict = {
                    "engine": engine,
                    "size": size,
                    "asked": swap_path,
                    "changed": fraction,
                    "tp": tp,
                    "model_bytes": model_bytes(model),
                    "updates": [],
                }
                for _ in range(updates):
                    trainer.advance()  # the synthetic training step is not part of the latency
                    started = time.time()
                    publish_s = trainer.publish_current()
                    st = wait_step(server.url, trainer.step)
                    timings = st["last_update_timings_s"]
                    row["updates"].append(
                        {
                            "window_s": sum(timings.get(p, 0.0) for p in WINDOW_PHASES),
                            "publish_s": publish_s,
                            "publish_to_serving_s": served_after(st, started),
                            "timings": timings,
                            "staged": (st.get("last_staged") or {}).get("elements"),
                        }
                    )
                rows.append(row)
            st = status(server.url)
            folder = trainer.write_checkpoint(run / "checkpoint")
            reload_s = [engine_reload(engine, server.url, folder, st["current_snapshot_id"]) for _ in range(updates)]
            for row in rows:
                row.update(
                    swap_path=st.get("swap_path"), swap_path_reason=st.get("swap_path_reason"), reload_s=reload_s
                )
    finally:
        trainer.close()
    restart_s = restart_time(engine, model, run / "restart", tp) if restart else None
    for row in rows:
        row["restart_s"] = restart_s
    return rows


def _median_phase(r: dict, phase: str) -> float:
    return statistics.median(u["timings"].get(phase, 0.0) for u in r["updates"])


def summarize(rows: list[dict]) -> list[str]:
    lines = [
        f"{'engine':<7} {'size':>8} {'model MB':>9} {'TP':>2} {'changed':>7} {'asked':>7} {'path':>7} {'stage ms':>9} {'pause':>6} "
        f"{'swap':>7} {'resume':>6} {'window ms':>10} {'engine reload ms':>17} {'ratio':>6} {'restart s':>10} "
        f"{'publish->serving s':>19}"
    ]
    for r in rows:
        window = statistics.median(u["window_s"] for u in r["updates"])
        reload = statistics.median(r["reload_s"])
        latency = statistics.median(u["publish_to_serving_s"] for u in r["updates"])
        restart = "-" if r.get("restart_s") is None else f"{r['restart_s']:.1f}"
        phases = [1000 * _median_phase(r, p) for p in ("stage", "pause", "swap", "resume")]
        lines.append(
            f"{r['engine']:<7} {r['size']:>8} {r['model_bytes'] / 1e6:>9.0f} {r.get('tp', 1):>2} "
            f"{r.get('changed', 0.02):>7.1%} "
            f"{r.get('asked', 'auto'):>7} "
            f"{r.get('swap_path') or '-':>7} {phases[0]:>9.1f} {phases[1]:>6.1f} {phases[2]:>7.1f} {phases[3]:>6.1f} "
            f"{1000 * window:>10.1f} {1000 * reload:>17.1f} {window / reload:>6.3f} {restart:>10} {latency:>19.2f}"
        )
    return lines


def _family(size: str) -> str:
    return "qwen3-moe" if size in MOE_SIZES else "llama"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.8))
    colors = {"vllm": "tab:blue", "sglang": "tab:orange"}
    styles = iter(["o-", "D-", "v-", "P-"] * 4)

    def key(r: dict) -> tuple:
        return r["engine"], r.get("asked", "auto"), r.get("tp", 1), _family(r["size"])

    for engine, asked, tp, family in sorted({key(r) for r in rows}):
        mine = sorted((r for r in rows if key(r) == (engine, asked, tp, family)), key=lambda r: r["model_bytes"])
        taken_at = (f" TP {tp}" if tp > 1 else "") + (f" {family}" if family != "llama" else "")
        taken = "/".join(sorted({str(r.get("swap_path")) for r in mine}))
        x = [r["model_bytes"] / 1e6 for r in mine]
        ax.plot(
            x,
            [statistics.median(u["window_s"] for u in r["updates"]) for r in mine],
            next(styles),
            color=colors[engine],
            label=f"{engine}{taken_at}: delta-swap, {taken} path (pause + swap)",
        )
        ax.plot(
            x,
            [statistics.median(r["reload_s"]) for r in mine],
            "s--",
            color=colors[engine],
            label=f"{engine}{taken_at}: engine's own reload ({taken} server)",
        )
        restarts = [(xi, r["restart_s"]) for xi, r in zip(x, mine, strict=True) if r.get("restart_s") is not None]
        if restarts:
            ax.plot(
                *zip(*restarts, strict=True),
                "^:",
                color=colors[engine],
                alpha=0.6,
                label=f"{engine}{taken_at}: restart",
            )
    _finish(
        fig,
        ax,
        path,
        "model size (MB of bf16 weights)",
        "No-generation window per update ({where}; 2% of elements change per step)",
    )


def plot_sweep(rows: list[dict], path: Path) -> None:
    """The window against the fraction of elements that change, a line per engine, size and path,
    with the engine's own reload of the same server as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.8))
    styles = iter(["o-", "D-", "v-", "P-", "s-", "^-"] * 4)

    def key(r: dict) -> tuple:
        return r["engine"], r["size"], r.get("asked", "auto"), r.get("tp", 1)

    for which in sorted({key(r) for r in rows}):
        mine = sorted((r for r in rows if key(r) == which), key=lambda r: r["changed"])
        x = [100 * r["changed"] for r in mine]
        at = f" TP {which[3]}" if which[3] > 1 else ""
        label = f"{which[0]}{at} {mine[0]['model_bytes'] / 1e6:.0f} MB, {mine[0].get('swap_path')} path"
        line = ax.plot(
            x, [statistics.median(u["window_s"] for u in r["updates"]) for r in mine], next(styles), label=label
        )
        ax.axhline(
            statistics.median(mine[0]["reload_s"]),
            ls="--",
            color=line[0].get_color(),
            alpha=0.7,
            label=f"{which[0]}{at} {mine[0]['model_bytes'] / 1e6:.0f} MB: engine's own reload",
        )
    _finish(
        fig, ax, path, "elements changed per step (%)", "No-generation window against the changed fraction ({where})"
    )


def _finish(fig: Any, ax: Any, path: Path, xlabel: str, title: str) -> None:
    """Log axes, labels, the ``title`` (``{where}``: CPU or GPU), grid and legend; save to ``path``."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds without generation per update")
    where = f"CPU with {cpu_flags().split('; ')[-1]}, {os.cpu_count()} cores" if device() == "cpu" else "one GPU"
    ax.set_title(title.format(where=where), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["vllm", "sglang"], choices=["vllm", "sglang"])
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["25M", "60M", "100M", "160M", "350M"],
        choices=[*SIZES, *MOE_SIZES],
        help="Llama sizes, or moe-* (Qwen3-MoE)",
    )
    parser.add_argument("--updates", type=int, default=5)
    add_swap_paths_option(parser, "the table shows the path each server took")
    parser.add_argument("--no-restart", action="store_true", help="skip timing a fresh server's start")
    parser.add_argument("--tp", nargs="+", type=int, default=[1], help="tensor-parallel sizes (one core per rank)")
    parser.add_argument(
        "--changed", nargs="+", type=float, default=[0.02], help="fractions of elements each step moves (a sweep)"
    )
    parser.add_argument("--workdir", help="models and stores (default: a temp dir; models are cached there)")
    parser.add_argument("--json", default=str(DOCS / "swap_window.json"))
    parser.add_argument("--plot", default=str(DOCS / "swap_window.png"))
    args = parser.parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # killed: the servers' context managers stop them
        signal.signal(sig, exit_on_signal)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-window-"))
    rows = []
    print(f"CPU: {cpu_flags()}; device: {device()}", flush=True)
    print(summarize([])[0], flush=True)
    for engine in args.engines:
        for size in args.sizes:
            for swap_path in args.swap_paths:
                for tp in args.tp:
                    mine = measure(engine, size, work, args.updates, swap_path, not args.no_restart, args.changed, tp)
                    rows.extend(mine)
                    print("\n".join(summarize(mine)[1:]), f"({mine[-1].get('swap_path_reason')})", flush=True)
    print(f"CPU: {cpu_flags()}; device: {device()}")
    print("\n".join(summarize(rows)))
    Path(args.json).write_text(json.dumps(rows, indent=1))
    (plot_sweep if len(args.changed) > 1 else plot)(rows, Path(args.plot))
    print(f"wrote {args.plot} and {args.json}")


if __name__ == "__main__":
    main()
