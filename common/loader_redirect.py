"""Load tensors through an engine model's own loaders into other tensors than its live parameters.

An engine model loads a checkpoint tensor in two steps: its ``load_weights`` maps the name to a
parameter (fused q/k/v and gate/up shard ids, expert ids, a tied ``lm_head`` skipped), and the
parameter's ``weight_loader`` writes it (a tensor-parallel rank's shard, vocabulary padding).
:func:`load_redirected` runs both, but every loader call aimed at a live parameter goes to a
loader the caller gives instead (a scratch copy for the in-place path, a shadow module's own
parameter for the shadow build): the live model does not change. vLLM and SGLang models both load
this way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

#: Given a live parameter's name, the parameter and its own loader: the loader to call instead.
#: It receives the original call's arguments (``param`` first or as a keyword).
Redirect = Callable[[str, torch.Tensor, Callable[..., Any]], Callable[..., Any]]

_MISSING = object()


def load_redirected(
    model: torch.nn.Module,
    params: Mapping[str, torch.nn.Parameter],
    group: Sequence[tuple[str, torch.Tensor]],
    redirect: Redirect,
    default_loader: Callable[..., Any],
) -> set[str]:
    """Load ``group`` through ``model.load_weights`` one tensor at a time, with the loader of every
    parameter of ``params`` replaced by ``redirect(name, param, its loader)``; returns the names of
    ``group`` that some loader received (a name none did is one the engine ignores)."""
    received: set[str] = set()
    current: list[str] = []
    restore: list[Callable[[], None]] = []

    def recorded(name: str, param: torch.Tensor) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            target = redirect(name, param, original)

            def load(*args: Any, **kwargs: Any) -> Any:
                received.add(current[0])
                return target(*args, **kwargs)

            return load

        return wrap

    try:
        for name, param in params.items():
            restore.append(replace_loader(param, recorded(name, param), default_loader))
        load_weights: Any = model.load_weights  # an engine model's; torch types it Tensor | Module
        for name, tensor in group:  # one at a time, to know which name each loader call came from
            current[:] = [name]
            load_weights(iter([(name, tensor)]))
    finally:
        for undo in reversed(restore):
            undo()
    return received


def load_into_copies(
    model: torch.nn.Module,
    params: Mapping[str, torch.nn.Parameter],
    group: Sequence[tuple[str, torch.Tensor]],
    default_loader: Callable[..., Any],
    copies: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(a copy of every parameter ``group`` loads into, made from the live values and written by
    the model's own loaders, by parameter name; the names of ``group`` some loader received). The
    live parameters do not change; a partial load (one constituent of a fused parameter, one
    rank's shard, one expert) leaves the rest of a copy as the live values. Given ``copies``
    (from an earlier group), a parameter already copied there is written again, not copied anew."""
    copies = {} if copies is None else copies

    def into_copy(name: str, param: torch.Tensor, original: Callable[..., Any]) -> Callable[..., Any]:
        def load(*args: Any, **kwargs: Any) -> Any:
            copy = copies.get(name)
            if copy is None:
                copy = copies[name] = scratch_of(param)
            args, kwargs = with_param(args, kwargs, copy)
            return original(*args, **kwargs)

        return load

    received = load_redirected(model, params, group, into_copy, default_loader)
    return copies, received


def with_param(args: tuple[Any, ...], kwargs: dict[str, Any], param: torch.Tensor) -> tuple[tuple, dict]:
    """A loader call's arguments with ``param`` in place of the parameter it was given."""
    if "param" in kwargs:
        return args, {**kwargs, "param": param}
    return (param, *args[1:]), kwargs


def loader_of(param: torch.Tensor, default_loader: Callable[..., Any]) -> Callable[..., Any]:
    """A parameter's own weight loader (``default_loader`` where it has none)."""
    return getattr(param, "weight_loader", None) or default_loader


def replace_loader(
    param: torch.Tensor, wrap: Callable[[Callable[..., Any]], Callable[..., Any]], default_loader: Callable[..., Any]
) -> Callable[[], None]:
    """Put ``wrap(original loader)`` in place of the parameter's weight loader; returns the undo.
    The wrapper remembers what it replaced, so a copy made meanwhile (:func:`scratch_of`) gets that."""
    if isinstance(getattr(type(param), "weight_loader", None), property):  # the engines' parameter classes
        old = param._weight_loader  # type: ignore[attr-defined]
        param._weight_loader = _remembering(wrap(old), old)  # type: ignore[attr-defined]
        return lambda: setattr(param, "_weight_loader", old)
    old_attr = param.__dict__.get("weight_loader", _MISSING)
    param.weight_loader = _remembering(wrap(default_loader if old_attr is _MISSING else old_attr), old_attr)  # type: ignore[attr-defined]

    def undo() -> None:
        if old_attr is _MISSING:
            del param.weight_loader  # type: ignore[attr-defined]
        else:
            param.weight_loader = old_attr  # type: ignore[attr-defined]

    return undo


def scratch_of(param: torch.Tensor) -> torch.Tensor:
    """A copy of ``param`` with its class and attributes (its own loader, not a redirect in place
    while it is copied), so its loader treats it as the parameter."""
    data = param.data.clone()
    data.__class__ = param.__class__
    attrs = param.__dict__.copy()
    for key in ("weight_loader", "_weight_loader"):
        value = attrs.get(key, _MISSING)
        while value is not _MISSING and hasattr(value, _REPLACED):
            value = getattr(value, _REPLACED)
        if value is _MISSING:
            attrs.pop(key, None)
        else:
            attrs[key] = value
    data.__dict__ = attrs
    return data


#: The attribute of a redirecting loader that holds what it replaced (``_MISSING``: no loader).
_REPLACED = "_delta_swap_replaced"


def _remembering(loader: Callable[..., Any], replaced: object) -> Callable[..., Any]:
    setattr(loader, _REPLACED, replaced)
    return loader
