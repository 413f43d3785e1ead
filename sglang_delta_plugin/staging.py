"""Pack tensors for SGLang's ``update_weights_from_tensor``.

Any exception raised while SGLang's scheduler loads weights ends the whole server, so nothing
reaches it before every name, shape and dtype matches the checkpoint the server was started
from (the core checks that) and every staged byte matches its checksum (checked here). Tensors travel as one ``flattened_bucket``:
a single shared-memory buffer (passed to the scheduler as a file descriptor, no copy through
the socket) plus SGLang's own metadata records, which its safe unpickler accepts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from delta_swap.checksum import verify
from delta_swap.dtypes import to_torch_dtype
from delta_swap.errors import IncompatibleSnapshotError
from delta_swap.served_model import ServedModel
from delta_swap.staging_files import StagedTensors
from delta_swap.tensors import HostTensor

#: Each tensor starts at a multiple of this in the bucket, so SGLang's ``.view(dtype)`` is aligned.
ALIGN = 64


def served_model(model_path: str) -> ServedModel:
    """The checkpoint the server was started from and the tensors in it."""
    path = Path(model_path)
    if not path.is_dir():
        from huggingface_hub import snapshot_download  # a hub id: use the copy SGLang loaded

        path = Path(snapshot_download(model_path, allow_patterns=["*.safetensors"], local_files_only=True))
    served = ServedModel.from_checkpoint(path)
    if not served.specs:
        raise IncompatibleSnapshotError(f"no *.safetensors in {path}: delta-swap needs safetensors checkpoints")
    return served


@dataclass
class Bucket:
    """Tensors packed in one shared-memory buffer, ready for ``update_weights_from_tensor``."""

    #: One MultiprocessingSerializer payload of {"flattened_tensor", "metadata"} per tensor-parallel
    #: rank, as SGLang expects (each rank deserializes, and so receives the descriptor, once).
    payloads: list[bytes]
    nbytes: int
    #: The tensors the read-back after the load compares with (None: not read back).
    check: StagedTensors | None = None


def pack(
    state: Mapping[str, HostTensor], names: Sequence[str], checksums: Mapping[str, str] | None = None, ranks: int = 1
) -> Bucket:
    """Copy the ``names`` tensors of ``state`` (already checked against the served model) into one
    shared-memory buffer and verify the copied bytes against ``checksums`` (name -> "xxh3_128:..."),
    if given."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    spans, total = [], 0
    for name in names:
        spans.append((total, total + state[name].nbytes))
        total = -(-(total + state[name].nbytes) // ALIGN) * ALIGN
    flat = torch.empty(max(total, 1), dtype=torch.uint8).share_memory_()
    view = flat.numpy()
    metadata = []
    for name, (start, end) in zip(names, spans):
        tensor = state[name]
        view[start:end] = tensor.data
        if checksums is not None:
            verify(view[start:end], checksums[name], f"staged tensor {name}")
        metadata.append(
            FlattenedTensorMetadata(
                name=name,
                shape=torch.Size(tensor.shape),
                dtype=to_torch_dtype(tensor.dtype),
                start_idx=start,
                end_idx=end,
                numel=end - start,
            )
        )
    bucket = {"flattened_tensor": flat, "metadata": metadata}
    return Bucket([MultiprocessingSerializer.serialize(bucket) for _ in range(ranks)], total)
