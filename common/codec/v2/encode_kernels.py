"""Codec v2's encoder kernels: statistics, the class plan, the walk that collects gaps and steps,
and the writers of the bitstream and the rANS streams."""

from __future__ import annotations

import numpy as np

from .bitio import QMAX, bitlen, golomb_len, golomb_params, golomb_write, put, put_long
from .jit import inline, kernel
from .wire import MAX_T, RANS_L, SCALE, SCALE_BITS

HIST_BINS = 258  # encoder statistics: |step|-1 histogram 0..256, bin 257 = overflow
_BITLEN = np.array([max(0, int(x).bit_length()) for x in range(HIST_BINS)], np.int64)  # bitlen() of each bin


@inline
def _key(x, sign, full):
    """Ordered key of sign-magnitude bits: unsigned ints in float order."""
    x = np.int64(x)
    return full - x if x & sign else x | sign


@kernel
def enc_stats(u, v, mant_bits, exp_mask, row_len, n_rows, row_step, sign, full):
    """Per exponent: elements (all rows), elements in changed rows, changes, |step|-1 histogram,
    overflow bits; counted on every ``row_step``-th row and scaled by ``row_step`` (an estimate of
    every row's counts; exact for 1)."""
    E = exp_mask + 1
    ne = np.zeros((2, E), np.int64)  # two counters per exponent: alternate elements do not wait on each other
    ne_dead = np.zeros(E, np.int64)
    ke = np.zeros(E, np.int64)
    hist = np.zeros((E, HIST_BINS), np.int64)
    ovf_bits = np.zeros(E, np.int64)
    n = u.size
    for r in range(0, n_rows, row_step):
        s = r * row_len
        e_ = min(s + row_len, n)
        same = 0
        for i in range(s, e_):
            ne[i & 1, (np.int64(u[i]) >> mant_bits) & exp_mask] += 1
            same += u[i] == v[i]
        if same == e_ - s:  # a dead row: its elements count for the plan without dead rows
            for i in range(s, e_):
                ne_dead[(np.int64(u[i]) >> mant_bits) & exp_mask] += 1
            continue
        for i in range(s, e_):  # the changes: a few percent of a row
            x = u[i]
            y = v[i]
            if x != y:
                e = (np.int64(x) >> mant_bits) & exp_mask
                ke[e] += 1
                d = _key(y, sign, full) - _key(x, sign, full)
                mg = (d if d > 0 else -d) - 1
                if mg < HIST_BINS - 1:
                    hist[e, mg] += 1
                else:
                    hist[e, HIST_BINS - 1] += 1
                    ovf_bits[e] += bitlen(mg)
    ne_all = ne[0] + ne[1]
    if row_step > 1:
        ne_all *= row_step
        ne_dead *= row_step
        ke *= row_step
        hist *= row_step
        ovf_bits *= row_step
    return ne_all, ne_all - ne_dead, ke, hist, ovf_bits


@inline
def _h2bits(n, k):
    if k == 0 or k == n:
        return 0.0
    p = k / n
    return -n * (p * np.log2(p) + (1 - p) * np.log2(1 - p))


@inline
def _varint_len(x):
    L = 1
    while x >= 128:
        x >>= 7
        L += 1
    return L


