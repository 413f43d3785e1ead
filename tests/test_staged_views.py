"""Engines must copy what they read from a staged file: the subscriber's copy of the weights is
decoded over in place at the next update, and read_staged maps files rather than copying them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from delta_swap.staged_swap import copy_views, read_staged, refuse_views


@pytest.fixture
def staged(tmp_path) -> list[tuple[str, torch.Tensor]]:
    path = tmp_path / "update.safetensors"
    save_file({"a.weight": torch.randn(64, 32).bfloat16(), "b.weight": torch.randn(16).bfloat16()}, str(path))
    return read_staged(str(path))


def test_a_tensor_that_views_the_staged_file_is_refused_and_a_copy_is_not(staged) -> None:
    kept = dict(staged)["a.weight"]
    with pytest.raises(RuntimeError, match="a shadow module holds a view of a staged file"):
        refuse_views([torch.zeros(3), kept[1:3]], staged, "a shadow module")
    refuse_views([kept.clone(), "not a tensor", torch.empty(0)], staged, "a shadow module")


def test_parameters_and_buffers_left_viewing_the_staged_file_get_copies(staged) -> None:
    tensors = dict(staged)
    model = torch.nn.Linear(32, 64, bias=False).bfloat16()
    model.weight.data = tensors["a.weight"]  # a loader that kept what it was handed
    model.register_buffer("scale", tensors["b.weight"])
    model.register_buffer("own", torch.ones(4))
    assert copy_views(model, staged) == 2
    assert torch.equal(model.weight, tensors["a.weight"]) and torch.equal(model.scale, tensors["b.weight"])
    refuse_views([model.weight, model.scale, model.own], staged, "the model")
    assert copy_views(model, staged) == 0
