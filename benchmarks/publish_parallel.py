"""Publishing at the speed of training (issue #25): a delta step on 1 and on 2+ encode threads,
and ``delta-swap publish`` per step with and without its head cache.

    PYTHONPATH=$(bash scripts/import_root.sh):. python -m benchmarks.publish_parallel [--layers 4] [--steps 3]
        [--ranks 2] [--load N] [--vocab 151936]

A synthetic Llama-shaped bf16 model (hidden 1024, MLP 2816, vocab 8192; ``--layers 4`` is ~124 MB)
is trained by an Adam-like update of fp32 master weights (every element moves by about ``--lr``,
so the chance that its bf16 copy changes grows as its magnitude shrinks, as in an RL run:
benchmarks/rl_corpus.py). Step 0 is published as a base (not timed); each later step is timed:

* library: ``Publisher.publish`` + ``flush`` (the host copy, encode, upload to a file:// store and
  commit), once per ``encode_threads`` value, each in a process of its own so that its peak RSS
  (``VmHWM``) is its own; then "queued": every step published at once and flushed at the end (a
  trainer ahead of its publisher), so that the next step encodes while the previous one uploads;
  where a tensor is large enough to be coded in parts (``--vocab 151936``: the embeddings), also
  with every tensor in one piece ("whole tensors"), so the parts' gain shows in the same run;
* cli: ``python -m delta_swap.cli publish <checkpoint folder>`` per step, a process each (Python
  start, imports, reading the folder, the head, encode, upload, commit), with ``--no-head-cache``
  (the head is rebuilt from the store every step) and with a head cache; then ``delta-swap watch``
  (one process for every step), timed from a ``checkpoint-N`` folder renamed into place to its
  commit line.

* ranks: ``--ranks N`` gloo ranks (a process each, one encode thread each), each publishing its
  balanced share of the same step (``PublisherConfig(rank=r, world_size=N)``; the last rank to
  finish commits), timed from a barrier before the publish to a barrier after every rank's flush:
  the multi-rank publisher of a sharded trainer, against one rank on one thread.

Each library and rank row also gives the CPU seconds its publish took per step (every thread of
the process; for ranks, the busiest rank's and all ranks' together): the work each rank does
falls as 1/N with N ranks whatever the machine, the wall-clock time only where the ranks' cores
do not slow each other down.

``--load N`` runs N busy processes (``nice 10``, as the fleet benchmark's servers are) for the
whole run: the trainer of a host whose cores also serve.

Also timed: one large tensor's delta encoded twice on one thread, then once on each of two threads
at the same time (the codec's numba kernels run without the GIL, so two threads should take about
the time of one encode on a machine with two free cores). The header names the CPU, its bf16 flags
and the load average: figures from a machine that is not quiet are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.machine import cpu_flags
from delta_swap.codec import CodecConfig

HIDDEN, INTERMEDIATE, VOCAB = 1024, 2816, 8192


def model_shapes(layers: int, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE, vocab: int = VOCAB) -> dict:
    """Llama-style tensor shapes (GQA with a quarter of the heads for k and v)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden // 4, hidden),
            p + "self_attn.v_proj.weight": (hidden // 4, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


class SyntheticTrainer:
    """fp32 master weights (std 0.02, norms 1.0) nudged by an Adam-like step; ``state()`` is the
    bf16 copy a trainer publishes."""

    def __init__(self, shapes: dict, lr: float, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.lr = lr
        self.master = {
            name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=self.gen) * 0.02
            for name, shape in shapes.items()
        }

    def advance(self) -> None:
        for w in self.master.values():
            w += torch.randn(w.shape, generator=self.gen) * self.lr

    def state(self) -> dict[str, torch.Tensor]:
        return {name: w.to(torch.bfloat16) for name, w in self.master.items()}


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _peak_rss_mb() -> float:
    """This process's peak RSS (``VmHWM``: unlike ``ru_maxrss``, not inherited from a parent that
    forked it), in MB."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1e3
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


#: Runs ``delta_swap.cli`` with the given arguments and prints its peak RSS (``VmHWM``) on stderr at
#: exit. It imports nothing the CLI does not: importing this module (torch) would add ~1 s and
#: ~150 MB to every CLI row, which earlier tables here did.
_CLI_WRAPPER = (
    "import atexit, runpy, sys\n"
    "def _peak():\n"
    "    with open('/proc/self/status') as fh:\n"
    "        return next(int(line.split()[1]) / 1e3 for line in fh if line.startswith('VmHWM:'))\n"
    "atexit.register(lambda: print(f'PEAK_RSS_MB={_peak()}', file=sys.stderr))\n"
    "sys.argv = ['delta-swap', *sys.argv[1:]]\n"
    "runpy.run_module('delta_swap.cli', run_name='__main__')\n"
)


def measure_library(
    shapes: dict, steps: int, threads: int, lr: float, work: Path, queued: bool = False, whole: bool = False
) -> dict:
    """Seconds per delta step of ``Publisher`` on ``threads`` encode threads, payload bytes, RSS.
    Each step is flushed before the next, or with ``queued`` every step is published at once
    (made beforehand) and flushed at the end: the next step then encodes while one uploads.
    ``whole``: every tensor in one piece (no parts for the threads to share)."""
    if queued:
        return _measure_queued(shapes, steps, threads, lr, work)
    from delta_swap.codec import CodecConfig
    from delta_swap.publisher import Publisher, PublisherConfig

    store = work / f"library-{threads}"
    shutil.rmtree(store, ignore_errors=True)
    trainer = SyntheticTrainer(shapes, lr)
    seconds, cpu, payload = [], [], []
    codec = CodecConfig(part_elements=1 << 62) if whole else CodecConfig()
    with Publisher(str(store), PublisherConfig(base_every=10_000, encode_threads=threads, codec=codec)) as pub:
        pub.publish(0, trainer.state())
        pub.flush()
        rss_before = _rss_mb()
        for step in range(1, steps + 1):
            trainer.advance()
            state = trainer.state()
            start, cpu_start = time.perf_counter(), time.process_time()
            pub.publish(step, state)
            pub.flush()
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
            assert pub.last_manifest is not None and pub.last_manifest.kind == "delta"
            payload.append(pub.last_manifest.payload_bytes)
            del state
    return {
        "mode": "library, whole tensors" if whole else "library",
        "threads": threads,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "payload_bytes": payload,
        "model_bytes": pub.last_manifest.model_bytes,
        "rss_before_mb": rss_before,
        "peak_rss_mb": _peak_rss_mb(),
    }


def _measure_queued(shapes: dict, steps: int, threads: int, lr: float, work: Path) -> dict:
    import asyncio

    from delta_swap.chain import ChainReader
    from delta_swap.publisher import Publisher, PublisherConfig
    from delta_swap.stores import FileStore

    store = work / f"library-queued-{threads}"
    shutil.rmtree(store, ignore_errors=True)
    trainer = SyntheticTrainer(shapes, lr)
    config = PublisherConfig(base_every=10_000, encode_threads=threads, max_pending=steps)
    with Publisher(str(store), config) as pub:
        pub.publish(0, trainer.state())
        pub.flush()
        states = []
        for _ in range(steps):
            trainer.advance()
            states.append(trainer.state())
        rss_before = _rss_mb()
        start, cpu_start = time.perf_counter(), time.process_time()
        for step, state in enumerate(states, 1):
            pub.publish(step, state)
        pub.flush()
        total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    manifests = asyncio.run(ChainReader(FileStore(store)).list())[1:]
    assert [m.kind for m in manifests] == ["delta"] * steps
    return {
        "mode": "library, queued",
        "threads": threads,
        "seconds": [total / steps] * steps,
        "cpu_seconds": [cpu / steps] * steps,
        "payload_bytes": [m.payload_bytes for m in manifests],
        "model_bytes": manifests[-1].model_bytes,
        "rss_before_mb": rss_before,
        "peak_rss_mb": _peak_rss_mb(),
    }


def measure_ranks(shapes: dict, steps: int, world: int, lr: float, work: Path) -> dict:
    """Seconds per delta step with ``world`` gloo ranks, each encoding its share on one thread;
    the payload of the committed snapshots and the largest peak RSS of a rank."""
    import asyncio
    import socket

    import torch.multiprocessing as mp

    from delta_swap.chain import ChainReader
    from delta_swap.stores import FileStore

    store, out = work / f"ranks-{world}", work / f"ranks-{world}-results"
    for folder in (store, out):
        shutil.rmtree(folder, ignore_errors=True)
    out.mkdir(parents=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank_main, args=(world, shapes, steps, lr, str(store), port, str(out)), nprocs=world, join=True)
    results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
    manifests = asyncio.run(ChainReader(FileStore(store)).list())[1:]
    assert [m.kind for m in manifests] == ["delta"] * steps
    return {
        "mode": f"ranks x{world}",
        "threads": 1,
        "seconds": [max(col) for col in zip(*(r["seconds"] for r in results))],
        "cpu_seconds": [sum(col) for col in zip(*(r["cpu_seconds"] for r in results))],
        "rank_cpu_seconds": [max(col) for col in zip(*(r["cpu_seconds"] for r in results))],
        "payload_bytes": [m.payload_bytes for m in manifests],
        "model_bytes": manifests[-1].model_bytes,
        "rss_before_mb": max(r["rss_before_mb"] for r in results),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
    }


def _rank_main(rank: int, world: int, shapes: dict, steps: int, lr: float, store: str, port: int, out: str) -> None:
    """One rank of :func:`measure_ranks` (every rank makes the same steps: same seed)."""
    import torch.distributed as dist

    from delta_swap.integrations.sharded import balanced_share
    from delta_swap.publisher import Publisher, PublisherConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    trainer = SyntheticTrainer(shapes, lr)
    config = PublisherConfig(base_every=10_000, encode_threads=1, rank=rank, world_size=world)
    seconds, cpu = [], []
    with Publisher(store, config) as pub:
        pub.publish(0, balanced_share(trainer.state().items(), rank, world))
        pub.flush()
        rss_before = _rss_mb()
        for step in range(1, steps + 1):
            trainer.advance()
            share = balanced_share(trainer.state().items(), rank, world)
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            pub.publish(step, share)
            pub.flush()
            cpu.append(time.process_time() - cpu_start)  # this rank's work, before it waits for the others
            dist.barrier()  # the step is committed once the last rank's flush returns
            seconds.append(time.perf_counter() - start)
            del share
    result = {"seconds": seconds, "cpu_seconds": cpu, "rss_before_mb": rss_before, "peak_rss_mb": _peak_rss_mb()}
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def start_load(n: int) -> list[subprocess.Popen]:
    """``n`` busy processes at nice 10 (stopped by :func:`stop_load`)."""
    busy = [sys.executable, "-c", "import os; os.nice(10)\nwhile True: pass"]
    return [subprocess.Popen(busy) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def _write_checkpoint(state: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "llama"}')


def measure_cli(shapes: dict, steps: int, lr: float, work: Path, head_cache: bool, threads: int | None = None) -> dict:
    """Wall seconds per ``delta-swap publish`` of a delta step (a process each), with or without
    the head cache; the children's peak RSS."""
    name = f"cli-{'cache' if head_cache else 'nocache'}"
    store, cache = work / name, work / f"{name}-heads"
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    trainer = SyntheticTrainer(shapes, lr)
    flags = ["--head-cache", str(cache)] if head_cache else ["--no-head-cache"]
    flags += ["--encode-threads", str(threads)] if threads else []
    seconds, payload = [], []
    peak = 0.0
    for step in range(steps + 1):
        if step:
            trainer.advance()
        folder = work / f"{name}-checkpoint"
        shutil.rmtree(folder, ignore_errors=True)
        _write_checkpoint(trainer.state(), folder)
        cmd = [sys.executable, "-c", _CLI_WRAPPER, "publish", str(folder), "--store", str(store)]
        cmd += ["--step", str(step), "--base-every", "10000", "--quiet", *flags]
        elapsed, rss_mb, stdout, stderr = _run_measured(cmd)
        if head_cache and step and "rebuilding" in stderr:
            raise RuntimeError(f"the head cache was not used: {stderr[-2000:]}")
        if step:
            seconds.append(elapsed)
            payload.append(int(stdout.split(": ")[1].split()[0]))
            peak = max(peak, rss_mb)
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "mode": f"cli, {'head cache' if head_cache else 'no head cache'}",
        "threads": threads or _cores(),
        "seconds": seconds,
        "payload_bytes": payload,
        "model_bytes": sum(int(np.prod(s)) * 2 for s in shapes.values()),
        "rss_before_mb": float("nan"),
        "peak_rss_mb": peak,
    }


