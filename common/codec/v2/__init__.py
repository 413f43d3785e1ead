"""Codec v2 (``DSC2``): exponent-classed ULP deltas with Golomb-coded positions and rANS magnitudes.

Why this design (measurements in benchmarks/README.md): between adjacent RL checkpoints an element
``w`` changes when its fp32 master weight crosses a bf16 rounding boundary, so the chance that it
changes is ~ |update| / ulp(w), which doubles for every binade ``w`` goes down, and the size of the
step grows the same way. The decoder holds the old tensor, so the old element's *exponent* is free
context. v2 splits the elements into *classes* (contiguous ranges of the old exponent, chosen per
tensor by a small dynamic program that trades model fit against per-class header bytes) and codes,
per class and in natural order within the class:

* the change positions as Golomb-coded gaps between class ranks (for classes where most elements
  change, the gaps between the *unchanged* ones), one Golomb parameter per class;
* the value as the signed distance in ordered-integer space (mostly +-1): one sign bit, and
  |step| - 1 either implied (all ones), Golomb-coded, or rANS-coded with a per-class table. The
  sign bits are raw, or, for matrices where it is smaller, "flip" bits against a low-rank
  prediction of the signs (:mod:`.sign_model`, header flag 1), rANS-coded eight at a time;
* optionally the rows (last dimension of the tensor's shape) that do not change at all (embedding
  rows of tokens absent from the batch), as Golomb-coded row gaps, so their elements cost nothing.

This sits within 2-6 % of the conditional entropy of that model; zstd byte planes (v1) are 1.6x
larger. Full payloads (no reference) and dtypes other than BF16/F16/F32 keep v1's approach:
byte planes + zstd (XOR for the non-float dtypes).

Decoding is one pass over the tensor in a numba kernel: per element a class lookup from the old
exponent and a per-class countdown; on an event it takes the next gap and applies the next value,
in place into a buffer that holds the old tensor. Every other cost is per changed element. The
kernels release the GIL (``nogil``), so a snapshot's tensors decode in parallel on threads, and are
cached on disk (:func:`warm_up` compiles or loads them ahead of the first payload).

The wire format is specified in docs/FORMAT.md ("Codec payload v2"); the decoder validates every
count, length and table against the expected tensor size *before* allocating, so a crafted payload
raises :class:`CorruptDataError`; it never crashes, hangs or allocates more than a bounded multiple
of the declared tensor size. Structurally valid but wrong payloads (a flipped sign bit) decode to a
wrong tensor, which the reader's checksum rejects.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import tempfile
import threading
from functools import cache
from importlib import resources

import numpy as np
import zstandard

from ...dtypes import DTYPE_SIZES
from ...errors import CorruptDataError
from ..inputs import raw_bytes
from ..zstd_frames import check_frame, decompress_exact


def _ensure_numba_cache_dir() -> None:
    """numba caches compiled kernels next to this file, else in the user's cache folder; when
    neither is writable (a read-only install under a locked-down user) use a temp folder rather
    than failing at import."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("NUMBA_CACHE_DIR") or os.access(here, os.W_OK):
        return
    user = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "numba")
    try:
        os.makedirs(user, exist_ok=True)
        if os.access(user, os.W_OK):
            return
    except OSError:
        pass
    import numba.core.config

    fallback = os.path.join(tempfile.gettempdir(), f"delta-swap-numba-{os.getuid() if hasattr(os, 'getuid') else 0}")
    os.makedirs(fallback, exist_ok=True)
    numba.core.config.CACHE_DIR = fallback


if sys.byteorder != "little":  # the kernels move bitstream words and rANS words as host integers
    raise ImportError("delta_swap.codec.v2 needs a little-endian host (x86_64, aarch64)")
_ensure_numba_cache_dir()

import numba as nb  # noqa: E402
from numba.cpython.unsafe.numbers import trailing_zeros  # noqa: E402

from . import select_apply, sign_model  # noqa: E402

FLAG_SIGN_MODEL = sign_model.FLAG_SIGN_MODEL

MAGIC = b"DSC2"
METHOD_FULL, METHOD_ULP, METHOD_XOR = 0, 1, 2
#: dtype -> (bytes, mantissa bits, exponent bits) of the floats coded as ULP deltas
FLOATS = {"BF16": (2, 7, 8), "F16": (2, 10, 5), "F32": (4, 23, 8)}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

QMAX = 40            # Golomb quotient at which a code escapes to an explicit length
SCALE_BITS = 12      # rANS frequency precision: tables sum to 4096
SCALE = 1 << SCALE_BITS
RANS_L = 1 << 16     # rANS state lower bound; 16-bit renormalisation
MAX_T = 64           # rANS table size (symbols 0..T-2 literal, T-1 escapes)
SENTINEL = 1 << 62   # gap after a class's last event: never reached
HIST_BINS = 258      # encoder statistics: |step|-1 histogram 0..256, bin 257 = overflow
MIN_ROW_LEN = 256    # shorter rows do not pay for their flags
ZSTD_LEVEL = 3
#: What a class costs the decoder (a mask pass per 64 elements and its own parse setup), charged
#: by the encoder's class plan in bits per change of the tensor (so the same share of every
#: payload): merging small classes makes rebuilds faster for slightly larger payloads
#: (benchmarks/README.md, "Fewer classes").
CLASS_COST = 0.025

_jit = nb.njit(cache=True, nogil=True)
_inline = nb.njit(inline="always", nogil=True)

# =====================================================================================  bit I/O


@_inline
def _peek(words, pos):
    """64 bits of the LSB-first bitstream starting at bit ``pos`` >= 0 (words are zero padded).
    Indices are unsigned here and in the other hot loops: numba then skips its negative-index
    wraparound code."""
    w = np.uint64(pos) >> np.uint64(6)
    s = np.uint64(pos) & np.uint64(63)
    return (words[w] >> s) | ((words[w + np.uint64(1)] << (np.uint64(63) - s)) << np.uint64(1))


@_inline
def _golomb_read(words, pos, m, b, cutoff):
    """(value, new_pos); new_pos < 0 on a malformed code."""
    win = _peek(words, pos)
    if win == 0:
        return 0, -1
    q = trailing_zeros(win)
    if q > QMAX:
        return 0, -1
    if q == QMAX:
        pos += QMAX + 1
        L = np.int64(_peek(words, pos) & np.uint64(63))
        pos += 6
        if L > 62:
            return 0, -1
        x = np.int64(_peek(words, pos) & ((np.uint64(1) << np.uint64(L)) - np.uint64(1)))
        return x, pos + L
    pos += q + 1
    if m == 1:
        return np.int64(q), pos
    if q + b < 64:  # the remainder is in the same window
        win = win >> np.uint64(q + 1)
    else:
        win = _peek(words, pos)
    x, k = _golomb_rest(win, q, m, b, cutoff)
    return x, pos + k


@_inline
def _golomb_rest(rest, q, m, b, cutoff):
    """(value, remainder bits) of a code with quotient q (m > 1) whose remainder starts at bit 0
    of ``rest``. Truncated binary without a branch (taken about half the time, so a branch
    mispredicts often): v >= cutoff reads one more bit t, and the value is then
    cutoff + 2 (v - cutoff) + t."""
    v = np.int64(rest & ((np.uint64(1) << np.uint64(b - 1)) - np.uint64(1)))
    long_ = np.int64(v >= cutoff)
    t = np.int64((rest >> np.uint64(b - 1)) & np.uint64(1))
    return q * m + v + long_ * (v - cutoff + t), b - 1 + long_


@_inline
def _golomb_next(words, pos, win, avail, m, b, cutoff):
    """:func:`_golomb_read` from a window: ``win`` holds the stream's next ``avail`` bits (from
    bit ``pos``), and a code that fits in them is decoded by shifting it out, without a load on
    the chain from one code to the next; anything else (a code that straddles the window, an
    escape, a malformed code) goes through :func:`_golomb_read` and a new window. Returns
    (value, new_pos, win, avail); new_pos < 0 on a malformed code, as there."""
    q = np.int64(trailing_zeros(win))  # 64 when the window is all zeros
    if q + b + 1 >= avail or q >= QMAX:  # (>=: the shift below stays under 64)
        x, pos = _golomb_read(words, pos, m, b, cutoff)
        if pos < 0:
            return x, pos, win, avail
        return x, pos, _peek(words, pos), np.int64(64)
    if m == 1:
        L = q + 1
        x = q
    else:
        x, k = _golomb_rest(win >> np.uint64(q + 1), q, m, b, cutoff)
        L = q + 1 + k
    return x, pos + L, win >> np.uint64(L), avail - L


@_inline
def _golomb_params(m):
    """(b, cutoff) of the Golomb code with parameter m: b = ceil(log2 m), cutoff = 2^b - m."""
    b = 0
    while (np.int64(1) << b) < m:
        b += 1
    return b, (np.int64(1) << b) - m


@_inline
def _put(buf, st, val, nb_):
    """Append the low nb_ (<= 57) bits of val; st = [acc, nacc, wpos] (uint64)."""
    if nb_ == 0:
        return
    val = np.uint64(val)
    sh = st[1]
    acc = st[0] | (val << sh)
    nacc = sh + np.uint64(nb_)
    if nacc >= np.uint64(64):
        buf[st[2]] = acc
        st[2] += np.uint64(1)
        nacc -= np.uint64(64)
        acc = (val >> (np.uint64(nb_) - nacc)) if nacc > np.uint64(0) else np.uint64(0)
    st[0] = acc
    st[1] = nacc


