"""Why codec v2 is built from the tools it is: three measurements on the Llama corpus of
:mod:`rl_corpus` (checkpoint pairs 1-3; pair 0 trains what needs training).

1. **zstd with trained dictionaries**, the best byte-oriented coder at hand, on codec v1's byte
   planes (gaps and zigzag ULP steps): level 19 without and with a dictionary trained on pair 0's
   planes, against codec v2's payload; and zstd-19 of codec v2's payloads (is anything left?).
2. **constriction** (a Rust ANS / range coder with Python bindings): the change mask coded in
   natural order as per-element Bernoulli symbols with v2's context (the change rate of the old
   element's exponent), one vectorised call per tensor; size against the ideal and decode time
   per element against codec v2's whole in-place rebuild.
3. **numba against a compiled extension**: codec v2's per-element pass (the hot loop) as C,
   built with ``cc -O3 -march=native`` and called through ctypes on the same inputs, against the
   numba kernel; skipped without a C compiler.

Usage: ``python -m benchmarks.codec_tools [--lrs 1e-6 1e-5] [--core N]``. Needs constriction
(``pip install constriction``, benchmark only) for part 2.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from benchmarks.rl_corpus import CORPORA, rl_checkpoints
from delta_swap import codec
from delta_swap.codec import v2


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _v1_planes(a: np.ndarray, b: np.ndarray) -> list[bytes]:
    """Codec v1's streams of one bf16 tensor pair: 4 gap planes and 2 zigzag-step planes."""
    u, v = a.view(np.uint16).astype(np.int64), b.view(np.uint16).astype(np.int64)
    changed = np.flatnonzero(u != v)
    gaps = (np.diff(changed, prepend=-1) - 1).astype(np.uint32)
    key = lambda x: np.where(x & 0x8000, 0xFFFF - x, x | 0x8000)  # noqa: E731
    d = (key(v[changed]) - key(u[changed])).astype(np.int16)
    zig = ((d << 1) ^ (d >> 15)).view(np.uint16)
    planes = [np.ascontiguousarray(gaps.view(np.uint8).reshape(-1, 4)[:, j]) for j in range(4)]
    planes += [np.ascontiguousarray(zig.view(np.uint8).reshape(-1, 2)[:, j]) for j in range(2)]
    return [p.tobytes() for p in planes]


