"""verl's checkpoint-engine registry with delta-swap underneath: the ``delta_swap`` backend.

verl 0.9 picks how weights leave its trainer by name, from its registry
(``verl.checkpoint_engine.CheckpointEngineRegistry``). Where its own engines push tensors over
NCCL, NIXL or Mooncake, this one publishes each step to a store (a full base every ``base_every``
steps, lossless deltas in between, signed with ``signing_key``), and servers started with the
delta-swap plugin pull, verify and swap it themselves. In verl's config::

    actor_rollout_ref:
      rollout:
        checkpoint_engine:
          backend: delta_swap
          custom_backend_module: delta_swap.integrations.verl
          engine_kwargs:
            delta_swap:
              store_url: s3://rl-snapshots/run-42
              model_path: /models/Qwen2.5-7B     # the checkpoint the servers started from
              base_every: 25
              signing_key: /secrets/trainer.key
              server_urls: [http://rollout-0:8000]
              max_staleness: 0

On the actor side (verl's ``update_weights``), every rank calls :meth:`send_weights` with verl's
per-tensor generator and drains it (an FSDP rank's gathers are collectives); each rank keeps its
share (balanced by elements) on the host, in the dtype the checkpoint at ``model_path`` holds each tensor
in, encodes and uploads it, and the last rank to finish commits the snapshot
(:mod:`delta_swap.commit`). Names the checkpoint does not hold fail on the trainer, except the
tied ``lm_head.weight`` verl's generator yields for a model whose config ties it, which is left
out as ``save_pretrained`` leaves it out. ``finalize`` (after every sync) waits until the step is
committed, so a sync that returns has landed in the store; with ``server_urls`` and
``max_staleness`` k, rank 0's sync also waits until every server serves step - k or later.

A step is published once: verl syncs again at the same step (after a validation), or with no
step at all, and a restarted trainer syncs the step it resumed from, which the store already
holds; each is drained and not published again. A store whose head is past the step asked for
(another run's) is refused with one line.

On the rollout side the engine carries no tensors: it speaks verl's ``delta_flush`` wire format
and :meth:`receive_weights` yields nothing, which verl's vLLM and SGLang adapters read as "weights
unchanged here, only advance the step tag" (verl's vLLM adapter refuses ``delta_flush`` where CUDA
IPC is missing, before it reads the stream). There is no process group (``build_topology`` and
``init_process_group`` are empty), so trainer and servers need no network path to each other.
verl 0.9.1 runs its own rollout servers on vLLM 0.24 or SGLang 0.5.12, which the delta-swap
plugins do not support (they pin vLLM 0.32 and SGLang 0.5.23), so the servers that follow the
store are delta-swap servers outside verl's rollout.

The verl series it supports is pinned in :mod:`.versions`; importing it under another fails with one
line.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .versions import check_version

check_version("verl")  # before verl's API is touched: an unsupported verl fails here, in one line

import torch  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry  # noqa: E402

from ..chain import head_step_at  # noqa: E402
from ..checkpoint_dir import read_side_files, read_tensor_specs  # noqa: E402
from ..dtypes import to_torch_dtype  # noqa: E402
from ..publisher import Publisher, PublisherConfig  # noqa: E402
from .servers import notify_urls, wait_for_servers  # noqa: E402
from .sharded import Share  # noqa: E402

log = logging.getLogger("delta_swap")

#: The backend name in verl's registry (``checkpoint_engine.backend``).
BACKEND_NAME = "delta_swap"


@dataclasses.dataclass(frozen=True)
class VerlEngineOptions:
    """``engine_kwargs.delta_swap`` of verl's checkpoint-engine config (see the module docstring)."""

    #: The store every server follows: ``file://``, ``s3://`` (or a plain folder path).
    store_url: str
    #: The Hugging Face folder the servers started from (``actor_rollout_ref.model.path``): its
    #: tensors' names and dtypes are what each step publishes, its config and tokenizer travel
    #: with every base, and its config says whether ``lm_head.weight`` is tied.
    model_path: str
    #: A full base every this many steps, lossless deltas in between.
    base_every: int = 25
    #: The private key file that signs every manifest (servers trust its ``.pub``).
    signing_key: str | None = None
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
        for required in ("store_url", "model_path"):
            if not kwargs.get(required):
                raise ConfigError(f"engine_kwargs.{BACKEND_NAME}.{required} is required")
        if not Path(kwargs["model_path"]).is_dir():
            raise ConfigError(f"engine_kwargs.{BACKEND_NAME}.model_path: {kwargs['model_path']} is not a folder")
        values = {k: _plain(v) for k, v in kwargs.items()}
        urls = values.get("server_urls") or ()
        values["server_urls"] = tuple(u.rstrip("/") for u in ((urls,) if isinstance(urls, str) else urls))
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
        #: The checkpoint's tensors (name -> (dtype, shape)), their torch dtypes and the tied names:
        #: read by the first
        #: :meth:`send_weights` (the actor side only).
        self._specs: dict[str, tuple[str, tuple[int, ...]]] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self._tied: tuple[str, ...] = ()
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
        """After every sync: wait until this rank's step is committed (or its part uploaded), and
        raise if it failed. The publisher itself lives on to the next sync."""
        self.flush()

    # ------------------------------------------------------------------ actor side

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Publish verl's (name, tensor) generator as ``global_steps``. Every rank drains the
        generator and publishes its share; a step already published (or None: verl's sync after a
        validation) is drained and not published again. Returns verl metrics on rank 0."""
        started = time.monotonic()
        rank, world_size = _rank_and_world()
        if self._specs is None:
            self._specs = read_tensor_specs(self.options.model_path)
            self._dtypes = {name: to_torch_dtype(dtype) for name, (dtype, _) in self._specs.items()}
            self._tied = _tied_output_names(self.options.model_path)
        share = Share(rank, world_size, self._dtypes)
        await _drain(weights, share)
        _check_same_stream(share.names, world_size)  # before anything one rank alone may raise
        tensors = self._checkpoint_share(share)
        publisher = self._publisher(rank, world_size)
        if self.last_step is None:  # a restarted trainer: what has the store got already?
            self.last_step = await head_step_at(self.options.store_url, publisher.trusted)
        step = global_steps if global_steps is not None else (self.last_step if self.last_step is not None else 0)
        waited = 0.0
        if self.last_step is not None and step < self.last_step:
            raise ConfigError(
                f"the store {self.options.store_url} already holds step {self.last_step}, past step {step}: "
                "resume from that step's checkpoint, or publish this run to a store of its own"
            )
        if step == self.last_step:
            log.info("delta-swap: step %d is already published; not again", step)
        else:
            await asyncio.to_thread(publisher.publish, step, tensors)
            self.last_step, self.last_names = step, sorted(tensors)
            if rank == 0 and self.options.max_staleness is not None and self.options.server_urls:
                waited_from = time.monotonic()
                await asyncio.to_thread(self.wait_for_servers, step - self.options.max_staleness)
                waited = time.monotonic() - waited_from
        if rank != 0:
            return {}  # verl merges every rank's metrics into one dict: rank 0's count
        return {"delta_swap/step": step, "delta_swap/send_s": time.monotonic() - started, "delta_swap/wait_s": waited}

    def _checkpoint_share(self, share: Share) -> dict[str, Any]:
        """This rank's tensors, checked against the checkpoint's names and shapes (every rank saw
        every name, so every rank raises alike), the tied head left out."""
        tensors = share.result()
        specs = self._specs or {}
        seen = set(share.names)
        unknown = sorted(seen - set(specs) - set(self._tied))
        missing = sorted(set(specs) - seen)
        if unknown or missing:
            raise ConfigError(
                f"verl's weights do not match the checkpoint at {self.options.model_path}: "
                + "; ".join(
                    f"{what} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                    for what, names in (("not in the checkpoint:", unknown), ("not sent:", missing))
                    if names
                )
                + " (merge LoRA adapters before syncing: model.lora.merge)"
            )
        for name, tensor in tensors.items():
            if name in specs and tuple(tensor.shape) != tuple(specs[name][1]):
                raise ConfigError(f"{name}: shape {list(tensor.shape)}, the checkpoint's {list(specs[name][1])}")
        return {name: tensor for name, tensor in tensors.items() if name in specs}

    def _publisher(self, rank: int, world_size: int) -> Publisher:
        if self.publisher is None:
            options = self.options
            config = PublisherConfig(
                base_every=options.base_every,
                rank=rank,
                world_size=world_size,
                signing_key=options.signing_key,
                notify_urls=notify_urls(options.server_urls),
                notify_token=options.admin_token,
            ).with_fields(options.publisher_options, f"engine_kwargs.{BACKEND_NAME}.publisher_options")
            self.publisher = Publisher(options.store_url, config, files=read_side_files(options.model_path))
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


async def _drain(weights: Any, share: Share) -> None:
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


def _check_same_stream(names: list[str], world_size: int) -> None:
    """Raise ConfigError on every rank unless every rank drained the same names in the same order
    (the shares assume it). Collective."""
    if world_size == 1:
        return
    import hashlib

    import torch.distributed as dist

    digests: list[Any] = [None] * world_size
    dist.all_gather_object(digests, hashlib.sha256("\n".join(names).encode()).hexdigest())
    if len(set(digests)) > 1:
        raise ConfigError(
            f"verl's ranks yielded different tensor names or orders ({len(set(digests))} different streams "
            f"among {world_size} ranks): every rank must iterate the same weights in the same order"
        )


def _tied_output_names(model_path: str) -> tuple[str, ...]:
    """``lm_head.weight`` when the model folder's config (or its text config) ties it to the input
    embeddings (transformers' default for a config that does not say)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    text = config.get("text_config") or {}
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
    return ("lm_head.weight",) if tied else ()


def _plain(value: Any) -> Any:
    """An OmegaConf list or mapping as a tuple or dict (verl passes its config nodes as they are)."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        return value
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return tuple(_plain(v) for v in value)
