"""Publishing from a sharded trainer: every rank publishes a share of the tensors, whole.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) or any trainer whose parameters are DTensors,
each rank holds a slice of every parameter. Each tensor in turn goes to the rank with the fewest
elements so far (the first such rank on a tie), so the ranks' shares, and so their encode times,
come out within one tensor of each other whatever the order of the large ones (round robin put the
embeddings and the output head on the same rank); for each tensor in turn, every rank takes part in one gather (``DTensor.full_tensor``) and only its owner
keeps the result, so a rank never holds more than one whole tensor beyond its share. Each rank
then publishes its share with ``PublisherConfig(rank=..., world_size=...)``, and the last rank to
finish commits the snapshot (see :mod:`delta_swap.commit`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any


def full_tensor(tensor: Any) -> Any:
    """``tensor`` detached and whole: a DTensor is gathered (every rank must take part)."""
    value = tensor.detach()
    return value.full_tensor() if hasattr(value, "full_tensor") else value


class Share:
    """Collects this rank's share of a stream of (name, tensor), fed in the same order on every rank.

    A tensor is this rank's when this rank had the fewest elements of the stream so far
    (:func:`least_loaded`: every rank computes the same owners from the same stream), or, with
    ``held``, when its name is in ``held`` (a trainer that knows which tensors it holds).
    Every tensor is materialized (a collective for a DTensor); only its owner keeps it, detached,
    on the host and cast to ``dtype`` when floating (one dtype, or a mapping of name to dtype).
    An error in keeping a tensor is raised by :meth:`result`, after the stream: a rank that
    stopped half way would leave the others waiting in their next collective."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        dtype: Any = None,
        *,
        materialize: Callable[[Any], Any] = full_tensor,
        held: Collection[str] | None = None,
    ) -> None:
        self.rank, self.world_size, self.dtype = rank, world_size, dtype
        self.materialize = materialize
        self.held = set(held) if held is not None else None
        #: This rank's tensors so far, by name.
        self.tensors: dict[str, Any] = {}
        #: Every name of the stream so far, in order (every rank sees them all).
        self.names: list[str] = []
        #: Elements of the stream each rank owns so far.
        self.loads = [0] * world_size
        self.error: BaseException | None = None

    def add(self, name: str, tensor: Any) -> None:
        """Take the next (name, tensor) of the stream (None: a tensor this source does not hold)."""
        self.names.append(name)
        if tensor is None:
            return
        owner = least_loaded(self.loads, _elements(tensor)) if self.held is None else None
        value = self.materialize(tensor)
        mine = name in self.held if self.held is not None else owner == self.rank
        if not mine or self.error is not None:
            return
        try:
            dtype = self.dtype.get(name) if isinstance(self.dtype, Mapping) else self.dtype
            cast = dtype if dtype is not None and value.is_floating_point() else None
            self.tensors[name] = value.detach().to(device="cpu", dtype=cast)
        except Exception as exc:  # noqa: BLE001 - raised by result(), once every collective ran
            self.error = exc

    def result(self) -> dict[str, Any]:
        """This rank's tensors; raises the first error in keeping one."""
        if self.error is not None:
            raise self.error
        return self.tensors


def _elements(tensor: Any) -> int:
    """Elements of a tensor (a DTensor's whole shape), a numpy array or anything with a shape."""
    return int(tensor.numel()) if hasattr(tensor, "numel") else int(tensor.size)


def least_loaded(loads: list[int], elements: int) -> int:
    """The rank that owns the next tensor of ``elements`` elements: the one with the fewest so far
    (the first on a tie); its load grows by ``elements``."""
    owner = loads.index(min(loads))
    loads[owner] += elements
    return owner


def balanced_share(
    pairs: Iterable[tuple[str, Any]], rank: int, world_size: int, dtype: Any = None, **options: Any
) -> dict[str, Any]:
    """This rank's share of ``pairs`` (see :class:`Share`, which takes ``options``)."""
    share = Share(rank, world_size, dtype, **options)
    for name, tensor in pairs:
        share.add(name, tensor)
    return share.result()


def owned_tensors(named: Iterable[tuple[str, Any]], rank: int, world_size: int, dtype: Any = None) -> dict[str, Any]:
    """This rank's share of ``named`` (name, tensor or DTensor) as whole local tensors (cast to
    ``dtype`` if given), dealt in name order to the least loaded rank (:func:`least_loaded`).
    Collective: every rank must call it with the same names in any order."""
    out = {}
    loads = [0] * world_size
    for name, tensor in sorted(named, key=lambda item: item[0]):
        owner = least_loaded(loads, _elements(tensor))
        value = full_tensor(tensor)
        if owner == rank:
            out[name] = value.to(dtype) if dtype is not None else value.clone()
    return out
