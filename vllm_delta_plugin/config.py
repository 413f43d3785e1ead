"""Plugin settings, read from ``DELTA_SWAP_*`` environment variables (vLLM plugins take no flags)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from delta_swap.engine_adapter import DrainPolicy

BACKEND_NAME = "delta_swap"


@dataclass(frozen=True)
class PluginConfig:
    """How the API server follows a store and swaps weights into vLLM."""

    store_url: str | None
    poll_interval_s: float = 2.0
    drain: DrainPolicy = DrainPolicy.WAIT
    #: In ``wait`` mode, abort what is still running after this many seconds.
    drain_timeout_s: float = 30.0
    #: Where staged tensors are written for the workers to map (tmpfs when available).
    staging_dir: str = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> PluginConfig:
        env = dict(os.environ if env is None else env)
        defaults = cls(store_url=None)
        return cls(
            store_url=env.get("DELTA_SWAP_STORE") or None,
            poll_interval_s=float(env.get("DELTA_SWAP_POLL_INTERVAL", defaults.poll_interval_s)),
            drain=DrainPolicy(env.get("DELTA_SWAP_DRAIN", defaults.drain.value)),
            drain_timeout_s=float(env.get("DELTA_SWAP_DRAIN_TIMEOUT", defaults.drain_timeout_s)),
            staging_dir=env.get("DELTA_SWAP_STAGING_DIR", defaults.staging_dir),
        )
