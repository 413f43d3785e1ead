"""A fleet across regions on one machine: a bucket, a trainer publishing every few seconds, three
regions behind capped links, each with a stock nginx cache and real rollout servers under load.

    python -m benchmarks.fleet [--size 100M] [--mbit 200] [--every 8] [--steps 10] [--paths cache direct]

What runs (everything is removed at the end, also on failure or Ctrl-C):

- the bucket: SeaweedFS on the host (:mod:`examples.servers.seaweedfs`: a master, ``--volumes``
  volume servers, a filer and its S3 gateway). The trainer writes through the S3 API with its own
  key (signature v4); reads are anonymous (an ``anonymous`` identity that may only read, as a
  region's cache would have through a VPC endpoint; snapshots are signed, so integrity does not
  rest on the bucket), ranged GETs straight from the gateway;
- the trainer (:mod:`benchmarks.fleet_trainer`), a separate process publishing through the
  Publisher: a base, then a delta chain for ``--steps`` steps (phase ``delta``), then a full base
  at every step (phase ``full``), ``--every`` seconds apart;
- ``--regions`` network namespaces, each joined to the host by a veth pair capped at ``--mbit``
  with ``tc tbf`` (:mod:`benchmarks.netlab`); in each, ``--servers`` rollout servers (vLLM with
  the plugin; SGLang in the last region), each under a steady stream of client requests;
- per path: ``cache``: an nginx caching proxy in each region (:mod:`benchmarks.regional_cache`),
  the servers reading ``http://`` through it; ``direct``: every server reading the bucket's S3
  gateway itself (over ``http://``, anonymously, as the caches do).

Printed per path, phase and region: staleness (steps and seconds behind the trainer, p50/p95,
sampled from each server's status), the fraction of wall time the servers were not paused for
updates, swap pauses, client requests served and failed, and the bytes that crossed the region's
link, next to the model (f*C + (W-f)*dC)*R at the measured delta size (times the servers per
region when they read directly). Writes a PNG of staleness over time and a JSON of all figures.

Where network namespaces cannot be made (no root), it says so and caps bandwidth with nginx's
``limit_rate`` instead (a per-connection cap: a weaker model of a shared link).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import netlab
from benchmarks.harness import SIZES, make_model
from benchmarks.regional_cache import RegionalCache
from delta_swap.signing import generate_keypair
from examples.servers import sglang as sglang_server
from examples.servers import vllm as vllm_server
from examples.servers.process import Server, free_port
from examples.servers.seaweedfs import ANONYMOUS, TRAINER, SeaweedFS

BUCKET = "fleet"
WORDS = "the of and to in is was for on that with as by at from his her it an were are which this".split()


@dataclass
class Config:
    size: str = "100M"
    regions: int = 3
    servers: int = 2
    #: SeaweedFS volume servers behind the bucket (objects are spread over them).
    volumes: int = 3
    mbit: float = 200.0
    every: float = 8.0
    steps: int = 10
    paths: tuple[str, ...] = ("cache", "direct")
    phases: tuple[str, ...] = ("delta", "full")
    sglang_regions: int = 1
    settle_s: float = 60.0
    load_tokens: int = 16
    load_gap_s: float = 0.5
    poll_s: float = 0.5
    #: Niceness of the rollout servers: in production the trainer and the bucket have machines of
    #: their own; here they share two cores with every server, so the servers yield to them.
    server_nice: int = 10


@dataclass
class Site:
    """Where one region's processes run and how the host reaches them."""

    name: str
    prefix: list[str]
    host: str  # the address the host reaches the region's servers at
    upstream_host: str  # the address the region reaches the bucket at
    region: netlab.Region | None = None
    link: RegionalCache | None = None  # the per-connection "link" when there are no namespaces
    cache: RegionalCache | None = None
    servers: list[tuple[str, Server]] = field(default_factory=list)

    def bytes_in(self) -> int:
        """Bytes that crossed into the region so far."""
        if self.region is not None:
            return self.region.bytes_in()
        proxy = self.cache or self.link
        return proxy.stats()["upstream_bytes"] if proxy else 0


