"""A working coder for the ``values`` lever of ``context_entropy`` (issue 12), measured against v2.

    python -m benchmarks.values_prototype [--corpus llama qwen2] [--steps 4]

Codec v2 codes each change's |step| per exponent class (in class order) and its sign as a raw
bit. The lever codes both together with rANS, in element order, given the class and the
element's previous step (the decoder holds the tensor before the previous one too, so it knows
that step): the symbol is (min(|step|, T) - 1, sign relative to the previous step). This script
codes the values of real checkpoint pairs that way, with the class boundaries of the real v2
payload, decodes them again (bit-exact, checked) and prints:

* the bytes v2 spends on values (its payload minus the payload of the same changes with every
  step +1 and no sign, plus the sign bytes), and the prototype's (tables, rANS words and
  escapes, with the per-tensor choice of context: none, changed-or-not, or |previous step| 0-3;
  a tensor whose v2 values are smaller keeps them);
* what the whole payload would then be, as a fraction of v2's;
* the time to decode and apply the values, in ns per element, beside v2's whole decode of the
  same tensors (v2 spends ~0.3 ns per element on values and ~0.4 on applying the changes at lr
  1e-5: benchmarks/README.md).

Two decoders: one keeps the tensor before the old one (context: |previous step| 0, 1, 2 or 3+),
the other 2 bits per element (moved in the previous step, and down). Both read the changed
elements in element order, two interleaved rANS states, one table per context.

Positions are left as v2 codes them. This is a measurement before a format change, not a format:
escapes are counted at v2's cost (6 + L bits) but handed to the decoder as a list.
"""

from __future__ import annotations

import argparse
import time

import numba as nb
import numpy as np
import torch

from benchmarks.context_entropy import bf16_keys
from benchmarks.rl_corpus import add_corpus_arguments, changed_bf16_triples, corpus_runs
from delta_swap.codec import v1, v2

T = 16  # |step| 1..T-1 literal, T and above escape
SYMBOLS = 2 * T
SCALE_BITS = 9  # 512 slots per context: smaller and faster than 2048 here (tables stay in L1/L2)
SCALE = 1 << SCALE_BITS
RANS_L = 1 << 16
_jit = nb.njit(cache=True, nogil=True)


def v2_classes(payload: bytes) -> list[tuple[int, int]]:
    """The [lo, hi] exponent ranges of a v2 ULP payload's classes (docs/FORMAT.md)."""
    rd = v2.wire.Reader(memoryview(payload))

    def skip(fields: int) -> None:
        for _ in range(fields):
            rd.varint(1 << 63, "field")

    assert bytes(rd.take(4, "magic")) == b"DSC2" and rd.u8() == 1
    rd.take(2, "elem_size and flags")
    skip(3)  # n_elements, n_changed, row_len
    if rd.u8():  # row_mode: n_row_events, row_m
        skip(2)
    classes, hi = [], -1
    for _ in range(rd.varint(1 << 63, "n_classes")):
        lo = hi + 1 + rd.varint(1 << 63, "lo_delta")
        hi = lo + rd.varint(1 << 63, "span")
        classes.append((lo, hi))
        cflags = rd.u8()
        skip(3 if cflags & 1 else 2)  # n_events, [n_class_changes], m
        if cflags >> 1 == 1:
            skip(1)  # mag_m
        elif cflags >> 1 == 2:
            skip(rd.varint(1 << 63, "T"))  # the table's frequencies
    return classes


