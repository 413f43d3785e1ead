"""Codec round trips over dtypes, shapes and change densities (v2, and v1 where still written),
stored v1 payloads that must keep decoding bit-exact, and rejection of crafted payloads."""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delta_swap import codec
from delta_swap.checksum import checksum
from delta_swap.codec import v1, v2
from delta_swap.codec.v2 import bitio, samples, wire
from delta_swap.dtypes import DTYPE_SIZES
from delta_swap.errors import ConfigError, CorruptDataError
from tests.support import codec_fixtures

V1 = codec.CodecConfig(version=1)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _pair(rng: np.random.Generator, dtype: str, n: int, density: float, small: bool) -> tuple[np.ndarray, np.ndarray]:
    width = DTYPE_SIZES[dtype]
    old = rng.integers(0, 256, size=n * width, dtype=np.uint8)
    new = old.copy()
    k = int(n * density)
    idx = rng.choice(n, size=k, replace=False) if k else np.zeros(0, dtype=np.int64)
    elems = new.view(_UINT[width])
    if small:  # mantissa-only nudges, as RL updates do
        elems[idx] ^= rng.integers(1, 4, size=k).astype(elems.dtype)
    else:
        elems[idx] = rng.integers(0, 255, size=k).astype(elems.dtype) * elems.dtype.type(
            0x0101010101010101 % (1 << (8 * width))
        )
    return old, new


def _weights(
    rng: np.random.Generator,
    dtype: str,
    shape: tuple[int, ...],
    frac: float,
    dead_rows: float = 0.0,
    max_step: int = 1,
    sign_rank: int = 0,
    agree: float = 0.8,
    pattern_seed: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Weight-like floats and an RL-like step: ``frac`` of the elements move by 1..max_step ULPs,
    small ones more often; rows in ``dead_rows`` never change. With ``sign_rank`` the steps'
    signs follow a random rank-``sign_rank`` pattern (as a momentum's outer products do; the same
    one for the same ``pattern_seed``), each with probability ``agree``; otherwise they are fair
    coins."""
    import torch

    tdtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dtype]
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    w = (torch.randn(shape, generator=gen) * 0.02).to(tdtype)
    old = w.reshape(-1).view({2: torch.uint16, 4: torch.uint32}[DTYPE_SIZES[dtype]]).numpy().copy()
    n = old.size
    mag = np.abs(w.float().reshape(-1).numpy())
    p = np.clip(frac * np.median(mag) / np.maximum(mag, 1e-8), 0, 1)
    changed = rng.random(n) < p
    if dead_rows and len(shape) >= 2:
        dead = rng.random(n // shape[-1]) < dead_rows
        changed &= ~np.repeat(dead, shape[-1])
    bits = 8 * old.itemsize
    sign = 1 << (bits - 1)
    key = np.where(old.astype(np.int64) & sign, (1 << bits) - 1 - old.astype(np.int64), old.astype(np.int64) | sign)
    signs = rng.choice([-1, 1], n)
    if sign_rank:
        factors = rng if pattern_seed is None else np.random.default_rng(pattern_seed)
        pattern = factors.standard_normal((shape[0], sign_rank)) @ factors.standard_normal((sign_rank, n // shape[0]))
        signs = np.where(
            rng.random(n) < agree, np.where(pattern.reshape(-1) < 0, -1, 1), -np.where(pattern.reshape(-1) < 0, -1, 1)
        )
    steps = rng.integers(1, max_step + 1, n) * signs
    key = np.where(changed, key + steps, key)
    new = np.where(key & sign, key ^ sign, (1 << bits) - 1 - key).astype(old.dtype)
    return old.view(np.uint8), new.view(np.uint8)


# ------------------------------------------------------------------------------ round trips


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(sorted(DTYPE_SIZES)),
    n=st.integers(0, 5000),
    density=st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]),
    small=st.booleans(),
    version=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32 - 1),
)
def test_delta_round_trip_is_bit_exact(
    dtype: str, n: int, density: float, small: bool, version: int, seed: int
) -> None:
    old, new = _pair(np.random.default_rng(seed), dtype, n, density, small)
    config = codec.CodecConfig(version=version)
    shape = (n // 500, 500) if n >= 1000 and n % 500 == 0 else (n,)
    payload = codec.encode_tensor_delta(old, new, dtype, config, shape=shape)
    assert codec.payload_version(payload) == version
    assert np.array_equal(codec.decode(old, payload, dtype, new.size), new)
    full = codec.encode_tensor_delta(None, new, dtype, config)
    assert codec.payload_method(full) == "full"
    assert np.array_equal(codec.decode(None, full, dtype, new.size), new)
    assert np.array_equal(codec.decode_tensor_delta(None, full, dtype), new)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("frac", [0.0, 0.002, 0.03, 0.1, 0.6])
@pytest.mark.parametrize("max_step", [1, 40, 5000])
def test_v2_weight_like_round_trips(rng, dtype: str, frac: float, max_step: int) -> None:
    shape = (48, 512)
    old, new = _weights(rng, dtype, shape, frac, dead_rows=0.5, max_step=max_step)
    for s in (shape, None):
        payload = codec.encode_tensor_delta(old, new, dtype, codec.CodecConfig(dense_fraction=2.0), shape=s)
        assert payload[:4] == b"DSC2" and codec.payload_method(payload) == "delta"
        assert np.array_equal(codec.decode(old, payload, dtype, old.size), new)
        out = old.copy()
        codec.decode_into(out, payload, dtype)
        assert np.array_equal(out, new)


@pytest.mark.parametrize("spread", [1, 7, 300, 40_000])
def test_v2_gap_codes_of_every_length_round_trip(rng, spread: int) -> None:
    """Position gaps from 0 to ~2**22 in one class, so that Golomb codes from 1 to ~45 bits (and
    escapes) start at every offset of the decoder's 64-bit window and straddle its end."""
    n = 1 << 22
    old = np.full(n, 0x3C00, np.uint16)  # one exponent: one class
    gaps = np.minimum(rng.geometric(1 / spread, 4000), n)
    gaps[::97] = rng.integers(1 << 18, 1 << 21, gaps[::97].size)  # long codes among short ones
    pos = np.cumsum(gaps)
    pos = pos[pos < n]
    new = old.copy()
    new[pos] += rng.integers(1, 3, pos.size).astype(np.uint16)
    payload = codec.encode_tensor_delta(
        old.view(np.uint8), new.view(np.uint8), "BF16", codec.CodecConfig(dense_fraction=2.0)
    )
    assert np.array_equal(codec.decode(old.view(np.uint8), payload, "BF16", 2 * n), new.view(np.uint8))


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("n", [0, 1, 2, 7])
@pytest.mark.parametrize("pattern", ["none", "all", "one"])
def test_v2_tiny_tensors(rng, dtype: str, n: int, pattern: str) -> None:
    width = DTYPE_SIZES[dtype]
    old = rng.integers(0, 256, n * width, dtype=np.uint8)
    new = old.copy()
    elems = new.view(_UINT[width])
    if pattern == "all":
        elems ^= elems.dtype.type(1)
    elif pattern == "one" and n:
        elems[n // 2] ^= elems.dtype.type(3)
    payload = codec.encode_tensor_delta(old, new, dtype, codec.CodecConfig(dense_fraction=2.0))
    assert np.array_equal(codec.decode(old, payload, dtype, old.size), new)


def _special(dtype: str) -> np.ndarray:
    """Zeros of both signs, the smallest subnormals, the largest finite values, infinities, NaNs
    (quiet, signalling, negative, with payload bits) and ordinary numbers of both signs."""
    width = DTYPE_SIZES[dtype]
    bits = 8 * width
    mant = {"BF16": 7, "F16": 10, "F32": 23}[dtype]
    sign = 1 << (bits - 1)
    inf = ((1 << (bits - 1 - mant)) - 1) << mant
    values = [
        0,
        sign,
        1,
        sign | 1,
        inf - 1,
        sign | (inf - 1),
        inf,
        sign | inf,
        inf | (1 << (mant - 1)),
        inf | 1,
        sign | inf | (1 << (mant - 1)),
        inf | ((1 << mant) - 1),
        (inf >> 1) & ~((1 << mant) - 1),
        sign | (inf >> 1),
    ]
    return np.array(values, dtype=np.uint64).astype(_UINT[width])


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_v2_special_values_huge_steps_and_sign_crossings(dtype: str) -> None:
    vals = _special(dtype)
    for shift in range(1, vals.size):
        old = vals.view(np.uint8).copy()
        new = np.roll(vals, shift).view(np.uint8).copy()  # every element jumps, many across signs, to NaN/Inf
        payload = codec.encode_tensor_delta(old, new, dtype, codec.CodecConfig(dense_fraction=2.0))
        assert codec.payload_method(payload) == "delta"
        assert np.array_equal(codec.decode(old, payload, dtype, old.size), new)
    tiled = np.tile(vals, 300)
    rng = np.random.default_rng(3)
    new = tiled.copy()
    idx = rng.choice(tiled.size, 200, replace=False)
    new[idx] = tiled[rng.permutation(idx)]
    payload = codec.encode_tensor_delta(
        tiled.view(np.uint8), new.view(np.uint8), dtype, codec.CodecConfig(dense_fraction=2.0)
    )
    assert np.array_equal(codec.decode(tiled.view(np.uint8), payload, dtype, new.nbytes), new.view(np.uint8))


def test_sparse_mantissa_changes_compress_far_below_raw(rng) -> None:
    old, new = _pair(rng, "BF16", 1_000_000, 0.015, small=True)
    payload = codec.encode_tensor_delta(old, new, "BF16")
    assert codec.payload_method(payload) == "delta"
    assert len(payload) < 0.02 * old.size  # ~1.5% of elements changed: well under 2% of the bytes
    assert np.array_equal(codec.decode(old, payload, "BF16", old.size), new)


def test_v2_is_smaller_than_v1_on_weight_like_deltas(rng) -> None:
    shape = (256, 1024)
    old, new = _weights(rng, "BF16", shape, 0.02, dead_rows=0.3, max_step=3)
    v1 = codec.encode_tensor_delta(old, new, "BF16", V1)
    v2 = codec.encode_tensor_delta(old, new, "BF16", shape=shape)
    v2_no_rows = codec.encode_tensor_delta(old, new, "BF16")
    assert len(v2) < 0.8 * len(v1)
    assert len(v2) < len(v2_no_rows)  # the dead-row flags pay for themselves
    assert np.array_equal(codec.decode(old, v2, "BF16", old.size), new)


# ------------------------------------------------------------------ plans from sampled rows


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _sampled_rows_case(rng, shape: tuple[int, int], what: str) -> tuple[np.ndarray, np.ndarray]:
    """A matrix planned from every SAMPLE_STEP-th row whose changes the sample misses: at
    exponents no sampled row holds, only in unsampled rows, or many more than the sample shows."""
    rows, cols = shape
    old = _bf16_bits(rng.standard_normal(shape) * 0.02)
    new = old.copy()
    unsampled = np.flatnonzero(np.arange(rows) % v2.encoder.SAMPLE_STEP)
    if what == "exponents outside the sample":
        old[unsampled, :8] = _bf16_bits(rng.choice([-1.0, 1.0], (unsampled.size, 8)) * 1e-30)
        new[unsampled, :8] = old[unsampled, :8] + 1  # tiny weights, one ULP each
        new[::7, 100] = old[::7, 100] + 1  # and a few changes at common exponents, sampled rows too
    elif what == "no change in the sample":
        new[unsampled, 5] = old[unsampled, 5] ^ 1
    else:  # "more changes than the sample shows"
        new[0, :4] = old[0, :4] ^ 1
        new[unsampled] = old[unsampled] ^ rng.integers(1, 3, (unsampled.size, cols)).astype(np.uint16)
    return old.reshape(-1), new.reshape(-1)


@pytest.mark.parametrize(
    "what", ["exponents outside the sample", "no change in the sample", "more changes than the sample shows"]
)
def test_plans_from_sampled_rows_still_code_every_change(rng, what: str) -> None:
    """The class plan of a large matrix comes from a sample of its rows; the changes it did not
    see (rare exponents, unsampled rows, more of them than expected) are still coded exactly."""
    shape = (v2.encoder.SAMPLE_MIN_ROWS * 2, 256)
    old, new = _sampled_rows_case(rng, shape, what)
    assert not np.array_equal(old, new)
    for level in (1, 2):
        payload = codec.encode_tensor_delta(
            old.view(np.uint8), new.view(np.uint8), "BF16", codec.CodecConfig(level=level), shape=shape
        )
        assert codec.payload_method(payload) == "delta"
        assert np.array_equal(codec.decode(old.view(np.uint8), payload, "BF16", old.nbytes), new.view(np.uint8))


def test_sampled_plans_cost_little_payload(rng, monkeypatch) -> None:
    """Planning from every SAMPLE_STEP-th row instead of every row gives nearly the same payload
    on weight-like steps (measured on the RL corpora: 0.2-0.5% larger; benchmarks/README.md)."""
    shape = (512, 1024)
    old, new = _weights(rng, "BF16", shape, 0.1, dead_rows=0.1, max_step=3)
    sampled = codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(level=1), shape=shape)
    monkeypatch.setattr(v2.encoder, "SAMPLE_MIN_ROWS", 1 << 40)
    exact = codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(level=1), shape=shape)
    assert sampled != exact  # the plan did come from the sample
    assert len(sampled) < 1.01 * len(exact)
    for payload in (sampled, exact):
        assert np.array_equal(codec.decode(old, payload, "BF16", old.size), new)


