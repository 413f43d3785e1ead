"""The adapter's half of staging, for any engine: the files it hands to the engine's processes,
and the wait until every process has staged what they hold.

An adapter writes an update's tensors (or the tensors a read-back compares with) to a
safetensors file of its own in the staging folder (:func:`staging_file`, :func:`write_tensors`);
the engine's processes read it (:func:`delta_swap.staged_swap.read_staged`) and stage on a thread
of their own; :func:`until_staged` asks them whether they are done until all are, without
blocking the event loop.

Where asking goes through the engine's own loop (vLLM: an RPC to every worker), each question
costs the engine a turn and keeps an idle vLLM worker spinning on its message queue (it busy-waits
for a second after every call), on the cores the build needs. There each process also rings a
*doorbell* when it is done (:func:`ring_doorbell`: a file in a folder of its own, no call into
the engine), and the adapter asks again only when every doorbell rang, or after
:data:`STAGE_ASK_S` (which notices a process that died).
"""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .safetensors_io import write_safetensors
from .tensors import HostTensor

#: How often an adapter asks the engine's processes whether they have staged an update (with
#: doorbells: how often it looks at them).
STAGE_POLL_S = 0.01
#: With doorbells: how often an adapter asks the processes all the same (which notices a process
#: that died). Each question keeps an idle vLLM worker busy-waiting for a second, half of one core
#: beside the build: asked every 10 s, that is a tenth of the build's time at most.
STAGE_ASK_S = 10.0


_exit_lock = threading.Lock()
_removed_at_exit: set[str] = set()
_registered_by = 0  # the process whose exit removes them


def remove_at_exit(path: str | os.PathLike[str]) -> None:
    """Delete ``path`` when this process exits normally. A file in the staging folder (/dev/shm)
    is memory until it is deleted, and an engine's API server may stop without telling its plugins
    (vLLM's does): its weight copies would outlive it. A killed process's files are deleted by the
    next server that starts in the same folder (:func:`delta_swap.arena.remove_stale_arenas`, and
    an update's own files by :func:`remove_stale_transients`).
    A forked child that exits normally leaves them: they are its parent's."""
    global _registered_by
    with _exit_lock:
        if _registered_by != os.getpid():
            _registered_by = os.getpid()
            atexit.register(_remove_files)
        _removed_at_exit.add(str(path))


def _remove_files() -> None:
    with _exit_lock:
        paths = sorted(_removed_at_exit)
        _removed_at_exit.clear()
    for path in paths:
        Path(path).unlink(missing_ok=True)


def _after_fork_in_child() -> None:
    global _exit_lock, _removed_at_exit
    _exit_lock = threading.Lock()  # a thread of the parent may have held it at the fork
    _removed_at_exit = set()  # the parent's files, not this process's to remove


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def hold(path: str | os.PathLike[str]) -> int:
    """An open descriptor of ``path`` holding a shared lock on it until it is closed: the file's
    owner keeps one for the file's life, and :func:`held` then says it is in use whatever process
    asks. (The pid in a staging file's name says nothing to a server in another PID namespace
    sharing the same /dev/shm, as containers run with ``--ipc=host`` do.)"""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        raise
    return fd


def own(path: str | os.PathLike[str]) -> int:
    """Make this process the owner of a file it made in the staging folder: deleted when it exits
    normally (:func:`remove_at_exit`), and held while it runs (:func:`hold`; close the returned
    descriptor when the file is given up)."""
    remove_at_exit(path)
    return hold(path)


def held(path: str | os.PathLike[str]) -> bool:
    """Whether some process holds ``path`` (:func:`hold`)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # and with it the lock this took, if it took one
    return False


def owner_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs here (False when one does, or when that cannot be told: a
    pid this user may not signal, or none the system could have)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def staging_file(staging_dir: str, kind: str, suffix: str = ".safetensors") -> str:
    """A new path in ``staging_dir`` for one file of ``kind`` (``update``, ``check``...), unique to
    this process and call."""
    return os.path.join(staging_dir, f"delta-swap-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}{suffix}")


def write_tensors(path: str, state: Mapping[str, HostTensor], names: Iterable[str]) -> None:
    """Write the tensors ``names`` of ``state`` to the safetensors file ``path``."""
    with open(path, "wb") as fh:
        write_safetensors(fh, [(name, state[name]) for name in names])


@dataclass(frozen=True)
class StagedTensors:
    """Tensors the engine's processes read from a safetensors file: ``names`` of ``path``."""

    path: str
    names: list[str]
    #: Written for this staging (removed with it), not the subscriber's copy of the weights.
    owned: bool

    def remove(self) -> None:
        """Remove the file if it is this staging's own."""
        if self.owned:
            Path(self.path).unlink(missing_ok=True)


