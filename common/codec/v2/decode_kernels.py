"""Codec v2's decoder kernels: the streams (gaps, steps, flips) and the per-element walk that applies
them in place; :mod:`.parse` validates a payload and sets them up, :mod:`.select_apply` is the
walk's branch-free BF16 alternative."""

from __future__ import annotations

import numpy as np

from . import sign_model
from .bitio import golomb_next, golomb_params, golomb_read, peek
from .encode_kernels import flip_byte_freqs
from .jit import inline, kernel
from .wire import RANS_L, SCALE, SCALE_BITS

SENTINEL = 1 << 62  # gap after a class's last event: never reached


@inline
def _signed(g, signs, j):
    """The step g + 1 with value j's sign bit (bit j of the sign bytes: one per value, in order)."""
    neg = np.int64((signs[j >> np.uint64(3)] >> (j & np.uint64(7))) & np.uint64(1))
    return ((g + 1) ^ -neg) + neg  # -(g + 1) when the sign bit is set


@inline
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


@kernel
def dec_streams(
    words,
    nbits,
    n_rows,
    row_mode,
    n_row_events,
    row_m,
    n_events,
    cls_m,
    ev,
    ev_off,
    mag_mode,
    mag_m,
    mag_T,
    freqs,
    freq_off,
    val_off,
    n_class_changes,
    signs,
    rans,
    vals,
    row_dead,
    max_mag,
):
    """Decode the row flags, each class's gaps (into ev, sentinel-terminated per class) and the
    signed steps (into vals). Returns 0 or a negative error code.

    The gaps (a chain through the bitstream position) and the rANS-coded steps (a chain through
    the rANS state) do not depend on each other, so each class's two are decoded in one loop,
    a gap and a step per turn, and the CPU runs both chains at once. What comes after the gaps in
    the bitstream (Golomb-coded steps, rANS escapes) is read afterwards, in value order."""
    pos = 0
    if row_mode != 0:
        b, cut = golomb_params(row_m)
        r = -1
        for _ in range(n_row_events):
            g, pos = golomb_read(words, pos, row_m, b, cut)
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
    n_esc = np.zeros(n_events.size, np.int64)  # per class: values whose rANS symbol escapes
    U1 = np.uint64(1)
    K = n_events.size
    for c in range(K):
        m = cls_m[c]
        b, cut = golomb_params(m)
        o = np.uint64(ev_off[c])
        o_end = o + np.uint64(n_events[c])
        mode = mag_mode[c]
        j = np.uint64(val_off[c])
        j_end = j + np.uint64(n_class_changes[c]) if mode != 1 else j  # Golomb-coded steps come after the gaps
        T = mag_T[c] if mode == 2 else 0
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
                g, pos, win, avail = golomb_next(words, pos, win, avail, m, b, cut)
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
            g, pos, win, avail = golomb_next(words, pos, win, avail, m, b, cut)
            if pos < 0 or pos > nbits:
                return -3
            ev[o] = g
            o += U1
        ev[o_end] = SENTINEL
    for c in range(K):
        j = np.uint64(val_off[c])
        j_end = j + np.uint64(n_class_changes[c])
        if mag_mode[c] == 1:
            m = mag_m[c]
            b, cut = golomb_params(m)
            while j < j_end:
                g, pos = golomb_read(words, pos, m, b, cut)
                if pos < 0 or pos > nbits or g >= max_mag:
                    return -5
                vals[j] = _signed(g, signs, j)
                j += U1
        elif n_esc[c]:
            T = mag_T[c]
            while j < j_end:
                if vals[j] == T or vals[j] == -T:  # the escape symbol T - 1, signed
                    L = np.int64(peek(words, pos) & np.uint64(63))
                    pos += 6
                    if L > 62:
                        return -7
                    g = T - 1 + np.int64(peek(words, pos) & ((np.uint64(1) << np.uint64(L)) - np.uint64(1)))
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

    @kernel
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


WALKS = {"BF16": _make_walk(7, 16), "F16": _make_walk(10, 16), "F32": _make_walk(23, 32)}


@inline
def _flip_words(p, at, nbytes):
    words = np.empty(nbytes // 2, np.uint16)
    words.view(np.uint8)[:] = p[at : at + nbytes]
    return words


@inline
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


@kernel
def dec_flips(p, fl_at, fl_len, f4, n_sym, out):
    """Decode the predicted signs' flip bits (one rANS byte symbol per eight flips, dealt to
    FLIP_STREAMS streams that start at fl_at[k] and are fl_len[k] bytes long) into the bytes
    ``out`` (flip j: bit j & 7 of byte j >> 3). The four streams are four independent chains.
    Returns 0 or -34."""
    freqs = flip_byte_freqs(f4)
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


@kernel
def check_consumed(evp, evend, vp, vend, S):
    """After the pass every class must have used exactly its events and values."""
    for j in range(evp.size):
        if j != S and (evp[j] != evend[j] or vp[j] != vend[j]):
            return -12
    return 0
