"""What the post-swap verification costs: the no-generation window per update with
``verify_swaps`` always, never and auto (the default), side by side, on the same model in one
run (vLLM, reload path).

    python -m benchmarks.verify_cost [--sizes 25M 100M] [--updates 10]

For each size, three plugin servers follow the same kind of RL-sized updates (2% of elements moved
by 1-3 ULP); the table shows the mean window (pause + swap + resume) under each policy, the
workers' own verification time, the overhead of always, and under auto how many swaps were read
back and the overhead over never, with the CPU flags that decide vLLM's weight layout. auto keeps
the read-backs within 10% of the windows on average (every swap where that allows).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import SIZES, Trainer, engine_server, make_model, model_bytes, status, wait_ready, wait_step
from benchmarks.machine import cpu_flags

WINDOW_PHASES = ("pause", "swap", "resume")


POLICIES = ("always", "never", "auto")


def measure(size: str, work: Path, updates: int, verify: str) -> dict:
    """One server with ``verify_swaps=verify`` following ``updates`` updates of a ``size`` model."""
    model = make_model(work / "models", size)
    run = work / f"{size}-verify-{verify}"
    trainer = Trainer(model, run / "store")
    windows, checks = [], []
    try:
        settings = {"swap_path": "reload", "verify_swaps": verify, "drain": "abort"}
        with engine_server("vllm", model, run / "server", store=run / "store", settings=settings) as server:
            wait_ready(server.url)
            for _ in range(updates):
                trainer.advance()
                trainer.publish_current()
                st = wait_step(server.url, trainer.step)
                windows.append(sum(st["last_update_timings_s"].get(p, 0.0) for p in WINDOW_PHASES))
                checks.append((st.get("last_verification") or {}).get("seconds", 0.0))
            final = status(server.url)
            path = final.get("swap_path")
            # The base's sync counts too: the updates' own read-backs are the difference.
            verified = (final.get("verification") or {}).get("verified_swaps", 0)
    finally:
        trainer.close()
    return {
        "size": size,
        "bytes": model_bytes(model),
        "verify": verify,
        "path": path,
        "window": statistics.mean(windows),
        "check": statistics.median(checks),
        "verified": verified,
        "updates": updates,
    }


def table(rows: list[dict]) -> list[str]:
    lines = [
        f"vLLM, {cpu_flags()}, path {rows[0]['path'] if rows else '-'}",
        f"{'size':>5} {'model MB':>9} {'window never ms':>16} {'always ms':>10} {'check ms':>9} "
        f"{'always +':>9} {'auto ms':>8} {'auto read back':>15} {'auto +':>7}",
    ]
    for size in dict.fromkeys(r["size"] for r in rows):
        by = {r["verify"]: r for r in rows if r["size"] == size}
        never, always, auto = by["never"], by["always"], by["auto"]
        lines.append(
            f"{size:>5} {never['bytes'] / 1e6:>9.0f} {1000 * never['window']:>16.1f} {1000 * always['window']:>10.1f} "
            f"{1000 * always['check']:>9.1f} {always['window'] / never['window'] - 1:>9.1%} "
            f"{1000 * auto['window']:>8.1f} {auto['verified']:>6} of {auto['updates'] + 1:<6} "
            f"{auto['window'] / never['window'] - 1:>7.1%}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["25M", "100M"], choices=list(SIZES))
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--workdir", help="models and stores (default: a temp dir)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-verify-"))
    rows = [measure(size, work, args.updates, verify) for size in args.sizes for verify in POLICIES]
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
