"""Predicted signs for codec v2 ULP payloads: a low-rank model of a matrix's step signs.

Why (benchmarks/README.md, "Predicted signs"): one step of Adam moves a weight matrix along its
momentum, and the momentum of a linear layer is a sum of outer products (output error x input
activation), dominated by a few of them. So the *signs* of a step's changes follow a low-rank
pattern: sign(W[i, j] step) ~ sign(sum_t a[i, t] b[j, t]) for a few row factors ``a`` and column
factors ``b``. With 1-3 factors of 1-2 bits per entry, 65-85% of the signs of a Qwen2-style
matrix at lr 1e-5 agree with the prediction, and coding each sign as agree/disagree
(an entropy-coded "flip" bit, see :mod:`delta_swap.codec.v2`) instead of a raw bit saves ~4% of
the payload there. The model is stateless: it needs nothing but the payload itself.

This module is the model: fitting it (encoder, numpy), its bytes in the payload, and the integer
prediction both sides compute. A row's codes (``rank * bits`` <= 6 bits) and a column's take at
most 64 values each, so the decoder tabulates the prediction once per payload: bit ``y`` of
``table[x]`` says whether row codes ``x`` and column codes ``y`` predict a negative step
(:func:`prediction_table`), and predicting a change costs one shift (:func:`predicted_negative`).
The wire format is in docs/FORMAT.md ("Predicted signs").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .jit import inline, kernel

MAX_RANK = 3  # a row's or a column's codes fit in 6 bits: the prediction is one table bit
ROW_ALIGN = 64  # rows must be a whole number of 64-element words (the select apply's unit)
MIN_CHANGES = 4096  # fewer changes do not pay for the factors
LEVEL_MAX = 255
_OVERSAMPLE = 4  # MAX_RANK + _OVERSAMPLE <= 8: _times's columns
_POWER_ITERATIONS = 1
_REFINE_STEPS = 4  # rows, columns, rows, columns
#: Below this many changes per row and column of a matrix, the one-bit model is fitted beside the
#: two-bit one (its side bytes are 1/6 as many: it wins on small or sparse steps).
SMALL_STEP_CHANGES = 16
#: With a :class:`FitMemory`, at most this many fits in a row start from the matrix's last model
#: (its codes refined on the new signs) instead of a new SVD; the next one fits from scratch.
#: Adam moves a matrix along its momentum, so one step's sign pattern is most of the next one's:
#: on the RL corpora at lr 1e-5 the refined model costs ~0.5% more sign bits than a fresh fit, in
#: ~0.45x of its time (benchmarks/README.md, "Encoder levels").
WARM_FITS = 7
#: With a :class:`FitMemory`, after a new fit finds no model that pays, this many fits in a row
#: return None at once (raw sign bits) before the next one tries again: a matrix whose changes'
#: signs show no pattern at one step mostly shows none at the next, and the randomized SVD that
#: finds that out is most of such a matrix's encode (benchmarks/README.md, "Encoder levels").
IDLE_FITS = 3


@dataclass(frozen=True)
class SignModel:
    """Factors as codes and integer levels: element (i, j) is predicted negative when the sum
    over t of value(row_codes[i, t]) * value(col_codes[j, t]) is below 0 (docs/FORMAT.md)."""

    rank: int
    bits: int  # 1: entries +-1 (rank 1 only); 2: entries +-lo or +-hi
    levels: np.ndarray  # (rank, 4) uint8: row lo, row hi, col lo, col hi (bits == 2)
    row_codes: np.ndarray  # (n_rows, rank) uint8 codes: bit 0 negative, bit 1 high level
    col_codes: np.ndarray  # (row_len, rank)

    @classmethod
    def checked(
        cls, rank: int, bits: int, levels: np.ndarray, row_codes: np.ndarray, col_codes: np.ndarray
    ) -> SignModel:
        """A model from stored fields (an encoder's memory kept on disk), each checked against
        what :func:`fit` makes: ValueError for anything else (codes out of range would index
        outside the kernels' tables)."""
        if not (1 <= rank <= MAX_RANK and bits in (1, 2) and (bits == 2 or rank == 1)):
            raise ValueError(f"a sign model of rank {rank} with {bits} bits per entry")
        fields = (levels, row_codes, col_codes)
        if any(not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 2 for a in fields):
            raise ValueError("a sign model's fields are 2-d uint8 arrays")
        n_rows, row_len = row_codes.shape[0], col_codes.shape[0]
        if levels.shape != (rank, 4) or row_codes.shape[1] != rank or col_codes.shape[1] != rank:
            raise ValueError("a sign model's fields disagree on its rank")
        if n_rows < 2 or row_len % ROW_ALIGN or not row_len:
            raise ValueError(f"no sign model fits a {n_rows} x {row_len} matrix")
        if int(row_codes.max(initial=0)) >> bits or int(col_codes.max(initial=0)) >> bits:
            raise ValueError(f"a sign model's codes exceed {bits} bits")
        return cls(rank, bits, levels.copy(), row_codes.copy(), col_codes.copy())

    @property
    def shape(self) -> tuple[int, int]:
        """The (n_rows, row_len) of the matrix it models."""
        return self.row_codes.shape[0], self.col_codes.shape[0]

    def to_bytes(self) -> bytes:
        """The model's bytes in a payload: model byte, levels, row codes, column codes."""
        out = bytearray([(self.bits << 4) | self.rank])
        if self.bits == 2:
            out += self.levels.astype(np.uint8).tobytes()
        return bytes(out) + _pack(self.row_codes, self.bits) + _pack(self.col_codes, self.bits)


@dataclass
class FitMemory:
    """What :func:`fit` keeps of one matrix (one tensor part) from one call to the next: the model
    it returned last, and how many fits in a row started from a previous model. Encoder-side
    only: every payload still carries its whole model, and the decoder needs nothing else."""

    model: SignModel | None = None
    warm_fits: int = 0
    #: Fits still to skip (no model) since a new fit found none that pays: see IDLE_FITS.
    idle_fits: int = 0


def _pack(codes: np.ndarray, bits: int) -> bytes:
    """Entries in row-major order, ``bits`` each, LSB first."""
    flat = codes.reshape(-1).astype(np.uint8)
    planes = flat[:, None] >> np.arange(bits, dtype=np.uint8) & 1
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def section_size(n_rows: int, row_len: int, rank: int, bits: int) -> int:
    """Bytes of a model's section (what :meth:`SignModel.to_bytes` writes)."""
    return 1 + (4 * rank if bits == 2 else 0) + (n_rows * rank * bits + 7) // 8 + (row_len * rank * bits + 7) // 8


def _int_levels(levels: np.ndarray) -> np.ndarray:
    """Real levels (any positive scale) as integers 1..255 of the same ratios."""
    top = float(levels.max())
    if not top > 0:
        return np.ones(levels.shape, np.uint8)
    return np.clip(np.rint(LEVEL_MAX * levels / top), 1, LEVEL_MAX).astype(np.uint8)


@kernel
def _two_bit(x):
    """A factor vector as 2-bit codes (sign, above the median magnitude) and its two levels."""
    mag = np.abs(x)
    cut = np.median(mag)
    codes = np.empty(x.size, np.uint8)
    lo_sum, hi_sum, n_hi = 0.0, 0.0, 0
    for i in range(x.size):
        high = mag[i] > cut
        codes[i] = (x[i] < 0) | (high << 1)
        if high:
            hi_sum += mag[i]
            n_hi += 1
        else:
            lo_sum += mag[i]
    n_lo = x.size - n_hi
    lo = lo_sum / n_lo if n_lo else cut
    hi = hi_sum / n_hi if n_hi else lo
    return codes, lo, hi


@kernel
def _times(rows, cols, negative, x, n_out):
    """S @ x for the sparse sign matrix S (entry -1 where ``negative[i]``, else +1, at (rows[i],
    cols[i])) and x of at most 8 columns; S.T @ x with rows and cols swapped. Where ``rows``
    ascend (S @ x: the changes in element order) a row's sums stay in registers until its run
    of changes ends, instead of a store and a reload per change; any order is correct."""
    k = x.shape[1]
    xp = np.zeros((x.shape[0], 8))
    xp[:, :k] = x
    out = np.zeros((n_out, 8))
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    r0 = rows[0] if rows.size else 0
    for i in range(rows.size + 1):
        if i == rows.size or rows[i] != r0:
            out[r0, 0] += a0
            out[r0, 1] += a1
            out[r0, 2] += a2
            out[r0, 3] += a3
            out[r0, 4] += a4
            out[r0, 5] += a5
            out[r0, 6] += a6
            out[r0, 7] += a7
            if i == rows.size:
                break
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
            r0 = rows[i]
        c = cols[i]
        s = 1.0 - 2.0 * negative[i]
        a0, a1, a2, a3 = a0 + s * xp[c, 0], a1 + s * xp[c, 1], a2 + s * xp[c, 2], a3 + s * xp[c, 3]
        a4, a5, a6, a7 = a4 + s * xp[c, 4], a5 + s * xp[c, 5], a6 + s * xp[c, 6], a7 + s * xp[c, 7]
    return out[:, :k].copy()


def _top_factors(
    shape: tuple[int, int], rows: np.ndarray, cols: np.ndarray, negative: np.ndarray, rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank-``rank`` factors (u * sqrt(s), v * sqrt(s)) of the sparse sign matrix by a seeded
    randomized SVD, and their singular values s; every product runs over the changes only."""
    n_rows, row_len = shape
    rng = np.random.default_rng(0)
    q = _times(rows, cols, negative, rng.standard_normal((row_len, rank + _OVERSAMPLE)), n_rows)
    for _ in range(_POWER_ITERATIONS):
        q, _ = np.linalg.qr(q)
        q = _times(rows, cols, negative, _times(cols, rows, negative, q, row_len), n_rows)
    q, _ = np.linalg.qr(q)
    u, s, vt = np.linalg.svd(_times(cols, rows, negative, q, row_len).T, full_matrices=False)
    root = np.sqrt(s[:rank])
    return (q @ u[:, :rank]) * root, vt[:rank].T * root, s[:rank]


def _flip_bits(flips: int, n: int) -> float:
    """Bits to code n flip bits of which ``flips`` are set (ideal, i.i.d.; plus the table)."""
    p = min(max(flips / n, 1e-9), 1 - 1e-9)
    return n * -(p * np.log2(p) + (1 - p) * np.log2(1 - p)) + 8 * 20


def _joined(codes: np.ndarray, bits: int) -> np.ndarray:
    """(n, rank) codes as one code per row or column: factor t at bit t * bits."""
    return (codes.astype(np.int64) << (bits * np.arange(codes.shape[1]))).sum(1)


def _split(joined: np.ndarray, rank: int, bits: int) -> np.ndarray:
    return ((joined[:, None] >> (bits * np.arange(rank))) & ((1 << bits) - 1)).astype(np.uint8)


@kernel
def _sign_balance(major, minor, minor_codes, negative, n_major, n_codes):
    """(n_major, n_codes): per row (or column) and codes of the column (or row), its negative
    changes minus its positive ones."""
    out = np.zeros((n_major, n_codes), np.int32)  # integer adds: 3x faster than float ones here
    for i in range(major.size):
        out[major[i], minor_codes[minor[i]]] += 2 * np.int32(negative[i]) - 1  # no branch: signs are coin flips
    return out


@kernel
def _most_agreeing(balance, agree):
    """Per row i of ``balance``: the code x with the largest sum over k of balance[i, k] *
    agree[k, x] (0/1 entries; the first of equals, as numpy's argmax). Four k at a time: one
    load and store of the sums per four, not per k (a chain through memory otherwise)."""
    n_k, n_codes = agree.shape
    mask = np.empty((n_k, n_codes), np.int32)  # b & mask == b * agree: no multiply
    for k in range(n_k):
        for x in range(n_codes):
            mask[k, x] = -np.int32(agree[k, x] != 0)
    out = np.empty(balance.shape[0], np.int64)
    acc = np.empty(n_codes, np.int32)
    k4 = n_k - n_k % 4
    for i in range(balance.shape[0]):
        acc[:] = 0
        for k in range(0, k4, 4):
            b0, b1, b2, b3 = balance[i, k], balance[i, k + 1], balance[i, k + 2], balance[i, k + 3]
            for x in range(n_codes):
                acc[x] += (b0 & mask[k, x]) + (b1 & mask[k + 1, x]) + (b2 & mask[k + 2, x]) + (b3 & mask[k + 3, x])
        for k in range(k4, n_k):
            b = balance[i, k]
            for x in range(n_codes):
                acc[x] += b & mask[k, x]
        top = acc[0]
        for x in range(1, n_codes):
            top = max(top, acc[x])
        best = 0
        while acc[best] != top:
            best += 1
        out[i] = best
    return out


@kernel
def _predict(rows, cols, rc, cc, words):
    """Per change, whether the model (joined codes rc, cc; prediction table words) predicts a
    negative step."""
    out = np.empty(rows.size, np.bool_)
    for i in range(rows.size):
        out[i] = (words[rc[rows[i]]] >> np.uint64(cc[cols[i]])) & np.uint64(1)
    return out


def _refine(model: SignModel, rows: np.ndarray, cols: np.ndarray, negative: np.ndarray) -> tuple[SignModel, np.ndarray]:
    """Better codes for the same levels: every row takes the codes that agree with most of its
    changes' signs given the columns' codes, then every column given the rows' (exact, through
    the prediction table, in numba: numpy's products would run on BLAS threads, 30-50x slower
    while other processes load the cores); a few rounds. Only the columns' codes need a start
    (the SVD's, which fits the signs' values, not their agreement). Returns the model and its
    predictions."""
    n_codes = 1 << (model.rank * model.bits)
    words = np.zeros(64, np.uint64)
    prediction_table(model.levels.reshape(-1), model.rank, model.bits, words)
    table = ((words[:n_codes, None] >> np.arange(n_codes, dtype=np.uint64)) & np.uint64(1)).astype(np.int32)
    by_column = np.ascontiguousarray(table.T)  # [y, x]: column codes y and row codes x predict a negative step
    rc, cc = _joined(model.row_codes, model.bits), _joined(model.col_codes, model.bits)
    n_rows, row_len = model.row_codes.shape[0], model.col_codes.shape[0]
    # agreement of codes x = (changes) + sum over the other side's codes y of balance[y] * T[x, y],
    # up to a constant: every candidate code of every row (column) at once
    for step in range(_REFINE_STEPS):
        if step % 2 == 0:
            rc_before, rc = rc, _most_agreeing(_sign_balance(rows, cols, cc, negative, n_rows, n_codes), by_column)
            if step and np.array_equal(rc, rc_before):
                break  # a fixed point: further steps give the same codes
        else:
            cc_before, cc = cc, _most_agreeing(_sign_balance(cols, rows, rc, negative, row_len, n_codes), table)
            if np.array_equal(cc, cc_before):
                break
    refined = SignModel(
        model.rank, model.bits, model.levels, _split(rc, model.rank, model.bits), _split(cc, model.rank, model.bits)
    )
    return refined, _predict(rows, cols, rc, cc, words)


def fit(
    shape: tuple[int, int],
    rows: np.ndarray,
    cols: np.ndarray,
    negative: np.ndarray,
    memory: FitMemory | None = None,
) -> tuple[SignModel, np.ndarray] | None:
    """A sign model of a matrix's changes, or None when raw sign bits are cheaper: one factor of
    one bit per entry where the signs show one pattern, else as many factors as the shape allows
    (up to MAX_RANK) of two bits, or the one-bit model where it is cheaper on a matrix with few
    changes per row and column.

    ``shape`` is the matrix's (n_rows, row_len); ``rows`` and ``cols`` are the changed elements'
    coordinates, ``negative`` whether each step is negative. Returns the model and, per changed
    element, whether it predicts a negative step. With a ``memory`` of the same matrix's last
    step, the fit starts from its model while that still pays (at most WARM_FITS times in a row),
    a matrix where a new fit found no model is left with raw signs for IDLE_FITS calls, and the
    memory keeps what this call returns."""
    n = rows.size
    n_rows, row_len = shape
    if n < MIN_CHANGES or row_len % ROW_ALIGN or n_rows < 2:
        return None
    if memory is None:
        return _fit_new(shape, rows, cols, negative)
    last = memory.model
    if last is None and memory.idle_fits > 0:  # the last new fit found no pattern: raw signs for now
        memory.idle_fits -= 1
        return None
    if last is not None and memory.warm_fits < WARM_FITS and last.shape == (n_rows, row_len):
        model, predicted = _refine(last, rows, cols, negative)
        if _model_bits(model, predicted, negative) < n - 8 * 64.0:  # it still saves 64 bytes
            memory.model, memory.warm_fits = model, memory.warm_fits + 1
            return model, predicted
    fitted = _fit_new(shape, rows, cols, negative)
    memory.model, memory.warm_fits = (fitted[0] if fitted else None), 0
    memory.idle_fits = 0 if fitted else IDLE_FITS
    return fitted


def _model_bits(model: SignModel, predicted: np.ndarray, negative: np.ndarray) -> float:
    """The bits of the signs under ``model``: its flips and its own section."""
    n_rows, row_len = model.shape
    flips = int(np.count_nonzero(predicted != negative))
    return _flip_bits(flips, negative.size) + 8 * section_size(n_rows, row_len, model.rank, model.bits)


def _fit_new(
    shape: tuple[int, int], rows: np.ndarray, cols: np.ndarray, negative: np.ndarray
) -> tuple[SignModel, np.ndarray] | None:
    """:func:`fit` from scratch: a seeded randomized SVD of the signs, then its codes refined."""
    n = rows.size
    n_rows, row_len = shape
    a, b, s = _top_factors(shape, rows, cols, negative, min(MAX_RANK, n_rows, row_len))
    noise = np.sqrt(n / n_rows) + np.sqrt(n / row_len)  # the top singular value of random signs, about
    if s[0] < noise:
        # no pattern to predict (random signs on the same changes: 0.86-0.89 of it; >= 1.15
        # wherever a model paid on the RL corpora)
        return None
    one_bit = SignModel(
        1, 1, np.ones((1, 4), np.uint8), np.zeros((n_rows, 1), np.uint8), (b[:, :1] < 0).astype(np.uint8)
    )
    starts = [one_bit]  # one pattern: one bit per row and column
    if s[1] >= noise:  # more: two bits per entry, as many factors as the shape allows (benchmarks/README.md)
        rank = a.shape[1]
        cc, lv = [], np.zeros((rank, 4))
        for t in range(rank):
            _, lv[t, 0], lv[t, 1] = _two_bit(a[:, t])
            code, lv[t, 2], lv[t, 3] = _two_bit(b[:, t])
            cc.append(code)
        levels = np.concatenate([_int_levels(lv[:, :2]), _int_levels(lv[:, 2:])], axis=1)
        two_bit = SignModel(rank, 2, levels, np.zeros((n_rows, rank), np.uint8), np.stack(cc, 1))
        starts = [two_bit, one_bit] if n < SMALL_STEP_CHANGES * (n_rows + row_len) else [two_bit]
    best_bits, best = n - 8 * 64.0, None  # a model must save 64 bytes
    for start in starts:
        model, predicted = _refine(start, rows, cols, negative)  # it sets every row's codes first
        bits = _model_bits(model, predicted, negative)
        if bits < best_bits:
            best_bits, best = bits, (model, predicted)
    return best


@kernel
def prediction_table(levels, rank, bits, out):
    """out[x] (64 uint64): bit y set when row codes x and column codes y (``rank`` fields of
    ``bits`` bits, factor t at bit t * bits) predict a negative step. ``levels``: the section's
    (rank, 4) level bytes (row lo, row hi, col lo, col hi; unused for bits 1)."""
    mask = (1 << bits) - 1
    n_codes = 1 << (rank * bits)
    rows = np.empty((rank, n_codes), np.int32)  # the entries' values, per factor and code
    cols = np.empty((rank, n_codes), np.int32)
    for t in range(rank):
        for x in range(n_codes):
            f = (x >> (t * bits)) & mask
            a = 1 if bits == 1 else np.int32(levels[4 * t + (f >> 1)])
            b = 1 if bits == 1 else np.int32(levels[4 * t + 2 + (f >> 1)])
            rows[t, x] = -a if f & 1 else a
            cols[t, x] = -b if f & 1 else b
    acc = np.empty(n_codes, np.int32)  # |sum| <= 3 * 255 * 255: int32 is exact
    out[:] = 0
    for x in range(n_codes):
        acc[:] = 0
        for t in range(rank):
            a = rows[t, x]
            for y in range(n_codes):  # vectorises
                acc[y] += a * cols[t, y]
        word = np.uint64(0)
        for y in range(n_codes):
            word |= np.uint64(acc[y] < 0) << np.uint64(y)
        out[x] = word


@inline
def predicted_negative(row_table, col_code):
    """0 or 1: the prediction at a column with codes ``col_code``, in a row whose table word is
    ``row_table`` (``table[row codes]``)."""
    return np.int64((row_table >> np.uint64(col_code)) & np.uint64(1))
