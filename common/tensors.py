"""Host tensors: raw little-endian bytes plus dtype and shape, independent of any framework."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import dtype_size, from_numpy_dtype, from_torch_dtype, to_torch_dtype
from .errors import ConfigError


@dataclass(frozen=True)
class HostTensor:
    """A tensor held as raw bytes in host memory (``data`` is a 1-D uint8 array)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def __post_init__(self) -> None:
        if self.data.dtype != np.uint8 or self.data.ndim != 1:
            raise ValueError("HostTensor.data must be a 1-D uint8 array")
        if self.data.size != math.prod(self.shape) * dtype_size(self.dtype):
            raise ValueError(f"{self.data.size} bytes do not fit {self.dtype}{list(self.shape)}")

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    def to_torch(self) -> Any:
        """A torch tensor viewing a copy of these bytes (imports torch)."""
        import torch

        raw = torch.from_numpy(self.data.copy())
        return raw.view(to_torch_dtype(self.dtype)).reshape(self.shape)


StateDict = dict[str, HostTensor]
#: Name -> (dtype, shape) of a set of tensors: what an engine accepts, or what a snapshot holds.
TensorSpecs = dict[str, tuple[str, tuple[int, ...]]]


def specs_of(state: Mapping[str, HostTensor]) -> TensorSpecs:
    """The (dtype, shape) of every tensor of ``state``."""
    return {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}


def to_host(value: Any) -> HostTensor:
    """Copy a torch tensor (any device, any strides), numpy array or HostTensor into a new
    HostTensor.

    The copy is taken now, so the caller may keep training and mutating its own tensor.
    """
    if isinstance(value, HostTensor):
        return HostTensor(value.dtype, value.shape, value.data.copy())
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        return HostTensor(from_numpy_dtype(arr.dtype), tuple(arr.shape), arr.reshape(-1).view(np.uint8).copy())
    if type(value).__module__.startswith("torch"):
        import torch

        t = value.detach()
        raw = np.empty(t.numel() * t.element_size(), np.uint8)
        if raw.size:  # one copy, straight from the tensor's device and strides
            torch.from_numpy(raw).view(t.dtype).view(t.shape).copy_(t)
        return HostTensor(from_torch_dtype(t.dtype), tuple(t.shape), raw)
    raise ConfigError(f"cannot publish a {type(value).__name__}; pass torch tensors or numpy arrays")


#: Bytes :func:`same_bytes` compares at a time.
COMPARE_CHUNK = 1 << 20


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two 1-D uint8 arrays hold the same bytes. Compared a chunk at a time, as 64-bit
    words where the chunk allows (a contiguous multiple of 8 bytes), and stopping at the first
    chunk that differs: a tensor that changed costs about one chunk (not a pass over both and a
    boolean array of its size), one that did not a pass at memory speed."""
    if a.size != b.size:
        return False
    for start in range(0, a.size, COMPARE_CHUNK):
        x, y = a[start : start + COMPARE_CHUNK], b[start : start + COMPARE_CHUNK]
        if x.size % 8 == 0 and x.flags.c_contiguous and y.flags.c_contiguous:
            x, y = x.view(np.uint64), y.view(np.uint64)
        if not np.array_equal(x, y):
            return False
    return True


def state_to_host(tensors: Mapping[str, Any]) -> StateDict:
    """Copy a mapping of named tensors into host tensors."""
    return {name: to_host(value) for name, value in tensors.items()}
