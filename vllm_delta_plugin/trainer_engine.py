"""vLLM's trainer-side weight-transfer API with delta-swap underneath: the ``delta_swap`` trainer engine.

A loop written for vLLM's native API changes only the init info (and the backend it names)::

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
    from vllm_delta_plugin.trainer_engine import DeltaSwapTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        DeltaSwapTrainerInitInfo("s3://rl-snapshots/run-42", base_every=25, signing_key="trainer.key", rank=rank),
        client=HTTPVLLMWeightSyncClient("http://rollout-0:8000"),
        source=ModuleSource(model),
    )
    for step in range(steps):
        ...                      # rollouts, loss, optimizer step
        engine.send_weights()    # publishes the next step; every server pulls it from the store
    engine.shutdown()

Where vLLM's own backends push tensors to the servers (NCCL, CUDA IPC), this engine publishes each
step to a store through :class:`delta_swap.Publisher` (a full base every ``base_every`` steps,
lossless deltas in between, signed with ``signing_key``), and the servers, started with the plugin
(``VLLM_PLUGINS=delta_swap``, ``DELTA_SWAP_STORE``), pull, verify and swap it themselves. So the
client's weight-update RPCs are never called; its ``base_url`` (and ``server_urls``) name servers to
notify after each commit (best effort: they also poll) and, with ``max_staleness``, to wait for.

Multi-rank trainers call ``trainer_init`` and ``send_weights`` on every rank, as with vLLM's
engines; every rank iterates the source in the same order (FSDP's ``full_tensor`` gathers are
collectives) and keeps only its own share (the least loaded rank in the source's order, or the names its
source holds), which it encodes and uploads itself: no rank gathers the model. The last rank to
finish commits the snapshot (:mod:`delta_swap.commit`).

The engine is registered with ``WeightTransferTrainerFactory`` under ``delta_swap`` by the plugin's
entry point (:func:`vllm_delta_plugin.plugin.register`, run wherever vLLM loads its general plugins,
e.g. ``vllm.plugins.load_general_plugins()``) and on importing this module, which a trainer does for
:class:`DeltaSwapTrainerInitInfo` anyway. The vLLM versions it supports are pinned in
:mod:`delta_swap.integrations.versions`; on others, importing it fails with one line.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from delta_swap.integrations.versions import check_vllm_version

check_vllm_version()  # before vLLM's API is touched: an unsupported vLLM fails here, in one line

import torch  # noqa: E402
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    materialize_full_tensor,
)

from delta_swap.checkpoint_dir import read_side_files  # noqa: E402
from delta_swap.errors import ConfigError  # noqa: E402
from delta_swap.integrations.servers import notify_urls, served_steps, wait_for_servers  # noqa: E402
from delta_swap.integrations.sharded import balanced_share  # noqa: E402
from delta_swap.publisher import Publisher, PublisherConfig  # noqa: E402

# The trainer engine's name in ``WeightTransferTrainerFactory`` is the worker backend's: vLLM keeps
# the trainer and worker registries apart, and backends share names by convention.
from .plugin import BACKEND_NAME  # noqa: E402

log = logging.getLogger("vllm_delta_plugin")


@dataclass
class DeltaSwapTrainerInitInfo(TrainerInitInfo):
    """Where and how the ``delta_swap`` trainer engine publishes (``rank``: this trainer process's rank).

    ``signing_key`` and ``admin_token`` default to ``$DELTA_SWAP_SIGNING_KEY`` and
    ``$DELTA_SWAP_ADMIN_TOKEN``, as :class:`delta_swap.PublisherConfig` reads them."""

    backend: ClassVar[str] = BACKEND_NAME

    #: The store every server follows: ``file://``, ``s3://`` (or a plain folder path).
    store_url: str
    #: A full base every this many steps, lossless deltas in between.
    base_every: int = 25
    #: The private key file that signs every manifest (servers trust its ``.pub``).
    signing_key: str | None = None
    #: Trainer ranks that publish a share each (``rank`` is this one).
    world_size: int = 1
    #: The step the first ``send_weights()`` publishes when it is given none; each next one is the
    #: step after the last (a store that already holds this run's later steps refuses it).
    first_step: int = 0
    #: Cast floating tensors to this dtype before publishing (what the servers run); None keeps them.
    dtype: str | None = "bfloat16"
    #: Servers (base URLs) to notify and wait for, besides the client's ``base_url``.
    server_urls: tuple[str, ...] = ()
    #: POST each server's ``/delta_swap/notify`` after each commit (servers also poll the store).
    notify: bool = True
    #: The token the servers' admin routes want (notify), if any.
    admin_token: str | None = None
    #: With k: ``send_weights`` for step s returns once every server serves step s-k or later (on
    #: rank 0; k=0 is vLLM's own contract: the servers run the new weights when it returns). None:
    #: it returns as soon as the step is queued (encoding and upload run in the background).
    max_staleness: int | None = None
    #: How long ``send_weights`` waits for the servers before raising TimeoutError.
    wait_timeout_s: float = 300.0
    #: A model folder whose side files (config, tokenizer) travel with every base, so that a
    #: snapshot is a loadable checkpoint (``delta-swap pull``).
    files_from: str | None = None
    #: Other :class:`delta_swap.PublisherConfig` fields (``keep_bases``, ``run_id``, ``max_pending``...).
    publisher_options: dict[str, Any] = field(default_factory=dict)


class DeltaSwapTrainerEngine(TrainerWeightTransferEngine[DeltaSwapTrainerInitInfo]):
    """Publishes each step to a store; the servers follow the store (see the module docstring)."""

    init_info_cls = DeltaSwapTrainerInitInfo

    def __init__(
        self,
        init_info: DeltaSwapTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient | None = None,
        source: WeightSource | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)  # type: ignore[arg-type]
        self.init_info = init_info
        base_url = getattr(client, "base_url", None)
        #: The servers this engine notifies and waits for (the client's, then ``server_urls``).
        self.server_urls: tuple[str, ...] = tuple(
            dict.fromkeys(u.rstrip("/") for u in ([base_url] if base_url else []) + list(init_info.server_urls))
        )
        config = PublisherConfig(
            base_every=init_info.base_every,
            rank=init_info.rank,
            world_size=init_info.world_size,
            signing_key=init_info.signing_key,
            notify_urls=notify_urls(self.server_urls) if init_info.notify else (),
            notify_token=init_info.admin_token,
        ).with_fields(init_info.publisher_options)
        #: The publisher of this rank (its ``last_manifest`` is the newest snapshot it committed).
        self.publisher = Publisher(
            init_info.store_url, config, files=read_side_files(init_info.files_from) if init_info.files_from else {}
        )
        self._dtype = getattr(torch, init_info.dtype) if init_info.dtype else None
        #: The step the last ``send_weights`` published (None before the first).
        self.last_step: int | None = None
        #: The names this rank published at the last step (its share).
        self.last_names: list[str] = []

    @classmethod
    def trainer_init(
        cls,
        init_info: DeltaSwapTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient | None = None,
        source: WeightSource | None = None,
    ) -> DeltaSwapTrainerEngine:
        """Open the store on this rank; no rendezvous (the servers need no handshake: they follow
        the store), so every rank returns at once."""
        if not isinstance(init_info, DeltaSwapTrainerInitInfo):
            raise ConfigError(f"the {BACKEND_NAME} trainer engine takes a DeltaSwapTrainerInitInfo")
        return cls(init_info, client=client, source=source)

    def send_weights(
        self,
        weights: Iterable[tuple[str, Any]] | Mapping[str, Any] | None = None,
        *,
        step: int | None = None,
        module: Any = None,
    ) -> None:
        """Publish ``weights`` (default: the source given at ``trainer_init``) as ``step`` (default:
        the step after the last). Called on every rank with the same (name, tensor) sequence in
        the same order; each rank publishes its share. ``module``: the transformers model the
        weights come from, so that they travel under its checkpoint names (a ``ModuleSource``
        says so itself). Returns once the step is queued, or with ``max_staleness`` once the
        servers serve a recent enough step (on rank 0)."""
        pairs: Any = weights if weights is not None else self.source
        if pairs is None:
            raise ConfigError("send_weights needs weights, or a source given to trainer_init")
        if isinstance(pairs, Mapping):
            pairs = pairs.items()
        step = (
            step if step is not None else (self.init_info.first_step if self.last_step is None else self.last_step + 1)
        )
        held = pairs.held_names() if isinstance(pairs, WeightSource) else None
        share = self._share(pairs, held)
        model = module if module is not None else getattr(pairs, "_module", None)  # a ModuleSource's model
        from delta_swap.integrations.hf_names import checkpoint_tensors, is_transformers_model

        if model is not None and is_transformers_model(model):
            share = checkpoint_tensors(model, share.items())
        self.publisher.publish(step, share)
        self.last_step, self.last_names = step, sorted(share)
        if self.is_sender and self.init_info.max_staleness is not None and self.server_urls:
            self.wait_for_servers(step - self.init_info.max_staleness, self.init_info.wait_timeout_s)

    def _share(self, pairs: Iterable[tuple[str, Any]], held: Collection[str] | None) -> dict[str, Any]:
        """This rank's tensors of ``pairs``: every tensor is materialized in turn (a collective for
        a DTensor) and kept only by its owner, cast to the serving dtype."""
        rank, world = self.init_info.rank, self.init_info.world_size
        return balanced_share(pairs, rank, world, self._dtype, materialize=materialize_full_tensor, held=held)

    def flush(self) -> None:
        """Wait until every step this rank sent is committed (or its part uploaded); raise if one failed."""
        self.publisher.flush()

    def served_steps(self) -> list[int | None]:
        """The step each server serves now (``/delta_swap/status``; None: nothing yet or unreachable)."""
        return served_steps(self.server_urls)

    def wait_for_servers(self, step: int, timeout_s: float = 300.0) -> None:
        """Wait until every server serves ``step`` or a later one; TimeoutError (or the publish
        error that kept the step from the store) otherwise."""
        wait_for_servers(self.server_urls, step, timeout_s, before_timeout=self.publisher.flush)

    def shutdown(self) -> None:
        """Flush and stop this rank's publisher (raises if a step failed to publish)."""
        self.publisher.close()


def register_trainer_engine() -> None:
    """Register the ``delta_swap`` trainer engine (lazily, by module path; idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND_NAME not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND_NAME, __name__, DeltaSwapTrainerEngine.__name__)


register_trainer_engine()
