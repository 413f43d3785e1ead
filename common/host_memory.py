"""Giving host memory back to the system once it is no longer needed (Linux; a no-op elsewhere)."""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (clean file pages are simply dropped)


def release_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``): tensors freed from
    the heap rather than from their own mappings otherwise stay counted in the process's memory."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def page_out_library(name_part: str) -> int:
    """Drop this process's resident pages of the read-only mappings of the shared libraries whose
    path contains ``name_part``, and return how many bytes were advised.

    Only clean, file-backed pages are touched (code and read-only data), so nothing is lost: a page
    needed again is read back from the file. Meant for code that ran once, such as LLVM after
    numba's kernels are loaded (~75 MB of ``libllvmlite.so`` stays resident otherwise)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        with open("/proc/self/maps") as fh:
            lines = fh.readlines()
    except (OSError, AttributeError):  # not Linux
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or name_part not in fields[5] or "w" in fields[1]:
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if madvise(start, end - start, _MADV_PAGEOUT) != 0:
            log.debug("madvise(MADV_PAGEOUT) on %s failed: errno %d", fields[5], ctypes.get_errno())
            return advised  # an older kernel: nothing more to gain
        advised += end - start
    return advised
