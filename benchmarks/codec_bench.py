"""Compare delta codecs on adjacent bf16 checkpoints of RL-like training runs.

For every adjacent checkpoint pair of a corpus built by :mod:`rl_corpus` (``--corpus llama``: a 7M
Llama-style model at lr 1e-6/3e-6/1e-5; ``qwen2``: a 27M Qwen2-style model at 3e-6/1e-5) each
tensor is encoded and decoded with

* ``delta_swap``: our codec as the publisher writes it (codec v2, ``DSC2``; the tensor's shape is
  passed so unchanged rows are flagged; an ``EncoderMemory`` carried from one pair to the next, so
  the sign model's fit starts from the last step's from the second pair on, as a publisher's does;
  every timed repeat of a pair starts from the same memory);
* ``delta_swap@1``: the same codec at encoder level 1 (``CodecConfig(level=1)``: no sign model,
  a faster encode for a slightly larger payload; the decoder is the same);
* ``delta_swap_v1``: the previous codec (``CodecConfig(version=1)``, ``DSC1``), for reference;
* ``arc_v3@1`` / ``arc_v3@19``: Fireworks' ``fireworks-delta-compression`` 0.1.0 ARC v3 with its
  default zstd level 1 and with level 19 (its smallest payloads; 22 gives the same sizes), all
  candidates allowed to finish (``ARC3_CANDIDATE_WAIT_MULTIPLIER``): its best setting;
* ``arc_v2`` (only with ``--methods``), and ``xor+zstd1`` / ``xor+zstd3``: zstd level 1 (what
  NVIDIA ModelExpress ships) and 3 of the XOR of the bytes.

Every round trip is checked bit-exact. Columns: payload as % of the model bytes and relative to
the *smallest* ARC v3 payload of the run; encode and decode MB of model bytes per second on one
pinned core; *rebuild* = decode + apply + checksum verify (ours: xxh3-128, the project's checksum;
ARC verifies its own adler32 inside its decode), and for ours also the in-place rebuild into a
buffer that holds the old tensor (what a subscriber does with its weight arena). Timed calls
are interleaved round-robin on the same tensor, min of ``--repeats``, so load from other
processes hits every method alike; the verdict compares ratios from the same run.

Entropy lines, as % of the model bytes: *order-0* = per tensor, binary entropy of the change mask
+ order-0 entropy of the signed ULP steps; *conditional* = what codec v2's model aims at: the
change mask given the old element's exponent (and the changed-row flags where they pay), |step|-1
given the exponent, and per sign one bit or, where codec v2 fits a sign model (predicted signs),
the binary entropy of its flips. Model-table costs are not counted: they are limits.

Multi-core: one whole snapshot rebuilt by ``delta_swap.rebuild.apply_snapshot`` (threads over
tensors: decode, then verify every checksum) with 1 thread and with every core this process may
use, and ARC v3 (fastest setting) decoding the same snapshot's tensors on as many threads.

Usage: ``python -m benchmarks.codec_bench [--corpus llama qwen2] [--steps N] [--json PATH]``.
ARC is a benchmark-only dependency: ``pip install fireworks-delta-compression==0.1.0``.
"""

from __future__ import annotations

import os

os.environ.setdefault("ARC3_CANDIDATE_WAIT_MULTIPLIER", "1e9")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy; torch threads are set after the corpus is built

import argparse
import dataclasses
import json
import logging
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from benchmarks.rl_corpus import CORPORA, StateDict, add_corpus_arguments, rl_checkpoints  # noqa: E402
from delta_swap import codec  # noqa: E402
from delta_swap.checksum import checksum  # noqa: E402
from delta_swap.codec.v2 import sign_model  # noqa: E402

METHODS = ("delta_swap", "delta_swap@1", "delta_swap_v1", "arc_v3@1", "arc_v3@19", "arc_v2", "xor+zstd1", "xor+zstd3")
DEFAULT_METHODS = ("delta_swap", "delta_swap@1", "delta_swap_v1", "arc_v3@1", "arc_v3@19", "xor+zstd1", "xor+zstd3")
OURS = "delta_swap"
#: torch dtype -> (safetensors name, mantissa bits, exponent bits, unsigned view dtype)
_FLOATS: dict[torch.dtype, tuple[str, int, int, torch.dtype]] = {
    torch.bfloat16: ("BF16", 7, 8, torch.uint16),
    torch.float16: ("F16", 10, 5, torch.uint16),
    torch.float32: ("F32", 23, 8, torch.uint32),
}