def _quantize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to SCALE, at least 1 for every used symbol."""
    f = np.where(counts > 0, np.maximum(1, np.floor(counts * SCALE / counts.sum())), 0).astype(np.int64)
    f[np.argmax(counts)] += SCALE - f.sum()
    assert f.min() >= 0
    return f


@_jit
def _encode(ctx, sym, freqs, out):
    """Two interleaved rANS states (change j uses state j % 2), coded in reverse; returns how many
    uint16 words it wrote at the end of out (the decoder reads both states first)."""
    cum = np.zeros((freqs.shape[0], SYMBOLS + 1), np.int64)
    for c in range(freqs.shape[0]):
        for s in range(SYMBOLS):
            cum[c, s + 1] = cum[c, s] + freqs[c, s]
    xs = np.full(2, RANS_L, np.uint64)
    w = out.size
    for j in range(ctx.size - 1, -1, -1):
        c, s = ctx[j], sym[j]
        x = xs[j & 1]
        fs = np.uint64(freqs[c, s])
        if x >= (fs << np.uint64(32 - SCALE_BITS)):
            w -= 1
            out[w] = np.uint16(x & np.uint64(0xFFFF))
            x >>= np.uint64(16)
        xs[j & 1] = ((x // fs) << np.uint64(SCALE_BITS)) + (x % fs) + np.uint64(cum[c, s])
    for k in (1, 0):
        w -= 1
        out[w] = np.uint16(xs[k] >> np.uint64(16))
        w -= 1
        out[w] = np.uint16(xs[k] & np.uint64(0xFFFF))
    return out.size - w


_inline = nb.njit(inline="always", nogil=True)


@_inline
def _key(bits):
    return bits ^ (0x8000 | ((-(bits >> 15)) & 0x7FFF))


@_inline
def _step(out, i, ko, ctx, down, slots, words, wp, last, x, escapes, e):
    """Decode change i's symbol with context ctx from state x and write out[i]; ``down``: the
    previous step went down (the sign is coded relative to it)."""
    v = np.uint64(slots[ctx, x & np.uint64(SCALE - 1)])
    s = np.int64(v & np.uint64(63))
    x = (v >> np.uint64(18)) * (x >> np.uint64(SCALE_BITS)) + ((v >> np.uint64(6)) & np.uint64(SCALE - 1))
    need = x < RANS_L  # renormalise without a branch, as v2 does
    nxt = np.uint64(words[min(wp, last)])
    x = (x << np.uint64(16)) | nxt if need else x
    wp += np.int64(need)
    size = (s >> 1) + 1
    if size == T:
        size += escapes[e]
        e += 1
    negative = (s & 1) ^ down
    k = ko + (size ^ -negative) + negative
    out[i] = k ^ (0x8000 | ((-(1 - (k >> 15))) & 0x7FFF))
    return x, wp, e


@_inline
def _from_before(out, before, i, lut, states, slots, words, wp, last, x, escapes, e):
    o = np.int64(out[i])
    ko = _key(o)
    prev = ko - _key(np.int64(before[i]))
    ctx = lut[(o >> 7) & 0xFF] + states[min(abs(prev), 3)]
    return _step(out, i, ko, ctx, np.int64(prev < 0), slots, words, wp, last, x, escapes, e)


@_inline
def _from_bits(out, moved, down, i, lut, slots, words, wp, last, x, escapes, e):
    o = np.int64(out[i])
    w, bit = i >> 6, np.uint64(i & 63)
    ctx = lut[(o >> 7) & 0xFF] + np.int64((moved[w] >> bit) & np.uint64(1))
    return _step(out, i, _key(o), ctx, np.int64((down[w] >> bit) & np.uint64(1)), slots, words, wp, last, x, escapes, e)


@_inline
def _at(out, before, moved, down, i, lut, states, slots, words, wp, last, x, escapes, e):
    if before.size:
        return _from_before(out, before, i, lut, states, slots, words, wp, last, x, escapes, e)
    return _from_bits(out, moved, down, i, lut, slots, words, wp, last, x, escapes, e)


@_jit
def _decode(out, before, moved, down, changed, lut, states, slots, words, escapes):
    """In place: out holds the old elements (BF16 bits); rewrite the changed ones, in element
    order. The previous step comes from ``before`` (the tensor before the old one; context: class
    and |previous step| through ``states``) or, when before is empty, from the bitmaps ``moved``
    and ``down`` (context: class and moved-or-not). ``lut`` maps an exponent to its class's first
    context; ``slots`` packs per context and slot: symbol, slot - cum, frequency. Changes
    alternate between two rANS states, so two decode chains run at once."""
    x0 = np.uint64(words[0]) | (np.uint64(words[1]) << np.uint64(16))
    x1 = np.uint64(words[2]) | (np.uint64(words[3]) << np.uint64(16))
    wp, last, e = 4, words.size - 1, 0
    n = changed.size
    j = 0
    while j < n:  # two changes per turn, one per state: no select between the chains
        x0, wp, e = _at(out, before, moved, down, changed[j], lut, states, slots, words, wp, last, x0, escapes, e)
        if j + 1 < n:
            x1, wp, e = _at(
                out, before, moved, down, changed[j + 1], lut, states, slots, words, wp, last, x1, escapes, e
            )
        j += 2
    return wp


def _bitmap(flags: np.ndarray) -> np.ndarray:
    padded = np.zeros(-(-flags.size // 64) * 64, np.uint8)
    padded[: flags.size] = flags
    return np.packbits(padded, bitorder="little").view(np.uint64)


def _table_bytes(freqs: np.ndarray) -> int:
    """A table per used context: a bitmap of its symbols, then their frequencies as varints."""
    return sum(
        SYMBOLS // 8 + sum(v2.encode_kernels._varint_len(int(f)) for f in row if f) for row in freqs if row.any()
    )


def _plan(ctx_class: np.ndarray, state: np.ndarray, sym: np.ndarray, n_classes: int, n_states: int):
    """(tables, estimated bytes) for one choice of context."""
    counts = np.zeros((n_classes * n_states, SYMBOLS), np.int64)
    np.add.at(counts, (ctx_class * n_states + state, sym), 1)
    used = counts.sum(1) > 0
    freqs = np.zeros_like(counts)
    freqs[used] = np.array([_quantize(c) for c in counts[used]])
    ideal = float((counts[counts > 0] * np.log2(SCALE / freqs[counts > 0])).sum()) / 8
    return freqs, _table_bytes(freqs) + ideal


STATE_MAPS = {1: np.array([0, 0, 0, 0]), 2: np.array([0, 1, 1, 1]), 4: np.array([0, 1, 2, 3])}


def code_values(u: np.ndarray, v: np.ndarray, w: np.ndarray, classes: list[tuple[int, int]], state: str) -> dict:
    """Code, decode and time one tensor's values (u, v, w: old, new and before-old BF16 bits).
    ``state``: what the decoder keeps of the previous step, "before" (the tensor before the old
    one: contexts by |previous step| 0-3) or "bits" (2 bits per element: moved, moved down)."""
    ku, kv, kw = (bf16_keys(x) for x in (u, v, w))
    changed = np.flatnonzero(kv != ku)
    step, prev = (kv - ku)[changed], (ku - kw)[changed]
    lut = np.full(256, -1, np.int64)
    for c, (lo, hi) in enumerate(classes):
        lut[lo : hi + 1] = c
    klass = lut[(u[changed].astype(np.int64) >> 7) & 0xFF]
    assert klass.min() >= 0
    size = np.abs(step)
    negative = (step < 0).astype(np.int64) ^ (prev < 0)
    sym = (np.minimum(size, T) - 1) * 2 + negative
    esc = size[size >= T] - T
    esc_bits = sum(6 + int(e).bit_length() for e in esc)
    capped = np.minimum(np.abs(prev), 3)
    best = None
    for n_states, smap in STATE_MAPS.items():
        if state == "bits" and n_states == 4:
            continue
        freqs, est = _plan(klass, smap[capped], sym, len(classes), n_states)
        if best is None or est < best[2]:
            best = (n_states, freqs, est, smap)
    n_states, freqs, _, smap = best
    ctx = klass * n_states + smap[capped]
    out = np.empty(2 * changed.size + 16, np.uint16)
    nw = _encode(ctx, sym, freqs, out)
    words = out[out.size - nw :].copy()
    nbytes = 1 + _table_bytes(freqs) + 2 * nw + (esc_bits + 7) // 8
    slots = np.zeros((freqs.shape[0], SCALE), np.uint32)
    for c, row in enumerate(freqs):
        t = 0
        for s, f in enumerate(row):
            for r in range(f):
                slots[c, t + r] = s | (r << 6) | (int(f) << 18)
            t += f
    class_lut = np.where(lut >= 0, lut * n_states, 0)
    moved, down = _bitmap(kw != ku), _bitmap(ku < kw)
    if n_states == 1:  # no context but the previous sign: every element reads as "did not move"
        moved = np.zeros_like(moved)
    seconds = []
    for _ in range(3):
        out_bits = u.copy()
        t0 = time.perf_counter()
        _decode(
            out_bits,
            w if state == "before" else w[:0],
            moved,
            down,
            changed,
            class_lut,
            smap.astype(np.int64),
            slots,
            words,
            esc.astype(np.int64),
        )
        seconds.append(time.perf_counter() - t0)
    assert np.array_equal(out_bits, v), "values prototype is not bit-exact"
    return {"bytes": nbytes, "seconds": min(seconds), "states": n_states}


def v2_value_bytes(u: np.ndarray, v: np.ndarray, shape: tuple[int, ...], full: bytes) -> tuple[int, float]:
    """(bytes v2's payload ``full`` spends on values, its decode seconds) for one tensor."""
    ku, kv = bf16_keys(u), bf16_keys(v)
    ones = v1._ordered_unkey(np.where(kv != ku, ku + 1, ku).astype(np.uint16), 16)
    bare = v2.encode_delta(u.view(np.uint8), ones.view(np.uint8), "BF16", shape, predict_signs=False)
    out = np.empty_like(u)
    seconds = []
    for _ in range(3):
        out[:] = u
        t0 = time.perf_counter()
        v2.decode_into(out.view(np.uint8), full, "BF16")
        seconds.append(time.perf_counter() - t0)
    n_changed = int((kv != ku).sum())
    return len(full) - len(bare) + (n_changed + 7) // 8, min(seconds)


def measure(checkpoints: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Totals over every bf16 tensor of every pair that has a previous pair."""
    out = {"v2_payload": 0, "v2_values": 0, "elements": 0, "v2_seconds": 0.0}
    for state in ("before", "bits"):
        out[state], out[state + "_seconds"] = 0, 0.0
    for shape, u, v, w in changed_bf16_triples(checkpoints):
        # v2 with raw sign bits: this lever codes the signs itself (against the previous step)
        payload = v2.encode_delta(u.view(np.uint8), v.view(np.uint8), "BF16", shape, predict_signs=False)
        if payload[4] != 1:  # not a ULP payload (a full one was smaller)
            continue
        values, v2_seconds = v2_value_bytes(u, v, shape, payload)
        out["v2_payload"] += len(payload)
        out["v2_values"] += values
        out["elements"] += u.size
        out["v2_seconds"] += v2_seconds
        classes = v2_classes(payload)
        for state in ("before", "bits"):
            r = code_values(u, v, w, classes, state)
            out[state] += min(r["bytes"], values)  # a tensor keeps v2's values where they are smaller
            out[state + "_seconds"] += r["seconds"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_corpus_arguments(parser)
    args = parser.parse_args(argv)
    print(f"pairs 2-{args.steps}; bytes over all bf16 ULP tensors; ns per element, one thread")
    print(
        f"{'corpus':<7} {'lr':>7} {'v2 payload':>11} {'v2 values':>10} {'v2 decode':>10}   "
        f"then, keeping the tensor before / 2 bits per element: values, payload, values decode"
    )
    for name, lr, checkpoints in corpus_runs(args.corpus, args.steps):
        r = measure(checkpoints)
        line = (
            f"{name:<7} {lr:>7g} {r['v2_payload']:>11,} {r['v2_values']:>10,} "
            f"{1e9 * r['v2_seconds'] / r['elements']:>10.2f}"
        )
        for state in ("before", "bits"):
            ratio = (r["v2_payload"] - r["v2_values"] + r[state]) / r["v2_payload"]
            line += f"   {r[state]:>10,} {ratio:.3f}x {1e9 * r[state + '_seconds'] / r['elements']:.2f}"
        print(line)


if __name__ == "__main__":
    main()
