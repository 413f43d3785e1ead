"""``vllm.endpoint_plugins`` entry point: the subscriber and admin routes in vLLM's API server."""

from __future__ import annotations

import logging
from argparse import Namespace
from typing import Any

from delta_swap.subscriber import Subscriber, SubscriberConfig

from .config import PluginConfig

log = logging.getLogger("vllm_delta_plugin")


class DeltaSwapEndpoint:
    """Mounts ``/delta_swap/*`` and, when ``DELTA_SWAP_STORE`` is set, follows that store."""

    name = "delta_swap"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from .routes import router

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        from .adapter import VllmEngineAdapter

        config = PluginConfig.load()
        state.delta_swap = None
        if not config.store_url:
            log.warning("delta_swap: DELTA_SWAP_STORE is not set; the server will not follow a store")
            return
        backend = getattr(engine_client.vllm_config.weight_transfer_config, "backend", None)
        if backend != "delta_swap":
            raise RuntimeError(
                "delta_swap needs vLLM's weight-transfer backend: add "
                "--weight-transfer-config '{\"backend\": \"delta_swap\"}'"
            )
        adapter = VllmEngineAdapter(engine_client, config, checkpoint_dir=args.model)
        subscriber = Subscriber(SubscriberConfig(config.store_url, poll_interval_s=config.poll_interval_s), adapter)
        state.delta_swap = subscriber
        subscriber.start()
        log.info("delta_swap: following %s (drain=%s)", config.store_url, config.drain.value)

