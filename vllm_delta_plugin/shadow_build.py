"""vLLM's side of the shadow build (:mod:`delta_swap.shadow`): a module's load-time form and its
post-load processing, both as vLLM itself records and runs them for its layerwise reload.

When vLLM builds a model it records every module's parameters and buffers as they are before
processing (meta tensors with their loaders: ``record_metadata_for_reloading``). A shadow gets new
zeroed tensors of those shapes, with the loaders bound to the shadow; the tensors vLLM never records
(``bias``, built after ``create_weights``) are copied. Processing is the module's quantization
method's ``process_weights_after_loading``, which on the CPU packs linear weights for oneDNN or
AMX into a closure on the module (``cpu_linear``), all state of the module itself.

MoE experts (unquantized, on vLLM's CPU experts kernel) are built the same way: the quantization
method's processing hands the loaded weights to the kernel (on an update it only copies them,
since the kernel is set up), and the CPU experts kernel's own ``process_weights_after_loading``
then prepacks the shadow's weights, on the shadow (vLLM's reload skips that step; see
:func:`cpu_experts`). The kernel reads the weights from the module it is called with, so the
switch takes them in. MoE layers with biases are refused (the kernel's quantization config holds
the live biases), as is any module whose processing keeps other state outside the module
(attention, experts of checkpoint-quantized models): :class:`~delta_swap.shadow.ShadowUnsupported`,
and an update that loads into one takes the reload path.

Experts that vLLM quantizes as it loads them (``--quantization int8_per_channel_weight_only``) keep
their kernel and the scales' config on the layer's quantization method, one per layer: a shadow gets
a copy of that method, so its quantization and kernel set-up touch only the copy, which the switch
takes in with the rest of the shadow's state (on one rank: over several, the quantization reduces
scales across the ranks, a collective). :func:`quantized_experts_check` reads them back.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from types import MethodType
from typing import Any

import torch

from delta_swap.errors import ChecksumMismatchError
from delta_swap.fresh_pages import zeroed_host_tensor
from delta_swap.loader_redirect import scratch_of
from delta_swap.readback import ExpertsCheck
from delta_swap.shadow import ShadowUnsupported, build_shadows, shallow_copy

#: Quantization methods whose ``process_weights_after_loading`` only sets attributes of the layer
#: it is given (class names, so that importing this module needs no vLLM layer).
_SELF_CONTAINED = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}


def shadow_possible() -> str | None:
    """Why this vLLM cannot build shadows (None: it can)."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise, sanitize  # noqa: F401
    except ImportError as exc:
        return f"this vLLM records no load-time layouts ({exc})"
    return None


class VllmShadowEngine:
    """:class:`delta_swap.shadow.ShadowEngine` for a vLLM model."""

    def unprocessed_copy(self, module: torch.nn.Module) -> torch.nn.Module:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS
        from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in _SELF_CONTAINED:
            why = _experts_refusal(module, method)
            if why is not None:
                raise ShadowUnsupported(f"{type(module).__name__} is processed by {type(method).__name__}: {why}")
        info = LAYERWISE_INFO.get(module)
        if info is None:
            raise ShadowUnsupported(f"vLLM recorded no load-time layout of {type(module).__name__}")
        restore_params, restore_buffers = info.restore_metadata
        shadow = shallow_copy(module)
        if _quantized_online(method):  # its kernel and scales go on the method: the shadow gets its own
            shadow.__dict__["quant_method"] = copy.copy(method)

        def fresh(meta: torch.Tensor) -> torch.Tensor:
            return _materialized(meta, module, shadow, layer_ref_sentinel, info.restore_device)

        # tensors vLLM does not record (the bias) are copied: a loader writes into the copy
        # (and names registered as None, such as the bias of a linear without one, stay None)
        params: dict[str, torch.Tensor | None] = {name: fresh(meta) for name, meta in restore_params.items()}
        for name, t in module._parameters.items():
            if name not in params and (t is None or name in SKIP_TENSORS):
                params[name] = None if t is None else scratch_of(t)
        buffers: dict[str, torch.Tensor | None] = {name: fresh(meta) for name, meta in restore_buffers.items()}
        for name, buffer in module._buffers.items():
            if name not in buffers and (buffer is None or name in SKIP_TENSORS):
                buffers[name] = buffer
        shadow._parameters, shadow._buffers = params, buffers  # type: ignore[assignment]  # torch types them Parameter
        shadow.__dict__.pop("_already_called_process_weights_after_loading", None)
        return shadow

    def process(self, module: torch.nn.Module) -> None:
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)  # quantized online: with the kernel's prepack
            experts = cpu_experts(module)
            if experts is not None:  # the prepack vLLM runs only at the first load
                experts.process_weights_after_loading(module)
        update_tp_status = getattr(module, "update_param_tp_status", None)
        if update_tp_status is not None:
            update_tp_status()


