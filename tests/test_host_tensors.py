"""Host tensors (delta_swap.tensors): the publisher's copy of what a trainer hands it, and the
comparison that finds which tensors changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from delta_swap.tensors import HostTensor, same_bytes, to_host


def test_a_copy_keeps_dtype_shape_and_bytes_whatever_the_source() -> None:
    weights = torch.arange(64 * 96, dtype=torch.float32).reshape(64, 96).to(torch.bfloat16)
    sources = {
        "w": (weights, "BF16", (64, 96), weights),
        "w_t": (weights.t(), "BF16", (96, 64), weights.t().contiguous()),  # strides of a view
        "scale": (torch.tensor(3.5), "F32", (), torch.tensor(3.5)),
        "empty": (torch.zeros(0, 8, dtype=torch.float16), "F16", (0, 8), torch.zeros(0, 8, dtype=torch.float16)),
        "grad": (torch.ones(3, requires_grad=True), "F32", (3,), torch.ones(3)),
    }
    for name, (value, dtype, shape, expected) in sources.items():
        host = to_host(value)
        assert (host.dtype, host.shape) == (dtype, shape), name
        assert host.data.tobytes() == expected.reshape(-1).view(torch.uint8).numpy().tobytes(), name
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert to_host(array.T).data.tobytes() == np.ascontiguousarray(array.T).tobytes()
    host = to_host(weights)
    again = to_host(host)
    assert isinstance(again, HostTensor) and again.data.tobytes() == host.data.tobytes()
    assert again.data.ctypes.data != host.data.ctypes.data
    weights.add_(1)  # the trainer's next step does not touch what was copied
    assert host.data.tobytes() != to_host(weights).data.tobytes()


@pytest.mark.parametrize("size", [0, 7, 8, 4096, (1 << 20) + 13, (3 << 20) + 8])
def test_same_bytes_finds_a_difference_anywhere(size: int) -> None:
    a = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert same_bytes(a, a.copy())
    if size:
        assert not same_bytes(a, a[:-1])
        for where in (0, size // 2, size - 1):
            b = a.copy()
            b[where] ^= 0x40
            assert not same_bytes(a, b) and not same_bytes(b, a)
    assert same_bytes(a[1:], a.copy()[1:])  # views that do not start on a word
    assert same_bytes(a[::2], a.copy()[::2])  # strided views
    if size > 16:
        b = a.copy()
        b[2] ^= 1
        assert not same_bytes(a[::2], b[::2]) and same_bytes(a[1::2], b[1::2])
