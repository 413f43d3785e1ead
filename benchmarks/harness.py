"""What the update benchmarks share: random Llama checkpoints of a chosen size, RL-sized updates of
them, one engine server at a time with delta-swap following a store, and the engines' own anchors
(vLLM's layerwise reload from a folder, SGLang's ``update_weights_from_disk``, a restart).

Every server listens on 127.0.0.1 and is stopped when its ``with`` block ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from delta_swap import store_keys
from delta_swap.arena import file_owner
from delta_swap.freshness import record_path
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.settings import Settings, SwapPath
from delta_swap.stores import open_store
from examples.servers import sglang as sglang_server
from examples.servers import vllm as vllm_server
from examples.servers.process import Server
from examples.tiny_model import make_tiny_model

#: Llama shapes by parameter count (vocab 512: the offline tokenizer's size), bf16.
SIZES: dict[str, dict[str, int]] = {
    "3M": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 768},
    "25M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536},
    "60M": {"hidden_size": 768, "num_layers": 9, "num_heads": 12, "num_kv_heads": 4, "intermediate_size": 2304},
    "100M": {"hidden_size": 1024, "num_layers": 9, "num_heads": 16, "num_kv_heads": 4, "intermediate_size": 2816},
    "160M": {"hidden_size": 1024, "num_layers": 14, "num_heads": 16, "num_kv_heads": 4, "intermediate_size": 2816},
    "350M": {"hidden_size": 1536, "num_layers": 14, "num_heads": 16, "num_kv_heads": 4, "intermediate_size": 4096},
    "540M": {"hidden_size": 2048, "num_layers": 12, "num_heads": 16, "num_kv_heads": 4, "intermediate_size": 5632},
}
#: Qwen3-MoE shapes by parameter count (8 experts of ``intermediate_size // 4``, top 2), bf16.
MOE_SIZES: dict[str, dict[str, int]] = {
    "moe-45M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536},
    "moe-190M": {"hidden_size": 1024, "num_layers": 12, "num_heads": 16, "num_kv_heads": 4, "intermediate_size": 2048},
}
MODEL_NAME = "model"


def model_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def make_model(root: Path, size: str) -> Path:
    """A random checkpoint of ``size`` (cached in ``root``), init std 0.02 like HF's: a Llama for
    :data:`SIZES`, a Qwen3-MoE for :data:`MOE_SIZES`."""
    if size in MOE_SIZES:
        folder = root / f"qwen3_moe-{size.removeprefix('moe-')}"
        if not any(folder.glob("*.safetensors")):
            make_tiny_model(folder, vocab_size=512, init_std=0.02, family="qwen3_moe", **MOE_SIZES[size])
        return folder
    folder = root / f"llama-{size}"
    if not (folder / "model.safetensors").exists():
        make_tiny_model(folder, vocab_size=512, init_std=0.02, **SIZES[size])
    return folder


def rl_update(weights: dict[str, torch.Tensor], gen: torch.Generator, fraction: float = 0.02) -> None:
    """Move about ``fraction`` of every bf16 tensor's elements by -3..3 ULP in place: an RL step.

    Picks the elements by index (a few repeat) rather than with a full random mask, so a 100M
    model updates in well under a second and a synthetic trainer can keep a cadence of seconds.
    A move that would cross zero or reach the top exponent is left out: on the bits, 0x0000 - 2
    is 0xFFFE, a NaN, which no RL step makes (and a read-back rightly finds in every row it probes).
    """
    for w in weights.values():
        bits = w.view(-1).view(torch.int16)
        k = max(1, int(fraction * bits.numel()))
        idx = torch.randint(bits.numel(), (k,), generator=gen)
        old = bits[idx].to(torch.int32) & 0xFFFF
        new = old + torch.randint(-3, 4, (k,), generator=gen, dtype=torch.int32)
        keep = (new >= 0) & (new <= 0xFFFF) & (((old ^ new) & 0x8000) == 0) & ((new & 0x7F80) != 0x7F80)
        new = torch.where(new >= 0x8000, new - 0x10000, new)
        bits[idx[keep]] = new[keep].to(torch.int16)


@dataclass
class Trainer:
    """Publishes RL-sized updates of one model to a store, step after step."""

    model: Path
    store: Path
    step: int = 0
    #: The fraction of every tensor's elements each step moves (:func:`rl_update`).
    fraction: float = 0.02
    #: The publisher's settings (default: a base once, every allowed core, the default codec).
    publisher_config: PublisherConfig | None = None

    def __post_init__(self) -> None:
        shutil.rmtree(self.store, ignore_errors=True)  # a fresh chain: the store is this trainer's own
        self.weights = load_file(str(self.model / "model.safetensors"))
        self.gen = torch.Generator().manual_seed(0)
        self.publisher = Publisher(
            str(self.store),
            self.publisher_config or PublisherConfig(base_every=10_000),
            files={"config.json": (self.model / "config.json").read_bytes()},
        )
        self.publisher.publish(0, self.weights)
        self.publisher.flush()

    def advance(self) -> None:
        """The next training step: an RL-sized update of the weights (not published yet)."""
        rl_update(self.weights, self.gen, self.fraction)
        self.step += 1

    def publish_current(self) -> float:
        """Publish the current step; returns the wall time of the call and its commit."""
        start = time.perf_counter()
        self.publisher.publish(self.step, self.weights)
        self.publisher.flush()
        return time.perf_counter() - start

    def publish_next(self) -> float:
        """:meth:`advance`, then :meth:`publish_current` (only the publish is timed)."""
        self.advance()
        return self.publish_current()

    def write_checkpoint(self, folder: Path) -> Path:
        """The current weights as a checkpoint folder (what the engines' own reloads read)."""
        folder.mkdir(parents=True, exist_ok=True)
        save_file(self.weights, str(folder / "model.safetensors"))
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if (self.model / name).exists():
                shutil.copy(self.model / name, folder / name)
        return folder

    def close(self) -> None:
        self.publisher.close()


class PublishedAhead:
    """A trainer on other machines: ``steps`` RL-sized updates are published up front into a
    store of their own, and :meth:`release` makes the next one appear in ``store`` as a remote
    trainer's upload would (the snapshot's objects, its manifest last, then HEAD). The benchmark's
    cores then run only the engine, its load and delta-swap, not the trainer's encoding."""

    def __init__(self, model: Path, store: Path, steps: int) -> None:
        self.source = store.parent / f"{store.name}-trainer"
        self.store = store
        trainer = Trainer(model, self.source)
        try:
            self.heads = [(self.source / "HEAD").read_bytes()]
            for _ in range(steps):
                trainer.publish_next()
                self.heads.append((self.source / "HEAD").read_bytes())
        finally:
            trainer.close()
        shutil.rmtree(store, ignore_errors=True)
        self.step = -1
        self.release()  # the base

    @property
    def remaining(self) -> int:
        return len(self.heads) - 1 - self.step

    def release(self) -> int:
        """Make the next step visible in ``store``; returns that step."""
        asyncio.run(self._upload(self.heads[self.step + 1]))
        self.step += 1
        return self.step

    async def _upload(self, head: bytes) -> None:
        src, dst = open_store(str(self.source)), open_store(str(self.store), create=True)
        snapshot = json.loads(head)["snapshot_id"]
        manifest = store_keys.manifest_key(snapshot)
        for key in sorted(await src.list(store_keys.snapshot_prefix(snapshot)), key=lambda k: k == manifest):
            await dst.put(key, await src.get(key))
        await dst.put(store_keys.HEAD_KEY, head)


def add_swap_paths_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--swap-paths``: the swap paths to run (``Settings.swap_path``: auto, arena, reload, inplace,
    shadow), a server each."""
    parser.add_argument("--swap-paths", nargs="+", default=["auto"], choices=[p.value for p in SwapPath], help=help)


def path_label(swap_path: str, keep: bool) -> str:
    """A table's path column: the swap path, ``+keep`` where the server kept the memory updates free."""
    return f"{swap_path}+keep" if keep else swap_path


def add_keep_freed_memory_option(parser: argparse.ArgumentParser) -> None:
    """``--keep-freed-memory``: servers with ``Settings.keep_freed_memory`` off, on, or each in turn."""
    parser.add_argument(
        "--keep-freed-memory",
        nargs="+",
        choices=["off", "on"],
        default=["off"],
        help="servers with Settings.keep_freed_memory off, on, or each in turn (off on)",
    )


@contextlib.contextmanager
def engine_server(
    engine: str,
    model: Path,
    work: Path,
    *,
    store: Path | None,
    settings: dict | None = None,
    kv_cache_gib: int = 2,
    wait: bool = True,
    tp: int = 1,
) -> Iterator[Server]:
    """One engine server on ``model`` (``tp`` tensor-parallel ranks, one core each on a CPU); with
    ``store``, the plugin follows it (``settings`` added). Without ``wait`` it is yielded as soon
    as it is launched (call ``wait_healthy``)."""
    plugin = store is not None
    options = {"store": store.as_uri(), "poll_interval": 0.2, **(settings or {})} if plugin else None
    if store is not None:  # a record left by an earlier run in ``work`` would refuse this run's base
        record_path(str(work), store.as_uri()).unlink(missing_ok=True)
    binding = "|".join(str(core) for core in range(tp))
    if engine == "vllm":
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = binding
        server = vllm_server.start(
            model,
            work,
            settings=options,
            plugin=plugin,
            served_name=MODEL_NAME,
            extra=("--tensor-parallel-size", str(tp)) if tp > 1 else (),
            env=env,
            log_name=f"vllm-{time.monotonic_ns()}.log",
            timeout_s=900,
            wait=wait,
        )
    else:
        server = sglang_server.start(
            model,
            work,
            settings=options,
            plugin=plugin,
            served_name=MODEL_NAME,
            extra=("--tp-size", str(tp)) if tp > 1 else (),
            env={"SGLANG_CPU_OMP_THREADS_BIND": binding} if tp > 1 else None,
            log_name=f"sglang-{time.monotonic_ns()}.log",
            timeout_s=900,
            wait=wait,
        )
    try:
        yield server
    finally:
        server.stop()


def status(url: str) -> dict:
    return httpx.get(f"{url}/delta_swap/status", timeout=60).json()


def wait_status(url: str, done: Callable[[dict], bool], what: str, timeout: float, every_s: float) -> dict:
    """The server's status once ``done(status)`` holds (asked every ``every_s`` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = status(url)
        if done(st):
            return st
        time.sleep(every_s)
    raise TimeoutError(f"server did not {what}: {json.dumps(status(url))[:400]}")


def wait_step(url: str, step: int, timeout: float = 600, every_s: float = 0.1) -> dict:
    """The server's status once it serves ``step`` (its ``current_since`` says since when: a
    status asked every 20 ms took a tenth of a one-core server's CPU from the update it timed)."""
    return wait_status(url, lambda st: st["current_step"] == step, f"reach step {step}", timeout, every_s)


def served_after(st: dict, started: float) -> float:
    """Seconds from ``started`` (``time.time()``, on the server's host) until the server began
    serving the snapshot of its status ``st``."""
    return float(st["current_since"]) - started


def wait_ready(url: str, timeout: float = 900) -> dict:
    """The server's status once it serves its first snapshot and its codec is compiled (a cold
    numba cache costs ~15 s of a core, which must not land inside a measurement)."""
    return wait_status(url, lambda st: st["current_step"] is not None and st["codec_ready"], "get ready", timeout, 0.2)


def engine_reload(engine: str, url: str, folder: Path, version: str | None) -> float:
    """The engine's own full reload of the weights in ``folder``; returns its wall time."""
    start = time.perf_counter()
    if engine == "vllm":
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
        r = httpx.post(f"{url}/collective_rpc", json=body, timeout=900)
    else:
        body = {"model_path": str(folder), "weight_version": version, "flush_cache": True}
        r = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=900)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    if engine == "sglang" and not r.json().get("success", False):
        raise RuntimeError(f"update_weights_from_disk failed: {r.text[:300]}")
    return elapsed