@_inline
def _bitlen(x):
    L = 0
    while (np.int64(1) << L) <= x and L < 63:
        L += 1
    return L


@_inline
def _put_long(buf, st, x, L):
    if L > 32:
        _put(buf, st, x & 0xFFFFFFFF, 32)
        _put(buf, st, x >> 32, L - 32)
    else:
        _put(buf, st, x, L)


@_inline
def _golomb_write(buf, st, x, m, b, cutoff):
    q = x // m
    if q >= QMAX:
        _put(buf, st, 0, 40)
        _put(buf, st, 1, 1)
        L = _bitlen(x)
        _put(buf, st, L, 6)
        _put_long(buf, st, x, L)
        return
    _put(buf, st, np.int64(1) << q, q + 1)
    if m == 1:
        return
    r = x - q * m
    if r < cutoff:
        _put(buf, st, r, b - 1)
    else:
        v = cutoff + (r - cutoff) // 2
        t = (r - cutoff) & 1
        _put(buf, st, v | (t << (b - 1)), b)


@_inline
def _golomb_len(x, m, b, cutoff):
    q = x // m
    if q >= QMAX:
        return 47 + _bitlen(x)
    if m == 1:
        return q + 1
    r = x - q * m
    return q + 1 + (b - 1 if r < cutoff else b)


@_inline
def _key(x, sign, full):
    """Ordered key of sign-magnitude bits: unsigned ints in float order."""
    x = np.int64(x)
    return full - x if x & sign else x | sign


# =====================================================================================  encoder kernels


@_jit
def _enc_stats(u, v, mant_bits, exp_mask, row_len, n_rows, sign, full):
    """Per exponent: elements (all rows), elements in changed rows, changes, |step|-1 histogram,
    overflow bits; per row: whether it changed."""
    E = exp_mask + 1
    ne = np.zeros(E, np.int64)
    ne_alive = np.zeros(E, np.int64)
    ke = np.zeros(E, np.int64)
    hist = np.zeros((E, HIST_BINS), np.int64)
    ovf_bits = np.zeros(E, np.int64)
    row_alive = np.zeros(n_rows, np.uint8)
    n = u.size
    tmp = np.zeros(E, np.int64)
    for r in range(n_rows):
        s = r * row_len
        e_ = min(s + row_len, n)
        tmp[:] = 0
        any_ = False
        for i in range(s, e_):
            x = u[i]
            y = v[i]
            e = (np.int64(x) >> mant_bits) & exp_mask
            tmp[e] += 1
            if x != y:
                any_ = True
                ke[e] += 1
                d = _key(y, sign, full) - _key(x, sign, full)
                mg = (d if d > 0 else -d) - 1
                if mg < HIST_BINS - 1:
                    hist[e, mg] += 1
                else:
                    hist[e, HIST_BINS - 1] += 1
                    ovf_bits[e] += _bitlen(mg)
        ne += tmp
        if any_:
            row_alive[r] = 1
            ne_alive += tmp
    return ne, ne_alive, ke, hist, ovf_bits, row_alive


@_inline
def _h2bits(n, k):
    if k == 0 or k == n:
        return 0.0
    p = k / n
    return -n * (p * np.log2(p) + (1 - p) * np.log2(1 - p))


@_inline
def _varint_len(x):
    L = 1
    while x >= 128:
        x >>= 7
        L += 1
    return L


