"""The vLLM engine adapter: swaps verified updates into a running vLLM through its engine client.

Four paths, chosen once per server from what the workers report (``describe``); ``auto`` tries
them in this order:

* **arena** (parameters are plain host tensors, as on CPUs without AMX or AVX512-BF16): updates
  are decoded straight into the spare one of two shared-memory weight arenas laid out like the
  engine's parameters, and the swap points every parameter at it (``commit``): the pause does not
  grow with the model, and the spare arena is the only copy delta-swap adds;
* **inplace** (where every rank's parameters are plain tensors holding the checkpoint's elements
  but no arena applies: tensor parallel > 1, vLLM on GPUs for bf16/fp16): the changed tensors are staged, and while the engine generates each worker
  works out which elements of its parameters change (through the model's own loaders) and keeps
  them next to them; the pause writes only those, with an undo log (:mod:`delta_swap.inplace`);
* **shadow** (vLLM's CPU path where it repacks weights for oneDNN or AMX; ``auto`` there): the
  changed tensors, completed to whole modules, are staged, and while the engine generates each
  worker builds the changed modules' new weights processed as vLLM processes them (shadow modules,
  :mod:`delta_swap.shadow`); the pause switches the live modules to them by reference, the old ones
  kept until the swap is final. An update that loads into a module the shadow build cannot make
  (MoE experts) takes the reload path;
* **reload** (everywhere else, or with ``DELTA_SWAP_SWAP_PATH=reload``): the changed tensors,
  completed to whole modules (:mod:`delta_swap.module_groups`: fused q/k/v and gate/up with their biases,
  every expert of an MoE layer), are staged as one safetensors file in shared memory and loaded
  through vLLM's layerwise reload.

Either way the swap drives vLLM's RL weight-update API (``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` with the snapshot id as weight version, through the
``delta_swap`` weight-transfer backend of :mod:`.transfer_engine`) and resets the prefix cache, so
no KV computed with the old weights is reused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

from delta_swap.arena import Arena, ArenaPair
from delta_swap.engine_adapter import EngineAdapter, WeightUpdate
from delta_swap.errors import EngineError, SwapUndoneError
from delta_swap.module_groups import complete_modules, module_groups, tensors_of_modules
from delta_swap.served_model import ServedModel
from delta_swap.settings import DrainPolicy, Settings, SwapPath
from delta_swap.staged_swap import (
    FAIL_BUILD_ENV,
    FAIL_SCATTER_ENV,
    injected_failure,
    injected_failure_rank,
    injected_swap_failure,
    merge_staged,
)
from delta_swap.staging_files import (
    StagedTensors,
    make_doorbell,
    remove_doorbells,
    stage_tensors,
    staging_file,
    until_staged,
)
from delta_swap.tensors import StateDict, TensorSpecs
from delta_swap.verify_budget import VerifyBudget

from .worker_results import read_worker_results

log = logging.getLogger("vllm_delta_plugin")


@dataclass(frozen=True)
class StagedFile:
    """An update's tensors in the staging folder, and the read-back's."""

    update: StagedTensors
    #: What the post-swap verification reads: every tensor of the modules the update touches (the
    #: update's own tensors when they are all of them, or when nothing is verified).
    check: StagedTensors
    #: Whether this swap is read back (``verify_swaps`` and its budget decide when staging).
    verify: bool = False
    #: The in-place path: the workers hold the changed elements (``stage_inplace``) of this file.
    inplace: bool = False
    #: The shadow path: the workers hold shadow modules built from this file (``stage_shadow``).
    shadow: bool = False

    def remove(self) -> None:
        """Remove the files written for this staging (not the subscriber's copy of the weights)."""
        self.update.remove()
        self.check.remove()


def packed_modules_of(vllm_config: Any) -> Mapping[str, Sequence[str]] | None:
    """The served model class's fused parameters (None when vLLM cannot tell)."""
    from vllm.model_executor.models import ModelRegistry

    model_config = vllm_config.model_config
    try:
        model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    except Exception:  # an architecture vLLM resolves differently at load time
        log.warning("delta_swap: cannot resolve the model class; every update will send all tensors")
        return None
    return dict(getattr(model_cls, "packed_modules_mapping", None) or {})


def merge_layouts(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``describe`` answer for the deployment from every worker's: an arena layout only if
    every worker (of every data-parallel engine) described the same one."""
    if not answers:
        raise EngineError("vllm: no worker described its parameters")
    first = answers[0]
    # each rank decides for itself; the deployment takes a path only where every rank can
    first = {**first, **{k: all(a.get(k) for a in answers) for k in ("inplace", "shadow") if k in first}}
    freed = sorted({str(a["freed_memory"]) for a in answers if a.get("freed_memory")})
    if len(freed) > 1:  # a worker that could not keep it says why, beside the others
        first["freed_memory"] = "; ".join(freed)
    for other in answers[1:]:
        if other["layout"] is None:
            return {**first, "layout": None, "reason": other["reason"]}
        if other["layout"] != first["layout"]:
            return {**first, "layout": None, "reason": f"the {len(answers)} workers hold different layouts"}
    return first


def merge_verifications(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """What every worker read back after a reload: modules checked in all, the slowest worker's
    seconds, how many workers answered, and why any of them checked nothing."""
    merged: dict[str, Any] = {
        "checks": sum(a["checks"] for a in answers),
        "seconds": max((a["seconds"] for a in answers), default=0.0),
        "workers": len(answers),
    }
    skipped = sorted({a["skipped"] for a in answers if a.get("skipped")})
    if skipped or not answers:
        merged["skipped"] = "; ".join(skipped) or "no worker answered"
    return merged


class VllmAdapter(EngineAdapter):
    """Drives vLLM's engine client: pause, start/update/finish weight update, reset cache, resume."""

    name = "vllm"
    copies_updates = True  # its workers copy every tensor they read from a staged file

    def __init__(
        self, engine_client: Any, settings: Settings, served: ServedModel, packed: Mapping[str, Sequence[str]] | None
    ) -> None:
        self.engine = engine_client
        self.settings = settings
        self.served = served
        self.packed = packed
        #: The two weight arenas, on the arena path (None: the reload path, or not described yet).
        self.arenas: ArenaPair | None = None
        #: Whether the workers write changed elements in place (the inplace path).
        self.inplace = False
        #: Whether the workers build shadow modules before the pause (the shadow path).
        self.shadow = False
        #: What the workers do with the memory an update frees (``Settings.keep_freed_memory``).
        self.freed_memory: str | None = None
        #: What the workers staged for the last in-place or shadow swap ({"elements" or "modules",
        #: "bytes", "seconds"}; "fallback": why it was reloaded instead).
        self.last_staged: dict[str, Any] | None = None
        self._described = False
        #: Why this server swaps the way it does (shown in the status).
        self.path_reason: str | None = None
        #: What the workers checked after the last reload ({"checks": modules, "seconds": ...}).
        self.last_verification: dict[str, Any] | None = None
        self._groups: dict[str, list[str]] = module_groups(served.specs, packed or {})
        self._drain = settings.drain
        #: Which reloads are read back (verify_swaps), and how many were.
        self.verify_budget = VerifyBudget(settings.verify_swaps)

    @classmethod
    def for_engine(cls, engine_client: Any, settings: Settings, model: str) -> VllmAdapter:
        """The adapter of a server started with ``--model model``."""
        return cls(
            engine_client, settings, ServedModel.from_checkpoint(model), packed_modules_of(engine_client.vllm_config)
        )

    async def weight_version(self) -> str | None:
        return await self.engine.get_weight_version()

    async def describe(self) -> dict[str, Any]:
        return {
            "swap_path": "arena"
            if self.arenas
            else "inplace"
            if self.inplace
            else "shadow"
            if self.shadow
            else "reload"
            if self._described
            else None,
            "swap_path_reason": self.path_reason,
            "freed_memory": self.freed_memory,
            "last_verification": self.last_verification,
            "last_staged": self.last_staged,
            "verification": self.verify_budget.describe(),
        }

    async def _call(self, info: dict[str, Any], version: str | None = None) -> None:
        """One operation of the workers' ``delta_swap`` backend, in its own weight-update session;
        ``version`` becomes the engine's weight version if the operation succeeded."""
        await self.engine.start_weight_update()
        try:
            await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))
        except BaseException:
            try:  # vLLM may have ended the session itself: its complaint must not hide the cause
                await self.engine.finish_weight_update()
            except Exception as exc:
                log.debug("delta_swap: finish_weight_update after a failed update: %s", exc)
            raise
        await self.engine.finish_weight_update()
        if version is not None:
            await self.engine.update_weight_version(version)

    async def destination(self, specs: TensorSpecs) -> StateDict | None:
        if not self._described:
            self._described = True
            output = Path(staging_file(self.settings.staging_dir, "layout", ".json"))
            try:
                await self._call({"op": "describe", "output": str(output)})
            finally:
                answers = read_worker_results(str(output))
            doc = merge_layouts(answers)
            if doc.get("packed") is not None:  # the workers' mapping, which may extend the class's
                self.packed = {k: list(v) for k, v in doc["packed"].items()}
                self._groups = module_groups(self.served.specs, self.packed)
            self.path_reason = doc["reason"]
            self.freed_memory = doc.get("freed_memory")
            self.inplace = bool(doc.get("inplace"))
            self.shadow = bool(doc.get("shadow"))
            if self.inplace:
                log.info("delta_swap: writing changed elements in place on each swap (%s)", doc["reason"])
            elif doc["layout"]:
                self.arenas, why_not = await asyncio.to_thread(ArenaPair.open, self.settings.staging_dir, doc["layout"])
                self.path_reason = why_not or self.path_reason
            elif self.shadow:
                log.info("delta_swap: building changed modules before each swap (%s)", doc["reason"])
            else:
                log.info("delta_swap: reloading changed tensors on each swap (%s)", doc["reason"])
            asked = self.settings.swap_path
            if (
                (asked is SwapPath.ARENA and self.arenas is None)
                or (asked is SwapPath.INPLACE and not self.inplace)
                or (asked is SwapPath.SHADOW and not self.shadow)
            ):
                log.warning(
                    "delta_swap: DELTA_SWAP_SWAP_PATH=%s, but this engine cannot take that path (%s): reloading instead",
                    asked.value,
                    self.path_reason,
                )
        return await asyncio.to_thread(self.arenas.spare_for, specs) if self.arenas else None

    async def stage(self, update: WeightUpdate) -> StagedFile | Arena:
        arena = self.arenas.staged(update.state, "vllm") if self.arenas else None
        if arena is not None:
            return arena
        if self.inplace:  # only the changed tensors: the workers find the changed elements of each
            names = sorted(update.names)
        elif self.packed is None:
            names = sorted(update.state)
        else:
            names = sorted(complete_modules(update.names, self._groups, self.packed) & update.state.keys())
        # What the verification compares with: whole modules, computed apart from the completion above
        # (so a completion that missed a tensor is caught); the update's own tensors whenever they agree.
        # Both come from the subscriber's copy of the weights where there is one (it holds every tensor).
        verify = self.verify_budget.due()
        check_names = sorted(tensors_of_modules(names, update.state, self.packed or {})) if verify else names
        stage_dir, state_file = self.settings.staging_dir, update.state_file
        tensors = await asyncio.to_thread(
            stage_tensors, stage_dir, f"update-{update.version}", state_file, update.state, names
        )
        check = tensors
        if check_names != tensors.names:
            try:
                check = await asyncio.to_thread(
                    stage_tensors, stage_dir, "check", state_file, update.state, check_names
                )
            except BaseException:
                tensors.remove()
                raise
        staged = StagedFile(tensors, check, verify, inplace=self.inplace, shadow=self.shadow)
        if staged.inplace or staged.shadow:
            try:
                fallback = await self._stage_on_workers(
                    "stage_inplace" if staged.inplace else "stage_shadow", tensors.path, tensors.names
                )
            except BaseException:
                await self.unstage(staged)
                raise
            if fallback is not None:  # a module the shadow build cannot make: reload this update
                await self._call({"op": "drop_staged"})
                staged = dataclasses.replace(staged, shadow=False)
        return staged

    async def _stage_on_workers(self, op: str, path: str, names: list[str]) -> str | None:
        """Have every worker stage the update its way (``op``: work out the changed elements of its
        parameters, or build shadow modules; on a thread of its own, so the engine generates
        meanwhile), and wait until all have; returns why a worker cannot (None: all did)."""
        fail_after = injected_failure(FAIL_BUILD_ENV) if op == "stage_shadow" else -1
        doorbell = await asyncio.to_thread(make_doorbell, self.settings.staging_dir)
        output = path + ".staged.json"

        async def ask() -> list[dict[str, Any]]:
            try:
                await self._call({"op": "stage_wait", "output": output})
            finally:
                answers = read_worker_results(output)  # raises a worker's error
            return answers

        try:
            info = {"op": op, "path": path, "names": names, "fail_after": fail_after, "doorbell": doorbell}
            await self._call(info)
            answers = await until_staged(ask, doorbell)
        finally:
            await asyncio.to_thread(remove_doorbells, doorbell)
        self.last_staged = merge_staged(answers)
        if "fallback" in self.last_staged:
            log.info("delta_swap: reloading this update: %s", self.last_staged["fallback"])
            return str(self.last_staged["fallback"])
        return None

    async def unstage(self, staged: StagedFile | Arena) -> None:
        if isinstance(staged, StagedFile):
            staged.remove()
            if staged.inplace or staged.shadow:  # the workers drop what they staged and the undo
                await self._call({"op": "drop_staged"})

    async def close(self) -> None:
        if self.arenas is not None:  # the workers keep their mappings until they exit
            self.arenas.close()

    async def pause(self, drain: DrainPolicy, timeout_s: float) -> None:
        self._drain = drain
        if drain is DrainPolicy.WAIT:
            try:
                await asyncio.wait_for(self._pause("wait"), timeout_s)
                return
            except asyncio.TimeoutError:
                log.warning("delta_swap: requests still running after %.1fs, aborting them", timeout_s)
                drain = DrainPolicy.ABORT
        await self._pause(drain.value)

    async def _pause(self, mode: str) -> None:
        # The engine core's own pause: AsyncLLM.pause_generation adds a fixed 20 ms sleep that only
        # orders output events for its caller.
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "pause_scheduler_async"):
            await core.pause_scheduler_async(mode=mode, clear_cache=False)
        else:
            await self.engine.pause_generation(mode=mode, clear_cache=False)

    async def swap(self, update: WeightUpdate, staged: StagedFile | Arena) -> None:
        if isinstance(staged, Arena):
            await self._call({"op": "commit", "path": str(staged.path)}, update.version)
            assert self.arenas is not None
            self.arenas.live = staged
        else:
            fail_after = await injected_swap_failure(update.version, self.weight_version)
            fail_rank = injected_failure_rank(FAIL_SCATTER_ENV)
            if staged.inplace or staged.shadow:  # a worker that fails takes its own writes (modules) back
                op = {"op": "scatter" if staged.inplace else "switch", "fail_after": fail_after}
                await self._apply(staged, {**op, "fail_rank": -1 if fail_rank is None else fail_rank}, answered=True)
            else:
                await self._apply(staged, {"op": "load", "path": staged.update.path, "names": staged.update.names})
            if update.version is not None:
                await self.engine.update_weight_version(update.version)
        # No new request may reuse KV computed with the old weights: drop the prefix cache. Requests
        # kept in place recompute theirs if asked; else they keep it and their blocks stay, so the
        # reset cannot succeed (vLLM would log a warning at every swap) and is not tried: the
        # version in every request's cache salt keeps new requests apart from the old KV.
        keep_kv = self._drain is DrainPolicy.KEEP and not self.settings.recompute_kv
        if keep_kv and self._requests_in_flight():
            return
        reset = await self.engine.reset_prefix_cache(reset_running_requests=not keep_kv)
        if not reset and not keep_kv:
            raise EngineError("vllm: refused to reset its prefix cache after a weight update")

    async def _apply(self, staged: StagedFile, info: dict[str, Any], *, answered: bool = False) -> None:
        """Have the workers apply ``staged`` (the worker op in ``info``: ``load`` or ``scatter``),
        reading back what they then compute with when verification is due (raises on any
        difference), in one weight-update call; the time goes to the verify budget. ``answered``:
        the op always answers through a result file (its errors come back that way)."""
        started, check_s, output = time.perf_counter(), None, f"{staged.update.path}.{info['op']}.json"
        if staged.verify:
            info = {**info, "verify_path": staged.check.path, "verify_names": staged.check.names}
        if staged.verify or answered:
            try:
                await self._call({**info, "output": output})
            except BaseException:
                read_worker_results(output)  # raises a worker's error: it says more than vLLM's wrapper
                raise
            answers = read_worker_results(output, raise_errors=False)
            failed = [answer for answer in answers if answer.get("error")]
            if failed and info["op"] in ("scatter", "switch"):
                await self._take_back(info["op"], answers)
            if failed:
                raise EngineError(f"vllm: {failed[0]['error']}")
        else:
            await self._call(info)
        if staged.verify:
            self.last_verification = merge_verifications(answers)
            check_s = self.last_verification["seconds"]
        self.verify_budget.record(time.perf_counter() - started - (check_s or 0.0), check_s)

    async def _take_back(self, op: str, answers: list[dict[str, Any]]) -> None:
        """Some workers failed ``op`` (each taking its own back): have the others take theirs
        back, so every rank serves the previous weights; raise SwapUndoneError if all of them do
        (the core then has nothing to roll back), else EngineError naming what stayed."""
        error = next(answer["error"] for answer in answers if answer.get("error"))
        output = str(staging_file(self.settings.staging_dir, "undo", ".json"))
        try:
            await self._call({"op": "undo", "output": output})
            undone = read_worker_results(output)
        except Exception as exc:
            raise EngineError(
                f"vllm: the {op} failed ({error}) and the other ranks could not take theirs back: {exc}"
            ) from exc
        stuck = sum(1 for answer in answers if answer.get("error") and not answer.get("restored"))
        if stuck:
            raise EngineError(f"vllm: the {op} failed and {stuck} worker(s) could not take theirs back: {error}")
        finished = sum(1 for answer in answers if not answer.get("error"))
        took_back = sum(1 for answer in undone if answer.get("undone"))
        if len(undone) != len(answers) or took_back != finished:
            raise EngineError(
                f"vllm: the {op} failed ({error}); of {finished} workers that had finished theirs, "
                f"{took_back} took it back ({len(undone)} of {len(answers)} answered)"
            )
        raise SwapUndoneError(
            f"vllm: the {op} failed and was taken back on every rank ({took_back} of {len(answers)} workers had "
            f"finished theirs): {error}"
        )

    def engine_error(self, exc: BaseException) -> EngineError:
        """vLLM wraps a worker's exception in two layers of text; keep the worker's own message."""
        text = str(exc)
        inner = re.search(r"Worker failed with error '(.*)', please check", text, re.S)
        return EngineError(f"vllm: {inner.group(1) if inner else f'{type(exc).__name__}: {text}'}")

    def _requests_in_flight(self) -> bool:
        count = getattr(self.engine, "get_num_unfinished_requests", None)
        return bool(count and count())

    async def resume(self) -> None:
        if await self.engine.is_paused():
            await self.engine.resume_generation()
