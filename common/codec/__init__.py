"""Lossless, bit-exact tensor codec: the one entry point the rest of delta-swap uses.

New payloads are written by codec v2 (:mod:`.v2`, magic ``DSC2``: exponent-classed ULP
deltas, Golomb-coded positions, rANS magnitudes, numba kernels); payloads of codec v1
(:mod:`.v1`, ``DSC1``: zstd byte planes) still decode, so stores written before v2 stay
readable. Every decoder dispatches on the payload's magic; the wire formats are in docs/FORMAT.md.

codec v2 needs numba; it is imported on first use, so ``import delta_swap`` stays light. Its
kernels are JIT-compiled once per machine and cached on disk; :func:`warm_up` compiles them now
(servers and publishers do that in the background: :mod:`delta_swap.codec_warm_up`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from ..errors import ConfigError, CorruptDataError
from ..manifest import Encoding
from . import v1
from .inputs import Payload, payload_view, raw_bytes
from .memory import EncoderMemory as EncoderMemory
from .memory import TensorMemory

#: The codec version new payloads are written with.
LATEST_VERSION = 2
#: Encoder levels (:attr:`CodecConfig.level`): what each one does.
LEVELS = {1: "fast: no sign model", 2: "default: a sign model per matrix where it pays"}
_MAGICS = {b"DSC1": 1, b"DSC2": 2}


@dataclass(frozen=True)
class CodecConfig:
    """Encoder knobs; the decoder needs none of them."""

    zstd_level: int = 3
    #: Above this fraction of changed elements the encoder also tries a full payload (codec v2:
    #: when the delta also exceeds a quarter of the tensor's bytes).
    dense_fraction: float = 0.125
    #: Codec version of new payloads: 2, or 1 for readers that predate codec v2.
    version: int = LATEST_VERSION
    #: Codec v2: code the signs of a matrix's steps against a low-rank prediction where that is
    #: smaller (~4% smaller payloads at lr 1e-5, a rebuild some % slower: benchmarks/README.md).
    predict_signs: bool = True
    #: Codec v2's encoder effort, as zstd has levels (the decoder is the same): 2 (default) tries
    #: the sign model on every matrix, the smallest payloads; 1 skips it, for an encode ~1.4-1.9x as
    #: fast and payloads ~4-5% larger at lr 1e-5 (about the same at 1e-6). Measured on
    #: benchmarks/codec_bench.py's corpora: benchmarks/README.md, "Encoder levels". At level 2 an
    #: :class:`EncoderMemory` (the publisher keeps one) makes the fits after a matrix's first one
    #: refinements of the last step's model, and skips the next 3 after a fit that found no pattern.
    level: int = 2
    #: Codec v2: a tensor of at least twice this many elements is coded in parts of about this
    #: many (whole rows each), which threads encode and decode together (2^23: 16 MiB of bf16).
    part_elements: int = 1 << 23

    def __post_init__(self) -> None:
        if self.version not in _MAGICS.values():
            raise ConfigError(f"unknown codec version {self.version} (known: {sorted(_MAGICS.values())})")
        if self.level not in LEVELS:
            raise ConfigError(f"unknown codec level {self.level} (known: {sorted(LEVELS)})")
        if self.part_elements < 1:
            raise ConfigError(f"part_elements must be at least 1, not {self.part_elements}")


DEFAULT_CONFIG = CodecConfig()
_v2_lock = threading.Lock()
_v2_module: ModuleType | None = None


def _v2() -> ModuleType:
    """codec v2, imported on first use (it imports numba)."""
    global _v2_module
    if _v2_module is None:
        with _v2_lock:
            if _v2_module is None:
                from . import v2

                _v2_module = v2
    return _v2_module


def warm_up(encoder: bool = True) -> None:
    """Compile (or load from the on-disk cache) codec v2's decoder kernels now, and its encoder's
    unless ``encoder`` is False (a server only decodes)."""
    _v2().warm_up(encoder)


def payload_version(payload: Payload) -> int:
    """The codec version (1 or 2) that wrote ``payload``, from its magic."""
    magic = bytes(payload_view(payload)[:4])
    if magic not in _MAGICS:
        raise CorruptDataError(f"bad payload magic {magic!r}")
    return _MAGICS[magic]


# --------------------------------------------------------------------------- encoder


def encode_full(new: np.ndarray, dtype: str, config: CodecConfig = DEFAULT_CONFIG) -> bytes:
    """Encode one tensor on its own (no reference)."""
    if config.version == 1:
        return v1.encode_full(new, dtype, config.zstd_level)
    return _v2().encode_full(new, dtype, config.zstd_level)


def encode_tensor_delta(
    old: np.ndarray | None,
    new: np.ndarray,
    dtype: str,
    config: CodecConfig = DEFAULT_CONFIG,
    shape: tuple[int, ...] | None = None,
    memory: TensorMemory | None = None,
) -> bytes:
    """Encode ``new`` against ``old`` (raw bytes of the same dtype and size).

    Returns a full payload when ``old`` is None or when that is smaller than the delta. ``shape``
    (optional) lets codec v2 skip the rows (last dimension) that did not change at all.
    ``memory`` (optional): this tensor's :meth:`EncoderMemory.tensor`, the same every step.
    """
    new = raw_bytes(new, "new")
    if old is None:
        return encode_full(new, dtype, config)
    if config.version == 1:
        return v1.encode_tensor_delta(old, new, dtype, config.zstd_level, config.dense_fraction)
    return _v2().encode_delta(
        raw_bytes(old, "old"),
        new,
        dtype,
        tuple(shape) if shape else None,
        config.zstd_level,
        config.dense_fraction,
        config.predict_signs and config.level >= 2,
        part_elements=config.part_elements,
        memory=memory,
    )


def tensor_parts(
    n_elements: int, shape: tuple[int, ...] | None, config: CodecConfig = DEFAULT_CONFIG
) -> list[tuple[int, int]]:
    """The element ranges :func:`encode_tensor_delta` codes a tensor in (one range: in one
    piece): a caller with threads encodes each with :func:`encode_part` and joins them with
    :func:`join_parts`, for the same payload byte for byte."""
    if config.version == 1:
        return [(0, n_elements)]
    return _v2().split_ranges(n_elements, tuple(shape) if shape else None, config.part_elements)


def encode_part(
    old: np.ndarray,
    new: np.ndarray,
    dtype: str,
    part: tuple[int, int],
    config: CodecConfig = DEFAULT_CONFIG,
    shape: tuple[int, ...] | None = None,
    memory: TensorMemory | None = None,
) -> bytes:
    """The payload of elements ``part`` (start, stop) of a tensor, one of :func:`tensor_parts`
    (``memory``: as :func:`encode_tensor_delta` takes it)."""
    return _v2().encode_part(
        raw_bytes(old, "old"),
        raw_bytes(new, "new"),
        dtype,
        tuple(shape) if shape else None,
        part,
        config.zstd_level,
        config.dense_fraction,
        config.predict_signs and config.level >= 2,
        memory=memory,
    )


def join_parts(dtype: str, parts: list[tuple[int, bytes]]) -> bytes:
    """One payload of the parts' payloads, (elements, payload) in order (:func:`tensor_parts`)."""
    return _v2().join_parts(dtype, parts)