def test_dense_tensors_fall_back_to_a_full_payload(rng) -> None:
    old, new = _pair(rng, "BF16", 20_000, 1.0, small=False)
    payload = codec.encode_tensor_delta(old, new, "BF16")
    assert codec.payload_method(payload) == "full"
    assert np.array_equal(codec.decode(old, payload, "BF16", old.size), new)


# ------------------------------------------------------------------------------ predicted signs


def _walk_only(monkeypatch) -> None:
    monkeypatch.setattr(v2.select_apply, "AVAILABLE", False)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("sign_rank", [1, 3])
@pytest.mark.parametrize("apply", ["select", "walk"])
def test_predicted_signs_round_trip_and_shrink_the_payload(
    rng, monkeypatch, dtype: str, sign_rank: int, apply: str
) -> None:
    """Steps whose signs follow a low-rank pattern (80% of them) get a sign model (header flag 1):
    bit-exact through both apply paths, in place too, and smaller than raw sign bits."""
    if apply == "walk":
        _walk_only(monkeypatch)
    shape = (128, 512) if sign_rank == 1 else (384, 512)  # more factors pay only for more changes
    old, new = _weights(rng, dtype, shape, 0.2, dead_rows=0.2, max_step=3, sign_rank=sign_rank)
    n_changed = int(np.count_nonzero(old.view(_UINT[DTYPE_SIZES[dtype]]) != new.view(_UINT[DTYPE_SIZES[dtype]])))
    assert n_changed >= v2.sign_model.MIN_CHANGES
    payload = codec.encode_tensor_delta(old, new, dtype, codec.CodecConfig(dense_fraction=2.0), shape=shape)
    assert payload[6] == v2.FLAG_SIGN_MODEL
    assert np.array_equal(codec.decode(old, payload, dtype, old.size), new)
    out = old.copy()
    codec.decode_into(out, payload, dtype)
    assert np.array_equal(out, new)
    monkeypatch.setattr(v2.sign_model, "fit", lambda *args: None)
    raw = codec.encode_tensor_delta(old, new, dtype, codec.CodecConfig(dense_fraction=2.0), shape=shape)
    assert raw[6] == 0 and np.array_equal(codec.decode(old, raw, dtype, old.size), new)
    # the signs' ideal saving at 80% agreement is 28% of their bits; 2-bit factors of a rank-3
    # pattern predict it less well than one bit per row and column does a rank-1 pattern
    assert len(raw) - len(payload) > (0.15 if sign_rank == 1 else 0.05) * n_changed / 8


