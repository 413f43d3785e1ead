"""SGLang 0.5.23 on CPU (on a GPU with ``DELTA_SWAP_DEVICE=cuda``) with the ``delta_swap`` plugin, as a
child process.

SGLang runs in its own cached environment (``scripts/sglang_env.sh``: CPU torch, SGLang without its
CUDA dependencies, and a CPU test shim standing in for ``sgl_kernel``; docs/SGLANG.md explains it).
The plugin is enabled by its flags: every setting is ``--delta-swap-<name>``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

from delta_swap.settings import Settings

from .process import (
    GPU_MEMORY_FRACTION,
    ROOT,
    Server,
    device,
    launch_server,
    start_on_a_free_port,
    with_freshness_record,
)


@cache
def python() -> str:
    """The SGLang environment's interpreter: ``$DELTA_SWAP_SGLANG_PYTHON`` if set (e.g. a CUDA
    install on a GPU machine), else the CPU environment scripts/sglang_env.sh builds and caches."""
    if os.environ.get("DELTA_SWAP_SGLANG_PYTHON"):
        return os.environ["DELTA_SWAP_SGLANG_PYTHON"]
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "sglang_env.sh")], check=True, capture_output=True, text=True, timeout=3600
    )
    return str(Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python")


def numba_cache_dir() -> Path:
    """Where SGLang's environment caches the codec's compiled kernels: its own folder, as its numba
    may differ from the trainer's (one shared cache would be compiled again at each switch)."""
    digest = hashlib.sha256(python().encode()).hexdigest()[:12]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "delta-swap" / f"numba-sglang-{digest}"


def command(
    model: Path,
    port: int,
    *,
    served_name: str = "model",
    settings: Mapping[str, object] | None = None,
    extra: Sequence[str] = (),
    bind: str = "127.0.0.1",
) -> list[str]:
    """Arguments after ``python`` that start SGLang's server on ``model`` (plugin flags from ``settings``)."""
    argv = [
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--host",
        bind,
        "--port",
        str(port),
        "--served-model-name",
        served_name,
        "--random-seed",
        "0",
    ]
    if device() == "cpu":
        argv += ["--max-total-tokens", "4096", "--device", "cpu", "--attention-backend", "torch_native"]
    else:
        argv += ["--max-total-tokens", "32768", "--mem-fraction-static", str(GPU_MEMORY_FRACTION)]
    for name, value in (settings or {}).items():
        argv += [Settings.flag_name(name), str(value)]
    return argv + list(extra)


def environment(*, plugin: bool = True, shim_log: Path | None = None) -> dict[str, str]:
    """What SGLang needs on this machine; ``shim_log`` records any call of the sgl_kernel test shim."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "SGLANG_PLUGINS": "delta_swap" if plugin else "none",
    }  # an allowlist naming no plugin: plain SGLang
    if device() == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    if not os.environ.get("NUMBA_CACHE_DIR"):
        env["NUMBA_CACHE_DIR"] = str(numba_cache_dir())
    if shim_log is not None:
        env["DELTA_SWAP_SGL_KERNEL_SHIM_LOG"] = str(shim_log)
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
    shim_log: Path | None = None,
    log_name: str = "sglang.log",
    timeout_s: float = 300,
    wait: bool = True,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> Server:
    """Start SGLang on ``model`` and (with ``wait``) wait until it answers ``/health``. With a
    ``prefix`` (e.g. ``ip netns exec NS``) it runs there; reached at a ``host`` other than
    loopback, it listens on every address."""
    workdir.mkdir(parents=True, exist_ok=True)
    settings = with_freshness_record(settings, workdir)
    full_env = {**environment(plugin=plugin, shim_log=shim_log), **(env or {})}

    def launch(port: int) -> Server:
        argv = command(
            model,
            port,
            served_name=served_name,
            settings=settings if plugin else None,
            extra=extra,
            bind="127.0.0.1" if host == "127.0.0.1" else "0.0.0.0",
        )
        return launch_server(argv, full_env, workdir / log_name, port, python=python(), host=host, prefix=prefix)

    return start_on_a_free_port(launch, wait, timeout_s)