def measure_cli_watch(shapes: dict, steps: int, lr: float, work: Path, threads: int | None = None) -> dict:
    """Seconds from a checkpoint folder appearing (renamed into place, as a trainer that saves
    atomically does) to ``delta-swap watch`` printing its commit, per delta step; the watcher's
    peak RSS."""
    store, saves = work / "cli-watch", work / "cli-watch-saves"
    for folder in (store, saves):
        shutil.rmtree(folder, ignore_errors=True)
    saves.mkdir(parents=True)
    trainer = SyntheticTrainer(shapes, lr)
    cmd = [sys.executable, "-c", _CLI_WRAPPER, "watch", str(saves), "--store", str(store), "--base-every", "10000"]
    cmd += ["--settle-s", "0", "--poll-s", "0.02", "--until-step", str(steps)]
    cmd += ["--encode-threads", str(threads)] if threads else []
    seconds, payload = [], []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            assert proc.stdout is not None
            proc.stdout.readline()  # "watching ..."
            for step in range(steps + 1):
                if step:
                    trainer.advance()
                staging = saves / f".saving-{step}"
                _write_checkpoint(trainer.state(), staging)
                start = time.perf_counter()
                staging.rename(saves / f"checkpoint-{step}")
                line = proc.stdout.readline()
                if not line.startswith("published"):
                    raise RuntimeError(f"delta-swap watch: {line!r}")
                if step:
                    seconds.append(time.perf_counter() - start)
                    payload.append(int(line.split(": ")[1].split()[0]))
                shutil.rmtree(saves / f"checkpoint-{step}")
            proc.wait(timeout=600)
        finally:
            proc.kill()
        err.seek(0)
        peak = _peak_of(err.read())
    return {
        "mode": "cli watch",
        "threads": threads or _cores(),
        "seconds": seconds,
        "payload_bytes": payload,
        "model_bytes": sum(int(np.prod(s)) * 2 for s in shapes.values()),
        "rss_before_mb": float("nan"),
        "peak_rss_mb": peak,
    }


