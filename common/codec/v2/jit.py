"""numba for codec v2's kernels: where they are cached, and the decorators they are compiled with.

The kernels move bitstream and rANS words as host integers, so only little-endian hosts import
this package. They are compiled once per machine and cached on disk (numba's cache: next to this
package, else the user's cache folder, else a temp folder). numba checks a cached kernel against
its own file only, but these kernels inline helpers and constants from the package's other modules:
here a kernel's cache is valid for one content of the whole package (:func:`sources_digest`).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import numpy as np


def ensure_cache_dir() -> None:
    """numba caches compiled kernels next to this file, else in the user's cache folder; when
    neither is writable (a read-only install under a locked-down user) use a temp folder rather
    than failing at import."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("NUMBA_CACHE_DIR") or os.access(here, os.W_OK):
        return
    user = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "numba")
    try:
        os.makedirs(user, exist_ok=True)
        if os.access(user, os.W_OK):
            return
    except OSError:
        pass
    import numba.core.config

    fallback = os.path.join(tempfile.gettempdir(), f"delta-swap-numba-{os.getuid() if hasattr(os, 'getuid') else 0}")
    os.makedirs(fallback, exist_ok=True)
    numba.core.config.CACHE_DIR = fallback


def sources_digest(folder: Path) -> str:
    """sha256 of every Python file in ``folder`` (names and contents)."""
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _key_caches_on_the_package() -> None:
    """Make numba's cache locators stamp this package's kernels with :func:`sources_digest` as well
    as their own file's time and size, so that changing a helper in another module recompiles the
    kernels that inline it. Without numba's locator classes (another numba) caching stays as it is."""
    try:
        from numba.core.caching import CacheImpl, InTreeCacheLocator, UserProvidedCacheLocator, UserWideCacheLocator
    except ImportError:
        return
    here = Path(__file__).resolve().parent
    digest = sources_digest(here)

    def stamped(base: type) -> type:
        class PackageLocator(base):
            @classmethod
            def from_function(cls, py_func, py_file):
                if Path(py_file).resolve().parent != here:
                    return None
                return super().from_function(py_func, py_file)

            def get_source_stamp(self):
                return super().get_source_stamp(), digest

        PackageLocator.__name__ = PackageLocator.__qualname__ = f"DeltaSwapCodec{base.__name__}"
        return PackageLocator

    if not any(cls.__name__.startswith("DeltaSwapCodec") for cls in CacheImpl._locator_classes):
        CacheImpl._locator_classes[:0] = [
            stamped(cls) for cls in (UserProvidedCacheLocator, InTreeCacheLocator, UserWideCacheLocator)
        ]


if sys.byteorder != "little":  # the kernels move bitstream words and rANS words as host integers
    raise ImportError("delta_swap.codec.v2 needs a little-endian host (x86_64, aarch64)")
ensure_cache_dir()

import numba as nb  # noqa: E402

_key_caches_on_the_package()

#: A kernel: compiled once, cached on disk, without the GIL (a snapshot's tensors decode on threads).
kernel = nb.njit(cache=True, nogil=True)
#: A helper inlined into the kernels that call it.
inline = nb.njit(inline="always", nogil=True)


def readonly(arr: np.ndarray, dtype: type) -> np.ndarray:
    """A read-only view: numba compiles one specialisation per array mutability, so every
    input reaches the kernels read-only (bytes, mmapped files and writable arrays alike) and
    the kernels warm_up compiled are the ones real payloads use."""
    view: np.ndarray = arr.view(dtype)
    view.flags.writeable = False
    return view
