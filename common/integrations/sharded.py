"""Publishing from a sharded trainer: every rank publishes a share of the tensors, whole.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) or any trainer whose parameters are DTensors,
each rank holds a slice of every parameter. Tensors are assigned to ranks round-robin by name;
for each tensor in turn, every rank takes part in one gather (``DTensor.full_tensor``) and only its
owner keeps the result, so a rank never holds more than one whole tensor beyond its share. Each
rank then publishes its share with ``PublisherConfig(rank=..., world_size=...)``, and the last
rank to finish commits the snapshot (see :mod:`delta_swap.commit`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def owned_tensors(named: Iterable[tuple[str, Any]], rank: int, world_size: int, dtype: Any = None) -> dict[str, Any]:
    """This rank's share of ``named`` (name, tensor or DTensor) as whole local tensors (cast to
    ``dtype`` if given). Collective: every rank must call it with the same names in any order."""
    out = {}
    for i, (name, tensor) in enumerate(sorted(named, key=lambda item: item[0])):
        value = tensor.detach()
        if hasattr(value, "full_tensor"):  # a DTensor: gather it (every rank takes part)
            value = value.full_tensor()
        if i % world_size == rank:
            out[name] = value.to(dtype) if dtype is not None else value.clone()
    return out
