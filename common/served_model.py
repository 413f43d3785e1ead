"""The model a server runs, as delta-swap checks snapshots against it before touching the engine."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .checkpoint_dir import read_tensor_specs
from .dtypes import dtype_size
from .errors import IncompatibleSnapshotError
from .tensors import TensorSpecs


@dataclass(frozen=True)
class ServedModel:
    """The checkpoint folder a server was started from and the tensors its engine accepts."""

    #: Where the engine loaded its weights from (None when it was not a local folder).
    checkpoint_dir: str | None
    specs: TensorSpecs

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str]) -> ServedModel:
        """Read the tensor specs of a local checkpoint folder (headers only); an unknown
        layout (a hub id, no safetensors) gives empty specs, which accept any snapshot."""
        folder = os.fspath(path)
        return cls(folder, read_tensor_specs(folder)) if os.path.isdir(folder) else cls(None, {})

    @property
    def nbytes(self) -> int:
        """Bytes of every served tensor."""
        return sum(math.prod(shape) * dtype_size(dtype) for dtype, shape in self.specs.values())

    def check_fits(self, specs: Mapping[str, tuple[str, tuple[int, ...]]], *, complete: bool = True) -> None:
        """Raise IncompatibleSnapshotError unless every tensor of ``specs`` is served with the same
        dtype and shape and, when ``complete``, every served tensor is in ``specs``: an engine would
        fail half way through loading anything else, or keep tensors of another version for names
        a snapshot lacks. Empty served specs (unknown layout) accept anything."""
        if not self.specs:
            return
        problems = [f"{name}: missing from the snapshot" for name in self.specs if complete and name not in specs]
        for name, (dtype, shape) in specs.items():
            want = self.specs.get(name)
            if want is None:
                problems.append(f"{name}: not in the served model")
            elif (dtype, tuple(shape)) != (want[0], tuple(want[1])):
                problems.append(f"{name}: {dtype}{list(shape)}, served {want[0]}{list(want[1])}")
        if problems:
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            raise IncompatibleSnapshotError("snapshot does not fit the served model: " + "; ".join(problems[:3]) + more)
