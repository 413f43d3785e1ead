"""``vllm.general_plugins`` entry point: runs in the API server, the engine core and every worker."""

from __future__ import annotations

from .config import BACKEND_NAME


def register() -> None:
    """Register the ``delta_swap`` weight-transfer backend (idempotent: vLLM may call this twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "vllm_delta_plugin.transfer_engine", "DeltaSwapTransferEngine"
        )