@dataclasses.dataclass(frozen=True)
class TensorPair:
    """One tensor in two adjacent checkpoints, as raw bytes and as torch tensors."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    old: np.ndarray
    new: np.ndarray
    old_t: torch.Tensor
    new_t: torch.Tensor
    new_checksum: str


@dataclasses.dataclass(frozen=True)
class Method:
    """``encode`` returns (opaque payload, payload bytes); ``decode`` returns the new raw bytes;
    ``rebuild`` also verifies them (raises on a mismatch); ``in_place`` (ours only) applies the
    payload into ``buf``, which holds the old tensor, and verifies."""

    name: str
    encode: Callable[[TensorPair], tuple[Any, int]]
    decode: Callable[[TensorPair, Any], Any]
    rebuild: Callable[[TensorPair, Any], Any]
    in_place: Callable[[TensorPair, Any, np.ndarray], None] | None = None
    encode_repeats: int | None = None  # None: --repeats
    reset: Callable[[], None] = lambda: None  # called before each run (corpus, lr)


@dataclasses.dataclass
class Totals:
    payload_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    rebuild_s: float = 0.0
    in_place_s: float = 0.0


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


class VerifyError(SystemExit):
    pass


def _codec_method(name: str, config: codec.CodecConfig) -> Method:
    # each tensor's encoder memory after the previous pair, and after this pair's last encode
    before: dict[str, codec.TensorMemory] = {}
    after: dict[str, codec.TensorMemory] = {}
    pair_of: dict[str, TensorPair] = {}

    def encode(p: TensorPair) -> tuple[Any, int]:
        if pair_of.get(p.name) is not p:  # the next step of this tensor: what its last encode kept
            pair_of[p.name] = p
            before[p.name] = after.get(p.name, {})
        memory = {part: dataclasses.replace(kept) for part, kept in before[p.name].items()}
        payload = codec.encode_tensor_delta(p.old, p.new, p.dtype, config, p.shape, memory)
        after[p.name] = memory
        return payload, len(payload)

    def reset() -> None:
        for kept in (before, after, pair_of):
            kept.clear()

    def decode(p: TensorPair, payload: bytes) -> np.ndarray:
        return codec.decode(p.old, payload, p.dtype, p.old.size)

    def rebuild(p: TensorPair, payload: bytes) -> np.ndarray:
        out = codec.decode(p.old, payload, p.dtype, p.old.size)
        if checksum(out) != p.new_checksum:
            raise VerifyError(f"{name}: checksum mismatch on {p.name}")
        return out

    def in_place(p: TensorPair, payload: bytes, buf: np.ndarray) -> None:
        codec.decode_into(buf, payload, p.dtype)
        if checksum(buf) != p.new_checksum:
            raise VerifyError(f"{name}: checksum mismatch on {p.name} (in place)")

    return Method(name, encode, decode, rebuild, in_place, reset=reset)


def _arc_method(fmt: str, zstd_level: int | None = None) -> Method:
    try:
        from fireworks_delta_compression import delta_compress, delta_decompress
    except ImportError:
        sys.exit(
            "fireworks-delta-compression is not installed; it is a benchmark-only dependency:\n"
            "    pip install fireworks-delta-compression==0.1.0\n"
            f"or run without the ARC methods, e.g. --methods {' '.join(m for m in METHODS if 'arc' not in m)}"
        )
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # raised inside arc_v2
    arc3 = None
    if zstd_level is not None:
        import fireworks_delta_compression.backends.arc3 as arc3  # the level is read at call time

    def level() -> None:
        if arc3 is not None:
            arc3._ZSTD_LEVEL = zstd_level

    def encode(p: TensorPair) -> tuple[Any, int]:
        level()
        blob, adler = delta_compress(src=p.old_t, dst=p.new_t, compression_format=fmt)
        return (blob, adler), blob.numel()

    def decode(p: TensorPair, payload: Any) -> torch.Tensor:
        blob, adler = payload
        return delta_decompress(src=p.old_t, compressed_diff=blob, checksum=adler, compression_format=fmt)

    name = fmt if zstd_level is None else f"{fmt}@{zstd_level}"
    # level 19 encodes at a few MB/s: one timed run is plenty
    return Method(name, encode, decode, decode, encode_repeats=1 if (zstd_level or 0) > 3 else None)


def _zstd_method(level: int) -> Method:
    compressor, decompressor = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
    name = f"xor+zstd{level}"

    def encode(p: TensorPair) -> tuple[Any, int]:
        payload = compressor.compress(np.bitwise_xor(p.old, p.new).tobytes())
        return payload, len(payload)

    def decode(p: TensorPair, payload: Any) -> np.ndarray:
        return np.bitwise_xor(p.old, np.frombuffer(decompressor.decompress(payload), dtype=np.uint8))

    def rebuild(p: TensorPair, payload: Any) -> np.ndarray:
        out = decode(p, payload)
        if checksum(out) != p.new_checksum:
            raise VerifyError(f"{name}: checksum mismatch on {p.name}")
        return out

    return Method(name, encode, decode, rebuild)


def _methods(names: list[str]) -> list[Method]:
    build = {
        "delta_swap": lambda: _codec_method("delta_swap", codec.CodecConfig()),
        "delta_swap@1": lambda: _codec_method("delta_swap@1", codec.CodecConfig(level=1)),
        "delta_swap_v1": lambda: _codec_method("delta_swap_v1", codec.CodecConfig(version=1)),
        "arc_v3@1": lambda: _arc_method("arc_v3", 1),
        "arc_v3@19": lambda: _arc_method("arc_v3", 19),
        "arc_v2": lambda: _arc_method("arc_v2"),
        "xor+zstd1": lambda: _zstd_method(1),
        "xor+zstd3": lambda: _zstd_method(3),
    }
    return [build[name]() for name in names]


def _pairs(old: StateDict, new: StateDict) -> list[TensorPair]:
    out = []
    for k in sorted(old):
        raw_new = _raw(new[k])
        out.append(
            TensorPair(
                k,
                _FLOATS[old[k].dtype][0],
                tuple(old[k].shape),
                _raw(old[k]),
                raw_new,
                old[k],
                new[k],
                checksum(raw_new),
            )
        )
    return out


# ------------------------------------------------------------------------------ entropy


def _h2(n: int, k: int) -> float:
    """Bits of an ideal code for which k of n elements changed (binary entropy, n trials)."""
    if k <= 0 or k >= n:
        return 0.0
    p = k / n
    return float(-n * (p * np.log2(p) + (1 - p) * np.log2(1 - p)))


def _h0(x: np.ndarray) -> float:
    if x.size == 0:
        return 0.0
    _, counts = np.unique(x, return_counts=True)
    return float(-(counts * np.log2(counts / counts.sum())).sum())


def entropy_bits(t: torch.Tensor, u: torch.Tensor) -> tuple[float, float]:
    """(order-0 bits, conditional bits) of one float tensor pair (see the module docstring)."""
    _, mant, exp_bits, udtype = _FLOATS[t.dtype]
    bits = torch.finfo(t.dtype).bits
    a = t.reshape(-1).view(udtype).numpy().astype(np.int64)
    b = u.reshape(-1).view(udtype).numpy().astype(np.int64)
    sign, full = 1 << (bits - 1), (1 << bits) - 1
    key_a = np.where(a & sign, full - a, a | sign)
    key_b = np.where(b & sign, full - b, b | sign)
    m = a != b
    k = int(m.sum())
    d = key_b[m] - key_a[m]
    order0 = _h2(a.size, k) + _h0(d)
    e = (a >> mant) & ((1 << exp_bits) - 1)

    def position_bits(sel: np.ndarray) -> float:
        ne = np.bincount(e[sel], minlength=1 << exp_bits)
        ke = np.bincount(e[sel & m], minlength=1 << exp_bits)
        return sum(_h2(int(ne[x]), int(ke[x])) for x in np.flatnonzero(ne))

    positions = position_bits(np.ones(a.size, bool))
    shape = tuple(t.shape)
    if len(shape) >= 2 and shape[-1] >= 256:
        rows = a.size // shape[-1]
        alive = m.reshape(rows, -1).any(1)
        positions = min(positions, position_bits(np.repeat(alive, shape[-1])) + _h2(rows, int(alive.sum())))
    mags = np.abs(d) - 1
    sign_bits = float(k)
    if len(shape) >= 2 and shape[-1] >= 256:
        rows, cols = np.divmod(np.flatnonzero(m), shape[-1])
        fitted = sign_model.fit((a.size // shape[-1], shape[-1]), rows, cols, d < 0)
        if fitted is not None:
            sign_bits = min(sign_bits, _h2(k, int(np.count_nonzero(fitted[1] != (d < 0)))))
    values = sum(_h0(mags[e[m] == x]) for x in np.unique(e[m])) + sign_bits
    return order0, positions + values


# ------------------------------------------------------------------------------ timing


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def _decoded_bytes(out: Any) -> np.ndarray:
    return _raw(out) if isinstance(out, torch.Tensor) else out


def _bench_pair(pair: TensorPair, methods: list[Method], totals: dict[str, Totals], repeats: int) -> None:
    payloads = {}
    for m in methods:
        (payload, size), enc_s = _timed(lambda m=m: m.encode(pair), m.encode_repeats or repeats)
        payloads[m.name] = payload
        totals[m.name].payload_bytes += size
        totals[m.name].encode_s += enc_s
    jobs: list[tuple[str, str, Callable[[], Any]]] = []
    for m in methods:
        p = payloads[m.name]
        jobs.append((m.name, "decode", lambda m=m, p=p: m.decode(pair, p)))
        jobs.append((m.name, "rebuild", lambda m=m, p=p: m.rebuild(pair, p)))
    buf = np.empty_like(pair.old)
    best: dict[tuple[str, str], float] = {}
    for r in range(repeats):
        jobs = jobs[r % len(jobs) :] + jobs[: r % len(jobs)]  # rotate the order between repeats
        for name, kind, fn in jobs:
            t0 = time.perf_counter()
            out = fn()
            best[(name, kind)] = min(best.get((name, kind), float("inf")), time.perf_counter() - t0)
            if r == 0 and not np.array_equal(_decoded_bytes(out), pair.new):
                raise VerifyError(f"round trip FAILED: {name} ({kind}) on {pair.name}")
        for m in methods:
            if m.in_place is not None:
                buf[:] = pair.old  # the arena holds the old tensor (not timed)
                t0 = time.perf_counter()
                m.in_place(pair, payloads[m.name], buf)
                totals_key = (m.name, "in_place")
                best[totals_key] = min(best.get(totals_key, float("inf")), time.perf_counter() - t0)
    for m in methods:
        t = totals[m.name]
        t.decode_s += best[(m.name, "decode")]
        t.rebuild_s += best[(m.name, "rebuild")]
        t.in_place_s += best.get((m.name, "in_place"), 0.0)


def _snapshot_rebuild(
    old: StateDict, new: StateDict, arc: Method | None, threads: list[int], repeats: int
) -> dict[str, dict[int, float]]:
    """Seconds to rebuild the snapshot old -> new with apply_snapshot (and ARC v3 on a thread
    pool over tensors), per thread count: min of ``repeats``."""
    import asyncio
    import tempfile

    from delta_swap.chain import ChainReader
    from delta_swap.publisher import Publisher, PublisherConfig
    from delta_swap.rebuild import apply_snapshot, fetch_shards
    from delta_swap.stores import FileStore
    from delta_swap.tensors import HostTensor

    logging.getLogger("delta_swap.chain").setLevel(logging.ERROR)  # "not authenticated": a throwaway store
    with tempfile.TemporaryDirectory() as root:
        with Publisher(root, PublisherConfig(base_every=100, max_delta_fraction=1.0)) as pub:
            pub.publish(0, old)
            pub.publish(1, new)

        async def load() -> tuple[Any, dict[str, np.ndarray]]:
            reader = ChainReader(FileStore(root))
            manifest = (await reader.list())[-1]
            return manifest, await fetch_shards(reader.store, manifest)

        manifest, shards = asyncio.run(load())
    assert manifest.kind == "delta"
    prev = {k: HostTensor(_FLOATS[v.dtype][0], tuple(v.shape), _raw(v)) for k, v in old.items()}
    jobs: list[tuple[str, int, Callable[[], Any]]] = [
        (OURS, n, lambda n=n: apply_snapshot(prev, manifest, shards, threads=n)) for n in threads
    ]
    if arc is not None:
        pairs = _pairs(old, new)
        payloads = [arc.encode(p)[0] for p in pairs]

        def arc_snapshot(n: int) -> None:
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda i: arc.decode(pairs[i], payloads[i]), range(len(pairs))))

        jobs += [(arc.name, n, lambda n=n: arc_snapshot(n)) for n in threads]
    out: dict[str, dict[int, float]] = {}
    for _ in range(repeats):  # interleaved, like the per-tensor timings; a snapshot takes only tens of ms
        for name, n, fn in jobs:
            _, s = _timed(fn, 1)
            out.setdefault(name, {})[n] = min(out.get(name, {}).get(n, float("inf")), s)
    return out


def _bench_lr(
    checkpoints: list[StateDict],
    methods: list[Method],
    repeats: int,
    threads: list[int],
    core: int,
    all_cores: set[int],
) -> dict[str, Any]:
    totals = {m.name: Totals() for m in methods}
    for m in methods:
        m.reset()
    elements = changed = 0
    order0 = conditional = 0.0
    model_bytes = sum(t.numel() * t.element_size() for t in checkpoints[0].values())
    for old, new in zip(checkpoints, checkpoints[1:]):
        for k, a in old.items():
            changed += int(
                (a.reshape(-1).view(_FLOATS[a.dtype][3]) != new[k].reshape(-1).view(_FLOATS[a.dtype][3])).sum()
            )
            elements += a.numel()
            h0, hc = entropy_bits(a, new[k])
            order0, conditional = order0 + h0, conditional + hc
        for pair in _pairs(old, new):
            _bench_pair(pair, methods, totals, repeats)
    total_bytes = model_bytes * (len(checkpoints) - 1)
    result: dict[str, Any] = {
        "pairs": len(checkpoints) - 1,
        "model_bytes": model_bytes,
        "changed_fraction": changed / elements,
        "entropy_order0_pct": 100.0 * order0 / 8 / total_bytes,
        "entropy_conditional_pct": 100.0 * conditional / 8 / total_bytes,
        "methods": {
            name: {
                **dataclasses.asdict(t),
                "payload_pct": 100.0 * t.payload_bytes / total_bytes,
                "encode_mb_s": total_bytes / t.encode_s / 1e6,
                "decode_mb_s": total_bytes / t.decode_s / 1e6,
                "rebuild_mb_s": total_bytes / t.rebuild_s / 1e6,
                "in_place_mb_s": total_bytes / t.in_place_s / 1e6 if t.in_place_s else None,
            }
            for name, t in totals.items()
        },
    }
    if OURS in totals and threads:
        arcs = [m for m in methods if m.name.startswith("arc_v3")]
        fastest = max(arcs, key=lambda m: result["methods"][m.name]["rebuild_mb_s"]) if arcs else None
        os.sched_setaffinity(0, all_cores)
        torch.set_num_threads(1)  # threads come from the pools, one tensor each
        try:
            secs = _snapshot_rebuild(checkpoints[-2], checkpoints[-1], fastest, threads, max(repeats, 7))
        finally:
            os.sched_setaffinity(0, {core})
        result["snapshot_rebuild_mb_s"] = {
            m: {str(n): model_bytes / s / 1e6 for n, s in v.items()} for m, v in secs.items()
        }
    result["target"] = _target(result)
    return result


def _target(result: dict[str, Any]) -> dict[str, Any] | None:
    """Issue 12's targets, against ARC v3's best of its settings measured in the same run."""
    methods = result["methods"]
    arcs = {k: v for k, v in methods.items() if k.startswith("arc_v3")}
    if OURS not in methods or not arcs:
        return None
    ours = methods[OURS]
    payload = ours["payload_bytes"] / min(a["payload_bytes"] for a in arcs.values())
    rebuild = ours["rebuild_mb_s"] / max(a["rebuild_mb_s"] for a in arcs.values())
    in_place = ours["in_place_mb_s"] / max(a["rebuild_mb_s"] for a in arcs.values())
    encode = ours["encode_mb_s"] / max(a["encode_mb_s"] for a in arcs.values())
    return {
        "payload_vs_best_arc_v3": payload,
        "payload_met": payload <= 0.6,
        "rebuild_vs_fastest_arc_v3": rebuild,
        "in_place_rebuild_vs_fastest_arc_v3": in_place,
        "rebuild_met": rebuild >= 2,
        "encode_vs_fastest_arc_v3": encode,
        "encode_met": encode >= 1,
    }


def _print_table(corpus: str, results: dict[float, dict[str, Any]], repeats: int) -> None:
    print(f"\n=== corpus {corpus} (one pinned core, min of {repeats}, interleaved) ===")
    head = f"{'method':<14} {'payload%':>9} {'x bestARC':>9} {'enc MB/s':>9} {'dec MB/s':>9} {'rebuild':>8} {'in-place':>8}"
    print(f"{'lr':>7} {'changed':>8}  {head}")
    for lr, r in results.items():
        arc_payloads = [m["payload_bytes"] for k, m in r["methods"].items() if k.startswith("arc_v3")]
        best_arc = min(arc_payloads) if arc_payloads else None
        stats = f"{lr:>7g} {100 * r['changed_fraction']:>7.2f}%"
        for i, (name, m) in enumerate(r["methods"].items()):
            prefix = stats if i == 0 else " " * len(stats)
            rel = f"{m['payload_bytes'] / best_arc:>9.3f}" if best_arc else f"{'':>9}"
            in_place = f"{m['in_place_mb_s']:>8.0f}" if m["in_place_mb_s"] else f"{'':>8}"
            print(
                f"{prefix}  {name:<14} {m['payload_pct']:>9.4f} {rel} {m['encode_mb_s']:>9.1f} "
                f"{m['decode_mb_s']:>9.0f} {m['rebuild_mb_s']:>8.0f} {in_place}"
            )
        pad = " " * (len(stats) + 2)
        print(
            f"{pad}entropy: order-0 {r['entropy_order0_pct']:.4f}%   conditional (codec v2's model) "
            f"{r['entropy_conditional_pct']:.4f}%"
        )
        if "snapshot_rebuild_mb_s" in r:
            parts = [
                f"{m} " + " / ".join(f"{v:.0f}" for v in per.values()) for m, per in r["snapshot_rebuild_mb_s"].items()
            ]
            counts = " / ".join(next(iter(r["snapshot_rebuild_mb_s"].values())).keys())
            print(f"{pad}whole-snapshot rebuild MB/s on {counts} threads: " + "; ".join(parts))
        t = r["target"]
        if t:

            def ok(flag: bool) -> str:
                return "met" if flag else "MISSED"

            print(
                f"{pad}vs ARC v3: payload {t['payload_vs_best_arc_v3']:.3f}x of its smallest ({ok(t['payload_met'])}, "
                f"<= 0.6); rebuild {t['rebuild_vs_fastest_arc_v3']:.2f}x of its fastest, in place "
                f"{t['in_place_rebuild_vs_fastest_arc_v3']:.2f}x ({ok(t['rebuild_met'])}, >= 2); encode "
                f"{t['encode_vs_fastest_arc_v3']:.2f}x ({ok(t['encode_met'])}, >= 1)"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_corpus_arguments(parser)
    parser.add_argument("--lrs", type=float, nargs="+", help="default: each corpus's own learning rates")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per call; best kept")
    parser.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)), help="CPU core to pin to")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="*",
        help="thread counts of the whole-snapshot rebuild "
        "(default: 1 and every core this process may use; none to skip)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    all_cores = set(os.sched_getaffinity(0))
    threads = sorted({1, len(all_cores)}) if args.threads is None else args.threads
    methods = _methods(args.methods)
    t0 = time.perf_counter()
    codec.warm_up()  # JIT-compile (or load) codec v2's kernels before anything is timed
    print(f"codec v2 kernels ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    report: dict[str, Any] = {
        "steps": args.steps,
        "core": args.core,
        "repeats": args.repeats,
        "load_average_start": os.getloadavg(),
        "corpora": {},
    }
    for name in args.corpus:
        config, lrs = CORPORA[name]
        corpus = rl_checkpoints(tuple(args.lrs or lrs), args.steps, config)
        os.sched_setaffinity(0, {args.core})
        torch.set_num_threads(1)
        results: dict[float, dict[str, Any]] = {}
        for lr, checkpoints in corpus.items():
            print(f"{name} lr={lr:g}: {len(checkpoints) - 1} checkpoint pairs ...", file=sys.stderr, flush=True)
            results[lr] = _bench_lr(checkpoints, methods, args.repeats, threads, args.core, all_cores)
        _print_table(name, results, args.repeats)
        report["corpora"][name] = {
            "config": dataclasses.asdict(config),
            "results": {f"{lr:g}": r for lr, r in results.items()},
        }
    report["load_average_end"] = os.getloadavg()
    print(
        f"\nload average at start {report['load_average_start'][0]:.2f}, at end {report['load_average_end'][0]:.2f} "
        f"({len(all_cores)} cores)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
