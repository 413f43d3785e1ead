"""Warming up the codec in the background: its kernels compiled in a child process, loaded here,
and LLVM's pages given back afterwards. The codec itself only compiles (:func:`.codec.warm_up`);
servers and publishers call :func:`start_warm_up` when they start so the first delta they handle
does not wait for the JIT.
"""

from __future__ import annotations

import subprocess
import sys
import threading

from . import codec
from .host_memory import page_out_library

#: The name of the thread :func:`start_warm_up` runs (the CLI waits for it before it exits).
WARM_UP_THREAD = "delta-swap-codec-warm-up"

_lock = threading.Lock()
_threads: dict[bool, threading.Thread] = {}


def _run(encoder: bool) -> None:
    try:
        code = f"import os; os.nice(10); from delta_swap import codec; codec.warm_up({encoder})"
        subprocess.run(
            [sys.executable, "-c", code],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=900,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):  # then this process compiles, as it would anyway
        pass
    try:
        codec.warm_up(encoder)
    except Exception:  # noqa: BLE001 - best effort: decoding works without it
        return
    page_out_library("llvmlite")  # LLVM ran to load the kernels; decoding does not need it


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
    with _lock:
        thread = _threads.get(encoder) or _threads.get(True)
        if thread is None:
            thread = threading.Thread(target=_run, args=(encoder,), name=WARM_UP_THREAD, daemon=True)
            thread.start()
            _threads[encoder] = thread
    return thread


def warmed_up() -> bool:
    """Whether a warm-up started in this process has finished: deltas then decode without waiting
    for the JIT (``codec_ready`` in a server's status)."""
    with _lock:
        return any(not thread.is_alive() for thread in _threads.values())
