"""A faster apply of codec v2 ULP payloads to BF16 tensors: rank-space select instead of a walk.

Codec v2 codes each exponent class's changes as gaps counted in that class's own rank space, and
its values in that class's order (docs/FORMAT.md). The walk in :mod:`.decode_kernels` finds
them by visiting every element, looking its class up and counting down the class's gap: an
unpredictable branch per element. This module applies the same payloads after the same parse and
validation, to the same results (a payload the walk rejects is rejected here too, possibly with
another error code), without a branch per element:

1. per class, its events become a bitmap over the class's rank space;
2. per chunk of ``CHUNK`` elements and per 64-element word: the class's membership mask ``m``
   (64 exponent bytes compared at once), then ``pdep(rank window, m)`` deposits the class's
   events onto the positions of its members; the classes' results are OR-ed into one change mask;
3. the change mask's set bits are applied in position order (class from the exponent byte, next
   value of that class).

It needs BMI2's ``pdep`` (x86_64; microcoded and slow on AMD Zen 1/2), so :data:`AVAILABLE` says
whether this host takes it; elsewhere the walk runs. ``DELTA_SWAP_SELECT_APPLY=0`` (set before
import) turns it off.
"""

from __future__ import annotations

import os
import platform

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...errors import ConfigError
from .jit import inline
from .sign_model import predicted_negative

__all__ = ["AVAILABLE", "CHUNK", "SelectScratch", "apply_bf16"]

CHUNK = 4096  # elements per chunk: its exponent bytes and masks stay in L1


def _host_has_fast_pdep() -> bool:
    """BMI2 on the CPU numba compiles for (the host, unless NUMBA_CPU_NAME overrides it), and not
    AMD Zen 1/2 (or Hygon, LLVM's znver1), whose ``pdep`` is microcoded."""
    if os.environ.get("DELTA_SWAP_SELECT_APPLY", "1") == "0":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    from llvmlite import binding as llvm
    from numba.core import config

    if config.CPU_NAME:  # e.g. "generic" for caches baked into images: only if told it has BMI2
        name, bmi2 = config.CPU_NAME, "+bmi2" in (config.CPU_FEATURES or "")
    else:
        name, bmi2 = llvm.get_host_cpu_name(), bool(llvm.get_host_cpu_features().get("bmi2"))
    return bmi2 and name not in ("znver1", "znver2")


#: Whether this host applies BF16 payloads with the select kernels (else codec v2's walk).
AVAILABLE = _host_has_fast_pdep()

_jit = nb.njit(cache=True, nogil=True, boundscheck=False)

U0, U1, U6, U63, U64 = (np.uint64(x) for x in (0, 1, 6, 63, 64))
SIGN, LOW, SH, FULL = 1 << 15, (1 << 15) - 1, 15, (1 << 16) - 1


# ------------------------------------------------------------------------------ intrinsics


def _splat(builder, value, lanes: int):
    vty = ir.VectorType(value.type, lanes)
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


