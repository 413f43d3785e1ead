"""What every codec entry point takes: a tensor as its raw bytes, a 1-D uint8 array."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError

#: An encoded payload as the decoders take it: bytes, or a buffer over them (a memoryview, or a
#: uint8 array such as a slice of a mapped shard).
Payload = bytes | memoryview | np.ndarray


def raw_bytes(arr: np.ndarray, what: str) -> np.ndarray:
    """``arr`` itself; ConfigError unless it is a 1-D uint8 array (``what`` names it)."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 1:
        raise ConfigError(f"{what} must be a 1-D uint8 array of raw tensor bytes")
    return arr


def payload_view(payload: Payload) -> memoryview:
    """``payload`` as a memoryview (no copy)."""
    return memoryview(payload)  # type: ignore[arg-type]  # numpy types ndarray a Buffer on Python 3.12+ only
