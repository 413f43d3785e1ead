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
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_server(
    argv: list[str], env: dict[str, str], log_path: Path, port: int, timeout_s: float = 300, python: str | None = None
) -> Server:
    """Run ``python argv...`` (default: this interpreter) in its own process group, with ``env``
    added, and wait until ``GET /health`` on ``port`` answers 200."""
    log = open(log_path, "wb")
    proc = subprocess.Popen([python or sys.executable, *argv], env={**os.environ, **env}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"server not ready after {timeout_s}s:\n{server.log_tail()}")
