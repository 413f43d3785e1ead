"""Codec round trips over dtypes, shapes and change densities, and rejection of crafted payloads."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delta_swap import codec
from delta_swap.dtypes import DTYPE_SIZES
from delta_swap.errors import CorruptDataError


def _pair(rng: np.random.Generator, dtype: str, n: int, density: float, small: bool) -> tuple[np.ndarray, np.ndarray]:
    width = DTYPE_SIZES[dtype]
    old = rng.integers(0, 256, size=n * width, dtype=np.uint8)
    new = old.copy()
    k = int(n * density)
    idx = rng.choice(n, size=k, replace=False) if k else np.zeros(0, dtype=np.int64)
    elems = new.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width])
    if small:  # mantissa-only nudges, as RL updates do
        elems[idx] ^= rng.integers(1, 4, size=k).astype(elems.dtype)
    else:
        elems[idx] = rng.integers(0, 255, size=k).astype(elems.dtype) * elems.dtype.type(0x0101010101010101 % (1 << (8 * width)))
    return old, new


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(sorted(DTYPE_SIZES)),
    n=st.integers(0, 5000),
    density=st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]),
    small=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_delta_round_trip_is_bit_exact(dtype: str, n: int, density: float, small: bool, seed: int) -> None:
    old, new = _pair(np.random.default_rng(seed), dtype, n, density, small)
    payload = codec.encode_tensor_delta(old, new, dtype)
    assert np.array_equal(codec.decode(old, payload, dtype, new.size), new)
    full = codec.encode_tensor_delta(None, new, dtype)
    assert codec.payload_method(full) == "full"
    assert np.array_equal(codec.decode(None, full, dtype, new.size), new)


def test_sparse_mantissa_changes_compress_far_below_raw(rng) -> None:
    old, new = _pair(rng, "BF16", 1_000_000, 0.015, small=True)
    payload = codec.encode_tensor_delta(old, new, "BF16")
    assert codec.payload_method(payload) == "delta"
    assert len(payload) < 0.02 * old.size  # ~1.5% of elements changed: well under 2% of the bytes
    assert np.array_equal(codec.decode(old, payload, "BF16", old.size), new)


def test_ordered_float_delta_handles_sign_crossings_and_special_values() -> None:
    vals = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x7F80, 0xFF80, 0x7FC0, 0x3F80, 0xBF80], dtype=np.uint16)
    old = vals.view(np.uint8).copy()
    new = np.roll(vals, 3).view(np.uint8).copy()
    payload = codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(dense_fraction=2.0))
    assert codec.payload_method(payload) == "delta"
    assert np.array_equal(codec.decode(old, payload, "BF16", old.size), new)


@pytest.fixture
def sample(rng) -> tuple[np.ndarray, np.ndarray, bytes]:
    old, new = _pair(rng, "BF16", 20_000, 0.02, small=True)
    return old, new, codec.encode_tensor_delta(old, new, "BF16")


def test_truncated_payloads_are_rejected(sample) -> None:
    old, _, payload = sample
    for cut in (0, 10, 23, 30, len(payload) // 2, len(payload) - 1):
        with pytest.raises(CorruptDataError):
            codec.decode(old, payload[:cut], "BF16", old.size)


def test_trailing_bytes_are_rejected(sample) -> None:
    old, _, payload = sample
    with pytest.raises(CorruptDataError, match="trailing"):
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


def test_absurd_counts_and_lengths_fail_without_allocating(sample) -> None:
    old, _, payload = sample
    header = bytearray(payload[: codec._HEADER.size])
    magic, method, transform, width, n_sections, n, k = codec._HEADER.unpack(header)
    crafted = [
        codec._HEADER.pack(magic, method, transform, width, n_sections, 2**62, k) + payload[codec._HEADER.size :],
        codec._HEADER.pack(magic, method, transform, width, n_sections, n, 2**62) + payload[codec._HEADER.size :],
        codec._HEADER.pack(magic, method, transform, width, 255, n, k) + payload[codec._HEADER.size :],
        codec._HEADER.pack(magic, method, transform, 3, n_sections, n, k) + payload[codec._HEADER.size :],
        codec._HEADER.pack(b"XXXX", method, transform, width, n_sections, n, k) + payload[codec._HEADER.size :],
        codec._HEADER.pack(magic, 9, transform, width, n_sections, n, k) + payload[codec._HEADER.size :],
    ]
    # A section that claims a huge raw length.
    first = codec._SECTION.unpack_from(payload, codec._HEADER.size)
    crafted.append(
        payload[: codec._HEADER.size]
        + codec._SECTION.pack(first[0], first[1], first[2], 2**60, first[4])
        + payload[codec._HEADER.size + codec._SECTION.size :]
    )
    crafted.append(
        payload[: codec._HEADER.size]
        + codec._SECTION.pack(first[0], first[1], first[2], first[3], 2**60)
        + payload[codec._HEADER.size + codec._SECTION.size :]
    )
    for bad in crafted:
        with pytest.raises(CorruptDataError):
            codec.decode(old, bad, "BF16", old.size)


def test_zstd_bomb_frame_is_rejected(rng) -> None:
    import zstandard

    old, new = _pair(rng, "U8", 1000, 0.5, small=False)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (1 << 24))
    section = codec._SECTION.pack(codec.KIND_PLANE, codec.CODER_ZSTD, 0, 1000, len(bomb)) + bomb
    payload = codec._HEADER.pack(codec.MAGIC, codec.METHOD_FULL, codec.TRANSFORM_NONE, 1, 1, 1000, 1000) + section
    with pytest.raises(CorruptDataError, match="declares"):
        codec.decode(None, payload, "U8", 1000)


def test_positions_past_the_end_are_rejected(rng) -> None:
    old = np.zeros(400, dtype=np.uint8)
    gaps = [np.array([150, 150], dtype=np.uint32)]  # positions 150 and 301 of 200 elements
    planes = [codec._section(codec.KIND_GAPS, j, p, 3) for j, p in enumerate(codec._planes(gaps[0]))]
    values = [codec._section(codec.KIND_PLANE, j, p, 3) for j, p in enumerate(codec._planes(np.array([2, 2], dtype=np.uint16)))]
    payload = codec._HEADER.pack(codec.MAGIC, codec.METHOD_DELTA, codec.TRANSFORM_ORDERED, 2, 6, 200, 2) + b"".join(planes + values)
    with pytest.raises(CorruptDataError, match="past the end"):
        codec.decode(old, payload, "BF16", 400)


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


def test_header_layout_is_stable() -> None:
    """The wire format is documented in docs/FORMAT.md; changing it needs a new magic."""
    assert codec._HEADER.size == 24 and codec._SECTION.size == 20
    assert struct.calcsize("<4sBBBBQQ") == 24
