"""The SGLang engine adapter: swaps verified updates into a running SGLang through its tokenizer manager.

Staging packs the changed tensors into one shared-memory bucket while SGLang keeps generating.
The swap runs ``begin_weight_update`` / ``update_weights_from_tensor`` (which flushes the radix
cache and sets the weight version) / ``end_weight_update``. SGLang's Llama-style
``load_weights`` takes q/k/v and gate/up one by one, so only changed tensors are sent.

Drain policies on SGLang 0.5.23 (its pause modes are ``abort``, ``retract`` and ``in_place``):

* ``wait``: take the tokenizer manager's model-update writer lock, which SGLang's own updates
  use to wait for in-flight requests and to hold new ones; abort what still runs after the
  timeout. Then a ``retract`` pause (nothing left to retract) marks the engine paused.
* ``keep``: ``retract``: running requests go back to the queue and resume on the new weights
  with their KV recomputed. (``in_place`` would keep KV computed with the old weights, and its
  cache flush fails with 400 although the weights changed, so it is never used.)
* ``abort``: ``abort``, then ``retract`` so the scheduler is paused for the flush too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from delta_swap.engine_adapter import EngineAdapter, WeightUpdate
from delta_swap.errors import EngineError
from delta_swap.served_model import ServedModel
from delta_swap.settings import DrainPolicy

from .staging import Bucket, pack

log = logging.getLogger("sglang_delta_plugin")


class SglangAdapter(EngineAdapter):
    """Drives SGLang's RL weight-update API in the HTTP server process."""

    name = "sglang"

    def __init__(self, tokenizer_manager: Any, served: ServedModel, tp_size: int = 1) -> None:
        self.tm = tokenizer_manager
        self.served = served
        self.tp_size = tp_size
        self._holds_writer_lock = False

    async def weight_version(self) -> str | None:
        return self.tm.config_value("weight_version")

    async def stage(self, update: WeightUpdate) -> Bucket | None:
        if not update.names:  # same bytes as now (e.g. a step that reverts): only the version moves
            return None
        return await asyncio.to_thread(pack, update.state, sorted(update.names), update.checksums, self.tp_size)

    # ------------------------------------------------------------------ drain

    async def pause(self, drain: DrainPolicy, timeout_s: float) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        try:
            if drain is DrainPolicy.WAIT:
                await self._acquire_writer(timeout_s)
            elif drain is DrainPolicy.ABORT:
                await self.tm.pause_generation(PauseGenerationReqInput(mode="abort"))
            await self.tm.pause_generation(PauseGenerationReqInput(mode="retract"))
        except BaseException:
            await self.resume()
            raise

    async def _acquire_writer(self, timeout_s: float) -> None:
        """Wait for in-flight requests (new ones queue behind); abort them after the timeout."""
        lock = self.tm.model_update_lock
        task = asyncio.ensure_future(lock.acquire_writer())
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                log.warning("delta_swap: requests still running after %.1fs, aborting them", timeout_s)
                while not task.done():
                    self.tm.abort_request(abort_all=True)
                    await asyncio.wait({task}, timeout=0.5)
            await task
            self._holds_writer_lock = True
        except BaseException:
            if task.done() and not task.cancelled() and task.exception() is None:
                await lock.release_writer()
            else:
                task.cancel()
            raise

    async def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        try:
            if self.tm.is_pause:
                await self.tm.continue_generation(ContinueGenerationReqInput())
        finally:
            if self._holds_writer_lock:
                self._holds_writer_lock = False
                await self.tm.model_update_lock.release_writer()

    # ------------------------------------------------------------------ load

    async def swap(self, update: WeightUpdate, staged: Bucket | None) -> None:
        version = update.version or await self.weight_version() or "default"
        if staged is None:
            await self._set_version(version)
            return
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )

        ok, message = await self.tm.begin_weight_update(BeginWeightUpdateReqInput(), None)
        if not ok:
            raise EngineError(f"sglang: begin_weight_update refused: {message}")
        try:
            # flush_cache (the default) drops every KV computed with the old weights.
            request = UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=staged.payloads, load_format="flattened_bucket",
                flush_cache=True, weight_version=version,
            )
            ok, message = await self.tm.update_weights_from_tensor(request, None)
        finally:
            end_ok, end_message = await self.tm.end_weight_update(EndWeightUpdateReqInput(), None)
        if not ok:
            raise EngineError(f"sglang: update_weights_from_tensor refused: {message}")
        if not end_ok:
            raise EngineError(f"sglang: end_weight_update refused: {end_message}")
        log.info("delta_swap: loaded %d tensors (%.1f MB) as %s", len(update.names), staged.nbytes / 1e6, version)

    async def _set_version(self, version: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        await self.tm.update_weight_version(UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False))
