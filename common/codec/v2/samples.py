"""Small fixed (old, new) pairs that use every coding mode of codec v2, the payloads stored for
them with the package, and :func:`warm_up`, which compiles (or loads) the kernels by coding them."""

from __future__ import annotations

import base64
import json
from functools import cache
from importlib import resources

import numpy as np

from .decoder import decode_into
from .encoder import encode_delta
from .wire import FLOATS, UINT


def tensors(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A small deterministic (old, new) pair of shape (8, 256) that uses every coding mode: dead
    rows, sparse and dense classes, Golomb and rANS magnitudes with escapes."""
    width, mant_bits, _ = FLOATS[dtype]
    i = np.arange(2048, dtype=np.uint64)
    x = ((i + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
    u = (x >> np.uint64(66 - 8 * width)).astype(UINT[width])  # top bits clear: finite, no wrap
    v = u.copy()
    live = (i // 256) % 3 != 1
    v[live & (i % 3 == 0)] += 1
    v[live & (i % 97 == 1)] += UINT[width](1 << mant_bits)
    v[live & (i % 11 == 2)] -= 3
    v[live & (i % 7 == 3)] += UINT[width](5 + (i[live & (i % 7 == 3)] % 50).astype(UINT[width]))
    return u.view(np.uint8), v.view(np.uint8)


def sign_tensors() -> tuple[np.ndarray, np.ndarray]:
    """A deterministic BF16 (old, new) pair of shape (64, 256) whose steps' signs follow a rank-1
    pattern (a sign per row times a sign per column, one in eight flipped): its payload predicts
    signs."""
    i = np.arange(64 * 256, dtype=np.uint64)
    x = ((i + np.uint64(7)) * np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
    u = ((x >> np.uint64(51)) | np.uint64(0x3C00)).astype(np.uint16)  # 2^-7 .. 2^1, positive
    rows, cols = i // np.uint64(256), i % np.uint64(256)
    negative = ((rows * np.uint64(5) + cols * np.uint64(3)) % np.uint64(7) < np.uint64(3)) ^ (
        (x >> np.uint64(7)) % np.uint64(8) == 0
    )
    changed = (x >> np.uint64(20)) % np.uint64(3) != 0
    v = u.astype(np.int64) + np.where(changed, np.where(negative, -1, 1), 0)
    return u.view(np.uint8), v.astype(np.uint16).view(np.uint8)


@cache
def _stored_payloads() -> dict[str, str]:
    """warm_up_payloads.json (shipped with the package), base64 payloads by case: "BF16", "F16" and
    "F32" are ``encode_delta(*tensors(dtype), dtype, (8, 256), dense_fraction=2.0)``,
    "BF16 signs" is ``encode_delta(*sign_tensors(), "BF16", (64, 256), dense_fraction=2.0)``
    (predicted signs), each as written when it was stored (later encoders may write other bytes)."""
    return json.loads(resources.files(__package__).joinpath("warm_up_payloads.json").read_text())


def stored_payload(name: str) -> bytes:
    """The stored payload of one warm-up case (see :func:`_stored_payloads`)."""
    return base64.b64decode(_stored_payloads()[name])


def warm_up(encoder: bool = True) -> None:
    """Compile (or load from numba's on-disk cache) the decoder's kernels, and the encoder's
    unless ``encoder`` is False, by coding small tensors of each float dtype with every coding
    mode. The decoder-only warm-up decodes payloads stored with the package, so a server does not
    compile the encoder it never uses. Call it early, e.g. in a background thread, so the first
    real payload does not wait for the JIT."""
    cases = [(dtype, *tensors(dtype), (8, 256)) for dtype in FLOATS]
    cases.append(("BF16 signs", *sign_tensors(), (64, 256)))
    for name, old, new, shape in cases:
        dtype = name.split()[0]
        payloads = [stored_payload(name)]
        if encoder:
            payloads.append(encode_delta(old, new, dtype, shape, dense_fraction=2.0))
        for payload in payloads:
            out = old.copy()
            decode_into(out, payload, dtype)
            if not np.array_equal(out, new):
                raise RuntimeError(f"codec v2 self-test failed for {name}")
