"""Several HTTP front ends for one deployment (vLLM starts ``--api-server-count`` of them, by default
one per data-parallel engine): one subscriber, one version for all.

Front end 0 leads: it runs the subscriber, which pauses, updates and resumes every engine (the
engines are shared by all front ends), and it answers the others over a Unix socket (:class:`Leader`).
The others follow (:class:`Follower`): their admin routes show the leader's status and pass notifies
and resyncs on to it, and their version tags and prefix-cache salts use the snapshot the leader
serves, which it pushes to them as it changes. Both stand where the admin routes expect a subscriber
(:class:`~delta_swap.admin_routes.RouteTarget`).

The socket lives in a directory only this user can enter; a follower's routes check the admin
token before they pass a request on. The protocol is one JSON object per line: a follower keeps one
connection that starts with ``{"op": "watch"}`` and then reads ``{"version", "resyncing"}`` lines,
and opens one more per request (``describe``, ``notify``, ``resync``) for one answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from .settings import Settings
    from .subscriber import Subscriber

log = logging.getLogger("delta_swap.front_ends")

#: How often the leader looks for a new served version to push (seconds).
PUSH_INTERVAL = 0.02
#: How long a follower waits between attempts to reach the leader (seconds).
RETRY_INTERVAL = 0.5


@dataclass(frozen=True)
class FrontEnd:
    """This HTTP front end's place among the deployment's (``index`` 0 leads)."""

    index: int
    count: int
    #: The leader's Unix socket, the same path for every front end of the deployment.
    address: Path

    @property
    def leads(self) -> bool:
        return self.index == 0

    def place(self) -> dict[str, int]:
        """This front end's place, as the status shows it."""
        return {"api_server": self.index, "api_servers": self.count}

    @classmethod
    def siblings_of(cls, parent_pid: int, index: int, count: int) -> FrontEnd:
        """Front ends started by one parent process (vLLM's ``serve`` starts its API servers so)."""
        return cls(index, count, Path(tempfile.gettempdir()) / f"delta-swap-{os.getuid()}-{parent_pid}" / "leader.sock")


