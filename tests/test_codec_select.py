"""Codec v2's select apply (BF16, common/codec/v2/select_apply.py) against its walk, on the same payloads:
the same tensors from valid payloads and the same verdict on damaged ones."""

from __future__ import annotations

import numpy as np
import pytest

from delta_swap import codec
from delta_swap.codec import v2
from delta_swap.codec.v2 import select_apply
from delta_swap.errors import CorruptDataError
from tests.test_codec import _weights

needs_select = pytest.mark.skipif(not select_apply.AVAILABLE, reason="this host applies BF16 payloads with the walk")


def _decode(old: np.ndarray, payload: bytes, select: bool, monkeypatch) -> np.ndarray | None:
    """The decoded tensor, or None when the payload is rejected."""
    monkeypatch.setattr(select_apply, "AVAILABLE", select)
    try:
        return codec.decode(old, payload, "BF16", old.size)
    except CorruptDataError:
        return None


CASES = {  # shape, fraction changed, rows that never change, largest step, rank of the signs' pattern
    "sparse": ((64, 1000), 0.003, 0.0, 1),
    "rl-like": ((96, 700), 0.03, 0.0, 3),
    "dense classes": ((50, 800), 0.4, 0.0, 2),
    "dead rows": ((300, 256), 0.05, 0.6, 1),
    "huge steps": ((33, 517), 0.1, 0.0, 5000),
    "not a chunk multiple": ((4096 * 3 + 77,), 0.02, 0.0, 1),
    "tiny": ((70,), 0.2, 0.0, 1),
    "large (its rank bitmaps grow)": ((600, 512), 0.01, 0.0, 1),
    "predicted signs": ((160, 640), 0.1, 0.1, 2, 2),  # big enough that the model clearly pays
    "predicted signs, one bit per factor": ((200, 256), 0.15, 0.0, 1, 1),
}


@needs_select
@pytest.mark.parametrize("case", sorted(CASES))
def test_select_apply_rebuilds_what_the_walk_rebuilds(case: str, rng, monkeypatch) -> None:
    shape, frac, dead, step, *rank = CASES[case]
    monkeypatch.setattr(v2.decoder, "_POOL", [])  # fresh scratch: the large case grows its buffer
    old, new = _weights(
        rng, "BF16", shape, frac, dead_rows=dead, max_step=step, sign_rank=rank[0] if rank else 0, agree=0.9
    )
    payload = codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(), shape=shape)
    assert payload[4] == v2.METHOD_ULP  # coded as ULP steps, not a full or XOR payload
    assert payload[6] == (v2.FLAG_SIGN_MODEL if rank else 0)
    for select in (True, False):
        out = _decode(old, payload, select, monkeypatch)
        assert out is not None and np.array_equal(out, new), (case, select)


@needs_select
@pytest.mark.parametrize("signs", ["raw", "predicted"])
def test_damaged_payloads_get_the_same_verdict_from_both(rng, monkeypatch, signs: str) -> None:
    shape = (40, 500) if signs == "raw" else (64, 512)
    old, new = _weights(
        rng,
        "BF16",
        shape,
        0.05 if signs == "raw" else 0.4,
        dead_rows=0.3,
        max_step=20,
        sign_rank=0 if signs == "raw" else 1,
        agree=0.9,
    )
    payload = codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(), shape=shape)
    assert payload[6] == (0 if signs == "raw" else v2.FLAG_SIGN_MODEL)
    rejected = accepted = 0
    for byte in range(7, len(payload), max(1, len(payload) // 300)):
        for bit in (0, 2, 5, 7):
            bad = bytearray(payload)
            bad[byte] ^= 1 << bit
            walk = _decode(old, bytes(bad), False, monkeypatch)
            select = _decode(old, bytes(bad), True, monkeypatch)
            assert (walk is None) == (select is None), (byte, bit)
            if walk is None:
                rejected += 1
            else:
                accepted += 1
                assert np.array_equal(walk, select), (byte, bit)
    assert rejected > 0 and accepted > 0


def test_the_walk_still_serves_other_dtypes_and_hosts(rng, monkeypatch) -> None:
    """F16/F32 payloads, and BF16 where the host lacks a fast pdep, go through the walk."""
    calls = []
    monkeypatch.setattr(select_apply, "AVAILABLE", True)
    monkeypatch.setattr(select_apply, "apply_bf16", lambda *a: calls.append(a) or -12)
    old, new = _weights(rng, "F16", (20, 300), 0.05)
    assert np.array_equal(
        codec.decode(old, codec.encode_tensor_delta(old, new, "F16", codec.CodecConfig()), "F16", old.size), new
    )
    assert not calls
    old, new = _weights(rng, "BF16", (20, 300), 0.05)
    payload = codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig())
    with pytest.raises(CorruptDataError):  # the patched select apply is what decodes BF16 here
        codec.decode(old, payload, "BF16", old.size)
    assert calls
    monkeypatch.setattr(select_apply, "AVAILABLE", False)
    assert np.array_equal(codec.decode(old, payload, "BF16", old.size), new)


@needs_select
def test_a_payload_applied_to_another_base_gets_the_same_verdict_from_both(rng, monkeypatch) -> None:
    """Against the wrong previous tensor a class has other members: ranks past them are rejected
    (by the final count checks), others decode to the same (wrong) tensor, which the checksum
    then rejects."""
    shape = (64, 700)
    old, new = _weights(rng, "BF16", shape, 0.05, dead_rows=0.2, max_step=3)
    payload = codec.encode_tensor_delta(old, new, "BF16", codec.CodecConfig(), shape=shape)
    fewer = old.view(np.uint16).copy()
    fewer[: fewer.size // 3] = 0  # a third of the elements leave their classes
    shuffled = np.ascontiguousarray(old.view(np.uint16).reshape(shape)[:, rng.permutation(shape[1])]).reshape(-1)
    # ^ the same members per class in every row, at other places
    verdicts = []
    for base in (fewer, shuffled):
        walk = _decode(base.view(np.uint8), payload, False, monkeypatch)
        select = _decode(base.view(np.uint8), payload, True, monkeypatch)
        assert (walk is None) == (select is None)
        assert walk is None or np.array_equal(walk, select)
        verdicts.append(walk is None)
    assert verdicts == [True, False]


@needs_select
def test_a_crafted_rank_past_the_tensor_is_rejected_without_writing_past_the_buffers(monkeypatch) -> None:
    """Gaps that add up past the class's members are rejected by both (the select apply clamps
    every rank-bitmap store to its buffer first)."""
    from tests.test_codec import _golomb1, _one_class

    old = np.zeros(2 * 1000, np.uint8)
    for gaps in ((5, 3000), (999, 0), (2**40,)):
        bits, nbits = _golomb1(*gaps)
        payload = _one_class(len(gaps), len(gaps), bits=bits, nbits=nbits, signs=b"\0")
        for select in (True, False):
            assert _decode(old, payload, select, monkeypatch) is None, (gaps, select)
    assert v2.select_apply is select_apply
