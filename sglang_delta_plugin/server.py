"""Glue in SGLang's HTTP server process: mount the admin routes and follow the store for as long
as the server's app lives (started after SGLang's own startup, on its event loop)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from delta_swap import service
from delta_swap.engine_adapter import refuse_unverified_weights
from delta_swap.errors import ConfigError
from delta_swap.settings import Settings

log = logging.getLogger("sglang_delta_plugin")

#: Settings from the parsed command line (None until SGLang parses one: then the environment).
_settings: Settings | None = None


def remember_args(args: argparse.Namespace) -> None:
    """Keep the ``--delta-swap-*`` flags SGLang just parsed (ServerArgs has no field for them)."""
    global _settings
    if hasattr(args, "delta_swap_store"):
        _settings = Settings.load(args)


def enable_engine_ops() -> None:
    """When following a store: name the file the scheduler describes its parameters in and the
    channel each scheduler answers on (children inherit the environment)."""
    from . import scheduler_channel
    from .engine_ops import LAYOUT_FILE_ENV

    settings = _settings or Settings.load()
    if not settings.store:
        return
    os.environ[LAYOUT_FILE_ENV] = str(Path(settings.staging_dir) / f"delta-swap-layout-{os.getpid()}.json")
    os.environ[Settings.env_name("swap_path")] = settings.swap_path.value  # read by the scheduler
    scheduler_channel.configure()  # where each scheduler answers the adapter's requests


def install(app: Any, server_args: Any) -> None:
    """Mount ``/delta_swap/*`` on ``app`` and, when a store is configured, follow it while the
    app runs."""
    settings = _settings or Settings.load()
    service.mount(app, f"pass {Settings.flag_name('store')} URL")
    if settings.keep_freed_memory:
        log.warning(
            "delta_swap: %s applies to vLLM only: SGLang's processes give freed memory back",
            Settings.flag_name("keep_freed_memory"),
        )
    if not settings.store:
        service.start(app.state, settings, None)
        return
    if (getattr(server_args, "tokenizer_worker_num", 1) or 1) > 1:
        raise ConfigError("delta_swap needs one tokenizer process: drop --tokenizer-worker-num")
    refuse_unsupported(server_args)
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


def refuse_unsupported(server_args: Any) -> None:
    """Refuse, when the server starts and with one line, what delta-swap cannot keep exact yet:
    data and pipeline parallel, quantized servers, LoRA adapters, multimodal models (tensor
    parallel is supported)."""
    if (getattr(server_args, "dp_size", 1) or 1) > 1:
        raise ConfigError("delta_swap supports --dp-size 1 (SGLang's tensor weight update does too)")
    if (getattr(server_args, "pp_size", 1) or 1) > 1:
        raise ConfigError("delta_swap does not support --pp-size > 1 yet")
    lora = getattr(server_args, "enable_lora", None) or getattr(server_args, "lora_paths", None)
    refuse_unverified_weights(
        getattr(server_args, "quantization", None),
        "LoRA adapters (--enable-lora / --lora-paths)" if lora else None,
        bool(
            getattr(server_args, "enable_multimodal", None) or _is_multimodal(getattr(server_args, "model_path", None))
        ),
    )


def _is_multimodal(model_path: str | None) -> bool:
    """Whether a local checkpoint's config names a vision or audio tower."""
    import json

    try:
        config = json.loads((Path(model_path or "") / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and any(k in config for k in ("vision_config", "audio_config"))


async def _adapter(settings: Settings, state: Any) -> Any:
    from sglang.srt.entrypoints.http_server import get_global_state
    from sglang.srt.runtime_context import get_parallel

    from .adapter import SglangAdapter
    from .staging import served_model
    from .versions import instrument

    tokenizer_manager = get_global_state().tokenizer_manager
    # Weight-version spans for the OpenAI-compatible routes, and version-salted radix caching.
    instrument(tokenizer_manager, lambda: service.served_version(state))
    served = await asyncio.to_thread(served_model, tokenizer_manager.model_path)
    return SglangAdapter(tokenizer_manager, served, settings, tp_size=get_parallel().tp_size)