def private_directory(path: Path) -> Path:
    """Create ``path`` (mode 0700) or check that an existing one is ours and closed to others."""
    path.mkdir(mode=0o700, parents=False, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError(f"{path} must belong to this user and be closed to others (mode 0700)")
    return path


async def _ask(address: Path, request: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """Send one request to the leader and read its one-line answer."""
    reader, writer = await asyncio.open_unix_connection(str(address))
    try:
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        if not line:
            raise ConnectionError("the leading front end closed the connection")
        answer: dict[str, Any] = json.loads(line)
        return answer
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


class Leader:
    """Front end 0: its subscriber, and the socket that answers the other front ends."""

    def __init__(self, subscriber: Subscriber, front_end: FrontEnd) -> None:
        self.subscriber = subscriber
        self.settings = subscriber.settings
        self.front_end = front_end
        self._server: asyncio.AbstractServer | None = None
        self._listening: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the subscriber and listen for the followers (on the running event loop; the
        followers keep trying until the socket is there)."""
        private_directory(self.front_end.address.parent)
        self.front_end.address.unlink(missing_ok=True)
        self._listening = asyncio.get_running_loop().create_task(self._listen(), name="delta-swap-leader")
        self.subscriber.start()

    async def _listen(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.front_end.address))

    async def stop(self) -> None:
        if self._listening is not None:
            await self._listening
            self._listening = None
        if self._server is not None:
            self._server.close()
            self._server = None
            self.front_end.address.unlink(missing_ok=True)
        await self.subscriber.stop()

    # The route target: the subscriber's, with this front end's place added to the status.
    @property
    def resync_running(self) -> bool:
        return self.subscriber.resync_running

    @property
    def served_snapshot_id(self) -> str | None:
        return self.subscriber.served_snapshot_id

    def status(self) -> dict[str, Any]:
        return {**self.subscriber.status(), **self.front_end.place()}

    async def describe(self) -> dict[str, Any]:
        return {**await self.subscriber.describe(), **self.front_end.place()}

    async def resync(self, *, allow_older: bool = False) -> bool:
        return await self.subscriber.resync(allow_older=allow_older)

    def wake(self) -> None:
        self.subscriber.wake()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await reader.readline() or b"{}")
            op = request.get("op")
            if op == "watch":
                await self._push_versions(writer)
                return
            if op == "describe":
                answer = await self.subscriber.describe()
            elif op == "notify":
                self.subscriber.wake()
                answer = {"accepted": True}
            elif op == "resync":
                if self.subscriber.resync_running:
                    answer = {"busy": True}
                else:
                    ok = await self.subscriber.resync(allow_older=bool(request.get("allow_older")))
                    answer = {"resynced": ok, "status": self.subscriber.status()}
            else:
                answer = {"error": f"unknown request {op!r}"}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, json.JSONDecodeError) as exc:
            log.warning("delta-swap: a follower's request failed: %s", exc)
        finally:
            writer.close()

    async def _push_versions(self, writer: asyncio.StreamWriter) -> None:
        """Tell a follower the served version and whether a resync runs, now and at every change."""
        sent: tuple[str | None, bool] | None = None
        while not writer.is_closing():
            state = (self.subscriber.served_snapshot_id, self.subscriber.resync_running)
            if state != sent:
                writer.write(json.dumps({"version": state[0], "resyncing": state[1]}).encode() + b"\n")
                await writer.drain()
                sent = state
            await asyncio.sleep(PUSH_INTERVAL)


class Follower:
    """Front ends 1..n-1: answer for the leader, and serve the version it serves."""

    def __init__(self, settings: Settings, front_end: FrontEnd) -> None:
        self.settings = settings
        self.front_end = front_end
        self._version: str | None = None
        self._resyncing = False
        self._last_status: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Follow the leader's version in the background (on the running event loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="delta-swap-follower")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def resync_running(self) -> bool:
        return self._resyncing

    @property
    def served_snapshot_id(self) -> str | None:
        return self._version

    def status(self) -> dict[str, Any]:
        return {**self._last_status, **self.front_end.place()}

    async def describe(self) -> dict[str, Any]:
        try:
            self._last_status = await _ask(self.front_end.address, {"op": "describe"}, timeout=30)
        except (OSError, ConnectionError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
            return {**self.status(), "leader_error": f"the leading front end does not answer: {exc}"}
        return self.status()

    async def resync(self, *, allow_older: bool = False) -> bool:
        answer = await _ask(self.front_end.address, {"op": "resync", "allow_older": allow_older}, timeout=None)
        if answer.get("busy"):
            return False
        self._last_status = answer.get("status", self._last_status)
        return bool(answer.get("resynced"))

    def wake(self) -> None:
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        try:
            await _ask(self.front_end.address, {"op": "notify"}, timeout=30)
        except (OSError, ConnectionError, asyncio.TimeoutError) as exc:
            log.warning("delta-swap: could not pass a notify on to the leading front end: %s", exc)

    async def _watch(self) -> None:
        """Keep one connection to the leader and take every version it pushes; reconnect if lost."""
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.front_end.address))
            except OSError:
                await asyncio.sleep(RETRY_INTERVAL)
                continue
            try:
                writer.write(b'{"op": "watch"}\n')
                await writer.drain()
                while line := await reader.readline():
                    pushed = json.loads(line)
                    self._version, self._resyncing = pushed["version"], bool(pushed["resyncing"])
            except (OSError, ConnectionError, json.JSONDecodeError, KeyError) as exc:
                log.warning("delta-swap: lost the leading front end (%s); reconnecting", exc)
            finally:
                writer.close()
            await asyncio.sleep(RETRY_INTERVAL)
