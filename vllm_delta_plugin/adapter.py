"""Swap one staged snapshot into a running vLLM engine through its engine client."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

from delta_swap.checkpoint_dir import check_fits, read_checkpoint_layout
from delta_swap.engine_adapter import DrainPolicy, EngineAdapter, StagedSnapshot
from delta_swap.safetensors_io import write_safetensors
from delta_swap.tensors import StateDict

from .config import PluginConfig

log = logging.getLogger("vllm_delta_plugin")


def with_module_siblings(changed: tuple[str, ...], all_names: list[str]) -> list[str]:
    """``changed`` plus every tensor of the same parent module (``...self_attn``, ``...mlp``).

    vLLM fuses q/k/v and gate/up into one parameter; a layerwise reload must receive all parts
    of a fused parameter at once, so a change to one part sends its siblings too.
    """
    parents = {name.rsplit(".", 2)[0] for name in changed}
    return [n for n in all_names if n in changed or n.rsplit(".", 2)[0] in parents]


class VllmEngineAdapter(EngineAdapter):
    """Drives vLLM's RL weight-update API: pause, start/update/finish, reset cache, resume."""

    def __init__(self, engine_client: Any, config: PluginConfig, checkpoint_dir: str) -> None:
        self.engine = engine_client
        self.config = config
        self.checkpoint_dir = checkpoint_dir
        #: What the served model accepts (empty when it was not loaded from a local folder).
        self.layout = read_checkpoint_layout(checkpoint_dir) if os.path.isdir(checkpoint_dir) else {}

    async def describe(self) -> dict[str, Any]:
        return {"engine": "vllm", "weight_version": await self.engine.get_weight_version(),
                "drain": self.config.drain.value}

    async def swap(self, staged: StagedSnapshot) -> dict[str, float]:
        timings: dict[str, float] = {}
        if self.layout:
            check_fits(staged.state, self.layout)
        names = with_module_siblings(staged.changed, sorted(staged.state))
        t0 = time.perf_counter()
        path = await asyncio.to_thread(self._stage, staged.state, names, staged.snapshot_id)
        timings["stage"] = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            await self._pause()
            timings["pause"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            try:
                await self._load(path, staged.snapshot_id)
            except Exception:
                await self._rollback(staged, names)
                raise
            timings["swap"] = time.perf_counter() - t0
        finally:
            if await self.engine.is_paused():
                await self.engine.resume_generation()
            os.unlink(path)
        return timings

    def _stage(self, state: StateDict, names: list[str], snapshot_id: str) -> str:
        path = os.path.join(self.config.staging_dir, f"delta-swap-{os.getpid()}-{snapshot_id}-{uuid.uuid4().hex[:8]}.safetensors")
        with open(path, "wb") as fh:
            write_safetensors(fh, [(n, state[n]) for n in names])
        return path

    async def _pause(self) -> None:
        drain = self.config.drain
        if drain is DrainPolicy.WAIT:
            try:
                await asyncio.wait_for(self.engine.pause_generation(mode="wait", clear_cache=False),
                                       self.config.drain_timeout_s)
                return
            except asyncio.TimeoutError:
                log.warning("delta_swap: requests still running after %.1fs, aborting them", self.config.drain_timeout_s)
                drain = DrainPolicy.ABORT
        await self.engine.pause_generation(mode=drain.value, clear_cache=False)

    async def _load(self, path: str, version: str, names: list[str] | None = None) -> None:
        await self.engine.start_weight_update()
        info = {"path": path, "names": names or []}
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))
        await self.engine.finish_weight_update(weight_version=version)
        # No KV computed with the old weights may be reused: drop the prefix cache, and make
        # requests kept in place recompute theirs.
        if not await self.engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to reset its prefix cache")

    async def _rollback(self, staged: StagedSnapshot, names: list[str]) -> None:
        """Put the previous weights back after a failed load (the subscriber keeps its version)."""
        log.error("delta_swap: loading %s failed, restoring the previous weights", staged.snapshot_id)
        if staged.previous is not None and all(n in staged.previous for n in names):
            path = await asyncio.to_thread(self._stage, staged.previous, names, "rollback")
            try:
                await self._load(path, await self.engine.get_weight_version())
            finally:
                os.unlink(path)
        else:  # first sync: reload those tensors from the checkpoint the server started with
            await self._load(self.checkpoint_dir, await self.engine.get_weight_version(), names)
