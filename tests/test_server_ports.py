"""examples.servers.process.start_on_a_free_port: a server whose port was taken before it could
listen (CI saw an SGLang server at TP 2 lose its port to another process while its engine
started, and then wait five minutes for a health check that could never pass) is stopped at once
and started again on another port. The "server" here is a few lines of Python that behave like
one: the first start logs uvicorn's bind error and hangs, the next serves ``/health``."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from examples.servers.process import PORT_ATTEMPTS, PortTakenError, Server, launch_server, start_on_a_free_port

SERVER = textwrap.dedent(
    """
    import http.server, sys, time
    from pathlib import Path
    port, attempts, taken = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    n = int(attempts.read_text()) + 1 if attempts.exists() else 1
    attempts.write_text(str(n))
    if n <= taken:
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
              "address already in use", flush=True)
        time.sleep(600)  # as uvicorn's server does: it never exits
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


def _launcher(tmp_path: Path, taken: int):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    attempts = tmp_path / "attempts"

    def launch(port: int) -> Server:
        argv = [str(script), str(port), str(attempts), str(taken)]
        return launch_server(argv, {}, tmp_path / "server.log", port, python=sys.executable)

    return launch, attempts


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path) -> None:
    launch, attempts = _launcher(tmp_path, taken=1)
    started = time.monotonic()
    server = start_on_a_free_port(launch, wait=True, timeout_s=60)
    try:
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert attempts.read_text() == "2" and time.monotonic() - started < 30
    finally:
        server.stop()


def test_a_port_taken_at_every_attempt_is_an_error_that_says_so(tmp_path) -> None:
    launch, attempts = _launcher(tmp_path, taken=PORT_ATTEMPTS)
    with pytest.raises(PortTakenError, match="address already in use"):
        start_on_a_free_port(launch, wait=True, timeout_s=60)
    assert attempts.read_text() == str(PORT_ATTEMPTS)
