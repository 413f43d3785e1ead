"""The ``delta_swap`` weight-transfer backend, living in each vLLM worker. Its operations
(``update_info["op"]``):

* ``describe``: write the engine's parameter layout as an arena layout (or why there is none) and
  the model's fused-module mapping to ``output``: the API server then decodes updates into
  shared-memory arenas in that layout, or completes them to whole modules for ``load``;
* ``commit``: point every parameter at the arena file ``path`` (a reference swap, O(#parameters)):
  the arena path, used where parameters are plain host tensors (vLLM's CPU fallback for bf16);
* ``load`` (default): load the tensors of a staged safetensors file or checkpoint folder through
  vLLM's layerwise reload, which works after CPU (oneDNN, AMX) or GPU post-load processing has
  repacked the weights: the reload path, used everywhere else. Modules that share a parameter
  with a reloaded one without receiving anything (a tied ``lm_head``) are processed again after
  the reload, so no packed copy of the old weights stays behind.

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
from delta_swap.settings import Settings, SwapPath
from delta_swap.torch_params import check_matches, plan_layout, point_parameters

from .module_groups import complete_modules, module_groups, module_of

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
        self._packed: dict[str, list[str]] = {k: list(v) for k, v in
                                              (getattr(model, "packed_modules_mapping", None) or {}).items()}
        self._groups = module_groups(self._served.specs, self._packed)
        #: Modules that received tensors in the reload under way.
        self._touched: set[str] = set()
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
        """Write the arena layout of this worker's parameters (or the reason there is none) and
        the fused-module mapping that updates on the reload path are completed with."""
        params = dict(self.model.named_parameters())
        layout: ArenaLayout | None = None
        if Settings.load().swap_path is SwapPath.RELOAD:
            reason = "DELTA_SWAP_SWAP_PATH=reload"
        elif not self._served.specs:
            reason = "the served checkpoint is not a local folder"
        else:
            layout, reason = plan_layout(params, self._packed, self._served.specs)
        if layout is not None and self._served.checkpoint_dir is not None:
            checkpoint, _ = read_checkpoint_dir(self._served.checkpoint_dir)
            mismatch = check_matches(params, layout, checkpoint)
            if mismatch is not None:
                layout, reason = None, mismatch
        self._layout = layout
        Path(output).write_text(json.dumps({"layout": layout and layout.to_json(), "reason": reason,
                                            "packed": self._packed}))

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
        self._touched.update(module_of(name, self._packed) for name, _ in weights)
        with set_current_vllm_config(self.vllm_config), torch.inference_mode():
            if not self._active:
                initialize_layerwise_reload(self.model)
                self._active = True
            try:
                self.model.load_weights(iter(weights))
            except BaseException:
                self._finalize()  # untouched layers keep their weights
                raise
        log.info("delta_swap: loaded %d tensors in %.3fs", len(weights), time.perf_counter() - started)

    def _validate(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self._served.check_fits({name: (from_torch_dtype(t.dtype), tuple(t.shape)) for name, t in weights},
                                complete=False)
        names = {name for name, _ in weights}
        gaps = sorted(complete_modules(names, self._groups, self._packed) - names)
        if gaps:
            raise IncompatibleSnapshotError(f"incomplete modules, missing {gaps[:4]}")

    def finish_weight_update(self) -> None:
        if self._active:
            self._finalize()

    def _finalize(self) -> None:
        """End the layerwise reload, then process again every module that shares a parameter with
        a reloaded one but received nothing itself (its packed copy still holds the old weights)."""
        with set_current_vllm_config(self.vllm_config), torch.inference_mode():
            finalize_layerwise_reload(self.model, self.model_config)
            for path, module in _modules_sharing_parameters_with(self.model, self._touched):
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)
                    log.info("delta_swap: processed %s again (it shares weights with a reloaded module)", path)
        self._active = False
        self._touched = set()

    def shutdown(self) -> None:
        pass


def _modules_sharing_parameters_with(model: torch.nn.Module, touched: set[str]) -> list[tuple[str, torch.nn.Module]]:
    """Modules not in ``touched`` that hold a parameter object also held by a module in ``touched``
    (tied embeddings: ``lm_head`` holds ``embed_tokens.weight``)."""
    holders: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append((path, module))
    out: dict[str, torch.nn.Module] = {}
    for group in holders.values():
        if len(group) > 1 and any(path in touched for path, _ in group):
            out.update((path, module) for path, module in group if path not in touched)
    return sorted(out.items(), key=lambda item: item[0])
