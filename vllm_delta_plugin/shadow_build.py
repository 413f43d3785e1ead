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
(quantized experts, attention): :class:`~delta_swap.shadow.ShadowUnsupported`, and an update that
loads into one takes the reload path.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch

from delta_swap.loader_redirect import scratch_of
from delta_swap.shadow import ShadowUnsupported, shallow_copy

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
            method.process_weights_after_loading(module)
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

    if not current_platform.is_cpu():
        return None
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return experts if experts is not None and hasattr(experts, "process_weights_after_loading") else None


def _experts_refusal(module: torch.nn.Module, method: Any) -> str | None:
    """Why the shadow build cannot make this MoE ``module`` (None: it can): only unquantized
    experts on vLLM's CPU experts kernel, set up, without biases."""
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
