"""verl's checkpoint-engine registry with delta-swap underneath: the ``delta_swap`` backend.

verl 0.9 picks how weights reach the rollout servers by name, from its registry
(``verl.checkpoint_engine.CheckpointEngineRegistry``). Where its own engines push tensors over
NCCL, NIXL or Mooncake, this one publishes each step to a store (a full base every ``base_every``
steps, lossless deltas in between, signed with ``signing_key``) and the servers, started with the
delta-swap plugin, pull, verify and swap it themselves. In verl's config::

    actor_rollout_ref:
      rollout:
        free_cache_engine: false          # the servers keep their weights; the store feeds them
        checkpoint_engine:
          backend: delta_swap
          custom_backend_module: delta_swap.integrations.verl
          engine_kwargs:
            delta_swap:
              store_url: s3://rl-snapshots/run-42
              base_every: 25
              signing_key: /secrets/trainer.key
              model_path: /models/Qwen2.5-7B     # the checkpoint the servers started from
              server_urls: [http://rollout-0:8000]
              max_staleness: 0

On the actor side (verl's ``update_weights``), every rank calls :meth:`send_weights` with verl's
per-tensor generator and drains it (an FSDP rank's gathers are collectives); each rank keeps its
share (round robin), encodes and uploads it, and the last rank to finish commits the snapshot
(:mod:`delta_swap.commit`). With ``max_staleness`` k and ``server_urls``, rank 0 returns once every
server serves step - k or later (k=0: verl's synchronous contract, the servers run the new weights
when the sync returns). A step at or below the last one published (verl syncs again after a
validation or a resume) is drained and not published again.

On the rollout side the engine carries no tensors: it speaks verl's ``delta_flush`` wire format
and :meth:`receive_weights` yields nothing, which verl's vLLM and SGLang adapters read as "weights
unchanged here, only advance the step tag" (verl's vLLM adapter refuses ``delta_flush`` where CUDA
IPC is missing, before it reads the stream). There is no process group (``build_topology`` and
``init_process_group`` are empty), so trainer and servers need no network path to each other.

The verl series it supports is pinned in :mod:`.versions`; importing it under another fails with one
line.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..errors import ConfigError
from .versions import check_version

check_version("verl")  # before verl's API is touched: an unsupported verl fails here, in one line

import torch  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry  # noqa: E402

from ..checkpoint_dir import read_side_files  # noqa: E402
from ..publisher import Publisher, PublisherConfig  # noqa: E402
from .servers import wait_for_servers  # noqa: E402
from .sharded import Share  # noqa: E402

log = logging.getLogger("delta_swap")

#: The backend name in verl's registry (``checkpoint_engine.backend``).
BACKEND_NAME = "delta_swap"


@dataclasses.dataclass(frozen=True)
class VerlEngineOptions:
    """``engine_kwargs.delta_swap`` of verl's checkpoint-engine config (see the module docstring)."""

    #: The store every server follows: ``file://``, ``s3://`` (or a plain folder path).
    store_url: str
    #: A full base every this many steps, lossless deltas in between.
    base_every: int = 25
    #: The private key file that signs every manifest (servers trust its ``.pub``).
    signing_key: str | None = None
    #: The Hugging Face folder the servers started from: its config and tokenizer travel with every
    #: base, and its config says whether ``lm_head.weight`` is tied (then not published: verl's
    #: generator yields it, a checkpoint does not hold it).
    model_path: str | None = None
    #: Cast floating tensors to this dtype before publishing (what the servers run); None keeps them.
    dtype: str | None = "bfloat16"
    #: Servers (base URLs) to notify after each commit and, with ``max_staleness``, to wait for.
    server_urls: tuple[str, ...] = ()
    #: With k: rank 0's ``send_weights`` for step s returns once every server serves s-k or later.
    max_staleness: int | None = 0
    #: How long that wait may take before raising TimeoutError.
    wait_timeout_s: float = 300.0
    #: The token the servers' admin routes want (notify), if any.
    admin_token: str | None = None
    #: Other :class:`delta_swap.PublisherConfig` fields (``keep_bases``, ``run_id``, ``encode_threads``...).
    publisher_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> VerlEngineOptions:
        """Options from verl's ``engine_kwargs`` (an OmegaConf mapping or a dict); unknown keys
        raise ConfigError naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"engine_kwargs.{BACKEND_NAME}: unknown {', '.join(unknown)}; known: {sorted(names)}")
        if "store_url" not in kwargs:
            raise ConfigError(f"engine_kwargs.{BACKEND_NAME}.store_url is required")
        values = {k: _plain(v) for k, v in kwargs.items()}
        if isinstance(values.get("server_urls"), str):
            values["server_urls"] = (values["server_urls"],)
        values["server_urls"] = tuple(u.rstrip("/") for u in values.get("server_urls", ()))
        return cls(**values)


@CheckpointEngineRegistry.register(BACKEND_NAME)
class DeltaSwapCheckpointEngine(CheckpointEngine):
    """Publishes each step to a store; the servers follow the store (see the module docstring)."""

    #: verl's adapters read an empty ``delta_flush`` stream as "nothing to load, advance the step".
    wire_format = "delta_flush"

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.bucket_size = bucket_size  # verl's bucket for tensors in flight; unused: none fly here
        self.is_master = is_master
        self.options = VerlEngineOptions.from_kwargs(engine_kwargs)
        self._dtype = getattr(torch, self.options.dtype) if self.options.dtype else None
        self._tied = _tied_output_names(self.options.model_path)
        #: This rank's publisher, opened by the first :meth:`send_weights` (the actor side only).
        self.publisher: Publisher | None = None
        #: The step the last :meth:`send_weights` published (None before the first).
        self.last_step: int | None = None
        #: The names this rank published at that step (its share).
        self.last_names: list[str] = []

    # ------------------------------------------------------------------ no process group

    def prepare(self) -> dict[str, Any]:
        """Nothing to allocate or advertise: the store is the only meeting point."""
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No topology: trainer and servers never connect to each other."""
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """No process group to join."""

    def finalize(self) -> None:
        """Nothing to free between steps: the publisher lives until the process exits."""

    # ------------------------------------------------------------------ actor side

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Publish verl's (name, tensor) generator as ``global_steps`` (default: the step after the
        last). Every rank drains the generator; each publishes its share. Returns verl metrics."""
        started = time.monotonic()
        rank, world_size = _rank_and_world()
        step = global_steps if global_steps is not None else (0 if self.last_step is None else self.last_step + 1)
        share = await _share_of(weights, Share(rank, world_size, self._dtype))
        for name in self._tied:
            share.pop(name, None)
        if self.last_step is not None and step <= self.last_step:
            log.info("delta-swap: step %d is already published (last %d); not again", step, self.last_step)
            return {
                "delta_swap/step": self.last_step,
                "delta_swap/send_s": time.monotonic() - started,
                "delta_swap/wait_s": 0.0,
            }
        publisher = self._publisher(rank, world_size)
        await asyncio.to_thread(publisher.publish, step, share)
        self.last_step, self.last_names = step, sorted(share)
        waited = 0.0
        if rank == 0 and self.options.max_staleness is not None and self.options.server_urls:
            waited_from = time.monotonic()
            await asyncio.to_thread(self.wait_for_servers, step - self.options.max_staleness)
            waited = time.monotonic() - waited_from
        return {"delta_swap/step": step, "delta_swap/send_s": time.monotonic() - started, "delta_swap/wait_s": waited}

    def _publisher(self, rank: int, world_size: int) -> Publisher:
        if self.publisher is None:
            options = self.options
            config = PublisherConfig(
                base_every=options.base_every,
                rank=rank,
                world_size=world_size,
                signing_key=options.signing_key,
                notify_urls=tuple(f"{u}/delta_swap/notify" for u in options.server_urls),
                notify_token=options.admin_token,
            )
            try:
                config = dataclasses.replace(config, **dict(options.publisher_options))
            except TypeError as exc:
                raise ConfigError(f"engine_kwargs.{BACKEND_NAME}.publisher_options: {exc}") from None
            self.publisher = Publisher(
                options.store_url, config, files=read_side_files(options.model_path) if options.model_path else {}
            )
            atexit.register(self.publisher.close)  # verl never closes an engine: the last step still lands
        return self.publisher

    def flush(self) -> None:
        """Wait until every step this rank sent is committed (or its part uploaded); raise if one failed."""
        if self.publisher is not None:
            self.publisher.flush()

    def wait_for_servers(self, step: int) -> None:
        """Wait until every server in ``server_urls`` serves ``step`` or a later one; TimeoutError
        (or the publish error that kept the step from the store) otherwise."""
        options = self.options
        wait_for_servers(options.server_urls, step, options.wait_timeout_s, before_timeout=self.flush)

    # ------------------------------------------------------------------ rollout side

    def receive_weights(self, global_steps: int | None = None) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
        """Nothing travels through verl: the servers take the step from the store themselves. An
        empty plain iterator, as verl's own delta engine returns (its SGLang adapter iterates the
        flushes with ``for``, its vLLM adapter through ``ensure_async_iterator``)."""
        return iter(())


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and world size (0 and 1 outside ``torch.distributed``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


async def _share_of(weights: Any, share: Share) -> dict[str, Any]:
    """Feed verl's weights (a sync or async iterable of (name, tensor), or a mapping) to ``share``,
    to the end (every rank drains them: an FSDP rank's gathers are collectives)."""
    if isinstance(weights, Mapping):
        weights = weights.items()
    if hasattr(weights, "__aiter__"):
        async for name, tensor in weights:
            share.add(name, tensor)
    elif isinstance(weights, Iterable):
        for name, tensor in weights:
            share.add(name, tensor)
    else:
        raise ConfigError(f"send_weights takes (name, tensor) pairs, not {type(weights).__name__}")
    return share.tensors


def _tied_output_names(model_path: str | None) -> tuple[str, ...]:
    """``lm_head.weight`` when the model folder's config ties it to the input embeddings."""
    if not model_path:
        return ()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ("lm_head.weight",) if getattr(text_config, "tie_word_embeddings", False) else ()


def _plain(value: Any) -> Any:
    """An OmegaConf list or mapping as a tuple or dict (verl passes its config nodes as they are)."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        return value
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return tuple(_plain(v) for v in value)
