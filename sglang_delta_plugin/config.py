"""Plugin settings: ``--delta-swap-*`` flags on SGLang's own command line, or ``DELTA_SWAP_*``
environment variables (a flag wins over its variable)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from delta_swap.engine_adapter import DrainPolicy, SwapConfig


class PluginConfig(SwapConfig):
    """How the HTTP server process follows a store and swaps weights into SGLang."""

    @classmethod
    def from_sources(cls, args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> SwapConfig:
        """Flags parsed by SGLang (``args``), falling back to the environment, then to defaults."""
        given = {
            "store_url": getattr(args, "delta_swap_source", None),
            "poll_interval_s": getattr(args, "delta_swap_poll_interval", None),
            "drain": getattr(args, "delta_swap_drain", None),
            "drain_timeout_s": getattr(args, "delta_swap_drain_timeout", None),
        }
        return cls.load(given, env)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``--delta-swap-*`` flags to SGLang's server argument parser."""
    if any("--delta-swap-source" in a.option_strings for a in parser._actions):
        return  # already added (the hook may run twice)
    group = parser.add_argument_group("delta-swap", "Follow a delta-swap store and hot-swap each new snapshot.")
    group.add_argument("--delta-swap-source", metavar="URL", default=None,
                       help="Store URL to follow (file:///path or a plain path). Env: DELTA_SWAP_STORE. "
                            "Without it the plugin stays idle.")
    group.add_argument("--delta-swap-poll-interval", metavar="SECONDS", type=float, default=None,
                       help="Seconds between polls of the store's head. Env: DELTA_SWAP_POLL_INTERVAL (default 2).")
    group.add_argument("--delta-swap-drain", choices=[p.value for p in DrainPolicy], default=None,
                       help="In-flight requests during a swap: wait (finish them first, hold new ones), keep "
                            "(SGLang's retract pause: they resume on the new weights, KV recomputed), abort. "
                            "Env: DELTA_SWAP_DRAIN (default wait).")
    group.add_argument("--delta-swap-drain-timeout", metavar="SECONDS", type=float, default=None,
                       help="In wait mode, abort what still runs after this many seconds. "
                            "Env: DELTA_SWAP_DRAIN_TIMEOUT (default 30).")