def zstd_dictionaries(cks: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    names = sorted(cks[0])
    samples = [p for k in names for p in _v1_planes(_raw(cks[0][k]), _raw(cks[1][k])) if p]
    dictionary = zstandard.train_dictionary(64 * 1024, samples, level=19)
    plain, with_dict = zstandard.ZstdCompressor(level=19), zstandard.ZstdCompressor(level=19, dict_data=dictionary)
    sizes = {
        "v1 planes, zstd-19": 0,
        "v1 planes, zstd-19 + 64 KiB dictionary": 0,
        "codec v2": 0,
        "codec v2, then zstd-19": 0,
    }
    model = 0
    for t in range(1, len(cks) - 1):
        for k in names:
            a, b = _raw(cks[t][k]), _raw(cks[t + 1][k])
            model += a.size
            for p in _v1_planes(a, b):
                sizes["v1 planes, zstd-19"] += min(len(p), len(plain.compress(p)))
                sizes["v1 planes, zstd-19 + 64 KiB dictionary"] += min(len(p), len(with_dict.compress(p)))
            payload = codec.encode_tensor_delta(a, b, "BF16", shape=tuple(cks[t][k].shape))
            sizes["codec v2"] += len(payload)
            sizes["codec v2, then zstd-19"] += min(len(payload), len(plain.compress(payload)))
    return {k: 100.0 * v / model for k, v in sizes.items()}


def constriction_mask(cks: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    import constriction

    family = constriction.stream.model.Bernoulli(perfect=False)
    ideal = bits = 0.0
    decode_s = rebuild_s = 0.0
    elements = 0
    for t in range(1, len(cks) - 1):
        for k in sorted(cks[t]):
            a, b = _raw(cks[t][k]), _raw(cks[t + 1][k])
            u, v = a.view(np.uint16), b.view(np.uint16)
            mask = (u != v).astype(np.int32)
            e = (u >> 7) & 0xFF
            rate = np.bincount(e, weights=mask, minlength=256) / np.maximum(np.bincount(e, minlength=256), 1)
            p = np.clip(rate[e], 1e-6, 1 - 1e-6)
            ideal += float(-(np.where(mask, np.log2(p), np.log2(1 - p))).sum())
            coder = constriction.stream.stack.AnsCoder()
            coder.encode_reverse(mask, family, p)
            compressed = coder.get_compressed()
            bits += 32 * compressed.size
            start = time.perf_counter()
            decoded = constriction.stream.stack.AnsCoder(compressed).decode(family, p)
            decode_s += time.perf_counter() - start
            assert np.array_equal(decoded, mask)
            payload = codec.encode_tensor_delta(a, b, "BF16", shape=tuple(cks[t][k].shape))
            buf = a.copy()
            start = time.perf_counter()
            codec.decode_into(buf, payload, "BF16")
            rebuild_s += time.perf_counter() - start
            elements += u.size
    return {
        "mask bits vs ideal (table-free)": bits / ideal,
        "constriction mask decode ns/element": 1e9 * decode_s / elements,
        "codec v2 whole in-place decode ns/element": 1e9 * rebuild_s / elements,
    }


_C_WALK = r"""
#include <stdint.h>
/* codec v2's pass for bf16, as codec.v2's _make_walk (unsigned indices, as there) */
int64_t walk_bf16(uint16_t *out, uint64_t n, const uint64_t *lut, uint64_t D, const uint8_t *row_dead,
                  uint64_t n_rows, uint64_t row_len, uint64_t *cnt, uint64_t *evp, const int64_t *ev,
                  uint64_t *vp, const uint64_t *vend, const int64_t *vals) {
    int64_t bad = 0;
    for (uint64_t r = 0, s = 0; r < n_rows; r++) {
        uint64_t e = s + row_len < n ? s + row_len : n, i = s;
        s = e;
        if (row_dead[r]) continue;
        for (; i < e; i++) {
            uint64_t x = out[i], c = lut[x >> 7], t = cnt[c], q;
            cnt[c] = t - 1;
            if (t == 0) {
                uint64_t p = evp[c];
                cnt[c] = (uint64_t)ev[p];
                evp[c] = p + 1;
                if (c >= D) continue;
                q = vp[c]++;
            } else if (c < D) {
                continue;
            } else {
                q = vp[c];
                if (q >= vend[c]) return -10;
                vp[c] = q + 1;
            }
            int64_t xi = (int64_t)x;
            int64_t k = (xi ^ (0x8000 | ((-(xi >> 15)) & 0x7FFF))) + vals[q];
            bad |= k | (0xFFFF - k);
            out[i] = (uint16_t)(k ^ (0x8000 | ((-(1 - (k >> 15))) & 0x7FFF)));
        }
    }
    return bad < 0 ? -11 : 0;
}
"""


def _compiled_walk() -> ctypes.CDLL | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="codec-tools-"))
    (folder / "walk.c").write_text(_C_WALK)
    subprocess.run(
        [cc, "-O3", "-march=native", "-shared", "-fPIC", "-o", str(folder / "walk.so"), str(folder / "walk.c")],
        check=True,
    )
    return ctypes.CDLL(str(folder / "walk.so"))