def cpu_experts(module: torch.nn.Module) -> Any | None:
    """The CPU experts kernel of an MoE ``module`` that prepacks its weights after loading (None
    for any other module). vLLM prepacks only at the first load: on a weight update its
    quantization method copies the plain weights into the module and leaves the prepack out, so
    whoever loads them again must run the kernel's ``process_weights_after_loading`` itself."""
    from vllm.platforms import current_platform

    method = getattr(module, "quant_method", None)
    if not current_platform.is_cpu() or type(method).__name__ != "UnquantizedFusedMoEMethod":
        return None  # a method that quantizes runs its kernel's processing itself, at every load
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return experts if experts is not None and hasattr(experts, "process_weights_after_loading") else None


#: ``--quantization`` methods whose modules the shadow build makes as vLLM does when it loads (their
#: quantization runs on the shadow, with its own copy of the layer's method) and the read-back
#: checks (:func:`quantized_experts_check`): MoE experts quantized to int8 as they load.
EXACT_QUANTIZATIONS = ("int8_per_channel_weight_only",)


def exact_quantizations(parallel: Any) -> dict[str, str | None]:
    """Each of :data:`EXACT_QUANTIZATIONS` -> None where a server with this ``parallel_config`` is
    kept exact, else why not."""
    ranks = int(getattr(parallel, "tensor_parallel_size", 1) or 1) * int(
        getattr(parallel, "data_parallel_size", 1) or 1
    )
    why = (
        None
        if ranks == 1
        else "over tensor- or data-parallel ranks its quantization reduces each expert's scale across the ranks "
        "(a collective, which the shadow build cannot run beside the engine's own); serve it on one rank"
    )
    return {name: why for name in EXACT_QUANTIZATIONS}