@pytest.fixture
def new_fits(monkeypatch) -> list[tuple[int, int]]:
    """The shape of every new sign-model fit (not a refinement) made while the test runs."""
    fits: list[tuple[int, int]] = []
    fit_new = v2.sign_model._fit_new
    monkeypatch.setattr(v2.sign_model, "_fit_new", lambda shape, *args: fits.append(shape) or fit_new(shape, *args))
    return fits


def test_encoder_memory_starts_each_fit_from_the_last_steps_model(rng, new_fits) -> None:
    """With an EncoderMemory, a matrix's next step refines the sign model of its last one instead
    of a new SVD, at most WARM_FITS times in a row, for payloads that decode the same and are as
    small; a memory of another shape, or a last model that no longer pays, gets a new fit."""
    sm = v2.sign_model
    shape = (384, 512)
    config = codec.CodecConfig(dense_fraction=2.0)
    memory = codec.EncoderMemory()
    fitted_anew = []
    for _ in range(sm.WARM_FITS + 3):
        old, new = _weights(rng, "BF16", shape, 0.2, max_step=3, sign_rank=3, pattern_seed=7)
        before = len(new_fits)
        remembered = codec.encode_tensor_delta(old, new, "BF16", config, shape, memory.tensor("w"))
        fitted_anew.append(len(new_fits) > before)
        alone = codec.encode_tensor_delta(old, new, "BF16", config, shape)
        assert remembered[6] == alone[6] == v2.FLAG_SIGN_MODEL
        assert np.array_equal(codec.decode(old, remembered, "BF16", old.size), new)
        assert len(remembered) <= 1.01 * len(alone)
    assert fitted_anew == [True] + [False] * sm.WARM_FITS + [True, False]
    assert len(new_fits) == len(fitted_anew) + sum(fitted_anew)  # every encode without it fits anew

    new_fits.clear()  # another shape under the same name: a new fit
    old, new = _weights(rng, "BF16", (256, 512), 0.2, max_step=3, sign_rank=3, pattern_seed=7)
    payload = codec.encode_tensor_delta(old, new, "BF16", config, (256, 512), memory.tensor("w"))
    assert new_fits == [(256, 512)] and np.array_equal(codec.decode(old, payload, "BF16", old.size), new)
    new_fits.clear()  # signs that no longer follow the model: a new fit, which finds no pattern
    old, new = _weights(rng, "BF16", (256, 512), 0.2, max_step=3)
    payload = codec.encode_tensor_delta(old, new, "BF16", config, (256, 512), memory.tensor("w"))
    assert new_fits == [(256, 512)] and payload[6] == 0
    assert memory.tensor("w")[0].model is None
    assert np.array_equal(codec.decode(old, payload, "BF16", old.size), new)


def test_encoder_memory_skips_the_fits_after_one_that_found_no_pattern(rng, new_fits, tmp_path) -> None:
    """After a new fit finds no sign pattern, the next IDLE_FITS steps of that matrix keep raw sign
    bits without fitting (a pattern that appears meanwhile waits for the fit after them), and a
    saved memory keeps how many are left: every payload decodes to the step."""
    sm = v2.sign_model
    shape = (384, 512)
    config = codec.CodecConfig(dense_fraction=2.0)
    memory = codec.EncoderMemory()
    fitted, flags = [], []
    for step in range(sm.IDLE_FITS + 3):
        patterned = step >= 2  # random signs, then a pattern from the third step on
        old, new = _weights(
            rng, "BF16", shape, 0.2, max_step=3, **({"sign_rank": 3, "pattern_seed": 7} if patterned else {})
        )
        before = len(new_fits)
        payload = codec.encode_tensor_delta(old, new, "BF16", config, shape, memory.tensor("w"))
        fitted.append(len(new_fits) > before)
        flags.append(payload[6])
        assert np.array_equal(codec.decode(old, payload, "BF16", old.size), new)
        if step == 1:  # one skip spent: a memory saved now skips the rest
            memory.save(tmp_path / "memory.npz")
            loaded = codec.EncoderMemory.load(tmp_path / "memory.npz").tensor("w")[0]
            assert loaded.model is None and loaded.idle_fits == sm.IDLE_FITS - 1
    assert fitted == [True] + [False] * sm.IDLE_FITS + [True, False]
    assert flags == [0] * (sm.IDLE_FITS + 1) + [v2.FLAG_SIGN_MODEL] * 2


def test_encoder_memory_files_round_trip_and_refuse_what_fit_would_not_make(rng, tmp_path) -> None:
    """EncoderMemory.save/load keep every tensor part's model; a file whose models the kernels
    could not use (codes past their bits, fields of another rank, a shape no model fits) is
    refused with CorruptDataError, never handed to the encoder."""
    from delta_swap.errors import CorruptDataError

    shape = (384, 512)
    memory = codec.EncoderMemory()
    old, new = _weights(rng, "BF16", shape, 0.2, max_step=3, sign_rank=3, pattern_seed=3)
    codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(dense_fraction=2.0), shape, memory.tensor("w"))
    memory.tensor("unfitted")  # an entry without a model is not kept
    path = tmp_path / "memory.npz"
    memory.save(path)
    loaded = codec.EncoderMemory.load(path)
    kept, got = memory.tensor("w")[0].model, loaded.tensor("w")[0].model
    assert (got.rank, got.bits, got.shape) == (kept.rank, kept.bits, shape) and len(loaded) == 1
    assert all(
        np.array_equal(a, b)
        for a, b in zip(
            (got.levels, got.row_codes, got.col_codes), (kept.levels, kept.row_codes, kept.col_codes), strict=True
        )
    )
    arrays = dict(np.load(path))
    for field, bad in [
        ("r0", np.full_like(arrays["r0"], 1 << kept.bits)),  # codes past their bits
        ("c0", arrays["c0"][:, :1].copy()),  # a column's codes of another rank
        ("c0", arrays["c0"][:100].copy()),  # rows of 100 elements: not whole 64-element words
        ("l0", arrays["l0"].astype(np.int64)),
    ]:
        np.savez(path, **{**arrays, field: bad})
        with pytest.raises(CorruptDataError, match="not an encoder memory"):
            codec.EncoderMemory.load(path)
    index = json.loads(arrays["index"].tobytes())
    index["entries"][0][3] = float(index["entries"][0][3])  # a rank that is not an int
    np.savez(path, **{**arrays, "index": np.frombuffer(json.dumps(index).encode(), np.uint8)})
    with pytest.raises(CorruptDataError, match="malformed"):
        codec.EncoderMemory.load(path)
    for data in (b"", b"garbage", b"PK\x03\x04 truncated"):
        path.write_bytes(data)
        with pytest.raises(CorruptDataError, match="not an encoder memory"):
            codec.EncoderMemory.load(path)


