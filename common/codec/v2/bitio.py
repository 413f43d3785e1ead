"""Codec v2's bitstream: LSB-first bits in 64-bit words, and the Golomb codes written into it."""

from __future__ import annotations

import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

from .jit import inline
from .wire import QMAX


@inline
def peek(words, pos):
    """64 bits of the LSB-first bitstream starting at bit ``pos`` >= 0 (words are zero padded).
    Indices are unsigned here and in the other hot loops: numba then skips its negative-index
    wraparound code."""
    w = np.uint64(pos) >> np.uint64(6)
    s = np.uint64(pos) & np.uint64(63)
    return (words[w] >> s) | ((words[w + np.uint64(1)] << (np.uint64(63) - s)) << np.uint64(1))


@inline
def golomb_read(words, pos, m, b, cutoff):
    """(value, new_pos); new_pos < 0 on a malformed code."""
    win = peek(words, pos)
    if win == 0:
        return 0, -1
    q = trailing_zeros(win)
    if q > QMAX:
        return 0, -1
    if q == QMAX:
        pos += QMAX + 1
        L = np.int64(peek(words, pos) & np.uint64(63))
        pos += 6
        if L > 62:
            return 0, -1
        x = np.int64(peek(words, pos) & ((np.uint64(1) << np.uint64(L)) - np.uint64(1)))
        return x, pos + L
    pos += q + 1
    if m == 1:
        return np.int64(q), pos
    if q + b < 64:  # the remainder is in the same window
        win = win >> np.uint64(q + 1)
    else:
        win = peek(words, pos)
    x, k = _golomb_rest(win, q, m, b, cutoff)
    return x, pos + k


@inline
def _golomb_rest(rest, q, m, b, cutoff):
    """(value, remainder bits) of a code with quotient q (m > 1) whose remainder starts at bit 0
    of ``rest``. Truncated binary without a branch (taken about half the time, so a branch
    mispredicts often): v >= cutoff reads one more bit t, and the value is then
    cutoff + 2 (v - cutoff) + t."""
    v = np.int64(rest & ((np.uint64(1) << np.uint64(b - 1)) - np.uint64(1)))
    long_ = np.int64(v >= cutoff)
    t = np.int64((rest >> np.uint64(b - 1)) & np.uint64(1))
    return q * m + v + long_ * (v - cutoff + t), b - 1 + long_


@inline
def golomb_next(words, pos, win, avail, m, b, cutoff):
    """:func:`golomb_read` from a window: ``win`` holds the stream's next ``avail`` bits (from
    bit ``pos``), and a code that fits in them is decoded by shifting it out, without a load on
    the chain from one code to the next; anything else (a code that straddles the window, an
    escape, a malformed code) goes through :func:`golomb_read` and a new window. Returns
    (value, new_pos, win, avail); new_pos < 0 on a malformed code, as there."""
    q = np.int64(trailing_zeros(win))  # 64 when the window is all zeros
    if q + b + 1 >= avail or q >= QMAX:  # (>=: the shift below stays under 64)
        x, pos = golomb_read(words, pos, m, b, cutoff)
        if pos < 0:
            return x, pos, win, avail
        return x, pos, peek(words, pos), np.int64(64)
    if m == 1:
        L = q + 1
        x = q
    else:
        x, k = _golomb_rest(win >> np.uint64(q + 1), q, m, b, cutoff)
        L = q + 1 + k
    return x, pos + L, win >> np.uint64(L), avail - L


@inline
def golomb_params(m):
    """(b, cutoff) of the Golomb code with parameter m: b = ceil(log2 m), cutoff = 2^b - m."""
    b = 0
    while (np.int64(1) << b) < m:
        b += 1
    return b, (np.int64(1) << b) - m


@inline
def put(buf, acc, nacc, w, val, nb_):
    """Append the low nb_ (<= 57) bits of val to a writer whose state is (acc: the pending bits,
    nacc: how many, w: the next word of buf); returns the new state. The state lives in locals,
    not in an array: stores to buf (also uint64) would force the compiler to reload it."""
    if nb_ == 0:
        return acc, nacc, w
    val = np.uint64(val)
    acc |= val << nacc
    nacc += np.uint64(nb_)
    if nacc >= np.uint64(64):
        buf[w] = acc
        w += np.uint64(1)
        nacc -= np.uint64(64)
        acc = (val >> (np.uint64(nb_) - nacc)) if nacc > np.uint64(0) else np.uint64(0)
    return acc, nacc, w


@inline
def bitlen(x):
    L = 0
    while (np.int64(1) << L) <= x and L < 63:
        L += 1
    return L


@inline
def put_long(buf, acc, nacc, w, x, L):
    if L > 32:
        acc, nacc, w = put(buf, acc, nacc, w, x & 0xFFFFFFFF, 32)
        return put(buf, acc, nacc, w, x >> 32, L - 32)
    return put(buf, acc, nacc, w, x, L)


@inline
def golomb_write(buf, acc, nacc, w, x, m, b, cutoff):
    """Append x's Golomb code (parameter m, with b and cutoff from :func:`golomb_params`); the
    writer's state in and out as in :func:`put`. A code of up to 57 bits is one put."""
    q = x // m
    if q >= QMAX:
        acc, nacc, w = put(buf, acc, nacc, w, 0, 40)
        acc, nacc, w = put(buf, acc, nacc, w, 1, 1)
        L = bitlen(x)
        acc, nacc, w = put(buf, acc, nacc, w, L, 6)
        return put_long(buf, acc, nacc, w, x, L)
    if m == 1:
        return put(buf, acc, nacc, w, np.int64(1) << q, q + 1)
    r = x - q * m
    if r < cutoff:
        rest, nb = r, b - 1
    else:
        v = cutoff + (r - cutoff) // 2
        rest, nb = v | (((r - cutoff) & 1) << (b - 1)), b
    if q + 1 + nb <= 57:
        return put(buf, acc, nacc, w, (np.int64(1) << q) | (rest << (q + 1)), q + 1 + nb)
    acc, nacc, w = put(buf, acc, nacc, w, np.int64(1) << q, q + 1)
    return put(buf, acc, nacc, w, rest, nb)


@inline
def golomb_len(x, m, b, cutoff):
    q = x // m
    if q >= QMAX:
        return 47 + bitlen(x)
    if m == 1:
        return q + 1
    r = x - q * m
    return q + 1 + (b - 1 if r < cutoff else b)
