"""delta_swap.shadow on a stand-in engine written here: a torch model that loads like vLLM's (fused
q/k/v with shard ids, a tied head sharing the embedding's parameter, biases) and processes its
linears after loading into a packed copy held by a closure, emptying the weight, as vLLM's CPU
linears do. The real engine runs in tests/test_vllm_exactness.py (the Shadow classes)."""

from __future__ import annotations

import pytest
import torch

from delta_swap.shadow import ShadowUnsupported, build_shadows

HIDDEN, VOCAB = 8, 16


def default_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


class Linear(torch.nn.Module):
    """A linear that packs its weight (transposed, doubled) into ``packed_linear`` after loading."""

    def __init__(self, rows: int, shards: dict[str, tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.rows, self.shards = rows, shards or {}
        self.weight = torch.nn.Parameter(torch.zeros(rows, HIDDEN), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(rows), requires_grad=False)
        for p in (self.weight, self.bias):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        start, size = self.shards[shard] if shard else (0, self.rows)
        param.data[start : start + size].copy_(loaded)

    def process(self) -> None:
        packed = (self.weight.data.t() * 2).contiguous()
        self.packed_linear = lambda x: x @ packed / 2 + self.bias
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed_linear(x)


class Embedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(VOCAB, HIDDEN), requires_grad=False)

    def process(self) -> None:
        pass


class Head(torch.nn.Module):
    """Shares the embedding's parameter; packs a copy of it for the logits."""

    def __init__(self, embedding: Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def process(self) -> None:
        packed = self.weight.data.t().clone()
        self.logits = lambda h: h @ packed


class Experts(torch.nn.Module):
    """A module the stand-in engine cannot build a shadow of."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, HIDDEN), requires_grad=False)

    def process(self) -> None:
        pass


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embedding()
        self.qkv = Linear(12, {"q": (0, 4), "k": (4, 4), "v": (8, 4)})
        self.o = Linear(HIDDEN)
        self.head = Head(self.embed)
        self.experts = Experts()

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name == "head.weight":  # tied: the engine skips it, as vLLM does
                continue
            module, _, kind = name.rpartition(".")
            if module in ("q", "k", "v"):
                param = params[f"qkv.{kind}"]
                param.weight_loader(param, tensor, module)
            else:
                param = params[name]
                getattr(param, "weight_loader", default_loader)(param, tensor)

    def process(self) -> None:
        for m in (self.embed, self.qkv, self.o, self.head):
            m.process()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed.weight[tokens]
        h = torch.tanh(self.qkv(h)[:, :HIDDEN] + self.o(h))
        return self.head.logits(h)


class StandInEngine:
    """Load-time forms recorded at build, as vLLM records them for its layerwise reload."""

    def __init__(self, model: Model) -> None:
        self.shapes = {id(m): {n: p.shape for n, p in m._parameters.items()} for m in model.modules()}

    def unprocessed_copy(self, module: torch.nn.Module) -> torch.nn.Module:
        from delta_swap.loader_redirect import scratch_of
        from delta_swap.shadow import shallow_copy

        if isinstance(module, Experts):
            raise ShadowUnsupported("experts keep kernel state outside the module")
        shadow = shallow_copy(module)
        for name, shape in self.shapes[id(module)].items():
            if name == "bias":  # copied from the live module, as vLLM does (it records no bias)
                shadow._parameters[name] = scratch_of(module._parameters[name])
                continue
            fresh = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
            if isinstance(module, Linear):
                fresh.weight_loader = shadow.weight_loader  # type: ignore[attr-defined]
            shadow._parameters[name] = fresh
        return shadow

    def process(self, module: torch.nn.Module) -> None:
        module.process()  # type: ignore[operator]


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (VOCAB, HIDDEN), "o.weight": (HIDDEN, HIDDEN), "o.bias": (HIDDEN,)}
    shapes |= {f"{p}.weight": (4, HIDDEN) for p in "qkv"} | {f"{p}.bias": (4,) for p in "qkv"}
    shapes |= {"experts.weight": (2, HIDDEN)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def built(state: dict[str, torch.Tensor]) -> tuple[Model, StandInEngine]:
    model = Model()
    engine = StandInEngine(model)
    model.load_weights(state.items())
    model.process()
    return model, engine


TOKENS = torch.arange(VOCAB)


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param(["k.weight"], id="one constituent of a fused module"),
        pytest.param(["q.bias", "k.bias", "v.bias"], id="biases alone"),
        pytest.param(["embed.weight"], id="the embedding of a tied model"),
        pytest.param(["o.weight", "embed.weight", "v.bias"], id="several modules"),
    ],
)
def test_the_switch_serves_what_a_fresh_build_serves_and_undo_gives_the_old_back(changed) -> None:
    old, new = checkpoint(0), checkpoint(0)
    for name in changed:
        new[name] = new[name] + 0.5
    model, engine = built(old)
    before = model(TOKENS)
    fused = {"qkv": ["q", "k", "v"]}
    modules = {"q": "qkv", "k": "qkv", "v": "qkv"}
    whole = sorted(
        n
        for n in new
        if modules.get(n.split(".")[0], n.split(".")[0])
        in {modules.get(c.split(".")[0], c.split(".")[0]) for c in changed}
    )
    build, ignored = build_shadows(model, [(n, new[n]) for n in whole], fused, engine, default_loader)
    assert not ignored
    assert torch.equal(model(TOKENS), before), "building the shadows changed what the live model computes"
    build.switch()
    expected = built(new)[0](TOKENS)
    assert not torch.equal(expected, before)
    assert torch.equal(model(TOKENS), expected)
    if "embed.weight" in changed:  # the tied head was rebuilt on the new embedding
        assert {s.path for s in build.switches} >= {"embed", "head"}
    build.undo()
    assert torch.equal(model(TOKENS), before)


def test_a_failure_mid_switch_switches_back() -> None:
    old, new = checkpoint(0), checkpoint(1)
    model, engine = built(old)
    before = model(TOKENS)
    names = [n for n in new if not n.startswith("experts")]
    build, _ = build_shadows(model, [(n, new[n]) for n in names], {"qkv": ["q", "k", "v"]}, engine, default_loader)
    assert len(build.switches) == 4  # embed, head, qkv, o

    def fail(done: int) -> None:
        if done == 2:
            raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        build.switch(fail)
    assert torch.equal(model(TOKENS), before)
    assert all(s.old is None for s in build.switches)


def test_a_module_the_engine_cannot_shadow_is_refused_before_anything_changes() -> None:
    old, new = checkpoint(0), checkpoint(1)
    model, engine = built(old)
    before = model(TOKENS)
    with pytest.raises(ShadowUnsupported, match="experts"):
        build_shadows(
            model,
            [("o.weight", new["o.weight"]), ("o.bias", new["o.bias"]), ("experts.weight", new["experts.weight"])],
            {},
            engine,
            default_loader,
        )
    assert torch.equal(model(TOKENS), before)


def test_a_tied_name_the_engine_skips_is_reported_ignored() -> None:
    model, engine = built(checkpoint(0))
    new = checkpoint(1)
    _, ignored = build_shadows(model, [("head.weight", new["embed.weight"])], {}, engine, default_loader)
    assert ignored == {"head.weight"}


def test_updates_in_a_row_each_serve_what_a_fresh_build_serves() -> None:
    """A switched-in module is built from again: its copied tensors carry their own loaders, not
    the redirects in place while they were copied."""
    states = [checkpoint(0)]
    for step in range(1, 4):
        states.append(
            {n: t + 0.25 * step if n.endswith("bias") or n == "embed.weight" else t for n, t in states[0].items()}
        )
    model, engine = built(states[0])
    names = [n for n in states[0] if not n.startswith("experts")]
    for state in states[1:]:
        build, _ = build_shadows(
            model, [(n, state[n]) for n in names], {"qkv": ["q", "k", "v"]}, engine, default_loader
        )
        build.switch()
        assert torch.equal(model(TOKENS), built(state)[0](TOKENS))


def test_a_replaced_state_goes_when_the_swap_is_final_without_the_cyclic_collector(monkeypatch) -> None:
    """The loaders a shadow's tensors carry must not keep the shadow object: its state becomes the
    live module's, and the state the next update replaces would then wait for Python's cyclic
    collector (rare in vLLM, which freezes its heap) instead of going with the build."""
    import gc
    import weakref

    def process(self: Linear) -> None:  # as vLLM's prepack: the processed weight keeps the loader
        packed, bias, loader = (self.weight.data.t() * 2).contiguous(), self.bias, self.weight.weight_loader
        self.packed_linear = lambda x: x @ packed / 2 + bias
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        self.weight.weight_loader = loader  # type: ignore[attr-defined]

    monkeypatch.setattr(Linear, "process", process)
    model, engine = built(checkpoint(0))
    gc.collect()
    gc.disable()
    try:
        states = []
        for seed in (1, 2, 3):
            new = checkpoint(seed)
            build, _ = build_shadows(model, [(n, new[n]) for n in ("o.weight", "o.bias")], {}, engine, default_loader)
            build.switch()
            states.append(weakref.ref(model.o.weight))
            del build  # the swap is final: the state it replaced goes now
        assert [state() is None for state in states] == [True, True, False]
    finally:
        gc.enable()
