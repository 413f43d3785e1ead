"""Figure 2: the tokens per second a steady client load gets while an update arrives every 10 s,
over the same load without updates, for each drain mode, on vLLM and SGLang (CPU).

    python -m benchmarks.throughput_under_updates [--engines vllm sglang] [--size 160M] [--streams 4]
        [--max-tokens 512] [--seconds 120] [--rounds 4] [--interval 10] [--modes keep wait abort] [--merge]

The load is the official ``openai`` client streaming ``/v1/completions`` (long generations,
``--max-tokens`` each, ``--streams`` at once, a new request as soon as one ends; the streams' first
requests are shorter, 1/n .. n/n of the length, so that requests end spread over time; measuring
starts once every stream's first request ended, when the load is steady). Each drain mode gets a
fresh server following a store, and the comparison is made inside that server: its time is cut
into windows without updates and windows with an RL-sized update (2% of elements, 1-3 ULP) every
``--interval`` seconds, ``--seconds`` of each in all, in the order quiet, updates, updates, quiet,
quiet, updates, ... so that a drift of the load's speed over time hits both alike. The
trainer publishes the updates before the load starts and they are released into the served store
one at a time, as a trainer on other machines would upload them: the measured cores run the
engine, its load and delta-swap only. Tokens are counted as they arrive (from each chunk's
per-token logprobs: a chunk may carry several). Prints a table (tokens/s without and with updates,
retained %, also counting only the tokens of requests that were not aborted, which a trainer keeps;
swap window, requests ended and aborted) and writes docs/throughput_under_updates.png;
``--merge`` keeps the rows of engines and modes not run this time from the JSON already there.
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
    wait_ready,
    wait_step,
)
from examples.servers.process import device

DOCS = Path(__file__).resolve().parents[1] / "docs"
PROMPT = "The rollout server keeps generating while the trainer publishes"
MODES = ("keep", "wait", "abort")


def ended_normally(reason: str | None) -> bool:
    """A finish reason of a request whose tokens a trainer keeps (None: cut off when the load
    stopped)."""
    return reason is None or reason in ("length", "stop")


class TokenLog:
    """When a load's tokens arrived, and which of them belonged to requests that did not end
    normally (thread safe)."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int]] = []  # (time, tokens) of every chunk that carried text
        self.wasted: list[tuple[float, int]] = []  # the same for requests that did not end normally
        self.finished: list[dict] = []  # {"reason", "versions"} of every request that ended
        self._lock = threading.Lock()

    def arrived(self, now: float, tokens: int) -> None:
        with self._lock:
            self.arrivals.append((now, tokens))

    def ended(self, reason: str | None, versions: list | None, arrivals: list[tuple[float, int]]) -> None:
        """A request ended with ``reason``; ``arrivals`` are its own (they were logged as they came)."""
        with self._lock:
            self.finished.append({"reason": reason, "versions": versions})
            if not ended_normally(reason):  # a trainer samples these again: their tokens are lost
                self.wasted.extend(arrivals)

    def tokens_between(self, start: float, end: float, *, useful: bool = False) -> int:
        """Tokens that arrived in [start, end); ``useful``: without those of requests that were
        aborted or failed (known once they ended)."""
        with self._lock:
            got = sum(n for t, n in self.arrivals if start <= t < end)
            return got - sum(n for t, n in self.wasted if start <= t < end) if useful else got


