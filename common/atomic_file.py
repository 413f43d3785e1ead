"""Files replaced whole or not at all: written to a temporary file in the target's folder, then
renamed over the target (``os.replace``), so a reader sees the old content or the new, never a
torn one, and a failed write leaves no temporary file behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, cast


@contextlib.contextmanager
def atomic_write(path: Path, *, prefix: str = ".tmp-") -> Iterator[BinaryIO]:
    """Yield a binary file open for writing that replaces ``path`` when the block ends without an
    exception; the folder is made if missing. ``prefix`` names the temporary file, so that
    listings of the folder can skip it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield cast(BinaryIO, fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
