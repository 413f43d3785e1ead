"""The shadow-build swap strategy: for engines that process weights after loading (repacked for a
CPU kernel such as oneDNN or AMX, quantized...), build each changed module's new weights in the
engine's own processed form while the engine generates, and switch the live modules to them by
reference in the pause.

Before the pause, :func:`build_shadows` makes a *shadow* of every module an update loads into: a
copy of the module object with tensors of its own in their load-time form
(:meth:`ShadowEngine.unprocessed_copy`), fills it through the model's own loaders
(:mod:`.loader_redirect`: name mapping, fused shards, tensor-parallel shards, vocabulary padding)
and runs the engine's post-load processing on it (:meth:`ShadowEngine.process`). A module that
shares a parameter with a changed one without receiving anything itself (a tied ``lm_head``)
gets a shadow too, on the new parameter. The live model does not change.

The pause then runs :meth:`ShadowBuild.switch`: each live module takes its shadow's state (its
``__dict__``: parameters, buffers, and whatever processing attached, such as a kernel's packed
weight), one reference per module. The old states are kept until the swap is final
(:meth:`ShadowBuild.undo` puts them back, bit-exact, as does a failure mid-switch). Memory: one
spare copy of the changed modules, in their processed form, until the swap ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Protocol, TypeVar

import torch

from .errors import EngineError
from .loader_redirect import load_redirected, loader_of, with_param
from .module_groups import module_of
from .undo import take_back

T = TypeVar("T")


class ShadowUnsupported(EngineError):
    """A module the shadow build cannot make (the update then takes the engine's reload)."""


class ShadowEngine(Protocol):
    """What an engine adapter's worker side gives the shadow build."""

    def unprocessed_copy(self, module: torch.nn.Module) -> torch.nn.Module:
        """A copy of ``module`` (see :func:`shallow_copy`) whose parameters are new tensors in the
        form the engine's loaders write (before any post-load processing), with the loaders bound
        to the copy; raises :class:`ShadowUnsupported` for a module it cannot copy that way."""
        ...

    def process(self, module: torch.nn.Module) -> None:
        """The engine's post-load processing of ``module`` (repack, quantize...), touching nothing
        but ``module`` itself."""
        ...


@dataclass
class ModuleSwitch:
    """One live module and the state it takes in the switch."""

    path: str
    module: torch.nn.Module
    state: dict[str, Any]
    #: The module's state before the switch (set by :meth:`ShadowBuild.switch`).
    old: dict[str, Any] | None = None


@dataclass
class ShadowBuild:
    """The shadows of one update, ready to switch in."""

    switches: list[ModuleSwitch] = field(default_factory=list)
    #: Bytes of the shadows' parameters and buffers before processing (what processing starts from).
    nbytes: int = 0
    seconds: float = 0.0

    def switch(self, after_each: Callable[[int], None] | None = None) -> None:
        """Put every shadow's state into its live module; on any failure (or when ``after_each``,
        called with the number of modules switched so far, raises) switch back and raise."""

        def switch_one(item: ModuleSwitch) -> None:
            item.old = item.module.__dict__
            object.__setattr__(item.module, "__dict__", item.state)

        switch_each(self.switches, switch_one, self.undo, after_each)

    def undo(self) -> None:
        """Give every switched module its old state back (in reverse order)."""
        for item in reversed(self.switches):
            if item.old is not None:
                object.__setattr__(item.module, "__dict__", item.old)
                item.old = None


def switch_each(
    items: Sequence[T],
    switch_one: Callable[[T], None],
    undo: Callable[[], None],
    after_each: Callable[[int], None] | None,
) -> None:
    """Switch every item in order, calling ``after_each`` with the number switched so far; on any
    failure (``after_each`` raising included) ``undo`` and raise (marked if the undo failed too:
    :func:`delta_swap.undo.restored`)."""
    try:
        for done, item in enumerate(items, start=1):
            switch_one(item)
            if after_each is not None:
                after_each(done)
    except BaseException as exc:
        take_back(undo, exc)
        raise


def shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object of the same class with the same attributes, and dictionaries of its own
    for parameters, buffers and submodules: replacing a tensor of the copy leaves ``module`` alone."""
    copy = object.__new__(type(module))
    state = dict(module.__dict__)
    for key in ("_parameters", "_buffers", "_modules"):
        state[key] = dict(state.get(key) or {})
    state["_non_persistent_buffers_set"] = set(state.get("_non_persistent_buffers_set") or ())
    object.__setattr__(copy, "__dict__", state)
    return copy


def build_shadows(
    model: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed: Mapping[str, Sequence[str]],
    engine: ShadowEngine,
    default_loader: Callable[..., Any],
    after_each: Callable[[int], None] | None = None,
) -> tuple[ShadowBuild, set[str]]:
    """(the shadows of every module ``weights`` load into, and of every module sharing a parameter
    with one; the names no loader received, which the engine ignores), one module at a time;
    ``after_each`` is called with the number of shadows built so far (tests raise from it).

    ``weights`` must hold whole modules (every constituent of a fused one): a shadow starts empty.
    Raises :class:`ShadowUnsupported` for a module the engine cannot build this way."""
    started = time.perf_counter()
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in weights:
        groups.setdefault(module_of(name, packed), []).append((name, tensor))
    params = dict(model.named_parameters())
    owners = _owners(model)
    build = ShadowBuild()
    built: set[int] = set()  # ids of the live modules shadowed in earlier groups
    made: list[tuple[str, torch.nn.Module, torch.nn.Module]] = []  # this group's (path, live, shadow)

    def into_shadow(name: str, param: torch.Tensor, original: Callable[..., Any]) -> Callable[..., Any]:
        path, live, attr = owners[id(param)][0]

        def load(*args: Any, **kwargs: Any) -> Any:
            entry = next((m for m in made if m[1] is live), None)
            if entry is None:
                if id(live) in built:
                    raise ShadowUnsupported(f"{path} is loaded by tensors of two modules")
                entry = (path, live, engine.unprocessed_copy(live))
                made.append(entry)
            target = getattr(entry[2], attr)
            args, kwargs = with_param(args, kwargs, target)
            return loader_of(target, default_loader)(*args, **kwargs)

        return load

    ignored: set[str] = set()
    for group in groups.values():
        made.clear()
        received = load_redirected(model, params, group, into_shadow, default_loader)
        ignored.update(name for name, _ in group if name not in received)
        for path, live, shadow in made:
            built.add(id(live))
            build.nbytes += _nbytes(shadow)
            sharing = _sharing_shadows(live, shadow, owners, engine)
            engine.process(shadow)
            rebind_loaders(shadow, live)
            build.switches.append(ModuleSwitch(path, live, shadow.__dict__))
            for other_path, other, other_shadow in sharing:
                engine.process(other_shadow)
                rebind_loaders(other_shadow, other)
                build.switches.append(ModuleSwitch(other_path, other, other_shadow.__dict__))
            if after_each is not None:
                after_each(len(build.switches))
    build.seconds = time.perf_counter() - started
    return build, ignored


def rebind_loaders(shadow: torch.nn.Module, live: torch.nn.Module) -> None:
    """Bind the methods the shadow's tensors carry (their weight loaders) to ``live``, whose state
    the shadow's becomes at the switch. Bound to the shadow object, each tensor would reach the
    shadow and through its state the tensor again: a reference cycle, so a state the next update
    replaces would wait for Python's cyclic collector (which vLLM's frozen heap rarely runs)
    instead of going when the swap is final. vLLM's prepack copies a weight's loader onto the
    packed weight, which keeps such a cycle on every MoE layer."""
    tensors = [*shadow._parameters.values(), *shadow._buffers.values()]
    for tensor in tensors:
        for key, value in list(getattr(tensor, "__dict__", {}).items()):
            if isinstance(value, MethodType) and value.__self__ is shadow:
                setattr(tensor, key, value.__func__.__get__(live))


def _owners(model: torch.nn.Module) -> dict[int, list[tuple[str, torch.nn.Module, str]]]:
    """Every parameter's modules, by the parameter's id: (module path, module, attribute name),
    the module that ``named_parameters`` names it after first."""
    owners: dict[int, list[tuple[str, torch.nn.Module, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((path, module, attr))
    return owners


def _sharing_shadows(
    live: torch.nn.Module,
    shadow: torch.nn.Module,
    owners: Mapping[int, list[tuple[str, torch.nn.Module, str]]],
    engine: ShadowEngine,
) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """Shadows of the other modules holding a parameter of ``live`` (a tied ``lm_head``), each on
    the shadow's new parameter (taken before ``shadow`` is processed)."""
    out: dict[int, tuple[str, torch.nn.Module, torch.nn.Module]] = {}
    for attr, param in live._parameters.items():
        if param is None:
            continue
        for path, other, other_attr in owners.get(id(param), []):
            if other is live:
                continue
            if id(other) not in out:
                out[id(other)] = (path, other, engine.unprocessed_copy(other))
            out[id(other)][2]._parameters[other_attr] = shadow._parameters[attr]
    return list(out.values())


def _nbytes(module: torch.nn.Module) -> int:
    tensors = [*module._parameters.values(), *module._buffers.values()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
