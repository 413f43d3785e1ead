"""A side channel from SGLang's HTTP server process into each scheduler, for what must run while
the engine generates.

SGLang's own way in (``update_weights_from_tensor``, which delta-swap's custom weight loader uses
in the pause) waits for every in-flight request when the engine is not paused, so staging an
in-place update before the pause cannot go that way. Each tensor-parallel rank's scheduler
instead answers requests on a Unix socket of its own (:func:`serve`, on a daemon thread started
when the scheduler is set up), authenticated with a key only the server's processes know
(``multiprocessing.connection``'s HMAC challenge). :func:`call` sends one request and returns the
answer. The handler must not raise; a request it cannot answer answers ``{"error": ...}``.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Callable
from multiprocessing.connection import Client, Listener
from typing import Any

log = logging.getLogger("sglang_delta_plugin")

#: The socket path of rank 0 (rank k adds ``.k``), set by the HTTP server process for its schedulers.
ADDRESS_ENV = "DELTA_SWAP_SCHEDULER_CHANNEL"
#: The channel's key (hex), likewise.
KEY_ENV = "DELTA_SWAP_SCHEDULER_CHANNEL_KEY"

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def configure() -> None:
    """Name a fresh socket and key for this server's schedulers (they inherit the environment)."""
    os.environ[ADDRESS_ENV] = os.path.join(tempfile.gettempdir(), f"delta-swap-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.environ[KEY_ENV] = os.urandom(16).hex()


def address(rank: int) -> str:
    base = os.environ[ADDRESS_ENV]
    return base if rank == 0 else f"{base}.{rank}"


def serve(rank: int, handler: Handler) -> threading.Thread:
    """Answer requests to ``rank``'s socket with ``handler`` on a daemon thread."""
    path = address(rank)
    if os.path.exists(path):
        os.unlink(path)
    listener = Listener(path, family="AF_UNIX", authkey=bytes.fromhex(os.environ[KEY_ENV]))

    def loop() -> None:
        while True:
            try:
                with listener.accept() as conn:
                    request = conn.recv()
                    try:
                        answer = handler(request)
                    except Exception as exc:  # the handler must not raise; say so rather than hang
                        log.exception("delta_swap: the scheduler channel's handler raised")
                        answer = {"error": f"{type(exc).__name__}: {exc}"}
                    conn.send(answer)
            except Exception:  # a client that went away, a failed handshake: keep serving
                log.exception("delta_swap: a scheduler channel request failed")

    thread = threading.Thread(target=loop, name=f"delta-swap-channel-{rank}", daemon=True)
    thread.start()
    return thread


def call(rank: int, request: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    """Send ``request`` to ``rank``'s scheduler and return its answer."""
    with Client(address(rank), family="AF_UNIX", authkey=bytes.fromhex(os.environ[KEY_ENV])) as conn:
        conn.send(request)
        if not conn.poll(timeout_s):
            raise TimeoutError(f"the scheduler of rank {rank} did not answer {request.get('op')!r} in {timeout_s}s")
        answer: dict[str, Any] = conn.recv()
    return answer
