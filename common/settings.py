"""The settings of a rollout server's delta-swap, one dataclass for every engine.

Each setting has one name, spelled three ways: the field ``poll_interval``, the environment
variable ``DELTA_SWAP_POLL_INTERVAL`` and the flag ``--delta-swap-poll-interval`` (engines whose
command line a plugin can extend, such as SGLang, get the flags; vLLM plugins read the
environment). A flag wins over its variable, which wins over the default.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from enum import Enum
from functools import cache
from typing import Any, ClassVar

from .errors import ConfigError

ENV_PREFIX = "DELTA_SWAP_"
FLAG_PREFIX = "--delta-swap-"


class DrainPolicy(str, Enum):
    """What happens to in-flight requests while weights are swapped."""

    WAIT = "wait"  # stop admitting, let running requests finish (up to a timeout), then swap
    KEEP = "keep"  # freeze running requests in place, swap, resume them on the new weights
    ABORT = "abort"  # abort running requests, swap


class SwapPath(str, Enum):
    """Which swap path a server takes (``Settings.swap_path``)."""

    AUTO = "auto"  # arena where the parameters are plain host tensors, else shadow where the engine can, else reload
    ARENA = "arena"  # ask the engine for plain parameters where it allows it; reload where it cannot
    RELOAD = "reload"  # always the engine's own loader
    INPLACE = "inplace"  # write only the changed elements into plain live parameters (undo log); reload elsewhere
    SHADOW = "shadow"  # build the changed modules processed (repacked) before the pause, switch them in it


class VerifySwaps(str, Enum):
    """When a server reads back what its engine computes with after a swap (``Settings.verify_swaps``)."""

    AUTO = "auto"  # as often as keeps the checks within VERIFY_SHARE of the swap windows: every swap when cheap
    ALWAYS = "always"  # every swap, whatever it costs
    NEVER = "never"

    @classmethod
    def _missing_(cls, value: object) -> VerifySwaps | None:
        """The boolean spellings of earlier releases: true -> always, false -> never."""
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return cls.ALWAYS
        if text in ("0", "false", "no", "off"):
            return cls.NEVER
        return None


#: With ``verify_swaps=auto``: the share of the swap windows (on average) that read-backs may add.
VERIFY_SHARE = 0.10


def _default_staging_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(frozen=True)
class Settings:
    """How a server follows a store and swaps snapshots into its engine."""

    store: str | None = None
    """Store URL to follow: file:///path or a plain path, s3://bucket/prefix, http(s)://host/path.
    Without it the plugin stays idle."""

    poll_interval: float = 2.0
    """Seconds between polls of the store's head pointer (a trainer's notify call polls at once)."""

    drain: DrainPolicy = DrainPolicy.KEEP
    """In-flight requests during a swap: keep (freeze them in place; they continue on the new
    weights, and spans tag which snapshot made each token), wait (finish them first, holding new
    ones: the pause lasts as long as the longest request), abort (end them)."""

    recompute_kv: bool = False
    """In keep mode, recompute the KV cache of requests kept in place on the new weights (exact,
    but costs a prefill of every running request: cheap on GPUs, slow on CPUs). Off, they continue
    on the KV they have, as in-flight-update RL trainers do; new requests never reuse KV computed
    with other weights either way."""

    drain_timeout: float = 30.0
    """In wait mode, abort the requests still running after this many seconds."""

    fetch_concurrency: int = 4
    """Shards of one snapshot downloaded at once."""

    replay_cost_ratio: float = 1.0
    """Replay deltas from the served snapshot while their bytes stay below this many times the
    bytes of loading the newest base and its deltas; otherwise reload from the base."""

    staging_dir: str = _default_staging_dir()
    """Where the weight arenas, staged tensors and the files an engine's other processes read are
    kept (vLLM's workers, SGLang's scheduler; tmpfs when available)."""

    freshness_file: str | None = None
    """File where the server records the run and step of the newest snapshot it verified, so that
    a restart never goes back to an older snapshot or another run (default:
    delta-swap-freshness-<store hash>.json in staging_dir; a tmpfs staging dir forgets it at reboot:
    point this at a persistent disk to keep it)."""

    trusted_key: str | None = None
    """Public key file(s) of the publisher, comma-separated (several during a key rotation): only
    snapshots signed by one of them are accepted, checked before anything they name is fetched."""

    admin_token: str | None = None
    """Bearer token that POST /delta_swap/resync and /delta_swap/notify require (prefer the
    variable: a flag shows in the process list); without one those routes refuse every caller
    unless admin_open_loopback is on."""

    admin_open_loopback: bool = False
    """Without an admin token, let loopback callers use the POST routes. Every process on the
    host is then an admin, and so is every client of a reverse proxy on the host (it connects
    from loopback): prefer a token."""

    notify_interval: float = 1.0
    """At most one store poll per this many seconds on notify calls: notifies that arrive
    meanwhile are folded into the pending poll (the regular polls keep poll_interval)."""

    max_model_bytes: int | None = None
    """Refuse snapshots whose tensors add up to more bytes than this (default: the served model's size)."""

    max_step_jump: int = 1_000_000
    """Refuse a newest snapshot more than this many steps ahead of the one served (a runaway or
    forged step number)."""

    verify_swaps: VerifySwaps = VerifySwaps.AUTO
    """After a swap, before the engine generates again, read back what it computes with (a bounded
    sample per module, through the engine's own layout) and roll back on any difference (vLLM's
    reload path, SGLang's tensor path). auto: every swap while that costs at most 10% of the swap
    windows, else as many swaps as keep it there on average (the check's cost is bounded per module,
    the window grows with the model: python -m benchmarks.verify_cost, figures in the README);
    always; never (true and false mean always and never)."""

    swap_path: SwapPath = SwapPath.AUTO
    """How updates reach the engine: auto (arena where the engine's parameters are plain host
    tensors, else the engine's own loader), arena (also asks an engine that would repack its weights
    for plain ones where it can, e.g. vLLM on CPUs with AMX or AVX512-BF16: a faster swap, slower
    matrix products), inplace (asks for plain parameters the same way, then writes only the changed
    elements into the live parameters, with an undo log, on any device and tensor-parallel rank),
    reload (always the engine's own loader). The status says which path each
    swap took and why."""

    keep_freed_memory: bool = False
    """The engine's worker keeps the memory an update frees for the next update instead of giving it
    back to the system (glibc's malloc: no mapping per large block, no trimming; as the tcmalloc that
    vLLM's CPU wheels preload does on its own). Each update's new weights then land on pages already
    mapped: at 1 GB the shadow build (vLLM's repacked CPU weights) 8% faster on two cores and 55% on
    one, vLLM's own reload ~47%, for ~2x the model more memory between updates and ~1.1x more at the
    peak (benchmarks/README.md, "Keeping freed memory"). vLLM only; the status says whether it took."""

    #: Extra flag spellings accepted for a field (kept for command lines written before the rename).
    FLAG_ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {"store": ("--delta-swap-source",)}
    #: Fields whose values are secrets: never shown by ``repr`` (nor by anything that logs it).
    SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset({"admin_token"})

    def __repr__(self) -> str:
        """Every setting, with secrets as ``<redacted>`` and the store URL without credentials or
        query string."""
        from .stores.base import public_url

        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self.SECRET_FIELDS and value is not None:
                shown.append(f"{f.name}='<redacted>'")
            elif f.name == "store" and value is not None:
                shown.append(f"store={public_url(value)!r}")
            else:
                shown.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    @staticmethod
    def env_name(name: str) -> str:
        """``poll_interval`` -> ``DELTA_SWAP_POLL_INTERVAL``."""
        return ENV_PREFIX + name.upper()

    @staticmethod
    def flag_name(name: str) -> str:
        """``poll_interval`` -> ``--delta-swap-poll-interval``."""
        return FLAG_PREFIX + name.replace("_", "-")

    @classmethod
    def load(
        cls, flags: argparse.Namespace | Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> Settings:
        """Settings from parsed flags (attributes ``delta_swap_<field>``; None means not given),
        else the environment, else the defaults. Raises ConfigError naming a bad setting."""
        env = os.environ if env is None else env
        given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags or {})
        values: dict[str, Any] = {}
        for f in fields(cls):
            source, value = cls.flag_name(f.name), given.get("delta_swap_" + f.name)
            if value is None:
                source, value = cls.env_name(f.name), env.get(cls.env_name(f.name)) or None
            if value is None:
                continue
            try:
                values[f.name] = _converter(str(f.type))(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"bad delta-swap setting {source}={value!r}: {exc}") from None
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add a ``--delta-swap-*`` flag for every setting (idempotent)."""
        if any(cls.flag_name("store") in a.option_strings for a in parser._actions):
            return
        group = parser.add_argument_group("delta-swap", "Follow a delta-swap store and hot-swap each new snapshot.")
        docs = field_docs(cls)  # type: ignore[arg-type]  # a class is hashable (mypy checks the instances' __hash__)
        for f in fields(cls):
            kind = _converter(str(f.type))
            extra: dict[str, Any] = {}
            if isinstance(f.default, Enum):
                extra["choices"] = [m.value for m in type(f.default)]
            help_text = f"{docs.get(f.name, '')} Env: {cls.env_name(f.name)} (default {_shown(f.default)})."
            group.add_argument(
                cls.flag_name(f.name),
                *cls.FLAG_ALIASES.get(f.name, ()),
                dest="delta_swap_" + f.name,
                default=None,
                metavar=f.name.upper(),
                type=str if extra else kind,
                help=help_text.replace("%", "%%"),
                **extra,
            )


def _shown(default: Any) -> str:
    return default.value if isinstance(default, Enum) else str(default)


def _converter(annotation: str) -> Callable[[Any], Any]:
    base = annotation.replace(" | None", "").replace("None | ", "")
    converters: dict[str, Callable[[Any], Any]] = {
        "str": str,
        "float": float,
        "int": int,
        "bool": _boolean,
        "DrainPolicy": DrainPolicy,
        "SwapPath": SwapPath,
        "VerifySwaps": VerifySwaps,
    }
    return converters[base]


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
