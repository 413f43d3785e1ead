"""Zeroed host tensors on fresh pages (``delta_swap.fresh_pages``), which the vLLM shadow build fills."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from delta_swap.fresh_pages import HUGE_PAGE, zeroed_host_tensor

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")


def _mapping(address: int) -> list[str] | None:
    """The /proc/self/smaps lines of the mapping holding ``address`` (None: not mapped)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("VmFlags")), i)
                return lines[i : end + 1]
    return None


def test_zeroed_host_tensors_are_zero_aligned_advised_and_unmapped_with_their_last_view() -> None:
    tensor = zeroed_host_tensor((1024, 1536), (1536, 1), torch.bfloat16)  # 3 MiB: a mapping of its own
    assert tensor.shape == (1024, 1536) and tensor.stride() == (1536, 1) and tensor.dtype == torch.bfloat16
    assert not tensor.any() and tensor.data_ptr() % HUGE_PAGE == 0
    address = tensor.data_ptr()
    mapping = _mapping(address)
    assert mapping is not None
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert " hg" in mapping[-1]  # advised MADV_HUGEPAGE (whether the kernel grants it is its choice)
    tensor.copy_(torch.arange(1024 * 1536).reshape(1024, 1536) % 251)  # exact in bf16
    view = torch.nn.Parameter(tensor[10:20], requires_grad=False)  # as a loader's narrow() or a parameter
    del tensor
    gc.collect()
    assert _mapping(address) is not None and view[0, 1].item() == (10 * 1536 + 1) % 251
    del view
    gc.collect()
    assert _mapping(address) is None  # unmapped with its last view


def test_small_or_strided_zeroed_host_tensors_keep_their_layout() -> None:
    small = zeroed_host_tensor((4, 4), (1, 4), torch.float32)  # torch's allocator
    assert small.stride() == (1, 4) and not small.any()
    page = zeroed_host_tensor((64, 64), (64, 1), torch.bfloat16)  # 8 KiB: a small mapping, not advised
    mapping = _mapping(page.data_ptr())
    assert mapping is not None and " hg" not in mapping[-1] and not page.any()
    wide = zeroed_host_tensor((1024, 2048), (1, 1024), torch.float32)  # 8 MiB, column-major
    assert wide.stride() == (1, 1024) and wide.t().is_contiguous() and not wide.any()
    assert wide.data_ptr() % HUGE_PAGE == 0
    empty = zeroed_host_tensor((0, 8), (8, 1), torch.bfloat16)
    assert empty.shape == (0, 8)
