"""delta_swap.param_switch (the shadow path for plain host tensors) on a stand-in torch model that
loads by name through its parameters' loaders, as engines do: a fused parameter loaded one
constituent at a time, a head sharing the embedding's parameter, experts loaded one expert at a
time into one fused tensor. The real engine runs in tests/test_sglang_exactness.py (the Shadow
classes and TestQwen3TiedAutoTP2)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import pytest
import torch

from delta_swap.errors import EngineError
from delta_swap.param_switch import build_parameter_switch
from delta_swap.staged_swap import StagedSwap, merge_staged

PACKED = {"qkv": ["q", "k", "v"]}


def default_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


class Model(torch.nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)

        def param(*shape: int) -> torch.nn.Parameter:
            t = torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)
            return torch.nn.Parameter(t, requires_grad=False)

        self.embed = torch.nn.Module()
        self.embed.weight = param(6, 4)
        self.head = torch.nn.Module()
        self.head.weight = self.embed.weight  # tied: one parameter object
        self.qkv = torch.nn.Module()
        self.qkv.weight = param(6, 4)
        self.qkv.weight.weight_loader = self._fused_loader  # type: ignore[attr-defined]
        self.experts = torch.nn.Module()
        self.experts.w = param(3, 2, 4)
        self.experts.w.weight_loader = self._expert_loader  # type: ignore[attr-defined]

    @staticmethod
    def _fused_loader(param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
        param.data[2 * shard : 2 * shard + 2].copy_(loaded)

    @staticmethod
    def _expert_loader(param: torch.Tensor, loaded: torch.Tensor, expert: int) -> None:
        param.data[expert].copy_(loaded)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name == "head.weight":  # tied: the engine skips it
                continue
            if name.startswith("qkv."):
                part = name.split(".")[1]
                params["qkv.weight"].weight_loader(params["qkv.weight"], tensor, PACKED["qkv"].index(part))  # type: ignore[attr-defined]
            elif name.startswith("experts."):
                params["experts.w"].weight_loader(params["experts.w"], tensor, int(name.split(".")[1]))  # type: ignore[attr-defined]
            else:
                getattr(params[name], "weight_loader", default_loader)(params[name], tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x + self.embed.weight[0]) @ self.qkv.weight.t()
        return (h[:, :4] + self.experts.w.sum((0, 1))) @ self.head.weight.t()


def _moved(t: torch.Tensor) -> torch.Tensor:
    bits = t.clone().view(torch.int16).reshape(-1)
    bits[::3] += 1
    return bits.view(torch.bfloat16).reshape(t.shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16).clone()


def _update(model: Model) -> list[tuple[str, torch.Tensor]]:
    """One constituent of the fused parameter, one expert, the tied embedding."""
    return [
        ("qkv.k.weight", _moved(model.qkv.weight.data[2:4])),
        ("experts.1.weight", _moved(model.experts.w.data[1])),
        ("embed.weight", _moved(model.embed.weight.data)),
    ]


def _fresh(update: list[tuple[str, torch.Tensor]]) -> Model:
    model = Model()
    model.load_weights(update)
    return model


def test_the_switch_serves_what_a_fresh_load_serves_and_undo_gives_the_old_back() -> None:
    model = Model()
    x = torch.randn(2, 4).to(torch.bfloat16)
    before, old = model(x), {n: _bits(p) for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    update = _update(model)
    build, ignored = build_parameter_switch(model, update, PACKED, default_loader)
    assert ignored == set() and sorted(n for n, _, _ in build.targets) == ["embed.weight", "experts.w", "qkv.weight"]
    assert build.nbytes == sum(p.numel() * 2 for p in params.values())
    assert torch.equal(model(x), before)  # nothing moved before the switch
    build.switch()
    assert dict(model.named_parameters()) == params  # the same parameter objects, new tensors
    fresh = _fresh(update)
    for name, p in fresh.named_parameters():
        assert torch.equal(_bits(params[name]), _bits(p)), name
    assert torch.equal(model(x), fresh(x)) and model.head.weight is model.embed.weight
    build.undo()
    for name, p in model.named_parameters():
        assert torch.equal(_bits(p), old[name]), name


def test_unchanged_parameters_are_not_copied_and_a_tied_name_is_ignored() -> None:
    model = Model()
    same = [("qkv.q.weight", model.qkv.weight.data[0:2].clone()), ("head.weight", model.embed.weight.data.clone())]
    build, ignored = build_parameter_switch(model, same, PACKED, default_loader)
    assert build.targets == [] and ignored == {"head.weight"}


def test_a_failure_mid_switch_switches_back_and_the_staged_swap_reports_parameters() -> None:
    model, staged = Model(), StagedSwap()
    old = {n: _bits(p) for n, p in model.named_parameters()}
    staged.stage_switch(model, _update(model), PACKED, default_loader)
    deadline = time.monotonic() + 30
    while not (answer := staged.answer())["done"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert answer["parameters"] == 3 and answer["bytes"] > 0, answer
    with pytest.raises(RuntimeError, match="injected failure after switching 1 parameters"):
        staged.apply("switch", model, fail_after=1)
    for name, p in model.named_parameters():
        assert torch.equal(_bits(p), old[name]), name
    count, undo = staged.apply("switch", model)  # the build is still there: a retry switches it in
    assert count == 3 and not torch.equal(_bits(model.embed.weight), old["embed.weight"])
    undo.undo()
    for name, p in model.named_parameters():
        assert torch.equal(_bits(p), old[name]), name
    staged.apply("switch", model)  # the engine's own loads write into switched-in tensors later
    for p in model.parameters():
        p.data[0].add_(1)  # a view, outside inference mode: an inference tensor's would refuse
    with pytest.raises(RuntimeError, match="scatter before stage_inplace"):
        staged.apply("scatter", model)
    staged.shutdown()
    assert merge_staged([answer, answer]) == {"parameters": 6, "bytes": answer["bytes"], "seconds": answer["seconds"]}


def test_a_build_failure_is_answered_and_nothing_moves() -> None:
    model, staged = Model(), StagedSwap()
    old = {n: _bits(p) for n, p in model.named_parameters()}
    staged.stage_switch(model, _update(model), PACKED, default_loader, fail_after=1)
    deadline = time.monotonic() + 30
    while not (answer := staged.answer())["done"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "injected failure mid-build after 1 modules" in answer["error"], answer
    for name, p in model.named_parameters():
        assert torch.equal(_bits(p), old[name]), name
    staged.shutdown()


def test_parameters_off_the_host_are_refused() -> None:
    model = Model(device="meta")
    with pytest.raises(EngineError, match="not a plain host tensor"):
        build_parameter_switch(model, [("embed.weight", torch.zeros(6, 4, dtype=torch.bfloat16))], {}, default_loader)
