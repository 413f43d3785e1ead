"""Glue in SGLang's HTTP server process: mount the admin routes and run the subscriber for as
long as the server's app lives (started after SGLang's own startup, on its event loop)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any

from .config import PluginConfig

log = logging.getLogger("sglang_delta_plugin")

#: Settings from the parsed command line (None until SGLang parses one: then the environment).
_config: PluginConfig | None = None


def remember_args(args: argparse.Namespace) -> None:
    """Keep the ``--delta-swap-*`` flags SGLang just parsed (ServerArgs has no field for them)."""
    global _config
    if hasattr(args, "delta_swap_source"):
        _config = PluginConfig.from_sources(args)


def install(app: Any, server_args: Any) -> None:
    """Mount ``/delta_swap/*`` on ``app`` and, when a store is configured, follow it while the
    app runs."""
    from .routes import router

    config = _config or PluginConfig.from_sources()
    if not any(getattr(r, "path", "").startswith("/delta_swap/") for r in app.routes):
        app.include_router(router)
    app.state.delta_swap = None
    if not config.store_url:
        log.warning("delta_swap: no --delta-swap-source (or DELTA_SWAP_STORE); the server will not follow a store")
        return
    if (getattr(server_args, "tokenizer_worker_num", 1) or 1) > 1:
        raise RuntimeError("delta_swap needs one tokenizer process: drop --tokenizer-worker-num")
    original = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(the_app: Any):
        async with original(the_app) as state:
            subscriber = await _start(config)
            the_app.state.delta_swap = subscriber
            try:
                yield state
            finally:
                the_app.state.delta_swap = None
                await subscriber.stop()

    app.router.lifespan_context = lifespan


async def _start(config: PluginConfig) -> Any:
    # Imported only now: the subscriber's Prometheus metrics must see the multiprocess mode that
    # SGLang's --enable-metrics sets up after plugins load, to appear on SGLang's /metrics.
    from delta_swap.subscriber import Subscriber, SubscriberConfig
    from sglang.srt.entrypoints.http_server import get_global_state
    from sglang.srt.runtime_context import get_parallel

    from .adapter import SglangEngineAdapter
    from .staging import served_layout

    if get_parallel().dp_size != 1:
        raise RuntimeError("delta_swap supports --dp-size 1 (SGLang's tensor weight update does too)")
    tokenizer_manager = get_global_state().tokenizer_manager
    checkpoint_dir = tokenizer_manager.model_path
    layout = await asyncio.to_thread(served_layout, checkpoint_dir)
    adapter = SglangEngineAdapter(tokenizer_manager, config, checkpoint_dir, layout, tp_size=get_parallel().tp_size)
    subscriber = Subscriber(SubscriberConfig(config.store_url, poll_interval_s=config.poll_interval_s), adapter)
    subscriber.start()
    log.info("delta_swap: following %s (drain=%s, %d tensors served)", config.store_url, config.drain.value, len(layout))
    return subscriber
