"""Reading back what an engine's model holds, after a swap and before it generates (torch only:
vLLM's workers and SGLang's scheduler call it on their own model, where the parameters live).

The reload path hands tensors to the engine's loaders (vLLM's, SGLang's), which copy, fuse, pad
and repack them (oneDNN and AMX handles for linear layers, a prepacked layout for CPU experts).
:func:`verify_modules` checks that the engine now computes with exactly the published values,
through the engine's own layout, at a bounded cost per module:

* plain parameters (norms, biases, embeddings) are compared element by element at up to
  ``samples`` evenly spread positions;
* a linear layer (its weight possibly repacked away) is probed with one-hot inputs through its own
  ``quant_method.apply``: the output of ``e_j`` is column ``j`` of the weight, exactly (products by
  one, sums with zeros), so a stale or garbage packed copy shows (a published row holding an Inf
  or a NaN gives NaN there, ``0 * inf``: its expected outputs are worked out the same way);
* MoE experts are compared, for one sampled expert per layer, with the published expert processed
  by the experts kernel's own post-load processing (e.g. the CPU prepack); experts the engine holds
  in a form of its own (quantized as it loads them) go to the engine's own check
  (:data:`ExpertsCheck`), and any other quantized module fails the read-back: it is never passed
  unchecked.

A mismatch raises :class:`~delta_swap.errors.ChecksumMismatchError` naming the tensor.

At tensor parallel > 1 every rank holds its own shard. The engine then passes a :data:`Shard`: it
loads the published tensors of a module through the module's own loader into a scratch copy of the
rank's parameter (local shape, same parameter class), and that local shard is what the rank must
compute with: plain parameters are compared with it, linear layers are probed with one-hot rows of
its (local) input width, and one expert is processed from the rank's shard of it. This module knows
no engine: how a tensor is sharded is the engine package's business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from delta_swap.errors import ChecksumMismatchError

from .module_groups import module_of

#: Evenly spread elements compared per plain parameter, and one-hot columns per linear layer.
SAMPLES = 4096
PROBES = 4
#: Weight rows read at a time when working out the one-hot outputs of rows holding Inf or NaN.
ROW_CHUNK = 1024

#: ``shard(module_path, module, parameter, parts)``: what this rank's ``parameter`` of ``module``
#: must hold once ``parts`` (checkpoint name -> published tensor, in the engine's fused order) are
#: loaded through the module's own loader: the rank's local shard, in the layout before any post-load
#: repacking, with NaN where the loader writes nothing (padding). For experts, ``parameter`` is
#: ``w13_weight`` or ``w2_weight`` and the answer is one expert's shard. None: unknown here.
Shard = Callable[[str, torch.nn.Module, str, Sequence[tuple[str, torch.Tensor]]], torch.Tensor | None]

#: ``check(module_path, experts, tensors)``: an engine's own read-back of an MoE ``experts`` module
#: against the published ``tensors`` that load into it, for experts the engine holds in a form of
#: its own (quantized as it loads them); the number of checks (raising ChecksumMismatchError on a
#: difference), or None where it has none for this module (the prepack comparison runs instead).
ExpertsCheck = Callable[[str, torch.nn.Module, Mapping[str, torch.Tensor]], int | None]


def verify_modules(
    model: torch.nn.Module,
    published: Mapping[str, torch.Tensor],
    packed: Mapping[str, Sequence[str]],
    shard: Shard | None = None,
    experts_check: ExpertsCheck | None = None,
) -> int:
    """Check every module that ``published`` (checkpoint name -> tensor) loads into, and every
    module sharing a parameter with one of them (a tied ``lm_head``), against those tensors (each
    rank's shard of them, through ``shard``, at tensor parallel > 1; whole tensors without it;
    MoE experts through ``experts_check`` first, where the engine gives one).
    Returns how many checks ran; raises ChecksumMismatchError at the first difference."""
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in published.items():
        by_module.setdefault(module_of(name, packed), {})[name] = tensor
    extra = [path for path, _ in modules_sharing_parameters_with(model, set(by_module))]
    checks = 0
    modules = dict(model.named_modules())
    for path, tensors in sorted(by_module.items()):
        module = modules.get(path)
        if module is None:
            continue  # a name vLLM maps elsewhere (hf_to_vllm_mapper): not checked here
        checks += _verify_module(path, module, tensors, packed, shard, experts_check)
    for path in extra:  # e.g. a tied lm_head: it must compute with the embedding just loaded
        module = modules.get(path)
        source = _shared_source(module, modules, by_module) if module is not None else None
        if module is not None and source is not None:
            name = f"{path}.weight (tied to {source[0]})"
            weight = _weight_of(source[1])
            parts = _expected(name, source[2], modules[source[2]], "weight", [weight], shard)
            checks += _probe_linear(path, module, parts, name, loose=shard is not None)
    return checks


def _expected(
    name: str,
    path: str,
    module: torch.nn.Module,
    kind: str,
    parts: Sequence[tuple[str, torch.Tensor]],
    shard: Shard | None,
) -> list[torch.Tensor]:
    """What ``module.<kind>`` must hold: the published parts back to back (one rank), or this
    rank's shard of them (``shard``)."""
    if shard is None:
        return [t for _, t in parts]
    local = shard(path, module, kind, parts)
    if local is None or (local.is_floating_point() and bool(torch.isnan(_sample(local)).all())):  # nothing loaded
        raise ChecksumMismatchError(f"{name}: cannot work out this rank's shard of it ({type(module).__name__})")
    return [local]


