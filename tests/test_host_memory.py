"""Keeping freed memory for the next update (``Settings.keep_freed_memory``), and giving it back
otherwise: glibc's malloc in a process of its own per case (its settings are per process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from delta_swap import host_memory

#: One allocation of an update's size, far above glibc's threshold for a mapping of its own.
CYCLE = r"""
import ctypes, json, resource, sys
from delta_swap import host_memory

kept = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else "not asked"
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = 64 << 20


def resident():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def cycle():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)  # every page touched, as a tensor's fill does
    held = resident()
    libc.free(block)
    host_memory.release_free_heap()  # what the end of a swap does
    return held


held = cycle()
after_free = resident()
cycle()  # the heap settles: Python's own small blocks may take the start of the freed space
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
cycle()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(json.dumps({"kept": kept, "status": host_memory.freed_memory(), "released": held - after_free, "faults": faults}))
"""


def run_cycle(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CYCLE, mode], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc: Linux only")
def test_kept_memory_is_reused_without_faults_and_default_memory_goes_back() -> None:
    default, kept = run_cycle("default"), run_cycle("keep")
    size, page = 64 << 20, 4096
    # by default a freed update goes back to the system at once, and the next one faults in again
    assert default["released"] >= size // 2, default
    assert default["status"] == "given back to the system", default
    # kept: it stays mapped, and a later update of its size lands on it without faulting
    assert kept["kept"] is None and kept["status"] == "kept for the next update", kept
    assert kept["released"] < size // 8, kept
    assert kept["faults"] < size // page // 8, kept


def test_another_allocator_is_left_to_keep_memory_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "_other_allocator", lambda: "tcmalloc")
    monkeypatch.setattr(host_memory, "_keeping", False)
    monkeypatch.setattr(host_memory, "_why_not", None)
    why = host_memory.keep_freed_memory()
    assert why is not None and "tcmalloc" in why
    assert host_memory.freed_memory() == f"given back to the system ({why})"
    assert not host_memory._keeping  # so release_free_heap still trims glibc's own heap
