"""The delta shard (``.dsd``, docs/FORMAT.md): the 8-byte magic ``DSWPSHD1``, then the codec
payloads of a rank's tensors back to back, each addressed by its manifest entry."""

from __future__ import annotations

import numpy as np

from .errors import CorruptDataError

DELTA_SHARD_MAGIC = b"DSWPSHD1"
#: The file extension of a delta shard (a base shard is a plain ``.safetensors`` file).
DELTA_SHARD_EXT = "dsd"


def is_delta_shard(name: str) -> bool:
    """Whether the shard called ``name`` is a delta shard (by its extension)."""
    return name.endswith("." + DELTA_SHARD_EXT)


def check_delta_shard(head: bytes | memoryview | np.ndarray, what: str) -> None:
    """Raise CorruptDataError unless ``head`` (a delta shard's first bytes) starts with the magic."""
    if bytes(head[: len(DELTA_SHARD_MAGIC)]) != DELTA_SHARD_MAGIC:
        raise CorruptDataError(f"{what} is not a delta shard (it does not start with {DELTA_SHARD_MAGIC.decode()})")