def _verify_module(
    path: str,
    module: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    packed: Mapping[str, Sequence[str]],
    shard: Shard | None,
    experts_check: ExpertsCheck | None = None,
) -> int:
    if any(".experts." in name for name in tensors):  # vLLM keeps them in a submodule (routed_experts)
        for sub_path, sub in module.named_modules():
            if hasattr(sub, "w13_weight") and hasattr(sub, "w2_weight"):
                experts_path = f"{path}.{sub_path}".rstrip(".")
                checked = experts_check(experts_path, sub, tensors) if experts_check is not None else None
                if checked is not None:
                    return checked
                _refuse_quantized(experts_path, sub)
                return _verify_experts(experts_path, sub, tensors, shard)
        return 0
    _refuse_quantized(path, module)
    checks = 0
    for kind in ("weight", "bias"):
        parts = _ordered(path, {n: t for n, t in tensors.items() if n.endswith("." + kind)}, packed)
        if not parts:
            continue
        name = f"{path}.{kind} ({len(parts)} checkpoint tensors)" if len(parts) > 1 else parts[0][0]
        expected = _expected(name, path, module, kind, parts, shard)
        total = sum(t.numel() for t in expected)
        param = getattr(module, kind, None)
        if param is not None and param.numel() >= total:  # a plain parameter: the parts back to back
            flat, offset = param.detach().reshape(-1), 0
            for t in expected:
                _compare(name, flat[offset : offset + t.numel()], t.reshape(-1), loose=shard is not None)
                offset += t.numel()
            checks += 1
        if kind == "weight" and all(t.ndim == 2 for t in expected) and _is_linear(module):
            checks += _probe_linear(path, module, expected, name, loose=shard is not None)
    return checks


def _refuse_quantized(path: str, module: torch.nn.Module) -> None:
    """Raise for a module quantized by the engine that nothing here can read back: its values differ
    from the published ones by design, and a read-back that skipped it would pass silently."""
    method = getattr(module, "quant_method", None)
    if method is not None and not type(method).__name__.startswith("Unquantized"):
        raise ChecksumMismatchError(f"{path}: cannot read back a module quantized by {type(method).__name__}")


def _ordered(
    path: str, tensors: Mapping[str, torch.Tensor], packed: Mapping[str, Sequence[str]]
) -> list[tuple[str, torch.Tensor]]:
    """A fused module's constituents in the order vLLM stacks them (q, k, v; gate, up)."""
    parts = packed.get(path.rsplit(".", 1)[-1])
    if not parts:
        return sorted(tensors.items())
    rank = {part: i for i, part in enumerate(parts)}
    return sorted(tensors.items(), key=lambda item: rank.get(item[0].rsplit(".", 2)[-2], len(rank)))