def _run_measured(cmd: list[str]) -> tuple[float, float, str, str]:
    """Run ``cmd`` (the CLI wrapper): its wall seconds, its peak RSS in MB, its stdout and stderr."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        returncode = subprocess.run(cmd, stdout=out, stderr=err, text=True, timeout=1800).returncode
        elapsed = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if returncode != 0:
        raise RuntimeError(f"delta-swap publish failed ({returncode}): {stderr[-2000:]}")
    return elapsed, _peak_of(stderr), stdout, stderr


def _peak_of(stderr: str) -> float:
    """The peak RSS in MB that :data:`_CLI_WRAPPER` printed on ``stderr`` (NaN if it did not)."""
    peaks = [float(line.split("=", 1)[1]) for line in stderr.splitlines() if line.startswith("PEAK_RSS_MB=")]
    return peaks[-1] if peaks else float("nan")


def measure_gil(rows: int, cols: int, lr: float) -> dict:
    """Seconds for two deltas of a ``rows x cols`` bf16 tensor on one thread, then on two."""
    from delta_swap import codec

    trainer = SyntheticTrainer({"a": (rows, cols), "b": (rows, cols)}, lr)
    old = {k: v.view(-1).view(torch.uint8).numpy().copy() for k, v in trainer.state().items()}
    trainer.advance()
    new = {k: v.view(-1).view(torch.uint8).numpy().copy() for k, v in trainer.state().items()}

    def encode(k: str) -> None:
        codec.encode_tensor_delta(old[k], new[k], "BF16", shape=(rows, cols))

    encode("a")  # compile or load the kernels outside the timing
    start = time.perf_counter()
    encode("a")
    encode("b")
    one = time.perf_counter() - start
    threads = [threading.Thread(target=encode, args=(k,)) for k in ("a", "b")]
    start, cpu = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    two, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "tensor": f"{rows}x{cols}",
        "mb": rows * cols * 2 / 1e6,
        "one_thread_s": one,
        "two_threads_s": two,
        "two_threads_cpu_s": cpu,
    }


def _cores() -> int:
    from delta_swap.publisher import allowed_cores

    return allowed_cores()


def machine() -> list[str]:
    """The CPU, its bf16-relevant flags, the cores this process may use and the load."""
    load = os.getloadavg()
    return [
        f"cpu: {cpu_flags()}",
        f"cores allowed: {_cores()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start",
    ]


def summarize(rows: list[dict]) -> list[str]:
    lines = [
        f"{'mode':<22} {'threads':>7} {'s/step':>8} {'model MB/s':>10} {'CPU s/step':>10} {'busiest rank':>12} "
        f"{'payload bytes':>14} {'payload %':>9} {'RSS before MB':>13} {'peak RSS MB':>11}"
    ]
    for r in rows:
        s = float(np.median(r["seconds"]))
        pay = int(np.median(r["payload_bytes"]))
        cpu = float(np.median(r["cpu_seconds"])) if r.get("cpu_seconds") else float("nan")
        busiest = float(np.median(r["rank_cpu_seconds"])) if r.get("rank_cpu_seconds") else float("nan")
        lines.append(
            f"{r['mode']:<22} {r['threads']:>7} {s:>8.3f} {r['model_bytes'] / 1e6 / s:>10.1f} {cpu:>10.3f} "
            f"{busiest:>12.3f} {pay:>14} {100 * pay / r['model_bytes']:>8.2f}% {r['rss_before_mb']:>13.0f} "
            f"{r['peak_rss_mb']:>11.0f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (4: ~124 MB of bf16)")
    parser.add_argument(
        "--vocab", type=int, default=VOCAB, help="vocabulary (151936, Qwen's: embeddings in parts, a row without)"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed delta steps per configuration")
    parser.add_argument("--lr", type=float, default=1e-5, help="Adam-like step size of the master weights")
    parser.add_argument("--threads", type=int, nargs="+", help="encode threads to compare (default: 1 and all cores)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks of the multi-rank row (0: none)")
    parser.add_argument("--load", type=int, default=0, help="busy processes at nice 10 during the run")
    parser.add_argument("--workdir")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one library run, as JSON
    parser.add_argument("--queued", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = model_shapes(args.layers, vocab=args.vocab)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-parallel-"))
    if args.child is not None:
        print(json.dumps(measure_library(shapes, args.steps, args.child, args.lr, work, args.queued, args.whole)))
        return
    load_procs = start_load(args.load)
    try:
        _run(args, shapes, work)
    finally:
        stop_load(load_procs)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, shapes: dict, work: Path) -> None:
    if args.load:
        print(f"load: {args.load} busy processes at nice 10 for the whole run")
    for line in machine():
        print(line)
    nbytes = sum(int(np.prod(s)) * 2 for s in shapes.values())
    print(f"model: {len(shapes)} bf16 tensors, {nbytes / 1e6:.0f} MB; {args.steps} delta steps at lr {args.lr:g}")
    gil = measure_gil(4096, 4096, args.lr)
    print(
        f"GIL check: two {gil['tensor']} bf16 deltas ({gil['mb']:.0f} MB each) on one thread "
        f"{gil['one_thread_s']:.3f} s, on two threads {gil['two_threads_s']:.3f} s "
        f"(x{gil['one_thread_s'] / gil['two_threads_s']:.2f}; {gil['two_threads_cpu_s'] / gil['two_threads_s']:.2f} "
        "cores busy on average: above 1 only if the threads run at once, without the GIL)",
        flush=True,
    )
    rows = []
    runs = [(threads, "") for threads in args.threads or sorted({1, _cores()})] + [(_cores(), "--queued")]
    if max(int(np.prod(s)) for s in shapes.values()) >= 2 * CodecConfig().part_elements:  # parts against none
        runs.append((_cores(), "--whole"))
    for threads, flag in runs:
        cmd = [sys.executable, "-m", "benchmarks.publish_parallel", "--child", str(threads), *([flag] if flag else [])]
        cmd += ["--layers", str(args.layers), "--vocab", str(args.vocab), "--steps", str(args.steps)]
        cmd += ["--lr", str(args.lr), "--workdir", str(work)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(summarize(rows)[-1], flush=True)
    if args.ranks:
        rows.append(measure_ranks(shapes, args.steps, args.ranks, args.lr, work))
        print(summarize(rows)[-1], flush=True)
    for cached in (False, True):
        rows.append(measure_cli(shapes, args.steps, args.lr, work, head_cache=cached))
        print(summarize(rows)[-1], flush=True)
    rows.append(measure_cli_watch(shapes, args.steps, args.lr, work))
    print(summarize(rows)[-1], flush=True)
    print("\n".join(summarize(rows)))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")


if __name__ == "__main__":
    main()
