"""Checkpoint names for a live transformers model: what ``save_pretrained`` would write.

A model's ``state_dict()`` is not its checkpoint. Tied weights appear twice (``lm_head.weight``
is ``model.embed_tokens.weight``), and transformers 5 keeps some weights fused in memory
(``mlp.experts.gate_up_proj`` of every expert in one 3-D tensor, where the checkpoint holds
``mlp.experts.N.gate_proj.weight``...). Servers load checkpoints, so the trainer must publish
checkpoint names. :func:`checkpoint_tensors` converts with transformers' own save-time functions;
:func:`check_checkpoint_names` refuses, on the trainer, a plain mapping that still cannot match.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ConfigError

#: In-memory names of fused expert weights (3-D tensors) that no checkpoint holds.
_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj|w1|w2|w3)(_bias)?$")


def is_transformers_model(value: Any) -> bool:
    """Whether ``value`` is a transformers model (it has a config and a state dict)."""
    return hasattr(value, "state_dict") and hasattr(value, "config") and hasattr(value, "save_pretrained")


def checkpoint_tensors(model: Any, named: Iterable[tuple[str, Any]] | None = None, dtype: Any = None) -> dict[str, Any]:
    """``named`` (default: the model's ``state_dict()``; whole tensors) under the names and in the
    layout ``save_pretrained`` writes: tied aliases dropped as the model declares them, fused
    in-memory weights split back by transformers' own conversion; floating tensors cast to
    ``dtype`` if given (e.g. fp32 master weights to the bf16 that servers run)."""
    from transformers.core_model_loading import revert_weight_conversion

    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    state = {
        name: (tensor.detach().to(dtype) if dtype is not None and tensor.is_floating_point() else tensor.detach())
        for name, tensor in (model.state_dict().items() if named is None else named)
        if name not in tied
    }
    if not state:
        return {}
    return dict(revert_weight_conversion(model, state))


def check_checkpoint_names(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """``tensors`` without aliases (a name whose tensor shares storage with an earlier name's, as
    a tied ``lm_head.weight`` does: ``save_pretrained`` drops it too); raises ConfigError naming
    the tensors that only exist in memory (fused experts), which no server could load."""
    fused = sorted(name for name in tensors if _FUSED_EXPERTS.search(name))
    if fused:
        raise ConfigError(
            f"{', '.join(fused[:3])}{' ...' if len(fused) > 3 else ''}: fused in-memory weights that "
            "no checkpoint holds; publish the model itself (publish(step, model)) so they are split as "
            "save_pretrained writes them"
        )
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    out = {}
    for name, tensor in tensors.items():
        key = _storage_key(tensor)
        if key is not None and key in seen:
            continue  # an alias of seen[key]
        if key is not None:
            seen[key] = name
        out[name] = tensor
    return out


def _storage_key(tensor: Any) -> tuple[int, int, tuple[int, ...]] | None:
    """Where a torch tensor's bytes start and its shape (None for other arrays)."""
    if not hasattr(tensor, "untyped_storage") or getattr(tensor, "device", None) is None:
        return None
    if tensor.device.type == "meta" or hasattr(tensor, "full_tensor"):  # DTensors: never aliases here
        return None
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
