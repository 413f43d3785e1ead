"""What the post-swap verification costs: the no-generation window per update with
``verify_swaps`` on and off, side by side, on the same model in one run (vLLM, reload path).

    python -m benchmarks.verify_cost [--sizes 25M 100M] [--updates 5]

For each size, two plugin servers (verification on, then off) follow the same kind of RL-sized
updates (2% of elements moved by 1-3 ULP); the table shows the median window (pause + swap +
resume), the workers' own verification time and the overhead, with the CPU flags that decide
vLLM's weight layout. The project keeps the check on by default where it costs under 10% of the
window.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import SIZES, Trainer, engine_server, make_model, model_bytes, status, wait_ready, wait_step

WINDOW_PHASES = ("pause", "swap", "resume")


def cpu_flags() -> str:
    """The CPU flags that decide vLLM's CPU weight layout (AMX, AVX512-BF16)."""
    import torch

    return (
        f"amx={'yes' if torch.cpu._is_amx_tile_supported() else 'no'} "
        f"avx512_bf16={'yes' if torch.cpu._is_avx512_bf16_supported() else 'no'}"
    )


def measure(size: str, work: Path, updates: int, verify: bool) -> dict:
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
            path = status(server.url).get("swap_path")
    finally:
        trainer.close()
    return {
        "size": size,
        "bytes": model_bytes(model),
        "verify": verify,
        "path": path,
        "window": statistics.median(windows),
        "check": statistics.median(checks),
    }


def table(rows: list[dict]) -> list[str]:
    lines = [
        f"vLLM, {cpu_flags()}, path {rows[0]['path'] if rows else '-'}",
        f"{'size':>5} {'model MB':>9} {'window, verify on ms':>21} {'window, off ms':>15} "
        f"{'check ms':>9} {'overhead':>9}",
    ]
    for size in dict.fromkeys(r["size"] for r in rows):
        on = next(r for r in rows if r["size"] == size and r["verify"])
        off = next(r for r in rows if r["size"] == size and not r["verify"])
        lines.append(
            f"{size:>5} {on['bytes'] / 1e6:>9.0f} {1000 * on['window']:>21.1f} {1000 * off['window']:>15.1f} "
            f"{1000 * on['check']:>9.1f} {on['window'] / off['window'] - 1:>9.1%}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["25M", "100M"], choices=list(SIZES))
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--workdir", help="models and stores (default: a temp dir)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-verify-"))
    rows = [measure(size, work, args.updates, verify) for size in args.sizes for verify in (True, False)]
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