def _is_linear(module: torch.nn.Module) -> bool:
    method = getattr(module, "quant_method", None)
    return method is not None and hasattr(method, "apply") and hasattr(module, "weight")


def _probe_linear(
    path: str, module: torch.nn.Module, parts: Sequence[torch.Tensor], name: str, loose: bool = False
) -> int:
    """Push one-hot rows through the layer's own kernel (``quant_method.apply``, never the layer's
    forward, so no all-reduce of a tensor-parallel layer runs): each output is a column of its
    weight (the parts' columns stacked, as vLLM fuses them; a rank's shard: its local input width
    and outputs). Only the probed columns are read."""
    rows, cols = sum(t.shape[0] for t in parts), parts[0].shape[1]
    picks = sorted({int(i) for i in torch.linspace(0, cols - 1, min(PROBES, cols)).round()})
    probe = torch.zeros(len(picks), cols, dtype=parts[0].dtype, device=_device(module))
    for r, j in enumerate(picks):
        probe[r, j] = 1
    with torch.inference_mode():
        method: Any = module.quant_method  # torch types a submodule attribute as Tensor | Module
        out = method.apply(module, probe)
    if out.shape[-1] < rows:
        raise ChecksumMismatchError(f"{name}: {path} computes {out.shape[-1]} outputs, the checkpoint has {rows}")
    live = out[:, :rows].to(parts[0].dtype).cpu()
    expected = torch.cat([t[:, picks] for t in parts]).t()
    _compare(name, live, _with_non_finite_rows(expected, live, parts, picks), loose=loose)
    return 1


def _with_non_finite_rows(
    expected: torch.Tensor, live: torch.Tensor, parts: Sequence[torch.Tensor], picks: Sequence[int]
) -> torch.Tensor:
    """``expected`` (the probed columns, on ``live``'s device), except in the weight rows that hold
    an Inf or a NaN: there a one-hot product is not the column's value (``0 * inf`` is NaN). Such a
    row's output for column ``j`` is ``W[i, j]`` where that is the row's only non-finite value, else
    NaN. Only rows whose live output is not finite are read, :data:`ROW_CHUNK` at a time (a
    published row with no Inf or NaN keeps its column value, so garbage there still shows)."""
    expected = expected.to(live.device)
    suspects = (~torch.isfinite(live)).any(0).nonzero().flatten()
    if not len(suspects):
        return expected
    expected = expected.clone()
    picked = torch.tensor(list(picks))
    start = 0
    for part in parts:
        mine = suspects[(suspects >= start) & (suspects < start + part.shape[0])]
        for chunk in mine.split(ROW_CHUNK):
            rows = part.index_select(0, (chunk - start).to(part.device))
            odd = (~torch.isfinite(rows)).sum(1).cpu()  # non-finite values per row
            bad = odd > 0
            if not bool(bad.any()):
                continue
            values = rows.index_select(1, picked.to(rows.device)).cpu()[bad]  # (bad rows, probes)
            alone = (odd[bad] == 1).unsqueeze(1) & ~torch.isfinite(values)
            nan = torch.full_like(values, float("nan"))
            expected[:, chunk[bad]] = torch.where(alone, values, nan).t().to(expected.dtype)
        start += part.shape[0]
    return expected


