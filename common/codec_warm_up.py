"""Warming up the codec in the background: its kernels compiled in a child process, loaded here,
and LLVM's pages given back afterwards. The codec itself only compiles (:func:`.codec.warm_up`);
servers and publishers call :func:`start_warm_up` when they start so the first delta they handle
does not wait for the JIT. A process that exits meanwhile stops the child and waits for a load
under way (:func:`_stop_at_exit`): it neither leaves a compile behind nor exits under LLVM's feet.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading

from . import codec
from .host_memory import page_out_library

#: The name of the thread :func:`start_warm_up` runs (the CLI waits for it before it exits).
WARM_UP_THREAD = "delta-swap-codec-warm-up"

#: How long a warm-up child may compile before it is given up (the JIT then runs here).
CHILD_TIMEOUT_S = 900

_lock = threading.Lock()
_threads: dict[bool, threading.Thread] = {}
_exiting = False
_owner = 0  # the process whose exit stops them (a forked child inherits the hook, not the work)
_children: set[subprocess.Popen] = set()  # compiling now
_loading: set[threading.Thread] = set()  # loading (or compiling) the kernels in this process now


def _compile_in_child(encoder: bool) -> None:
    """Fill numba's cache from a child process at a lower priority; any failure leaves the JIT to
    this process. The child is stopped if this process exits first."""
    code = f"import os; os.nice(10); from delta_swap import codec; codec.warm_up({encoder})"
    with _lock:  # started under the lock: an exit that began meanwhile either sees it or stops it first
        if _exiting:
            return
        try:
            child = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError:
            return
        _children.add(child)
    try:
        child.wait(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    finally:
        with _lock:
            _children.discard(child)


def _run(encoder: bool) -> None:
    _compile_in_child(encoder)
    me = threading.current_thread()
    with _lock:
        if _exiting:  # the process is going: it needs no kernels now
            return
        _loading.add(me)
    try:
        codec.warm_up(encoder)
        page_out_library("llvmlite")  # LLVM ran to load the kernels; decoding does not need it
    except Exception:  # noqa: BLE001 - best effort: decoding works without it
        return
    finally:
        with _lock:
            _loading.discard(me)


def _stop_at_exit() -> None:
    """At interpreter exit (atexit runs before finalization, daemon threads still alive): stop the
    compiling children, and wait for a load under way in this process. A daemon thread left inside
    numba/LLVM while the interpreter and the C++ runtime tear down can abort the process (SIGABRT,
    "terminate called without an active exception"), which a trainer's launcher reports as a
    failed rank."""
    global _exiting
    if os.getpid() != _owner:  # a forked child exiting: the children and threads are its parent's
        return
    with _lock:
        _exiting = True
        children, loading = list(_children), list(_loading)
    for child in children:
        child.terminate()  # numba writes a cache file to a temporary name and renames it: no torn entry
    for child in children:
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
    for thread in loading:
        thread.join()


def start_warm_up(encoder: bool = True) -> threading.Thread:
    """:func:`.codec.warm_up` in a daemon thread (returned, already started), once per process;
    errors there are ignored, since the first real payload compiles what it needs anyway. Cold
    (nothing cached yet) this takes ~15 s of one core for the decoder and ~30 s with the encoder;
    with the cache, under a second (benchmarks/README.md).

    The kernels are compiled in a child process (at a lower priority than the engine), which fills
    numba's on-disk cache, and then loaded from that cache here: a compile leaves ~90 MB of LLVM's
    working memory in the process that ran it, and a server should not carry that for its life.
    Once they are loaded, LLVM's code pages are paged out as well (~75 MB resident otherwise;
    decoding never runs LLVM, and a later compile reads them back from disk)."""
    global _owner
    with _lock:
        thread = _threads.get(encoder) or _threads.get(True)
        if thread is None:
            if not _threads:
                _owner = os.getpid()
                atexit.register(_stop_at_exit)
            thread = threading.Thread(target=_run, args=(encoder,), name=WARM_UP_THREAD, daemon=True)
            thread.start()
            _threads[encoder] = thread
    return thread


def warmed_up() -> bool:
    """Whether a warm-up started in this process has finished: deltas then decode without waiting
    for the JIT (``codec_ready`` in a server's status)."""
    with _lock:
        return any(not thread.is_alive() for thread in _threads.values())