@_jit
def _mag_cost(h, ovf_bits):
    """Estimated bits of the cheapest magnitude coding of a |step|-1 histogram."""
    tot = 0
    for i in range(HIST_BINS):
        tot += h[i]
    if tot == h[0]:
        return 0.0
    s = 0.0
    for i in range(HIST_BINS - 1):
        s += i * h[i]
    mean = s / tot
    best = 1e300
    m0 = max(1, int(mean * 0.69 + 0.5))
    for mm in (max(1, m0 // 2), max(1, m0 - 1), m0, m0 + 1, m0 * 2, 1):
        b, cut = _golomb_params(mm)
        c = 8.0 * _varint_len(mm)
        for i in range(HIST_BINS - 1):
            if h[i]:
                c += h[i] * _golomb_len(i, mm, b, cut)
        c += h[HIST_BINS - 1] * 60.0
        best = min(best, c)
    for T in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        c = 8.0 * (_varint_len(T) + 1.5 * T)
        esc = 0
        for i in range(T - 1, HIST_BINS):
            esc += h[i]
        for i in range(T - 1):
            if h[i]:
                c -= h[i] * np.log2(h[i] / tot)
        if esc:
            c -= esc * np.log2(esc / tot)
            for i in range(T - 1, HIST_BINS - 1):
                if h[i]:
                    c += h[i] * (6 + _bitlen(i - (T - 1)))
            c += h[HIST_BINS - 1] * 6 + ovf_bits
        best = min(best, c)
        if esc == 0:
            break
    return best


@_jit
def _plan_classes(exps, ne, ke, hist, ovf_bits, class_bits):
    """Dynamic program over the sorted active exponents: split them into contiguous classes
    minimising estimated bits, plus ``class_bits`` per class with changes (what a class costs the
    decoder, in bits' worth). Returns (total bits, start index of the segment ending at j)."""
    E = exps.size
    best = np.full(E + 1, 1e300)
    best[0] = 0.0
    arg = np.zeros(E + 1, np.int64)
    h = np.zeros(HIST_BINS, np.int64)
    for j in range(1, E + 1):
        n = 0
        k = 0
        ob = 0
        h[:] = 0
        for i in range(j, 0, -1):  # segment exps[i-1 .. j-1]
            n += ne[exps[i - 1]]
            k += ke[exps[i - 1]]
            ob += ovf_bits[exps[i - 1]]
            h += hist[exps[i - 1]]
            if k == 0:
                c = 0.0
            else:
                ev = min(k, n - k)
                c = _h2bits(n, k) + 0.04 * ev + 8.0 * (4 + _varint_len(ev) + (_varint_len(k) if k > n - k else 0))
                c += _mag_cost(h, ob) + k + class_bits  # + sign bits
            if best[i - 1] + c < best[j]:
                best[j] = best[i - 1] + c
                arg[j] = i - 1
            if j - i > 24:
                break
    return best[E], arg


@_jit
def _enc_walk(u, v, lut, row_alive, row_len, mant_bits, dense, ev_off, val_off, ev_out, val_out, sign, full):
    """Collect per class (in natural order, skipping dead rows) the event gaps and signed steps."""
    K1 = ev_off.size
    rank = np.zeros(K1, np.int64)
    last = np.full(K1, -1, np.int64)
    evp = ev_off.copy()
    vp = val_off.copy()
    n = u.size
    for r in range(row_alive.size):
        if not row_alive[r]:
            continue
        s = r * row_len
        e_ = min(s + row_len, n)
        for i in range(s, e_):
            x = u[i]
            y = v[i]
            c = lut[np.int64(x) >> mant_bits]
            rk = rank[c]
            rank[c] = rk + 1
            ch = x != y
            if ch != dense[c]:
                ev_out[evp[c]] = rk - last[c] - 1
                last[c] = rk
                evp[c] += 1
            if ch:
                val_out[vp[c]] = _key(y, sign, full) - _key(x, sign, full)
                vp[c] += 1
    return evp, vp


@_jit
def _golomb_best_m(g, m_hint):
    """The Golomb parameter (among a few around the hint) that codes g in the fewest bits."""
    best = -1
    best_m = 1
    for f in (0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6):
        m = max(1, int(m_hint * f + 0.5))
        b, cut = _golomb_params(m)
        L = 0
        for x in g:
            L += _golomb_len(x, m, b, cut)
        if best < 0 or L < best:
            best, best_m = L, m
    return best_m, best


@_jit
def _write_bits(buf, row_ev, row_m, ev, ev_off, ev_cnt, cls_m, vals, val_off, val_cnt, mag_mode, mag_par):
    """The bitstream: row gaps, each class's event gaps, then each class's magnitudes (Golomb
    codes, or the escape payloads of rANS-coded ones). Returns its length in bits."""
    st = np.zeros(3, np.uint64)
    if row_ev.size:
        b, cut = _golomb_params(row_m)
        for x in row_ev:
            _golomb_write(buf, st, x, row_m, b, cut)
    K = ev_off.size
    for c in range(K):
        m = cls_m[c]
        b, cut = _golomb_params(m)
        for j in range(ev_off[c], ev_off[c] + ev_cnt[c]):
            _golomb_write(buf, st, ev[j], m, b, cut)
    for c in range(K):
        if mag_mode[c] == 1:
            m = mag_par[c]
            b, cut = _golomb_params(m)
            for j in range(val_off[c], val_off[c] + val_cnt[c]):
                d = vals[j]
                _golomb_write(buf, st, (d if d > 0 else -d) - 1, m, b, cut)
        elif mag_mode[c] == 2:
            T = mag_par[c]
            for j in range(val_off[c], val_off[c] + val_cnt[c]):
                d = vals[j]
                mg = (d if d > 0 else -d) - 1
                if mg >= T - 1:
                    x = mg - (T - 1)
                    L = _bitlen(x)
                    _put(buf, st, L, 6)
                    _put_long(buf, st, x, L)
    nbits = np.int64(st[2]) * 64 + np.int64(st[1])
    if st[1]:
        buf[np.int64(st[2])] = st[0]
    return nbits


@_inline
def _rans_put(x, w, out, f, cum):
    """One rANS encoding step (state x, symbol of frequency f and cumulative frequency cum),
    renormalising into out[w - 1] downwards; returns (x, w)."""
    fs = np.uint64(f)
    if x >= (fs << np.uint64(20)):
        w -= 1
        out[w] = np.uint16(x & np.uint64(0xFFFF))
        x >>= np.uint64(16)
    return ((x // fs) << np.uint64(SCALE_BITS)) + (x % fs) + np.uint64(cum), w


@_inline
def _rans_flush(x, w, out):
    """Store the final state below out[w] (low word first in decoding order); returns the new w."""
    out[w - 1] = np.uint16(x >> np.uint64(16))
    out[w - 2] = np.uint16(x & np.uint64(0xFFFF))
    return w - 2


@_jit
def _rans_encode(vals, val_off, val_cnt, mag_mode, mag_par, freqs, freq_off, out):
    """Encode the table-mode magnitudes in reverse; returns the number of uint16 words written at
    the END of out (out[size-nw:] holds them in decoding order, the final state first)."""
    x = np.uint64(RANS_L)
    w = out.size
    K = val_off.size
    cum = np.zeros(MAX_T + 1, np.int64)
    for c in range(K - 1, -1, -1):
        if mag_mode[c] != 2:
            continue
        T = mag_par[c]
        f = freqs[freq_off[c]:freq_off[c] + T]
        cum[0] = 0
        for s in range(T):
            cum[s + 1] = cum[s] + f[s]
        for j in range(val_off[c] + val_cnt[c] - 1, val_off[c] - 1, -1):
            d = vals[j]
            s = (d if d > 0 else -d) - 1
            if s > T - 1:
                s = T - 1
            x, w = _rans_put(x, w, out, f[s], cum[s])
    return out.size - _rans_flush(x, w, out)


FLIP_STREAMS = 4  # the flip bytes are dealt to four rANS streams: byte i goes to stream i % 4


@_jit
def _flip_byte_freqs(f4):
    """The rANS table of flip bytes (256 symbols, summing to SCALE), from the table of flip
    nibbles a payload carries: f8[a + 16 b] = max(1, (f4[a] f4[b] + 2048) >> 12), and what that
    leaves of SCALE added to the first largest entry. Returns it, or an empty array if that entry
    would drop below 1."""
    f8 = np.empty(256, np.int64)
    tot = 0
    for b in range(16):
        for a in range(16):
            f = max(1, (f4[a] * f4[b] + SCALE // 2) >> SCALE_BITS)
            f8[a + 16 * b] = f
            tot += f
    top = 0
    for i in range(256):
        if f8[i] > f8[top]:
            top = i
    f8[top] += SCALE - tot
    if f8[top] < 1:
        return np.zeros(0, np.int64)
    return f8


@_jit
def _rans_encode_bytes(syms, freqs, out):
    """Encode byte symbols (flip bits of predicted signs, eight per symbol) as one rANS stream
    with one table of 256, in reverse; returns the number of uint16 words written at the END of
    out, as _rans_encode."""
    x = np.uint64(RANS_L)
    w = out.size
    cum = np.zeros(257, np.int64)
    for s in range(256):
        cum[s + 1] = cum[s] + freqs[s]
    for j in range(syms.size - 1, -1, -1):
        s = syms[j]
        x, w = _rans_put(x, w, out, freqs[s], cum[s])
    return out.size - _rans_flush(x, w, out)


# =====================================================================================  decoder kernels


@_inline
def _signed(g, signs, j):
    """The step g + 1 with value j's sign bit (bit j of the sign bytes: one per value, in order)."""
    neg = np.int64((signs[j >> np.uint64(3)] >> (j & np.uint64(7))) & np.uint64(1))
    return ((g + 1) ^ -neg) + neg  # -(g + 1) when the sign bit is set


@_inline
def _rans_step(x, wp, slots, rans, last):
    """One rANS symbol: (symbol, state, words read). ``slots`` packs, per slot of the frequency
    table, what the step needs in one load: symbol s (bits 0-5), slot - cum[s] (6-17) and f[s]
    (18-30). Renormalises without a branch (one 16-bit word is always enough); a read past the
    end rereads the last word and is caught by the caller's check of wp."""
    e = np.uint64(slots[x & np.uint64(SCALE - 1)])
    s = np.int64(e & np.uint64(63))
    x = (e >> np.uint64(18)) * (x >> np.uint64(SCALE_BITS)) + ((e >> np.uint64(6)) & np.uint64(SCALE - 1))
    need = x < RANS_L
    w = np.uint64(rans[min(wp, last)])
    x = (x << np.uint64(16)) | w if need else x
    return s, x, wp + np.int64(need)


@_jit
def _dec_streams(words, nbits, n_rows, row_mode, n_row_ev, row_m, cls_nev, cls_m, ev, ev_off,
                 mag_mode, mag_par, freqs, freq_off, val_off, val_cnt, signs, rans, vals, row_dead, max_mag):
    """Decode the row flags, each class's gaps (into ev, sentinel-terminated per class) and the
    signed steps (into vals). Returns 0 or a negative error code.

    The gaps (a chain through the bitstream position) and the rANS-coded steps (a chain through
    the rANS state) do not depend on each other, so each class's two are decoded in one loop,
    a gap and a step per turn, and the CPU runs both chains at once. What comes after the gaps in
    the bitstream (Golomb-coded steps, rANS escapes) is read afterwards, in value order."""
    pos = 0
    if row_mode != 0:
        b, cut = _golomb_params(row_m)
        r = -1
        for _ in range(n_row_ev):
            g, pos = _golomb_read(words, pos, row_m, b, cut)
            if pos < 0 or pos > nbits:
                return -1
            r += g + 1
            if r >= n_rows:
                return -2
            row_dead[r] = 1
        if row_mode == 2:  # the events were the changed rows
            for r in range(n_rows):
                row_dead[r] ^= 1
    slots = np.zeros(SCALE, np.uint32)
    x = np.uint64(0)
    wp = 0
    last = rans.size - 1
    if rans.size:
        if rans.size < 2:
            return -4
        x = np.uint64(rans[0]) | (np.uint64(rans[1]) << np.uint64(16))
        wp = 2
        if x < RANS_L:
            return -4
    n_esc = np.zeros(cls_nev.size, np.int64)  # per class: values whose rANS symbol escapes
    U1 = np.uint64(1)
    K = cls_nev.size
    for c in range(K):
        m = cls_m[c]
        b, cut = _golomb_params(m)
        o = np.uint64(ev_off[c])
        o_end = o + np.uint64(cls_nev[c])
        mode = mag_mode[c]
        j = np.uint64(val_off[c])
        j_end = j + np.uint64(val_cnt[c]) if mode != 1 else j  # Golomb-coded steps come after the gaps
        T = mag_par[c] if mode == 2 else 0
        if mode == 2:
            t = 0
            for s in range(T):
                f = freqs[freq_off[c] + s]
                for r in range(f):
                    slots[t + r] = np.uint32(s | (r << 6) | (f << 18))
                t += f
        pairs = min(o_end - o, j_end - j)
        win = np.uint64(0)
        avail = np.int64(0)
        if mode == 2:
            esc_sym = T - 1
            k = 0
            big = False
            for _ in range(pairs):
                g, pos, win, avail = _golomb_next(words, pos, win, avail, m, b, cut)
                s, x, wp = _rans_step(x, wp, slots, rans, last)
                if pos < 0 or pos > nbits:
                    return -3
                ev[o] = g
                vals[j] = _signed(s, signs, j)  # an escape's is set again below
                k += s == esc_sym
                big |= s >= max_mag
                o += U1
                j += U1
            while j < j_end:
                s, x, wp = _rans_step(x, wp, slots, rans, last)
                vals[j] = _signed(s, signs, j)
                k += s == esc_sym
                big |= s >= max_mag
                j += U1
            n_esc[c] = k
            if wp > rans.size:
                return -6
            if big:
                return -5
        else:
            while j < j_end:
                vals[j] = _signed(0, signs, j)
                j += U1
        while o < o_end:
            g, pos, win, avail = _golomb_next(words, pos, win, avail, m, b, cut)
            if pos < 0 or pos > nbits:
                return -3
            ev[o] = g
            o += U1
        ev[o_end] = SENTINEL
    for c in range(K):
        j = np.uint64(val_off[c])
        j_end = j + np.uint64(val_cnt[c])
        if mag_mode[c] == 1:
            m = mag_par[c]
            b, cut = _golomb_params(m)
            while j < j_end:
                g, pos = _golomb_read(words, pos, m, b, cut)
                if pos < 0 or pos > nbits or g >= max_mag:
                    return -5
                vals[j] = _signed(g, signs, j)
                j += U1
        elif n_esc[c]:
            T = mag_par[c]
            while j < j_end:
                if vals[j] == T or vals[j] == -T:  # the escape symbol T - 1, signed
                    L = np.int64(_peek(words, pos) & np.uint64(63))
                    pos += 6
                    if L > 62:
                        return -7
                    g = T - 1 + np.int64(_peek(words, pos) & ((np.uint64(1) << np.uint64(L)) - np.uint64(1)))
                    pos += L
                    if pos > nbits:
                        return -7
                    if g >= max_mag:
                        return -5
                    vals[j] = _signed(g, signs, j)
                j += U1
    if rans.size and (x != RANS_L or wp != rans.size):
        return -8
    if pos != nbits:
        return -9
    return 0


@_inline
def _rv(p, pos, limit):
    """Read a varint (at most 9 bytes) from p at pos: (value, new_pos); new_pos = -1 on
    truncation, an overlong encoding or a value above limit."""
    x = np.int64(0)
    shift = 0
    for _ in range(9):
        if pos < 0 or pos >= p.size:
            return np.int64(0), -1
        b = np.int64(p[pos])
        pos += 1
        x |= (b & 0x7F) << shift
        if b < 128:
            if x > limit or x < 0:
                return np.int64(0), -1
            return x, pos
        shift += 7
    return np.int64(0), -1


def _make_walk(mant_bits: int, bits: int):
    """The per-element pass, specialised for one float layout (compile-time constants). The
    ordered key of x is x ^ (SIGN | (LOW if x is negative)); both directions are branch free.
    Every index is unsigned (the class tables are passed as uint64 views): numba then drops its
    negative-index wraparound code, which makes this loop ~1.5x faster."""
    SIGN = 1 << (bits - 1)
    LOW = SIGN - 1
    SH = bits - 1
    FULL = (1 << bits) - 1
    MANT = np.uint64(mant_bits)
    ONE = np.uint64(1)

    @_jit
    def walk(out, lut, D, row_dead, row_len, cnt, evp, ev, vp, vend, vals, table, rc, cc, predict, pred_len):
        """In place: out holds the old elements; changed ones are rewritten. lut, cnt, evp, vp
        and vend are uint64. Sparse classes (id < D) consume exactly one value per event
        (bounded by their sentinel); dense classes (id >= D) consume one per non-event element
        and are bounds-checked. With a sign model (``predict``; rows of ``pred_len`` elements,
        their codes rc, the columns' cc, the prediction ``table``) a value is negated where the
        model predicts a negative step."""
        n = np.uint64(out.size)
        pl = np.uint64(max(pred_len, 1))
        step = np.uint64(row_len)
        D = np.uint64(D)
        bad = np.int64(0)
        s = np.uint64(0)
        for r in range(row_dead.size):
            e_ = min(s + step, n)
            if row_dead[r]:
                s = e_
                continue
            i = s
            s = e_
            while i < e_:
                x = out[i]
                c = lut[np.uint64(x) >> MANT]
                t = cnt[c]
                cnt[c] = t - ONE
                if t == 0:
                    p = evp[c]
                    cnt[c] = np.uint64(ev[p])
                    evp[c] = p + ONE
                    if c >= D:
                        i += ONE
                        continue
                    q = vp[c]
                    vp[c] = q + ONE
                elif c < D:
                    i += ONE
                    continue
                else:
                    q = vp[c]
                    if q >= vend[c]:
                        return -10
                    vp[c] = q + ONE
                d = vals[q]
                if predict:
                    r_ = i // pl
                    neg = sign_model.predicted_negative(table[rc[r_]], cc[i - r_ * pl])
                    d = (d ^ -neg) + neg
                xi = np.int64(x)
                k = (xi ^ (SIGN | ((-(xi >> SH)) & LOW))) + d
                bad |= k | (FULL - k)
                out[i] = k ^ (SIGN | ((-(1 - (k >> SH))) & LOW))
                i += ONE
        return -11 if bad < 0 else 0

    return walk


_WALKS = {"BF16": _make_walk(7, 16), "F16": _make_walk(10, 16), "F32": _make_walk(23, 32)}


@_jit
def _sign_codes(p, codes_at, width, n_rows, row_len, rc, cc):
    """Each row's and each column's codes (``width`` = rank * bits bits, LSB first) of a sign
    model section (docs/FORMAT.md, "Predicted signs"): rc[:n_rows], cc[:row_len]."""
    _unpack_codes(p, codes_at * 8, width, rc)
    _unpack_codes(p, (codes_at + (n_rows * width + 7) // 8) * 8, width, cc)


@_inline
def _unpack_codes(p, at, width, out):
    """out[i] = the ``width``-bit (<= 6) field at bit at + i * width of p (LSB first)."""
    mask = (1 << width) - 1
    last = p.size - 1
    for i in range(out.size):
        b = at >> 3
        two = np.int64(p[b]) | (np.int64(p[min(b + 1, last)]) << 8)  # a field spans at most 2 bytes
        out[i] = (two >> (at & 7)) & mask
        at += width


@_inline
def _flip_words(p, at, nbytes):
    words = np.empty(nbytes // 2, np.uint16)
    words.view(np.uint8)[:] = p[at:at + nbytes]
    return words


@_inline
def _rans_step8(x, wp, slots, rans, last):
    """:func:`_rans_step` for a table of up to 256 symbols (each f < 4096): slots pack the
    symbol (bits 0-7), slot - cum (8-19) and f (20-31)."""
    e = np.uint64(slots[x & np.uint64(SCALE - 1)])
    s = np.int64(e & np.uint64(255))
    x = (e >> np.uint64(20)) * (x >> np.uint64(SCALE_BITS)) + ((e >> np.uint64(8)) & np.uint64(SCALE - 1))
    need = x < RANS_L
    w = np.uint64(rans[min(wp, last)])
    x = (x << np.uint64(16)) | w if need else x
    return s, x, wp + np.int64(need)


@_jit
def _dec_flips(p, fl_at, fl_len, f4, n_sym, out):
    """Decode the predicted signs' flip bits (one rANS byte symbol per eight flips, dealt to
    FLIP_STREAMS streams that start at fl_at[k] and are fl_len[k] bytes long) into the bytes
    ``out`` (flip j: bit j & 7 of byte j >> 3). The four streams are four independent chains.
    Returns 0 or -34."""
    freqs = _flip_byte_freqs(f4)
    if freqs.size == 0:
        return -34
    slots = np.empty(SCALE, np.uint32)  # every slot is set: the frequencies sum to SCALE
    t = 0
    for s in range(256):
        f = freqs[s]
        for r in range(f):
            slots[t + r] = np.uint32(s | (r << 8) | (f << 20))
        t += f
    w0 = _flip_words(p, fl_at[0], fl_len[0])
    w1 = _flip_words(p, fl_at[1], fl_len[1])
    w2 = _flip_words(p, fl_at[2], fl_len[2])
    w3 = _flip_words(p, fl_at[3], fl_len[3])
    x0 = np.uint64(w0[0]) | (np.uint64(w0[1]) << np.uint64(16))
    x1 = np.uint64(w1[0]) | (np.uint64(w1[1]) << np.uint64(16))
    x2 = np.uint64(w2[0]) | (np.uint64(w2[1]) << np.uint64(16))
    x3 = np.uint64(w3[0]) | (np.uint64(w3[1]) << np.uint64(16))
    if min(min(x0, x1), min(x2, x3)) < RANS_L:
        return -34
    p0 = p1 = p2 = p3 = 2
    full = n_sym // 4
    for b in range(full):  # four bytes (32 flips) per turn
        s0, x0, p0 = _rans_step8(x0, p0, slots, w0, w0.size - 1)
        s1, x1, p1 = _rans_step8(x1, p1, slots, w1, w1.size - 1)
        s2, x2, p2 = _rans_step8(x2, p2, slots, w2, w2.size - 1)
        s3, x3, p3 = _rans_step8(x3, p3, slots, w3, w3.size - 1)
        out[4 * b] = np.uint8(s0)
        out[4 * b + 1] = np.uint8(s1)
        out[4 * b + 2] = np.uint8(s2)
        out[4 * b + 3] = np.uint8(s3)
    for i in range(4 * full, n_sym):  # the last 1-3 bytes: streams 0, 1, 2
        if i % 4 == 0:
            s, x0, p0 = _rans_step8(x0, p0, slots, w0, w0.size - 1)
        elif i % 4 == 1:
            s, x1, p1 = _rans_step8(x1, p1, slots, w1, w1.size - 1)
        else:
            s, x2, p2 = _rans_step8(x2, p2, slots, w2, w2.size - 1)
        out[i] = np.uint8(s)
    if p0 != w0.size or p1 != w1.size or p2 != w2.size or p3 != w3.size:
        return -34
    if x0 != RANS_L or x1 != RANS_L or x2 != RANS_L or x3 != RANS_L:
        return -34
    return 0


@_jit
def _parse_ulp(p, pos, n, exp_bits, max_mag, flags, i64s, u8s, sc):
    """Parse and validate a ULP body (p[pos:]) for a tensor of n elements and decode its streams
    into the caller's scratch (i64s, u8s). Returns 1 (ready: sc describes the layout for the
    pass), 2 (scratch too small: sc[0:2] = sizes needed, all validated), 0 (nothing changed) or a
    negative error code. ``flags`` are the payload header's (FLAG_SIGN_MODEL: predicted signs).
    Kept separate from the pass: inlined into this big function the hot loop runs ~2x slower."""
    E = 1 << exp_bits
    n_changed, pos = _rv(p, pos, n)
    row_len, pos = _rv(p, pos, max(n, 1))
    if pos < 0 or row_len < 1:
        return -20
    n_rows = (n + row_len - 1) // row_len
    if pos >= p.size:
        return -20
    row_mode = np.int64(p[pos])
    pos += 1
    if row_mode > 2:
        return -21
    n_row_ev = 0
    row_m = 1
    if row_mode:
        n_row_ev, pos = _rv(p, pos, n_rows)
        row_m, pos = _rv(p, pos, 1 << 40)
        if pos < 0 or row_m < 1:
            return -22
    K, pos = _rv(p, pos, E)
    if pos < 0:
        return -23
    cls_lo = np.empty(K, np.int64)
    cls_hi = np.empty(K, np.int64)
    dense = np.zeros(K, np.bool_)
    cls_nev = np.zeros(K, np.int64)
    cls_nchg = np.zeros(K, np.int64)
    cls_m = np.ones(K, np.int64)
    mag_mode = np.zeros(K, np.int64)
    mag_par = np.zeros(K, np.int64)
    freq_off = np.zeros(K, np.int64)
    freqs = np.zeros(K * MAX_T + 1, np.int64)
    fo = 0
    prev_hi = -1
    sum_nev = 0
    sum_nchg = 0
    n_tables = 0
    for c in range(K):
        d, pos = _rv(p, pos, E)
        span, pos = _rv(p, pos, E)
        if pos < 0 or pos >= p.size:
            return -24
        lo = prev_hi + 1 + d
        hi = lo + span
        if hi >= E:
            return -24
        cls_lo[c] = lo
        cls_hi[c] = hi
        prev_hi = hi
        cf = np.int64(p[pos])
        pos += 1
        if cf > 5:
            return -25
        dense[c] = (cf & 1) == 1
        mag_mode[c] = cf >> 1
        cls_nev[c], pos = _rv(p, pos, n)
        if dense[c]:
            cls_nchg[c], pos = _rv(p, pos, n)
        else:
            cls_nchg[c] = cls_nev[c]
        cls_m[c], pos = _rv(p, pos, 1 << 40)
        if pos < 0 or cls_m[c] < 1 or cls_nchg[c] < 1:
            return -26
        if mag_mode[c] == 1:
            mag_par[c], pos = _rv(p, pos, 1 << 40)
            if pos < 0 or mag_par[c] < 1:
                return -27
        elif mag_mode[c] == 2:
            T, pos = _rv(p, pos, MAX_T)
            if pos < 0 or T < 2:
                return -28
            tot = 0
            for s_ in range(T):
                f, pos = _rv(p, pos, SCALE)
                if pos < 0:
                    return -28
                freqs[fo + s_] = f
                tot += f
            if tot != SCALE:
                return -28
            mag_par[c] = T
            freq_off[c] = fo
            fo += T
            n_tables += 1
        sum_nev += cls_nev[c]
        sum_nchg += cls_nchg[c]
        if sum_nev > n or sum_nchg > n:
            return -29
    if sum_nchg != n_changed:
        return -29
    nbits, pos = _rv(p, pos, np.int64(8) * p.size)
    if pos < 0:
        return -30
    nbytes_bits = (nbits + 7) // 8
    n_sign = (n_changed + 7) // 8
    model = (flags & FLAG_SIGN_MODEL) != 0
    # every gap code takes at least one bit, every change one raw sign bit: counts are bounded by
    # the payload's own length as well as by n before anything of their size is allocated
    if nbytes_bits + (0 if model else n_sign) > p.size - pos or sum_nev + n_row_ev > nbits:
        return -30
    bits_at = pos
    pos += nbytes_bits
    signs = p[pos:pos + n_sign]
    sm_rank = 0
    sm_bits = 0
    lv_at = 0
    codes_at = 0
    fl_at = np.zeros(FLIP_STREAMS, np.int64)
    fl_len = np.zeros(FLIP_STREAMS, np.int64)
    fl_freqs = np.zeros(16, np.int64)
    if model:  # the sign model's section (docs/FORMAT.md, "Predicted signs")
        if row_len % 64 != 0 or n_rows < 2 or n_rows * row_len != n or n_changed == 0 or pos >= p.size:
            return -33
        mb = np.int64(p[pos])
        pos += 1
        sm_rank = mb & 15
        sm_bits = mb >> 4
        if sm_rank < 1 or sm_rank > 3 or sm_bits < 1 or sm_bits > 2 or (sm_bits == 1 and sm_rank != 1):
            return -33
        lv_at = pos
        if sm_bits == 2:
            if 4 * sm_rank > p.size - pos:
                return -33
            for i in range(4 * sm_rank):
                if p[pos + i] == 0:
                    return -33
            pos += 4 * sm_rank
        codes_at = pos
        code_bytes = (n_rows * sm_rank * sm_bits + 7) // 8 + (row_len * sm_rank * sm_bits + 7) // 8
        if code_bytes > p.size - pos:
            return -33
        pos += code_bytes
        tot = 0
        for s_ in range(16):
            f, pos = _rv(p, pos, SCALE)
            if pos < 0:
                return -34
            fl_freqs[s_] = f
            tot += f
        if tot != SCALE:
            return -34
        for k in range(FLIP_STREAMS):
            fl_len[k], pos = _rv(p, pos, p.size)
            if pos < 0 or fl_len[k] % 2 or fl_len[k] < 4 or fl_len[k] > p.size - pos:
                return -34
            fl_at[k] = pos
            pos += fl_len[k]
    else:
        pos += n_sign
    rans_len, pos = _rv(p, pos, p.size)
    if pos < 0 or rans_len % 2 or rans_len != p.size - pos:
        return -31
    if (n_tables > 0) != (rans_len > 0):
        return -31
    if n_changed == 0:
        return 0 if (K == 0 and row_mode == 0 and nbits == 0) else -32
    # large per-change arrays live in caller-owned scratch (reused between calls: fresh pages
    # cost ~0.5 ms/MB in page faults); the small per-class ones are appended behind them
    n_ev = sum_nev + K
    need64 = n_ev + 1 + n_changed + 1 + 6 * (K + 1) + 2 * E + 64 + (64 if model else 0)
    signs_at = (n_rows if row_mode else 0) + 1
    codes_at8 = signs_at + n_sign + 8
    need8 = codes_at8 + n_rows + row_len if model else signs_at
    if need64 > i64s.size or need8 > u8s.size:
        sc[0] = need64
        sc[1] = need8
        return 2
    words = np.zeros(nbytes_bits // 8 + 5, np.uint64)  # little-endian words (x86_64, aarch64)
    words.view(np.uint8)[:nbytes_bits] = p[bits_at:bits_at + nbytes_bits]
    rans = np.empty(rans_len // 2, np.uint16)
    rans.view(np.uint8)[:] = p[pos:pos + rans_len]
    ev_off = np.zeros(K + 1, np.int64)
    val_off = np.zeros(K + 1, np.int64)
    for c in range(K):
        ev_off[c + 1] = ev_off[c] + cls_nev[c] + 1
        val_off[c + 1] = val_off[c] + cls_nchg[c]
    ev = i64s[:n_ev]
    vals = i64s[n_ev:n_ev + n_changed]
    row_dead = u8s[:n_rows] if row_mode else u8s[:1]
    row_dead[:] = 0
    table_at = n_ev + n_changed + 1 + 2 * E + 5 * (K + 1)
    if model:
        _sign_codes(p, codes_at, sm_rank * sm_bits, n_rows, row_len, u8s[codes_at8:codes_at8 + n_rows],
                    u8s[codes_at8 + n_rows:codes_at8 + n_rows + row_len])
        sign_model.prediction_table(p[lv_at:lv_at + (4 * sm_rank if sm_bits == 2 else 0)], sm_rank, sm_bits,
                                    i64s[table_at:table_at + 64].view(np.uint64))
        signs = u8s[signs_at:signs_at + n_sign]  # _dec_flips writes every byte
        err = _dec_flips(p, fl_at, fl_len, fl_freqs, n_sign, signs)
        if err:
            return err
    err = _dec_streams(words, nbits, n_rows, row_mode, n_row_ev, row_m, cls_nev, cls_m, ev, ev_off,
                       mag_mode, mag_par, freqs, freq_off, val_off, cls_nchg, signs, rans, vals, row_dead, max_mag)
    if err:
        return err
    # internal class ids: sparse classes 0..S-1, "no change" S, dense S+1..K
    S = 0
    for c in range(K):
        if not dense[c]:
            S += 1
    D = S + 1
    iid = np.empty(K, np.int64)
    a_ = 0
    b_ = D
    for c in range(K):
        if dense[c]:
            iid[c] = b_
            b_ += 1
        else:
            iid[c] = a_
            a_ += 1
    lut_at = n_ev + n_changed + 1
    o_ = lut_at
    lut = i64s[o_:o_ + 2 * E]  # indexed by the old element's bits >> mantissa bits (sign included)
    o_ += 2 * E
    cnt = i64s[o_:o_ + K + 1]
    evp = i64s[o_ + K + 1:o_ + 2 * (K + 1)]
    vp = i64s[o_ + 2 * (K + 1):o_ + 3 * (K + 1)]
    vend = i64s[o_ + 3 * (K + 1):o_ + 4 * (K + 1)]
    evend = i64s[o_ + 4 * (K + 1):o_ + 5 * (K + 1)]
    lut[:] = S
    for c in range(K):
        lut[cls_lo[c]:cls_hi[c] + 1] = iid[c]
        lut[E + cls_lo[c]:E + cls_hi[c] + 1] = iid[c]
    cnt[S] = SENTINEL
    evp[S] = 0
    vp[S] = 0
    vend[S] = 0
    evend[S] = 0
    for c in range(K):
        j = iid[c]
        cnt[j] = ev[ev_off[c]]
        evp[j] = ev_off[c] + 1
        evend[j] = ev_off[c + 1]
        vp[j] = val_off[c]
        vend[j] = val_off[c + 1]
    sc[0] = D
    sc[1] = row_len if row_mode != 0 else max(n, 1)  # no row flags: one long row (cheaper loop)
    sc[2] = S
    sc[3] = K
    sc[4] = n_ev
    sc[5] = n_changed
    sc[6] = n_rows if row_mode != 0 else 0
    sc[7] = lut_at
    sc[8] = 1 if model else 0
    sc[9] = table_at
    sc[10] = row_len
    sc[11] = codes_at8
    return 1


@_jit
def _check_consumed(evp, evend, vp, vend, S):
    """After the pass every class must have used exactly its events and values."""
    for j in range(evp.size):
        if j != S and (evp[j] != evend[j] or vp[j] != vend[j]):
            return -12
    return 0


_ERRORS = {
    -1: "bad row gap", -2: "row past the end", -3: "bad position gap", -4: "bad rANS state", -5: "bad magnitude",
    -6: "rANS stream too short", -7: "bad magnitude escape", -8: "rANS stream not fully used",
    -9: "bitstream length disagrees", -10: "more values than a class holds", -11: "a value leaves the dtype's range",
    -12: "a class's events or values were not all used", -20: "bad counts or row length", -21: "unknown row mode",
    -22: "bad row flags", -23: "too many classes", -24: "bad class range", -25: "unknown class flags",
    -26: "bad class counts", -27: "bad magnitude parameter", -28: "bad frequency table",
    -29: "class counts disagree with the total", -30: "streams longer than the payload or counts above them",
    -31: "bad rANS stream length", -32: "inconsistent empty delta", -33: "bad sign model",
    -34: "bad flip stream",
}
class _Scratch:
    """Reusable decode buffers. Fresh pages cost ~0.5 ms/MB in page faults, and apply_snapshot
    runs each snapshot on a new thread pool, so buffers are pooled process-wide (one per decoding
    thread at a time, at most ``_POOL_MAX`` kept), not per thread."""

    __slots__ = ("i64", "u8", "select")

    def __init__(self) -> None:
        self.i64 = np.empty(1 << 12, np.int64)
        self.u8 = np.empty(1 << 12, np.uint8)
        self.select = select_apply.SelectScratch()

    def grow(self, n64: int, n8: int) -> None:
        if self.i64.size < n64:
            self.i64 = np.empty(n64, np.int64)
        if self.u8.size < n8:
            self.u8 = np.empty(n8, np.uint8)


_POOL: list[_Scratch] = []
_POOL_LOCK = threading.Lock()
_POOL_MAX = max(2, os.cpu_count() or 1)


def _acquire() -> _Scratch:
    with _POOL_LOCK:
        return _POOL.pop() if _POOL else _Scratch()


def _release(scratch: _Scratch) -> None:
    with _POOL_LOCK:
        if len(_POOL) < _POOL_MAX:
            _POOL.append(scratch)


def _apply_ulp(p: np.ndarray, pos: int, elems: np.ndarray, dtype: str, flags: int = 0) -> None:
    """Parse the ULP body p[pos:] and apply it in place to elems (the old elements)."""
    exp_bits = FLOATS[dtype][2]
    full = (1 << (8 * elems.itemsize)) - 1
    scratch = _acquire()
    try:
        err = _apply_ulp_with(scratch, p, pos, elems, dtype, exp_bits, full, flags)
    finally:
        _release(scratch)
    if err not in (0, 1):
        raise CorruptDataError(f"corrupt v2 delta payload: {_ERRORS.get(err, 'inconsistent')} (code {err})")


def _apply_ulp_with(scratch: _Scratch, p: np.ndarray, pos: int, elems: np.ndarray, dtype: str, exp_bits: int,
                    full: int, flags: int = 0) -> int:
    sc = np.zeros(12, np.int64)
    err = _parse_ulp(p, pos, elems.size, exp_bits, full, flags, scratch.i64, scratch.u8, sc)
    if err == 2:  # sizes were validated against n and the payload length before this request
        scratch.grow(int(sc[0]) + int(sc[0]) // 4, int(sc[1]) + int(sc[1]) // 4)
        err = _parse_ulp(p, pos, elems.size, exp_bits, full, flags, scratch.i64, scratch.u8, sc)
    i64s, u8s = scratch.i64, scratch.u8
    if err == 1:
        D, row_len, S, K, n_ev, n_changed, n_rows, o_, predict, t_at, pred_len, c_at = (int(x) for x in sc)
        table = i64s[t_at:t_at + 64].view(np.uint64)
        n_pred_rows = elems.size // pred_len if predict else 0
        rc = u8s[c_at:c_at + n_pred_rows]
        cc = u8s[c_at + n_pred_rows:c_at + n_pred_rows + (pred_len if predict else 0)]
        E = 1 << exp_bits
        lut = i64s[o_:o_ + 2 * E]
        o_ += 2 * E
        cnt, evp, vp, vend, evend = (i64s[o_ + j * (K + 1):o_ + (j + 1) * (K + 1)] for j in range(5))
        ev = i64s[:n_ev]
        vals = i64s[n_ev:n_ev + n_changed]
        row_dead = u8s[:n_rows] if n_rows else np.zeros(1, np.uint8)
        if dtype == "BF16" and select_apply.AVAILABLE and elems.flags.c_contiguous:
            return select_apply.apply_bf16(scratch.select, elems, row_dead, row_len, n_rows, lut, S, D,
                                           K, evp, vp, vend, evend, ev, vals, table, rc, cc, predict, pred_len)
        u64 = np.uint64
        err = _WALKS[dtype](elems, lut.view(u64), D, row_dead, row_len, cnt.view(u64), evp.view(u64), ev, vp.view(u64),
                            vend.view(u64), vals, table, rc, cc, predict, pred_len)
        if err == 0:
            err = _check_consumed(evp, evend, vp, vend, S)
    return err


# =====================================================================================  python side


def _varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class _Reader:
    """Bounds-checked reader of the byte-aligned header fields."""

    def __init__(self, view: memoryview) -> None:
        self.v = view
        self.p = 0

    def u8(self) -> int:
        if self.p >= len(self.v):
            raise CorruptDataError("payload truncated")
        b = self.v[self.p]
        self.p += 1
        return b

    def varint(self, limit: int, what: str) -> int:
        x = shift = 0
        for _ in range(9):
            b = self.u8()
            x |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                if x > limit:
                    raise CorruptDataError(f"{what} = {x} exceeds its limit {limit}")
                return x
        raise CorruptDataError(f"overlong varint for {what}")

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self.v) - self.p:
            raise CorruptDataError(f"payload truncated inside {what}")
        out = self.v[self.p:self.p + n]
        self.p += n
        return out


def _planes_body(elems: np.ndarray, width: int, level: int) -> bytes:
    out = bytearray()
    as_bytes = elems.view(np.uint8).reshape(-1, width)
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
    for j in range(width):
        raw = np.ascontiguousarray(as_bytes[:, j]).tobytes()
        packed = cctx.compress(raw) if len(raw) >= 64 else raw
        if len(packed) < len(raw):
            out += bytes([1]) + _varint(len(packed)) + packed
        else:
            out += bytes([0]) + _varint(len(raw)) + raw
    return bytes(out)


def _read_planes(rd: _Reader, n: int, width: int) -> list[tuple[int, memoryview]]:
    """Read and validate every plane's framing (coder, length, zstd content size) before any
    plane is decompressed or the output allocated."""
    planes = []
    for _ in range(width):
        coder = rd.u8()
        stored = rd.take(rd.varint(len(rd.v), "plane length"), "a plane")
        if coder == 0:
            if len(stored) != n:
                raise CorruptDataError("raw plane has the wrong length")
        elif coder == 1:
            check_frame(stored, n, "plane")
        else:
            raise CorruptDataError(f"unknown plane coder {coder}")
        planes.append((coder, stored))
    return planes


def _plane_bytes(coder: int, stored: memoryview, n: int) -> np.ndarray:
    if coder == 0:
        return np.frombuffer(stored, np.uint8)
    return np.frombuffer(decompress_exact(stored, n, "plane"), np.uint8)


def _header(method: int, width: int, n: int, flags: int = 0) -> bytes:
    return MAGIC + bytes([method, width, flags]) + _varint(n)


def _readonly(arr: np.ndarray, dtype: type) -> np.ndarray:
    """A read-only view: numba compiles one specialisation per array mutability, so every
    input reaches the kernels read-only (bytes, mmapped files and writable arrays alike) and
    the kernels warm_up compiled are the ones real payloads use."""
    view = arr.view(dtype)
    view.flags.writeable = False
    return view


def _width(dtype: str, nbytes: int) -> int:
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {dtype!r}")
    width = DTYPE_SIZES[dtype]
    if nbytes % width:
        raise ValueError(f"{nbytes} bytes is not a whole number of {dtype} elements")
    return width


def encode_full(new: np.ndarray, dtype: str, zstd_level: int = ZSTD_LEVEL) -> bytes:
    """A payload of ``new`` on its own: byte planes, each zstd-compressed or raw."""
    new = raw_bytes(new, "new")
    width = _width(dtype, new.size)
    return _header(METHOD_FULL, width, new.size // width) + _planes_body(new.view(_UINT[width]), width, zstd_level)


def _quantize_freqs(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to SCALE, every present symbol >= 1."""
    counts = counts.astype(np.float64)
    tot = counts.sum()
    f = np.where(counts > 0, np.maximum(1, np.floor(counts * SCALE / tot)), 0).astype(np.int64)
    diff = SCALE - int(f.sum())
    order = np.argsort(-counts, kind="stable")
    i = 0
    while diff != 0:
        s = order[i % order.size]
        if counts[s] > 0:
            if diff > 0:
                f[s] += 1
                diff -= 1
            elif f[s] > 1:
                f[s] -= 1
                diff += 1
        i += 1
    return f


def _table_bits(mags: np.ndarray, T: int) -> tuple[float, np.ndarray]:
    sym = np.minimum(mags, T - 1)
    counts = np.bincount(sym, minlength=T)[:T]
    f = _quantize_freqs(counts)
    bits = -(counts[counts > 0] * np.log2(f[counts > 0] / SCALE)).sum()
    esc = mags[mags >= T - 1] - (T - 1)
    if esc.size:
        bits += 6 * esc.size + np.ceil(np.log2(esc + 1)).sum()
    bits += 8 * (len(_varint(T)) + sum(len(_varint(int(x))) for x in f))
    return float(bits), f


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


def _sign_section(u: np.ndarray, v: np.ndarray, vals: np.ndarray, lut_e: np.ndarray, mant_bits: int, E: int,
                  shape: tuple[int, ...] | None, row_len: int, n_rows: int) -> tuple[int, bytes]:
    """(payload flags, the signs' bytes): raw sign bits, or, where it is smaller, a sign model
    (:mod:`.sign_model`) and the rANS-coded flips of ``vals`` (which are negated in place
    where the model predicts a negative step)."""
    raw = np.packbits(vals < 0, bitorder="little").tobytes()
    if not shape or len(shape) < 2 or row_len * n_rows != u.size or vals.size < sign_model.MIN_CHANGES:
        return 0, raw
    changed = np.flatnonzero(u != v)
    cls = lut_e[(u[changed] >> mant_bits).astype(np.int64) & (E - 1)].astype(np.uint8)  # K <= 256 classes
    order = np.argsort(cls, kind="stable")  # (a radix sort) value j is the change at changed[order[j]]
    signs = np.zeros(u.size, np.int8)
    signs[changed[order]] = np.where(vals < 0, -1, 1)
    rows, cols = np.divmod(changed, row_len)
    fitted = sign_model.fit(signs.reshape(n_rows, row_len), rows, cols)
    if fitted is None:
        return 0, raw
    model, predicted = fitted
    stored = np.where(predicted[order], -vals, vals)
    flips = np.zeros((stored.size + 7) // 8 * 8, np.uint8)
    flips[:stored.size] = stored < 0
    nibbles = flips[0::4] | flips[1::4] << 1 | flips[2::4] << 2 | flips[3::4] << 3
    f4 = _quantize_freqs(np.bincount(nibbles, minlength=16))
    f8 = _flip_byte_freqs(f4)
    if f8.size == 0:
        return 0, raw
    syms = np.packbits(flips, bitorder="little")
    buf = np.zeros(syms.size + 8, np.uint16)
    section = model.to_bytes() + b"".join(_varint(int(f)) for f in f4)
    for k in range(FLIP_STREAMS):
        nw = _rans_encode_bytes(syms[k::FLIP_STREAMS].copy(), f8, buf)
        coded = buf[buf.size - nw:].astype("<u2").tobytes()
        section += _varint(len(coded)) + coded
    if len(section) >= len(raw):
        return 0, raw
    vals[:] = stored
    return sign_model.FLAG_SIGN_MODEL, section


def _encode_ulp(u: np.ndarray, v: np.ndarray, dtype: str, shape: tuple[int, ...] | None,
                predict_signs: bool = True, class_cost: float = 0.0) -> tuple[bytes, int]:
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
    ne, ne_alive, ke, hist, ovf_bits, row_alive = _enc_stats(u, v, mant_bits, E - 1, row_len, n_rows, sign, full)
    n_changed = int(ke.sum())

    # class plans without and with the dead-rows filter
    exps = np.flatnonzero(ne).astype(np.int64)
    class_bits = class_cost * n_changed
    cost, arg = _plan_classes(exps, ne, ke, hist, ovf_bits, class_bits)
    ne_used = ne
    n_alive = int(row_alive.sum())
    row_mode = 0
    if n_rows > 1 and n_alive < n_rows:
        exps_a = np.flatnonzero(ne_alive).astype(np.int64)
        cost1, arg1 = _plan_classes(exps_a, ne_alive, ke, hist, ovf_bits, class_bits)
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
    cls_nev = np.zeros(K, np.int64)
    cls_nchg = np.zeros(K, np.int64)
    for c, (lo, hi, nn, k) in enumerate(classes):
        lut_e[lo:hi + 1] = c
        dense[c] = k > nn - k
        cls_nev[c] = nn - k if dense[c] else k
        cls_nchg[c] = k
    lut = np.concatenate([lut_e, lut_e])
    ev_off = np.concatenate([[0], np.cumsum(cls_nev)[:-1]]).astype(np.int64) if K else np.zeros(0, np.int64)
    val_off = np.concatenate([[0], np.cumsum(cls_nchg)[:-1]]).astype(np.int64) if K else np.zeros(0, np.int64)
    ev = np.empty(int(cls_nev.sum()), np.int64)
    vals = np.empty(n_changed, np.int64)
    if K:
        _enc_walk(u, v, lut, row_alive, row_len, mant_bits, dense, np.append(ev_off, 0), np.append(val_off, 0),
                  ev, vals, sign, full)
    row_ev = np.zeros(0, np.int64)
    row_m = 1
    if row_mode:
        rows = np.flatnonzero(row_alive == 0) if row_mode == 1 else np.flatnonzero(row_alive)
        row_ev = (np.diff(rows, prepend=-1) - 1).astype(np.int64)
        row_m, _ = _golomb_best_m(row_ev, max(1.0, 0.69 * row_ev.mean()) if row_ev.size else 1.0)
    # per-class Golomb parameters and magnitude coding
    cls_m = np.ones(K, np.int64)
    mag_mode = np.zeros(K, np.int64)
    mag_par = np.zeros(K, np.int64)
    tables: dict[int, np.ndarray] = {}
    for c in range(K):
        g = ev[ev_off[c]:ev_off[c] + cls_nev[c]]
        if g.size:
            cls_m[c], _ = _golomb_best_m(g, max(1.0, 0.69 * g.mean()))
        mags = np.abs(vals[val_off[c]:val_off[c] + cls_nchg[c]]) - 1
        if mags.max() == 0:
            continue
        m2, gl = _golomb_best_m(mags, max(1.0, 0.69 * mags.mean()))
        best_bits, best = gl + 8 * len(_varint(int(m2))), (1, int(m2), None)
        mx = int(mags.max())
        for T in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
            tb, f = _table_bits(mags, T)
            if tb < best_bits:
                best_bits, best = tb, (2, T, f)
            if T - 1 > mx:
                break
        mag_mode[c], mag_par[c] = best[0], best[1]
        if best[0] == 2:
            tables[c] = best[2]
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
    nbits = _write_bits(buf, row_ev, row_m, ev, ev_off, cls_nev, cls_m, vals, val_off, cls_nchg, mag_mode, mag_par)
    bits_bytes = buf.view(np.uint8)[: (nbits + 7) // 8].tobytes()
    flags, signs = _sign_section(u, v, vals, lut_e, mant_bits, E, shape if predict_signs else None, row_len, n_rows)
    rans_bytes = b""
    if tables:
        rbuf = np.zeros(vals.size * 2 + 8, np.uint16)
        nw = _rans_encode(vals, val_off, cls_nchg, mag_mode, mag_par, freqs, freq_off, rbuf)
        rans_bytes = rbuf[rbuf.size - nw:].astype("<u2").tobytes()

    out = bytearray(_header(METHOD_ULP, width, n, flags))
    out += _varint(n_changed) + _varint(row_len)
    out.append(row_mode)
    if row_mode:
        out += _varint(int(row_ev.size)) + _varint(int(row_m))
    out += _varint(K)
    prev_hi = -1
    for c, (lo, hi, _nn, _k) in enumerate(classes):
        out += _varint(lo - prev_hi - 1) + _varint(hi - lo)
        prev_hi = hi
        out.append(int(dense[c]) | (int(mag_mode[c]) << 1))
        out += _varint(int(cls_nev[c]))
        if dense[c]:
            out += _varint(int(cls_nchg[c]))
        out += _varint(int(cls_m[c]))
        if mag_mode[c] == 1:
            out += _varint(int(mag_par[c]))
        elif mag_mode[c] == 2:
            out += _varint(int(mag_par[c])) + b"".join(_varint(int(x)) for x in tables[c])
    out += _varint(int(nbits)) + bits_bytes + signs + _varint(len(rans_bytes)) + rans_bytes
    return bytes(out), n_changed


def encode_delta(old: np.ndarray, new: np.ndarray, dtype: str, shape: tuple[int, ...] | None = None,
                 zstd_level: int = ZSTD_LEVEL, dense_fraction: float = 0.125, predict_signs: bool = True,
                 class_cost: float = CLASS_COST) -> bytes:
    """A payload that rebuilds ``new`` from ``old`` (raw bytes of ``dtype``, same size).

    ``shape`` (optional) is the tensor's shape: rows of its last dimension that do not change at
    all are then flagged instead of coded element by element. When more than ``dense_fraction``
    of the elements changed, a full payload is returned if it is smaller. ``predict_signs``: try a
    sign model (:mod:`.sign_model`) where the shape allows it. ``class_cost``: see CLASS_COST.
    """
    new = raw_bytes(new, "new")
    old = raw_bytes(old, "old")
    if old.size != new.size:
        raise ValueError(f"old has {old.size} bytes, new has {new.size}")
    width = _width(dtype, new.size)
    n = new.size // width
    if dtype in FLOATS:
        payload, n_changed = _encode_ulp(_readonly(old, _UINT[width]), _readonly(new, _UINT[width]), dtype, shape,
                                         predict_signs, class_cost)
        if n_changed > dense_fraction * n:
            full = encode_full(new, dtype, zstd_level)
            if len(full) < len(payload):
                return full
        return payload
    x = np.bitwise_xor(old, new).view(_UINT[width])
    return _header(METHOD_XOR, width, n) + _planes_body(x, width, zstd_level)


def payload_is_delta(payload: bytes | memoryview) -> bool:
    """Whether a v2 payload needs the previous tensor."""
    view = memoryview(payload)
    if len(view) < 8 or bytes(view[:4]) != MAGIC:
        raise CorruptDataError("bad v2 payload magic")
    if view[4] not in (METHOD_FULL, METHOD_ULP, METHOD_XOR):
        raise CorruptDataError(f"unknown v2 payload method {view[4]}")
    return view[4] != METHOD_FULL


def full_payload_nbytes(payload: bytes | memoryview) -> int:
    """The tensor size a v2 full payload rebuilds, from its header (planes validated, not decoded)."""
    view = memoryview(payload).cast("B")
    if not payload_is_delta(view) and view[5] in _UINT:
        rd = _Reader(view)
        rd.p = 7
        n = rd.varint(1 << 62, "n_elements")
        _read_planes(rd, n, view[5])
        return n * view[5]
    raise CorruptDataError("not a v2 full payload")


def decode_into(out: np.ndarray, payload: bytes | memoryview, dtype: str) -> None:
    """Rebuild a tensor in place: ``out`` (raw bytes of ``dtype``) holds the previous tensor for a
    delta payload (anything for a full one) and receives the new bytes.

    The payload's header, counts, lengths and tables are validated before ``out`` is written;
    errors found during the pass (values that do not add up) raise CorruptDataError after part of
    ``out`` was rewritten, so its content is then undefined.
    """
    out = raw_bytes(out, "out")
    view = memoryview(payload).cast("B")
    if len(view) < 8 or bytes(view[:4]) != MAGIC:
        raise CorruptDataError("bad v2 payload magic")
    if dtype not in DTYPE_SIZES:
        raise CorruptDataError(f"unknown dtype {dtype!r}")
    width = DTYPE_SIZES[dtype]
    rd = _Reader(view)
    rd.p = 4
    method, pwidth, flags = rd.u8(), rd.u8(), rd.u8()
    if pwidth != width:
        raise CorruptDataError(f"payload element size {pwidth} does not match {dtype}")
    if flags & ~FLAG_SIGN_MODEL or (flags and method != METHOD_ULP):
        raise CorruptDataError(f"unknown payload flags {flags:#x}")
    if out.size % width:
        raise CorruptDataError("expected byte count is not a whole number of elements")
    n = rd.varint(out.size // width, "n_elements")
    if n * width != out.size:
        raise CorruptDataError(f"payload rebuilds {n * width} bytes, expected {out.size}")
    if method in (METHOD_FULL, METHOD_XOR):
        if method == METHOD_XOR and dtype in FLOATS:
            raise CorruptDataError(f"XOR payload for the float dtype {dtype}")
        planes = _read_planes(rd, n, width)
        if rd.p != len(view):
            raise CorruptDataError(f"{len(view) - rd.p} trailing bytes")
        columns = out.reshape(-1, width)
        for j, (coder, stored) in enumerate(planes):
            data = _plane_bytes(coder, stored, n)
            if method == METHOD_FULL:
                columns[:, j] = data
            else:
                columns[:, j] ^= data
        return
    if method != METHOD_ULP:
        raise CorruptDataError(f"unknown v2 payload method {method}")
    if dtype not in FLOATS:
        raise CorruptDataError(f"ULP payload for the non-float dtype {dtype}")
    _apply_ulp(_readonly(np.frombuffer(view, np.uint8), np.uint8), rd.p, out.view(_UINT[width]), dtype, flags)


def _warm_up_tensors(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A small deterministic (old, new) pair of shape (8, 256) that uses every coding mode: dead
    rows, sparse and dense classes, Golomb and rANS magnitudes with escapes."""
    width, mant_bits, _ = FLOATS[dtype]
    i = np.arange(2048, dtype=np.uint64)
    x = ((i + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
    u = (x >> np.uint64(66 - 8 * width)).astype(_UINT[width])  # top bits clear: finite, no wrap
    v = u.copy()
    live = (i // 256) % 3 != 1
    v[live & (i % 3 == 0)] += 1
    v[live & (i % 97 == 1)] += _UINT[width](1 << mant_bits)
    v[live & (i % 11 == 2)] -= 3
    v[live & (i % 7 == 3)] += _UINT[width](5 + (i[live & (i % 7 == 3)] % 50).astype(_UINT[width]))
    return u.view(np.uint8), v.view(np.uint8)


def _warm_up_sign_tensors() -> tuple[np.ndarray, np.ndarray]:
    """A deterministic BF16 (old, new) pair of shape (64, 256) whose steps' signs follow a rank-1
    pattern (a sign per row times a sign per column, one in eight flipped): its payload predicts
    signs."""
    i = np.arange(64 * 256, dtype=np.uint64)
    x = ((i + np.uint64(7)) * np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
    u = ((x >> np.uint64(51)) | np.uint64(0x3C00)).astype(np.uint16)  # 2^-7 .. 2^1, positive
    rows, cols = i // np.uint64(256), i % np.uint64(256)
    negative = ((rows * np.uint64(5) + cols * np.uint64(3)) % np.uint64(7) < np.uint64(3)) ^ ((x >> np.uint64(7)) % np.uint64(8) == 0)
    changed = (x >> np.uint64(20)) % np.uint64(3) != 0
    v = u.astype(np.int64) + np.where(changed, np.where(negative, -1, 1), 0)
    return u.view(np.uint8), v.astype(np.uint16).view(np.uint8)


@cache
def _stored_payloads() -> dict[str, str]:
    """warm_up_payloads.json (shipped with the package), base64 payloads by case: "BF16", "F16" and
    "F32" are ``encode_delta(*_warm_up_tensors(dtype), dtype, (8, 256), dense_fraction=2.0)``,
    "BF16 signs" is ``encode_delta(*_warm_up_sign_tensors(), "BF16", (64, 256), dense_fraction=2.0)``
    (predicted signs), each as written when it was stored (later encoders may write other bytes)."""
    return json.loads(resources.files(__package__).joinpath("warm_up_payloads.json").read_text())


def _stored_payload(name: str) -> bytes:
    """The stored payload of one warm-up case (see :func:`_stored_payloads`)."""
    return base64.b64decode(_stored_payloads()[name])


def warm_up(encoder: bool = True) -> None:
    """Compile (or load from numba's on-disk cache) the decoder's kernels, and the encoder's
    unless ``encoder`` is False, by coding small tensors of each float dtype with every coding
    mode. The decoder-only warm-up decodes payloads stored with the package, so a server does not
    compile the encoder it never uses. Call it early, e.g. in a background thread, so the first
    real payload does not wait for the JIT."""
    cases = [(dtype, *_warm_up_tensors(dtype), (8, 256)) for dtype in FLOATS]
    cases.append(("BF16 signs", *_warm_up_sign_tensors(), (64, 256)))
    for name, old, new, shape in cases:
        dtype = name.split()[0]
        payloads = [_stored_payload(name)]
        if encoder:
            payloads.append(encode_delta(old, new, dtype, shape, dense_fraction=2.0))
        for payload in payloads:
            out = old.copy()
            decode_into(out, payload, dtype)
            if not np.array_equal(out, new):
                raise RuntimeError(f"codec v2 self-test failed for {name}")
