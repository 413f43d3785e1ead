"""Zeroed host tensors on pages fresh from the kernel, as transparent huge pages where it grants them.

A shadow build (:mod:`.shadow`) fills a gigabyte of new tensors at every update. From torch's
allocator each one is written twice (zeros, then the loader's values) and faults in 4 KiB at a
time. An anonymous mapping is zero already, and one advised ``MADV_HUGEPAGE`` faults in 2 MiB at a
time: the loader's copy is the only pass over it (docs/SWAPS.md, "What the shadow build costs").
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
#: Smaller tensors (norms, biases) come from torch's allocator: less than a page of their own.
MIN_BYTES = mmap.PAGESIZE


def zeroed_host_tensor(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``size`` and ``stride``: from MIN_BYTES on, on an anonymous private
    mapping of its own (unmapped once the tensor and its views are gone), and from HUGE_PAGE on,
    2 MiB aligned and advised as huge pages (Linux; the kernel may still give small ones); smaller
    ones from torch."""
    span = 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) if all(size) else 0
    nbytes = span * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty_strided(size, stride, dtype=dtype).zero_()
    huge = nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    mapping = mmap.mmap(-1, nbytes + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping until its last view goes
    start = -raw.data_ptr() % HUGE_PAGE if huge else 0
    if huge:
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, start, math.ceil(nbytes / mmap.PAGESIZE) * mmap.PAGESIZE)
        except OSError:  # no transparent huge pages here: small pages, still zero and written once
            pass
    return torch.as_strided(raw[start : start + nbytes].view(dtype), size, stride)
