"""A local copy of the last tensors a trainer published, so the next delta needs no rebuild.

A long-lived :class:`~.publisher.Publisher` keeps the previous step in memory; a process per
step (``delta-swap publish``) would have to rebuild the store's head (download and decode the
chain since its base) before it can encode a delta. With a head cache the publisher writes this
rank's tensors to ``<folder>/<store>/<run>/head-rank-R.safetensors`` as it publishes (``<store>``
is a hash of the store's URL), and the next publish uses them as the previous step instead of
rebuilding. Only the newest run of a store keeps a cache: a cache is as large as the model, and a
save deletes the other runs' of the same store. The cache is trusted for nothing: it is used only when it names the
store's head snapshot and every tensor it lends matches the head manifest's dtype, shape and
checksum; anything else (a missing or damaged file, another snapshot, a changed tensor) is said in
the log and the head is rebuilt from the store as without a cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
from pathlib import Path

from .atomic_file import atomic_write
from .checksum import checksum
from .errors import CorruptDataError
from .manifest import Manifest
from .safetensors_io import read_safetensors, write_safetensors
from .tensors import StateDict

log = logging.getLogger("delta_swap.head_cache")

#: The CLI's default folder (``$DELTA_SWAP_HEAD_CACHE``, else ``${DELTA_SWAP_CACHE:-~/.cache/delta-swap}/heads``).
ENV_VAR = "DELTA_SWAP_HEAD_CACHE"


def default_folder() -> Path:
    """Where ``delta-swap publish`` keeps its heads unless told otherwise."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("DELTA_SWAP_CACHE") or str(Path.home() / ".cache" / "delta-swap")
    return Path(base).expanduser() / "heads"


def cache_file(folder: str | os.PathLike[str], store_url: str, run_id: str | None, rank: int) -> Path:
    """The file holding rank ``rank``'s head of run ``run_id`` in the store at ``store_url``."""
    key = hashlib.sha256(store_url.encode()).hexdigest()[:24]
    return Path(folder).expanduser() / key / (run_id or "no-run") / f"head-rank-{rank:05d}.safetensors"


def memory_file(path: Path) -> Path:
    """Where the publisher keeps its encoder's memory (:class:`delta_swap.codec.EncoderMemory`)
    beside the head cache ``path``: the sign models it fitted last, so that the next process's
    fits start from them."""
    return path.with_name(path.name.removesuffix(".safetensors") + ".encoder.npz")


def save(path: Path, state: StateDict, manifest_snapshot_id: str) -> None:
    """Replace the cached head with ``state`` (of snapshot ``manifest_snapshot_id``), atomically."""
    with atomic_write(path, prefix=".tmp-head-") as fh:
        write_safetensors(fh, sorted(state.items()), {"snapshot_id": manifest_snapshot_id})
    for other in path.parent.parent.iterdir():  # other runs of this store: a new run never resumes them
        if other.is_dir() and other != path.parent:
            shutil.rmtree(other, ignore_errors=True)


def load(path: Path, head: Manifest, names: list[str]) -> StateDict | None:
    """The cached tensors of ``names`` that ``head`` holds, each verified against the manifest's
    dtype, shape and checksum; None (with the reason in the log) if any of them is missing or
    differs, or the cache is for another snapshot."""
    try:
        return _load(path, head, names)
    except (OSError, ValueError, CorruptDataError) as exc:
        log.warning(
            "delta-swap: the cached head in %s cannot be used (%s); rebuilding %s from the store",
            path,
            exc,
            head.snapshot_id,
        )
        return None


def _load(path: Path, head: Manifest, names: list[str]) -> StateDict:
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    cached = read_safetensors(mapped)
    snapshot_id = _metadata_snapshot(mapped)
    if snapshot_id != head.snapshot_id:
        raise CorruptDataError(f"it holds {snapshot_id or 'an unnamed snapshot'}, the head is {head.snapshot_id}")
    entries = {t.name: t for t in head.tensors}
    state: StateDict = {}
    for name in names:
        entry = entries.get(name)
        if entry is None:
            continue  # not in the head: a new tensor, published in full as without a cache
        tensor = cached.get(name)
        if tensor is None:
            raise CorruptDataError(f"tensor {name} is missing")
        if (tensor.dtype, tuple(tensor.shape)) != (entry.dtype, tuple(entry.shape)):
            raise CorruptDataError(f"tensor {name} is {tensor.dtype}{list(tensor.shape)}, the head's is different")
        if checksum(tensor.data) != entry.checksum:
            raise CorruptDataError(f"tensor {name} does not match the head's checksum")
        state[name] = tensor
    return state


def _metadata_snapshot(data: bytes | mmap.mmap) -> str | None:
    (hlen,) = struct.unpack_from("<Q", data, 0)
    doc = json.loads(bytes(data[8 : 8 + hlen]))
    meta = doc.get("__metadata__") if isinstance(doc, dict) else None
    value = meta.get("snapshot_id") if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None
