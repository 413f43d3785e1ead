"""Swap one staged snapshot into a running SGLang server through its tokenizer manager.

Order of one swap: validate and pack the changed tensors (generation goes on), drain per the
policy, ``begin_weight_update`` / ``update_weights_from_tensor`` (which flushes the radix cache
and sets the weight version) / ``end_weight_update``, resume. SGLang's Llama-style
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
import time
from typing import Any

from delta_swap.checkpoint_dir import Layout, check_fits, read_checkpoint_dir
from delta_swap.engine_adapter import DrainPolicy, EngineAdapter, StagedSnapshot
from delta_swap.errors import DeltaSwapError
from delta_swap.tensors import StateDict

from .config import PluginConfig
from .staging import Bucket, pack

log = logging.getLogger("sglang_delta_plugin")


class EngineUpdateError(DeltaSwapError):
    """SGLang refused a weight-update call (the message is SGLang's)."""


class SglangEngineAdapter(EngineAdapter):
    """Drives SGLang's RL weight-update API in the HTTP server process."""

    def __init__(self, tokenizer_manager: Any, config: PluginConfig, checkpoint_dir: str, layout: Layout,
                 tp_size: int = 1) -> None:
        self.tm = tokenizer_manager
        self.config = config
        self.checkpoint_dir = checkpoint_dir
        self.layout = layout
        self.tp_size = tp_size

    def weight_version(self) -> str | None:
        return self.tm.config_value("weight_version")

    async def describe(self) -> dict[str, Any]:
        return {"engine": "sglang", "weight_version": self.weight_version(), "drain": self.config.drain.value}

    async def swap(self, staged: StagedSnapshot) -> dict[str, float]:
        timings: dict[str, float] = {}
        names = sorted(staged.changed)
        checksums = {t.name: t.checksum for t in staged.manifest.tensors}
        check_fits(staged.state, self.layout)  # also when nothing changed: a dropped tensor changes nothing
        t0 = time.perf_counter()
        bucket = await asyncio.to_thread(pack, staged.state, names, self.layout, checksums, self.tp_size) if names else None
        timings["stage"] = time.perf_counter() - t0
        version_before = self.weight_version()
        t0 = time.perf_counter()
        held = await self._pause()
        try:
            timings["pause"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            try:
                if bucket is None:  # same bytes as now (e.g. a step that reverts): only the version moves
                    await self._set_version(staged.snapshot_id)
                else:
                    await self._load(bucket, staged.snapshot_id)
            except Exception:
                await self._rollback(staged, names, version_before)
                raise
            timings["swap"] = time.perf_counter() - t0
        finally:
            t0 = time.perf_counter()
            await self._resume(held)
            timings["resume"] = time.perf_counter() - t0
        log.info("delta_swap: loaded %d tensors (%.1f MB) of %s", len(names), bucket.nbytes / 1e6 if bucket else 0.0,
                 staged.snapshot_id)
        return timings

    # ------------------------------------------------------------------ drain

    async def _pause(self) -> bool:
        """Drain per the policy and pause; True if this holds the model-update writer lock."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        drain, held = self.config.drain, False
        try:
            if drain is DrainPolicy.WAIT:
                await self._acquire_writer()
                held = True
            elif drain is DrainPolicy.ABORT:
                await self.tm.pause_generation(PauseGenerationReqInput(mode="abort"))
            await self.tm.pause_generation(PauseGenerationReqInput(mode="retract"))
        except BaseException:
            await self._resume(held)
            raise
        return held

    async def _acquire_writer(self) -> None:
        """Wait for in-flight requests (new ones queue behind); abort them after the timeout."""
        lock = self.tm.model_update_lock
        task = asyncio.ensure_future(lock.acquire_writer())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.config.drain_timeout_s)
            if not done:
                log.warning("delta_swap: requests still running after %.1fs, aborting them", self.config.drain_timeout_s)
                while not task.done():
                    self.tm.abort_request(abort_all=True)
                    await asyncio.wait({task}, timeout=0.5)
            await task
        except BaseException:
            if task.done() and not task.cancelled() and task.exception() is None:
                await lock.release_writer()
            else:
                task.cancel()
            raise

    async def _resume(self, held_writer: bool) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        try:
            if self.tm.is_pause:
                await self.tm.continue_generation(ContinueGenerationReqInput())
        finally:
            if held_writer:
                await self.tm.model_update_lock.release_writer()

    # ------------------------------------------------------------------ load

    async def _load(self, bucket: Bucket, version: str) -> None:
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )

        ok, message = await self.tm.begin_weight_update(BeginWeightUpdateReqInput(), None)
        if not ok:
            raise EngineUpdateError(f"begin_weight_update: {message}")
        try:
            # flush_cache (the default) drops every KV computed with the old weights.
            request = UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=bucket.payloads, load_format="flattened_bucket",
                flush_cache=True, weight_version=version,
            )
            ok, message = await self.tm.update_weights_from_tensor(request, None)
        finally:
            end_ok, end_message = await self.tm.end_weight_update(EndWeightUpdateReqInput(), None)
        if not ok:
            raise EngineUpdateError(f"update_weights_from_tensor: {message}")
        if not end_ok:
            raise EngineUpdateError(f"end_weight_update: {end_message}")

    async def _set_version(self, version: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        await self.tm.update_weight_version(UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False))

    async def _rollback(self, staged: StagedSnapshot, names: list[str], version: str | None) -> None:
        """Put the previous weights back after a failed load (the subscriber keeps its version)."""
        log.error("delta_swap: loading %s failed, restoring the previous weights", staged.snapshot_id)
        previous: StateDict | None = staged.previous
        if previous is None or not all(n in previous for n in names):
            # First sync: the tensors the server started with, memory-mapped from its checkpoint.
            previous, _ = await asyncio.to_thread(read_checkpoint_dir, self.checkpoint_dir)
        names = [n for n in names if n in previous]
        if not names:
            await self._set_version(version or "default")
            return
        bucket = await asyncio.to_thread(pack, previous, names, self.layout, None, self.tp_size)
        await self._load(bucket, version or "default")
