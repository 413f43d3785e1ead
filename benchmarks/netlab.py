"""A lab network on one machine: "regions" as network namespaces, each joined to the host by a veth
pair whose host side is capped with a ``tbf`` qdisc (``netem`` is not available on these machines).

Region ``i`` is the namespace ``dsw-r{i}``, linked by ``dsw{i}h`` (host side, ``10.231.{i}.1``) and
``dsw{i}n`` (region side, ``10.231.{i}.2``); traffic from the host into the region (the downloads
that matter here) is capped. Processes run inside a region through :meth:`Region.prefix`
(``ip netns exec``). Everything the lab creates is removed by :meth:`Lab.close`, which also runs on
exit, SIGTERM and Ctrl-C; it never touches the host's own interfaces, only the pairs it created.

Where namespaces cannot be created (no root, no ``CAP_NET_ADMIN``), :func:`namespaces_available`
says why, and callers cap bandwidth another way.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

PREFIX = "dsw"


@dataclass(frozen=True)
class Region:
    index: int
    netns: str
    host_dev: str
    host_ip: str
    region_ip: str

    @property
    def prefix(self) -> list[str]:
        """Command prefix that runs a program inside the region."""
        return ["ip", "netns", "exec", self.netns]

    def bytes_in(self) -> int:
        """Bytes sent from the host into the region so far (the capped direction)."""
        return int(Path(f"/sys/class/net/{self.host_dev}/statistics/tx_bytes").read_text())


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True)


def namespaces_available() -> tuple[bool, str]:
    """Whether this process may create network namespaces and veth pairs (and why not)."""
    if os.geteuid() != 0:
        return False, "not root: network namespaces need CAP_NET_ADMIN"
    probe = f"{PREFIX}-probe"
    created = _run("ip", "netns", "add", probe, check=False)
    if created.returncode != 0:
        return False, f"ip netns add failed: {created.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    if _run("tc", "-V", check=False).returncode != 0:
        return False, "tc (iproute2) is missing"
    return True, "network namespaces and tc are available"


class Lab:
    """``regions`` network namespaces behind links capped at ``mbit`` megabits per second."""

    def __init__(self, regions: int, mbit: float) -> None:
        self.mbit = mbit
        self.regions = [
            Region(i, f"{PREFIX}-r{i}", f"{PREFIX}{i}h", f"10.231.{i}.1", f"10.231.{i}.2")
            for i in range(1, regions + 1)
        ]
        self._up = False
        self._handlers: dict[int, object] = {}

    def __enter__(self) -> Lab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self) -> list[Region]:
        self._remove()  # leftovers of an earlier run that died
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._handlers[sig] = signal.signal(sig, exit_on_signal)
        self._up = True
        rate_bytes = self.mbit * 1e6 / 8
        burst = max(32 * 1024, int(rate_bytes / 100))
        for r in self.regions:
            _run("ip", "netns", "add", r.netns)
            _run("ip", "link", "add", r.host_dev, "type", "veth", "peer", "name", f"{PREFIX}{r.index}n")
            _run("ip", "link", "set", f"{PREFIX}{r.index}n", "netns", r.netns)
            _run("ip", "addr", "add", f"{r.host_ip}/24", "dev", r.host_dev)
            _run("ip", "link", "set", r.host_dev, "up")
            _run("ip", "-n", r.netns, "addr", "add", f"{r.region_ip}/24", "dev", f"{PREFIX}{r.index}n")
            _run("ip", "-n", r.netns, "link", "set", f"{PREFIX}{r.index}n", "up")
            _run("ip", "-n", r.netns, "link", "set", "lo", "up")
            _run(
                "tc",
                "qdisc",
                "add",
                "dev",
                r.host_dev,
                "root",
                "tbf",
                "rate",
                f"{self.mbit}mbit",
                "burst",
                str(burst),
                "latency",
                "400ms",
            )
        return self.regions

    def close(self) -> None:
        """Kill every process left in the regions, delete the namespaces and their links."""
        self._remove()
        while self._handlers:
            sig, handler = self._handlers.popitem()
            signal.signal(sig, handler)

    def _remove(self) -> None:
        for r in self.regions:
            pids = _run("ip", "netns", "pids", r.netns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", r.netns, check=False)
            _run("ip", "link", "del", r.host_dev, check=False)  # gone with the namespace, normally
        self._up = False


def exit_on_signal(signum: int, frame: object) -> None:
    """A SIGTERM/SIGHUP handler that raises SystemExit, so ``finally`` blocks and ``with`` exits run."""
    raise SystemExit(128 + signum)  # unwinds through every finally: the lab closes
