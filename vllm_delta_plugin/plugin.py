"""``vllm.general_plugins`` entry point: runs in the API server, the engine core and every worker."""

from __future__ import annotations

import logging
from typing import Any

#: The name of the weight-transfer backend (``--weight-transfer-config '{"backend": "delta_swap"}'``).
BACKEND_NAME = "delta_swap"

log = logging.getLogger("vllm_delta_plugin")


def register() -> None:
    """Register the ``delta_swap`` weight-transfer backend, and the ``delta_swap`` trainer engine
    (:mod:`.trainer_engine`, imported only when a trainer creates it), in their separate registries
    (idempotent: vLLM may call this twice)."""
    import torch
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from delta_swap.settings import Settings, SwapPath

    # On CPUs with AMX, vLLM's CPU attention can pick AMX kernels before the process has asked the
    # kernel for AMX tile state; a first request under 8 prompt tokens then dies with SIGILL.
    if hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "vllm_delta_plugin.transfer_engine", "DeltaSwapTransferEngine"
        )
    if BACKEND_NAME not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND_NAME, "vllm_delta_plugin.trainer_engine", "DeltaSwapTrainerEngine"
        )
    if Settings.load().swap_path in (SwapPath.ARENA, SwapPath.INPLACE):
        keep_plain_cpu_weights()


def keep_plain_cpu_weights() -> None:
    """Make vLLM's CPU linear layers compute from their plain weights (``torch.nn.functional.linear``)
    instead of a copy repacked for oneDNN or AMX, so that they can live in a weight arena.

    This is what vLLM itself does on CPUs without those kernels; it costs matrix-product speed on
    CPUs that have them. Linear weights of other shapes (MoE experts, convolutions) keep vLLM's
    own handling. Idempotent; nothing happens off the CPU platform."""
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(utils.dispatch_cpu_unquantized_gemm, "_delta_swap", False):
        return
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch_plain(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            original(layer, remove_weight)
            return
        import torch

        layer.cpu_linear = torch.nn.functional.linear

    dispatch_plain._delta_swap = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch_plain
    log.info(
        "delta_swap: DELTA_SWAP_SWAP_PATH=arena/inplace: CPU linear layers keep plain weights (no oneDNN/AMX repack)"
    )
