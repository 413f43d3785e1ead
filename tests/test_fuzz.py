"""Fuzzing every parser and decoder that reads store bytes (bounded: a few hundred examples each).

Whatever the input, each either succeeds or raises CorruptDataError (or a subclass): never
another exception, a hang, or an allocation beyond what the input declares and the reader allows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delta_swap import codec
from delta_swap.chain import decode_head
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
@given(path=st.lists(st.sampled_from(["tensors", "shards", "files", 0, 1, "name", "shape", "offset", "length",
                                      "encoding", "checksum", "sha256", "size", "dtype", "step", "kind",
                                      "prev_snapshot_id", "metadata", "created_at", "format_version"]),
                     min_size=1, max_size=4),
       value=json_values)
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
def test_safetensors_header_parser(data) -> None:
    _parses_or_corrupt(read_safetensors, data)


@FUZZ
@given(doc=json_values)
def test_signature_parser(tmp_path_factory, doc) -> None:
    keys = getattr(test_signature_parser, "_keys", None)
    if keys is None:
        from delta_swap.signing import generate_keypair

        _, pub = generate_keypair(tmp_path_factory.mktemp("fuzzkey") / "k")
        keys = test_signature_parser._keys = TrustedKeys.load([pub])
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
    return out


@FUZZ
@given(which=st.integers(0, 5), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), max_size=6),
       cut=st.integers(0, 10**6), tail=st.binary(max_size=8))
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
