"""Figure 2: the tokens per second a steady client load gets while an update arrives every 10 s,
over the same load without updates, for each drain mode, on vLLM and SGLang (CPU).

    python -m benchmarks.throughput_under_updates [--engines vllm sglang] [--size 160M] [--streams 4]
        [--max-tokens 512] [--seconds 90] [--interval 10] [--modes keep wait abort]

The load is the official ``openai`` client streaming ``/v1/completions`` (long generations,
``--max-tokens`` each, ``--streams`` at once, a new request as soon as one ends). Every run starts
a fresh server following a store; the baseline run gets no update, the others an RL-sized one
(2% of elements, 1-3 ULP) every ``--interval`` seconds. The trainer publishes those updates before
the load starts and they are released into the served store one at a time, as a trainer on other
machines would upload them: the measured cores run the engine, its load and delta-swap only. Tokens are counted as
they arrive, over the measured window. Prints a table (tokens/s, retained %, requests aborted,
versions per request, swap window) and writes docs/throughput_under_updates.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness import (
    MODEL_NAME,
    SIZES,
    PublishedAhead,
    engine_server,
    make_model,
    model_bytes,
    status,
    wait_step,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"
PROMPT = "The rollout server keeps generating while the trainer publishes"


class Load:
    """``streams`` clients, each streaming one completion after another until stopped."""

    def __init__(self, url: str, streams: int, max_tokens: int) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600)
        self.max_tokens = max_tokens
        self.arrivals: list[float] = []
        self.finished: list[dict] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]
        self._lock = threading.Lock()

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            reason, versions = None, None
            try:
                stream = self.client.completions.create(
                    model=MODEL_NAME, prompt=PROMPT, max_tokens=self.max_tokens, temperature=1.0, stream=True,
                    extra_body={"ignore_eos": True})
                for chunk in stream:
                    now = time.monotonic()
                    for choice in chunk.choices:
                        if choice.text:
                            with self._lock:
                                self.arrivals.append(now)
                        if choice.finish_reason:
                            reason = choice.finish_reason
                            versions = (choice.model_extra or {}).get("weight_versions")
                    if self.stop.is_set():
                        break
            except Exception as exc:  # a failed request is recorded, then the client carries on
                reason = f"error: {type(exc).__name__}"
                time.sleep(0.5)
            with self._lock:
                self.finished.append({"reason": reason, "versions": versions})

    def tokens_between(self, start: float, end: float) -> int:
        with self._lock:
            return sum(1 for t in self.arrivals if start <= t < end)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def run_mode(engine: str, model: Path, work: Path, mode: str | None, args: argparse.Namespace) -> dict:
    """One server, one window of load; ``mode`` None is the baseline without updates."""
    run = work / f"{engine}-{mode or 'baseline'}"
    updates = 0 if mode is None else int(args.seconds // args.interval)
    chain = PublishedAhead(model, run / "store", updates)  # the trainer runs before the load, as if elsewhere
    drain_timeout = 60.0
    settings = {"drain": mode or "keep", "drain_timeout": drain_timeout}
    with engine_server(engine, model, run / "server", store=run / "store", settings=settings) as server:
        wait_step(server.url, 0)
        load = Load(server.url, args.streams, args.max_tokens)
        load.start()
        time.sleep(args.warmup)
        start = time.monotonic()
        windows = []
        while time.monotonic() - start < args.seconds:
            time.sleep(min(args.interval, max(0.0, start + args.seconds - time.monotonic())))
            if chain.remaining and time.monotonic() - start < args.seconds - 1:
                step = chain.release()
                # wait mode may drain for up to drain_timeout before the swap even starts
                st = wait_step(server.url, step, timeout=drain_timeout + args.interval * 6)
                t = st["last_update_timings_s"]
                windows.append(sum(t.get(p, 0.0) for p in ("pause", "swap", "resume")))
        end = time.monotonic()
        tokens = load.tokens_between(start, end)
        load.close()
        final = status(server.url)
    finished = load.finished
    return {"engine": engine, "mode": mode or "baseline", "tokens_per_s": tokens / (end - start),
            "updates": len(windows), "window_s": windows,
            # requests that ended inside the run (those cut off when the load stops carry no reason)
            "requests": sum(1 for f in finished if f["reason"]),
            "aborted": sum(1 for f in finished if f["reason"] and f["reason"] not in ("length", "stop")),
            "multi_version": sum(1 for f in finished if f["versions"] and len(f["versions"]) > 1),
            "swap_path": final.get("swap_path")}


def summarize(rows: list[dict]) -> list[str]:
    base = {r["engine"]: r["tokens_per_s"] for r in rows if r["mode"] == "baseline"}
    lines = [f"{'engine':<7} {'drain':>8} {'tokens/s':>9} {'retained':>9} {'updates':>8} {'window ms':>10} "
             f"{'requests':>9} {'aborted':>8} {'2+ versions':>12}"]
    for r in rows:
        retained = r["tokens_per_s"] / base[r["engine"]] if base.get(r["engine"]) else float("nan")
        window = 1000 * statistics.median(r["window_s"]) if r["window_s"] else 0.0
        lines.append(f"{r['engine']:<7} {r['mode']:>8} {r['tokens_per_s']:>9.2f} {100 * retained:>8.1f}% "
                     f"{r['updates']:>8} {window:>10.1f} {r['requests']:>9} {r['aborted']:>8} {r['multi_version']:>12}")
    return lines


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = sorted({r["engine"] for r in rows})
    modes = [m for m in ("baseline", "keep", "wait", "abort") if any(r["mode"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = []
        for engine in engines:
            base = next((r["tokens_per_s"] for r in rows if r["engine"] == engine and r["mode"] == "baseline"), None)
            r = next((r for r in rows if r["engine"] == engine and r["mode"] == mode), None)
            values.append(100 * r["tokens_per_s"] / base if r and base else 0)
        bars = ax.bar([e + i * width for e in range(len(engines))], values, width, label=mode)
        ax.bar_label(bars, fmt="%.0f%%", fontsize=8)
    ax.axhline(95, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks([e + width * (len(modes) - 1) / 2 for e in range(len(engines))], engines)
    ax.set_ylabel("tokens/s retained (% of no updates)")
    ax.set_title(title, fontsize=9)
    ax.legend(title="drain", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["vllm", "sglang"], choices=["vllm", "sglang"])
    parser.add_argument("--size", default="160M", choices=list(SIZES))
    parser.add_argument("--modes", nargs="+", default=["keep", "wait", "abort"], choices=["keep", "wait", "abort"])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds of load before the window starts")
    parser.add_argument("--workdir")
    parser.add_argument("--json", default=str(DOCS / "throughput_under_updates.json"))
    parser.add_argument("--plot", default=str(DOCS / "throughput_under_updates.png"))
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-throughput-"))
    model = make_model(work / "models", args.size)
    rows = []
    for engine in args.engines:
        for mode in [None, *args.modes]:
            rows.append(run_mode(engine, model, work, mode, args))
            print(summarize(rows)[-1], flush=True)
            Path(args.json).write_text(json.dumps(rows, indent=1))  # what ran so far survives a later failure
    print("\n".join(summarize(rows)))
    mb = model_bytes(model) / 1e6
    plot(rows, Path(args.plot), f"Steady streaming load, {args.streams} x {args.max_tokens}-token completions, an update "
                                f"every {args.interval:g} s ({mb:.0f} MB model, CPU)")
    print(f"wrote {args.plot} and {args.json}")


if __name__ == "__main__":
    main()