# --------------------------------------------------------------------------- decoder


def payload_method(payload: Payload) -> Encoding:
    """``Encoding.DELTA`` if the payload needs the previous tensor, else ``Encoding.FULL``."""
    if payload_version(payload) == 1:
        return v1.payload_method(payload)
    return Encoding.DELTA if _v2().payload_is_delta(payload) else Encoding.FULL


def decode_into(out: np.ndarray, payload: Payload, dtype: str, executor: Executor | None = None) -> None:
    """Rebuild a tensor in place: ``out`` (raw bytes of ``dtype``) holds the previous tensor for a
    delta payload (anything for a full one) and receives the new bytes.

    Header, counts, lengths and tables are validated before ``out`` is written; a crafted payload
    raises CorruptDataError (if it is only found while applying a v2 delta, ``out`` is then partly
    rewritten: callers verify the checksum of what they rebuild, or discard ``out``).
    A payload of a large tensor in parts decodes them on ``executor``'s threads, if given.
    """
    out = raw_bytes(out, "out")
    if payload_version(payload) == 1:
        v1.decode_into(out, payload, dtype)
    else:
        _v2().decode_into(out, payload, dtype, executor)


def decode_full(payload: Payload, dtype: str, nbytes: int, executor: Executor | None = None) -> np.ndarray:
    """Decode a full payload that must rebuild exactly ``nbytes`` bytes of ``dtype``."""
    if payload_method(payload) is not Encoding.FULL:
        raise CorruptDataError("expected a full payload, got a delta")
    out = np.empty(nbytes, dtype=np.uint8)
    decode_into(out, payload, dtype, executor)
    return out


def decode(
    old: np.ndarray | None, payload: Payload, dtype: str, nbytes: int, executor: Executor | None = None
) -> np.ndarray:
    """Rebuild exactly ``nbytes`` of ``dtype`` from a full payload, or a delta applied to ``old``
    (``old`` is not modified); the parts of a large tensor's payload on ``executor``, if given."""
    if payload_method(payload) is Encoding.FULL:
        return decode_full(payload, dtype, nbytes, executor)
    if old is None:
        raise CorruptDataError("delta payload but no previous tensor to apply it to")
    old = raw_bytes(old, "old")
    if old.size != nbytes:
        raise CorruptDataError(f"previous tensor has {old.size} bytes, delta expects {nbytes}")
    out = old.copy()
    decode_into(out, payload, dtype, executor)
    return out


def decode_tensor_delta(old: np.ndarray | None, payload: Payload, dtype: str) -> np.ndarray:
    """Rebuild the new tensor bytes from ``old`` and a payload made by :func:`encode_tensor_delta`.

    ``old`` may be None only for a full payload; then the size comes from the payload itself,
    so callers that know the expected size should prefer :func:`decode` with ``nbytes``.
    """
    if old is None:
        if payload_version(payload) == 1:
            header = v1._read_header(payload_view(payload))
            return decode_full(payload, dtype, header.n_elements * header.width)
        return decode_full(payload, dtype, _v2().full_payload_nbytes(payload))
    return decode(old, payload, dtype, raw_bytes(old, "old").size)
