"""Giving host memory back to the system once it is no longer needed, or keeping it for the next
update where that is asked for (Linux and glibc; a no-op elsewhere)."""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (clean file pages are simply dropped)
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: Allocators that keep freed memory on their own when preloaded (vLLM's CPU platform preloads the
#: tcmalloc its wheels bundle into its engine processes); glibc's mallopt does not reach them.
_OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")

_keeping = False
_why_not: str | None = None  # why keep_freed_memory could not, once asked


def release_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``): tensors freed from
    the heap rather than from their own mappings otherwise stay counted in the process's memory.
    Nothing after :func:`keep_freed_memory`: the next update reuses those pages."""
    if _keeping:
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def keep_freed_memory() -> str | None:
    """Make this process keep the memory it frees for its next allocations: glibc's malloc then
    takes every block from its heap (none on a mapping of its own, which ``free`` would unmap at
    once) and never trims the heap, and :func:`release_free_heap` does nothing. An update's new
    weights then land on pages the last update freed, already mapped, instead of pages the kernel
    must fault in and zero one by one; the process holds its peak between updates. Returns why it
    cannot (None: done): not glibc, or another allocator preloaded (which keeps freed memory itself)."""
    global _keeping, _why_not
    _why_not = _keep_or_why_not()
    _keeping = _why_not is None
    return _why_not


def _other_allocator() -> str | None:
    """The allocator of :data:`_OTHER_ALLOCATORS` this process has loaded, if any (its maps: the
    environment's LD_PRELOAD may name one that only the children load)."""
    try:
        with open("/proc/self/maps") as fh:
            libraries = {fields[5] for fields in map(str.split, fh) if len(fields) >= 6}
    except OSError:
        libraries = set(os.environ.get("LD_PRELOAD", "").replace(":", " ").split())
    return next((name for name in _OTHER_ALLOCATORS if any(name in lib for lib in libraries)), None)


def freed_memory() -> str:
    """What this process does with the memory it frees (for a server's status)."""
    if _keeping:
        return "kept for the next update"
    return f"given back to the system ({_why_not})" if _why_not else "given back to the system"


def _keep_or_why_not() -> str | None:
    other = _other_allocator()
    if other is not None:
        return f"{other} is loaded (LD_PRELOAD): it keeps freed memory itself"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "the C library is not glibc (no mallopt)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, -1)):  # -1: never trim (mallopt(3))
        return "glibc refused mallopt(M_MMAP_MAX, 0) or mallopt(M_TRIM_THRESHOLD, -1)"
    return None


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
