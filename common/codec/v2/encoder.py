"""Encoding codec v2 payloads: full and XOR payloads as byte planes, float deltas as ULP bodies
(the class plan, per-class codes, and raw or predicted signs)."""

from __future__ import annotations

import numpy as np

from ...dtypes import DTYPE_SIZES
from ...errors import ConfigError
from ..inputs import raw_bytes
from . import sign_model
from .encode_kernels import (
    enc_stats,
    enc_walk,
    flip_byte_freqs,
    golomb_best_m,
    magnitude_code,
    plan_classes,
    quantize_freqs,
    rans_encode,
    rans_encode_bytes,
    write_bits,
)
from .jit import readonly
from .wire import (
    FLAG_SIGN_MODEL,
    FLIP_STREAMS,
    FLOATS,
    MAX_PARTS,
    METHOD_FULL,
    METHOD_SPLIT,
    METHOD_ULP,
    METHOD_XOR,
    UINT,
    header,
    planes_body,
    varint,
)

MIN_ROW_LEN = 256  # shorter rows do not pay for their flags
ZSTD_LEVEL = 3
#: What a class costs the decoder (a mask pass per 64 elements and its own parse setup), charged
#: by the encoder's class plan in bits per change of the tensor (so the same share of every
#: payload): merging small classes makes rebuilds faster for slightly larger payloads
#: (benchmarks/README.md, "Fewer classes").
CLASS_COST = 0.025
#: A full payload is tried only for a delta over 1/FULL_TRY_BELOW of the tensor's bytes: trained
#: bf16 weights compress to 60-70% on their own, so a smaller delta wins anyway, and compressing
#: them costs a quarter of the encode of a delta with 20% of the elements changed.
FULL_TRY_BELOW = 4
#: At most this many exponents per class (the plan's dynamic program looks no further back): 8
#: plans 1.1x as fast as 25 for payloads 0.1-0.3% smaller and the same rebuild speed (4 gives no
#: more; benchmarks/README.md, "Encoder levels").
MAX_CLASS_SPAN = 8


#: Tensors of at least twice this many elements are encoded in parts of about this many (whole
#: rows of the last dimension), so that threads share one large tensor: 2^23 bf16 elements are
#: 16 MiB; a part's own headers (class records, tables, a sign model's column codes) cost well under
#: 1% of its payload at RL deltas' sizes.
PART_ELEMENTS = 1 << 23


