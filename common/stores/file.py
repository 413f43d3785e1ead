"""``file://`` store: a folder on a local or shared file system (the embedded default)."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from ..errors import NotFoundError, StoreError
from .base import Store, check_key


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
        return self.root / check_key(key)

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return await asyncio.to_thread(self._get, key, start, end)

    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                if start is None and end is None:
                    return fh.read()
                begin = start or 0
                fh.seek(begin)
                return fh.read(-1 if end is None else max(0, end - begin))
        except FileNotFoundError:
            raise NotFoundError(f"{key} not found in {self.url}") from None
        except OSError as exc:
            raise StoreError(f"cannot read {key} from {self.url}: {exc}") from None

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await asyncio.to_thread(self._put, key, data)

    def _put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            raise StoreError(f"cannot write {key} to {self.url}: {exc}") from None

    async def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    async def list(self, prefix: str) -> list[str]:
        return await asyncio.to_thread(self._list, prefix)

    def _list(self, prefix: str) -> list[str]:
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
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
