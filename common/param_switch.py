"""The parameter-switch swap strategy, for engines whose parameters are plain host tensors holding
the checkpoint's elements (SGLang's CPU path at tensor parallel > 1 and for MoE experts, where no
weight arena applies): build the changed parameters' new values before the pause, and point the
live parameters at them in the pause.

Before the pause (the engine still generates), :func:`build_parameter_switch` loads the update
through the model's own loaders (:mod:`.loader_redirect`: name mapping, fused q/k/v and gate/up
shards, expert ids, vocabulary padding, a tensor-parallel rank's shard) into a copy of every
parameter it reaches, made from the live values (so a partial load keeps the rest), and keeps the
copies that differ from their live parameter. The pause then runs
:meth:`ParameterSwitch.switch`: each changed parameter's ``.data`` is pointed at its copy, one
reference per parameter. The parameter objects stay (whatever holds one, a tied head included,
sees the new values), and the old tensors are kept until the swap is final
(:meth:`ParameterSwitch.undo` puts them back, as does a failure mid-switch).

The window does not grow with the changed elements (the in-place scatter's does: its writes touch
about half the cache lines of a tensor with 2% of its elements changed). Memory: one spare copy of
the changed parameters until the swap ends. Host tensors only: a CUDA graph keeps the addresses
it captured, so on a GPU the in-place scatter (:mod:`.inplace`) writes into them instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import EngineError
from .inplace import bits_equal
from .loader_redirect import load_into_copies
from .module_groups import module_of
from .shadow import switch_each


@dataclass
class ParameterSwitch:
    """The new tensors of one update's changed parameters, ready to switch in."""

    #: (name, live parameter, new tensor) per changed parameter.
    targets: list[tuple[str, torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    #: The tensors the parameters held before the switch (set by :meth:`switch`).
    old: list[torch.Tensor] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(new.numel() * new.element_size() for _, _, new in self.targets)

    def switch(self, after_each: Callable[[int], None] | None = None) -> None:
        """Point every changed parameter at its new tensor; on any failure (or when
        ``after_each``, called with the number switched so far, raises) switch back and raise."""

        def switch_one(target: tuple[str, torch.nn.Parameter, torch.Tensor]) -> None:
            _name, param, new = target
            self.old.append(param.data)
            param.data = new

        switch_each(self.targets, switch_one, self.undo, after_each)

    def undo(self) -> None:
        """Give every switched parameter its old tensor back (in reverse order)."""
        for (_name, param, _new), old in reversed(list(zip(self.targets, self.old, strict=False))):
            param.data = old
        self.old.clear()


def build_parameter_switch(
    model: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed: Mapping[str, Sequence[str]],
    default_loader: Callable[..., Any],
    after_each: Callable[[int], None] | None = None,
) -> tuple[ParameterSwitch, set[str]]:
    """(the new tensors of every parameter ``weights`` change, one module's tensors at a time; the
    names no loader received, which the engine ignores, as a fresh server would: a tied
    ``lm_head``); ``after_each`` is called with the number of modules loaded so far (tests raise
    from it). Memory: the changed parameters' copies, and one module's more while it loads.
    Raises :class:`EngineError` for a parameter that is not a plain host tensor."""
    started = time.perf_counter()
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in weights:
        groups.setdefault(module_of(name, packed), []).append((name, tensor))
    params = dict(model.named_parameters())
    copies: dict[str, torch.Tensor] = {}
    ignored: set[str] = set()
    for done, group in enumerate(groups.values(), start=1):
        earlier = set(copies)
        _copies, received = load_into_copies(model, params, group, default_loader, copies)
        for name in set(copies) - earlier:  # a copy equal to its parameter is dropped at once; a
            if not _changes(name, params[name].data, copies[name].data):  # later load copies anew
                del copies[name]
        ignored.update(name for name, _ in group if name not in received)
        if after_each is not None:
            after_each(done)
    build = ParameterSwitch([(name, params[name], copy.data) for name, copy in copies.items()])
    build.seconds = time.perf_counter() - started
    return build, ignored


def _changes(name: str, live: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether ``new`` (a loaded copy) differs from the live parameter ``live``; raises where the
    parameter cannot be switched."""
    if live.device.type != "cpu" or not live.is_contiguous():
        raise EngineError(
            f"delta_swap: parameter {name} is not a plain host tensor ({live.device}): it cannot be switched"
        )
    if new.shape != live.shape or new.dtype != live.dtype:
        raise EngineError(
            f"delta_swap: {name}: the loaded copy has {new.dtype}{tuple(new.shape)}, the live "
            f"parameter {live.dtype}{tuple(live.shape)}"
        )
    return not bits_equal(new, live)