class Load:
    """A client thread per server: short completions back to back, counting successes and failures."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.stop = cfg, threading.Event()
        self.counts: dict[str, list[int]] = {}
        self.threads: list[threading.Thread] = []

    def add(self, key: str, url: str) -> None:
        self.counts[key] = [0, 0]
        thread = threading.Thread(target=self._run, args=(key, url), daemon=True)
        self.threads.append(thread)
        thread.start()

    def _run(self, key: str, url: str) -> None:
        rng = random.Random(key)
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                body = {
                    "model": "policy",
                    "prompt": " ".join(rng.sample(WORDS, 5)),
                    "max_tokens": self.cfg.load_tokens,
                    "temperature": 1.0,
                }
                try:
                    ok = client.post(f"{url}/v1/completions", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.counts[key][0 if ok else 1] += 1
                self.stop.wait(self.cfg.load_gap_s)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {k: (v[0], v[1]) for k, v in self.counts.items()}

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(130)


# ---------------------------------------------------------------------- one run per path


def run_path(
    cfg: Config, path: str, work: Path, model: Path, sites: list[Site], store: SeaweedFS, key_paths: tuple[Path, Path]
) -> dict:
    """Start the trainer, caches and servers for ``path``; drive every phase; return the figures."""
    run_prefix = f"run-{path}-{int(time.time())}"
    control = work / f"control-{path}"
    shutil.rmtree(control, ignore_errors=True)
    control.mkdir(parents=True)
    env = {
        **os.environ,
        **store.env(TRAINER),
        "PYTHONUNBUFFERED": "1",
    }
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.fleet_trainer",
            "--store",
            f"s3://{BUCKET}/{run_prefix}",
            "--model",
            str(model),
            "--control",
            str(control),
            "--every",
            str(cfg.every),
            "--steps",
            str(cfg.steps),
            "--phases",
            *cfg.phases,
            "--signing-key",
            str(key_paths[0]),
        ],
        env=env,
        stdout=open(control / "trainer.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    load = Load(cfg)
    cpus = os.cpu_count() or 1
    try:
        _wait_file(control / "ready", trainer, 600)
        for i, site in enumerate(sites):
            store_url = _start_proxies(cfg, path, work, site, store.ports["s3"], run_prefix)
            settings = {"store": store_url, "poll_interval": cfg.poll_s, "trusted_key": str(key_paths[1])}
            server_env: dict[str, str] = {}
            engine = "sglang" if i >= len(sites) - cfg.sglang_regions else "vllm"
            launch = [*site.prefix, "nice", "-n", str(cfg.server_nice)]
            for j in range(cfg.servers):
                folder = work / f"{path}-{site.name}-{j}"
                if engine == "vllm":  # spread the workers over the cores (vLLM pins each to one)
                    env = {**server_env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(j % cpus)}
                    server = vllm_server.start(
                        model,
                        folder,
                        settings=settings,
                        served_name="policy",
                        wait=False,
                        env=env,
                        host=site.host,
                        prefix=launch,
                    )
                else:  # an idle SGLang scheduler busy-polls a core unless told to sleep
                    server = sglang_server.start(
                        model,
                        folder,
                        settings=settings,
                        served_name="policy",
                        wait=False,
                        env=server_env,
                        host=site.host,
                        prefix=launch,
                        extra=["--sleep-on-idle"],
                    )
                site.servers.append((engine, server))
        for site in sites:
            for _, server in site.servers:
                server.wait_healthy(1200)
        everyone = [(site, engine, server) for site in sites for engine, server in site.servers]
        _wait_until(lambda: all(_status(s).get("current_step") == 0 for _, _, s in everyone), 900, "initial sync")
        for site in sites:
            for j, (_, server) in enumerate(site.servers):
                load.add(f"{site.name}/{j}", server.url)
        phases = {phase: _run_phase(cfg, phase, control, trainer, sites, load) for phase in cfg.phases}
        engines = {site.name: site.servers[0][0] for site in sites}
        return {"path": path, "phases": phases, "commits": _commits(control), "engines": engines}
    finally:
        load.close()
        trainer.terminate()
        for site in sites:
            for _, server in site.servers:
                server.stop()
            site.servers.clear()
            for proxy in (site.cache, site.link):
                if proxy is not None:
                    proxy.stop()
            site.cache = site.link = None


def _start_proxies(cfg: Config, path: str, work: Path, site: Site, read_port: int, run_prefix: str) -> str:
    """The region's nginx (a cache, or without namespaces a rate-limited link); returns the store URL."""
    upstream = f"http://{site.upstream_host}:{read_port}"
    limit = None if site.region is not None else f"{int(cfg.mbit * 1e6 / 8)}"
    if path == "direct":
        if site.region is not None:
            return f"{upstream}/{BUCKET}/{run_prefix}"
        port = free_port()
        site.link = RegionalCache(
            work / f"link-{site.name}", upstream, listen=f"127.0.0.1:{port}", limit_rate=limit, caching=False
        ).start()
        site.link.wait_ready(f"http://127.0.0.1:{port}/")
        return f"http://127.0.0.1:{port}/{BUCKET}/{run_prefix}"
    port = 8080 if site.region is not None else free_port()
    site.cache = RegionalCache(
        work / f"cache-{site.name}", upstream, listen=f"127.0.0.1:{port}", prefix=site.prefix, limit_rate=limit
    ).start()
    site.cache.wait_ready(f"http://127.0.0.1:{port}/", prefix=site.prefix)
    return f"http://127.0.0.1:{port}/{BUCKET}/{run_prefix}"


