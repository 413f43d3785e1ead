"""Which checkpoint tensors an engine loads into one module: they must travel together in a reload,
and a read-back (:mod:`.readback`) checks them together. vLLM and SGLang name their fused modules
alike (``qkv_proj``, ``gate_up_proj``, ``...experts``).

vLLM's layerwise reload rebuilds a module from the tensors it receives and processes it once
every element arrived; a module that gets only some of its tensors is rebuilt around
uninitialised memory (an MoE layer's other experts, the q/k/v weight of a bias-only update).
So a reload always sends whole modules:

* fused linears: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj`` (the model class's
  ``packed_modules_mapping``), weights and biases together;
* MoE experts: every expert of a layer lives in one ``FusedMoE`` module (``...experts``);
* anything else: the tensors of one module (``...o_proj.weight`` with ``...o_proj.bias``).

Workers compute the groups from their own model (whose mapping may extend the class's) and hand
them to the API server, which completes every update with them and the workers refuse any that
is still incomplete.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")


def module_of(name: str, packed: Mapping[str, Sequence[str]]) -> str:
    """The vLLM module a checkpoint tensor is loaded into, e.g. ``model.layers.0.self_attn.k_proj.bias``
    -> ``model.layers.0.self_attn.qkv_proj``, ``...mlp.experts.3.up_proj.weight`` -> ``...mlp.experts``."""
    expert = _EXPERT.match(name)
    if expert:
        return expert.group(1)
    module = name.rsplit(".", 1)[0]
    head, _, last = module.rpartition(".")
    for fused, parts in packed.items():
        if last in parts:
            return f"{head}.{fused}" if head else fused
    return module


def module_groups(names: Iterable[str], packed: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Checkpoint tensor names by the module they load into (sorted within each module)."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        groups.setdefault(module_of(name, packed), []).append(name)
    return groups


def tensors_of_modules(
    names: Iterable[str], candidates: Iterable[str], packed: Mapping[str, Sequence[str]]
) -> list[str]:
    """The ``candidates`` that load into a module one of ``names`` loads into (sorted): what a
    read-back of those modules compares with."""
    touched = {module_of(name, packed) for name in names}
    return sorted(name for name in candidates if module_of(name, packed) in touched)


def complete_modules(
    names: Iterable[str], groups: Mapping[str, Sequence[str]], packed: Mapping[str, Sequence[str]]
) -> set[str]:
    """``names`` and every other tensor of the modules they load into."""
    out = set(names)
    for name in list(out):
        out.update(groups.get(module_of(name, packed), ()))
    return out
