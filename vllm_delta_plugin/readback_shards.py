"""What a vLLM tensor-parallel rank must hold of a published tensor, for the read-back
(:data:`delta_swap.readback.Shard`): the published tensors go through the module's own weight
loader, with the shard ids vLLM's models give them, into a scratch copy of the rank's parameter as
vLLM recorded it before any post-load repacking (the layerwise reload's metadata: local shape,
parameter class, ``tp_rank``/``output_dim``... attributes). Nothing of the live model changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: The shard id vLLM's models load each experts projection with (``make_expert_params_mapping``).
_EXPERT_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def local_shards(packed: Mapping[str, Sequence[str]]) -> Any:
    """A :data:`delta_swap.readback.Shard` for a model whose fused modules are ``packed``."""

    def shard(
        path: str, module: torch.nn.Module, kind: str, parts: Sequence[tuple[str, torch.Tensor]]
    ) -> torch.Tensor | None:
        param = _scratch(module, kind)
        if param is None:
            return None
        loader = _loader(param)
        if kind in ("w13_weight", "w2_weight"):  # one expert: the loader writes its row of the scratch
            index = int(parts[0][0].split(".experts.", 1)[1].split(".")[0])
            for name, tensor in parts:
                proj = name.rsplit(".", 2)[-2]
                if not loader(param, tensor, name, _EXPERT_SHARD[proj], index, return_success=True):
                    return None  # not an expert of this rank (expert parallelism)
            local = module._map_global_expert_id_to_local_expert_id(index)  # type: ignore[operator]
            return param.data[local].clone()
        constituents = list(packed.get(path.rsplit(".", 1)[-1], ()))
        for name, tensor in parts:
            part = name.rsplit(".", 2)[-2]
            if constituents and part in constituents:
                loader(param, tensor, _shard_id(module, constituents.index(part)))
            else:
                loader(param, tensor)
        return param.data.detach()

    return shard


def _shard_id(module: torch.nn.Module, index: int) -> str | int:
    """vLLM's models load q/k/v with the ids "q", "k", "v" and gate/up with 0, 1."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    return ("q", "k", "v")[index] if isinstance(module, QKVParallelLinear) else index


def _scratch(module: torch.nn.Module, kind: str) -> torch.Tensor | None:
    """A NaN-filled copy of ``module.<kind>`` as vLLM created it (before post-load processing):
    same local shape, class and attributes. For experts, every expert shares one row of storage
    (an expanded view), so the scratch costs one expert whatever the number of experts."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    recorded = get_layerwise_info(module).restore_metadata[0].get(kind)
    template = recorded if recorded is not None else getattr(module, kind, None)
    if template is None:
        return None
    device = next((p.device for p in module.parameters(recurse=False)), torch.device("cpu"))
    shape = tuple(template.shape)
    if kind in ("w13_weight", "w2_weight"):
        data = torch.full((1, *shape[1:]), float("nan"), dtype=template.dtype, device=device).expand(shape)
    else:
        data = torch.full(shape, float("nan"), dtype=template.dtype, device=device)
    data.__class__ = template.__class__
    data.__dict__ = template.__dict__.copy()
    return restore_layer_refs(data, module)


def _loader(param: torch.Tensor) -> Any:
    """The parameter's own weight loader, without the layerwise reload's wrappers."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    loader: Any = getattr(param, "weight_loader", default_weight_loader)
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader
