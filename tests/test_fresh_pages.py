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


def test_fresh_bytes_are_zero_aligned_and_unmapped_with_their_last_view() -> None:
    from delta_swap.fresh_pages import fresh_bytes

    raw = fresh_bytes(3 << 20)
    assert raw.dtype.name == "uint8" and raw.shape == (3 << 20,) and not raw.any()
    address = raw.ctypes.data
    assert address % HUGE_PAGE == 0 and _mapping(address) is not None
    view = raw[100:200]
    del raw
    gc.collect()
    assert _mapping(address) is not None and not view.any()
    del view
    gc.collect()
    assert _mapping(address) is None
    assert fresh_bytes(10).tolist() == [0] * 10  # under a page: numpy's allocator


def test_the_publishers_copy_of_a_step_is_one_buffer_of_fresh_pages() -> None:
    """What a trainer hands to ``publish`` is copied at once (it keeps training), every tensor into
    one mapping of fresh pages: torch tensors of any strides, numpy arrays, host tensors, 0-d and
    empty ones, with their dtypes and shapes."""
    import numpy as np

    from delta_swap.tensors import STATE_ALIGN, HostTensor, state_to_host, to_host

    weights = torch.arange(1024 * 1536, dtype=torch.float32).reshape(1024, 1536).to(torch.bfloat16)
    sources = {
        "w": weights,
        "w_t": weights.t(),  # not contiguous
        "scale": torch.tensor(3.5),
        "empty": torch.zeros(0, 8, dtype=torch.float16),
        "np": np.arange(12, dtype=np.float32).reshape(3, 4),
        "host": to_host(torch.ones(5, dtype=torch.bfloat16)),
    }
    state = state_to_host(sources)
    assert [(state[n].dtype, state[n].shape) for n in sources] == [
        ("BF16", (1024, 1536)),
        ("BF16", (1536, 1024)),
        ("F32", ()),
        ("F16", (0, 8)),
        ("F32", (3, 4)),
        ("BF16", (5,)),
    ]
    for name, value in sources.items():
        expected = value if isinstance(value, HostTensor) else to_host(value)
        assert state[name].data.tobytes() == expected.data.tobytes(), name
    first = state["w"].data.ctypes.data
    assert first % HUGE_PAGE == 0 and all(t.data.ctypes.data % STATE_ALIGN == 0 for t in state.values())
    mapping = _mapping(first)
    assert mapping is not None
    lo, hi = (int(x, 16) for x in mapping[0].split()[0].split("-"))
    assert all(lo <= t.data.ctypes.data <= hi for t in state.values())  # one mapping for the step
    weights.add_(1)  # the trainer's next step does not touch what was published
    assert state["w"].data.tobytes() != to_host(weights).data.tobytes()


@pytest.mark.parametrize("size", [0, 7, 8, 4096, (1 << 20) + 13, (3 << 20) + 8])
def test_same_bytes_finds_a_difference_anywhere(size: int) -> None:
    import numpy as np

    from delta_swap.tensors import same_bytes

    a = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert same_bytes(a, a.copy())
    if size:
        assert not same_bytes(a, a[:-1])
        for where in (0, size // 2, size - 1):
            b = a.copy()
            b[where] ^= 0x40
            assert not same_bytes(a, b) and not same_bytes(b, a)
    assert same_bytes(a[1:], a.copy()[1:])  # unaligned views
