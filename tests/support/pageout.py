"""Why a page-out test could not see pages go: what this host's kernel and its other processes allow.

``MADV_PAGEOUT`` drops a clean file page only where no other process maps it (Linux 5.4+), and
some kernels (sandboxes, older versions, some filesystems or large folios) accept the call and drop
nothing. A test that measures a page-out asks :func:`why_pages_stay` whether the host could have
paged out at all (a fresh process loading the library the same way and paging it out itself),
so it fails only where the code under test is at fault. The probes call
``madvise`` themselves, never the code under test, so a page-out the code forgets still fails.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile

import numpy as np

_MADV_PAGEOUT = 21
_PAGE = 4096


def _madvise_pageout(start: int, length: int) -> bool:
    """``madvise(MADV_PAGEOUT)`` on a range; False if the kernel refused the call."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(start, length, _MADV_PAGEOUT) == 0


def resident_kb(path_part: str) -> int:
    """Resident kB of this process's mappings of the files whose path contains ``path_part``."""
    kb, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) > 5 and path_part in head[5]
            elif inside and head[0] == "Rss:":
                kb += int(head[1])
    return kb


def kernel_pages_out_private_file_mappings() -> bool:
    """Whether ``MADV_PAGEOUT`` drops the pages of a file mapping that only this process maps."""
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/var/tmp"), suffix=".probe") as fh:
        fh.write(os.urandom(8 << 20))
        fh.flush()
        os.fsync(fh.fileno())  # clean pages: reclaim does not write dirty ones back
        view = np.memmap(fh.name, dtype=np.uint8, mode="r")
        int(view[::_PAGE].sum())  # fault every page in
        before = resident_kb(fh.name)
        accepted = _madvise_pageout(view.ctypes.data & ~(_PAGE - 1), view.nbytes)
        after = resident_kb(fh.name)
        del view
    return accepted and before > 4096 and after < before / 4


_PROBE = """
import ctypes, sys
name_part = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

def resident_kb():
    kb, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            inside = len(head) > 5 and name_part in head[5]
        elif inside and head[0] == "Rss:":
            kb += int(head[1])
    return kb

before = resident_kb()
for line in open("/proc/self/maps"):
    fields = line.split()
    if len(fields) > 5 and name_part in fields[5] and "w" not in fields[1]:
        start, end = (int(x, 16) for x in fields[0].split("-"))
        libc.madvise(start, end - start, int(sys.argv[2]))
print(before, resident_kb())
"""


def library_pages_out_after(load: str, name_part: str) -> tuple[int, int]:
    """Run ``load`` (Python code that maps the library ``name_part`` names and uses it, as the code
    under test does) in a fresh interpreter, page the library out there with ``madvise`` and return
    its resident kB (before, after): the ground truth of whether this host drops the pages that
    code touched, now, whoever else maps them (other users and PID namespaces included, which
    :func:`other_processes_mapping` cannot see)."""
    done = subprocess.run(
        [sys.executable, "-c", load + "\n" + _PROBE, name_part, str(_MADV_PAGEOUT)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    before, after = map(int, done.stdout.split()[-2:])
    return before, after


def page_out_here(name_part: str) -> int:
    """Page this process's own read-only mappings of ``name_part`` out with ``madvise`` (this
    module's, not the code under test's) and return their resident kB afterwards: a library this
    process maps keeps its pages resident in every other process too."""
    with open("/proc/self/maps") as fh:
        lines = fh.readlines()
    for line in lines:
        fields = line.split()
        if len(fields) > 5 and name_part in fields[5] and "w" not in fields[1]:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            _madvise_pageout(start, end - start)
    return resident_kb(name_part)


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


def why_pages_stay(name_part: str, load: str) -> str | None:
    """Why this host cannot page out the pages of a shared library that ``load`` (Python code, see
    :func:`library_pages_out_after`) touches, right now (None: it can). Only that probe decides;
    the others name the likely cause."""
    own = page_out_here(name_part)
    before, after = library_pages_out_after(load, name_part)
    if after < before / 4:
        return None
    others = other_processes_mapping(name_part)
    causes = [
        f"{len(others)} other process(es) map it: {', '.join(others[:4])}"
        if others
        else "no other process this user can see maps it",
        f"{own} kB stay resident in the calling process",
    ]
    if not kernel_pages_out_private_file_mappings():
        causes.insert(0, "this kernel does not page out a private 8 MB file mapping either")
    return (
        f"MADV_PAGEOUT alone left {after} of {before} kB of {name_part} resident in a fresh process "
        f"that loaded it the same way ({'; '.join(causes)})"
    )