def quantized_experts_check(
    model: torch.nn.Module, packed: Mapping[str, Sequence[str]], default_loader: Callable[..., Any]
) -> ExpertsCheck:
    """The read-back of MoE experts vLLM quantized as it loaded them
    (:data:`delta_swap.readback.ExpertsCheck`): the published tensors of the layer are loaded and
    quantized into a fresh shadow of it, as a fresh server would (:class:`VllmShadowEngine`), and
    every expert of the live layer must compute exactly what it computes there, through the layer's
    own kernel (one probe token per expert, routed to it alone). Experts not quantized online: None
    (the prepack comparison runs). It catches what the swap left behind (stale weights, a switch
    that missed a tensor); a fault of the build itself, shared by the reference, is for the
    exactness tests, which compare with a fresh server. It rebuilds the layer in the pause: its
    cost is the share of swaps the verification budget reads back."""

    def check(path: str, experts: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> int | None:
        layer: Any = experts  # a vLLM RoutedExperts (torch types its attributes Tensor | Module)
        method = getattr(layer, "quant_method", None)
        if method is None or not _quantized_online(method):
            return None
        if getattr(method, "is_monolithic", False):
            raise ChecksumMismatchError(f"{path}: cannot read back experts on a monolithic kernel")
        build, _ = build_shadows(model, sorted(tensors.items()), packed, VllmShadowEngine(), default_loader)
        fresh = next((item.state for item in build.switches if item.module is experts), None)
        if fresh is None:
            raise ChecksumMismatchError(f"{path}: the published tensors of it load into no shadow of it")
        reference: Any = object.__new__(type(experts))
        object.__setattr__(reference, "__dict__", fresh)
        numbers = sorted({int(name.split(".experts.", 1)[1].split(".")[0]) for name in tensors})
        gen = torch.Generator().manual_seed(len(numbers))
        dtype = getattr(layer, "orig_dtype", torch.bfloat16)
        probes = torch.randn(len(numbers), int(layer.hidden_size), generator=gen).to(layer.w2_weight.device, dtype)
        top_k = int(layer.top_k)  # each probe token goes to one expert alone, in all of its top-k slots
        ids = torch.tensor(numbers, dtype=torch.int32, device=probes.device).unsqueeze(1).repeat(1, top_k)
        weights = torch.full((len(numbers), top_k), 1.0 / top_k, dtype=torch.float32, device=probes.device)
        live = method.apply(layer, probes, weights, ids, None, None)
        want = reference.quant_method.apply(reference, probes, weights, ids, None, None)
        same = torch.isclose(live, want, rtol=0, atol=0, equal_nan=True).flatten(1).all(1)  # NaN weights give NaN
        differ = [numbers[i] for i in range(len(numbers)) if not bool(same[i])]
        if differ:
            raise ChecksumMismatchError(
                f"{path}.{differ[0]}: the engine computes with other values than the snapshot (vLLM's "
                f"{type(method).__name__} of the published expert; {len(differ)} of {len(numbers)} experts differ)"
            )
        return 1

    return check


def _quantized_online(method: Any) -> bool:
    """Whether ``method`` quantizes bf16 experts to int8 as vLLM loads them (``--quantization
    int8_per_channel_weight_only``; the other online methods are not checked yet): its processing
    sets the kernel and the scales' config on the method itself, one method per layer, so a shadow
    takes a copy of it."""
    try:
        from vllm.model_executor.layers.quantization.online.int8 import Int8OnlineMoEMethod
    except ImportError:
        return False
    return isinstance(method, Int8OnlineMoEMethod)


def _experts_refusal(module: torch.nn.Module, method: Any) -> str | None:
    """Why the shadow build cannot make this MoE ``module`` (None: it can): unquantized experts on
    vLLM's CPU experts kernel, set up, without biases; or experts quantized online on one rank."""
    if _quantized_online(method):
        if getattr(getattr(method, "moe", None), "tp_size", 1) > 1:
            return (
                "its online quantization reduces each expert's scale over the tensor-parallel ranks (a "
                "collective, which cannot run beside the engine's own while it generates)"
            )
        return None
    if type(method).__name__ != "UnquantizedFusedMoEMethod":
        return "its processing keeps state outside the module"
    if getattr(method, "moe_kernel", None) is None or cpu_experts(module) is None:
        return "not on vLLM's CPU experts kernel"
    if getattr(getattr(method, "moe", None), "has_bias", False):
        return "the experts kernel holds the live biases"
    return None


def _materialized(
    meta: torch.Tensor, module: torch.nn.Module, shadow: torch.nn.Module, sentinel: Any, device: Any
) -> torch.Tensor:
    """A zeroed tensor of the recorded ``meta`` tensor's shape, class and attributes, its loader
    methods bound to ``shadow`` (vLLM's record leaves them bound to a sentinel or to ``module``)."""
    if torch.device(device).type == "cpu":  # fresh zero pages, huge where the kernel allows (one pass, not two)
        tensor = zeroed_host_tensor(tuple(meta.size()), tuple(meta.stride()), meta.dtype)
    else:
        with device:
            tensor = torch.empty_strided(tuple(meta.size()), tuple(meta.stride()), dtype=meta.dtype).zero_()
    tensor.__class__ = meta.__class__
    attrs = meta.__dict__.copy()
    for key, value in attrs.items():
        # a layerwise reload that did not load this module leaves its deferring wrapper on the record
        while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
            value = value.__wrapped__
        if isinstance(value, MethodType) and (value.__self__ is sentinel or value.__self__ is module):
            value = value.__func__.__get__(shadow)
        attrs[key] = value
    tensor.__dict__ = attrs
    return tensor