class Load:
    """``streams`` clients, each streaming one completion after another until stopped."""

    def __init__(self, url: str, streams: int, max_tokens: int) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600)
        self.max_tokens = max_tokens
        self.log = TokenLog()
        self.stop = threading.Event()
        self.first_ended = threading.Semaphore(0)  # released once by each stream's first request
        self.threads = [threading.Thread(target=self._run, args=(i, streams), daemon=True) for i in range(streams)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _run(self, index: int, streams: int) -> None:
        # The streams' first requests are 1/n, 2/n, ... of the length: from then on requests end
        # (and restart with a prefill) spread over time, not all at once inside one window.
        max_tokens = self.max_tokens * (index + 1) // streams
        first = True
        while not self.stop.is_set():
            reason, versions = None, None
            mine: list[tuple[float, int]] = []
            try:
                # logprobs: each chunk lists its tokens (an engine whose output handler falls behind
                # merges several steps' text into one chunk: counting chunks would undercount them)
                stream = self.client.completions.create(
                    model=MODEL_NAME,
                    prompt=PROMPT,
                    max_tokens=max_tokens,
                    temperature=1.0,
                    stream=True,
                    logprobs=1,
                    extra_body={"ignore_eos": True},
                )
                for chunk in stream:
                    now = time.monotonic()
                    for choice in chunk.choices:
                        tokens = len(choice.logprobs.tokens or []) if choice.logprobs else int(bool(choice.text))
                        if tokens:
                            mine.append((now, tokens))
                            self.log.arrived(now, tokens)
                        if choice.finish_reason:
                            reason = choice.finish_reason
                            versions = (choice.model_extra or {}).get("weight_versions")
                    if self.stop.is_set():
                        break
            except Exception as exc:  # a failed request is recorded, then the client carries on
                reason = f"error: {type(exc).__name__}"
                time.sleep(0.5)
            self.log.ended(reason, versions, mine)
            if first:
                first = False
                self.first_ended.release()
            max_tokens = self.max_tokens

    def wait_steady(self, timeout: float) -> None:
        """Until every stream's first (shortened) request ended: from then on request ends are
        spread over time and the load's speed is steady."""
        deadline = time.monotonic() + timeout
        for _ in self.threads:
            if not self.first_ended.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the load's first requests did not end within {timeout:.0f} s")

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def run_mode(engine: str, model: Path, work: Path, mode: str, args: argparse.Namespace) -> dict:
    """One server in drain ``mode``; its load measured in quiet windows and in update windows."""
    run = work / f"{engine}-{mode}"
    window_s = args.seconds / args.rounds
    per_window = max(1, int(window_s // args.interval))
    chain = PublishedAhead(model, run / "store", per_window * args.rounds)  # the trainer ran before, as if elsewhere
    drain_timeout = 60.0
    settings = {"drain": mode, "drain_timeout": drain_timeout}
    spent = {"quiet": 0.0, "updates": 0.0}
    tokens = {"quiet": 0, "updates": 0}
    windows: list[float] = []
    spans: list[tuple[str, float, float]] = []  # (kind, start, end) of every measured window
    releases: list[tuple[float, float]] = []  # (released, served) of every update
    rates: dict[str, list[float]] = {"quiet": [], "updates": []}
    with engine_server(engine, model, run / "server", store=run / "store", settings=settings) as server:
        wait_ready(server.url)
        load = Load(server.url, args.streams, args.max_tokens)
        load.start()
        load.wait_steady(timeout=1800)
        time.sleep(args.warmup)
        for r in range(args.rounds):
            for kind in ("quiet", "updates") if r % 2 == 0 else ("updates", "quiet"):  # Q U U Q Q U ...
                start = time.monotonic()
                if kind == "quiet":
                    time.sleep(window_s)
                for _ in range(per_window if kind == "updates" else 0):
                    time.sleep(args.interval)
                    step = chain.release()
                    released = time.monotonic()
                    # wait mode may drain for up to drain_timeout before the swap even starts
                    # (asked 4 times a second: each status call costs the server a little CPU)
                    st = wait_step(server.url, step, timeout=drain_timeout + args.interval * 6, every_s=0.25)
                    releases.append((released, time.monotonic()))
                    t = st["last_update_timings_s"]
                    windows.append(sum(t.get(p, 0.0) for p in ("pause", "swap", "resume")))
                end = time.monotonic()
                generated = load.log.tokens_between(start, end)
                spans.append((kind, start, end))
                spent[kind] += end - start
                tokens[kind] += generated
                rates[kind].append(generated / (end - start))
        time.sleep(LOCAL_S)  # the last update's local comparison needs the seconds after it
        load.close()
        final = status(server.url)
    lost = [local_loss(load.log, *r) for r in releases]
    useful = {
        kind: sum(load.log.tokens_between(a, b, useful=True) for k, a, b in spans if k == kind) / spent[kind]
        for kind in spent
    }
    finished = load.log.finished
    quiet, busy = tokens["quiet"] / spent["quiet"], tokens["updates"] / spent["updates"]
    return {
        "engine": engine,
        "mode": mode,
        "measured": time.strftime("%Y-%m-%d"),
        "quiet_tokens_per_s": quiet,
        "tokens_per_s": busy,
        "retained": busy / quiet if quiet else float("nan"),
        "seconds": spent,
        # without the tokens of aborted requests, which a trainer samples again
        "useful_tokens_per_s": useful,
        "retained_useful": useful["updates"] / useful["quiet"] if useful["quiet"] else float("nan"),
        "updates": len(windows),
        "window_s": windows,
        "window_tokens_per_s": rates,
        # seconds of generation each update cost, against the load's speed just before it
        # (the share of the update windows' time lost: updates come every interval + drain)
        "lost_s": lost,
        "retained_local": 1 - sum(lost) / spent["updates"] if lost else float("nan"),
        # requests that ended inside the run (those cut off when the load stops carry no reason)
        "requests": sum(1 for f in finished if f["reason"]),
        "aborted": sum(1 for f in finished if not ended_normally(f["reason"])),
        "multi_version": sum(1 for f in finished if f["versions"] and len(f["versions"]) > 1),
        "swap_path": final.get("swap_path"),
    }


#: Seconds before and after an update compared by :func:`local_loss`.
LOCAL_S = 4.0


def local_loss(log: TokenLog, released: float, served: float) -> float:
    """Seconds of generation an update cost: the tokens from its release until ``LOCAL_S`` seconds
    after it was served, against as many seconds at the speed of the ``LOCAL_S`` seconds before
    the release. Local, so the slow swings of a load's speed (its requests' contexts grow and
    restart) cancel out."""
    before = log.tokens_between(released - LOCAL_S, released) / LOCAL_S
    end = served + LOCAL_S
    after = log.tokens_between(released, end)
    return (before * (end - released) - after) / before if before else float("nan")


def retained_useful(row: dict) -> float:
    """The row's retained share of useful tokens (rows measured before it was recorded: their
    retained share when no request was aborted, else unknown)."""
    if "retained_useful" in row:
        return row["retained_useful"]
    return row["retained"] if row["aborted"] == 0 else float("nan")


def summarize(rows: list[dict]) -> list[str]:
    lines = [
        f"{'engine':<7} {'drain':>6} {'tokens/s quiet':>15} {'with updates':>13} {'retained':>9} {'local':>7} "
        f"{'useful':>7} "
        f"{'lost s/update':>14} {'updates':>8} {'window ms':>10} {'requests':>9} {'aborted':>8} {'2+ versions':>12} "
        f"{'measured':>11}"
    ]
    for r in rows:
        window = 1000 * statistics.median(r["window_s"]) if r["window_s"] else 0.0
        lines.append(
            f"{r['engine']:<7} {r['mode']:>6} {r['quiet_tokens_per_s']:>15.2f} {r['tokens_per_s']:>13.2f} "
            f"{100 * r['retained']:>8.1f}% {100 * r.get('retained_local', float('nan')):>6.1f}% "
            f"{100 * retained_useful(r):>6.1f}% "
            f"{statistics.median(r['lost_s']) if r.get('lost_s') else float('nan'):>14.2f} "
            f"{r['updates']:>8} {window:>10.1f} {r['requests']:>9} "
            f"{r['aborted']:>8} {r['multi_version']:>12} {r.get('measured', ''):>11}"
        )
    return lines


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = sorted({r["engine"] for r in rows})
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    by_run = {(r["engine"], r["mode"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = [100 * by_run[e, mode]["retained"] if (e, mode) in by_run else 0 for e in engines]
        xs = [e + i * width for e in range(len(engines))]
        bars = ax.bar(xs, values, width, label=mode)
        ax.bar_label(bars, fmt="%.0f%%", fontsize=8)
        local = [
            100 * by_run[e, mode].get("retained_local", float("nan")) if (e, mode) in by_run else float("nan")
            for e in engines
        ]
        ax.plot(xs, local, "k_", markersize=14, label="local estimate" if i == 0 else None)
        useful = [100 * retained_useful(by_run[e, mode]) if (e, mode) in by_run else float("nan") for e in engines]
        ax.plot(xs, useful, "kx", markersize=6, label="without aborted requests' tokens" if i == 0 else None)
    ax.axhline(95, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks([e + width * (len(modes) - 1) / 2 for e in range(len(engines))], engines)
    ax.set_ylabel("tokens/s retained (% of quiet windows)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 145)
    ax.legend(title="drain (bars: whole windows)", fontsize=8, title_fontsize=8, loc="upper center", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["vllm", "sglang"], choices=["vllm", "sglang"])
    parser.add_argument("--size", default="160M", choices=list(SIZES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=120.0, help="seconds with updates (and as many without)")
    parser.add_argument("--rounds", type=int, default=4, help="windows of each kind (alternating)")
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument(
        "--warmup", type=float, default=5.0, help="seconds of load after its first requests ended, before measuring"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the JSON's rows of engines/modes not run now (table and plot show all)",
    )
    parser.add_argument("--workdir")
    parser.add_argument("--json", default=str(DOCS / "throughput_under_updates.json"))
    parser.add_argument("--plot", default=str(DOCS / "throughput_under_updates.png"))
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-throughput-"))
    model = make_model(work / "models", args.size)
    kept: list[dict] = []
    if args.merge and Path(args.json).exists():
        kept = [
            r
            for r in json.loads(Path(args.json).read_text())
            if not (r["engine"] in args.engines and r["mode"] in args.modes)
        ]
    rows = kept
    for engine in args.engines:
        for mode in args.modes:
            new = run_mode(engine, model, work, mode, args)
            print(summarize([new])[-1], flush=True)
            rows = sorted([*rows, new], key=lambda r: (r["engine"], MODES.index(r["mode"])))
            Path(args.json).write_text(json.dumps(rows, indent=1))  # what ran so far survives a later failure
    print("\n".join(summarize(rows)))
    mb = model_bytes(model) / 1e6
    plot(
        rows,
        Path(args.plot),
        f"Steady streaming load, {args.streams} x {args.max_tokens}-token completions, an update "
        f"every {args.interval:g} s ({mb:.0f} MB model, {device().upper()})",
    )
    print(f"wrote {args.plot} and {args.json}")


if __name__ == "__main__":
    main()
