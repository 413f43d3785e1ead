"""What every codec entry point takes: a tensor as its raw bytes, a 1-D uint8 array."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError


def raw_bytes(arr: np.ndarray, what: str) -> np.ndarray:
    """``arr`` itself; ConfigError unless it is a 1-D uint8 array (``what`` names it)."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 1:
        raise ConfigError(f"{what} must be a 1-D uint8 array of raw tensor bytes")
    return arr
