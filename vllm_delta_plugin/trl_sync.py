"""TRL's trainers in vLLM server mode, syncing weights through delta-swap instead of NCCL.

TRL's ``GRPOTrainer(args=GRPOConfig(use_vllm=True, vllm_mode="server"))`` generates through a
``trl.generation.vllm_client.VLLMClient`` and pushes weights with it over an NCCL group (a CUDA
device, and the trainer and servers in one network). Passing a :class:`DeltaSwapSync` as a callback
keeps everything else and changes the sync::

    from vllm_delta_plugin.trl_sync import DeltaSwapSync

    trainer = GRPOTrainer(model=..., reward_funcs=..., train_dataset=...,
                          args=GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url=url),
                          callbacks=[DeltaSwapSync("s3://rl/run-42", base_every=10, max_staleness=1)])

Constructing it puts a subclass of TRL's client in TRL's place (the one name TRL looks the client
up by, ``trl.generation.vllm_generation.VLLMClient``; nothing else of TRL is touched, and the TRL
versions it supports are pinned in :mod:`delta_swap.integrations.versions`). That client still generates through the server
at ``vllm_server_base_url``, but it opens no NCCL group: each ``sync_weights`` publishes the
trainer's weights as the trainer's global step, a full base every ``base_every`` steps and lossless
deltas in between, signed with ``signing_key``, through the ``delta_swap`` trainer engine
(:mod:`.trainer_engine`); every server started with the plugin pulls, verifies and swaps it
itself. The sync returns once every server serves step ``global_step - max_staleness`` or later
(None: at once). At the end of training the final weights, which TRL itself never syncs, are
published and waited for, so the fleet serves exactly the trained policy when ``train()`` returns.

Only TRL's main process holds a client; it publishes the whole model (TRL gathers each parameter
for it, as for NCCL), under the model's checkpoint names.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from transformers import TrainerCallback

from delta_swap.errors import ConfigError
from delta_swap.integrations.versions import check_version

log = logging.getLogger("vllm_delta_plugin")


class DeltaSwapSync(TrainerCallback):
    """A TRL trainer callback whose construction makes TRL's vLLM weight sync publish to ``store_url``.

    ``max_staleness``: each sync returns once the servers serve ``step - max_staleness`` or later
    (None: once the step is queued). Other keywords are :class:`.DeltaSwapTrainerInitInfo` fields
    (``signing_key``, ``files_from``, ``server_urls``, ``wait_timeout_s``, ``publisher_options``...).
    """

    def __init__(self, store_url: str, *, base_every: int = 25, max_staleness: int | None = 1, **options: Any) -> None:
        check_version("trl")
        from .trainer_engine import DeltaSwapTrainerInitInfo

        try:
            self.init_info = DeltaSwapTrainerInitInfo(  # one publisher: TRL's main process
                store_url, base_every=base_every, max_staleness=max_staleness, **{"rank": 0, **options}
            )
        except TypeError as exc:
            raise ConfigError(f"DeltaSwapSync: {exc}") from None
        #: The trainer engine, made when TRL opens its client (``init_communicator``).
        self.engine: Any = None
        self.model: Any = None
        self._state: Any = None
        _install(self)

    # --------------------------------------------------------------- TrainerCallback events

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.model = model

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.model, self._state = model if model is not None else self.model, state

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Publish the final weights (TRL syncs only before generating) and wait until the servers
        serve them; raises if a step failed to publish."""
        if self.engine is None:
            return
        self.model = model if model is not None else self.model
        if self.model is not None:  # the trainer's global step, unless a sync published it already
            self.sync(self.model.named_parameters())
        self.engine.flush()
        if self.engine.last_step is not None and self.engine.server_urls:
            self.engine.wait_for_servers(self.engine.last_step, self.init_info.wait_timeout_s)

    # --------------------------------------------------------------- what the client calls

    def attach(self, base_url: str) -> None:
        """Open the store for TRL's client of the server at ``base_url`` (its ``init_communicator``)."""
        from delta_swap.integrations.servers import server_status

        from .trainer_engine import DeltaSwapTrainerEngine

        if server_status(base_url.rstrip("/")) is None:
            raise ConfigError(
                f"the server at {base_url} does not answer /delta_swap/status: start it with the delta-swap "
                "plugin (VLLM_PLUGINS=delta_swap, DELTA_SWAP_STORE) following the store this trainer publishes to"
            )
        if self.engine is None:
            urls = (base_url.rstrip("/"), *self.init_info.server_urls)
            self.engine = DeltaSwapTrainerEngine(dataclasses.replace(self.init_info, server_urls=urls))

    def sync(self, named_params: Iterable[tuple[str, Any]]) -> None:
        """Publish ``named_params`` (TRL's gathered parameters) as the trainer's global step."""
        if self.engine is None:
            raise ConfigError("DeltaSwapSync: TRL synced weights before opening its client (init_communicator)")
        step = self._state.global_step if self._state is not None else None
        if step is not None and self.engine.last_step is not None and step <= self.engine.last_step:
            log.info("delta-swap: step %d is published already; sync skipped", step)
            return
        self.engine.send_weights(list(named_params), step=step, module=self.model)


def _install(sync: DeltaSwapSync) -> None:
    """Put the delta-swap client in the place TRL's server-mode generation looks its client up."""
    import trl.generation.vllm_generation as generation
    from trl.generation.vllm_client import VLLMClient

    class DeltaSwapVLLMClient(VLLMClient):
        """TRL's client: generation through the server as before; weights through the store."""

        def init_communicator(self, device: Any = 0) -> None:
            sync.attach(self.base_url)

        def update_named_params(self, metadata: Any, named_params: Iterable[tuple[str, Any]]) -> None:
            sync.sync(named_params)

        def update_named_param(self, name: str, weights: Any) -> None:
            raise ConfigError("delta-swap publishes whole steps: sync with update_named_params or update_model_params")

        def update_model_params(self, model: Any) -> None:
            sync.sync((name, p.data) for name, p in model.named_parameters())

        def _start_weight_update(self) -> None:  # publishing is the whole update
            return None

        def _finish_weight_update(self) -> None:
            return None

        def reset_prefix_cache(self) -> None:  # the server resets its prefix cache with every swap
            return None

        def close_communicator(self) -> None:
            return None

    generation.VLLMClient = DeltaSwapVLLMClient  # type: ignore[misc]
