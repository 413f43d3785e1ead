"""Codec v2 (``DSC2``): exponent-classed ULP deltas with Golomb-coded positions and rANS magnitudes.

Why this design (measurements in benchmarks/README.md): between adjacent RL checkpoints an element
``w`` changes when its fp32 master weight crosses a bf16 rounding boundary, so the chance that it
changes is ~ |update| / ulp(w), which doubles for every binade ``w`` goes down, and the size of the
step grows the same way. The decoder holds the old tensor, so the old element's *exponent* is free
context. v2 splits the elements into *classes* (contiguous ranges of the old exponent, chosen per
tensor by a small dynamic program that trades model fit against per-class header bytes) and codes,
per class and in natural order within the class:

* the change positions as Golomb-coded gaps between class ranks (for classes where most elements
  change, the gaps between the *unchanged* ones), one Golomb parameter per class;
* the value as the signed distance in ordered-integer space (mostly +-1): one sign bit, and
  |step| - 1 either implied (all ones), Golomb-coded, or rANS-coded with a per-class table. The
  sign bits are raw, or, for matrices where it is smaller, "flip" bits against a low-rank
  prediction of the signs (:mod:`.sign_model`, header flag 1), rANS-coded eight at a time;
* optionally the rows (last dimension of the tensor's shape) that do not change at all (embedding
  rows of tokens absent from the batch), as Golomb-coded row gaps, so their elements cost nothing.

This sits within 2-6 % of the conditional entropy of that model; zstd byte planes (v1) are 1.6x
larger. Full payloads (no reference) and dtypes other than BF16/F16/F32 keep v1's approach:
byte planes + zstd (XOR for the non-float dtypes).

Decoding is one pass over the tensor in a numba kernel: per element a class lookup from the old
exponent and a per-class countdown; on an event it takes the next gap and applies the next value,
in place into a buffer that holds the old tensor. Every other cost is per changed element. The
kernels release the GIL (``nogil``), so a snapshot's tensors decode in parallel on threads, and are
cached on disk (:func:`warm_up` compiles or loads them ahead of the first payload).

The wire format is specified in docs/FORMAT.md ("Codec payload v2"); the decoder validates every
count, length and table against the expected tensor size *before* allocating, so a crafted payload
raises :class:`CorruptDataError`; it never crashes, hangs or allocates more than a bounded multiple
of the declared tensor size. Structurally valid but wrong payloads (a flipped sign bit) decode to a
wrong tensor, which the reader's checksum rejects.

Modules: :mod:`.wire` (constants, header, varints, byte planes), :mod:`.bitio` (bitstream and
Golomb codes), :mod:`.encode_kernels` and :mod:`.encoder` (the encoder's kernels and its Python
side), :mod:`.parse`, :mod:`.decode_kernels` and :mod:`.decoder` (the decoder's), :mod:`.sign_model`
(predicted signs), :mod:`.select_apply` (the BMI2 apply of BF16 deltas), :mod:`.samples` (the
warm-up), :mod:`.jit` (numba setup).
"""

from __future__ import annotations

from .decoder import decode_into, full_payload_nbytes, payload_is_delta, split_parts
from .encoder import (
    CLASS_COST,
    PART_ELEMENTS,
    ZSTD_LEVEL,
    encode_delta,
    encode_full,
    encode_part,
    join_parts,
    split_ranges,
)
from .samples import warm_up
from .wire import FLAG_SIGN_MODEL, FLOATS, MAGIC, METHOD_FULL, METHOD_SPLIT, METHOD_ULP, METHOD_XOR

__all__ = [
    "CLASS_COST",
    "PART_ELEMENTS",
    "FLAG_SIGN_MODEL",
    "FLOATS",
    "MAGIC",
    "METHOD_FULL",
    "METHOD_SPLIT",
    "METHOD_ULP",
    "METHOD_XOR",
    "ZSTD_LEVEL",
    "decode_into",
    "encode_delta",
    "encode_full",
    "full_payload_nbytes",
    "encode_part",
    "join_parts",
    "payload_is_delta",
    "split_parts",
    "split_ranges",
    "warm_up",
]
