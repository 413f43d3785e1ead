"""``vllm.endpoint_plugins`` entry point: the admin routes and the subscriber in vLLM's API server."""

from __future__ import annotations

import os
from argparse import Namespace
from typing import Any

from delta_swap import service
from delta_swap.engine_adapter import refuse_unverified_weights
from delta_swap.errors import ConfigError
from delta_swap.front_ends import FrontEnd
from delta_swap.settings import Settings

from .plugin import BACKEND_NAME
from .shadow_build import exact_quantizations


class DeltaSwapEndpoint:
    """Mounts ``/delta_swap/*`` and, when ``DELTA_SWAP_STORE`` is set, follows that store."""

    name = "delta_swap"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        service.mount(app, "set DELTA_SWAP_STORE (and VLLM_PLUGINS=delta_swap)")

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        from .versions import instrument

        # Weight-version spans for the OpenAI-compatible routes, and version-salted prefix caching.
        instrument(engine_client, lambda: service.served_version(state))
        settings = Settings.load()
        adapter = None
        front_end = front_end_of(engine_client.vllm_config.parallel_config)
        if settings.store:
            refuse_unsupported(engine_client.vllm_config)
            backend = getattr(engine_client.vllm_config.weight_transfer_config, "backend", None)
            if backend != BACKEND_NAME:
                raise ConfigError(
                    "delta_swap needs vLLM's weight-transfer backend: add "
                    f'--weight-transfer-config \'{{"backend": "{BACKEND_NAME}"}}\''
                )
            from .adapter import VllmAdapter

            if front_end.leads:  # the other API servers follow this one's subscriber
                adapter = VllmAdapter.for_engine(engine_client, settings, args.model)
        service.start(state, settings, adapter, front_end)


def front_end_of(parallel: Any) -> FrontEnd:
    """This API server's place among those ``vllm serve`` started (``--api-server-count``, by
    default one per data-parallel engine): siblings of one parent process, server 0 leads."""
    count = max(1, int(getattr(parallel, "_api_process_count", 1)))
    index = max(0, int(getattr(parallel, "_api_process_rank", 0)))
    return FrontEnd.siblings_of(os.getppid(), index, count)


def refuse_unsupported(vllm_config: Any) -> None:
    """Refuse, when the server starts and with one line, what delta-swap cannot keep exact yet
    (:func:`refuse_parallel_layouts`, and servers whose weights are not the published tensors:
    quantized other than as :mod:`.shadow_build` keeps exact, with LoRA adapters, multimodal),
    instead of serving something else silently."""
    refuse_parallel_layouts(vllm_config.parallel_config)
    model = getattr(vllm_config, "model_config", None)
    refuse_unverified_weights(
        getattr(model, "quantization", None),
        "--enable-lora" if getattr(vllm_config, "lora_config", None) is not None else None,
        bool(getattr(model, "is_multimodal_model", False)),
        exact_quantizations(vllm_config.parallel_config),
    )


def refuse_parallel_layouts(parallel: Any) -> None:
    """Refuse the layouts delta-swap cannot keep exact yet. Tensor parallel is supported, and data
    parallel: one subscriber (in API server 0, whatever ``--api-server-count``) pauses, updates
    and resumes every engine in the same swap (vLLM's client sends each call to all of them), and
    the other API servers follow it (:mod:`delta_swap.front_ends`). Pipeline parallel is not
    tested."""
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise ConfigError("delta_swap does not support --pipeline-parallel-size > 1 yet")
