"""Glue in SGLang's HTTP server process: mount the admin routes and follow the store for as long
as the server's app lives (started after SGLang's own startup, on its event loop)."""

from __future__ import annotations

import argparse
import asyncio
import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from delta_swap import service
from delta_swap.errors import ConfigError
from delta_swap.settings import Settings

#: Settings from the parsed command line (None until SGLang parses one: then the environment).
_settings: Settings | None = None


def remember_args(args: argparse.Namespace) -> None:
    """Keep the ``--delta-swap-*`` flags SGLang just parsed (ServerArgs has no field for them)."""
    global _settings
    if hasattr(args, "delta_swap_store"):
        _settings = Settings.load(args)


def enable_engine_ops(server_args: Any) -> None:
    """When following a store: register delta-swap's custom weight loader with SGLang and name
    the file the scheduler describes its parameters in (children inherit the environment)."""
    from .engine_ops import LAYOUT_FILE_ENV, LOADER

    settings = _settings or Settings.load()
    if not settings.store:
        return
    loaders = list(getattr(server_args, "custom_weight_loader", None) or [])
    if LOADER not in loaders:
        server_args.custom_weight_loader = [*loaders, LOADER]
    os.environ[LAYOUT_FILE_ENV] = str(Path(settings.staging_dir) / f"delta-swap-layout-{os.getpid()}.json")
    os.environ[Settings.env_name("swap_path")] = settings.swap_path.value  # read by the scheduler


def install(app: Any, server_args: Any) -> None:
    """Mount ``/delta_swap/*`` on ``app`` and, when a store is configured, follow it while the
    app runs."""
    settings = _settings or Settings.load()
    service.mount(app, f"pass {Settings.flag_name('store')} URL")
    if not settings.store:
        service.start(app.state, settings, None)
        return
    if (getattr(server_args, "tokenizer_worker_num", 1) or 1) > 1:
        raise ConfigError("delta_swap needs one tokenizer process: drop --tokenizer-worker-num")
    original = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(the_app: Any):
        async with original(the_app) as state:
            service.start(the_app.state, settings, await _adapter(settings, the_app.state))
            try:
                yield state
            finally:
                await service.stop(the_app)

    app.router.lifespan_context = lifespan


async def _adapter(settings: Settings, state: Any) -> Any:
    from sglang.srt.entrypoints.http_server import get_global_state
    from sglang.srt.runtime_context import get_parallel

    from .adapter import SglangAdapter
    from .staging import served_model
    from .versions import instrument

    if get_parallel().dp_size != 1:
        raise ConfigError("delta_swap supports --dp-size 1 (SGLang's tensor weight update does too)")
    tokenizer_manager = get_global_state().tokenizer_manager
    # Weight-version spans for the OpenAI-compatible routes, and version-salted radix caching.
    instrument(tokenizer_manager, lambda: service.served_version(state))
    served = await asyncio.to_thread(served_model, tokenizer_manager.model_path)
    return SglangAdapter(tokenizer_manager, served, settings, tp_size=get_parallel().tp_size)
