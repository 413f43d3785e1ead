"""Hugging Face checkpoint folders: *.safetensors plus config/tokenizer files."""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from pathlib import Path

from .errors import CorruptDataError, NotFoundError
from .manifest import check_relative_name
from .safetensors_io import MAX_HEADER_BYTES, parse_header, read_safetensors, write_safetensors
from .tensors import StateDict, TensorSpecs

#: Never read: pickled weights can execute code, and their tensors are in the safetensors files.
_SKIPPED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
INDEX_NAME = "model.safetensors.index.json"
MAX_FILE_BYTES = 256 << 20
SHARD_BYTES = 4 << 30


def read_checkpoint_dir(path: str | os.PathLike[str]) -> tuple[StateDict, dict[str, bytes]]:
    """Tensors of every ``*.safetensors`` file (memory-mapped) and the other small files."""
    root = Path(path)
    if not root.is_dir():
        raise NotFoundError(f"checkpoint directory not found: {root}")
    state: StateDict = {}
    files: dict[str, bytes] = {}
    for entry in sorted(root.iterdir()):
        if not entry.is_file() or entry.name.startswith("."):
            continue
        if entry.suffix == ".safetensors":
            with open(entry, "rb") as fh:
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if entry.stat().st_size else b""
            for name, tensor in read_safetensors(mapped).items():
                if name in state:
                    raise CorruptDataError(f"tensor {name} appears in two safetensors files")
                state[name] = tensor
        elif entry.name != INDEX_NAME and not entry.name.endswith(_SKIPPED_SUFFIXES):
            if entry.stat().st_size > MAX_FILE_BYTES:
                raise CorruptDataError(f"{entry.name} is too large for a checkpoint side file")
            files[check_relative_name(entry.name, "file")] = entry.read_bytes()
    if not state:
        raise NotFoundError(f"no *.safetensors files in {root}")
    return state, files


def read_tensor_specs(path: str | os.PathLike[str]) -> TensorSpecs:
    """Name -> (dtype, shape) of every tensor in a folder's ``*.safetensors`` (headers only)."""
    specs: TensorSpecs = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with open(file, "rb") as fh:
            head = fh.read(8)
            prefix = head + fh.read(min(int.from_bytes(head, "little"), MAX_HEADER_BYTES))
        for name, (dtype, shape, _, _) in parse_header(prefix, file.stat().st_size).items():
            specs[name] = (dtype, shape)
    return specs


def write_checkpoint_dir(
    path: str | os.PathLike[str],
    state: StateDict,
    files: dict[str, bytes],
    *,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write ``state`` as safetensors (sharded with an index above 4 GiB) plus ``files``."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (root / check_relative_name(name, "file")).write_bytes(content)
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(state):
        if groups[-1] and size + state[name].nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += state[name].nbytes
    names = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))
    ]
    written = []
    for fname, group in zip(names, groups):
        with open(root / fname, "wb") as fh:
            write_safetensors(fh, [(n, state[n]) for n in group])
        if progress:
            progress(sum(state[n].nbytes for n in group))
        written.append(root / fname)
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())},
                 "weight_map": {n: fname for fname, group in zip(names, groups) for n in group}}
        (root / INDEX_NAME).write_text(json.dumps(index, indent=1))
    return written
