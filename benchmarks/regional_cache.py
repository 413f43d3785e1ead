"""A region-local cache in front of the bucket: a stock nginx caching proxy, configured for
delta-swap's reads.

Snapshot objects (``snapshots/...``) never change once written, so nginx caches them for a day,
fetches each one from upstream once however many servers ask (``proxy_cache_lock``), and serves
the servers' ranged and HEAD requests from its cache (with caching on, nginx asks upstream for
the whole object and answers ranges itself). ``HEAD`` (the chain's head pointer) is never cached:
every poll goes upstream, conditionally (``If-None-Match`` passes through, an unchanged pointer
costs a 304). The access log records, per request, whether it hit the cache and how many bytes
came from upstream. ``limit_rate`` (bytes per second, nginx's ``proxy_limit_rate``) caps how fast
each response is read from upstream, for machines where the lab cannot cap a link (no network
namespaces).
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

CONFIG = """\
{user}worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 512; }}
http {{
    log_format cache '$request_method $uri $status $upstream_cache_status $bytes_sent '
                     '$upstream_bytes_received';
    access_log {root}/access.log cache;
    client_body_temp_path {root}/tmp/body;
    proxy_temp_path {root}/tmp/proxy;
    fastcgi_temp_path {root}/tmp/fastcgi;
    uwsgi_temp_path {root}/tmp/uwsgi;
    scgi_temp_path {root}/tmp/scgi;
    proxy_cache_path {root}/cache levels=1:2 keys_zone=snapshots:16m max_size={max_size} inactive=1d
                     use_temp_path=off;
    proxy_http_version 1.1;
    proxy_read_timeout 600s;
    server {{
        listen {listen};
        location ~ /HEAD$ {{
            proxy_pass {upstream};
            proxy_cache off;
        }}
        location / {{
            proxy_pass {upstream};
            proxy_cache {cache};
            proxy_cache_key $uri;
            proxy_cache_valid 200 206 1d;
            proxy_cache_lock on;
            proxy_cache_lock_age 600s;
            proxy_cache_lock_timeout 600s;
            {limit}
        }}
    }}
}}
"""


@dataclass
class RegionalCache:
    """One nginx caching proxy, run as ``[*prefix, nginx]`` (e.g. inside a region's namespace)."""

    root: Path
    upstream: str
    listen: str = "127.0.0.1:8080"
    prefix: Sequence[str] = ()
    limit_rate: str | None = None
    max_size: str = "8g"
    #: Off: a plain rate-limited pass-through (stands in for a capped link where namespaces are missing).
    caching: bool = True
    proc: subprocess.Popen | None = field(default=None, init=False)

    def start(self) -> RegionalCache:
        shutil.rmtree(self.root, ignore_errors=True)
        (self.root / "tmp").mkdir(parents=True)
        limit = f"proxy_limit_rate {self.limit_rate};" if self.limit_rate else ""
        conf = self.root / "nginx.conf"
        conf.write_text(
            CONFIG.format(
                root=self.root,
                upstream=self.upstream,
                listen=self.listen,
                limit=limit,
                max_size=self.max_size,
                cache="snapshots" if self.caching else "off",
                user=f"user {getpass.getuser()};\n" if os.geteuid() == 0 else "",
            )
        )
        self.proc = subprocess.Popen(
            [*self.prefix, "nginx", "-c", str(conf), "-p", str(self.root), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=open(self.root / "stderr.log", "wb"),
            start_new_session=True,
        )
        return self

    def wait_ready(self, url: str, timeout_s: float = 30, prefix: Sequence[str] = ()) -> None:
        """Wait until ``url`` answers (asked from inside ``prefix``, e.g. the region's namespace)."""
        code = (
            "import sys, urllib.error as e, urllib.request as u\n"
            f"try: u.urlopen({url!r}, timeout=2)\nexcept e.HTTPError: pass\n"
        )  # any HTTP answer will do
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {(self.root / 'stderr.log').read_text()[-2000:]}")
            if subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True).returncode == 0:
                time.sleep(0.3)
                if self.proc is not None and self.proc.poll() is not None:  # another nginx held the port
                    raise RuntimeError(f"nginx exited: {(self.root / 'stderr.log').read_text()[-2000:]}")
                return
            time.sleep(0.2)
        raise RuntimeError("nginx did not answer")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def stats(self) -> dict[str, int]:
        """Requests by cache status, and bytes received from upstream and sent to clients."""
        out = {"requests": 0, "HIT": 0, "MISS": 0, "BYPASS": 0, "upstream_bytes": 0, "sent_bytes": 0}
        try:
            lines = (self.root / "access.log").read_text().splitlines()
        except OSError:
            return out
        for line in lines:
            parts = line.split()
            if len(parts) < 6:
                continue
            out["requests"] += 1
            if parts[3] in out:
                out[parts[3]] += 1
            out["sent_bytes"] += int(parts[4]) if parts[4].isdigit() else 0
            out["upstream_bytes"] += sum(int(x) for x in parts[5].replace(",", " ").split() if x.isdigit())
        return out
