"""What an encoder keeps of each tensor from one step to the next, in memory or in a file."""

from __future__ import annotations

import copy
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic_file import atomic_write
from ..errors import CorruptDataError

#: One tensor's share of an :class:`EncoderMemory`, as :func:`delta_swap.codec.encode_tensor_delta`
#: takes it (codec v2 keeps the sign model it fitted, per part of the tensor).
TensorMemory = dict[int, Any]
_FORMAT = 1


class EncoderMemory:
    """Per tensor name, what the encoder kept from the step it encoded last: pass
    ``memory.tensor(name)`` to :func:`~delta_swap.codec.encode_tensor_delta` (or
    :func:`~delta_swap.codec.encode_part`) at every step, and codec v2's sign-model fit starts
    from the last step's model instead of a new SVD (benchmarks/README.md, "Encoder levels").

    It only makes the encoder faster: payloads decode the same with or without it. Different
    tensors may be encoded on different threads at once. A process per step (``delta-swap
    publish``) keeps it in a file beside its head cache (:meth:`save`, :meth:`load`)."""

    def __init__(self) -> None:
        self._tensors: dict[str, TensorMemory] = {}

    def tensor(self, name: str) -> TensorMemory:
        """Tensor ``name``'s memory (empty the first time)."""
        return self._tensors.setdefault(name, {})

    def __len__(self) -> int:
        return len(self._tensors)

    def copy(self) -> EncoderMemory:
        """A copy that later encodes with this memory do not change."""
        other = EncoderMemory()
        other._tensors = {
            name: {start: copy.copy(kept) for start, kept in parts.items()} for name, parts in self._tensors.items()
        }
        return other

    def clear(self) -> None:
        """Forget every tensor (the next step fits from scratch)."""
        self._tensors.clear()

    def save(self, path: Path) -> None:
        """Write the sign models (and which parts skip their next fits) to ``path`` (an ``.npz`` of uint8 arrays and a JSON index), atomically."""
        entries: list[list[Any]] = []
        idle: list[list[Any]] = []  # parts with no model and fits still to skip (sign_model.IDLE_FITS)
        arrays: dict[str, np.ndarray] = {}
        for name, parts in sorted(self._tensors.items()):
            for start, kept in sorted(parts.items()):
                model = getattr(kept, "model", None)
                if model is None:
                    if getattr(kept, "idle_fits", 0) > 0:
                        idle.append([name, start, kept.idle_fits])
                    continue
                i = len(entries)
                entries.append([name, start, kept.warm_fits, model.rank, model.bits])
                arrays.update({f"l{i}": model.levels, f"r{i}": model.row_codes, f"c{i}": model.col_codes})
        index = json.dumps({"format": _FORMAT, "entries": entries, "idle": idle}).encode()
        buf = io.BytesIO()
        arrays["index"] = np.frombuffer(index, np.uint8)
        np.savez(buf, *(), **arrays)  # type: ignore[arg-type]  # numpy's stub reads ** as allow_pickle
        with atomic_write(path, prefix=".tmp-memory-") as fh:
            fh.write(buf.getbuffer())

    @classmethod
    def load(cls, path: Path) -> EncoderMemory:
        """The memory :meth:`save` wrote to ``path``; CorruptDataError if it is not one (each model
        is checked as :meth:`SignModel.checked <delta_swap.codec.v2.sign_model.SignModel.checked>`
        does), OSError if it cannot be read."""
        from .v2.sign_model import IDLE_FITS, FitMemory, SignModel

        memory = cls()
        try:
            with np.load(path, allow_pickle=False) as arrays:
                index = json.loads(arrays["index"].tobytes())
                if not isinstance(index, dict) or index.get("format") != _FORMAT:
                    raise ValueError("not an encoder memory of this version")
                for i, (name, start, warm_fits, rank, bits) in enumerate(index["entries"]):
                    if not isinstance(name, str) or not all(type(x) is int for x in (start, warm_fits, rank, bits)):
                        raise ValueError(f"entry {i} is malformed")
                    model = SignModel.checked(rank, bits, arrays[f"l{i}"], arrays[f"r{i}"], arrays[f"c{i}"])
                    memory.tensor(name)[start] = FitMemory(model, max(0, warm_fits))
                for i, (name, start, idle_fits) in enumerate(index.get("idle", [])):  # absent before IDLE_FITS
                    if not isinstance(name, str) or not all(type(x) is int for x in (start, idle_fits)):
                        raise ValueError(f"idle entry {i} is malformed")
                    memory.tensor(name)[start] = FitMemory(idle_fits=min(max(0, idle_fits), IDLE_FITS))
        except (ValueError, KeyError, TypeError, AttributeError, EOFError, zipfile.BadZipFile) as exc:
            raise CorruptDataError(f"{path} is not an encoder memory: {exc}") from exc
        return memory