def _run_phase(
    cfg: Config, phase: str, control: Path, trainer: subprocess.Popen, sites: list[Site], load: Load
) -> dict:
    """Let the trainer publish one phase; sample every server until all serve its last step."""
    before = _counters(sites, load)
    (control / f"go-{phase}").touch()
    started, samples = time.time(), []
    done_at = None
    while True:
        now = time.time()
        for site in sites:
            for j, (_, server) in enumerate(site.servers):
                st = _status(server)
                samples.append(
                    {
                        "t": now,
                        "site": site.name,
                        "server": j,
                        "step": st.get("current_step"),
                        "paused": st.get("paused_seconds_total"),
                        "timings": st.get("last_update_timings_s"),
                        "updates": st.get("updates_applied"),
                        "error": st.get("last_error"),
                    }
                )
        if done_at is None and (control / f"done-{phase}").exists():
            done_at = now
        if done_at is not None:
            last = max(c["step"] for c in _commits(control))
            caught_up = all(s["step"] == last for s in samples[-sum(len(x.servers) for x in sites) :])
            if caught_up or now - done_at > cfg.settle_s:
                break
        if trainer.poll() is not None and done_at is None:
            raise RuntimeError(f"trainer exited: {(control / 'trainer.log').read_text()[-2000:]}")
        time.sleep(cfg.poll_s)
    after = _counters(sites, load)
    return {"started": started, "ended": time.time(), "samples": samples, "before": before, "after": after}


def _counters(sites: list[Site], load: Load) -> dict:
    out = {"bytes": {s.name: s.bytes_in() for s in sites}, "load": load.snapshot(), "paused": {}, "cache": {}}
    for site in sites:
        for j, (_, server) in enumerate(site.servers):
            out["paused"][f"{site.name}/{j}"] = _status(server).get("paused_seconds_total", 0.0)
        if site.cache is not None:
            out["cache"][site.name] = site.cache.stats()
    return out


# ---------------------------------------------------------------------- figures