def restart_time(engine: str, model: Path, work: Path, tp: int = 1) -> float:
    """Seconds from starting a fresh server on ``model`` to its first healthy answer."""
    start = time.perf_counter()
    with engine_server(engine, model, work, store=None, tp=tp):
        return time.perf_counter() - start


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_memory(pid: int) -> int:
    """Host memory a process tree holds, in bytes: the proportional set size of its processes
    (pages shared between them counted once overall) without their shared-memory mappings, plus
    the bytes the tree's files in the staging folder hold, mapped or not (weight arenas, the
    subscriber's copy, staged updates and read-back files: a tmpfs file takes memory from the
    moment it is allocated, before any process touches it)."""
    tree = process_tree(pid)
    total = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/smaps_rollup") as fh:
                fields = dict(line.split(":", 1) for line in fh if line.startswith("Pss"))
        except OSError:
            continue
        total += (int(fields.get("Pss", "0 kB").split()[0]) - int(fields.get("Pss_Shmem", "0 kB").split()[0])) * 1024
    pids = set(tree)
    for path in Path(Settings().staging_dir).glob("delta-swap-*"):
        if staging_file_owner(path) in pids:
            try:
                total += path.stat().st_blocks * 512
            except FileNotFoundError:
                continue
    return total


_STAGED_NAME = re.compile(r"-(\d+)-[0-9a-f]{8}(\.|$)")


def staging_file_owner(path: Path) -> int | None:
    """The pid that made a file in the staging folder: arena and layout files carry it after their
    kind, the others (``delta_swap.staging_files.staging_file``) before an 8-digit random tag."""
    if path.name.startswith(("delta-swap-arena-", "delta-swap-layout-")):
        return file_owner(path)
    found = _STAGED_NAME.search(path.name)
    return int(found.group(1)) if found else None
