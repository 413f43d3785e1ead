"""Hugging Face checkpoint folders: *.safetensors plus the side files a checkpoint needs.

Side files are an allowlist (model and generation config, tokenizer and chat-template files):
nothing that an engine would load as weights or code (``*.safetensors`` outside the snapshot's own
tensors, index files, ``*.bin``/``*.pt``/``*.pkl`` pickles, ``*.py``) is ever published or pulled.
A pull is installed atomically: written to a temporary folder beside ``--out``, which then takes
the place of the previous pull in one rename.
"""

from __future__ import annotations

import ctypes
import glob
import json
import mmap
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import ConfigError, CorruptDataError, NotFoundError
from .manifest import check_relative_name
from .safetensors_io import MAX_HEADER_BYTES, parse_header, read_safetensors, write_safetensors
from .tensors import StateDict, TensorSpecs

#: The only non-tensor files a snapshot carries: configs, tokenizer and chat-template files.
SIDE_FILE_RE = re.compile(
    r"(config|generation_config|tokenizer_config|special_tokens_map|added_tokens|preprocessor_config"
    r"|processor_config|chat_template)\.json|tokenizer\.json|vocab\.(json|txt)|merges\.txt|tokenizer\.model"
    r"|chat_template\.jinja|[A-Za-z0-9_][A-Za-z0-9_.-]*\.tiktoken"
)
INDEX_NAME = "model.safetensors.index.json"
#: Written into every pulled folder; ``pull`` replaces only folders that carry it (or empty ones).
PULL_MARKER = ".delta-swap-pull.json"
MAX_FILE_BYTES = 256 << 20
SHARD_BYTES = 4 << 30


def is_side_file(name: str) -> bool:
    """Whether ``name`` is a file a checkpoint may carry next to its tensors."""
    return SIDE_FILE_RE.fullmatch(name) is not None


def read_checkpoint_dir(path: str | os.PathLike[str]) -> tuple[StateDict, dict[str, bytes]]:
    """Tensors of every ``*.safetensors`` file (memory-mapped) and the side files."""
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
        elif is_side_file(entry.name):
            files[check_relative_name(entry.name, "file")] = _read_side_file(entry)
    if not state:
        raise NotFoundError(f"no *.safetensors files in {root}")
    return state, files


def read_side_files(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """The side files of a checkpoint folder (config, tokenizer...), by name; no tensors read."""
    root = Path(path)
    if not root.is_dir():
        raise NotFoundError(f"checkpoint directory not found: {root}")
    return {
        check_relative_name(entry.name, "file"): _read_side_file(entry)
        for entry in sorted(root.iterdir())
        if entry.is_file() and not entry.name.startswith(".") and is_side_file(entry.name)
    }


def _read_side_file(entry: Path) -> bytes:
    if entry.stat().st_size > MAX_FILE_BYTES:
        raise CorruptDataError(f"{entry.name} is too large for a checkpoint side file")
    return entry.read_bytes()


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
    """Write ``state`` as safetensors (sharded with an index above 4 GiB) plus the side files of
    ``files`` (any other name is refused)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if not is_side_file(check_relative_name(name, "file")):
            raise CorruptDataError(f"{name!r:.80} is not a checkpoint side file")
        (root / name).write_bytes(content)
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(state):
        if groups[-1] and size + state[name].nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += state[name].nbytes
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    written = []
    for fname, group in zip(names, groups):
        with open(root / fname, "wb") as fh:
            write_safetensors(fh, [(n, state[n]) for n in group])
        if progress:
            progress(sum(state[n].nbytes for n in group))
        written.append(root / fname)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in state.values())},
            "weight_map": {n: fname for fname, group in zip(names, groups) for n in group},
        }
        (root / INDEX_NAME).write_text(json.dumps(index, indent=1))
    return written


def install_checkpoint(
    out: str | os.PathLike[str],
    state: StateDict,
    files: dict[str, bytes],
    marker: dict,
    *,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write a checkpoint folder that replaces ``out`` in one step.

    ``out`` must be absent, empty, or an earlier pull (it carries :data:`PULL_MARKER`); anything
    else is refused unless ``force``. The new folder is written beside ``out`` and swapped in
    with one atomic exchange where the kernel has it (two renames elsewhere: a pull killed
    between them is finished by the next one, see :func:`recover_install`).
    """
    target = Path(out).absolute()
    recover_install(target)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{target} exists and is not a folder")
    if target.is_dir() and any(target.iterdir()) and not (target / PULL_MARKER).is_file() and not force:
        raise ConfigError(f"{target} is not empty and is not an earlier pull; pass --force to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.pulling-", dir=target.parent))
    try:
        write_checkpoint_dir(staging, state, files, progress=progress)
        (staging / PULL_MARKER).write_text(json.dumps(marker))
        os.chmod(staging, 0o755)
        if not target.exists():
            os.rename(staging, target)
        elif not _exchange(staging, target):
            old = staging.with_name(staging.name + ".old")
            os.rename(target, old)
            os.rename(staging, target)
            staging = old
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)  # now the previous pull
    return target


def recover_install(out: str | os.PathLike[str]) -> Path | None:
    """Finish a pull that was killed between its two renames (kernels without ``renameat2``).

    Then ``out`` is missing, the new pull (complete: its marker is written last) waits beside it
    in ``.<name>.pulling-*`` and the previous one in ``.<name>.pulling-*.old``. The newest complete
    pull found there takes ``out``'s place, and the previous one it replaced is removed. Returns
    the folder it put in place (None when ``out`` exists or nothing was left over)."""
    target = Path(out).absolute()
    if target.exists() or target.is_symlink() or not target.parent.is_dir():
        return None
    found = []
    for leftover in target.parent.glob(f".{glob.escape(target.name)}.pulling-*"):
        marker = leftover / PULL_MARKER
        if leftover.is_dir() and not leftover.is_symlink() and marker.is_file():
            try:
                pulled_at = float(json.loads(marker.read_text()).get("pulled_at", 0))
            except (OSError, ValueError, AttributeError, TypeError):
                continue
            found.append((leftover.suffix != ".old", pulled_at, leftover))
    if not found:
        return None
    _, _, best = max(found)
    os.rename(best, target)
    if best.suffix != ".old":
        shutil.rmtree(best.with_name(best.name + ".old"), ignore_errors=True)
    return best


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