def summarize(cfg: Config, run: dict, sites: list[Site]) -> list[dict]:
    """One row per phase and region."""
    rows = []
    commits = [c for c in run["commits"] if c["phase"] != "setup"]
    model_bytes = run["commits"][0]["model_bytes"]
    for phase, data in run["phases"].items():
        mine = [c for c in commits if c["phase"] == phase]
        deltas = [c["payload_bytes"] for c in mine if c["kind"] == "delta"]
        delta_frac = statistics.fmean(deltas) / model_bytes if deltas else 0.0
        window, bases = len(mine), sum(1 for c in mine if c["kind"] == "base")
        per_region = bases * model_bytes + (window - bases) * delta_frac * model_bytes
        readers = 1 if run["path"] == "cache" else cfg.servers
        elapsed = data["ended"] - data["started"]
        for site in sites:
            name = site.name
            stale_steps, stale_s = [], []
            for s in data["samples"]:
                if s["site"] != name or s["step"] is None:
                    continue
                published = [c for c in commits if c["t"] <= s["t"]]
                newest = max((c["step"] for c in published), default=0)
                stale_steps.append(max(0, newest - s["step"]))
                newer = [c["t"] for c in published if c["step"] == s["step"] + 1]
                stale_s.append(s["t"] - newer[0] if newer and newest > s["step"] else 0.0)
            keys = [k for k in data["after"]["paused"] if k.startswith(name + "/")]
            paused = [data["after"]["paused"][k] - data["before"]["paused"].get(k, 0.0) for k in keys]
            served = sum(data["after"]["load"][k][0] - data["before"]["load"].get(k, (0, 0))[0] for k in keys)
            failed = sum(data["after"]["load"][k][1] - data["before"]["load"].get(k, (0, 0))[1] for k in keys)
            windows = sorted(
                {
                    (s["server"], s["updates"]): sum(
                        (s["timings"] or {}).get(p, 0.0) for p in ("pause", "swap", "resume")
                    )
                    for s in data["samples"]
                    if s["site"] == name and s["updates"]
                }.values()
            )
            moved = data["after"]["bytes"][name] - data["before"]["bytes"][name]
            final = {s["server"]: s["step"] for s in data["samples"] if s["site"] == name}
            rows.append(
                {
                    "path": run["path"],
                    "phase": phase,
                    "region": name,
                    "engine": run["engines"][name],
                    "snapshots": window,
                    "bases": bases,
                    "delta_fraction": delta_frac,
                    "model_bytes": model_bytes,
                    "stale_steps_p50": _pct(stale_steps, 50),
                    "stale_steps_p95": _pct(stale_steps, 95),
                    "stale_s_p50": _pct(stale_s, 50),
                    "stale_s_p95": _pct(stale_s, 95),
                    "generating": 1 - statistics.fmean(paused) / elapsed if paused else None,
                    "swap_pause_ms_p50": 1000 * _pct(windows, 50),
                    "swap_pause_ms_max": 1000 * (max(windows) if windows else 0),
                    "served": served,
                    "failed": failed,
                    "bytes_moved": moved,
                    "bytes_model": per_region * readers,
                    "seconds": elapsed,
                    "cache": data["after"]["cache"].get(name),
                    "last_step": max((c["step"] for c in mine), default=None),
                    "final_steps": [final[j] for j in sorted(final)],
                }
            )
    return rows


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'path':<7}{'phase':<7}{'region':<8}{'engine':<8}{'stale steps p50/p95':>20}{'stale s p50/p95':>17}"
        f"{'generating':>11}{'pause ms p50/max':>18}{'served/failed':>14}{'MB moved':>10}{'MB formula':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        gen = f"{100 * r['generating']:.1f}%" if r["generating"] is not None else "-"
        print(
            f"{r['path']:<7}{r['phase']:<7}{r['region']:<8}{r['engine']:<8}"
            f"{r['stale_steps_p50']:>11.0f}/{r['stale_steps_p95']:<8.0f}"
            f"{r['stale_s_p50']:>9.1f}/{r['stale_s_p95']:<7.1f}{gen:>11}"
            f"{r['swap_pause_ms_p50']:>10.0f}/{r['swap_pause_ms_max']:<7.0f}"
            f"{r['served']:>9}/{r['failed']:<4}{r['bytes_moved'] / 1e6:>10.1f}{r['bytes_model'] / 1e6:>11.1f}"
        )


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(runs[0]["phases"])
    fig, axes = plt.subplots(
        len(runs), len(phases), figsize=(6 * len(phases), 3.2 * len(runs)), squeeze=False, sharey=True
    )
    for row, run in zip(axes, runs):
        commits = [c for c in run["commits"] if c["phase"] != "setup"]
        for ax, phase in zip(row, phases):
            data = run["phases"][phase]
            t0 = data["started"]
            for site in sorted({s["site"] for s in data["samples"]}):
                pts = []
                for s in data["samples"]:
                    if s["site"] == site and s["server"] == 0 and s["step"] is not None:
                        newest = max((c["step"] for c in commits if c["t"] <= s["t"]), default=0)
                        pts.append((s["t"] - t0, max(0, newest - s["step"])))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=site, drawstyle="steps-post")
            ax.set_title(f"{run['path']}: {'delta chain' if phase == 'delta' else 'full checkpoint every step'}")
            ax.set_xlabel("seconds into the phase")
            ax.set_ylabel("steps behind the trainer")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------- plumbing


def _status(server: Server) -> dict:
    try:
        return httpx.get(f"{server.url}/delta_swap/status", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _commits(control: Path) -> list[dict]:
    return [json.loads(line) for line in (control / "trainer.jsonl").read_text().splitlines()]


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    _wait_until(lambda: path.exists() or proc.poll() is not None, timeout, f"{path.name}")
    if not path.exists():
        raise RuntimeError(f"trainer exited: {(path.parent / 'trainer.log').read_text()[-2000:]}")


def _wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.5)


