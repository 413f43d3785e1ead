"""Fuzzing every parser and decoder that reads store bytes (bounded: a few hundred examples each).

Whatever the input, each either succeeds or raises CorruptDataError (or a subclass): never
another exception, a hang, or an allocation beyond what the input declares and the reader allows.
"""

from __future__ import annotations

import json
import resource
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delta_swap import codec
from delta_swap.chain import decode_head
from delta_swap.codec import v2
from delta_swap.commit import Part
from delta_swap.errors import CorruptDataError
from delta_swap.manifest import Manifest
from delta_swap.safetensors_io import read_safetensors
from delta_swap.signing import TrustedKeys
from tests.support.chains import rl_steps

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)


@pytest.fixture(scope="module")
def manifest_doc(tmp_path_factory) -> dict:
    from delta_swap.publisher import Publisher, PublisherConfig

    root = tmp_path_factory.mktemp("fuzz-store")
    with Publisher(str(root), PublisherConfig(base_every=100), files={"config.json": b"{}"}) as pub:
        for i, s in enumerate(rl_steps(2)):
            pub.publish(i, s)
    return json.loads((root / "snapshots" / "step-0000000001" / "manifest.json").read_text())


def _parses_or_corrupt(parse, data) -> None:
    try:
        parse(data)
    except CorruptDataError:
        pass


@FUZZ
@given(data=st.binary(max_size=2000))
def test_manifest_parser_on_random_bytes(data) -> None:
    _parses_or_corrupt(Manifest.from_json, data)


@FUZZ
@given(
    path=st.lists(
        st.sampled_from(
            [
                "tensors",
                "shards",
                "files",
                0,
                1,
                "name",
                "shape",
                "offset",
                "length",
                "encoding",
                "checksum",
                "sha256",
                "size",
                "dtype",
                "step",
                "kind",
                "prev_snapshot_id",
                "metadata",
                "created_at",
                "format_version",
            ]
        ),
        min_size=1,
        max_size=4,
    ),
    value=json_values,
)
def test_manifest_parser_on_mutated_manifests(manifest_doc, path, value) -> None:
    doc = json.loads(json.dumps(manifest_doc))
    node = doc
    for key in path[:-1]:
        if isinstance(node, dict) and isinstance(key, str) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            break
    last = path[-1]
    if isinstance(node, dict) and isinstance(last, str):
        node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        node[last] = value
    _parses_or_corrupt(Manifest.from_json, json.dumps(doc, allow_nan=True).encode())


@FUZZ
@given(doc=json_values)
def test_head_and_part_parsers(doc) -> None:
    data = json.dumps(doc, allow_nan=True).encode()
    _parses_or_corrupt(decode_head, data)
    _parses_or_corrupt(Part.from_json, data)


@FUZZ
@given(data=st.binary(max_size=600))
def test_random_safetensors_files_parse_or_raise_corrupt_data(data) -> None:
    _parses_or_corrupt(read_safetensors, data)


@FUZZ
@given(doc=json_values)
def test_random_signature_documents_verify_or_raise_corrupt_data(tmp_path_factory, doc) -> None:
    keys = getattr(test_random_signature_documents_verify_or_raise_corrupt_data, "_keys", None)
    if keys is None:
        from delta_swap.signing import generate_keypair

        _, pub = generate_keypair(tmp_path_factory.mktemp("fuzzkey") / "k")
        keys = test_random_signature_documents_verify_or_raise_corrupt_data._keys = TrustedKeys.load([pub])
    _parses_or_corrupt(lambda d: keys.verify(b"manifest", d, "s"), json.dumps(doc, allow_nan=True).encode())


@pytest.fixture(scope="module")
def payloads() -> list[tuple[np.ndarray, bytes, str]]:
    rng = np.random.default_rng(7)
    out = []
    for dtype, width in (("BF16", 2), ("F32", 4), ("I8", 1)):
        old = rng.integers(0, 256, 4000 * width, dtype=np.uint8)
        new = old.copy()
        idx = rng.choice(4000, 80, replace=False)
        new.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[width])[idx] ^= 1
        out.append((old, codec.encode_tensor_delta(old, new, dtype), dtype))
        out.append((old, codec.encode_full(new, dtype), dtype))
        out.append((old, codec.encode_tensor_delta(old, new, dtype, codec.CodecConfig(version=1)), dtype))
    return out


@FUZZ
@given(
    which=st.integers(0, 8),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), max_size=6),
    cut=st.integers(0, 10**6),
    tail=st.binary(max_size=8),
)
def test_codec_decoder_on_mutated_payloads(payloads, which, flips, cut, tail) -> None:
    old, payload, dtype = payloads[which]
    data = bytearray(payload)
    for pos, bit in flips:
        data[pos % len(data)] ^= 1 << bit
    data = data[: max(0, len(data) - cut % 64)] + tail
    try:
        out = codec.decode(old, bytes(data), dtype, old.size)
    except CorruptDataError:
        return
    assert out.size == old.size and out.dtype == np.uint8


