"""Why a page-out test could not see pages go: what this host's kernel and its other processes allow.

``MADV_PAGEOUT`` drops a clean file page only where no other process maps it (Linux 5.4+), and
some kernels (sandboxes, older versions) accept the call and drop nothing. A test that measures a
page-out asks :func:`why_pages_stay` whether the host could have paged out at all, so it fails
only where the code under test is at fault.
"""

from __future__ import annotations

import ctypes
import os
import tempfile

import numpy as np

_MADV_PAGEOUT = 21


def _resident_kb(path: str) -> int:
    """Resident kB of this process's mappings of ``path``."""
    kb, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) > 5 and head[5] == path
            elif inside and head[0] == "Rss:":
                kb += int(head[1])
    return kb


def kernel_pages_out_private_file_mappings() -> bool:
    """Whether ``MADV_PAGEOUT`` drops the pages of a file mapping that only this process maps."""
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/var/tmp"), suffix=".probe") as fh:
        fh.write(os.urandom(8 << 20))
        fh.flush()
        view = np.memmap(fh.name, dtype=np.uint8, mode="r")
        int(view[::4096].sum())  # fault every page in
        before = _resident_kb(fh.name)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        refused = libc.madvise(view.ctypes.data & ~4095, view.nbytes, _MADV_PAGEOUT) != 0
        after = _resident_kb(fh.name)
        del view
    return not refused and before > 4096 and after < before / 4


def other_processes_mapping(name_part: str) -> list[str]:
    """``pid (command)`` of every other process that maps a file whose path contains ``name_part``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/maps") as fh:
                if not any(name_part in line for line in fh):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                command = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
        except OSError:  # gone, or not ours to read
            continue
        found.append(f"{pid} ({command})")
    return found


def why_pages_stay(name_part: str) -> str | None:
    """Why this host cannot page out a shared library's pages right now (None: it can)."""
    if not kernel_pages_out_private_file_mappings():
        return "this kernel does not page out file mappings on MADV_PAGEOUT (checked on a private 8 MB file)"
    others = other_processes_mapping(name_part)
    if others:
        return f"{len(others)} other process(es) map {name_part}, so its pages stay resident: {', '.join(others[:4])}"
    return None