@kernel
def _mag_cost(h, tot, end, ovf_bits):
    """Estimated bits of the cheapest magnitude coding of a |step|-1 histogram of ``tot`` steps
    whose bins from ``end`` on are empty (but the overflow bin)."""
    if tot == h[0]:
        return 0.0
    s = 0.0
    for i in range(end):
        s += i * h[i]
    mean = s / tot
    best = 1e300
    m0 = max(1, int(mean * 0.69 + 0.5))
    for mm in (max(1, m0 // 2), max(1, m0 - 1), m0, m0 + 1, m0 * 2, 1):
        b, cut = golomb_params(mm)
        c = 8.0 * _varint_len(mm)
        q = 0  # golomb_len of i, without a division per bin: i = q * mm + r
        r = 0
        for i in range(end):
            if h[i]:
                if q >= QMAX:
                    c += h[i] * (47 + bitlen(i))
                elif mm == 1:
                    c += h[i] * (q + 1)
                else:
                    c += h[i] * (q + 1 + (b - 1 if r < cut else b))
            r += 1
            if r == mm:
                r = 0
                q += 1
        c += h[HIST_BINS - 1] * 60.0
        best = min(best, c)
    info = np.zeros(end)  # per bin, its count times log2 of its share (computed once, not per T)
    for i in range(end):
        if h[i]:
            info[i] = h[i] * np.log2(h[i] / tot)
    for T in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        c = 8.0 * (_varint_len(T) + 1.5 * T)
        esc = h[HIST_BINS - 1]
        for i in range(T - 1, end):
            esc += h[i]
        for i in range(min(T - 1, end)):
            if h[i]:
                c -= info[i]
        if esc:
            c -= esc * np.log2(esc / tot)
            for i in range(T - 1, end):
                if h[i]:
                    c += h[i] * (6 + _BITLEN[i - (T - 1)])
            c += h[HIST_BINS - 1] * 6 + ovf_bits
        best = min(best, c)
        if esc == 0:
            break
    return best


@kernel
def plan_classes(exps, ne, ke, hist, ovf_bits, class_bits, max_span):
    """Dynamic program over the sorted active exponents: split them into contiguous classes
    minimising estimated bits, plus ``class_bits`` per class with changes (what a class costs the
    decoder, in bits' worth). Returns (total bits, start index of the segment ending at j)."""
    E = exps.size
    best = np.full(E + 1, 1e300)
    best[0] = 0.0
    arg = np.zeros(E + 1, np.int64)
    h = np.zeros(HIST_BINS, np.int64)
    ends = np.zeros(E, np.int64)  # per exponent, past its last non-empty bin (but the overflow bin)
    for t in range(E):
        for b in range(HIST_BINS - 1):
            if hist[exps[t], b]:
                ends[t] = b + 1
    for j in range(1, E + 1):
        n = 0
        k = 0
        ob = 0
        end = 0
        h[:] = 0
        for i in range(j, 0, -1):  # segment exps[i-1 .. j-1]
            e = exps[i - 1]
            n += ne[e]
            k += ke[e]
            ob += ovf_bits[e]
            end = max(end, ends[i - 1])
            for b in range(ends[i - 1]):
                h[b] += hist[e, b]
            h[HIST_BINS - 1] += hist[e, HIST_BINS - 1]
            if k == 0:
                c = 0.0
            else:
                ev = min(k, n - k)
                c = _h2bits(n, k) + 0.04 * ev + 8.0 * (4 + _varint_len(ev) + (_varint_len(k) if k > n - k else 0))
                c += _mag_cost(h, k, end, ob) + k + class_bits  # + sign bits
            if best[i - 1] + c < best[j]:
                best[j] = best[i - 1] + c
                arg[j] = i - 1
            if j - i >= max_span - 1:
                break
    return best[E], arg


@kernel
def enc_walk(
    u,
    v,
    lut,
    dense,
    row_len,
    n_rows,
    mant_bits,
    skip_dead,
    sign,
    full,
    ev_buf,
    ev_cls,
    val_buf,
    val_cls,
    at_out,
    row_alive,
    walked,
):
    """One pass over the elements: per row whether it changed (``row_alive``); the rows walked
    (every row, or the changed ones with ``skip_dead``) give, in natural order, each class's event
    gaps and signed steps with their class (``ev_cls``, ``val_cls``), each change's position
    (``at_out``), and per class its elements walked (``walked``; class K = ``walked.size - 1``:
    the elements of no class). Returns (events, changes); -1 when a buffer is full, -2 when a
    change falls in no class (the plan missed its exponent)."""
    K1 = walked.size
    K = K1 - 1
    last = np.full(K1, -1, np.int64)
    walked[:] = 0
    code = np.empty(lut.size, np.int64)  # lut with 1 << 16 added for a dense class: one load decides
    for e in range(lut.size):
        code[e] = lut[e] | (np.int64(dense[lut[e]]) << 16)
    ne = 0
    nv = 0
    n = u.size
    for r in range(n_rows):
        s = r * row_len
        e_ = min(s + row_len, n)
        i = s
        while i < e_ and u[i] == v[i]:
            i += 1
        row_alive[r] = i < e_
        if skip_dead and i == e_:
            continue
        i = s
        while i < e_:
            while i < e_ and u[i] == v[i]:  # a run of unchanged elements of sparse classes: no events
                c = code[np.int64(u[i]) >> mant_bits]
                if c >> 16:
                    break
                walked[c] += 1
                i += 1
            if i == e_:
                break
            x = u[i]
            y = v[i]
            c = lut[np.int64(x) >> mant_bits]
            rk = walked[c]
            walked[c] = rk + 1
            if x != y:
                if c == K:
                    return -2, -2
                if nv >= val_buf.size:
                    return -1, -1
                if not dense[c]:
                    if ne >= ev_buf.size:
                        return -1, -1
                    ev_buf[ne] = rk - last[c] - 1
                    ev_cls[ne] = c
                    ne += 1
                    last[c] = rk
                val_buf[nv] = _key(y, sign, full) - _key(x, sign, full)
                val_cls[nv] = c
                at_out[nv] = i
                nv += 1
            elif dense[c]:
                if ne >= ev_buf.size:
                    return -1, -1
                ev_buf[ne] = rk - last[c] - 1
                ev_cls[ne] = c
                ne += 1
                last[c] = rk
            i += 1
    return ne, nv


@kernel
def by_class(buf, cls, count, n_classes, out, slot):
    """``buf[:count]`` grouped by class (``cls``), in order within each class, into ``out``;
    ``slot[j]``: where entry j went. Returns each class's count."""
    counts = np.zeros(n_classes, np.int64)
    for j in range(count):
        counts[cls[j]] += 1
    at = np.zeros(n_classes, np.int64)
    for c in range(1, n_classes):
        at[c] = at[c - 1] + counts[c - 1]
    for j in range(count):
        c = cls[j]
        out[at[c]] = buf[j]
        slot[j] = at[c]
        at[c] += 1
    return counts


@kernel
def changes_by_position(at, slot, vals, row_len):
    """Per change in element order (``at``: its position, ``slot``: its index in ``vals``): its
    row, its column and whether its step is negative (no division: the rows only grow)."""
    rows = np.empty(at.size, np.int64)
    cols = np.empty(at.size, np.int64)
    negative = np.empty(at.size, np.bool_)
    r = 0
    s = 0
    for j in range(at.size):
        while at[j] >= s + row_len:
            s += row_len
            r += 1
        rows[j] = r
        cols[j] = at[j] - s
        negative[j] = vals[slot[j]] < 0
    return rows, cols, negative


@kernel
def packed_flips(vals, slot, predicted):
    """The flips of ``vals`` against a sign model's ``predicted`` negative steps (per change in
    element order; ``slot``: its index in ``vals``), packed 8 to a byte in ``vals`` order, LSB
    first, and the histogram of their 4-bit groups; ``vals`` is negated in place where the
    prediction is negative (what the decoder negates back)."""
    n = vals.size
    for j in range(slot.size):  # a store every time: a conditional one is a branch, mispredicted half the time
        s = slot[j]
        x = vals[s]
        vals[s] = -x if predicted[j] else x
    out = np.zeros((n + 7) // 8, np.uint8)
    for j in range(n >> 3):  # whole bytes built in a register
        byte = 0
        for t in range(8):
            byte |= np.int64(vals[8 * j + t] < 0) << t
        out[j] = byte
    for i in range(n & ~7, n):
        out[i >> 3] |= np.uint8(vals[i] < 0) << np.uint8(i & 7)
    groups = np.zeros(16, np.int64)
    for b in out:
        groups[b & 15] += 1
        groups[b >> 4] += 1
    return out, groups


#: golomb_best_m costs its candidates on at most about this many of the values (evenly spread):
#: the cost is flat near its minimum, so a sample picks the same parameter or a neighbour.
GOLOMB_SAMPLE = 1 << 12
_COST_HIST = 128  # golomb_best_m costs the values below this through their histogram


@inline
def _golomb_cheapest(hist, big, hint):
    """Among the Golomb parameters of a few factors of ``hint``: the one that codes the values
    counted in ``hist`` (value x at hist[x]) and those listed in ``big`` in the fewest bits
    (the first of equals); and those bits."""
    best = -1
    best_m = 1
    for f in (0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6):
        m = max(1, int(hint * f + 0.5))
        b, cut = golomb_params(m)
        L = 0
        for x in range(hist.size):
            if hist[x]:
                L += hist[x] * golomb_len(x, m, b, cut)
        for x in big:
            L += golomb_len(x, m, b, cut)
        if best < 0 or L < best:
            best, best_m = L, m
    return best_m, best


@kernel
def golomb_best_m(g, m_hint):
    """The Golomb parameter (among a few around the hint) that codes g in the fewest bits, costed on
    at most about GOLOMB_SAMPLE of its values; and its bits on those values. The values below
    _COST_HIST are costed through their histogram (one code length per value, not per element)."""
    step = max(1, g.size // GOLOMB_SAMPLE)
    hist = np.zeros(_COST_HIST, np.int64)
    n_big = 0
    for i in range(0, g.size, step):
        if g[i] < _COST_HIST:
            hist[g[i]] += 1
        else:
            n_big += 1
    big = np.empty(n_big, np.int64)  # the rest, one by one
    j = 0
    if n_big:  # mostly none: no second pass then
        for i in range(0, g.size, step):
            if g[i] >= _COST_HIST:
                big[j] = g[i]
                j += 1
    return _golomb_cheapest(hist, big, m_hint)


@kernel
def write_bits(buf, row_ev, row_m, ev, ev_off, n_events, cls_m, vals, val_off, n_class_changes, mag_mode, mag_m, mag_T):
    """The bitstream: row gaps, each class's event gaps, then each class's magnitudes (Golomb
    codes, or the escape payloads of rANS-coded ones). Returns its length in bits."""
    acc, nacc, w = np.uint64(0), np.uint64(0), np.uint64(0)  # the writer's state (bitio.put)
    if row_ev.size:
        b, cut = golomb_params(row_m)
        for x in row_ev:
            acc, nacc, w = golomb_write(buf, acc, nacc, w, x, row_m, b, cut)
    K = ev_off.size
    for c in range(K):
        m = cls_m[c]
        b, cut = golomb_params(m)
        for j in range(ev_off[c], ev_off[c] + n_events[c]):
            acc, nacc, w = golomb_write(buf, acc, nacc, w, ev[j], m, b, cut)
    for c in range(K):
        if mag_mode[c] == 1:
            m = mag_m[c]
            b, cut = golomb_params(m)
            for j in range(val_off[c], val_off[c] + n_class_changes[c]):
                d = vals[j]
                acc, nacc, w = golomb_write(buf, acc, nacc, w, (d if d > 0 else -d) - 1, m, b, cut)
        elif mag_mode[c] == 2:
            T = mag_T[c]
            for j in range(val_off[c], val_off[c] + n_class_changes[c]):
                d = vals[j]
                mg = (d if d > 0 else -d) - 1
                if mg >= T - 1:
                    x = mg - (T - 1)
                    L = bitlen(x)
                    acc, nacc, w = put(buf, acc, nacc, w, L, 6)
                    acc, nacc, w = put_long(buf, acc, nacc, w, x, L)
    nbits = np.int64(w) * 64 + np.int64(nacc)
    if nacc:
        buf[w] = acc
    return nbits


@inline
def _rans_put(x, w, out, f, cum):
    """One rANS encoding step (state x, symbol of frequency f and cumulative frequency cum),
    renormalising into out[w - 1] downwards; returns (x, w)."""
    fs = np.uint64(f)
    if x >= (fs << np.uint64(20)):
        w -= 1
        out[w] = np.uint16(x & np.uint64(0xFFFF))
        x >>= np.uint64(16)
    return ((x // fs) << np.uint64(SCALE_BITS)) + (x % fs) + np.uint64(cum), w


@inline
def _rans_flush(x, w, out):
    """Store the final state below out[w] (low word first in decoding order); returns the new w."""
    out[w - 1] = np.uint16(x >> np.uint64(16))
    out[w - 2] = np.uint16(x & np.uint64(0xFFFF))
    return w - 2


@kernel
def rans_encode(vals, val_off, n_class_changes, mag_mode, mag_T, freqs, freq_off, out):
    """Encode the table-mode magnitudes in reverse; returns the number of uint16 words written at
    the END of out (out[size-nw:] holds them in decoding order, the final state first)."""
    x = np.uint64(RANS_L)
    w = out.size
    K = val_off.size
    cum = np.zeros(MAX_T + 1, np.int64)
    for c in range(K - 1, -1, -1):
        if mag_mode[c] != 2:
            continue
        T = mag_T[c]
        f = freqs[freq_off[c] : freq_off[c] + T]
        cum[0] = 0
        for s in range(T):
            cum[s + 1] = cum[s] + f[s]
        for j in range(val_off[c] + n_class_changes[c] - 1, val_off[c] - 1, -1):
            d = vals[j]
            s = (d if d > 0 else -d) - 1
            if s > T - 1:
                s = T - 1
            x, w = _rans_put(x, w, out, f[s], cum[s])
    return out.size - _rans_flush(x, w, out)


@kernel
def flip_byte_freqs(f4):
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


@kernel
def rans_encode_bytes(syms, freqs, out):
    """Encode byte symbols (flip bits of predicted signs, eight per symbol) as one rANS stream
    with one table of 256, in reverse; returns the number of uint16 words written at the END of
    out, as rans_encode."""
    x = np.uint64(RANS_L)
    w = out.size
    cum = np.zeros(257, np.int64)
    for s in range(256):
        cum[s + 1] = cum[s] + freqs[s]
    for j in range(syms.size - 1, -1, -1):
        s = syms[j]
        x, w = _rans_put(x, w, out, freqs[s], cum[s])
    return out.size - _rans_flush(x, w, out)


TABLE_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the rANS table sizes the encoder tries
_HIST_CAP = 2 * 64  # magnitudes from here on are escaped by every table


@inline
def _numpy_sum(a, n):
    """a[:n].sum() (n <= 128) added in numpy's order (8 interleaved partial sums from 8 elements
    on), so that the encoder's choices match its numpy reference bit for bit."""
    if n < 8:
        s = 0.0
        for i in range(n):
            s += a[i]
        return s
    r = np.empty(8)
    for k in range(8):
        r[k] = a[k]
    i = 8
    while i < n - n % 8:
        for k in range(8):
            r[k] += a[i + k]
        i += 8
    s = (r[0] + r[1]) + (r[2] + r[3]) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        s += a[i]
        i += 1
    return s


@kernel
def quantize_freqs(counts):
    """Frequencies summing to SCALE, every present symbol >= 1 (largest counts adjusted first)."""
    c = counts.astype(np.float64)
    tot = c.sum()
    f = np.zeros(c.size, np.int64)
    for i in range(c.size):
        if c[i] > 0:
            f[i] = max(1, int(np.floor(c[i] * SCALE / tot)))
    diff = SCALE - f.sum()
    order = np.argsort(-c, kind="mergesort")
    i = 0
    while diff != 0:
        s = order[i % order.size]
        if c[s] > 0:
            if diff > 0:
                f[s] += 1
                diff -= 1
            elif f[s] > 1:
                f[s] -= 1
                diff += 1
        i += 1
    return f


@kernel
def magnitude_code(mags):
    """The cheapest coding of a class's magnitudes (|step| - 1, not all 0): (1, Golomb parameter,
    no table) or (2, rANS table size T, its frequencies), T escaping magnitudes >= T - 1."""
    n = mags.size
    hist = np.zeros(_HIST_CAP, np.int64)
    n_big = 0
    total = 0
    mx = 0
    for x in mags:
        total += x
        mx = max(mx, x)
        if x < _HIST_CAP:
            hist[x] += 1
        else:
            n_big += 1
    big = np.empty(n_big, np.int64)
    j = 0
    for x in mags:
        if x >= _HIST_CAP:
            big[j] = x
            j += 1
    # Golomb: the parameter (among a few around 0.69 x the mean) with the fewest bits
    best_m, best_gl = _golomb_cheapest(hist, big, max(1.0, 0.69 * (total / n)))
    best_bits = float(best_gl + 8 * _varint_len(best_m))
    mode, param = 1, best_m
    table = np.zeros(0, np.int64)
    terms = np.empty(64)
    for T in TABLE_SIZES:
        counts = np.zeros(T, np.int64)
        for x in range(T - 1):
            counts[x] = hist[x]
        esc_bits = 0
        for x in range(T - 1, _HIST_CAP):
            counts[T - 1] += hist[x]
            esc_bits += hist[x] * (6 + bitlen(x - (T - 1)))
        for x in big:
            counts[T - 1] += 1
            esc_bits += 6 + bitlen(x - (T - 1))
        f = quantize_freqs(counts)
        k = 0
        for s in range(T):
            if counts[s] > 0:
                terms[k] = counts[s] * np.log2(f[s] / SCALE)
                k += 1
        bits = -_numpy_sum(terms, k)
        if counts[T - 1]:
            bits += esc_bits
        overhead = _varint_len(T)
        for s in range(T):
            overhead += _varint_len(f[s])
        bits += 8 * overhead
        if bits < best_bits:
            best_bits, mode, param, table = bits, 2, T, f
        if T - 1 > mx:
            break
    return mode, param, table
