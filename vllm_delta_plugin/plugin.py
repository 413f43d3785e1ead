"""``vllm.general_plugins`` entry point: runs in the API server, the engine core and every worker."""

from __future__ import annotations

#: The name of the weight-transfer backend (``--weight-transfer-config '{"backend": "delta_swap"}'``).
BACKEND_NAME = "delta_swap"


def register() -> None:
    """Register the ``delta_swap`` weight-transfer backend (idempotent: vLLM may call this twice)."""
    import torch
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # On CPUs with AMX, vLLM's CPU attention can pick AMX kernels before the process has asked the
    # kernel for AMX tile state; a first request under 8 prompt tokens then dies with SIGILL.
    if hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "vllm_delta_plugin.transfer_engine", "DeltaSwapTransferEngine"
        )