def split_ranges(n: int, shape: tuple[int, ...] | None, part_elements: int = PART_ELEMENTS) -> list[tuple[int, int]]:
    """The element ranges a tensor of ``n`` elements is encoded in: one range below
    ``2 * part_elements``, else about ``part_elements`` each, cut between rows of ``shape``'s last
    dimension (every range holds whole rows)."""
    if part_elements < 1:
        raise ConfigError(f"part_elements must be at least 1, not {part_elements}")
    row = int(shape[-1]) if shape and len(shape) >= 2 and int(np.prod(shape)) == n and shape[-1] > 0 else 1
    rows = n // row
    k = min(rows, n // part_elements, MAX_PARTS)
    if k < 2:
        return [(0, n)]
    cuts = [row * (rows * i // k) for i in range(k + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def part_shape(shape: tuple[int, ...] | None, start: int, stop: int) -> tuple[int, ...] | None:
    """The shape of elements ``start:stop`` of a tensor of ``shape`` (rows of its last dimension)."""
    if not shape or len(shape) < 2 or shape[-1] <= 0:
        return None
    return ((stop - start) // int(shape[-1]), int(shape[-1]))


def encode_part(
    old: np.ndarray,
    new: np.ndarray,
    dtype: str,
    shape: tuple[int, ...] | None,
    part: tuple[int, int],
    zstd_level: int = ZSTD_LEVEL,
    dense_fraction: float = 0.125,
    predict_signs: bool = True,
    class_cost: float = CLASS_COST,
) -> bytes:
    """The payload (in one piece) of elements ``part`` = (start, stop) of a tensor of ``shape``,
    one of :func:`split_ranges` (the other arguments as :func:`encode_delta` takes them)."""
    width = _width(dtype, new.size)
    start, stop = part
    return encode_delta(
        old[start * width : stop * width],
        new[start * width : stop * width],
        dtype,
        part_shape(shape, start, stop),
        zstd_level,
        dense_fraction,
        predict_signs,
        class_cost,
        None,
    )


def join_parts(dtype: str, parts: list[tuple[int, bytes]]) -> bytes:
    """One split payload (method 3) of ``parts``: (elements, payload) of consecutive ranges."""
    width = _width(dtype, 0)
    n = sum(count for count, _ in parts)
    table = varint(len(parts)) + b"".join(varint(count) + varint(len(payload)) for count, payload in parts)
    return header(METHOD_SPLIT, width, n) + table + b"".join(payload for _, payload in parts)


def _width(dtype: str, nbytes: int) -> int:
    if dtype not in DTYPE_SIZES:
        raise ConfigError(f"unknown dtype {dtype!r}")
    width = DTYPE_SIZES[dtype]
    if nbytes % width:
        raise ConfigError(f"{nbytes} bytes is not a whole number of {dtype} elements")
    return width


def encode_full(new: np.ndarray, dtype: str, zstd_level: int = ZSTD_LEVEL) -> bytes:
    """A payload of ``new`` on its own: byte planes, each zstd-compressed or raw."""
    new = raw_bytes(new, "new")
    width = _width(dtype, new.size)
    return header(METHOD_FULL, width, new.size // width) + planes_body(new.view(UINT[width]), width, zstd_level)


def _h2bits_py(n: int, k: int) -> float:
    if k <= 0 or k >= n:
        return 0.0
    p = k / n
    return float(-n * (p * np.log2(p) + (1 - p) * np.log2(1 - p)))


def _segments(exps: np.ndarray, arg: np.ndarray) -> list[tuple[int, int]]:
    segs = []
    j = exps.size
    while j > 0:
        i = int(arg[j])
        segs.append((i, j))
        j = i
    return segs[::-1]


def _sign_section(
    vals: np.ndarray, at: np.ndarray, slot: np.ndarray, shape: tuple[int, ...] | None, row_len: int, n_rows: int
) -> tuple[int, bytes]:
    """(payload flags, the signs' bytes): raw sign bits, or, where it is smaller, a sign model
    (:mod:`.sign_model`) and the rANS-coded flips of ``vals`` (which are negated in place
    where the model predicts a negative step). ``at``/``slot``: per change in element order, its
    position in the tensor and its index in ``vals``."""
    raw = np.packbits(vals < 0, bitorder="little").tobytes()
    if not shape or len(shape) < 2 or n_rows < 2 or vals.size < sign_model.MIN_CHANGES:  # one row: no model
        return 0, raw
    rows, cols = np.divmod(at, row_len)
    fitted = sign_model.fit((n_rows, row_len), rows, cols, vals[slot] < 0)
    if fitted is None:
        return 0, raw
    model, predicted = fitted
    predicted_by_value = np.empty(vals.size, np.bool_)
    predicted_by_value[slot] = predicted
    stored = np.where(predicted_by_value, -vals, vals)
    flips = np.zeros((stored.size + 7) // 8 * 8, np.uint8)
    flips[: stored.size] = stored < 0
    nibbles = flips[0::4] | flips[1::4] << 1 | flips[2::4] << 2 | flips[3::4] << 3
    f4 = quantize_freqs(np.bincount(nibbles, minlength=16))
    f8 = flip_byte_freqs(f4)
    if f8.size == 0:
        return 0, raw
    syms = np.packbits(flips, bitorder="little")
    buf = np.zeros(syms.size + 8, np.uint16)
    section = model.to_bytes() + b"".join(varint(int(f)) for f in f4)
    for k in range(FLIP_STREAMS):
        nw = rans_encode_bytes(syms[k::FLIP_STREAMS].copy(), f8, buf)
        coded = buf[buf.size - nw :].astype("<u2").tobytes()
        section += varint(len(coded)) + coded
    if len(section) >= len(raw):
        return 0, raw
    vals[:] = stored
    return FLAG_SIGN_MODEL, section


def _encode_ulp(
    u: np.ndarray,
    v: np.ndarray,
    dtype: str,
    shape: tuple[int, ...] | None,
    predict_signs: bool = True,
    class_cost: float = 0.0,
) -> tuple[bytes, int]:
    """The ULP payload of old elements u -> new elements v, and the number of changes."""
    width, mant_bits, exp_bits = FLOATS[dtype]
    bits_w = 8 * width
    sign, full = 1 << (bits_w - 1), (1 << bits_w) - 1
    E = 1 << exp_bits
    n = u.size
    row_len = n
    if shape and len(shape) >= 2 and int(np.prod(shape)) == n and shape[-1] >= MIN_ROW_LEN:
        row_len = int(shape[-1])
    row_len = max(1, row_len)
    n_rows = (n + row_len - 1) // row_len if n else 0
    ne, ne_alive, ke, hist, ovf_bits, row_alive = enc_stats(u, v, mant_bits, E - 1, row_len, n_rows, sign, full)
    n_changed = int(ke.sum())

    # class plans without and with the dead-rows filter
    exps = np.flatnonzero(ne).astype(np.int64)
    class_bits = class_cost * n_changed
    cost, arg = plan_classes(exps, ne, ke, hist, ovf_bits, class_bits, MAX_CLASS_SPAN)
    ne_used = ne
    n_alive = int(row_alive.sum())
    row_mode = 0
    if n_rows > 1 and n_alive < n_rows:
        exps_a = np.flatnonzero(ne_alive).astype(np.int64)
        cost1, arg1 = plan_classes(exps_a, ne_alive, ke, hist, ovf_bits, class_bits, MAX_CLASS_SPAN)
        minority = min(n_alive, n_rows - n_alive)
        cost1 += _h2bits_py(n_rows, minority) + 0.04 * minority + 24
        if cost1 < cost:
            row_mode = 1 if (n_rows - n_alive) <= n_alive else 2
            exps, arg, ne_used = exps_a, arg1, ne_alive
    if row_mode == 0:
        row_alive = np.ones(n_rows, np.uint8)

    classes = []  # (lo, hi, elements, changes) of the segments that have changes
    for i, j in _segments(exps, arg):
        es = exps[i:j]
        k = int(ke[es].sum())
        if k:
            classes.append((int(es[0]), int(es[-1]), int(ne_used[es].sum()), k))
    K = len(classes)
    lut_e = np.full(E, K, np.int64)
    dense = np.zeros(K + 1, np.bool_)
    n_events = np.zeros(K, np.int64)
    n_class_changes = np.zeros(K, np.int64)
    for c, (lo, hi, nn, k) in enumerate(classes):
        lut_e[lo : hi + 1] = c
        dense[c] = k > nn - k
        n_events[c] = nn - k if dense[c] else k
        n_class_changes[c] = k
    lut = np.concatenate([lut_e, lut_e])
    ev_off = np.concatenate([[0], np.cumsum(n_events)[:-1]]).astype(np.int64) if K else np.zeros(0, np.int64)
    val_off = np.concatenate([[0], np.cumsum(n_class_changes)[:-1]]).astype(np.int64) if K else np.zeros(0, np.int64)
    ev = np.empty(int(n_events.sum()), np.int64)
    vals = np.empty(n_changed, np.int64)
    at = np.empty(n_changed, np.int64)  # per change in natural order: its position, its index in vals
    slot = np.empty(n_changed, np.int64)
    if K:
        enc_walk(
            u,
            v,
            lut,
            row_alive,
            row_len,
            mant_bits,
            dense,
            np.append(ev_off, 0),
            np.append(val_off, 0),
            ev,
            vals,
            at,
            slot,
            sign,
            full,
        )
    row_ev = np.zeros(0, np.int64)
    row_m = 1
    if row_mode:
        rows = np.flatnonzero(row_alive == 0) if row_mode == 1 else np.flatnonzero(row_alive)
        row_ev = (np.diff(rows, prepend=-1) - 1).astype(np.int64)
        row_m, _ = golomb_best_m(row_ev, max(1.0, 0.69 * row_ev.mean()) if row_ev.size else 1.0)
    # per-class Golomb parameters and magnitude coding
    cls_m = np.ones(K, np.int64)
    mag_mode = np.zeros(K, np.int64)
    mag_m = np.zeros(K, np.int64)  # mode 1: the Golomb parameter of |step| - 1
    mag_T = np.zeros(K, np.int64)  # mode 2: the rANS table's size
    tables: dict[int, np.ndarray] = {}
    for c in range(K):
        g = ev[ev_off[c] : ev_off[c] + n_events[c]]
        if g.size:
            cls_m[c], _ = golomb_best_m(g, max(1.0, 0.69 * g.mean()))
        mags = np.abs(vals[val_off[c] : val_off[c] + n_class_changes[c]]) - 1
        if mags.max() == 0:
            continue
        mode, param, table = magnitude_code(mags)
        mag_mode[c] = mode
        if mode == 1:
            mag_m[c] = param
        else:
            mag_T[c] = param
            tables[c] = table
    freq_off = np.zeros(K, np.int64)
    flist = []
    o = 0
    for c in range(K):
        if c in tables:
            freq_off[c] = o
            flist.append(tables[c])
            o += tables[c].size
    freqs = np.concatenate(flist).astype(np.int64) if flist else np.zeros(1, np.int64)

    bound = (row_ev.size + ev.size + vals.size) * 112 // 64 + 4  # every code is at most 47 + 63 bits
    buf = np.zeros(bound, np.uint64)
    nbits = write_bits(
        buf, row_ev, row_m, ev, ev_off, n_events, cls_m, vals, val_off, n_class_changes, mag_mode, mag_m, mag_T
    )
    bits_bytes = buf.view(np.uint8)[: (nbits + 7) // 8].tobytes()
    flags, signs = _sign_section(vals, at, slot, shape if predict_signs else None, row_len, n_rows)
    rans_bytes = b""
    if tables:
        rbuf = np.zeros(vals.size * 2 + 8, np.uint16)
        nw = rans_encode(vals, val_off, n_class_changes, mag_mode, mag_T, freqs, freq_off, rbuf)
        rans_bytes = rbuf[rbuf.size - nw :].astype("<u2").tobytes()

    out = bytearray(header(METHOD_ULP, width, n, flags))
    out += varint(n_changed) + varint(row_len)
    out.append(row_mode)
    if row_mode:
        out += varint(int(row_ev.size)) + varint(int(row_m))
    out += varint(K)
    prev_hi = -1
    for c, (lo, hi, _nn, _k) in enumerate(classes):
        out += varint(lo - prev_hi - 1) + varint(hi - lo)
        prev_hi = hi
        out.append(int(dense[c]) | (int(mag_mode[c]) << 1))
        out += varint(int(n_events[c]))
        if dense[c]:
            out += varint(int(n_class_changes[c]))
        out += varint(int(cls_m[c]))
        if mag_mode[c] == 1:
            out += varint(int(mag_m[c]))
        elif mag_mode[c] == 2:
            out += varint(int(mag_T[c])) + b"".join(varint(int(x)) for x in tables[c])
    out += varint(int(nbits)) + bits_bytes + signs + varint(len(rans_bytes)) + rans_bytes
    return bytes(out), n_changed


def encode_delta(
    old: np.ndarray,
    new: np.ndarray,
    dtype: str,
    shape: tuple[int, ...] | None = None,
    zstd_level: int = ZSTD_LEVEL,
    dense_fraction: float = 0.125,
    predict_signs: bool = True,
    class_cost: float = CLASS_COST,
    part_elements: int | None = PART_ELEMENTS,
) -> bytes:
    """A payload that rebuilds ``new`` from ``old`` (raw bytes of ``dtype``, same size).

    A tensor of at least twice ``part_elements`` elements is encoded in parts (:func:`split_ranges`,
    one after the other here; the publisher encodes them on threads); None: in one piece.

    ``shape`` (optional) is the tensor's shape: rows of its last dimension that do not change at
    all are then flagged instead of coded element by element. When more than ``dense_fraction``
    of the elements changed and the delta exceeds 1/FULL_TRY_BELOW of the tensor's bytes, a full
    payload is returned if it is smaller. ``predict_signs``: try a
    sign model (:mod:`.sign_model`) where the shape allows it. ``class_cost``: see CLASS_COST.
    """
    new = raw_bytes(new, "new")
    old = raw_bytes(old, "old")
    if old.size != new.size:
        raise ConfigError(f"old has {old.size} bytes, new has {new.size}")
    width = _width(dtype, new.size)
    n = new.size // width
    ranges = split_ranges(n, shape, part_elements) if part_elements else [(0, n)]
    if len(ranges) > 1:
        coded = [
            encode_part(old, new, dtype, shape, part, zstd_level, dense_fraction, predict_signs, class_cost)
            for part in ranges
        ]
        return join_parts(
            dtype, [(stop - start, payload) for (start, stop), payload in zip(ranges, coded, strict=True)]
        )
    if dtype in FLOATS:
        payload, n_changed = _encode_ulp(
            readonly(old, UINT[width]), readonly(new, UINT[width]), dtype, shape, predict_signs, class_cost
        )
        if n_changed > dense_fraction * n and len(payload) * FULL_TRY_BELOW > new.size:
            full = encode_full(new, dtype, zstd_level)
            if len(full) < len(payload):
                return full
        return payload
    x = np.bitwise_xor(old, new).view(UINT[width])
    return header(METHOD_XOR, width, n) + planes_body(x, width, zstd_level)