def test_signs_without_a_pattern_stay_raw_bits(rng) -> None:
    shape = (128, 512)
    old, new = _weights(rng, "BF16", shape, 0.2, max_step=3)
    payload = codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(dense_fraction=2.0), shape=shape)
    assert payload[6] == 0 and np.array_equal(codec.decode(old, payload, "BF16", old.size), new)


def test_sign_model_products_sum_each_row_in_change_order(rng) -> None:
    """The SVD's sparse products (a row's sums held in registers while its changes run) give
    the sums of the changes in element order bit for bit where rows ascend, and the same sums,
    up to rounding, in any order (the transposed products)."""
    from delta_swap.codec.v2 import sign_model

    for n_rows, row_len, n, k in [(50, 64, 2000, 7), (7, 128, 500, 6), (1, 64, 10, 8), (30, 64, 0, 7)]:
        rows = np.sort(rng.integers(0, n_rows, n))
        cols = rng.integers(0, row_len, n)
        negative = rng.random(n) < 0.5
        x = rng.standard_normal((row_len, k))
        in_order = np.zeros((n_rows, k))
        for r, c, neg in zip(rows, cols, negative, strict=True):
            in_order[r] += (-1.0 if neg else 1.0) * x[c]
        assert np.array_equal(sign_model._times(rows, cols, negative, x, n_rows), in_order)
        shuffled = rng.permutation(n)
        any_order = sign_model._times(rows[shuffled], cols[shuffled], negative[shuffled], x, n_rows)
        np.testing.assert_allclose(any_order, in_order, atol=1e-9)


def test_sign_models_only_where_rows_are_whole_words(rng) -> None:
    """Rows of 500 elements (not a multiple of 64), one row or no shape: raw signs."""
    for shape, passed in (((128, 500), (128, 500)), ((1, 64000), (1, 64000)), ((128, 512), None)):
        old, new = _weights(rng, "BF16", shape, 0.2, sign_rank=1, agree=0.95)
        payload = codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(dense_fraction=2.0), shape=passed)
        assert payload[6] == 0 and np.array_equal(codec.decode(old, payload, "BF16", old.size), new)


