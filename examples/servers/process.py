"""Run an inference server (vLLM, SGLang) as a child process and wait until it is healthy.

Used by the demo, the engine tests and the benchmarks; engine-agnostic: it runs a command.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx

from delta_swap.freshness import record_path

ROOT = Path(__file__).resolve().parents[2]


def with_freshness_record(settings: Mapping[str, object] | None, workdir: Path) -> dict[str, object] | None:
    """``settings`` with the server's freshness record (the newest snapshot it verified, which it
    never goes back from) kept in ``workdir``, one file per store, unless they name one. By
    default a server keeps it in its staging dir (/dev/shm), shared by every server on the host:
    a store made again at the same path for a new run (a rerun of a test, a demo) would be refused
    there as another run."""
    if not settings or not settings.get("store") or settings.get("freshness_file"):
        return dict(settings) if settings is not None else None
    return {**settings, "freshness_file": str(record_path(str(workdir), str(settings["store"])))}


def device() -> str:
    """``cpu`` (the default, CI) or ``cuda`` (``DELTA_SWAP_DEVICE=cuda``, e.g. benchmarks/gpu_smoke.sh)."""
    return os.environ.get("DELTA_SWAP_DEVICE", "cpu")


#: On a GPU, the share of its memory a server may take: one server at a time, and the next one may
#: start while the last one's memory is still being given back.
GPU_MEMORY_FRACTION = 0.3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTakenError(RuntimeError):
    """The server could not listen on its port: something else took it between :func:`free_port`
    choosing it and the server binding it (a server binds only once its engine is up, and meanwhile
    its own ranks open many connections, each on a port from the same range)."""


#: How many ports :func:`start_on_a_free_port` tries.
PORT_ATTEMPTS = 3


def start_on_a_free_port(launch: Callable[[int], Server], wait: bool, timeout_s: float) -> Server:
    """``launch(port)`` on a free port and (with ``wait``) wait until it is healthy; where the port
    was taken meanwhile (:class:`PortTakenError`), again on another, up to :data:`PORT_ATTEMPTS` times."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        server = launch(free_port())
        if not wait:
            return server
        try:
            return server.wait_healthy(timeout_s)
        except PortTakenError as exc:
            if attempt == PORT_ATTEMPTS:
                raise
            print(f"{server.url}: {exc}; starting again on another port", file=sys.stderr)
    raise AssertionError("unreachable")


@dataclass
class Server:
    """A running server: its base URL, process and log file."""

    url: str
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float = 300) -> Server:
        """Wait until ``GET /health`` answers 200; raise (and stop the server) otherwise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "address already in use" in self.log_tail(20).lower():  # it may hang or exit on it
                self.stop()
                raise PortTakenError(f"the port was taken before the server could listen on it: {self.log_tail(3)}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever of it is left (an engine core
        or worker can outlive the API server that started it)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the group is gone: its memory (GPU too) is free
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.05)


@cache
def _import_root() -> str:
    """This checkout's packages under their import names (made once per process by
    scripts/import_root.sh, which prints the folder)."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "import_root.sh")], check=True, capture_output=True, text=True, timeout=60
    )
    return out.stdout.strip()


def _with_this_checkout(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this checkout's packages first on PYTHONPATH, so a server imports the plugin
    from the checkout that started it even when another checkout has since pointed the shared
    environment's editable install at itself."""
    paths = [_import_root(), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def launch_server(
    argv: list[str],
    env: dict[str, str],
    log_path: Path,
    port: int,
    *,
    python: str | None = None,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> Server:
    """Run ``[*prefix, python, *argv]`` (default python: this interpreter; a prefix such as
    ``ip netns exec NS`` runs it elsewhere) in its own process group with ``env`` added; the server
    is reached at ``host:port``. Returns at once."""
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [*prefix, python or sys.executable, *argv],
        env=_with_this_checkout({**os.environ, **env}),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return Server(f"http://{host}:{port}", proc, log_path)


def start_server(
    argv: list[str],
    env: dict[str, str],
    log_path: Path,
    port: int,
    timeout_s: float = 300,
    python: str | None = None,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> Server:
    """:func:`launch_server`, then wait until ``GET /health`` answers 200."""
    return launch_server(argv, env, log_path, port, python=python, host=host, prefix=prefix).wait_healthy(timeout_s)
