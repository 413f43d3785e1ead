"""Which elements of a vLLM worker's live parameters an update changes
(:class:`delta_swap.inplace.ElementChanges`), worked out by vLLM itself.

The new tensors go through the model's own ``load_weights`` (its name mapping, fused q/k/v and
gate/up shard ids, expert ids, vocabulary padding, tied embeddings) and each parameter's own
``weight_loader`` (this tensor-parallel rank's shard), but every loader writes into a scratch copy
of its parameter instead of the parameter: the live model does not change. Each scratch is then
compared with the live parameter, one module at a time (memory: the largest module's parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from delta_swap.inplace import ElementChanges, changes_between, merge
from delta_swap.module_groups import module_of

_MISSING = object()


def element_changes(
    model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], packed: Mapping[str, Sequence[str]]
) -> tuple[list[ElementChanges], set[str]]:
    """(the changes ``weights`` make to the live parameters, the names no loader received).

    A name no loader received is one the engine ignores, as a fresh server would (a tied
    ``lm_head.weight``)."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in weights:
        groups.setdefault(module_of(name, packed), []).append((name, tensor))
    params = dict(model.named_parameters())
    changes: list[ElementChanges] = []
    ignored: set[str] = set()
    for group in groups.values():
        found, received = _load_into_scratch(model, params, group)
        changes.extend(found)
        ignored.update(name for name, _ in group if name not in received)
    return changes, ignored


def _load_into_scratch(
    model: torch.nn.Module, params: Mapping[str, torch.nn.Parameter], group: Sequence[tuple[str, torch.Tensor]]
) -> tuple[list[ElementChanges], set[str]]:
    """Load one module's tensors through the model into scratch copies of its parameters."""
    scratch: dict[str, torch.Tensor] = {}
    received: set[str] = set()
    current: list[str] = []
    restore: list[Callable[[], None]] = []

    def recorder(param_name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def load(*args: Any, **kwargs: Any) -> Any:  # (param, loaded_weight, ...), some as keywords
            param = kwargs["param"] if "param" in kwargs else args[0]
            copy = scratch.get(param_name)
            if copy is None:
                copy = scratch[param_name] = _scratch_of(param)
            received.add(current[0])
            if "param" in kwargs:
                return original(*args, **{**kwargs, "param": copy})
            return original(copy, *args[1:], **kwargs)

        return load

    try:
        for name, param in params.items():
            restore.append(_replace_loader(param, lambda original, n=name: recorder(n, original)))
        load_weights: Any = model.load_weights  # a vLLM model's; torch types it Tensor | Module
        for name, tensor in group:  # one at a time, to know which name each loader call came from
            current[:] = [name]
            load_weights(iter([(name, tensor)]))
    finally:
        for undo in reversed(restore):
            undo()
    changes = []
    for param_name, copy in scratch.items():
        live = params[param_name].data
        if not live.is_contiguous():
            raise ValueError(f"delta_swap: parameter {param_name} is not a plain tensor")
        found = changes_between(param_name, live, copy.data)
        if found is not None:
            changes.append(found)
    return changes, received


def _scratch_of(param: torch.Tensor) -> torch.Tensor:
    """A copy of ``param`` with its class and attributes, so its loader treats it as the parameter."""
    data = param.data.clone()
    data.__class__ = param.__class__
    data.__dict__ = param.__dict__.copy()
    return data


def _replace_loader(
    param: torch.Tensor, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None]:
    """Put ``wrap(original loader)`` in place of the parameter's weight loader; returns the undo."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    if isinstance(getattr(type(param), "weight_loader", None), property):  # vLLM's own parameter classes
        old = param._weight_loader  # type: ignore[attr-defined]
        param._weight_loader = wrap(old)  # type: ignore[attr-defined]
        return lambda: setattr(param, "_weight_loader", old)
    old_attr = param.__dict__.get("weight_loader", _MISSING)
    param.weight_loader = wrap(default_weight_loader if old_attr is _MISSING else old_attr)  # type: ignore[attr-defined]

    def undo() -> None:
        if old_attr is _MISSING:
            del param.weight_loader  # type: ignore[attr-defined]
        else:
            param.weight_loader = old_attr  # type: ignore[attr-defined]

    return undo


def merged(changes: Iterable[ElementChanges]) -> list[ElementChanges]:
    """One :class:`ElementChanges` per parameter."""
    by_param: dict[str, list[ElementChanges]] = {}
    for change in changes:
        by_param.setdefault(change.param, []).append(change)
    return [merge(parts) for parts in by_param.values()]
