"""Figure 3: from the trainer's publish call to the server serving the new weights, against model
size, for delta-swap and for shipping a full checkpoint, on vLLM and SGLang (CPU).

    python -m benchmarks.publish_latency [--engines vllm sglang] [--sizes 25M 60M 100M 160M 350M] [--updates 5]

delta-swap: ``Publisher.publish`` of an RL-sized update (2% of elements, 1-3 ULP) until the
server's status reports the new step (encode, upload, commit, poll, fetch, decode, verify, swap).
Full checkpoint, in the same server: write the weights as a safetensors checkpoint folder, then the
engine's own reload from it (what a trainer without deltas does on one host). Prints medians and
writes docs/publish_latency.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    SIZES,
    Trainer,
    engine_reload,
    engine_server,
    make_model,
    model_bytes,
    served_after,
    status,
    wait_ready,
    wait_step,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"


def measure(engine: str, size: str, work: Path, updates: int) -> dict:
    model = make_model(work / "models", size)
    run = work / f"{engine}-{size}"
    trainer = Trainer(model, run / "store")
    delta, full = [], []
    try:
        with engine_server(engine, model, run / "server", store=run / "store") as server:
            wait_ready(server.url)
            for i in range(updates):
                trainer.advance()  # the synthetic training step is not part of the latency
                started = time.time()
                trainer.publish_current()
                delta.append(served_after(wait_step(server.url, trainer.step), started))
                start = time.perf_counter()
                folder = trainer.write_checkpoint(run / f"checkpoint-{i}")
                engine_reload(engine, server.url, folder, status(server.url)["current_snapshot_id"])
                full.append(time.perf_counter() - start)
    finally:
        trainer.close()
    return {"engine": engine, "size": size, "model_bytes": model_bytes(model), "delta_s": delta, "full_s": full}


def summarize(rows: list[dict]) -> list[str]:
    lines = [f"{'engine':<7} {'size':>5} {'model MB':>9} {'delta-swap s':>13} {'full checkpoint s':>18}"]
    for r in rows:
        lines.append(
            f"{r['engine']:<7} {r['size']:>5} {r['model_bytes'] / 1e6:>9.0f} "
            f"{statistics.median(r['delta_s']):>13.2f} {statistics.median(r['full_s']):>18.2f}"
        )
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = {"vllm": "tab:blue", "sglang": "tab:orange"}
    for engine in sorted({r["engine"] for r in rows}):
        mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["model_bytes"])
        x = [r["model_bytes"] / 1e6 for r in mine]
        ax.plot(
            x,
            [statistics.median(r["delta_s"]) for r in mine],
            "o-",
            color=colors[engine],
            label=f"{engine}: delta-swap publish -> serving",
        )
        ax.plot(
            x,
            [statistics.median(r["full_s"]) for r in mine],
            "s--",
            color=colors[engine],
            label=f"{engine}: write full checkpoint + engine reload",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model size (MB of bf16 weights)")
    ax.set_ylabel("seconds from publish to serving")
    ax.set_title("Publish-to-serving latency (one host, local file:// store, CPU)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["vllm", "sglang"], choices=["vllm", "sglang"])
    parser.add_argument("--sizes", nargs="+", default=["25M", "60M", "100M", "160M", "350M"], choices=list(SIZES))
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--workdir")
    parser.add_argument("--json", default=str(DOCS / "publish_latency.json"))
    parser.add_argument("--plot", default=str(DOCS / "publish_latency.png"))
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-latency-"))
    rows = []
    for engine in args.engines:
        for size in args.sizes:
            rows.append(measure(engine, size, work, args.updates))
            print(summarize(rows)[-1], flush=True)
    print("\n".join(summarize(rows)))
    Path(args.json).write_text(json.dumps(rows, indent=1))
    plot(rows, Path(args.plot))
    print(f"wrote {args.plot} and {args.json}")


if __name__ == "__main__":
    main()
