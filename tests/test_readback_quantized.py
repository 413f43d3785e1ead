"""delta_swap.readback on modules an engine quantized: a module nothing can read back fails the
read-back (it never passes silently), and MoE experts go to the engine's own check first
(vLLM's, for experts quantized as they load: tests/test_vllm_verify.py and the int8 exactness
class run it on real servers). The model here is a stand-in torch module."""

from __future__ import annotations

import pytest
import torch

from delta_swap.errors import ChecksumMismatchError
from delta_swap.readback import verify_modules


class Int8Method:
    """Stands in for an engine's quantization method (only its class name matters here)."""


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(2, 8, 4, dtype=torch.int8), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(2, 4, 4, dtype=torch.int8), requires_grad=False)
        self.quant_method = Int8Method()


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)
        self.proj.quant_method = Int8Method()
        self.mlp = torch.nn.Module()
        self.mlp.experts = torch.nn.Module()
        self.mlp.experts.routed_experts = Experts()  # where vLLM keeps them


def _experts_tensors() -> dict[str, torch.Tensor]:
    return {
        f"mlp.experts.{e}.{proj}.weight": torch.ones(4, 4, dtype=torch.bfloat16)
        for e in range(2)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }


def test_a_quantized_module_nothing_can_read_back_fails_the_read_back() -> None:
    model = Model()
    with pytest.raises(ChecksumMismatchError, match="proj: cannot read back a module quantized by Int8Method"):
        verify_modules(model, {"proj.weight": torch.ones(4, 4, dtype=torch.bfloat16)}, {})
    with pytest.raises(ChecksumMismatchError, match="routed_experts: cannot read back a module quantized by"):
        verify_modules(model, _experts_tensors(), {})


def test_experts_go_to_the_engines_own_check_with_every_published_tensor_of_the_layer() -> None:
    model, seen = Model(), []

    def check(path: str, experts: torch.nn.Module, tensors: dict) -> int:
        seen.append((path, experts, sorted(tensors)))
        return 1

    assert verify_modules(model, _experts_tensors(), {}, experts_check=check) == 1
    assert seen == [("mlp.experts.routed_experts", model.mlp.experts.routed_experts, sorted(_experts_tensors()))]

    def refuse(path: str, experts: torch.nn.Module, tensors: dict) -> int:
        raise ChecksumMismatchError(f"{path}.1: the engine computes with other values than the snapshot")

    with pytest.raises(ChecksumMismatchError, match="routed_experts.1: the engine computes"):
        verify_modules(model, _experts_tensors(), {}, experts_check=refuse)
