"""Codec v2's ULP body, parsed and validated in one kernel before anything of its size is allocated,
and decoded into the layout the walk (or the select apply) reads."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import sign_model
from .decode_kernels import SENTINEL, dec_flips, dec_streams
from .jit import inline, kernel
from .wire import FLAG_SIGN_MODEL, FLIP_STREAMS, MAX_T, SCALE


class UlpLayout(NamedTuple):
    """What :func:`parse_ulp` tells its caller about the arrays it left in the scratch (offsets
    are into the int64 scratch unless they say u8)."""

    need_i64: int  #: status 2: int64 scratch the payload needs
    need_u8: int  #: status 2: uint8 scratch the payload needs
    dense_first: int  #: internal id of the first dense class (n_sparse + 1)
    walk_row_len: int  #: row length the walk steps by (n_elements when there are no row flags)
    n_sparse: int  #: sparse classes (internal ids 0..n_sparse-1; n_sparse is "no class")
    n_classes: int  #: K
    n_event_slots: int  #: every class's events plus one sentinel each: ev = i64[:n_event_slots]
    n_changed: int  #: vals = i64[n_event_slots:n_event_slots + n_changed]
    n_rows: int  #: rows of the row flags (u8[:n_rows]); 0 without row flags
    lut_at: int  #: the class lookup table, then cnt, evp, vp, vend, evend
    predict: int  #: 1 if the signs are predicted (docs/FORMAT.md, "Predicted signs")
    table_at: int  #: the sign model's 64-entry prediction table
    row_len: int  #: row_len of the payload (the sign model's column count)
    codes_at_u8: int  #: the sign model's row codes, then its column codes, in the u8 scratch


#: :class:`UlpLayout` as the one-record array :func:`parse_ulp` writes by field name.
LAYOUT = np.dtype([(name, np.int64) for name in UlpLayout._fields])


@inline
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


@kernel
def _sign_codes(p, codes_at, width, n_rows, row_len, rc, cc):
    """Each row's and each column's codes (``width`` = rank * bits bits, LSB first) of a sign
    model section (docs/FORMAT.md, "Predicted signs"): rc[:n_rows], cc[:row_len]."""
    _unpack_codes(p, codes_at * 8, width, rc)
    _unpack_codes(p, (codes_at + (n_rows * width + 7) // 8) * 8, width, cc)


@inline
def _unpack_codes(p, at, width, out):
    """out[i] = the ``width``-bit (<= 6) field at bit at + i * width of p (LSB first)."""
    mask = (1 << width) - 1
    last = p.size - 1
    for i in range(out.size):
        b = at >> 3
        two = np.int64(p[b]) | (np.int64(p[min(b + 1, last)]) << 8)  # a field spans at most 2 bytes
        out[i] = (two >> (at & 7)) & mask
        at += width


@kernel
def parse_ulp(p, pos, n, exp_bits, max_mag, flags, i64s, u8s, layout):
    """Parse and validate a ULP body (p[pos:]) for a tensor of n elements and decode its streams
    into the caller's scratch (i64s, u8s). Returns 1 (ready: layout[0] describes the scratch for
    the pass, see UlpLayout), 2 (scratch too small: layout[0]'s need_i64 and need_u8, all
    validated), 0 (nothing changed) or a negative error code. ``flags`` are the payload header's (FLAG_SIGN_MODEL: predicted signs).
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
    n_row_events = 0
    row_m = 1
    if row_mode:
        n_row_events, pos = _rv(p, pos, n_rows)
        row_m, pos = _rv(p, pos, 1 << 40)
        if pos < 0 or row_m < 1:
            return -22
    K, pos = _rv(p, pos, E)
    if pos < 0:
        return -23
    cls_lo = np.empty(K, np.int64)
    cls_hi = np.empty(K, np.int64)
    dense = np.zeros(K, np.bool_)
    n_events = np.zeros(K, np.int64)
    n_class_changes = np.zeros(K, np.int64)
    cls_m = np.ones(K, np.int64)
    mag_mode = np.zeros(K, np.int64)
    mag_m = np.zeros(K, np.int64)  # mode 1: the Golomb parameter of |step| - 1
    mag_T = np.zeros(K, np.int64)  # mode 2: the rANS table's size
    freq_off = np.zeros(K, np.int64)
    freqs = np.zeros(K * MAX_T + 1, np.int64)
    fo = 0
    prev_hi = -1
    sum_events = 0
    sum_changes = 0
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
        n_events[c], pos = _rv(p, pos, n)
        if dense[c]:
            n_class_changes[c], pos = _rv(p, pos, n)
        else:
            n_class_changes[c] = n_events[c]
        cls_m[c], pos = _rv(p, pos, 1 << 40)
        if pos < 0 or cls_m[c] < 1 or n_class_changes[c] < 1:
            return -26
        if mag_mode[c] == 1:
            mag_m[c], pos = _rv(p, pos, 1 << 40)
            if pos < 0 or mag_m[c] < 1:
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
            mag_T[c] = T
            freq_off[c] = fo
            fo += T
            n_tables += 1
        sum_events += n_events[c]
        sum_changes += n_class_changes[c]
        if sum_events > n or sum_changes > n:
            return -29
    if sum_changes != n_changed:
        return -29
    nbits, pos = _rv(p, pos, np.int64(8) * p.size)
    if pos < 0:
        return -30
    nbytes_bits = (nbits + 7) // 8
    n_sign = (n_changed + 7) // 8
    model = (flags & FLAG_SIGN_MODEL) != 0
    # every gap code takes at least one bit, every change one raw sign bit: counts are bounded by
    # the payload's own length as well as by n before anything of their size is allocated
    if nbytes_bits + (0 if model else n_sign) > p.size - pos or sum_events + n_row_events > nbits:
        return -30
    bits_at = pos
    pos += nbytes_bits
    signs = p[pos : pos + n_sign]
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
    n_ev = sum_events + K
    need64 = n_ev + 1 + n_changed + 1 + 6 * (K + 1) + 2 * E + 64 + (64 if model else 0)
    signs_at = (n_rows if row_mode else 0) + 1
    codes_at8 = signs_at + n_sign + 8
    need8 = codes_at8 + n_rows + row_len if model else signs_at
    out = layout[0]
    if need64 > i64s.size or need8 > u8s.size:
        if model:  # the flip streams' length bounds no count (a byte can hold many flips): they must
            # decode to exactly n_changed signs before the caller allocates for that many changes
            err = dec_flips(p, fl_at, fl_len, fl_freqs, n_sign, np.empty(n_sign, np.uint8))
            if err:
                return err
        out.need_i64 = need64
        out.need_u8 = need8
        return 2
    words = np.zeros(nbytes_bits // 8 + 5, np.uint64)  # little-endian words (x86_64, aarch64)
    words.view(np.uint8)[:nbytes_bits] = p[bits_at : bits_at + nbytes_bits]
    rans = np.empty(rans_len // 2, np.uint16)
    rans.view(np.uint8)[:] = p[pos : pos + rans_len]
    ev_off = np.zeros(K + 1, np.int64)
    val_off = np.zeros(K + 1, np.int64)
    for c in range(K):
        ev_off[c + 1] = ev_off[c] + n_events[c] + 1
        val_off[c + 1] = val_off[c] + n_class_changes[c]
    ev = i64s[:n_ev]
    vals = i64s[n_ev : n_ev + n_changed]
    row_dead = u8s[:n_rows] if row_mode else u8s[:1]
    row_dead[:] = 0
    table_at = n_ev + n_changed + 1 + 2 * E + 5 * (K + 1)
    if model:
        _sign_codes(
            p,
            codes_at,
            sm_rank * sm_bits,
            n_rows,
            row_len,
            u8s[codes_at8 : codes_at8 + n_rows],
            u8s[codes_at8 + n_rows : codes_at8 + n_rows + row_len],
        )
        sign_model.prediction_table(
            p[lv_at : lv_at + (4 * sm_rank if sm_bits == 2 else 0)],
            sm_rank,
            sm_bits,
            i64s[table_at : table_at + 64].view(np.uint64),
        )
        signs = u8s[signs_at : signs_at + n_sign]  # dec_flips writes every byte
        err = dec_flips(p, fl_at, fl_len, fl_freqs, n_sign, signs)
        if err:
            return err
    err = dec_streams(
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
    )
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
    lut = i64s[o_ : o_ + 2 * E]  # indexed by the old element's bits >> mantissa bits (sign included)
    o_ += 2 * E
    cnt = i64s[o_ : o_ + K + 1]
    evp = i64s[o_ + K + 1 : o_ + 2 * (K + 1)]
    vp = i64s[o_ + 2 * (K + 1) : o_ + 3 * (K + 1)]
    vend = i64s[o_ + 3 * (K + 1) : o_ + 4 * (K + 1)]
    evend = i64s[o_ + 4 * (K + 1) : o_ + 5 * (K + 1)]
    lut[:] = S
    for c in range(K):
        lut[cls_lo[c] : cls_hi[c] + 1] = iid[c]
        lut[E + cls_lo[c] : E + cls_hi[c] + 1] = iid[c]
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
    out.dense_first = D
    out.walk_row_len = row_len if row_mode != 0 else max(n, 1)  # no row flags: one long row (cheaper loop)
    out.n_sparse = S
    out.n_classes = K
    out.n_event_slots = n_ev
    out.n_changed = n_changed
    out.n_rows = n_rows if row_mode != 0 else 0
    out.lut_at = lut_at
    out.predict = 1 if model else 0
    out.table_at = table_at
    out.row_len = row_len
    out.codes_at_u8 = codes_at8
    return 1


ERRORS = {
    -1: "bad row gap",
    -2: "row past the end",
    -3: "bad position gap",
    -4: "bad rANS state",
    -5: "bad magnitude",
    -6: "rANS stream too short",
    -7: "bad magnitude escape",
    -8: "rANS stream not fully used",
    -9: "bitstream length disagrees",
    -10: "more values than a class holds",
    -11: "a value leaves the dtype's range",
    -12: "a class's events or values were not all used",
    -20: "bad counts or row length",
    -21: "unknown row mode",
    -22: "bad row flags",
    -23: "too many classes",
    -24: "bad class range",
    -25: "unknown class flags",
    -26: "bad class counts",
    -27: "bad magnitude parameter",
    -28: "bad frequency table",
    -29: "class counts disagree with the total",
    -30: "streams longer than the payload or counts above them",
    -31: "bad rANS stream length",
    -32: "inconsistent empty delta",
    -33: "bad sign model",
    -34: "bad flip stream",
}