@contextlib.contextmanager
def bucket(cfg: Config, work: Path) -> Iterator[SeaweedFS]:
    """SeaweedFS on every host address (regions reach it over their links) with ``cfg.volumes``
    volume servers, the bucket, the trainer's key and anonymous reads; stopped at the end."""
    shutil.rmtree(work / "seaweedfs", ignore_errors=True)
    with SeaweedFS(work / "seaweedfs", identities=(TRAINER, ANONYMOUS), volumes=cfg.volumes, bind="0.0.0.0") as store:
        store.create_bucket(BUCKET)
        yield store


@contextlib.contextmanager
def network(cfg: Config) -> Iterator[list[Site]]:
    """The regions: namespaces behind capped links, or (without them) plain host processes."""
    ok, why = netlab.namespaces_available()
    if not ok:
        print(f"== network namespaces unavailable ({why}): capping bandwidth with nginx limit_rate instead", flush=True)
        yield [Site(f"r{i}", [], "127.0.0.1", "127.0.0.1") for i in range(1, cfg.regions + 1)]
        return
    with netlab.Lab(cfg.regions, cfg.mbit) as lab:
        yield [Site(f"r{r.index}", r.prefix, r.region_ip, r.host_ip, region=r) for r in lab.regions]


def run(cfg: Config, work: Path, out: Path | None) -> list[dict]:
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(work / "models", cfg.size)
    shutil.rmtree(work / "keys", ignore_errors=True)
    (work / "keys").mkdir()
    key_paths = generate_keypair(work / "keys" / "fleet")
    runs, rows = [], []
    with bucket(cfg, work) as store, network(cfg) as sites:
        for path in cfg.paths:
            print(
                f"== {path}: {cfg.regions} regions x {cfg.servers} servers, links {cfg.mbit:g} Mbit/s, "
                f"model {cfg.size}, a snapshot every {cfg.every:g} s",
                flush=True,
            )
            result = run_path(cfg, path, work, model, sites, store, key_paths)
            result["rows"] = summarize(cfg, result, sites)
            print_table(result["rows"])
            runs.append(result)
            rows += result["rows"]
    print("\n== all runs")
    print_table(rows)
    for phase in cfg.phases:
        mine = [r for r in rows if r["phase"] == phase]
        if mine:
            print(
                f"{phase}: measured delta size {100 * mine[0]['delta_fraction']:.2f}% of {mine[0]['model_bytes'] / 1e6:.0f} MB; "
                f"model bytes per region (f*C + (W-f)*dC) with W={mine[0]['snapshots']}, f={mine[0]['bases']}"
            )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(runs, out.with_suffix(".png"))
        compact = [{"path": r["path"], "rows": r["rows"], "commits": r["commits"]} for r in runs]
        out.with_suffix(".json").write_text(
            json.dumps({"config": cfg.__dict__, "runs": compact}, indent=1, default=str)
        )
        print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/delta-swap-fleet"))
    parser.add_argument("--size", default=Config.size, choices=list(SIZES))
    parser.add_argument("--regions", type=int, default=Config.regions)
    parser.add_argument("--servers", type=int, default=Config.servers, help="rollout servers per region")
    parser.add_argument("--volumes", type=int, default=Config.volumes, help="SeaweedFS volume servers")
    parser.add_argument("--mbit", type=float, default=Config.mbit, help="each region's link, megabits per second")
    parser.add_argument("--every", type=float, default=Config.every, help="seconds between trainer steps")
    parser.add_argument("--steps", type=int, default=Config.steps, help="trainer steps per phase")
    parser.add_argument("--paths", nargs="+", default=list(Config.paths), choices=["cache", "direct"])
    parser.add_argument("--phases", nargs="+", default=list(Config.phases), choices=["delta", "full"])
    parser.add_argument("--sglang-regions", type=int, default=Config.sglang_regions)
    parser.add_argument("--out", type=Path, default=Path("docs/fleet"), help="PNG and JSON (without suffix)")
    args = parser.parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind through every finally: nothing is left behind
        signal.signal(sig, netlab.exit_on_signal)
    cfg = Config(
        size=args.size,
        regions=args.regions,
        servers=args.servers,
        volumes=args.volumes,
        mbit=args.mbit,
        every=args.every,
        steps=args.steps,
        paths=tuple(args.paths),
        phases=tuple(args.phases),
        sglang_regions=args.sglang_regions,
    )
    run(cfg, args.workdir, args.out)


if __name__ == "__main__":
    main()
