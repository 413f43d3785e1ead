"""Weight arenas: a model's tensors in one shared-memory file, laid out as the engine holds them.

An engine that can switch its parameters by reference keeps two arenas: the *live* one it computes
with and a *spare* one. The next snapshot is decoded into the spare arena while the engine keeps
generating; the swap only re-points the engine's parameters to it, so the pause does not grow with
the model, and delta-swap's extra host memory is the one spare copy (the live arena *is* the
engine's weights, and it is what the next delta is decoded against).

The layout comes from the engine: its parameters (*slots*, e.g. a fused ``qkv_proj``) and, for
each checkpoint tensor, where its bytes sit inside a slot (``q_proj`` is the first rows of
``qkv_proj``). Both the process that decodes (the server's subscriber) and the engine's own
processes map the same file, so nothing is copied between them.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .dtypes import dtype_size
from .errors import CorruptDataError, EngineError
from .manifest import load_json
from .staging_files import held, own, owner_gone
from .tensors import HostTensor, StateDict, TensorSpecs

log = logging.getLogger("delta_swap")

#: Every slot starts at a multiple of this, so every view is aligned for any dtype and SIMD.
ALIGN = 64


@dataclass(frozen=True)
class Slot:
    """One engine parameter: its name, dtype, shape and byte offset in the arena."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor lives: a contiguous byte range of a slot."""

    slot: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True)
