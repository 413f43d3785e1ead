"""vLLM's fused parameters: tensors that must travel together in one update.

vLLM loads q/k/v into one ``qkv_proj`` parameter and gate/up into one ``gate_up_proj``
(``packed_modules_mapping`` of the model class); a layerwise reload must receive every member of
a fused parameter at once. The API server uses this to complete what it stages, each worker to
refuse an incomplete update before it starts reloading.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def fused_group_members(names: Iterable[str], packed: Mapping[str, Sequence[str]]) -> set[str]:
    """Every tensor name of each fused group that one of ``names`` belongs to (``names``
    included), e.g. ``...q_proj.weight`` -> the q, k and v weights of the same layer."""
    members = set(names)
    for parts in packed.values():
        for name in list(members):
            for part in parts:
                if f".{part}." in name:
                    members.update(name.replace(f".{part}.", f".{p}.") for p in parts)
    return members