def _model_payload(rng) -> tuple[np.ndarray, bytearray, int]:
    """(old, a sign-model payload, offset of its model byte)."""
    shape = (64, 512)
    old, new = _weights(rng, "BF16", shape, 0.15, max_step=1, sign_rank=2, agree=0.9)
    payload = bytearray(codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(dense_fraction=2.0), shape=shape))
    assert payload[6] == 1
    # locate the section as a decoder does: skip the header, the body's fields and the bitstream
    rd = wire.Reader(memoryview(bytes(payload)))
    rd.p = 7
    rd.varint(1 << 62, "n")
    rd.varint(1 << 62, "n_changed")
    rd.varint(1 << 62, "row_len")
    assert rd.u8() == 0  # no row flags
    for _ in range(rd.varint(256, "K")):
        rd.varint(256, "lo")
        rd.varint(256, "span")
        cflags = rd.u8()
        rd.varint(1 << 62, "events")
        if cflags & 1:
            rd.varint(1 << 62, "changes")
        rd.varint(1 << 62, "m")
        if cflags >> 1 == 1:
            rd.varint(1 << 62, "mag_m")
        elif cflags >> 1 == 2:
            for _ in range(rd.varint(64, "T")):
                rd.varint(4096, "f")
    rd.take((rd.varint(1 << 62, "nbits") + 7) // 8, "bits")
    return old, payload, rd.p


def test_crafted_sign_models_are_rejected(rng) -> None:
    old, payload, at = _model_payload(rng)
    codec.decode(old, bytes(payload), "BF16", old.size)
    rank, bits = payload[at] & 15, payload[at] >> 4
    crafted = {
        "unknown flag": (6, 2),
        "flag on a full payload": None,
        "rank 0": (at, bits << 4),
        "rank 5": (at, (bits << 4) | 5),
        "bits 3": (at, (3 << 4) | rank),
        "one bit with rank 2": (at, (1 << 4) | 2),
    }
    if bits == 2:
        crafted["level 0"] = (at + 1, 0)
    for what, edit in crafted.items():
        bad = bytearray(payload)
        if edit is None:
            bad = bytearray(codec.encode_full(np.zeros(8, np.uint8), "BF16"))
            bad[6] = 1
            target = np.zeros(8, np.uint8)
        else:
            bad[edit[0]] = edit[1]
            target = old
        with pytest.raises(CorruptDataError):
            codec.decode(target, bytes(bad), "BF16", target.size)
            pytest.fail(what)
    # cut anywhere inside the section or the streams after it: rejected, never a crash
    for cut in range(at, len(payload), max(1, (len(payload) - at) // 40)):
        with pytest.raises(CorruptDataError):
            codec.decode(old, bytes(payload[:cut]), "BF16", old.size)
    # the flag on a payload whose rows are not whole words is refused, whatever follows
    old500, new500 = _weights(rng, "BF16", (64, 500), 0.15, sign_rank=1, agree=0.95)
    raw = bytearray(
        codec.encode_tensor_delta(old500, new500, "BF16", codec.CodecConfig(dense_fraction=2.0), shape=(64, 500))
    )
    assert raw[6] == 0
    raw[6] = 1
    with pytest.raises(CorruptDataError, match="sign model"):
        codec.decode(old500, bytes(raw), "BF16", old500.size)


def test_damaged_flip_streams_are_caught(rng) -> None:
    """A flipped bit in the flip stream either fails the stream's own checks or rebuilds other
    bytes (which the manifest's checksum then rejects); it never crashes or goes out of range."""
    old, payload, _ = _model_payload(rng)
    good = codec.decode(old, bytes(payload), "BF16", old.size)
    verdicts = set()
    for i in range(len(payload) - 200, len(payload)):
        bad = bytearray(payload)
        bad[i] ^= 0x10
        try:
            verdicts.add(
                "other bytes" if not np.array_equal(codec.decode(old, bytes(bad), "BF16", old.size), good) else "same"
            )
        except CorruptDataError:
            verdicts.add("rejected")
    assert "rejected" in verdicts and "same" not in verdicts


def test_v2_kernels_release_the_gil() -> None:
    """apply_snapshot decodes tensors on threads: that only scales if the kernels drop the GIL."""
    import importlib
    import pkgutil

    modules = [importlib.import_module(f"{v2.__name__}.{m.name}") for m in pkgutil.iter_modules(v2.__path__)]
    kernels = [obj for module in modules for obj in vars(module).values() if hasattr(obj, "targetoptions")]
    kernels += list(v2.decode_kernels.WALKS.values())
    assert len(kernels) >= 10
    for kernel in kernels:
        assert kernel.targetoptions.get("nogil") is True, kernel


def test_decoding_on_threads_matches_serial(rng) -> None:
    from concurrent.futures import ThreadPoolExecutor

    cases = [_weights(rng, "BF16", (64, 512), frac) for frac in (0.01, 0.05, 0.2, 0.01)]
    payloads = [codec.encode_tensor_delta(a, b, "BF16", shape=(64, 512)) for a, b in cases]
    with ThreadPoolExecutor(4) as pool:
        outs = list(
            pool.map(lambda i: codec.decode(cases[i][0], payloads[i], "BF16", cases[i][0].size), [0, 1, 2, 3] * 5)
        )
    for i, out in enumerate(outs):
        assert np.array_equal(out, cases[i % 4][1])


def test_decoder_only_warm_up_decodes_its_stored_payloads() -> None:
    """Servers warm up without compiling the encoder: from payloads stored with codec v2, which
    must keep decoding to the tensors warm_up regenerates (else it raises)."""
    codec.warm_up(encoder=False)
    for dtype in v2.FLOATS:
        old, new = samples.tensors(dtype)
        assert (old != new).any()
    signs = samples.stored_payload("BF16 signs")  # the predicted-sign kernels are warmed up too
    old, new = samples.sign_tensors()
    assert signs[6] == v2.FLAG_SIGN_MODEL and np.array_equal(codec.decode(old, signs, "BF16", old.size), new)


def test_numba_cache_falls_back_to_a_temp_folder_when_nothing_else_is_writable(monkeypatch, tmp_path) -> None:
    import numba.core.config

    monkeypatch.setattr(numba.core.config, "CACHE_DIR", numba.core.config.CACHE_DIR)  # restored afterwards
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    monkeypatch.setattr(v2.jit.os, "access", lambda path, mode: False)  # a read-only install and home
    monkeypatch.setattr(v2.jit.tempfile, "gettempdir", lambda: str(tmp_path))
    v2.jit.ensure_cache_dir()
    assert numba.core.config.CACHE_DIR.startswith(str(tmp_path / "delta-swap-numba-"))
    monkeypatch.setattr(v2.jit.os, "access", lambda path, mode: True)  # a writable package folder
    numba.core.config.CACHE_DIR = ""
    v2.jit.ensure_cache_dir()
    assert numba.core.config.CACHE_DIR == ""


# ------------------------------------------------------------------------------ stored v1 payloads


@pytest.mark.parametrize("name", sorted(codec_fixtures.CASES))
def test_stored_v1_payloads_still_decode_bit_exact(name: str) -> None:
    dtype, old, new = codec_fixtures.reference(name)
    payload = (codec_fixtures.DATA / f"{name}.dsc1").read_bytes()
    assert payload[:4] == b"DSC1"
    expected_method = "full" if old is None else "delta"
    assert codec.payload_method(payload) == expected_method
    out = codec.decode(old, payload, dtype, new.size)
    assert np.array_equal(out, new)
    assert checksum(out) == codec_fixtures.expected()[name]
    if old is not None:
        buf = old.copy()
        codec.decode_into(buf, payload, dtype)
        assert np.array_equal(buf, new)
        assert np.array_equal(codec.decode_tensor_delta(old, payload, dtype), new)


@pytest.mark.parametrize("name", sorted(codec_fixtures.CASES))
def test_stored_v2_payloads_of_format_version_2_still_decode_bit_exact(name: str) -> None:
    """Payloads written before predicted signs (header flags 0) keep decoding, in place too."""
    dtype, old, new = codec_fixtures.reference(name)
    payload = (codec_fixtures.DATA_V2 / f"{name}.dsc2").read_bytes()
    assert payload[:4] == b"DSC2" and payload[6] == 0
    out = codec.decode(old, payload, dtype, new.size)
    assert np.array_equal(out, new) and checksum(out) == codec_fixtures.expected()[name]
    if old is not None:
        buf = old.copy()
        codec.decode_into(buf, payload, dtype)
        assert np.array_equal(buf, new)


# ------------------------------------------------------------------------------ crafted input


@pytest.fixture(params=[1, 2, "split"], ids=["v1", "v2", "v2-split"])
def sample(request, rng) -> tuple[np.ndarray, np.ndarray, bytes]:
    old, new = _weights(rng, "BF16", (40, 500), 0.03, max_step=20)
    if request.param == "split":  # parts of 10 rows each
        config = codec.CodecConfig(part_elements=5000)
        payload = codec.encode_tensor_delta(old, new, "BF16", config, shape=(40, 500))
        assert payload[4] == v2.METHOD_SPLIT
        return old, new, payload
    return old, new, codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(version=request.param))


def test_truncated_payloads_are_rejected(sample) -> None:
    old, _, payload = sample
    for cut in (0, 3, 4, 10, 23, 30, len(payload) // 2, len(payload) - 1):
        with pytest.raises(CorruptDataError):
            codec.decode(old, payload[:cut], "BF16", old.size)


def test_trailing_bytes_are_rejected(sample) -> None:
    old, _, payload = sample
    with pytest.raises(CorruptDataError):
        codec.decode(old, payload + b"\0", "BF16", old.size)


def test_bit_flips_never_crash_the_decoder(sample) -> None:
    """A flipped bit raises CorruptDataError or decodes to a tensor of the right size, whose
    checksum the reader then verifies; never another exception, a hang or a huge allocation."""
    old, new, payload = sample
    rejected = 0
    for byte in range(0, len(payload), max(1, len(payload) // 400)):
        for bit in (0, 3, 7):
            bad = bytearray(payload)
            bad[byte] ^= 1 << bit
            try:
                out = codec.decode(old, bytes(bad), "BF16", old.size)
            except CorruptDataError:
                rejected += 1
                continue
            assert out.size == new.size
    assert rejected > 0


def test_payload_for_another_dtype_or_size_is_rejected(sample) -> None:
    old, _, payload = sample
    with pytest.raises(CorruptDataError):
        codec.decode(old.view(np.uint8)[:-2].copy(), payload, "BF16", old.size - 2)
    with pytest.raises(CorruptDataError):
        codec.decode(old, payload, "F32", old.size)
    with pytest.raises(CorruptDataError):
        codec.decode(old, payload, "I16", old.size)
    with pytest.raises(CorruptDataError):
        codec.decode(None, payload, "BF16", old.size)


def test_unknown_magic_is_rejected(sample) -> None:
    old, _, payload = sample
    for magic in (b"DSC0", b"DSC3", b"XXXX"):
        with pytest.raises(CorruptDataError, match="magic"):
            codec.decode(old, magic + payload[4:], "BF16", old.size)


def test_v1_absurd_counts_and_lengths_fail_without_allocating(rng) -> None:
    old, new = _pair(rng, "BF16", 20_000, 0.02, small=True)
    payload = codec.encode_tensor_delta(old, new, "BF16", V1)
    H, S = v1._HEADER, v1._SECTION
    magic, method, transform, width, n_sections, n, k = H.unpack(payload[: H.size])
    body = payload[H.size :]
    crafted = [
        H.pack(magic, method, transform, width, n_sections, 2**62, k) + body,
        H.pack(magic, method, transform, width, n_sections, n, 2**62) + body,
        H.pack(magic, method, transform, width, 255, n, k) + body,
        H.pack(magic, method, transform, 3, n_sections, n, k) + body,
        H.pack(magic, 9, transform, width, n_sections, n, k) + body,
    ]
    first = S.unpack_from(payload, H.size)
    rest = payload[H.size + S.size :]
    crafted.append(payload[: H.size] + S.pack(first[0], first[1], first[2], 2**60, first[4]) + rest)
    crafted.append(payload[: H.size] + S.pack(first[0], first[1], first[2], first[3], 2**60) + rest)
    for bad in crafted:
        with pytest.raises(CorruptDataError):
            codec.decode(old, bad, "BF16", old.size)


def test_v1_zstd_bomb_frame_is_rejected() -> None:
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (1 << 24))
    section = v1._SECTION.pack(v1.KIND_PLANE, v1.CODER_ZSTD, 0, 1000, len(bomb)) + bomb
    payload = v1._HEADER.pack(v1.MAGIC, v1.METHOD_FULL, v1.TRANSFORM_NONE, 1, 1, 1000, 1000) + section
    with pytest.raises(CorruptDataError, match="declares"):
        codec.decode(None, payload, "U8", 1000)


def test_v1_positions_past_the_end_are_rejected() -> None:
    old = np.zeros(400, dtype=np.uint8)
    gaps = np.array([150, 150], dtype=np.uint32)  # positions 150 and 301 of 200 elements
    planes = [v1._section(v1.KIND_GAPS, j, p, 3) for j, p in enumerate(v1._planes(gaps))]
    values = [v1._section(v1.KIND_PLANE, j, p, 3) for j, p in enumerate(v1._planes(np.array([2, 2], dtype=np.uint16)))]
    payload = v1._HEADER.pack(v1.MAGIC, v1.METHOD_DELTA, v1.TRANSFORM_ORDERED, 2, 6, 200, 2) + b"".join(planes + values)
    with pytest.raises(CorruptDataError, match="past the end"):
        codec.decode(old, payload, "BF16", 400)


def _v(x: int) -> bytes:
    return wire.varint(x)


def _golomb1(*values: int) -> tuple[bytes, int]:
    """Golomb codes with m = 1 (docs/FORMAT.md), LSB first: (bytes, number of bits)."""
    bits: list[int] = []
    for x in values:
        if x >= wire.QMAX:
            length = x.bit_length()
            bits += (
                [0] * wire.QMAX + [1] + [(length >> i) & 1 for i in range(6)] + [(x >> i) & 1 for i in range(length)]
            )
        else:
            bits += [0] * x + [1]
    data = bytes(sum(b << i for i, b in enumerate(bits[k : k + 8])) for k in range(0, len(bits), 8))
    return data, len(bits)


def _ulp(n: int, body: bytes, width: int = 2) -> bytes:
    return b"DSC2" + bytes([v2.METHOD_ULP, width, 0]) + _v(n) + body


def _one_class(
    n_changed: int,
    n_events: int,
    m: int = 1,
    cflags: int = 0,
    extra: bytes = b"",
    bits: bytes = b"",
    nbits: int | None = None,
    signs: bytes = b"",
    rans: bytes = b"",
) -> bytes:
    """A ULP body with no row flags and one class covering every exponent."""
    record = _v(0) + _v(255) + bytes([cflags]) + _v(n_events) + (_v(n_changed) if cflags & 1 else b"") + _v(m) + extra
    nbits = 8 * len(bits) if nbits is None else nbits
    return _ulp(1000, _v(n_changed) + _v(1) + b"\0" + _v(1) + record + _v(nbits) + bits + signs + _v(len(rans)) + rans)


def test_v2_crafted_counts_and_tables_are_rejected_before_allocating() -> None:
    """Each of these would make a careless decoder allocate or loop far beyond the tensor
    (here 1000 BF16 elements), or read outside the payload."""
    n = 1000
    old = np.zeros(2 * n, np.uint8)
    big = 2**60
    crafted = {
        "n_elements": b"DSC2" + bytes([1, 2, 0]) + _v(big),
        "overlong varint": b"DSC2" + bytes([1, 2, 0]) + b"\xff" * 12,
        "n_changed > n": _ulp(n, _v(n + 1) + _v(1) + b"\0" + _v(0) + _v(0) + b"\0"),
        "row_len > n": _ulp(n, _v(1) + _v(n + 1) + b"\0"),
        "row_mode": _ulp(n, _v(1) + _v(10) + b"\7"),
        "row events > rows": _ulp(n, _v(1) + _v(10) + b"\1" + _v(101) + _v(1)),
        "classes > exponents": _ulp(n, _v(1) + _v(1) + b"\0" + _v(257)),
        "class past the exponents": _ulp(n, _v(1) + _v(1) + b"\0" + _v(1) + _v(200) + _v(100) + b"\0" + _v(1) + _v(1)),
        "class flags": _one_class(1, 1, cflags=0x40),
        "events > n": _one_class(1, big),
        "events without bits": _one_class(500, 500, bits=b"\xff", signs=b"\0" * 63),
        "changes without sign bytes": _one_class(800, 800, bits=b"\xff" * 100),
        "bitstream past the end": _one_class(1, 1, bits=b"\xff", nbits=8 * 10**6, signs=b"\0"),
        "table size": _one_class(1, 1, cflags=4, extra=_v(65)),
        "table sum": _one_class(1, 1, cflags=4, extra=_v(2) + _v(4000) + _v(95)),
        "table without rans": _one_class(1, 1, cflags=4, extra=_v(2) + _v(4000) + _v(96), bits=b"\x01", signs=b"\0"),
        "golomb m": _one_class(1, 1, m=0),
        "bits left over": _one_class(1, 1, bits=_golomb1(3)[0] + b"\0", signs=b"\0"),
        "gap past the end": _one_class(1, 1, bits=_golomb1(2000)[0], nbits=_golomb1(2000)[1], signs=b"\0"),
        "too few events": _one_class(2, 2, bits=_golomb1(5, 3000)[0], nbits=_golomb1(5, 3000)[1], signs=b"\0"),
        "odd rans length": _one_class(1, 1, bits=b"\x01", signs=b"\0", rans=b"\0\0\0"),
    }
    for what, payload in crafted.items():
        with pytest.raises(CorruptDataError):
            codec.decode(old, payload, "BF16", old.size)
            pytest.fail(what)


def test_v2_values_that_leave_the_float_range_are_rejected() -> None:
    """A step that would carry an element's key out of range (past +NaN) is an error, not a wrap."""
    old = np.array([0x7FFF, 0x3F80], np.uint16)  # the largest key, and 1.0
    new = np.array([0x7FFE, 0x3F81], np.uint16)
    payload = bytearray(
        codec.encode_tensor_delta(old.view(np.uint8), new.view(np.uint8), "BF16", codec.CodecConfig(dense_fraction=2.0))
    )
    assert np.array_equal(codec.decode(old.view(np.uint8), bytes(payload), "BF16", 4), new.view(np.uint8))
    signs_at = len(payload) - 2  # ... | sign byte | rans_len 0
    assert payload[-1] == 0
    payload[signs_at] ^= 0x3  # flip both signs: 0x7FFF goes up past the end of the key space
    with pytest.raises(CorruptDataError):
        codec.decode(old.view(np.uint8), bytes(payload), "BF16", 4)


def _dense_predicted_sign_payload(n: int, row_len: int, flip_stream: bytes) -> bytes:
    """A BF16 ULP payload (docs/FORMAT.md) declaring every one of n elements changed by one ULP:
    one dense class over every exponent, no events, magnitude mode 0 (no bits), signs predicted
    by a rank-1 model whose flips are four copies of ``flip_stream``."""
    n_rows = n // row_len
    body = _v(n) + _v(row_len) + b"\0" + _v(1)  # n_changed, row_len, row_mode 0, one class
    body += _v(0) + _v(255) + b"\1" + _v(0) + _v(n) + _v(1)  # lo, span, dense mode 0, 0 events, n changes, m
    body += _v(0)  # nbits: no bitstream
    body += bytes([1 | 1 << 4]) + bytes((n_rows + 7) // 8 + (row_len + 7) // 8)  # rank 1, 1 bit; codes
    body += b"".join(_v(f) for f in [4096 - 15] + [1] * 15)  # flip nibble table
    body += (_v(len(flip_stream)) + flip_stream) * 4 + _v(0)  # four flip streams, no rANS
    return wire.header(v2.METHOD_ULP, 2, n, v2.FLAG_SIGN_MODEL) + body


def test_declared_changes_the_flip_streams_cannot_hold_are_refused_before_allocating() -> None:
    """docs/SECURITY.md: counts are bounded by the payload, not only by the tensor. A few hundred
    bytes declaring 4M predicted-sign changes (8 bytes of decoder state each: 32 MB) are refused
    with CorruptDataError before the decoder allocates for them, and nothing large stays pooled."""
    import tracemalloc

    from delta_swap.codec.v2 import decoder

    n = 1 << 22
    payload = _dense_predicted_sign_payload(n, 2048, b"\0\0\1\0")  # each stream: only a final state
    assert len(payload) < 1024
    old = np.zeros(2 * n, np.uint8)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError, match="flip"):
            codec.decode_into(old, payload, "BF16")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # the 32 MB of int64 scratch were never requested
    assert all(s.i64.nbytes < 4 << 20 for s in decoder._POOL)


@pytest.mark.parametrize("dtype", ["BF16", "F32", "I16"])
@pytest.mark.parametrize("shape", [(37, 300), (11100,)])
def test_large_tensors_are_coded_in_parts_that_threads_can_share(rng, dtype: str, shape) -> None:
    """A tensor of at least twice ``part_elements`` is a split payload (method 3) of whole rows;
    it rebuilds bit-exact, and encoding its parts one by one (as the publisher's threads do) and
    joining them gives the same bytes."""
    if dtype == "I16":
        old, new = _pair(rng, dtype, int(np.prod(shape)), 0.05, small=False)
    else:
        old, new = _weights(rng, dtype, shape, 0.04, max_step=9)
    config = codec.CodecConfig(part_elements=3000)
    parts = codec.tensor_parts(int(np.prod(shape)), shape, config)
    assert len(parts) == 3 and parts[0][0] == 0 and parts[-1][1] == int(np.prod(shape))
    if len(shape) == 2:
        assert all(start % shape[-1] == 0 for start, _ in parts)  # whole rows
    payload = codec.encode_tensor_delta(old, new, dtype, config, shape=shape)
    assert payload[4] == v2.METHOD_SPLIT and codec.payload_method(payload).value == "delta"
    assert np.array_equal(codec.decode(old, payload, dtype, old.size), new)
    with ThreadPoolExecutor(2) as pool:  # the parts on threads, as apply_snapshot decodes them
        out = old.copy()
        codec.decode_into(out, payload, dtype, pool)
        assert np.array_equal(out, new)
        (_, c0, p0), (_, c1, p1), (_, c2, p2) = v2.split_parts(payload)
        shifted = codec.join_parts(dtype, [(c0, bytes(p0)), (c1 + 1, bytes(p1)), (c2 - 1, bytes(p2))])
        with pytest.raises(CorruptDataError, match="rebuilds"):  # found by a part decoding on a thread
            codec.decode_into(old.copy(), shifted, dtype, pool)
    joined = codec.join_parts(
        dtype, [(b - a, codec.encode_part(old, new, dtype, (a, b), config, shape)) for a, b in parts]
    )
    assert joined == payload
    assert codec.tensor_parts(int(np.prod(shape)), shape) == [(0, int(np.prod(shape)))]  # the default: one piece
    whole = codec.encode_tensor_delta(old, new, dtype, shape=shape)
    assert whole[4] != v2.METHOD_SPLIT and len(payload) < 1.1 * len(whole) + 200


def test_split_payloads_of_full_parts_need_no_previous_tensor(rng) -> None:
    old, new = _pair(rng, "BF16", 6000, 0.9, small=False)  # most bytes change: every part is full
    payload = codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(part_elements=2000), shape=(20, 300))
    assert payload[4] == v2.METHOD_SPLIT and codec.payload_method(payload).value == "full"
    assert np.array_equal(codec.decode_tensor_delta(None, payload, "BF16"), new)


def _split(*parts: tuple[int, bytes], n: int | None = None, count: int | None = None, flags: int = 0) -> bytes:
    total = sum(e for e, _ in parts) if n is None else n
    table = _v(len(parts) if count is None else count) + b"".join(_v(e) + _v(len(p)) for e, p in parts)
    return b"DSC2" + bytes([v2.METHOD_SPLIT, 2, flags]) + _v(total) + table + b"".join(p for _, p in parts)


def test_crafted_split_payloads_are_rejected_before_any_part_is_decoded(rng) -> None:
    """Tables that do not add up, nested splits, parts of another element size or method, and
    flags are refused before a byte of the output is written."""
    old, new = _weights(rng, "BF16", (8, 500), 0.05, max_step=3)
    half = old.size // 2
    a = codec.encode_tensor_delta(old[:half], new[:half], "BF16")
    b = codec.encode_tensor_delta(old[half:], new[half:], "BF16")
    good = _split((2000, a), (2000, b))
    assert np.array_equal(codec.decode(old, good, "BF16", old.size), new)
    wide = codec.encode_tensor_delta(old[half:], new[half:], "I16")  # the same bytes as 2-byte integers: XOR
    nested = _split((1000, a[:0] + codec.join_parts("BF16", [(1000, a)])), (2000, b))  # a split inside a split
    bad = {
        "one part": _split((4000, codec.encode_tensor_delta(old, new, "BF16"))),
        "elements short": _split((2000, a), (1999, b), n=4000),
        "elements over": _split((2000, a), (2001, b), n=4000),
        "zero elements": _split((0, b""), (2000, a), (2000, b)),
        "lengths short": _split((2000, a), (2000, b)) + b"\0",
        "count over": _split((2000, a), (2000, b), count=3),
        "count over the bound": _split((2000, a), (2000, b), n=1 << 20, count=(1 << 16) + 1),
        "flags": _split((2000, a), (2000, b), flags=1),
        "nested": nested,
        "part of another element size": _split((2000, a), (2000, b[:5] + bytes([4]) + b[6:])),
        "part of an unknown method": _split((2000, a), (2000, b[:4] + bytes([7]) + b[5:])),
        "part with a bad magic": _split((2000, a), (2000, b"DSC1" + b[4:])),
        "XOR part for a float dtype": _split((2000, a), (2000, wide[:5] + bytes([2]) + wide[6:])),
    }
    for what, payload in bad.items():
        out = old.copy()
        with pytest.raises(CorruptDataError):
            codec.decode_into(out, payload, "BF16")
        if what != "XOR part for a float dtype":  # framing errors: nothing written
            assert np.array_equal(out, old), what
            with pytest.raises(CorruptDataError):  # and what the payload needs is not answered either
                codec.payload_method(payload)


def test_v2_zstd_bomb_plane_is_rejected() -> None:
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (1 << 24))
    payload = b"DSC2" + bytes([v2.METHOD_FULL, 1, 0]) + _v(1000) + b"\1" + _v(len(bomb)) + bomb
    with pytest.raises(CorruptDataError, match="declares"):
        codec.decode(None, payload, "U8", 1000)
    with pytest.raises(CorruptDataError):
        codec.decode_tensor_delta(None, payload[:-3], "U8")


def test_header_layout_is_stable() -> None:
    """The wire formats are documented in docs/FORMAT.md; changing one needs a new magic."""
    assert v1._HEADER.size == 24 and v1._SECTION.size == 20
    # v1: magic, method, transform, width, sections, n (u64), changed (u64); little-endian
    full = codec.encode_full(np.arange(6, dtype=np.uint8), "BF16", V1)
    assert full[:24] == b"DSC1" + bytes([v1.METHOD_FULL, v1.TRANSFORM_NONE, 2, 2]) + struct.pack("<QQ", 3, 3)
    # v2: magic, method, width, flags, then n as a LEB128 varint (300 -> 0xAC 0x02)
    assert wire.header(v2.METHOD_ULP, 2, 300, v2.FLAG_SIGN_MODEL) == b"DSC2\x01\x02\x01\xac\x02"
    payload = codec.encode_tensor_delta(
        np.zeros(4, np.uint8), np.array([0, 0, 1, 0], np.uint8), "BF16", codec.CodecConfig(dense_fraction=2.0)
    )
    assert payload[:7] == b"DSC2" + bytes([v2.METHOD_ULP, 2, 0])
    assert codec.payload_version(payload) == 2 and codec.LATEST_VERSION == 2


def test_unknown_codec_version_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown codec version 3"):
        codec.CodecConfig(version=3)


def test_codec_arguments_that_are_not_raw_tensor_bytes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="1-D uint8"):
        codec.encode_full(np.zeros(4, np.float32), "F32")
    with pytest.raises(ConfigError, match="whole number"):
        codec.encode_full(np.zeros(3, np.uint8), "BF16")
    with pytest.raises(ConfigError, match="old has 4 bytes"):
        codec.encode_tensor_delta(np.zeros(4, np.uint8), np.zeros(6, np.uint8), "BF16")
    with pytest.raises(ConfigError, match="whole number"):
        codec.encode_full(np.zeros(3, np.uint8), "BF16", V1)


# ------------------------------------------------------------------------------ the specification


def _spec_cases() -> list[tuple[np.ndarray, bytes, str]]:
    rng = np.random.default_rng(21)
    cases = []
    for dtype, shape, frac, max_step, rows in (
        ("BF16", (8, 256), 0.05, 1, 0.5),
        ("BF16", (6, 300), 0.5, 3, 0.0),
        ("BF16", (4, 512), 0.2, 5000, 0.5),
        ("F16", (5, 260), 0.1, 40, 0.3),
        ("F32", (3, 400), 0.08, 100000, 0.0),
        ("BF16", (1,), 1.0, 1, 0.0),
    ):
        old, new = _weights(rng, dtype, shape, frac, dead_rows=rows, max_step=max_step)
        cases.append(
            (old, codec.encode_tensor_delta(old, new, dtype, codec.CodecConfig(dense_fraction=2.0), shape=shape), dtype)
        )
    for dtype, shape, rank in (("BF16", (32, 256), 1), ("F32", (16, 384), 2)):  # predicted signs
        old, new = _weights(rng, dtype, shape, 3.0, max_step=2, sign_rank=rank, agree=0.9)
        cases.append(
            (old, codec.encode_tensor_delta(old, new, dtype, codec.CodecConfig(dense_fraction=2.0), shape=shape), dtype)
        )
        assert cases[-1][1][6] == 1
    for dtype in ("BF16", "F16", "F32"):
        vals = _special(dtype)
        cases.append(
            (
                vals.view(np.uint8).copy(),
                codec.encode_tensor_delta(
                    vals.view(np.uint8),
                    np.roll(vals, 5).view(np.uint8).copy(),
                    dtype,
                    codec.CodecConfig(dense_fraction=2.0),
                ),
                dtype,
            )
        )
    old, new = _pair(rng, "I16", 500, 0.1, small=False)
    cases.append((old, codec.encode_tensor_delta(old, new, "I16"), "I16"))
    cases.append((old, codec.encode_full(new, "BF16"), "BF16"))
    for dtype, frac, dense in (("BF16", 0.05, 2.0), ("F16", 0.9, 0.125)):  # split: ULP parts; full parts
        old, new = _weights(rng, dtype, (12, 256), frac, max_step=3)
        config = codec.CodecConfig(dense_fraction=dense, part_elements=1000)
        cases.append((old, codec.encode_tensor_delta(old, new, dtype, config, shape=(12, 256)), dtype))
        assert cases[-1][1][4] == 3
    old, new = _pair(rng, "I16", 3000, 0.1, small=False)  # split XOR parts of a 1-D tensor
    cases.append((old, codec.encode_tensor_delta(old, new, "I16", codec.CodecConfig(part_elements=1000)), "I16"))
    assert cases[-1][1][4] == 3
    return cases


def test_docs_format_md_is_enough_to_decode_v2() -> None:
    """tests/support/ref_decoder_v2.py was written from docs/FORMAT.md alone: it must rebuild
    exactly what the codec rebuilds, and refuse what the codec refuses."""
    from tests.support import ref_decoder_v2 as ref

    cases = _spec_cases()
    modes = set()
    for old, payload, dtype in cases:
        modes.add(payload[4])
        assert ref.decode(old.tobytes(), payload, dtype) == codec.decode(old, payload, dtype, old.size).tobytes()
    assert modes == {0, 1, 2, 3}
    rng = np.random.default_rng(5)
    outcomes = {"both refuse": 0, "same bytes": 0}
    for _ in range(150):
        old, payload, dtype = cases[int(rng.integers(len(cases)))]
        bad = bytearray(payload)
        for _ in range(int(rng.integers(1, 3))):
            bad[int(rng.integers(min(len(bad), 60) if rng.random() < 0.5 else len(bad)))] ^= 1 << int(rng.integers(8))
        try:
            ours = codec.decode(old, bytes(bad), dtype, old.size).tobytes()
        except CorruptDataError:
            ours = None
        try:
            theirs = ref.decode(old.tobytes(), bytes(bad), dtype)
        except (ref.Bad, zstandard_error()):
            theirs = None
        assert ours == theirs
        outcomes["both refuse" if ours is None else "same bytes"] += 1
    assert min(outcomes.values()) > 0


def zstandard_error() -> type[Exception]:
    import zstandard

    return zstandard.ZstdError


@numba.njit
def _golomb_round_trip(values, m):
    """Write ``values`` with the encoder's Golomb writer, read them back with the decoder's
    reader: (values read, bits read, bits written, bits golomb_len counts)."""
    b, cut = bitio.golomb_params(m)
    buf = np.zeros(2 * values.size + 8, np.uint64)  # a code is at most 47 + 63 bits
    acc, nacc, w = np.uint64(0), np.uint64(0), np.uint64(0)
    counted = 0
    for x in values:
        acc, nacc, w = bitio.golomb_write(buf, acc, nacc, w, x, m, b, cut)
        counted += bitio.golomb_len(x, m, b, cut)
    if nacc:
        buf[w] = acc
    out = np.empty(values.size, np.int64)
    pos = 0
    for j in range(values.size):
        out[j], pos = bitio.golomb_read(buf, pos, m, b, cut)
    return out, pos, np.int64(w) * 64 + np.int64(nacc), counted


@pytest.mark.parametrize("m", [1, 2, 3, 5, 64, 1000, (1 << 20) + 7, (1 << 27) + 3, 1 << 40])
def test_golomb_writer_and_reader_agree(m: int) -> None:
    """Every path of the writer: one put, a code over 57 bits in two (large m, large quotient),
    the escape (quotient >= QMAX), m = 1; mixed so codes straddle the 64-bit words."""
    cut = (1 << (m - 1).bit_length()) - m  # the codes from here on take b bits, below b - 1
    picks = [0, 1, m - 1, m, max(0, cut - 1), cut, m + cut, 3 * m + m // 2]
    picks += [(wire.QMAX - 1) * m + r for r in (0, m - 1)]  # the longest codes that are not escaped
    picks += [wire.QMAX * m, (1 << 62) - 1]  # escaped
    rng = np.random.default_rng(m)
    values = np.array(picks + list(rng.choice(picks, 200)) + list(rng.integers(0, 5 * m, 200)), np.int64)
    out, read, written, counted = _golomb_round_trip(values, m)
    assert out.tolist() == values.tolist()
    assert read == written == counted
