"""The ``delta_swap`` weight-transfer backend, living in each vLLM worker. Its operations
(``update_info["op"]``):

* ``describe``: write the engine's parameter layout as an arena layout (or why there is none) to
  ``output``: the API server then decodes updates into shared-memory arenas in that layout;
* ``commit``: point every parameter at the arena file ``path`` (a reference swap, O(#parameters)):
  the arena path, used where parameters are plain host tensors (vLLM's CPU fallback for bf16);
* ``load`` (default): load the tensors of a staged safetensors file or checkpoint folder through
  vLLM's layerwise reload, which works after CPU (oneDNN, AMX) or GPU post-load processing has
  repacked the weights: the reload path, used everywhere else.

A layerwise reload that is started and never finalized leaves layers on the meta device and the
next forward pass kills the engine, so ``load`` validates everything first (names, dtypes, shapes
against the served checkpoint; complete fused groups), starts the reload only then, and finalizes
it on every error path: a failed update leaves the previous weights in place.
"""

from __future__ import annotations

import json
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

from delta_swap.arena import Arena, ArenaLayout
from delta_swap.checkpoint_dir import read_checkpoint_dir
from delta_swap.dtypes import from_torch_dtype
from delta_swap.errors import IncompatibleSnapshotError
from delta_swap.served_model import ServedModel
from delta_swap.torch_params import check_matches, plan_layout, point_parameters

from .fused import fused_group_members

log = logging.getLogger("vllm_delta_plugin")


@dataclass
class DeltaSwapInitInfo(WeightTransferInitInfo):
    """Nothing to set up: staged files are on the same host."""


@dataclass
class DeltaSwapUpdateInfo(WeightTransferUpdateInfo):
    """One operation: ``load`` a staged safetensors file or checkpoint folder (``path``,
    optionally only ``names``), ``commit`` to the arena file ``path``, or ``describe`` the
    parameter layout into the JSON file ``output``."""

    op: str = "load"
    path: str = ""
    names: list[str] = field(default_factory=list)
    output: str = ""


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
        self._layout: ArenaLayout | None = None
        self._arenas: dict[str, Arena] = {}

    def init_transfer_engine(self, init_info: DeltaSwapInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        self._active = False  # the reload starts in receive_weights, once the update is validated

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # copies to the device may still be in flight
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DeltaSwapUpdateInfo) -> None:
        if update_info.op == "describe":
            self._describe(update_info.output)
        elif update_info.op == "commit":
            self._commit(update_info.path)
        elif update_info.op == "load":
            self._load(update_info)
        else:
            raise ValueError(f"delta_swap: unknown operation {update_info.op!r}")

    def _describe(self, output: str) -> None:
        """Write the arena layout of this worker's parameters (or the reason there is none)."""
        params = dict(self.model.named_parameters())
        layout, reason = plan_layout(params, self._packed, self._served.specs) if self._served.specs else (
            None, "the served checkpoint is not a local folder")
        if layout is not None and self._served.checkpoint_dir is not None:
            checkpoint, _ = read_checkpoint_dir(self._served.checkpoint_dir)
            mismatch = check_matches(params, layout, checkpoint)
            if mismatch is not None:
                layout, reason = None, mismatch
        self._layout = layout
        Path(output).write_text(json.dumps({"layout": layout and layout.to_json(), "reason": reason}))

    def _commit(self, path: str) -> None:
        """Point every parameter at the arena ``path`` (mapped on first use)."""
        if self._layout is None:
            raise ValueError("delta_swap: commit before a layout was described")
        started = time.perf_counter()
        arena = self._arenas.get(path)
        if arena is None:
            arena = self._arenas[path] = Arena(path, self._layout)
        point_parameters(dict(self.model.named_parameters()), arena)
        log.info("delta_swap: parameters now live in %s (%.1f ms)", path, 1000 * (time.perf_counter() - started))

    def _load(self, update_info: DeltaSwapUpdateInfo) -> None:
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