@intrinsic
def _range_mask64(typingctx, arr, off, lo, span):
    """Bit j set when ``(uint8)(arr[off + j] - lo) <= span``, j < 64 (arr: uint8)."""
    sig = types.uint64(arr, types.uint64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        a, off_, lo_, span_ = args
        data = context.make_array(signature.args[0])(context, builder, a).data
        i8 = ir.IntType(8)
        v = builder.load(builder.bitcast(builder.gep(data, [off_]), ir.VectorType(i8, 64).as_pointer()), align=1)
        d = builder.sub(v, _splat(builder, builder.trunc(lo_, i8), 64))
        inside = builder.icmp_unsigned("<=", d, _splat(builder, builder.trunc(span_, i8), 64))
        return builder.bitcast(inside, ir.IntType(64))

    return sig, codegen


@intrinsic
def _exponents64(typingctx, src, off, dst, doff):
    """``dst[doff + j] = src[off + j] >> 7`` truncated to a byte, j < 64 (a BF16's exponent)."""
    sig = types.void(src, types.uint64, dst, types.uint64)

    def codegen(context, builder, signature, args):
        s, off_, d, doff_ = args
        sdata = context.make_array(signature.args[0])(context, builder, s).data
        ddata = context.make_array(signature.args[2])(context, builder, d).data
        v16, v8 = ir.VectorType(ir.IntType(16), 64), ir.VectorType(ir.IntType(8), 64)
        v = builder.load(builder.bitcast(builder.gep(sdata, [off_]), v16.as_pointer()), align=2)
        e = builder.trunc(builder.lshr(v, ir.Constant(v16, [7] * 64)), v8)
        builder.store(e, builder.bitcast(builder.gep(ddata, [doff_]), v8.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


def _call_llvm(builder, name: str, args, extra=()):
    fnty = ir.FunctionType(ir.IntType(64), [a.type for a in (*args, *extra)])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), [*args, *extra])


@intrinsic
def _pdep(typingctx, src, mask):
    """BMI2 parallel bit deposit: the low bits of src, in order, onto the set bits of mask."""
    return types.uint64(types.uint64, types.uint64), lambda ctx, b, sig, args: _call_llvm(
        b, "llvm.x86.bmi.pdep.64", args
    )


@intrinsic
def _popcount(typingctx, x):
    return types.uint64(types.uint64), lambda ctx, b, sig, args: _call_llvm(b, "llvm.ctpop.i64", args)


@intrinsic
def _tzcnt(typingctx, x):
    """Trailing zeros of a non-zero word."""
    return types.uint64(types.uint64), lambda ctx, b, sig, args: _call_llvm(
        b, "llvm.cttz.i64", args, (ir.Constant(ir.IntType(1), 0),)
    )


# ------------------------------------------------------------------------------ kernels


@inline
def _apply_one(out, pos, d):
    """out[pos] moved by d steps in float order (the walk's arithmetic); negative if out of range."""
    xi = np.int64(out[pos])
    k = (xi ^ (SIGN | ((-(xi >> SH)) & LOW))) + d
    out[pos] = k ^ (SIGN | ((-(1 - (k >> SH))) & LOW))
    return k | (FULL - k)


@_jit
def _rank_bitmap(ev, t0, t1, er, o, last_word, limit):
    """The events ev[t0:t1] (gaps) of one class as set bits at their ranks, in er[o:o + words];
    words past ``last_word`` are not written. Returns the last event's rank (-1: none), at most
    ``limit``."""
    r = U0 - U1
    acc = U0
    prev = U1 << U63
    o = np.uint64(o)
    last_word = np.uint64(last_word)
    limit = np.uint64(limit)
    for t in range(np.uint64(t0), np.uint64(t1)):
        r = min(r + np.uint64(ev[t]) + U1, limit)  # saturates: a rank at ``limit`` fails the caller
        w = min(r >> U6, last_word)
        acc = (acc & (U0 - np.uint64(w == prev))) | (U1 << (r & U63))
        er[o + w] = acc  # stores only: a word is rewritten at each of its events
        prev = w
    return np.int64(r)


@_jit
def _change_mask(ebuf, valid, use_valid, nw, lo, span, inv, rank, eroff, imax, er, cbuf):
    """OR every class's changes in this chunk into cbuf; rank[c] moves on by the class's members."""
    for c in range(lo.size):
        lo_c = lo[c]
        span_c = span[c]
        p = np.uint64(rank[c])
        o = np.uint64(eroff[c])
        inv_c = np.uint64(inv[c])
        top = np.uint64(imax[c])
        for w in range(np.uint64(nw)):
            m = _range_mask64(ebuf, w * U64, lo_c, span_c)
            if use_valid:
                m &= valid[w]
            i = min(o + (p >> U6), top)
            sh = p & U63
            window = (er[i] >> sh) | ((er[i + U1] << (U63 - sh)) << U1)
            cbuf[w] |= (_pdep(window, m) ^ inv_c) & m
            p += _popcount(m)
        rank[c] = np.int64(p)


@_jit
def _apply_changes(out, s, ebuf, cbuf, nw, cls_of, q, vals, last):
    bad = np.int64(0)
    s = np.uint64(s)
    last = np.uint64(last)
    for w in range(np.uint64(nw)):
        x = cbuf[w]
        base = w * U64
        while x:
            t = _tzcnt(x)
            c = cls_of[ebuf[base + t]]
            k = q[c]
            q[c] = k + U1
            bad |= _apply_one(out, s + base + t, vals[min(k, last)])
            x &= x - U1
    return bad


@_jit
def _apply_changes_predicted(out, s, ebuf, cbuf, nw, cls_of, q, vals, last, table, rc, cc, row_len):
    """:func:`_apply_changes` with predicted signs: a value is negated where the sign model
    predicts a negative step. Rows are whole words (row_len % 64 == 0, checked by the parse)."""
    bad = np.int64(0)
    s = np.uint64(s)
    last = np.uint64(last)
    row_len = np.uint64(row_len)
    for w in range(np.uint64(nw)):
        x = cbuf[w]
        base = w * U64
        row = (s + base) // row_len
        col = s + base - row * row_len
        row_table = table[rc[row]]
        while x:
            t = _tzcnt(x)
            c = cls_of[ebuf[base + t]]
            k = q[c]
            q[c] = k + U1
            d = vals[min(k, last)]
            neg = predicted_negative(row_table, cc[col + t])
            bad |= _apply_one(out, s + base + t, (d ^ -neg) + neg)
            x &= x - U1
    return bad


@_jit
def _apply(
    out,
    ebuf,
    cbuf,
    valid,
    er,
    row_dead,
    row_len,
    n_rows,
    lut,
    S,
    D,
    K,
    evp,
    vp,
    vend,
    evend,
    ev,
    vals,
    table,
    rc,
    cc,
    predict,
    pred_len,
):
    """Apply a parsed payload (the layout of :func:`.parse.parse_ulp`, internal class ids) to the BF16
    bits in ``out``; with a sign model (``predict``: rows of ``pred_len``, their codes rc, the
    columns' cc and the prediction table) its predicted signs. Returns 0, -12 (events or values not all used, or ranks past the tensor),
    -11 (a value leaves the dtype's range), or -(words of er needed) when er is too small."""
    n = out.size
    K1 = K + 1
    # value classes (internal ids without the no-change class S), numbered by id; one pass over the
    # exponent table gives each its exponent range and cls_of (exponent byte -> value class, K: none)
    ids = np.zeros(K, np.int64)
    kid = np.zeros(K1, np.int64)
    k = 0
    for j in range(K1):
        if j != S:
            ids[k] = j
            kid[j] = k
            k += 1
    elo = np.full(K, 256, np.int64)
    ehi = np.full(K, -1, np.int64)
    cls_of = np.full(256, K, np.uint64)
    for e in range(256):
        j = lut[e]
        if j != S:
            k = kid[j]
            cls_of[e] = k
            elo[k] = min(elo[k], e)
            ehi[k] = e
    q = np.zeros(K1, np.uint64)
    qend = np.zeros(K1, np.uint64)
    for k in range(K):
        if ehi[k] < 0:  # the parse gives every class a non-empty exponent range
            return -12
        q[k] = vp[ids[k]]
        qend[k] = vend[ids[k]]
    by_exp = np.argsort(elo)
    # mask classes: one per class with events; adjacent event-free dense classes merged
    cap = n // 64 + 1
    need = cap + 3 * K + 4
    if need > er.size:
        return -need
    er[:need] = 0
    lo = np.zeros(K, np.int64)
    span = np.zeros(K, np.int64)
    inv = np.zeros(K, np.uint64)
    eroff = np.zeros(K, np.int64)
    imax = np.zeros(K, np.int64)
    rlast = np.zeros(K, np.int64)
    M = 0
    o = 0
    prev_free = False
    for kk in range(K):
        k = by_exp[kk]
        j = ids[k]
        nev = evend[j] - evp[j]
        dense = j >= D
        if nev == 0 and dense and prev_free and lo[M - 1] + span[M - 1] + 1 == elo[k]:
            span[M - 1] = ehi[k] - lo[M - 1]
            continue
        lo[M] = elo[k]
        span[M] = ehi[k] - elo[k]
        inv[M] = ~U0 if dense else U0
        eroff[M] = o
        room = need - 3 - o  # words this class may use: ranks past the tensor fail below
        r = _rank_bitmap(ev, evp[j] - 1, evend[j] - 1, er, o, max(room, 0), n) if nev > 0 else -1
        if r >= n:
            return -12
        rlast[M] = r
        imax[M] = o + (r >> 6) + 1  # er[imax] and er[imax + 1] stay zero
        o += (r >> 6) + 3
        if o > need - 3:  # classes partition the tensor: valid ranks end by need - 5 (the next
            return -12  # class's stores, clamped to er[need - 3], stay inside er as well)
        prev_free = nev == 0 and dense
        M += 1
    lo, span, inv, eroff, imax = lo[:M], span[:M], inv[:M], eroff[:M], imax[:M]
    rank = np.zeros(M, np.int64)
    last = vals.size - 1
    bad = np.int64(0)
    chunk = ebuf.size - 64
    for s in range(0, n, chunk):
        L = min(chunk, n - s)
        nw = (L + 63) // 64
        if L == chunk:
            for w in range(nw):
                _exponents64(out, np.uint64(s + w * 64), ebuf, np.uint64(w * 64))
        else:
            for i in range(L):
                ebuf[i] = np.uint8((out[s + i] >> 7) & 0xFF)
        cbuf[:nw] = 0
        use_valid = n_rows > 0 or L < chunk
        if use_valid:
            valid[:nw] = U0 if n_rows > 0 else ~U0
            if n_rows > 0:  # members of live rows only
                for r_ in range(s // row_len, min(n_rows, (s + L + row_len - 1) // row_len)):
                    if row_dead[r_]:
                        continue
                    a = max(r_ * row_len, s) - s
                    b = min((r_ + 1) * row_len, s + L) - s
                    while a < b:
                        w = a >> 6
                        bit = a & 63
                        width = min(64 - bit, b - a)
                        ones = ~U0 if width == 64 else (U1 << np.uint64(width)) - U1
                        valid[w] |= ones << np.uint64(bit)
                        a += width
            if L & 63:
                valid[nw - 1] &= (U1 << np.uint64(L & 63)) - U1
        _change_mask(ebuf, valid, use_valid, nw, lo, span, inv, rank, eroff, imax, er, cbuf)
        if predict:
            bad |= _apply_changes_predicted(out, s, ebuf, cbuf, nw, cls_of, q, vals, last, table, rc, cc, pred_len)
        else:
            bad |= _apply_changes(out, s, ebuf, cbuf, nw, cls_of, q, vals, last)
    for k in range(K):
        if q[k] != qend[k]:
            return -12
    for c in range(M):
        if rank[c] <= rlast[c]:
            return -12
    return -11 if bad < 0 else 0


class SelectScratch:
    """Buffers of :func:`apply_bf16`, one set per codec v2 decode scratch (one decoding thread
    holds a scratch at a time)."""

    __slots__ = ("ebuf", "cbuf", "valid", "er")

    def __init__(self) -> None:
        self.ebuf = np.zeros(CHUNK + 64, np.uint8)
        self.cbuf = np.zeros(CHUNK // 64, np.uint64)
        self.valid = np.zeros(CHUNK // 64, np.uint64)
        self.er = np.zeros(1 << 12, np.uint64)


def apply_bf16(
    scratch: SelectScratch,
    out: np.ndarray,
    row_dead: np.ndarray,
    row_len: int,
    n_rows: int,
    lut: np.ndarray,
    S: int,
    D: int,
    K: int,
    evp: np.ndarray,
    vp: np.ndarray,
    vend: np.ndarray,
    evend: np.ndarray,
    ev: np.ndarray,
    vals: np.ndarray,
    table: np.ndarray,
    rc: np.ndarray,
    cc: np.ndarray,
    predict: int,
    pred_len: int,
) -> int:
    """Apply a payload parsed by codec v2 to ``out`` (the old BF16 bits as uint16, in place);
    ``table``, ``rc``, ``cc``, ``predict`` and ``pred_len`` are its sign model's (predict 0:
    none; sign_model). Returns codec v2's error code (0: applied)."""
    if out.dtype != np.uint16 or not out.flags.c_contiguous:
        raise ConfigError("apply_bf16 takes the BF16 bits as a contiguous uint16 array")
    while True:
        err = _apply(
            out,
            scratch.ebuf,
            scratch.cbuf,
            scratch.valid,
            scratch.er,
            row_dead,
            row_len,
            n_rows,
            lut,
            S,
            D,
            K,
            evp,
            vp,
            vend,
            evend,
            ev,
            vals,
            table,
            rc,
            cc,
            predict,
            pred_len,
        )
        if err >= -12 or -err <= scratch.er.size:  # done or an error code (a size is > er.size >= 4096)
            return int(err)
        scratch.er = np.zeros(-err + (-err) // 4, np.uint64)
