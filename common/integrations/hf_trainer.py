"""A ``transformers.TrainerCallback`` that publishes the model after optimizer steps.

    from delta_swap.integrations.hf_trainer import DeltaSwapCallback

    trainer = GRPOTrainer(model=..., reward_funcs=..., train_dataset=...,
                          callbacks=[DeltaSwapCallback("s3://rl-snapshots/run-42", every=1)])

Works with ``transformers.Trainer`` and every TRL trainer built on it. On one process it publishes
the whole ``state_dict``; with several (``torch.distributed`` initialised, e.g. FSDP2 through
accelerate) each rank publishes its share of the tensors without gathering the model on one rank
(:func:`delta_swap.integrations.sharded.owned_tensors`). Publishing runs on a background thread;
errors surface at the next step and at the end of training.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import TrainerCallback

from ..publisher import Publisher, PublisherConfig
from .hf_names import checkpoint_tensors, is_transformers_model
from .sharded import owned_tensors


class DeltaSwapCallback(TrainerCallback):
    """Publish the trained model every ``every`` optimizer steps (as that global step)."""

    def __init__(
        self,
        store: str,
        config: PublisherConfig | None = None,
        *,
        every: int = 1,
        dtype: Any = "bfloat16",
        files: dict[str, bytes] | None = None,
    ) -> None:
        import torch

        self.store, self.every, self.files = store, every, files
        self.config = config or PublisherConfig()
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.publisher: Publisher | None = None

    def _publisher(self) -> Publisher:
        if self.publisher is None:
            import torch.distributed as dist

            config = self.config
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                config = dataclasses.replace(config, rank=dist.get_rank(), world_size=dist.get_world_size())
            self.publisher = Publisher(self.store, config, files=self.files)
        return self.publisher

    def publish(self, step: int, model: Any) -> None:
        publisher = self._publisher()
        named = list(model.state_dict().items())
        cfg = publisher.config
        owned = owned_tensors(named, cfg.rank, cfg.world_size, self.dtype)
        # checkpoint names: tied aliases dropped, fused in-memory weights split as save_pretrained does
        publisher.publish(step, checkpoint_tensors(model, owned.items()) if is_transformers_model(model) else owned)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None and state.global_step % self.every == 0:
            self.publish(state.global_step, model)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.publisher is not None:
            self.publisher.close()  # waits for the last publish; raises if one failed
            self.publisher = None
