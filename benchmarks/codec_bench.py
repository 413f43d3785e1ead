"""Compare delta codecs on adjacent bf16 checkpoints of an RL-like training run.

For every adjacent checkpoint pair of the corpus built by :mod:`rl_corpus` (one run per learning
rate) each tensor is compressed and decompressed with

* ``delta_swap``: our codec (``delta_swap.codec.encode_tensor_delta`` / ``decode_tensor_delta``);
* ``arc_v2`` / ``arc_v3``: Fireworks' ``fireworks-delta-compression`` 0.1.0 backends;
* ``xor+zstd3``: zstd level 3 (``zstandard``) of the XOR of the two checkpoints' bytes;

every round trip is checked bit-exact, and one table is printed: per lr and method the payload as a
percentage of the full bf16 model bytes, and encode / decode speed in MB of model bytes per second on
one pinned core, with the fraction of changed elements and of changes touching sign/exponent bits.

ARC v3 races its candidates and keeps the smallest one finished within 1.5x of the first; unless
``ARC3_CANDIDATE_WAIT_MULTIPLIER`` is set, this script lets all candidates finish, so the ARC v3
payload is deterministic and its best case. ARC payloads count the compressed blob only, not the
adler32 string ARC carries out of band.

Usage: ``python -m benchmarks.codec_bench [--steps N] [--lrs 1e-6 3e-6 1e-5] [--json PATH]``.
ARC is a benchmark-only dependency: ``pip install fireworks-delta-compression==0.1.0``.
"""

from __future__ import annotations

import os

os.environ.setdefault("ARC3_CANDIDATE_WAIT_MULTIPLIER", "1e9")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy; torch threads are set after the corpus is built

import argparse
import dataclasses
import importlib
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from benchmarks.rl_corpus import CorpusConfig, StateDict, rl_checkpoints  # noqa: E402

METHODS = ("delta_swap", "arc_v3", "arc_v2", "xor+zstd3")
#: torch dtype -> (safetensors name, mantissa bits, unsigned view dtype)
_FLOATS: dict[torch.dtype, tuple[str, int, torch.dtype]] = {
    torch.bfloat16: ("BF16", 7, torch.uint16),
    torch.float16: ("F16", 10, torch.uint16),
    torch.float32: ("F32", 23, torch.uint32),
}


@dataclasses.dataclass(frozen=True)
class TensorPair:
    """One tensor in two adjacent checkpoints, as raw bytes and as torch tensors."""

    dtype: str
    old: np.ndarray
    new: np.ndarray
    old_t: torch.Tensor
    new_t: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Method:
    """``encode`` returns (opaque payload, payload bytes); ``decode`` returns the new raw bytes."""

    name: str
    encode: Callable[[TensorPair], tuple[Any, int]]
    decode: Callable[[TensorPair, Any], np.ndarray]


@dataclasses.dataclass
class Totals:
    payload_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _codec_method(module_name: str) -> Method:
    codec = importlib.import_module(module_name)

    def encode(p: TensorPair) -> tuple[Any, int]:
        payload = codec.encode_tensor_delta(p.old, p.new, p.dtype)
        return payload, len(payload)

    return Method("delta_swap", encode, lambda p, payload: codec.decode_tensor_delta(p.old, payload, p.dtype))


def _arc_method(fmt: str) -> Method:
    try:
        from fireworks_delta_compression import delta_compress, delta_decompress
    except ImportError:
        sys.exit(
            "fireworks-delta-compression is not installed; it is a benchmark-only dependency:\n"
            "    pip install fireworks-delta-compression==0.1.0\n"
            f"or run without the ARC methods, e.g. --methods {' '.join(m for m in METHODS if 'arc' not in m)}"
        )

    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # raised inside arc_v2

    def encode(p: TensorPair) -> tuple[Any, int]:
        blob, checksum = delta_compress(src=p.old_t, dst=p.new_t, compression_format=fmt)
        return (blob, checksum), blob.numel()

    def decode(p: TensorPair, payload: Any) -> np.ndarray:
        blob, checksum = payload
        new_t = delta_decompress(src=p.old_t, compressed_diff=blob, checksum=checksum, compression_format=fmt)
        return _raw(new_t)

    return Method(fmt, encode, decode)


def _zstd_method() -> Method:
    compressor, decompressor = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()

    def encode(p: TensorPair) -> tuple[Any, int]:
        payload = compressor.compress(np.bitwise_xor(p.old, p.new).tobytes())
        return payload, len(payload)

    def decode(p: TensorPair, payload: Any) -> np.ndarray:
        return np.bitwise_xor(p.old, np.frombuffer(decompressor.decompress(payload), dtype=np.uint8))

    return Method("xor+zstd3", encode, decode)


def _methods(names: list[str], codec_module: str) -> list[Method]:
    build = {
        "delta_swap": lambda: _codec_method(codec_module),
        "arc_v3": lambda: _arc_method("arc_v3"),
        "arc_v2": lambda: _arc_method("arc_v2"),
        "xor+zstd3": _zstd_method,
    }
    return [build[name]() for name in names]


def _pairs(old: StateDict, new: StateDict) -> list[TensorPair]:
    return [
        TensorPair(_FLOATS[old[k].dtype][0], _raw(old[k]), _raw(new[k]), old[k], new[k]) for k in sorted(old)
    ]