class ArenaLayout:
    """The engine's parameters (slots) and each checkpoint tensor's place in them."""

    slots: tuple[Slot, ...]
    tensors: dict[str, Placement]

    @property
    def nbytes(self) -> int:
        return max((s.offset + s.nbytes for s in self.slots), default=0)

    @property
    def specs(self) -> TensorSpecs:
        """Name -> (dtype, shape) of every checkpoint tensor the arena holds."""
        return {name: (p.dtype, p.shape) for name, p in self.tensors.items()}

    @classmethod
    def build(
        cls,
        slots: Sequence[tuple[str, str, tuple[int, ...]]],
        tensors: Mapping[str, tuple[str, int, str, tuple[int, ...]]],
    ) -> ArenaLayout:
        """Lay ``slots`` (name, dtype, shape) out back to back, aligned, and place ``tensors``
        (name -> slot, byte offset in the slot, dtype, shape) in them; validated."""
        placed, offset = [], 0
        for name, dtype, shape in slots:
            slot = Slot(name, dtype, tuple(int(d) for d in shape), offset)
            placed.append(slot)
            offset = -(-(offset + slot.nbytes) // ALIGN) * ALIGN
        layout = cls(
            tuple(placed),
            {n: Placement(s, int(o), d, tuple(int(x) for x in sh)) for n, (s, o, d, sh) in tensors.items()},
        )
        layout.validate()
        return layout

    def validate(self) -> None:
        """Raise CorruptDataError unless every placement lies inside its slot, with the slot's
        dtype, and no two placements overlap."""
        slots = {s.name: s for s in self.slots}
        if len(slots) != len(self.slots):
            raise CorruptDataError("arena layout lists a slot twice")
        spans: dict[str, list[tuple[int, int, str]]] = {}
        for name, p in self.tensors.items():
            slot = slots.get(p.slot)
            if slot is None or p.dtype != slot.dtype or p.offset < 0 or p.offset + p.nbytes > slot.nbytes:
                raise CorruptDataError(f"arena layout places {name} outside slot {p.slot}")
            spans.setdefault(p.slot, []).append((p.offset, p.offset + p.nbytes, name))
        for slot_name, ranges in spans.items():
            ranges.sort()
            for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
                if start < end:
                    raise CorruptDataError(f"arena layout overlaps {first} and {second} in {slot_name}")

    def to_json(self) -> str:
        return json.dumps(
            {
                "slots": [[s.name, s.dtype, list(s.shape)] for s in self.slots],
                "tensors": {n: [p.slot, p.offset, p.dtype, list(p.shape)] for n, p in self.tensors.items()},
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ArenaLayout:
        doc = load_json(text, "arena layout")
        try:
            return cls.build(
                [(n, d, tuple(s)) for n, d, s in doc["slots"]],
                {n: (s, o, d, tuple(sh)) for n, (s, o, d, sh) in doc["tensors"].items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptDataError(f"malformed arena layout: {exc!r:.200}") from None


class Arena:
    """One copy of a model in a shared-memory file, mapped read-write into this process."""

    def __init__(self, path: str | os.PathLike[str], layout: ArenaLayout, *, create: bool = False) -> None:
        self.path = Path(path)
        self.layout = layout
        size = max(layout.nbytes, 1)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise EngineError(
                f"cannot {'create' if create else 'open'} weight arena {self.path}: {exc.strerror}"
            ) from None
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)  # fail now, not with SIGBUS later, if tmpfs is full
                except OSError as exc:
                    os.unlink(self.path)
                    raise EngineError(
                        f"no room for a {size}-byte weight arena in {self.path.parent}: {exc.strerror}"
                    ) from None
            elif os.fstat(fd).st_size < size:
                raise CorruptDataError(f"weight arena {self.path} is smaller than its layout")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._owned = own(self.path) if create else None  # deleted at exit, held until closed
        self.buffer = np.frombuffer(self._map, dtype=np.uint8)
        self._slots = {slot.name: slot for slot in layout.slots}

    def tensors(self) -> StateDict:
        """Checkpoint name -> writable HostTensor view into the arena."""
        return {
            name: HostTensor(p.dtype, p.shape, self._view(self._slot(p.slot).offset + p.offset, p.nbytes))
            for name, p in self.layout.tensors.items()
        }

    def slot_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of one slot (an engine parameter)."""
        slot = self._slot(name)
        return self._view(slot.offset, slot.nbytes)

    def holds(self, array: np.ndarray) -> bool:
        """Whether ``array`` is a view into this arena's memory."""
        return bool(array.size) and np.shares_memory(array, self.buffer)

    def _slot(self, name: str) -> Slot:
        return self._slots[name]

    def _view(self, start: int, nbytes: int) -> np.ndarray:
        return self.buffer[start : start + nbytes]

    def close(self, *, unlink: bool = False) -> None:
        """Unmap the file (views must be gone); with ``unlink``, delete it."""
        if self._owned is not None:
            os.close(self._owned)
            self._owned = None
        self.buffer = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:  # views still exported (an engine still computes with them): leave mapped
            pass
        if unlink:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def arena_path(folder: str | os.PathLike[str], name: str) -> Path:
    """The file of arena ``name`` of this process in ``folder``."""
    return Path(folder) / f"delta-swap-arena-{os.getpid()}-{name}"


def file_owner(path: Path) -> int | None:
    """The pid in an arena or layout file's name (``delta-swap-{arena,layout}-<pid>[-...]``), or
    None for a name that carries none."""
    try:
        return int(path.name.split("-")[3].split(".")[0])
    except (ValueError, IndexError):
        return None


def remove_stale_arenas(folder: str | os.PathLike[str]) -> list[Path]:
    """Delete arena, layout and weight-copy files left in ``folder`` by processes that no longer
    run (a killed server): their names carry the owner's pid
    (``delta-swap-{arena,layout,weights}-<pid>[-...]``), and a file its owner still holds
    (:func:`delta_swap.staging_files.hold`: a server in another PID namespace) is kept."""
    removed = []
    stale = [path for kind in ("arena", "layout", "weights") for path in Path(folder).glob(f"delta-swap-{kind}-*")]
    for path in stale:
        pid = file_owner(path)
        if pid is not None and owner_gone(pid) and not held(path):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


class ArenaPair:
    """The two arenas of one engine: the live one it computes with and the spare one the next
    update is decoded into; they trade places at every swap.

    The second arena is made only when the engine first computes from the first one: until then
    the engine's own copy of the weights still exists, and host memory holds two copies, not three.
    Room for both is checked up front, so a full folder means no arenas rather than a failure later.
    """

    def __init__(self, folder: str | os.PathLike[str], layout: ArenaLayout) -> None:
        remove_stale_arenas(folder)
        self.folder = Path(folder)
        self.layout = layout
        room = _free_bytes(self.folder)
        if room < 2 * layout.nbytes:
            raise EngineError(f"no room for two {layout.nbytes}-byte weight arenas in {self.folder}: {room} bytes free")
        self.arenas = [Arena(arena_path(folder, "a"), layout, create=True)]
        self._tensors = [self.arenas[0].tensors()]
        self.live: Arena | None = None  # None until the engine first switches to an arena

    @property
    def spare(self) -> Arena:
        """The arena the engine does not compute with (made on first use after the first swap)."""
        if self.live is None:
            return self.arenas[0]
        if len(self.arenas) == 1:
            self.arenas.append(Arena(arena_path(self.folder, "b"), self.layout, create=True))
            self._tensors.append(self.arenas[1].tensors())
        return self.arenas[1] if self.live is self.arenas[0] else self.arenas[0]

    def spare_tensors(self) -> StateDict:
        """Writable views of the spare arena, by checkpoint name (the first call after the first
        swap allocates the second arena: call it off the event loop)."""
        return self._tensors[self.arenas.index(self.spare)]

    def holding(self, state: Mapping[str, HostTensor]) -> Arena | None:
        """The arena whose memory holds every tensor of ``state`` (None if not one of them)."""
        for arena in self.arenas:
            if state and all(arena.holds(t.data) for t in state.values() if t.nbytes):
                return arena
        return None

    @classmethod
    def open(cls, folder: str | os.PathLike[str], layout_json: str) -> tuple[ArenaPair | None, str | None]:
        """The pair for the layout an engine described (the adapter's side of the arena path), or
        None and why not (no room in ``folder``: the engine's slower path still works)."""
        try:
            pair = cls(folder, ArenaLayout.from_json(layout_json))
        except EngineError as exc:
            log.warning("delta_swap: no weight arenas (%s): updates take the engine's own load path", exc)
            return None, f"no weight arenas: {exc}"
        log.info("delta_swap: swapping by reference between two %.1f MB weight arenas", pair.layout.nbytes / 1e6)
        return pair, None

    def spare_for(self, specs: TensorSpecs) -> StateDict | None:
        """Where an update of ``specs`` is decoded: the spare arena's tensors, or None when the
        update does not have this layout's tensors (off the event loop: see :meth:`spare_tensors`)."""
        return self.spare_tensors() if specs == self.layout.specs else None

    def staged(self, state: Mapping[str, HostTensor], engine: str) -> Arena | None:
        """The arena an update decoded into it lives in (None: the update lives elsewhere, which
        is only possible before the engine first moved into an arena)."""
        arena = self.holding(state)
        if arena is None and self.live is not None:
            raise EngineError(f"{engine}: an update outside the weight arenas after the engine moved into them")
        return arena

    def close(self) -> None:
        for arena in self.arenas:
            arena.close(unlink=True)


def _free_bytes(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize
