"""``sglang.srt.plugins`` entry point: SGLang calls :func:`register` in its main, scheduler and
detokenizer processes. The main (HTTP server) process gets the flags, the routes and the
subscriber; the scheduler process describes its parameters and takes swaps in its paused loop
(:mod:`.engine_ops`, :mod:`.paused_loop`)."""

from __future__ import annotations

import argparse
import multiprocessing
from collections.abc import Callable
from typing import Any

from delta_swap.settings import Settings

from . import server

_registered = False

ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
LAUNCH_SERVER = "sglang.srt.entrypoints.http_server.launch_server"
SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"


def register() -> None:
    """Add the ``--delta-swap-*`` flags and, in the HTTP server, the routes and the subscriber
    (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _registered = True
    if multiprocessing.parent_process() is not None:  # a scheduler (or detokenizer) child
        from .engine_ops import describe_after_init
        from .paused_loop import PAUSED_ITERATION, on_paused_iteration

        HookRegistry.register(SCHEDULER_INIT, describe_after_init, HookType.AFTER)
        HookRegistry.register(PAUSED_ITERATION, on_paused_iteration, HookType.AFTER)
        return
    HookRegistry.register(ADD_CLI_ARGS, _after_add_cli_args, HookType.AFTER)
    HookRegistry.register(FROM_CLI_ARGS, _around_from_cli_args, HookType.AROUND)
    HookRegistry.register(LAUNCH_SERVER, _around_launch_server, HookType.AROUND)


def _after_add_cli_args(result: Any, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
    Settings.add_arguments(parser)


def _around_from_cli_args(original: Callable, cls: type, args: argparse.Namespace, *rest: Any, **kwargs: Any) -> Any:
    server.remember_args(args)
    server_args = original(cls, args, *rest, **kwargs)
    server.enable_engine_ops()
    return server_args


def _around_launch_server(original: Callable, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.entrypoints import http_server

    server.install(http_server.app, server_args)
    return original(server_args, *args, **kwargs)
