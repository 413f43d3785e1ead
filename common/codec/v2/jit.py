"""numba for codec v2's kernels: where they are cached, and the decorators they are compiled with.

The kernels move bitstream and rANS words as host integers, so only little-endian hosts import
this package. They are compiled once per machine and cached on disk (numba's cache: next to this
package, else the user's cache folder, else a temp folder).
"""

from __future__ import annotations

import os
import sys
import tempfile

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


if sys.byteorder != "little":  # the kernels move bitstream words and rANS words as host integers
    raise ImportError("delta_swap.codec.v2 needs a little-endian host (x86_64, aarch64)")
ensure_cache_dir()

import numba as nb  # noqa: E402

#: A kernel: compiled once, cached on disk, without the GIL (a snapshot's tensors decode on threads).
kernel = nb.njit(cache=True, nogil=True)
#: A helper inlined into the kernels that call it.
inline = nb.njit(inline="always", nogil=True)


def readonly(arr: np.ndarray, dtype: type) -> np.ndarray:
    """A read-only view: numba compiles one specialisation per array mutability, so every
    input reaches the kernels read-only (bytes, mmapped files and writable arrays alike) and
    the kernels warm_up compiled are the ones real payloads use."""
    view = arr.view(dtype)
    view.flags.writeable = False
    return view
