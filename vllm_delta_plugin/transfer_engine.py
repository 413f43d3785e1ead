"""The ``delta_swap`` weight-transfer backend, living in each vLLM worker.

The API server stages verified tensors as a safetensors file in shared memory; ``update_weights``
names that file and the worker maps it and loads the tensors through vLLM's layerwise reload,
which works after CPU (oneDNN) or GPU post-load processing has repacked the weights.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

log = logging.getLogger("vllm_delta_plugin")


def _iter_tensors(path: str, wanted: set[str], loaded: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of one safetensors file or of every one in a folder, memory-mapped."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if os.path.isdir(path) else [Path(path)]
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not wanted or name in wanted:
                    loaded.append(name)
                    yield name, f.get_tensor(name)


@dataclass
class DeltaSwapInitInfo(WeightTransferInitInfo):
    """Nothing to set up: staged files are on the same host."""


@dataclass
class DeltaSwapUpdateInfo(WeightTransferUpdateInfo):
    """A staged safetensors file (or a checkpoint folder of them), and optionally which of
    its tensors to load (default: all)."""

    path: str = ""
    names: list[str] = field(default_factory=list)


class DeltaSwapTransferEngine(WeightTransferEngine[DeltaSwapInitInfo, DeltaSwapUpdateInfo]):
    init_info_cls = DeltaSwapInitInfo
    update_info_cls = DeltaSwapUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: DeltaSwapInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # the base class syncs unconditionally, which fails on CPU
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DeltaSwapUpdateInfo) -> None:
        started = time.perf_counter()
        loaded: list[str] = []
        with set_current_vllm_config(self.vllm_config), torch.inference_mode():
            self.model.load_weights(_iter_tensors(update_info.path, set(update_info.names), loaded))
        log.info("delta_swap: loaded %d tensors in %.3fs", len(loaded), time.perf_counter() - started)

    def finish_weight_update(self) -> None:
        with set_current_vllm_config(self.vllm_config), torch.inference_mode():
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass
