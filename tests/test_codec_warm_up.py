"""The codec's background warm-up (delta_swap.codec_warm_up): once per process, reported done,
LLVM paged out of a server once the kernels are loaded, and a process that exits meanwhile exits
cleanly: its compiling child stopped, a load under way finished first."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from delta_swap import codec_warm_up
from tests.support import pageout


def test_warm_up_runs_once_per_process_and_reports_when_done() -> None:
    first = codec_warm_up.start_warm_up(encoder=False)
    assert first.name == codec_warm_up.WARM_UP_THREAD
    assert codec_warm_up.start_warm_up(encoder=False) is first  # once per process
    first.join(timeout=120)
    assert not first.is_alive() and codec_warm_up.warmed_up()


_EXIT_WHILE_THE_CHILD_COMPILES = """
import time
from delta_swap import codec_warm_up
codec_warm_up.start_warm_up(encoder=True)
while not codec_warm_up._children:
    time.sleep(0.05)
print(next(iter(codec_warm_up._children)).pid, flush=True)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_exiting_while_its_warm_up_compiles_stops_the_child(tmp_path) -> None:
    """A trainer that ends before the codec's first compile (a cold cache: ~30 s) exits at once and
    cleanly, leaving no compile behind."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cold-cache")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WHILE_THE_CHILD_COMPILES], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.monotonic() - started < 20, "the exit waited for the compile"
    assert _gone(int(done.stdout.split()[-1])), "the warm-up's compile outlived the process"


_FORK_WHILE_THE_CHILD_COMPILES = """
import os, sys, time
from delta_swap import codec_warm_up
codec_warm_up.start_warm_up(encoder=True)
while not codec_warm_up._children:
    time.sleep(0.05)
compiling = next(iter(codec_warm_up._children))
child = os.fork()
if child == 0:
    sys.exit(0)  # runs the atexit hook it inherited
os.waitpid(child, 0)
print(compiling.poll() is None, flush=True)
"""


def test_a_forked_child_exiting_leaves_its_parents_warm_up_alone(tmp_path) -> None:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cold-cache")}
    done = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_THE_CHILD_COMPILES], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]  # the compile still ran after the forked child's exit


_EXIT_WHILE_KERNELS_LOAD = """
import sys, time
from pathlib import Path
from delta_swap import codec, codec_warm_up

def no_child(*args, **kwargs):
    raise OSError("no child here: the kernels load in this process")

def slow_load(encoder):
    time.sleep(1.5)
    Path(sys.argv[1]).write_text("loaded")

codec_warm_up.subprocess.Popen = no_child
codec.warm_up = slow_load
codec_warm_up.start_warm_up(encoder=False)
time.sleep(0.3)  # then exit, with the load under way
"""


def test_a_process_exiting_while_kernels_load_waits_for_the_load(tmp_path) -> None:
    """Exiting with a daemon thread inside numba/LLVM can abort the process in the C++ runtime's
    teardown (SIGABRT; a failed rank to torchrun): the exit waits for the load instead."""
    marker = tmp_path / "loaded"
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WHILE_KERNELS_LOAD, str(marker)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker.exists(), "the process exited in the middle of the warm-up's load"


_LLVM_RESIDENT = """
import numpy as np
from delta_swap import codec, codec_warm_up
from delta_swap.codec import v2
from delta_swap.codec.v2 import samples

def resident_kb():
    kb, in_llvm = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            in_llvm = len(head) > 5 and "llvmlite" in head[5]
        elif in_llvm and head[0] == "Rss:":
            kb += int(head[1])
    return kb

codec.warm_up(encoder=False)
loaded = resident_kb()
codec_warm_up.start_warm_up(encoder=False).join()
after = resident_kb()
for dtype in v2.FLOATS:  # decoding still works, and bit-exact
    old, new = samples.tensors(dtype)
    out = old.copy()
    codec.decode_into(out, samples.stored_payload(dtype), dtype)
    assert np.array_equal(out, new), dtype
print(loaded, after, resident_kb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_server_warm_up_pages_llvm_out_once_the_kernels_are_loaded() -> None:
    """A server's warm-up leaves LLVM's code (~75 MB of libllvmlite.so, needed only to compile or
    load kernels) out of its memory, and decoding afterwards neither needs it nor changes. Where
    pages stay, the host is probed: a host that cannot page the library out skips with its reason,
    one that can fails the test (twice in a row: a process mapping it for a moment is no failure)."""
    for _attempt in range(2):
        # MADV_PAGEOUT skips pages that another process maps too: this test process (numba loaded,
        # kernels compiled) maps the same libllvmlite.so, so it gives its own pages back first
        pageout.page_out_here("llvmlite")
        done = subprocess.run([sys.executable, "-c", _LLVM_RESIDENT], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        loaded, after, after_decoding = map(int, done.stdout.split()[-3:])
        assert loaded > 20_000, loaded  # kB: the kernels' load ran LLVM
        if after < loaded / 4 and after_decoding < loaded / 4:
            return
        # pages stayed: the host's fault (skip) or the warm-up's (fail)
        why = pageout.why_pages_stay("llvmlite", "from delta_swap import codec; codec.warm_up(encoder=False)")
        if why is not None:
            pytest.skip(f"LLVM stayed resident ({after} of {loaded} kB) because {why}")
    pytest.fail(f"the warm-up left LLVM resident ({loaded}, {after}, {after_decoding} kB) on a host that pages it out")
