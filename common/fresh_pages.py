"""Zeroed host memory on pages fresh from the kernel, as transparent huge pages where it grants them.

A buffer filled right after it is allocated (a shadow build's new tensors at every update, the
publisher's copy of every step) is written twice from an allocator (zeros, then the values) and
faults in 4 KiB at a time. An anonymous mapping is zero already, and one advised
``MADV_HUGEPAGE`` faults in 2 MiB at a time: the fill is the only pass over it (docs/SWAPS.md,
"What the shadow build costs").
"""

from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

HUGE_PAGE = 2 << 20
#: Smaller buffers (norms, biases) come from the usual allocator: less than a page of their own.
MIN_BYTES = mmap.PAGESIZE


def fresh_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` zeroed bytes (a 1-D uint8 array): from MIN_BYTES on, on an anonymous private
    mapping of their own (unmapped once the array and its views are gone), and from HUGE_PAGE on,
    2 MiB aligned and advised as huge pages (Linux; the kernel may still give small ones); smaller
    ones from numpy."""
    if nbytes < MIN_BYTES or not hasattr(mmap, "MAP_PRIVATE"):
        return np.zeros(nbytes, np.uint8)
    huge = nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    mapping = mmap.mmap(-1, nbytes + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(mapping, dtype=np.uint8)  # holds the mapping until its last view goes
    start = -raw.ctypes.data % HUGE_PAGE if huge else 0
    if huge:
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, start, math.ceil(nbytes / mmap.PAGESIZE) * mmap.PAGESIZE)
        except OSError:  # no transparent huge pages here: small pages, still zero and written once
            pass
    return raw[start : start + nbytes]


def zeroed_host_tensor(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``size`` and ``stride`` on :func:`fresh_bytes` (smaller than
    MIN_BYTES: from torch's allocator)."""
    import torch

    span = 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) if all(size) else 0
    nbytes = span * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty_strided(size, stride, dtype=dtype).zero_()
    raw = torch.from_numpy(fresh_bytes(nbytes))  # shares the mapping and holds it
    return torch.as_strided(raw.view(dtype), size, stride)
