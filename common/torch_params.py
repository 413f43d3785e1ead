"""An engine's torch parameters as weight arenas see them, used inside engine processes.

:func:`plan_layout` lays the parameters of a running model out as an :class:`~delta_swap.arena.ArenaLayout`
and places every checkpoint tensor in them (fused parameters such as ``qkv_proj`` hold their
checkpoint tensors' rows back to back, in the order of the model's ``packed_modules_mapping``);
:func:`point_parameters` makes the parameters views of an arena, which is the whole swap.
Both refuse (returning a reason) anything they cannot do exactly: parameters that are not plain
contiguous CPU tensors (packed by oneDNN or AMX, on a GPU), checkpoint tensors without a place,
parameters that checkpoint tensors do not fill, or live bytes that differ from the checkpoint's
(an engine that transforms weights after loading). Callers then fall back to reloading.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .arena import Arena, ArenaLayout
from .checkpoint_dir import read_checkpoint_dir
from .dtypes import dtype_size, from_torch_dtype, to_torch_dtype
from .errors import ConfigError, DeltaSwapError
from .host_memory import release_free_heap
from .served_model import ServedModel
from .tensors import StateDict, TensorSpecs


def describe_arena(
    params: Mapping[str, Any], packed: Mapping[str, Sequence[str]], served: ServedModel
) -> tuple[ArenaLayout | None, str]:
    """The engine-process side of the arena path: a layout for ``params`` checked byte for byte
    against the served checkpoint (None, and why not, where there is none)."""
    if not served.specs or served.checkpoint_dir is None:
        return None, "the served checkpoint is not a local folder"
    layout, reason = plan_layout(params, packed, served.specs)
    if layout is not None:
        checkpoint, _ = read_checkpoint_dir(served.checkpoint_dir)
        mismatch = check_matches(params, layout, checkpoint)
        if mismatch is not None:
            return None, mismatch
    return layout, reason


class ArenaMappings:
    """The arenas an engine process has mapped, by path; :meth:`point` is the swap."""

    def __init__(self, layout: ArenaLayout) -> None:
        self.layout = layout
        self._arenas: dict[str, Arena] = {}

    def point(self, params: Mapping[str, Any], path: str) -> None:
        """Point every parameter at the arena file ``path`` (mapped on first use)."""
        arena = self._arenas.get(path)
        if arena is None:
            arena = self._arenas[path] = Arena(path, self.layout)
        point_parameters(params, arena)


def plan_layout(
    params: Mapping[str, Any], packed: Mapping[str, Sequence[str]], specs: TensorSpecs
) -> tuple[ArenaLayout | None, str]:
    """An arena layout for these torch ``params`` that places every checkpoint tensor of
    ``specs``, or (None, why not)."""
    slots = []
    for name, param in params.items():
        if param.device.type != "cpu":
            return None, f"parameter {name} is on {param.device.type}, not in host memory"
        if not param.numel() or not param.is_contiguous():
            return None, f"parameter {name} is not a plain tensor (packed for a CPU kernel?)"
        try:
            slots.append((name, from_torch_dtype(param.dtype), tuple(param.shape)))
        except ConfigError:
            return None, f"parameter {name} has dtype {param.dtype}"
    placements: dict[str, tuple[str, int, str, tuple[int, ...]]] = {}
    for name, (dtype, shape) in specs.items():
        target, offset = _place(name, params, packed, specs)
        if target is None:
            return None, f"checkpoint tensor {name} has no parameter to live in"
        placements[name] = (target, offset, dtype, tuple(shape))
    filled: dict[str, int] = {}
    for target, _offset, dtype, shape in placements.values():
        filled[target] = filled.get(target, 0) + int(np.prod(shape)) * dtype_size(dtype)
    for name, dtype, shape in slots:
        if filled.get(name, 0) != int(np.prod(shape)) * dtype_size(dtype):
            return None, f"parameter {name} is not exactly filled by checkpoint tensors"
    try:
        return ArenaLayout.build(slots, placements), "parameters are plain host tensors"
    except DeltaSwapError as exc:
        return None, str(exc)


def _place(
    name: str, params: Mapping[str, Any], packed: Mapping[str, Sequence[str]], specs: TensorSpecs
) -> tuple[str | None, int]:
    """The parameter a checkpoint tensor lives in and its byte offset there."""
    if name in params:
        return name, 0
    for fused, parts in packed.items():
        for i, part in enumerate(parts):
            if f".{part}." not in name:
                continue
            target = name.replace(f".{part}.", f".{fused}.")
            offset = 0
            for before in parts[:i]:
                sibling = specs.get(name.replace(f".{part}.", f".{before}."))
                if sibling is None:
                    return None, 0
                offset += int(np.prod(sibling[1])) * dtype_size(sibling[0])
            if target in params:
                return target, offset
    return None, 0


def check_matches(params: Mapping[str, Any], layout: ArenaLayout, checkpoint: StateDict) -> str | None:
    """None if every checkpoint tensor's bytes sit in the live parameters where ``layout`` says;
    else the first tensor that differs (the engine transforms weights after loading)."""
    import torch

    for name, place in layout.tensors.items():
        expected = checkpoint.get(name)
        if expected is None:
            return f"{name} is not in the served checkpoint"
        live = params[place.slot].detach().reshape(-1).view(torch.uint8).numpy()
        if not np.array_equal(live[place.offset : place.offset + place.nbytes], expected.data):
            return f"the engine holds {name} in another form than the checkpoint"
    return None


def point_parameters(params: Mapping[str, Any], arena: Arena) -> None:
    """Make every parameter of the arena's layout a view of the arena's memory (a reference swap:
    no bytes are copied). Everything is checked before the first parameter moves."""
    import torch

    views = {}
    for slot in arena.layout.slots:
        param = params.get(slot.name)
        dtype = to_torch_dtype(slot.dtype)
        if param is None or param.dtype != dtype or tuple(param.shape) != slot.shape:
            raise ConfigError(f"parameter {slot.name} does not match the arena layout")
        views[slot.name] = torch.from_numpy(arena.slot_bytes(slot.name)).view(dtype).view(slot.shape)
    for name, view in views.items():
        params[name].data = view
    global _heap_released
    if not _heap_released:  # the first commit frees the engine's own copy: give its pages back
        release_free_heap()
        _heap_released = True


#: Whether this process's parameters have left the heap for an arena (and its pages were returned).
_heap_released = False
