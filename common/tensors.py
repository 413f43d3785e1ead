"""Host tensors: raw little-endian bytes plus dtype and shape, independent of any framework."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import dtype_size, from_numpy_dtype, from_torch_dtype, to_torch_dtype
from .errors import ConfigError
from .fresh_pages import fresh_bytes


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
    """Copy a torch tensor, numpy array or HostTensor into a new HostTensor.

    The copy is taken now, so the caller may keep training and mutating its own tensor.
    """
    dtype, shape, nbytes, fill = _source(value)
    data = np.empty(nbytes, np.uint8)
    fill(data)
    return HostTensor(dtype, shape, data)


#: Bytes :func:`same_bytes` compares at a time.
COMPARE_CHUNK = 1 << 20


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two 1-D uint8 arrays hold the same bytes. Compared a chunk at a time, as 64-bit
    words where the chunk allows, and stopping at the first chunk that differs: a tensor that
    changed costs about one chunk (not a pass over both and a boolean array of its size), one
    that did not a pass at memory speed."""
    if a.size != b.size:
        return False
    for start in range(0, a.size, COMPARE_CHUNK):
        x, y = a[start : start + COMPARE_CHUNK], b[start : start + COMPARE_CHUNK]
        if x.size % 8 == 0:
            x, y = x.view(np.uint64), y.view(np.uint64)
        if not np.array_equal(x, y):
            return False
    return True


#: Where each tensor of :func:`state_to_host` starts in its buffer: a multiple of this many bytes.
STATE_ALIGN = 64


def state_to_host(tensors: Mapping[str, Any]) -> StateDict:
    """Copy a mapping of named tensors (torch tensors on any device, numpy arrays, HostTensors)
    into host tensors, all of them in one buffer on fresh (huge) pages
    (:func:`delta_swap.fresh_pages.fresh_bytes`), freed when the last of them goes. A publisher
    copies the whole model at every step: from the heap, each copy faults in 4 KiB pages, and a
    mapping per tensor would count against the kernel's limit on mappings for a model of many
    experts."""
    sources = [(name, _source(value)) for name, value in tensors.items()]
    starts, total = [], 0
    for _, (_, _, nbytes, _) in sources:
        starts.append(total)
        total += -(-nbytes // STATE_ALIGN) * STATE_ALIGN
    buffer = fresh_bytes(total)
    state = {}
    for (name, (dtype, shape, nbytes, fill)), start in zip(sources, starts, strict=True):
        data = buffer[start : start + nbytes]
        fill(data)
        state[name] = HostTensor(dtype, shape, data)
    return state


def _source(value: Any) -> tuple[str, tuple[int, ...], int, Callable[[np.ndarray], None]]:
    """The dtype, shape and byte size of a tensor to copy, and how to copy it into given bytes."""
    if isinstance(value, HostTensor):
        return value.dtype, value.shape, value.nbytes, lambda out: np.copyto(out, value.data)
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        return (
            from_numpy_dtype(arr.dtype),
            tuple(arr.shape),
            arr.nbytes,
            lambda out: np.copyto(out, arr.reshape(-1).view(np.uint8)),
        )
    if type(value).__module__.startswith("torch"):
        import torch

        t = value.detach()
        nbytes = t.numel() * t.element_size()

        def fill(out: np.ndarray) -> None:  # one copy, from any device and any strides
            if nbytes:
                torch.from_numpy(out).view(t.dtype).view(t.shape).copy_(t)

        return from_torch_dtype(t.dtype), tuple(t.shape), nbytes, fill
    raise ConfigError(f"cannot publish a {type(value).__name__}; pass torch tensors or numpy arrays")