def _change_counts(old: StateDict, new: StateDict) -> tuple[int, int, int]:
    """(elements, changed elements, changes touching sign/exponent bits) of one checkpoint pair."""
    elements = changed = sign_exp = 0
    for k, a in old.items():
        _, mantissa_bits, udtype = _FLOATS[a.dtype]
        x = a.reshape(-1).view(udtype).numpy()
        y = new[k].reshape(-1).view(udtype).numpy()
        diff = x ^ y
        elements += diff.size
        changed += int(np.count_nonzero(diff))
        sign_exp += int(np.count_nonzero(diff >> mantissa_bits))
    return elements, changed, sign_exp


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def _bench_lr(checkpoints: list[StateDict], methods: list[Method], repeats: int) -> dict[str, Any]:
    totals = {m.name: Totals() for m in methods}
    elements = changed = sign_exp = 0
    model_bytes = sum(t.numel() * t.element_size() for t in checkpoints[0].values())
    for step, (old, new) in enumerate(zip(checkpoints, checkpoints[1:])):
        e, c, s = _change_counts(old, new)
        elements, changed, sign_exp = elements + e, changed + c, sign_exp + s
        for pair in _pairs(old, new):
            for m in methods:
                (payload, size), enc_s = _timed(lambda m=m, pair=pair: m.encode(pair), repeats)
                decoded, dec_s = _timed(lambda m=m, pair=pair, payload=payload: m.decode(pair, payload), repeats)
                if not np.array_equal(decoded, pair.new):
                    raise SystemExit(f"round trip FAILED: {m.name}, step {step}, a {pair.dtype} tensor")
                t = totals[m.name]
                t.payload_bytes += size
                t.encode_s += enc_s
                t.decode_s += dec_s
    total_bytes = model_bytes * (len(checkpoints) - 1)
    return {
        "pairs": len(checkpoints) - 1,
        "model_bytes": model_bytes,
        "changed_fraction": changed / elements,
        "sign_exponent_fraction": sign_exp / max(changed, 1),
        "methods": {
            name: {
                **dataclasses.asdict(t),
                "payload_pct": 100.0 * t.payload_bytes / total_bytes,
                "encode_mb_s": total_bytes / t.encode_s / 1e6,
                "decode_mb_s": total_bytes / t.decode_s / 1e6,
            }
            for name, t in totals.items()
        },
    }


def _target(result: dict[str, Any]) -> dict[str, Any] | None:
    methods = result["methods"]
    if "delta_swap" not in methods or "arc_v3" not in methods:
        return None
    ours, arc = methods["delta_swap"], methods["arc_v3"]
    payload_ok = ours["payload_bytes"] <= arc["payload_bytes"]
    decode_ok = ours["decode_mb_s"] >= arc["decode_mb_s"]
    return {
        "met": payload_ok and decode_ok,
        "payload_vs_arc_v3": ours["payload_bytes"] / arc["payload_bytes"],
        "decode_speed_vs_arc_v3": ours["decode_mb_s"] / arc["decode_mb_s"],
    }


def _print_table(results: dict[float, dict[str, Any]]) -> None:
    header = f"{'method':<11} {'payload%':>9} {'enc MB/s':>9} {'dec MB/s':>9}"
    print(f"{'lr':>7} {'changed':>8} {'sign/exp':>8}  {header}")
    for lr, r in results.items():
        stats = f"{lr:>7g} {100 * r['changed_fraction']:>7.2f}% {100 * r['sign_exponent_fraction']:>7.2f}%"
        for i, (name, m) in enumerate(r["methods"].items()):
            prefix = stats if i == 0 else " " * len(stats)
            speeds = f"{m['encode_mb_s']:>9.1f} {m['decode_mb_s']:>9.1f}"
            print(f"{prefix}  {name:<11} {m['payload_pct']:>9.3f} {speeds}")
    verdicts = []
    for lr, r in results.items():
        t = _target(r)
        if t is None:
            verdicts.append(f"lr={lr:g} n/a (needs delta_swap and arc_v3)")
        else:
            verdicts.append(
                f"lr={lr:g} {'MET' if t['met'] else 'NOT MET'} (payload {t['payload_vs_arc_v3']:.3f}x, "
                f"decode speed {t['decode_speed_vs_arc_v3']:.2f}x of arc_v3)"
            )
    print("target (payload <= arc_v3 and decode >= arc_v3): " + "; ".join(verdicts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (= checkpoint pairs) per lr")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--codec", default="delta_swap.codec", help="module providing our codec's API")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per call; best kept")
    parser.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)), help="CPU core to pin to")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    methods = _methods(args.methods, args.codec)
    corpus = rl_checkpoints(tuple(args.lrs), args.steps)
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)

    results: dict[float, dict[str, Any]] = {}
    for lr, checkpoints in corpus.items():
        print(f"lr={lr:g}: {len(checkpoints) - 1} checkpoint pairs ...", file=sys.stderr, flush=True)
        results[lr] = _bench_lr(checkpoints, methods, args.repeats)
    _print_table(results)
    if args.json:
        report = {
            "corpus": dataclasses.asdict(CorpusConfig()),
            "steps": args.steps,
            "core": args.core,
            "repeats": args.repeats,
            "results": {f"{lr:g}": {**r, "target": _target(r)} for lr, r in results.items()},
        }
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
