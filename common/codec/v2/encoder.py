"""Encoding codec v2 payloads: full and XOR payloads as byte planes, float deltas as ULP bodies
(the class plan, per-class codes, and raw or predicted signs)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...dtypes import DTYPE_SIZES
from ...errors import ConfigError
from ..inputs import raw_bytes
from ..memory import TensorMemory  # per part, by its first element: sign_model.FitMemory
from . import sign_model
from .encode_kernels import (
    by_class,
    changes_by_position,
    enc_stats,
    enc_walk,
    flip_byte_freqs,
    golomb_best_m,
    magnitude_code,
    packed_flips,
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
#: A matrix of at least SAMPLE_MIN_ROWS rows is planned from every SAMPLE_STEP-th row: the class
#: plan needs only the shares of elements, changes and steps per exponent, and the walk that
#: collects the codes counts every class exactly (benchmarks/README.md, "Encoder levels").
SAMPLE_MIN_ROWS = 64
SAMPLE_STEP = 8


#: Tensors of at least twice this many elements are encoded in parts of about this many (whole
#: rows of the last dimension), so that threads share one large tensor: 2^23 bf16 elements are
#: 16 MiB; a part's own headers (class records, tables, a sign model's column codes) cost well under
#: 1% of its payload at RL deltas' sizes.
PART_ELEMENTS = 1 << 23


def _part_memory(memory: TensorMemory | None, start: int) -> sign_model.FitMemory | None:
    return None if memory is None else memory.setdefault(start, sign_model.FitMemory())


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
    memory: TensorMemory | None = None,
) -> bytes:
    """The payload (in one piece) of elements ``part`` = (start, stop) of a tensor of ``shape``,
    one of :func:`split_ranges` (the other arguments as :func:`encode_delta` takes them)."""
    old, new = _pair(old, new)
    width = _width(dtype, new.size)
    start, stop = part
    return _encode_piece(
        old[start * width : stop * width],
        new[start * width : stop * width],
        dtype,
        part_shape(shape, start, stop),
        zstd_level,
        dense_fraction,
        predict_signs,
        class_cost,
        _part_memory(memory, start),
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
    vals: np.ndarray,
    at: np.ndarray,
    slot: np.ndarray,
    shape: tuple[int, ...] | None,
    row_len: int,
    n_rows: int,
    memory: sign_model.FitMemory | None = None,
) -> tuple[int, bytes]:
    """(payload flags, the signs' bytes): raw sign bits, or, where it is smaller, a sign model
    (:mod:`.sign_model`) and the rANS-coded flips of ``vals`` (which are negated in place
    where the model predicts a negative step). ``at``/``slot``: per change in element order, its
    position in the tensor and its index in ``vals``; ``memory``: see :func:`sign_model.fit`."""
    raw = np.packbits(vals < 0, bitorder="little").tobytes()
    if not shape or len(shape) < 2 or n_rows < 2 or vals.size < sign_model.MIN_CHANGES:  # one row: no model
        return 0, raw
    rows, cols, negative = changes_by_position(at, slot, vals, row_len)
    fitted = sign_model.fit((n_rows, row_len), rows, cols, negative, memory)
    if fitted is None:
        return 0, raw
    model, predicted = fitted
    stored = vals.copy()
    syms, groups = packed_flips(stored, slot, predicted)
    f4 = quantize_freqs(groups)
    f8 = flip_byte_freqs(f4)
    if f8.size == 0:
        return 0, raw
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


@dataclass
class _Plan:
    """The classes of a ULP payload: (lo, hi, dense) exponent ranges, whether dead rows are listed
    (0: no; 1: the dead ones; 2: the changed ones), and how many changes and events to expect."""

    classes: list[tuple[int, int, bool]]
    row_mode: int
    expected: int
    sampled: bool


def _plan(
    u: np.ndarray,
    v: np.ndarray,
    mant_bits: int,
    E: int,
    row_len: int,
    n_rows: int,
    sign: int,
    full: int,
    class_cost: float,
) -> _Plan:
    """The class plan: a dynamic program over the exponents' statistics, with and without the
    dead-rows filter (a large matrix's statistics come from every SAMPLE_STEP-th row)."""
    step = SAMPLE_STEP if n_rows >= SAMPLE_MIN_ROWS else 1
    ne, ne_alive, ke, hist, ovf_bits = enc_stats(u, v, mant_bits, E - 1, row_len, n_rows, step, sign, full)
    if step > 1 and not ke.any():  # no change in the sample: plan from every row
        step = 1
        ne, ne_alive, ke, hist, ovf_bits = enc_stats(u, v, mant_bits, E - 1, row_len, n_rows, step, sign, full)
    est_changed = int(ke.sum())
    exps = np.flatnonzero(ne).astype(np.int64)
    class_bits = class_cost * est_changed
    cost, arg = plan_classes(exps, ne, ke, hist, ovf_bits, class_bits, MAX_CLASS_SPAN)
    ne_used = ne
    row_mode = 0
    est_alive = round(int(ne_alive.sum()) / row_len)  # rows that changed (exact unless sampled)
    if n_rows > 1 and est_alive < n_rows:
        exps_a = np.flatnonzero(ne_alive).astype(np.int64)
        cost1, arg1 = plan_classes(exps_a, ne_alive, ke, hist, ovf_bits, class_bits, MAX_CLASS_SPAN)
        minority = min(est_alive, n_rows - est_alive)
        cost1 += _h2bits_py(n_rows, minority) + 0.04 * minority + 24
        if cost1 < cost:
            row_mode = 1 if (n_rows - est_alive) <= est_alive else 2
            exps, arg, ne_used = exps_a, arg1, ne_alive
    classes = []  # the segments that have changes
    for i, j in _segments(exps, arg):
        es = exps[i:j]
        k = int(ke[es].sum())
        if k:
            classes.append((int(es[0]), int(es[-1]), k > int(ne_used[es].sum()) - k))
    if step > 1:  # rows outside the sample may hold any exponent: the classes cover every one
        classes = [
            (0 if c == 0 else classes[c - 1][1] + 1, E - 1 if c == len(classes) - 1 else hi, dense)
            for c, (_lo, hi, dense) in enumerate(classes)
        ]
    expected = est_changed
    for lo, hi, dense in classes:
        if dense:  # its events are its unchanged elements
            expected = max(expected, int(ne_used[lo : hi + 1].sum()) - int(ke[lo : hi + 1].sum()))
    return _Plan(classes, row_mode, expected, step > 1)


@dataclass
class _Codes:
    """What the walk collected, grouped by class: event gaps, signed steps (with offsets and counts
    per class), and per change in element order its position and its index in ``vals``."""

    classes: list[tuple[int, int, int, int]]  # (lo, hi, elements, changes) of each written class
    dense: np.ndarray
    ev: np.ndarray
    ev_off: np.ndarray
    n_events: np.ndarray
    vals: np.ndarray
    val_off: np.ndarray
    n_class_changes: np.ndarray
    at: np.ndarray
    slot: np.ndarray
    row_alive: np.ndarray


def _collect(
    u: np.ndarray, v: np.ndarray, plan: _Plan, mant_bits: int, E: int, row_len: int, n_rows: int, sign: int, full: int
) -> _Codes:
    """One walk over the elements, counting every class exactly (buffers sized from the plan's
    estimate, grown when a sampled plan expected too few), then the codes grouped by class."""
    K = len(plan.classes)
    lut_e = np.full(E, K, np.int64)
    dense = np.zeros(K + 1, np.bool_)
    for c, (lo, hi, d) in enumerate(plan.classes):
        lut_e[lo : hi + 1] = c
        dense[c] = d
    lut = np.concatenate([lut_e, lut_e])  # indexed with the sign bit
    n = u.size
    row_alive = np.zeros(n_rows, np.uint8)
    walked = np.zeros(K + 1, np.int64)
    cap = min(n, plan.expected + plan.expected // 4 + 4096) if plan.sampled else plan.expected
    while True:
        ev_buf, val_buf, at = np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap, np.int64)
        ev_cls, val_cls = np.empty(cap, np.uint16), np.empty(cap, np.uint16)  # K <= 256 classes
        n_ev, n_changed = enc_walk(
            u, v, lut, dense, row_len, n_rows, mant_bits, plan.row_mode != 0, sign, full,
            ev_buf, ev_cls, val_buf, val_cls, at, row_alive, walked,
        )  # fmt: skip
        if n_ev == -1 and cap < n:
            cap = min(n, 4 * cap)  # more changes or events than the sample let expect
            continue
        if n_ev < 0:
            raise AssertionError(f"codec v2 encoder: a change outside the class plan ({n_ev})")
        break
    ev = np.empty(n_ev, np.int64)
    vals = np.empty(n_changed, np.int64)
    slot = np.empty(n_changed, np.int64)
    n_events = by_class(ev_buf, ev_cls, n_ev, K, ev, np.empty(n_ev, np.int64))
    n_class_changes = by_class(val_buf, val_cls, n_changed, K, vals, slot)
    ev_off = np.cumsum(n_events) - n_events  # each class's first index
    val_off = np.cumsum(n_class_changes) - n_class_changes
    if not n_class_changes.all():  # each planned class has a change of a walked (sampled) row
        raise AssertionError("codec v2 encoder: a planned class without a change")
    classes = [(lo, hi, int(walked[c]), int(n_class_changes[c])) for c, (lo, hi, _) in enumerate(plan.classes)]
    return _Codes(
        classes, dense[:K], ev, ev_off, n_events, vals, val_off, n_class_changes, at[:n_changed], slot, row_alive
    )


def _encode_ulp(
    u: np.ndarray,
    v: np.ndarray,
    dtype: str,
    shape: tuple[int, ...] | None,
    predict_signs: bool = True,
    class_cost: float = 0.0,
    memory: sign_model.FitMemory | None = None,
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
    plan = _plan(u, v, mant_bits, E, row_len, n_rows, sign, full, class_cost)
    codes = _collect(u, v, plan, mant_bits, E, row_len, n_rows, sign, full)
    row_mode, classes, dense = plan.row_mode, codes.classes, codes.dense
    ev, ev_off, n_events = codes.ev, codes.ev_off, codes.n_events
    vals, val_off, n_class_changes = codes.vals, codes.val_off, codes.n_class_changes
    K = len(classes)
    n_changed = vals.size
    row_ev = np.zeros(0, np.int64)
    row_m = 1
    if row_mode:
        rows = np.flatnonzero(codes.row_alive == 0) if row_mode == 1 else np.flatnonzero(codes.row_alive)
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
    flags, signs = _sign_section(vals, codes.at, codes.slot, shape if predict_signs else None, row_len, n_rows, memory)
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
    memory: TensorMemory | None = None,
) -> bytes:
    """A payload that rebuilds ``new`` from ``old`` (raw bytes of ``dtype``, same size).

    A tensor of at least twice ``part_elements`` elements is encoded in parts (:func:`split_ranges`,
    one after the other here; the publisher encodes them on threads); None: in one piece.

    ``shape`` (optional) is the tensor's shape: rows of its last dimension that do not change at
    all are then flagged instead of coded element by element. When more than ``dense_fraction``
    of the elements changed and the delta exceeds 1/FULL_TRY_BELOW of the tensor's bytes, a full
    payload is returned if it is smaller. ``predict_signs``: try a
    sign model (:mod:`.sign_model`) where the shape allows it. ``class_cost``: see CLASS_COST.
    ``memory``: the dict this tensor's last encode was given (:data:`TensorMemory`), if any; the
    sign model's fit then starts from the last step's (the payload is no different to decode).
    """
    old, new = _pair(old, new)
    width = _width(dtype, new.size)
    n = new.size // width
    ranges = split_ranges(n, shape, part_elements) if part_elements else [(0, n)]
    if len(ranges) > 1:
        coded = [
            encode_part(old, new, dtype, shape, part, zstd_level, dense_fraction, predict_signs, class_cost, memory)
            for part in ranges
        ]
        return join_parts(
            dtype, [(stop - start, payload) for (start, stop), payload in zip(ranges, coded, strict=True)]
        )
    return _encode_piece(
        old, new, dtype, shape, zstd_level, dense_fraction, predict_signs, class_cost, _part_memory(memory, 0)
    )


def _pair(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``old`` and ``new`` as raw bytes of the same size."""
    old, new = raw_bytes(old, "old"), raw_bytes(new, "new")
    if old.size != new.size:
        raise ConfigError(f"old has {old.size} bytes, new has {new.size}")
    return old, new


def _encode_piece(
    old: np.ndarray,
    new: np.ndarray,
    dtype: str,
    shape: tuple[int, ...] | None,
    zstd_level: int,
    dense_fraction: float,
    predict_signs: bool,
    class_cost: float,
    memory: sign_model.FitMemory | None,
) -> bytes:
    """:func:`encode_delta` of raw bytes in one piece (no parts)."""
    width = _width(dtype, new.size)
    n = new.size // width
    if dtype in FLOATS:
        payload, n_changed = _encode_ulp(
            readonly(old, UINT[width]), readonly(new, UINT[width]), dtype, shape, predict_signs, class_cost, memory
        )
        if n_changed > dense_fraction * n and len(payload) * FULL_TRY_BELOW > new.size:
            full = encode_full(new, dtype, zstd_level)
            if len(full) < len(payload):
                return full
        return payload
    x = np.bitwise_xor(old, new).view(UINT[width])
    return header(METHOD_XOR, width, n) + planes_body(x, width, zstd_level)