def numba_vs_c(cks: list[dict[str, torch.Tensor]], repeats: int = 5) -> dict[str, float] | None:
    lib = _compiled_walk()
    if lib is None:
        return None

    def ptr(arr: np.ndarray) -> ctypes.c_void_p:
        return arr.ctypes.data_as(ctypes.c_void_p)

    lib.walk_bf16.restype = ctypes.c_int64
    numba_s = c_s = 0.0
    elements = 0
    for t in range(1, len(cks) - 1):
        for k in sorted(cks[t]):
            a, b = _raw(cks[t][k]), _raw(cks[t + 1][k])
            payload = codec.encode_tensor_delta(
                a, b, "BF16", codec.CodecConfig(dense_fraction=2.0, predict_signs=False), shape=tuple(cks[t][k].shape)
            )  # the C walk has no sign model
            if payload[4] != v2.METHOD_ULP:
                continue
            scratch = v2.decoder._Scratch()
            layout = np.zeros(1, v2.parse.LAYOUT)
            p = np.frombuffer(payload, np.uint8)
            pos = 7 + len(v2.wire.varint(a.size // 2))
            err = v2.parse.parse_ulp(p, pos, a.size // 2, 8, 0xFFFF, 0, scratch.i64, scratch.u8, layout)
            if err == 2:
                scratch.grow(int(layout[0]["need_i64"]), int(layout[0]["need_u8"]))
                err = v2.parse.parse_ulp(p, pos, a.size // 2, 8, 0xFFFF, 0, scratch.i64, scratch.u8, layout)
            if err != 1:
                continue
            lay = v2.parse.UlpLayout(*layout[0].tolist())
            D, row_len, K, n_ev, n_changed, n_rows, o_ = (
                lay.dense_first,
                lay.walk_row_len,
                lay.n_classes,
                lay.n_event_slots,
                lay.n_changed,
                lay.n_rows,
                lay.lut_at,
            )
            i64 = scratch.i64
            lut = i64[o_ : o_ + 512]
            state = i64[o_ + 512 : o_ + 512 + 5 * (K + 1)].copy()
            ev, vals = i64[:n_ev], i64[n_ev : n_ev + n_changed]
            row_dead = scratch.u8[:n_rows].copy() if n_rows else np.zeros(1, np.uint8)
            best = {"numba": float("inf"), "c": float("inf")}
            no_table, no_codes = np.zeros(64, np.uint64), np.zeros(1, np.uint8)
            for _ in range(repeats):
                for which in ("numba", "c"):
                    st = state.copy()
                    cnt, evp, vp, vend = (st[j * (K + 1) : (j + 1) * (K + 1)] for j in range(4))
                    out = a.view(np.uint16).copy()
                    start = time.perf_counter()
                    if which == "numba":
                        u = np.uint64
                        rc = v2.decode_kernels.WALKS["BF16"](
                            out,
                            lut.view(u),
                            D,
                            row_dead,
                            row_len,
                            cnt.view(u),
                            evp.view(u),
                            ev,
                            vp.view(u),
                            vend.view(u),
                            vals,
                            no_table,
                            no_codes,
                            no_codes,
                            0,
                            1,
                        )
                    else:
                        rc = lib.walk_bf16(
                            ptr(out),
                            ctypes.c_int64(out.size),
                            ptr(lut),
                            ctypes.c_int64(D),
                            ptr(row_dead),
                            ctypes.c_int64(row_dead.size),
                            ctypes.c_int64(row_len),
                            ptr(cnt),
                            ptr(evp),
                            ptr(ev),
                            ptr(vp),
                            ptr(vend),
                            ptr(vals),
                        )
                    best[which] = min(best[which], time.perf_counter() - start)
                    assert rc == 0 and np.array_equal(out.view(np.uint8), b), which
            numba_s += best["numba"]
            c_s += best["c"]
            elements += a.size // 2
    return {
        "numba pass ns/element": 1e9 * numba_s / elements,
        "C -O3 -march=native pass ns/element": 1e9 * c_s / elements,
        "numba / C time": numba_s / c_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)))
    args = parser.parse_args(argv)
    config, _ = CORPORA["llama"]
    corpus = rl_checkpoints(tuple(args.lrs), 4, config)
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    codec.warm_up()
    for lr, cks in corpus.items():
        print(f"\nlr={lr:g} (llama, pairs 1-3, one core)")
        for k, v in zstd_dictionaries(cks).items():
            print(f"  {k:<48} {v:.4f}% of the model")
        try:
            results = constriction_mask(cks)
        except ImportError:
            print("  constriction: not installed (pip install constriction)")
        else:
            for k, v in results.items():
                print(f"  {k:<48} {v:.3f}")
        c = numba_vs_c(cks)
        for k, v in (c or {"C compiler": float("nan")}).items():
            print(f"  {k:<48} {v:.3f}")


if __name__ == "__main__":
    main()
