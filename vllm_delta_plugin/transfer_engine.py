"""The ``delta_swap`` weight-transfer backend, living in each vLLM worker. Its operations
(``update_info["op"]``):

* ``describe``: write the engine's parameter layout as an arena layout (or why there is none) and
  the model's fused-module mapping to ``output``: the API server then decodes updates into
  shared-memory arenas in that layout, or completes them to whole modules for ``load``;
* ``commit``: point every parameter at the arena file ``path`` (a reference swap, O(#parameters)):
  the arena path, used where parameters are plain host tensors (vLLM's CPU fallback for bf16);
* ``load`` with ``verify_path``: also finish the reload and read back, in the same call, what the
  reloaded modules now compute with against that file's tensors (:mod:`delta_swap.readback`; each
  tensor-parallel rank against its own shard of them, :mod:`.readback_shards`);
* ``stage_inplace`` / ``stage_wait`` / ``scatter`` / ``drop_staged``: the in-place path
  (``swap_path=inplace``, where every parameter is a plain tensor holding the checkpoint's values
  as the engine's loaders place them): ``stage_inplace`` starts working out each parameter's
  changed elements through the model's own loaders (:func:`delta_swap.inplace.element_changes`)
  on a thread of the worker, so the engine keeps generating, and ``stage_wait`` answers whether
  that is done; in the pause ``scatter`` writes them with an undo log (:mod:`delta_swap.inplace`),
  reads the changed modules back if asked, and undoes everything on any failure;
* ``stage_shadow`` / ``stage_wait`` / ``switch`` / ``drop_staged``: the shadow path (where vLLM
  repacks its CPU weights for oneDNN or AMX): ``stage_shadow`` starts building the changed modules'
  new weights, processed as vLLM processes them, into shadow modules on a thread of the worker
  (:mod:`delta_swap.shadow`, :mod:`.shadow_build`), and answers through ``stage_wait`` whether that
  is done (or why this update must be reloaded instead: a module the shadow build cannot make, such
  as MoE experts); in the pause ``switch`` points every changed module at its shadow, reads the
  changed modules back if asked, and switches back on any failure;
* ``undo``: take back this worker's last ``scatter`` or ``switch`` (another rank failed its own),
  until ``drop_staged`` makes the swap final; a failed ``scatter`` or ``switch`` answers
  ``restored`` once its own worker holds the old weights again;
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

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from delta_swap.dtypes import from_torch_dtype
from delta_swap.errors import ChecksumMismatchError, IncompatibleSnapshotError
from delta_swap.host_memory import freed_memory, keep_freed_memory
from delta_swap.module_groups import complete_modules, module_groups, module_of
from delta_swap.readback import modules_sharing_parameters_with as _modules_sharing_parameters_with
from delta_swap.readback import verify_modules
from delta_swap.served_model import ServedModel
from delta_swap.settings import Settings, SwapPath
from delta_swap.staged_swap import StagedSwap, copy_views, inplace_possible, read_staged
from delta_swap.staging_files import ring_doorbell
from delta_swap.torch_params import ArenaMappings, describe_arena
from delta_swap.undo import restored

from .readback_shards import local_shards
from .shadow_build import VllmShadowEngine, cpu_experts, quantized_experts_check, shadow_possible
from .worker_results import write_worker_result

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
    #: With ``load``: finish the reload and read back the modules against this file's tensors
    #: (``verify_names`` of it), in the same call; the result goes to ``output``.
    verify_path: str = ""
    verify_names: list[str] = field(default_factory=list)
    #: With ``scatter`` / ``switch``: fail after writing this many parameters or switching this many
    #: modules (tests of the undo; -1: never), on the tensor-parallel rank ``fail_rank`` alone (-1: on every rank).
    fail_after: int = -1
    fail_rank: int = -1
    #: With ``stage_inplace`` / ``stage_shadow``: the doorbell this worker rings once staging is
    #: done (:func:`delta_swap.staging_files.ring_doorbell`), so the API server need not ask it.
    doorbell: str = ""


class DeltaSwapTransferEngine(WeightTransferEngine[DeltaSwapInitInfo, DeltaSwapUpdateInfo]):
    init_info_cls = DeltaSwapInitInfo
    update_info_cls = DeltaSwapUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._served = ServedModel.from_checkpoint(str(vllm_config.model_config.model))
        self._packed: dict[str, list[str]] = {
            k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()
        }
        self._groups = module_groups(self._served.specs, self._packed)
        #: Modules that received tensors in the reload under way.
        self._touched: set[str] = set()
        #: The tensors read for the reload under way (views of the staged file).
        self._loaded: list[tuple[str, torch.Tensor]] = []
        self._active = False
        self._arenas: ArenaMappings | None = None
        #: The in-place and shadow paths: what a thread of this worker stages while the engine
        #: generates, and the undo, kept until the swap is final.
        self._staged = StagedSwap()
        #: The undo of this worker's last scatter or switch, until the swap is final.
        self._undo: Any = None
        if Settings.load().keep_freed_memory:  # here, where updates are built: not the API server's
            why = keep_freed_memory()
            if why is not None:
                log.warning("delta_swap: DELTA_SWAP_KEEP_FREED_MEMORY=1 not applied: %s", why)

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
        elif update_info.op == "stage_inplace":
            self._stage_inplace(update_info)
        elif update_info.op in ("scatter", "switch"):
            self._swap_staged(update_info)
        elif update_info.op == "stage_wait":  # answers whether staging is done, never waits
            write_worker_result(update_info.output, self._staged.answer())
        elif update_info.op == "stage_shadow":
            self._stage_shadow(update_info)
        elif update_info.op == "undo":  # answered, not raised (see _verify)
            try:
                write_worker_result(update_info.output, {"undone": self._take_back()})
            except Exception as exc:
                log.error("delta_swap: taking back the last swap failed: %s", exc)
                write_worker_result(update_info.output, {"undone": False, "error": f"{type(exc).__name__}: {exc}"})
        elif update_info.op == "drop_staged":
            self._undo = None
            self._staged.drop()
        else:
            raise ValueError(f"delta_swap: unknown operation {update_info.op!r}")

    def _describe(self, output: str) -> None:
        """Write how this worker swaps, with the reason: its arena layout (``auto``: one rank of
        plain host tensors), else whether it writes changed elements in place (``auto``: plain
        tensors holding the checkpoint's elements, as at tensor parallel > 1 or on a GPU), else
        whether it builds shadow modules (``auto``: weights repacked on the CPU); the fused-module
        mapping that updates on the reload path are completed with; and what this process does with
        the memory an update frees."""

        def answer(reason: str, layout: Any = None, **path: bool) -> None:
            doc = {"layout": layout, "reason": reason, "packed": self._packed, "freed_memory": freed_memory()}
            write_worker_result(output, doc | path)

        params = dict(self.model.named_parameters())
        layout = None
        swap_path = Settings.load().swap_path
        if swap_path is SwapPath.INPLACE:
            inplace, reason = inplace_possible(
                self.model, self._served, self._packed, default_weight_loader, self._load_context
            )
            answer(reason, inplace=inplace)
            return
        if swap_path is SwapPath.RELOAD:
            reason = "DELTA_SWAP_SWAP_PATH=reload"
        elif swap_path is SwapPath.SHADOW:
            reason = "DELTA_SWAP_SWAP_PATH=shadow"
        else:
            layout, reason = describe_arena(params, self._packed, self._served)
        self._arenas = ArenaMappings(layout) if layout is not None else None
        if layout is None and swap_path is SwapPath.AUTO:
            inplace, why = inplace_possible(
                self.model, self._served, self._packed, default_weight_loader, self._load_context
            )
            if inplace:
                answer(f"{reason}; changed elements written in place", inplace=True)
                return
            reason = f"{reason}; {why}"
        shadow = False
        if layout is None and swap_path in (SwapPath.AUTO, SwapPath.SHADOW):
            why_not = self._shadow_impossible()
            shadow = why_not is None
            reason = (
                f"{reason}; new weights built as shadow modules before the pause" if shadow else f"{reason}; {why_not}"
            )
        answer(reason, layout and layout.to_json(), shadow=shadow)

    def _shadow_impossible(self) -> str | None:
        """Why this worker cannot build shadow modules (None: it can)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():  # a switch by reference would leave CUDA graphs on the old tensors
            return "shadow modules are built on the CPU platform only"
        return shadow_possible()

    def _commit(self, path: str) -> None:
        """Point every parameter at the arena ``path`` (mapped on first use)."""
        if self._arenas is None:
            raise ValueError("delta_swap: commit before a layout was described")
        started = time.perf_counter()
        self._arenas.point(dict(self.model.named_parameters()), path)
        log.info("delta_swap: parameters now live in %s (%.1f ms)", path, 1000 * (time.perf_counter() - started))

    def _load_context(self) -> Any:
        return set_current_vllm_config(self.vllm_config)

    def _stage_shadow(self, update_info: DeltaSwapUpdateInfo) -> None:
        """Start building the shadows of the modules the staged tensors load into (new weights,
        processed as vLLM processes them) on this worker's staging thread: the engine goes on
        generating meanwhile."""
        self._staged.drop()
        weights = read_staged(update_info.path, set(update_info.names))
        self._validate(weights)
        self._staged.stage_shadow(
            self.model,
            weights,
            self._packed,
            VllmShadowEngine(),
            default_weight_loader,
            self._load_context,
            update_info.fail_after,
            _doorbell(update_info),
        )

    def _stage_inplace(self, update_info: DeltaSwapUpdateInfo) -> None:
        """Start working out, through the model's own loaders, which elements of this rank's
        parameters the staged tensors change (positions and new values, kept next to the
        parameters), on this worker's staging thread: the engine goes on generating meanwhile."""
        self._staged.drop()
        weights = read_staged(update_info.path, set(update_info.names))
        self._served.check_fits(
            {name: (from_torch_dtype(t.dtype), tuple(t.shape)) for name, t in weights}, complete=False
        )
        self._staged.stage_inplace(
            self.model, weights, self._packed, default_weight_loader, self._load_context, _doorbell(update_info)
        )

    def _swap_staged(self, update_info: DeltaSwapUpdateInfo) -> None:
        """In the pause: ``scatter`` the staged changes into the live parameters, or ``switch`` the
        changed modules to their shadows, then read the changed modules back if asked; any failure
        puts the old values (modules) back and is answered in ``output`` (see :meth:`_verify` for
        why answered, not raised)."""
        started = time.perf_counter()
        unit = "parameters" if update_info.op == "scatter" else "modules"
        self._undo = None
        fails = update_info.fail_rank < 0 or update_info.fail_rank == get_tensor_model_parallel_rank()
        try:
            count, undo = self._staged.apply(update_info.op, self.model, update_info.fail_after if fails else -1)
        except Exception as exc:  # scatter and switch undo themselves (and say if that failed)
            log.error("delta_swap: the %s failed and was undone: %s", update_info.op, exc)
            write_worker_result(
                update_info.output,
                {"checks": 0, "seconds": 0.0, "error": f"{type(exc).__name__}: {exc}", "restored": restored(exc)},
            )
            return
        written = time.perf_counter() - started
        log.info("delta_swap: %s of %d %s in %.1f ms", update_info.op, count, unit, 1000 * written)
        if not update_info.verify_path:
            self._undo = undo
            write_worker_result(update_info.output, {"checks": 0, "seconds": 0.0, "written_s": written})
            return
        if self._verify(update_info.verify_path, update_info.verify_names, update_info.output, restored=True):
            self._undo = undo
            return
        try:
            with torch.inference_mode():
                undo.undo()
        except Exception as exc:  # answered, not raised (see _verify)
            log.error(
                "delta_swap: the read-back after the %s failed, and so did taking it back: %s", update_info.op, exc
            )
            error = f"the read-back failed and taking the {update_info.op} back failed too: {type(exc).__name__}: {exc}"
            write_worker_result(update_info.output, {"checks": 0, "seconds": 0.0, "error": error, "restored": False})
            return
        log.error("delta_swap: the read-back after the %s failed: the old %s are back", update_info.op, unit)

    def _take_back(self) -> bool:
        """Undo this worker's last scatter or switch (another rank failed); whether there was one."""
        undo, self._undo = self._undo, None
        if undo is None:
            return False
        with torch.inference_mode():
            undo.undo()
        log.info("delta_swap: took back the last swap (another rank failed)")
        return True

    def _load(self, update_info: DeltaSwapUpdateInfo) -> None:
        started = time.perf_counter()
        weights = read_staged(update_info.path, set(update_info.names))
        self._validate(weights)
        self._touched.update(module_of(name, self._packed) for name, _ in weights)
        self._loaded.extend(weights)  # views of the staged file: no parameter may keep one (_finalize)
        with set_current_vllm_config(self.vllm_config), torch.inference_mode():
            if not self._active:
                initialize_layerwise_reload(self.model)
                self._active = True
            load_weights: Any = self.model.load_weights  # a vLLM model's; torch types it Tensor | Module
            try:
                load_weights(iter(weights))
            except BaseException:
                self._finalize()  # untouched layers keep their weights
                raise
        log.info("delta_swap: loaded %d tensors in %.3fs", len(weights), time.perf_counter() - started)
        if update_info.verify_path:  # finish the reload now, then read it back, in one call
            self._finalize()
            self._verify(update_info.verify_path, update_info.verify_names, update_info.output)

    def _verify(self, path: str, names: list[str], output: str, restored: bool = False) -> bool:
        """Read back the modules a ``load`` just reloaded (and those sharing a parameter with
        them) through the engine's own kernels against the tensors ``names`` of the file ``path``;
        raise if any computes with other values; write what was checked to ``output`` (a failure
        answered there says ``restored``: whether the caller then puts the old weights back)."""
        started = time.perf_counter()
        parallel = self.vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            # each stage holds some layers: the read-back does not map stages yet, so it says so
            if output:
                write_worker_result(
                    output, {"checks": 0, "seconds": 0.0, "skipped": "pipeline parallel stages hold some layers"}
                )
            return True
        # each tensor-parallel rank checks its own shard, loaded through the modules' own loaders
        shard = local_shards(self._packed) if parallel.tensor_parallel_size > 1 else None
        published = dict(read_staged(path, set(names)))
        try:
            with set_current_vllm_config(self.vllm_config), torch.inference_mode():
                experts = quantized_experts_check(self.model, self._packed, default_weight_loader)
                checks = verify_modules(self.model, published, self._packed, shard, experts)
        except Exception as exc:  # a layout the check does not know: say so, never pass silently
            error = exc if isinstance(exc, ChecksumMismatchError) else None
            message = str(error or f"delta_swap: cannot read back the swapped modules: {type(exc).__name__}: {exc}")
            if not output:
                raise ChecksumMismatchError(message) from exc
            # Answered, not raised: vLLM's multiprocess executor stops reading the workers' answers
            # at the first failed one, so with several workers every later call would read the
            # answer left over from this one. The API server raises on any worker's error.
            log.error("delta_swap: the read-back failed: %s", message)
            answer = {"checks": 0, "seconds": time.perf_counter() - started, "error": message, "restored": restored}
            write_worker_result(output, answer)
            return False
        seconds = time.perf_counter() - started
        log.info("delta_swap: verified %d modules against the snapshot in %.1f ms", checks, 1000 * seconds)
        if output:
            write_worker_result(output, {"checks": checks, "seconds": seconds})
        return True

    def _validate(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self._served.check_fits(
            {name: (from_torch_dtype(t.dtype), tuple(t.shape)) for name, t in weights}, complete=False
        )
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
            for path, experts in _reloaded_cpu_experts(self.model, self._touched):
                experts.process_weights_after_loading(self.model.get_submodule(path))
                log.info("delta_swap: prepacked the reloaded experts of %s for the CPU kernel", path)
            copied = copy_views(self.model, self._loaded)
            if copied:
                log.warning("delta_swap: %d reloaded tensors viewed the staged file: copied", copied)
        self._active = False
        self._touched = set()
        self._loaded = []

    def shutdown(self) -> None:
        self._staged.shutdown()


def _reloaded_cpu_experts(model: torch.nn.Module, touched: set[str]) -> list[tuple[str, Any]]:
    """(path, experts kernel) of every reloaded MoE module whose CPU experts kernel prepacks its
    weights after loading (:func:`.shadow_build.cpu_experts`: vLLM's reload copies the plain
    reloaded weights into the prepacked storage, and the CPU kernel then reads them as garbage)."""
    out = []
    for path, module in model.named_modules():
        experts = cpu_experts(module)
        if experts is not None and any(
            path == t or path.startswith(t + ".") or t.startswith(path + ".") for t in touched
        ):
            out.append((path, experts))
    return out


def _doorbell(update_info: DeltaSwapUpdateInfo) -> Callable[[], None] | None:
    """What rings the update's doorbell, if it has one."""
    doorbell = update_info.doorbell
    return (lambda: ring_doorbell(doorbell)) if doorbell else None
