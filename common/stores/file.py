"""``file://`` store: a folder on a local or shared file system (the embedded default).

Keys are relative paths below the root. Reads refuse anything that is not a regular file (a
FIFO, a device) and any path whose symlinks lead outside the root, and never read more than the
reader allows. Writes go through a temp file and ``os.replace``; conditional writes (HEAD) hold
an exclusive ``flock`` on a lock file in the root while they compare and replace.
"""

from __future__ import annotations

import asyncio
import builtins
import fcntl
import os
import stat
from pathlib import Path

from ..atomic_file import atomic_write
from ..errors import NotFoundError, StoreError
from .base import Store, check_key, check_size, content_tag

_LOCK_NAME = ".delta-swap.lock"


class FileStore(Store):
    """Keys are relative paths below ``root``; writes go through a temp file and ``os.replace``."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        self.root = Path(root).resolve()
        self.url = self.root.as_uri()
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise NotFoundError(f"store not found: {self.root}")

    def _path(self, key: str) -> Path:
        path = self.root / check_key(key)
        real = os.path.realpath(path)
        if real != str(self.root) and not real.startswith(str(self.root) + os.sep):
            raise StoreError(f"{key} in {self.public_url} is a link that leaves the store")
        return path

    async def get(
        self, key: str, start: int | None = None, end: int | None = None, *, max_bytes: int | None = None
    ) -> bytes:
        return await asyncio.to_thread(self._get, key, start, end, max_bytes)

    def _get(self, key: str, start: int | None, end: int | None, max_bytes: int | None) -> bytes:
        path = self._path(key)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused just below.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            if not self.root.is_dir():  # an unmounted share or a deleted folder is not an empty store
                raise StoreError(f"the store folder {self.public_url} is missing") from None
            raise NotFoundError(f"{key} not found in {self.public_url}") from None
        except OSError as exc:
            raise StoreError(f"cannot read {key} from {self.public_url}: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as fh:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise StoreError(f"{key} in {self.public_url} is not a regular file")
            begin = start or 0
            stop = info.st_size if end is None else end
            check_size(key, max(0, stop - begin), max_bytes)
            try:
                fh.seek(begin)
                data = fh.read(max(0, stop - begin))
            except OSError as exc:
                raise StoreError(f"cannot read {key} from {self.public_url}: {exc.strerror}") from None
        return data

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await asyncio.to_thread(self._put, key, data)

    def _put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        try:
            with atomic_write(path, prefix=".tmp-") as fh:
                fh.write(data)
        except OSError as exc:
            raise StoreError(f"cannot write {key} to {self.public_url}: {exc.strerror}") from None

    async def put_if(self, key: str, data: bytes | memoryview, etag: str | None) -> bool:
        return await asyncio.to_thread(self._put_if, key, data, etag)

    def _put_if(self, key: str, data: bytes | memoryview, etag: str | None) -> bool:
        with open(self.root / _LOCK_NAME, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                current = content_tag(self._get(key, None, None, None))
            except NotFoundError:
                current = None
            if current != etag:
                return False
            self._put(key, data)
            return True

    async def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    async def list(self, prefix: str) -> list[str]:
        return await asyncio.to_thread(self._list, prefix)

    def _list(self, prefix: str) -> builtins.list[str]:  # `list` names the method above in this class
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root / folder
        if not base.is_dir():
            return []
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                if not name.startswith(".") and key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        for folder in path.parents:  # folders left empty go too, as keys in a bucket would
            if folder == self.root or self.root not in folder.parents:
                break
            try:
                folder.rmdir()
            except OSError:
                break
