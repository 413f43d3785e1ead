"""The vLLM engine adapter: swaps verified updates into a running vLLM through its engine client.

Staging writes the changed tensors (completed to whole fused groups) as one safetensors file in
shared memory, while vLLM keeps generating. The swap drains per the policy, then drives vLLM's
RL weight-update API (``start_weight_update`` / ``update_weights`` naming that file /
``finish_weight_update`` with the snapshot id as weight version) and resets the prefix cache, so
no KV computed with the old weights is reused. Each worker loads the file through the
``delta_swap`` weight-transfer backend (:mod:`.transfer_engine`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

from delta_swap.engine_adapter import EngineAdapter, WeightUpdate
from delta_swap.errors import EngineError
from delta_swap.safetensors_io import write_safetensors
from delta_swap.served_model import ServedModel
from delta_swap.settings import DrainPolicy, Settings

from .fused import fused_group_members

log = logging.getLogger("vllm_delta_plugin")


@dataclass(frozen=True)
class StagedFile:
    """A safetensors file in the staging folder and the tensors it holds."""

    path: str
    names: list[str]


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


class VllmAdapter(EngineAdapter):
    """Drives vLLM's engine client: pause, start/update/finish weight update, reset cache, resume."""

    name = "vllm"

    def __init__(self, engine_client: Any, settings: Settings, served: ServedModel,
                 packed: Mapping[str, Sequence[str]] | None) -> None:
        self.engine = engine_client
        self.settings = settings
        self.served = served
        self.packed = packed

    @classmethod
    def for_engine(cls, engine_client: Any, settings: Settings, model: str) -> VllmAdapter:
        """The adapter of a server started with ``--model model``."""
        return cls(engine_client, settings, ServedModel.from_checkpoint(model), packed_modules_of(engine_client.vllm_config))

    async def weight_version(self) -> str | None:
        return await self.engine.get_weight_version()

    async def stage(self, update: WeightUpdate) -> StagedFile:
        if self.packed is None:
            names = sorted(update.state)
        else:
            names = sorted(fused_group_members(update.names, self.packed) & update.state.keys())
        path = os.path.join(self.settings.staging_dir,
                            f"delta-swap-{os.getpid()}-{update.version}-{uuid.uuid4().hex[:8]}.safetensors")

        def write() -> None:
            with open(path, "wb") as fh:
                write_safetensors(fh, [(n, update.state[n]) for n in names])

        await asyncio.to_thread(write)
        return StagedFile(path, names)

    async def unstage(self, staged: StagedFile) -> None:
        os.unlink(staged.path)

    async def pause(self, drain: DrainPolicy, timeout_s: float) -> None:
        if drain is DrainPolicy.WAIT:
            try:
                await asyncio.wait_for(self.engine.pause_generation(mode="wait", clear_cache=False), timeout_s)
                return
            except asyncio.TimeoutError:
                log.warning("delta_swap: requests still running after %.1fs, aborting them", timeout_s)
                drain = DrainPolicy.ABORT
        await self.engine.pause_generation(mode=drain.value, clear_cache=False)

    async def swap(self, update: WeightUpdate, staged: StagedFile) -> None:
        await self.engine.start_weight_update()
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"path": staged.path,
                                                                                 "names": staged.names}))
        await self.engine.finish_weight_update(weight_version=update.version)
        # No KV computed with the old weights may be reused: drop the prefix cache, and make
        # requests kept in place recompute theirs.
        if not await self.engine.reset_prefix_cache(reset_running_requests=True):
            raise EngineError("vllm: refused to reset its prefix cache after a weight update")

    async def resume(self) -> None:
        if await self.engine.is_paused():
            await self.engine.resume_generation()
