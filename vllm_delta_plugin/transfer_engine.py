"""The ``delta_swap`` weight-transfer backend, living in each vLLM worker.

The API server stages verified tensors as a safetensors file in shared memory; ``update_weights``
names that file and the worker maps it and loads the tensors through vLLM's layerwise reload,
which works after CPU (oneDNN) or GPU post-load processing has repacked the weights.

A layerwise reload that is started and never finalized leaves layers on the meta device and the
next forward pass kills the engine, so this backend validates everything first (names, dtypes,
shapes against the served checkpoint; complete fused groups), starts the reload only then, and
finalizes it on every error path: a failed update leaves the previous weights in place.
"""

from __future__ import annotations

import logging
import os
import time
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

from delta_swap.dtypes import from_torch_dtype
from delta_swap.errors import IncompatibleSnapshotError
from delta_swap.served_model import ServedModel

from .fused import fused_group_members

log = logging.getLogger("vllm_delta_plugin")


@dataclass
class DeltaSwapInitInfo(WeightTransferInitInfo):
    """Nothing to set up: staged files are on the same host."""


@dataclass
class DeltaSwapUpdateInfo(WeightTransferUpdateInfo):
    """A staged safetensors file (or a checkpoint folder of them), and optionally which of
    its tensors to load (default: all)."""

    path: str = ""
    names: list[str] = field(default_factory=list)


def _read_tensors(path: str, wanted: set[str]) -> list[tuple[str, torch.Tensor]]:
    """Tensors of one safetensors file or of every one in a folder (memory-mapped reads)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if os.path.isdir(path) else [Path(path)]
    out = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out.extend((name, f.get_tensor(name)) for name in f.keys() if not wanted or name in wanted)
    return out


class DeltaSwapTransferEngine(WeightTransferEngine[DeltaSwapInitInfo, DeltaSwapUpdateInfo]):
    init_info_cls = DeltaSwapInitInfo
    update_info_cls = DeltaSwapUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._served = ServedModel.from_checkpoint(str(vllm_config.model_config.model))
        self._packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
        self._active = False

    def init_transfer_engine(self, init_info: DeltaSwapInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        self._active = False  # the reload starts in receive_weights, once the update is validated

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # copies to the device may still be in flight
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DeltaSwapUpdateInfo) -> None:
        started = time.perf_counter()
        weights = _read_tensors(update_info.path, set(update_info.names))
        self._validate(weights)
        with set_current_vllm_config(self.vllm_config), torch.inference_mode():
            if not self._active:
                initialize_layerwise_reload(self.model)
                self._active = True
            try:
                self.model.load_weights(iter(weights))
            except BaseException:
                finalize_layerwise_reload(self.model, self.model_config)  # untouched layers keep their weights
                self._active = False
                raise
        log.info("delta_swap: loaded %d tensors in %.3fs", len(weights), time.perf_counter() - started)

    def _validate(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self._served.check_fits({name: (from_torch_dtype(t.dtype), tuple(t.shape)) for name, t in weights},
                                complete=False)
        names = {name for name, _ in weights}
        gaps = sorted(fused_group_members(names, self._packed) - names)
        if gaps:
            raise IncompatibleSnapshotError(f"incomplete fused groups, missing {gaps[:4]}")

    def finish_weight_update(self) -> None:
        if self._active:
            with set_current_vllm_config(self.vllm_config), torch.inference_mode():
                finalize_layerwise_reload(self.model, self.model_config)
            self._active = False

    def shutdown(self) -> None:
        pass
