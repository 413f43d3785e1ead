"""Figure 4: host memory delta-swap adds during an update, over the model's bytes, on vLLM and SGLang.

    python -m benchmarks.update_memory [--engines vllm sglang] [--sizes 160M 350M] [--updates 5]
        [--keep-freed-memory off on]

Memory is that of the whole server process tree (``harness.tree_memory``): the proportional set
size of its processes, so pages shared between them count once, with the weight arenas counted as
the bytes their files hold in /dev/shm, whether or not a process has touched them yet. The anchor
is the same engine on the same model without delta-swap, sampled from launch until it has served
a few requests. The server with the plugin is sampled every 20 ms from launch through its first
sync (the base, while the engine still holds the weights it loaded), then while a trainer publishes
``--updates`` RL-sized updates. Prints, over the model's bytes: what delta-swap adds at the peak
of the first sync (over the plain server's own start-up peak), between updates, and at the peak
during updates (both over the plain server in steady state), and the swap path the server took
(``auto`` takes ``shadow`` where vLLM repacked its weights: one spare copy of the changed modules
until each swap is final); writes docs/update_memory.png. ``--keep-freed-memory off on`` measures
each (engine, size) once more with ``Settings.keep_freed_memory`` (vLLM: the server keeps the
memory an update frees for the next one; ``+keep`` in the table).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.harness import (
    MODEL_NAME,
    MOE_SIZES,
    SIZES,
    Trainer,
    add_keep_freed_memory_option,
    engine_server,
    make_model,
    model_bytes,
    path_label,
    status,
    tree_memory,
    wait_ready,
    wait_step,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"


class Sampler:
    """Samples a process tree's memory in a background thread."""

    def __init__(self, pid: int, every_s: float = 0.02) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(tree_memory(self.pid))
            self._stop.wait(self.every_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)


def _warm(url: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "warm the engine up", "max_tokens": 8, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()


def measure(engine: str, size: str, work: Path, updates: int, keep: bool = False) -> dict:
    model = make_model(work / "models", size)
    run = work / f"{engine}-{size}{'-keep' if keep else ''}"
    for folder in ("plain", "plugin"):  # fresh servers: a reused folder's freshness record would refuse the new base
        shutil.rmtree(run / folder, ignore_errors=True)
    with engine_server(engine, model, run / "plain", store=None, wait=False) as server:
        with Sampler(server.proc.pid) as plain_start:
            server.wait_healthy(900)
            _warm(server.url)
        time.sleep(2)
        plain = tree_memory(server.proc.pid)
    trainer = Trainer(model, run / "store")
    try:
        settings = {"keep_freed_memory": keep}
        with engine_server(engine, model, run / "plugin", store=run / "store", settings=settings, wait=False) as server:
            with Sampler(server.proc.pid) as first_sync:
                server.wait_healthy(900)
                wait_ready(server.url)
                _warm(server.url)
            time.sleep(2)
            with Sampler(server.proc.pid) as sampler:
                for _ in range(updates):
                    trainer.publish_next()
                    wait_step(server.url, trainer.step)
            time.sleep(2)
            steady = tree_memory(server.proc.pid)
            st = status(server.url)
    finally:
        trainer.close()
    size_b = model_bytes(model)
    return {
        "engine": engine,
        "size": size,
        "swap_path": st.get("swap_path"),
        "keep_freed_memory": keep,
        "freed_memory": st.get("freed_memory"),
        "model_bytes": size_b,
        "plain": plain,
        "plain_start_peak": plain_start.peak,
        "first_sync_peak": first_sync.peak,
        "steady": steady,
        "update_peak": sampler.peak,
        "first_sync_over_model": (first_sync.peak - plain_start.peak) / size_b,
        "steady_over_model": (steady - plain) / size_b,
        "update_peak_over_model": (sampler.peak - plain) / size_b,
    }


def _path(row: dict) -> str:
    return path_label(row.get("swap_path") or "-", bool(row.get("keep_freed_memory")))


def summarize(rows: list[dict]) -> list[str]:
    lines = [
        f"{'engine':<7} {'size':>8} {'path':>11} {'model MB':>9} {'plain MB':>9} {'steady MB':>10} {'update peak MB':>15} "
        f"{'added/model: first sync':>24} {'between updates':>16} {'update peak':>12}"
    ]
    for r in rows:
        lines.append(
            f"{r['engine']:<7} {r['size']:>8} {_path(r):>11} {r['model_bytes'] / 1e6:>9.0f} {r['plain'] / 1e6:>9.0f} "
            f"{r['steady'] / 1e6:>10.0f} {r['update_peak'] / 1e6:>15.0f} {r['first_sync_over_model']:>24.2f} "
            f"{r['steady_over_model']:>16.2f} {r['update_peak_over_model']:>12.2f}"
        )
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    labels = [f"{r['engine']} {_path(r)}\n{r['size']} ({r['model_bytes'] / 1e6:.0f} MB)" for r in rows]
    x = range(len(rows))
    series = [
        ("first sync (peak)", "first_sync_over_model"),
        ("between updates", "steady_over_model"),
        ("during updates (peak)", "update_peak_over_model"),
    ]
    for k, (label, key) in enumerate(series):
        bars = ax.bar([i + (k - 1) * 0.27 for i in x], [r[key] for r in rows], 0.27, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.3, color="gray", linestyle="--", linewidth=1, label="1.3x target")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("host memory added by delta-swap / model bytes")
    ax.set_title("Memory delta-swap adds to a server (process tree, arenas included, vs the plain engine)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["vllm", "sglang"], choices=["vllm", "sglang"])
    parser.add_argument("--sizes", nargs="+", default=["160M", "350M"], choices=[*SIZES, *MOE_SIZES])
    parser.add_argument("--updates", type=int, default=5)
    add_keep_freed_memory_option(parser)
    parser.add_argument("--workdir")
    parser.add_argument("--json", default=str(DOCS / "update_memory.json"))
    parser.add_argument("--plot", default=str(DOCS / "update_memory.png"))
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-memory-"))
    rows = []
    for engine in args.engines:
        for size in args.sizes:
            for keep in args.keep_freed_memory:
                rows.append(measure(engine, size, work, args.updates, keep == "on"))
                print(summarize(rows)[-1], flush=True)
    print("\n".join(summarize(rows)))
    Path(args.json).write_text(json.dumps(rows, indent=1))
    plot(rows, Path(args.plot))
    print(f"wrote {args.plot} and {args.json}")


if __name__ == "__main__":
    main()
