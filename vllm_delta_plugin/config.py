"""Plugin settings, read from ``DELTA_SWAP_*`` environment variables (vLLM plugins take no flags)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import ClassVar

from delta_swap.engine_adapter import SwapConfig

BACKEND_NAME = "delta_swap"


@dataclass(frozen=True)
class PluginConfig(SwapConfig):
    """How the API server follows a store and swaps weights into vLLM."""

    #: Where staged tensors are written for the workers to map (tmpfs when available).
    staging_dir: str = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    ENV: ClassVar[dict[str, str]] = {**SwapConfig.ENV, "staging_dir": "DELTA_SWAP_STAGING_DIR"}