def stage_tensors(
    staging_dir: str, kind: str, state_file: str | None, state: Mapping[str, HostTensor], names: Iterable[str]
) -> StagedTensors:
    """The tensors ``names`` of ``state`` in a file the engine's processes can read: the
    subscriber's copy of the weights (``state_file``: it holds them all), else a new file of
    ``kind`` written here."""
    names = sorted(names)
    if state_file is not None:
        return StagedTensors(state_file, names, owned=False)
    path = staging_file(staging_dir, kind)
    write_tensors(path, state, names)
    return StagedTensors(path, names, owned=True)


#: What an update leaves in the staging folder only while it runs (:func:`staging_file` names):
#: tensors handed to the engine's processes (``update-<version>``, ``check``), vLLM's undo record,
#: doorbells (``staged``, folders) and doorbells being removed (``.gone``). The group is the pid.
_TRANSIENT = re.compile(r"delta-swap-(?:update|check|undo|staged)-(?:.*-)?(\d+)-[0-9a-f]{8}(?:\..*)?")
#: A killed server's transient files are removed by the next server in the folder once their
#: owner's pid is not running and they are this old. They are not held (:func:`hold`), so the age
#: stands in for the lock a server in another PID namespace would hold: no update takes an hour.
STALE_TRANSIENT_S = 3600.0


def remove_stale_transients(folder: str | os.PathLike[str], now: float | None = None) -> list[Path]:
    """Delete what killed servers' updates left in ``folder`` (see ``_TRANSIENT``): files and
    doorbell folders whose owner no longer runs and that are :data:`STALE_TRANSIENT_S` old."""
    now = time.time() if now is None else now
    removed = []
    for path in Path(folder).glob("delta-swap-*"):
        match = _TRANSIENT.fullmatch(path.name)
        if match is None:
            continue
        if not owner_gone(int(match.group(1))):
            continue
        try:
            if now - path.lstat().st_mtime < STALE_TRANSIENT_S:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def make_doorbell(staging_dir: str) -> str:
    """A new doorbell: an empty folder of its own in ``staging_dir``, which each process rings by
    leaving a file in it (:func:`ring_doorbell`). Looking at it every :data:`STAGE_POLL_S` lists
    that folder alone, not the staging folder (``/dev/shm`` holds the engines' own files too: a
    thousand names to match at every look, 5% of a core beside the build)."""
    path = staging_file(staging_dir, "staged", ".done")
    os.mkdir(path)
    return path


def ring_doorbell(doorbell: str) -> None:
    """Say that this process is done staging (a file ``<pid>`` in the ``doorbell`` folder; nothing
    if the adapter removed it meanwhile: it stopped waiting)."""
    try:
        Path(doorbell, str(os.getpid())).touch()
    except FileNotFoundError:
        pass


def doorbells_rung(doorbell: str) -> int:
    """How many processes rang ``doorbell`` (:func:`ring_doorbell`)."""
    try:
        return len(os.listdir(doorbell))
    except FileNotFoundError:
        return 0


def remove_doorbells(doorbell: str) -> None:
    """Remove ``doorbell`` and what :func:`ring_doorbell` left in it (moved away first: a process
    ringing meanwhile finds no folder, rather than one that is half removed)."""
    gone = f"{doorbell}.{uuid.uuid4().hex[:8]}.gone"
    try:
        os.rename(doorbell, gone)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)


async def until_staged(
    ask: Callable[[], Awaitable[Sequence[Mapping[str, Any]]]], doorbell: str | None = None
) -> list[Mapping[str, Any]]:
    """Call ``ask`` (every process's :meth:`~delta_swap.staged_swap.StagedSwap.answer`) until every
    answer is ``done``; the last answers. Without a ``doorbell`` it asks every
    :data:`STAGE_POLL_S`; with one, again once every process that answered rang it, or after
    :data:`STAGE_ASK_S`."""
    while True:
        answers = list(await ask())
        if answers and all(a["done"] for a in answers):
            return answers
        if doorbell is None:
            await asyncio.sleep(STAGE_POLL_S)
            continue
        deadline = time.monotonic() + STAGE_ASK_S
        while time.monotonic() < deadline and doorbells_rung(doorbell) < len(answers):
            await asyncio.sleep(STAGE_POLL_S)
