"""Finding the checkpoint folders a trainer writes, in step order, once each is complete.

Trainers that save checkpoints write one folder per step under one parent: ``checkpoint-500``
(transformers' Trainer and TRL), ``step_500``, ``global_step_500``, ``iter_0000500``. A folder
counts once it holds ``*.safetensors`` and none of its files has changed for ``settle_s`` seconds
(a trainer writes its files one after the other; a folder renamed into place is complete at once).
A folder that settled but does not read (a trainer that stopped half way) is retried once a file
in it changes again.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

#: A checkpoint folder's name and the step it holds.
STEP_FOLDER_RE = re.compile(r"(?:checkpoint|step|global_step|iter)[-_]?0*(\d+)")


@dataclass(frozen=True)
class CheckpointFolder:
    """A complete checkpoint folder, its step, and when a file in it last changed."""

    step: int
    path: Path
    changed: float = 0.0


def step_of(name: str) -> int | None:
    """The step a checkpoint folder's name holds (``checkpoint-500`` -> 500), else None."""
    match = STEP_FOLDER_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def ready_checkpoints(
    parent: Path, after: int | None, settle_s: float, now: float | None = None
) -> list[CheckpointFolder]:
    """The complete checkpoint folders of ``parent`` for steps after ``after``, oldest step first.
    A folder still being written (a file changed within ``settle_s``) and every later one wait:
    steps are published in order."""
    now = time.time() if now is None else now
    found = []
    for entry in parent.iterdir() if parent.is_dir() else ():
        step = step_of(entry.name)
        if step is not None and entry.is_dir() and (after is None or step > after):
            found.append(CheckpointFolder(step, entry))
    ready = []
    for folder in sorted(found, key=lambda f: f.step):
        changed = _settled(folder.path, settle_s, now)
        if changed is None:
            break
        ready.append(CheckpointFolder(folder.step, folder.path, changed))
    return ready


def _settled(folder: Path, settle_s: float, now: float) -> float | None:
    """When a file of ``folder`` last changed, if it holds safetensors and that was at least
    ``settle_s`` seconds ago; else None."""
    try:
        files = [p for p in folder.iterdir() if p.is_file()]
        newest = max((p.stat().st_mtime for p in files), default=None)
    except FileNotFoundError:  # a file or the folder went away while being listed
        return None
    if newest is None or not any(p.suffix == ".safetensors" for p in files) or now - newest < settle_s:
        return None
    return newest