def _verify_experts(
    path: str, module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], shard: Shard | None = None
) -> int:
    """One sampled expert (this rank's shard of it, through ``shard``), processed by the experts
    kernel's own post-load step, against the engine's copy of that expert."""
    experts: dict[int, dict[str, tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        number, proj = name.split(".experts.", 1)[1].split(".")[:2]
        experts.setdefault(int(number), {})[proj] = (name, tensor)
    index = sorted(experts)[len(experts) // 2]
    parts = experts[index]
    if not {"gate_proj", "up_proj", "down_proj"} <= parts.keys():
        return 0  # another experts naming (w1/w2/w3): not checked here
    name = f"{path}.{index} (gate/up/down)"
    w13 = torch.cat([parts["gate_proj"][1], parts["up_proj"][1]])
    w2 = parts["down_proj"][1]
    if shard is not None:  # this rank's shard of the expert, as the experts' loader places it
        w13 = _expected(name, path, module, "w13_weight", [parts["gate_proj"], parts["up_proj"]], shard)[0]
        w2 = _expected(name, path, module, "w2_weight", [parts["down_proj"]], shard)[0]
    kernel = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    stub = torch.nn.Module()
    device = _device(module)
    stub.register_parameter(
        "w13_weight",
        torch.nn.Parameter(w13.unsqueeze(0).to(device), requires_grad=False),
    )
    stub.register_parameter("w2_weight", torch.nn.Parameter(w2.unsqueeze(0).to(device), requires_grad=False))
    if kernel is not None and hasattr(kernel, "process_weights_after_loading"):
        kernel.process_weights_after_loading(stub)
    for param in ("w13_weight", "w2_weight"):
        live = getattr(module, param).detach()[index]
        want = getattr(stub, param).detach()[0]
        if live.shape != want.shape:
            raise ChecksumMismatchError(f"{name}: {param} has shape {tuple(live.shape)}, expected {tuple(want.shape)}")
        _compare(name, live.reshape(-1), want.reshape(-1), loose=shard is not None)
    return 1


def modules_sharing_parameters_with(model: torch.nn.Module, touched: set[str]) -> list[tuple[str, torch.nn.Module]]:
    """Modules not in ``touched`` that hold a parameter object also held by a module in ``touched``
    (tied embeddings: ``lm_head`` holds ``embed_tokens.weight``)."""
    holders: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append((path, module))
    out: dict[str, torch.nn.Module] = {}
    for group in holders.values():
        if len(group) > 1 and any(path in touched for path, _ in group):
            out.update((path, module) for path, module in group if path not in touched)
    return sorted(out.items(), key=lambda item: item[0])


def _shared_source(
    module: torch.nn.Module, modules: Mapping[str, torch.nn.Module], by_module: Mapping[str, Mapping[str, torch.Tensor]]
) -> tuple[str, dict[str, torch.Tensor], str] | None:
    """The published tensors of a module that holds the same parameter object as ``module``
    (their names, the tensors, that module's path)."""
    own = {id(p) for p in module.parameters(recurse=False)}
    for path, tensors in by_module.items():
        other = modules.get(path)
        if other is not None and other is not module and own & {id(p) for p in other.parameters(recurse=False)}:
            return ", ".join(tensors), dict(tensors), path
    return None


def _weight_of(tensors: Mapping[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    return next((n, t) for n, t in sorted(tensors.items()) if n.endswith(".weight"))


def _device(module: torch.nn.Module) -> torch.device:
    for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        return tensor.device
    return torch.device("cpu")


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    """Up to SAMPLES evenly spread elements of ``tensor``."""
    flat = tensor.reshape(-1)
    return flat[:: max(1, flat.numel() // SAMPLES)]


def _compare(name: str, live: torch.Tensor, expected: torch.Tensor, loose: bool = False) -> None:
    """Compare at up to SAMPLES evenly spread positions (values cast to the live dtype); with
    ``loose``, a NaN expected value means "the loader writes nothing here" (a shard's padding)."""
    live, expected = live.reshape(-1), expected.reshape(-1).to(device=live.device)
    if live.numel() != expected.numel():
        raise ChecksumMismatchError(
            f"{name}: the engine holds {live.numel()} elements, the snapshot {expected.numel()}"
        )
    step = max(1, live.numel() // SAMPLES)
    a, b = live[::step], expected[::step].to(live.dtype)
    same = (a == b) | (torch.isnan(b) if loose else torch.isnan(a) & torch.isnan(b))
    if not bool(same.all()):
        where = int((~same).nonzero()[0]) * step
        raise ChecksumMismatchError(
            f"{name}: the engine computes with other values than the snapshot (element {where}: "
            f"{float(live[where])} instead of {float(expected[where])})"
        )
