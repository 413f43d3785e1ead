"""Plugin settings: ``--delta-swap-*`` flags on SGLang's own command line, or ``DELTA_SWAP_*``
environment variables (a flag wins over its variable)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from delta_swap.engine_adapter import DrainPolicy

PLUGIN_NAME = "delta_swap"

#: flag -> (environment variable, Namespace attribute)
FLAGS = {
    "--delta-swap-source": ("DELTA_SWAP_STORE", "delta_swap_source"),
    "--delta-swap-poll-interval": ("DELTA_SWAP_POLL_INTERVAL", "delta_swap_poll_interval"),
    "--delta-swap-drain": ("DELTA_SWAP_DRAIN", "delta_swap_drain"),
    "--delta-swap-drain-timeout": ("DELTA_SWAP_DRAIN_TIMEOUT", "delta_swap_drain_timeout"),
}


@dataclass(frozen=True)
class PluginConfig:
    """How the HTTP server process follows a store and swaps weights into SGLang."""

    store_url: str | None
    poll_interval_s: float = 2.0
    drain: DrainPolicy = DrainPolicy.WAIT
    #: In ``wait`` mode, abort what is still running after this many seconds.
    drain_timeout_s: float = 30.0

    @classmethod
    def from_sources(cls, args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> PluginConfig:
        """Flags parsed by SGLang (``args``), falling back to the environment, then to defaults."""
        env = os.environ if env is None else env
        values: dict[str, str | None] = {}
        for flag, (var, attr) in FLAGS.items():
            value = getattr(args, attr, None) if args is not None else None
            values[flag] = str(value) if value is not None else (env.get(var) or None)
        defaults = cls(store_url=None)
        try:
            return cls(
                store_url=values["--delta-swap-source"],
                poll_interval_s=float(values["--delta-swap-poll-interval"] or defaults.poll_interval_s),
                drain=DrainPolicy(values["--delta-swap-drain"] or defaults.drain.value),
                drain_timeout_s=float(values["--delta-swap-drain-timeout"] or defaults.drain_timeout_s),
            )
        except ValueError as exc:
            raise ValueError(f"bad delta-swap setting: {exc}") from None


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
