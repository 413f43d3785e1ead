"""The subscriber's copy of the served weights, for engines that keep none it can share.

Where the engine computes from weights of its own (repacked for a kernel, on a device, or loaded
by its own loader), the core still needs the served weights on the host: the next delta is decoded
against them. Kept in the heap, an update then held three copies of what it changes at its peak:
the previous weights (for a rollback), the decoded new ones, and the file of changed tensors the
engine's processes read (vLLM's workers, SGLang's schedulers). A :class:`HostCopy` is one
safetensors file in the staging folder holding every tensor, mapped writable by the subscriber:
each snapshot is decoded into it in place, and the engine's processes read an update's tensors
straight from it (mapped, so nothing is copied between processes). The previous weights are not
kept: a swap the engine takes back itself needs none, and a rollback that does rebuilds them from
the store (:func:`delta_swap.swap.apply_update`'s ``restore``).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from .arena import remove_stale_arenas
from .safetensors_io import specs_header
from .staging_files import own, remove_stale_transients, staging_file
from .tensors import HostTensor, StateDict, TensorSpecs

#: The file kind in the staging folder: ``delta-swap-weights-<pid>-<tag>.safetensors``.
KIND = "weights"


class HostCopy:
    """Every tensor of a model in one safetensors file in the staging folder, mapped writable."""

    def __init__(self, path: str, specs: TensorSpecs, mapping: mmap.mmap, state: StateDict) -> None:
        self.path, self.specs, self._mapping = path, specs, mapping
        self._owned: int | None = None  # the descriptor that holds the file (staging_files.own)
        #: Writable views of every tensor, by checkpoint name (what snapshots are decoded into).
        self.state = state

    @classmethod
    def create(cls, staging_dir: str, specs: TensorSpecs) -> HostCopy:
        """A new copy for tensors of ``specs`` (its bytes reserved up front); raises OSError when
        the staging folder has no room (a write into a tmpfs file past its room would kill the
        process with SIGBUS, not raise)."""
        names = sorted(specs)
        header, locations = specs_header((name, *specs[name]) for name in names)
        size = max([len(header), *(offset + length for offset, length in locations.values())])
        remove_stale_arenas(staging_dir)  # copies left by killed servers hold memory in /dev/shm
        remove_stale_transients(staging_dir)  # and so do their updates' files
        path = staging_file(staging_dir, KIND)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, max(size, 1))
            else:  # pragma: no cover - not Linux: a sparse file
                os.ftruncate(fd, max(size, 1))
            os.pwrite(fd, header, 0)
            mapping = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            Path(path).unlink(missing_ok=True)
            raise
        os.close(fd)
        raw = np.frombuffer(mapping, dtype=np.uint8)
        state = {
            name: HostTensor(specs[name][0], tuple(specs[name][1]), raw[offset : offset + length])
            for name, (offset, length) in locations.items()
        }
        copy = cls(path, dict(specs), mapping, state)
        copy._owned = own(path)  # deleted at exit, held until closed
        return copy

    def holds(self, specs: TensorSpecs) -> bool:
        """Whether this copy has a place of the right dtype and shape for exactly ``specs``."""
        return {n: (d, tuple(s)) for n, (d, s) in specs.items()} == {
            n: (d, tuple(s)) for n, (d, s) in self.specs.items()
        }

    def close(self) -> None:
        """Remove the file; its memory goes when the last view of it does."""
        Path(self.path).unlink(missing_ok=True)
        if self._owned is not None:
            os.close(self._owned)
            self._owned = None
        self.state = {}
        try:
            self._mapping.close()
        except BufferError:  # views still held elsewhere keep the mapping alive until they go
            pass