@FUZZ
@given(data=st.binary(max_size=300), nbytes=st.integers(0, 10**12))
def test_codec_decoder_on_random_bytes(data, nbytes) -> None:
    old = np.zeros(64, dtype=np.uint8)
    for reference, size in ((None, nbytes), (old, old.size)):
        _parses_or_corrupt(lambda d, r=reference, n=size: codec.decode(r, d, "BF16", n), data)


@pytest.fixture(scope="module")
def v2_payloads() -> list[tuple[np.ndarray, bytes, str]]:
    """Codec v2 payloads that use every part of the format: dead-row flags, sparse and dense
    classes, Golomb and rANS magnitudes with escapes, F16/F32, full and XOR payloads, predicted
    signs."""
    import torch

    rng = np.random.default_rng(11)
    out = []
    for dtype, shape, frac, max_step in (
        ("BF16", (32, 512), 0.03, 1),
        ("BF16", (16, 512), 0.4, 3000),
        ("F16", (8, 300), 0.1, 40),
        ("F32", (4, 700), 0.05, 100000),
    ):
        tdtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dtype]
        udtype = {2: np.uint16, 4: np.uint32}[torch.tensor([], dtype=tdtype).element_size()]
        w = (torch.randn(shape, generator=torch.Generator().manual_seed(len(out))) * 0.02).to(tdtype)
        old = w.reshape(-1).view(torch.int16 if udtype is np.uint16 else torch.int32).numpy().view(udtype).copy()
        new = old.copy()
        rows = np.repeat(rng.random(shape[0]) < 0.5, shape[1])  # half the rows never change
        idx = np.flatnonzero((rng.random(old.size) < frac) & rows)
        new[idx] = (old[idx].astype(np.int64) + rng.integers(1, max_step + 1, idx.size)).astype(udtype)  # stays finite
        a, b = old.view(np.uint8), new.view(np.uint8)
        out.append(
            (a, codec.encode_tensor_delta(a, b, dtype, codec.CodecConfig(dense_fraction=2.0), shape=shape), dtype)
        )
    a = rng.integers(0, 256, 3000, dtype=np.uint8)
    b = a.copy()
    b[::17] ^= 5
    out.append((a, codec.encode_tensor_delta(a, b, "I8"), "I8"))
    out.append((a, codec.encode_full(b, "BF16"), "BF16"))
    from tests.test_codec import _weights

    a, b = _weights(rng, "BF16", (64, 512), 0.4, max_step=3, sign_rank=2, agree=0.9)
    out.append(
        (a, codec.encode_tensor_delta(a, b, "BF16", codec.CodecConfig(dense_fraction=2.0), shape=(64, 512)), "BF16")
    )
    assert out[-1][1][6] == v2.FLAG_SIGN_MODEL
    assert all(p[:4] == b"DSC2" for _, p, _ in out)
    return out


_RSS_BASE: list[int] = []
_RSS_SLACK_KIB = 64 * 1024  # the declared tensors are a few KiB: any count-driven allocation shows


@settings(max_examples=1500, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, 6),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7), st.booleans()), max_size=6),
    cut=st.integers(0, 10**6),
    splice=st.binary(max_size=16),
    at=st.integers(0, 10**6),
    in_place=st.booleans(),
)
def test_v2_decoder_on_mutated_payloads(v2_payloads, which, flips, cut, splice, at, in_place) -> None:
    """Bounded fuzz of the v2 decoder (1500 payloads, a few seconds): bit flips (half of them in
    the header and class records), truncation and spliced bytes give CorruptDataError or a
    tensor of the right size (which the reader's checksum then judges); never a crash, a hang
    (deadline) or memory beyond the declared tensor size (peak RSS stays flat)."""
    if not _RSS_BASE:
        _RSS_BASE.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    old, payload, dtype = v2_payloads[which]
    data = bytearray(payload)
    for pos, bit, head in flips:
        data[pos % (min(len(data), 48) if head else len(data))] ^= 1 << bit
    if splice:
        i = at % (len(data) + 1)
        data[i : i + len(splice) // 2] = splice
    data = data[: max(0, len(data) - cut % 16)]
    try:
        if in_place:
            out = old.copy()
            codec.decode_into(out, bytes(data), dtype)
        else:
            out = codec.decode(old, bytes(data), dtype, old.size)
    except CorruptDataError:
        pass
    else:
        assert out.size == old.size and out.dtype == np.uint8
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - _RSS_BASE[0] < _RSS_SLACK_KIB


@settings(max_examples=300, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.binary(max_size=400),
    method=st.integers(0, 3),
    n=st.integers(0, 2**20),
    nbytes=st.integers(0, 2**20),
    flags=st.sampled_from([0, v2.FLAG_SIGN_MODEL]),
)
def test_v2_decoder_on_random_bodies(v2_payloads, body, method, n, nbytes, flags) -> None:
    """A valid v2 header (with or without predicted signs) followed by garbage, with any element
    count and expected size (the fixture has compiled the kernels, so the deadline only measures
    decoding)."""
    payload = b"DSC2" + bytes([method, 2, flags]) + v2.wire.varint(n) + body
    old = np.zeros(2 * n, np.uint8) if n == nbytes // 2 and n < 5000 else None
    try:
        codec.decode(old, payload, "BF16", 2 * n if old is not None else nbytes)
    except CorruptDataError:
        pass
