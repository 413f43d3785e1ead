"""Fault matrix: every fault of docs/SECURITY.md against a real vLLM server and a real SGLang server.

    python -m benchmarks.fault_matrix [--engine vllm|sglang|both] [--only FAULT ...] [--outage 120]

Each server starts on a tiny model, follows a local store, trusts the trainer's key and has an
admin token, as in production. For every fault: from a server on a good snapshot, inject the
fault; check that the server keeps generating on one consistent snapshot (the version its status
reports tags every token of a fresh completion) and that its status says what happened; remove
the fault; check that it converges on the newest good snapshot. One table row per fault and
engine. A CI-sized subset runs in the engine test modules (tests/support/rollout_scenarios.py).

The staging-disk-full row mounts a small tmpfs (root only; skipped elsewhere); the outage row
takes the store offline for --outage seconds (two minutes by default).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from safetensors.torch import load_file, save_file

from delta_swap import store_keys
from delta_swap.checksum import checksum, sha256
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.signing import generate_keypair
from examples.servers import sglang as sglang_server
from examples.servers import vllm as vllm_server
from examples.servers.process import Server
from examples.tiny_model import make_tiny_model, perturb_weights

PROMPT = [5, 17, 99, 230, 41, 300, 301, 302, 7, 8]


@dataclass
class Row:
    fault: str
    engine: str
    generating: bool = False
    consistent: bool = False
    status: str = ""
    converged: bool = False
    served_after: str = ""
    note: str = ""


@dataclass
class Harness:
    """One engine server following one store, and the trainer that publishes to it."""

    engine: str
    work: Path
    models: list[Path]
    outage_s: float
    key: Path = field(init=False)
    token: str = "fault-matrix-token"
    store: Path = field(init=False)
    server: Server | None = None
    step: int = 0
    trusted: bool = True
    staging: Path | None = None

    def __post_init__(self) -> None:
        self.key, _ = generate_keypair(self.work / "trainer.key")
        self.store = self.work / "store"

    # ------------------------------------------------------------------ server

    def settings(self) -> dict[str, object]:
        out: dict[str, object] = {
            "store": self.store.as_uri(),
            "poll_interval": 0.2,
            "admin_token": self.token,
            "drain_timeout": 60,
        }
        if self.trusted:
            out["trusted_key"] = f"{self.key}.pub"
        if self.staging is not None:
            out["staging_dir"] = str(self.staging)
        return out

    def start(self, wait: bool = True) -> None:
        if self.engine == "vllm":
            self.server = vllm_server.start(
                self.models[0], self.work / "vllm", settings=self.settings(), log_name=f"server-{self.step}.log"
            )
        else:
            self.server = sglang_server.start(
                self.models[0], self.work / "sglang", settings=self.settings(), log_name=f"server-{self.step}.log"
            )
        if wait:
            self.wait(lambda s: s["current_step"] == self.step, 300)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def kill(self) -> None:
        assert self.server is not None
        os.killpg(self.server.proc.pid, signal.SIGKILL)
        self.server.proc.wait(30)
        self.server = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def status(self) -> dict:
        return httpx.get(f"{self.url}/delta_swap/status", timeout=30).json()

    def wait(self, pred: Callable[[dict], bool], timeout: float = 60) -> dict | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if pred(st):
                return st
            time.sleep(0.2)
        return None

    def post(self, route: str, token: str | None = "default") -> int:
        headers = {"Authorization": f"Bearer {self.token if token == 'default' else token}"} if token else {}
        return httpx.post(f"{self.url}/delta_swap/{route}", headers=headers, timeout=300).status_code

    def generation_versions(self) -> list[str]:
        """The weight versions that tag a fresh greedy completion (raises if generation fails)."""
        if self.engine == "vllm":
            body = {"model": "model", "token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "temperature": 0}}
            r = httpx.post(f"{self.url}/inference/v1/generate", json=body, timeout=120)
            r.raise_for_status()
            return [span["version"] for span in r.json()["choices"][0]["weight_versions"]]
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
        r = httpx.post(f"{self.url}/generate", json=body, timeout=120)
        r.raise_for_status()
        return [span["version"] for span in r.json()["meta_info"]["weight_versions"]]

    def check_serving(self, row: Row) -> None:
        """Fill ``generating`` and ``consistent``: a completion succeeds, tagged only with the
        snapshot the status reports."""
        try:
            versions = self.generation_versions()
            st = self.status()
            row.generating = True
            served = {st["weight_version"]} if st["current_snapshot_id"] is None else {st["current_snapshot_id"]}
            row.consistent = bool(versions) and set(versions) == served == {st["weight_version"]}
        except httpx.HTTPError as exc:
            row.note = f"generation failed: {exc!r}"[:80]

    # ------------------------------------------------------------------ trainer

    def publish(self, store: Path, step: int, model: Path, *, signed: bool = True, base: bool = False) -> None:
        config = PublisherConfig(base_every=10_000, signing_key=str(self.key) if signed else None)
        with Publisher(str(store), config, files={"config.json": (model / "config.json").read_bytes()}) as pub:
            pub.publish(step, load_file(str(model / "model.safetensors")), force_base=base)

    def prepare(self, model: Path, *, signed: bool = True, base: bool = False) -> Path:
        """Publish the next step into a scratch copy of the store; returns that copy."""
        self.step += 1
        scratch = Path(tempfile.mkdtemp(dir=self.work, prefix=f"scratch-{self.step}-"))
        shutil.copytree(self.store, scratch, dirs_exist_ok=True)
        self.publish(scratch, self.step, model, signed=signed, base=base)
        return scratch

    def snapshot_dir(self, root: Path, step: int | None = None) -> Path:
        return root / "snapshots" / f"step-{self.step if step is None else step:010d}"

    def commit(self, scratch: Path, step: int | None = None, *, head: bool = True) -> None:
        """Copy a prepared snapshot into the live store in the publisher's order, then HEAD
        (unless ``head`` is False: a store that withholds it)."""
        src, dest = self.snapshot_dir(scratch, step), self.snapshot_dir(self.store, step)
        order = sorted(src.rglob("*"), key=lambda p: (p.name == "manifest.json", p.name == "manifest.sig", str(p)))
        for path in order:
            if path.is_file():
                target = dest / path.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, target)
        if head:
            shutil.copy(scratch / "HEAD", self.store / "HEAD")

    def model(self) -> Path:
        return self.models[(self.step + 1) % len(self.models)]


# ---------------------------------------------------------------------- faults


def _shard(snapshot: Path) -> Path:
    return next(snapshot.glob("shard-*"))


def _tamper(h: Harness, edit: Callable[[Path], None]) -> tuple[Path, Path]:
    """Prepare the next step, keep a pristine copy, and commit a damaged one."""
    scratch = h.prepare(h.model())
    pristine = Path(tempfile.mkdtemp(dir=h.work, prefix="pristine-"))
    shutil.copytree(scratch, pristine, dirs_exist_ok=True)
    edit(h.snapshot_dir(scratch))
    h.commit(scratch)
    return scratch, pristine


def _refused_then_repaired(h: Harness, row: Row, edit: Callable[[Path], None], expect: str) -> None:
    served = h.status()["current_step"]
    before = h.status()["failures"]
    _, pristine = _tamper(h, edit)
    st = h.wait(lambda s: s["failures"] > before)
    row.status = (st or {}).get("last_error") or "(no error reported)"
    h.check_serving(row)
    ok_status = st is not None and expect in row.status and st["current_step"] == served
    shutil.rmtree(h.snapshot_dir(h.store))
    h.commit(pristine)
    st = h.wait(lambda s: s["current_step"] == h.step and s["last_error"] is None)
    row.converged = ok_status and st is not None
    row.served_after = (st or h.status())["current_snapshot_id"]


def flip_shard_byte(snapshot: Path) -> None:
    shard = _shard(snapshot)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def truncate_shard(snapshot: Path) -> None:
    shard = _shard(snapshot)
    shard.write_bytes(shard.read_bytes()[:-100])


def remove_shard(snapshot: Path) -> None:
    _shard(snapshot).unlink()


def forge_weights(snapshot: Path) -> None:
    """Change stored bytes and recompute every checksum the manifest lists (the signature, if
    any, cannot be recomputed without the trainer's key)."""
    shard = _shard(snapshot)
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01
    shard.write_bytes(bytes(data))
    manifest = snapshot / "manifest.json"
    doc = json.loads(manifest.read_text())
    for blob in doc["shards"]:
        if blob["name"] == shard.name:
            blob.update(checksum=checksum(bytes(data)), sha256=sha256(bytes(data)))
    manifest.write_text(json.dumps(doc))


def claim_older_parent(snapshot: Path) -> None:
    manifest = snapshot / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["prev_snapshot_id"] = "step-0000000000"
    manifest.write_text(json.dumps(doc))


def fault_shard(edit: Callable[[Path], None], expect: str) -> Callable[[Harness, Row], None]:
    return lambda h, row: _refused_then_repaired(h, row, edit, expect)


def fault_unsigned(h: Harness, row: Row) -> None:
    served, before = h.status()["current_step"], h.status()["failures"]
    step = h.step + 1
    signed = h.prepare(h.model())
    h.step -= 1
    unsigned = h.prepare(h.model(), signed=False)
    assert h.step == step
    h.commit(unsigned)
    st = h.wait(lambda s: s["failures"] > before)
    row.status = (st or {}).get("last_error") or "(no error reported)"
    h.check_serving(row)
    ok = st is not None and "not signed" in row.status and st["current_step"] == served
    shutil.rmtree(h.snapshot_dir(h.store))
    h.commit(signed)
    st = h.wait(lambda s: s["current_step"] == h.step and s["last_error"] is None)
    row.converged, row.served_after = ok and st is not None, h.status()["current_snapshot_id"]


def fault_gap(h: Harness, row: Row) -> None:
    served, before = h.status()["current_step"], h.status()["failures"]
    scratch = h.prepare(h.model())
    h.publish(scratch, h.step + 1, h.models[0])
    h.step += 1
    h.commit(scratch, h.step)  # step N+1 without step N
    st = h.wait(lambda s: s["failures"] > before)
    row.status = (st or {}).get("last_error") or "(no error reported)"
    h.check_serving(row)
    ok = st is not None and f"step-{h.step - 1:010d}" in row.status and st["current_step"] == served
    h.commit(scratch, h.step - 1)
    h.commit(scratch, h.step)
    st = h.wait(lambda s: s["current_step"] == h.step and s["last_error"] is None)
    row.converged, row.served_after = ok and st is not None, h.status()["current_snapshot_id"]


def fault_missing_base(h: Harness, row: Row) -> None:
    served = h.status()["current_step"]
    base = h.store / "snapshots" / "step-0000000000"
    aside = h.work / "base-aside"
    shutil.move(base, aside)
    code = h.post("resync")
    st = h.status()
    row.status = f"resync HTTP {code}: {st['last_error']}"
    h.check_serving(row)
    ok = code == 502 and st["current_step"] == served
    shutil.move(aside, base)
    code = h.post("resync")
    st = h.wait(lambda s: s["current_step"] == h.step and s["last_error"] is None)
    row.converged, row.served_after = ok and code == 200 and st is not None, h.status()["current_snapshot_id"]


def _misfit(h: Harness, row: Row, change: Callable[[dict], None]) -> None:
    served, before = h.status()["current_step"], h.status()["failures"]
    weights = load_file(str(h.models[0] / "model.safetensors"))
    change(weights)
    bad = h.work / f"misfit-{h.step}"
    bad.mkdir()
    save_file(weights, str(bad / "model.safetensors"))
    shutil.copy(h.models[0] / "config.json", bad / "config.json")
    h.step += 1
    h.publish(h.store, h.step, bad)
    st = h.wait(lambda s: s["failures"] > before)
    row.status = (st or {}).get("last_error") or "(no error reported)"
    h.check_serving(row)
    ok = st is not None and "IncompatibleSnapshotError" in row.status and st["current_step"] == served
    h.step += 1
    h.publish(h.store, h.step, h.model(), base=True)  # the trainer publishes a good base again
    st = h.wait(lambda s: s["current_step"] == h.step and s["last_error"] is None)
    row.converged, row.served_after = ok and st is not None, h.status()["current_snapshot_id"]


def fault_shape(h: Harness, row: Row) -> None:
    name = "lm_head.weight"
    _misfit(h, row, lambda w: w.update({name: w[name][:-1].clone()}))


def fault_unknown_names(h: Harness, row: Row) -> None:
    _misfit(h, row, lambda w: w.update({"model.layers.0.mlp.extra_proj.weight": w["lm_head.weight"].clone()}))


def fault_future_head(h: Harness, row: Row) -> None:
    served, before = h.status()["current_step"], h.status()["failures"]
    head_path = h.store / store_keys.HEAD_KEY
    head = head_path.read_text()
    head_path.write_text(json.dumps({**json.loads(head), "step": 10**12}))
    st = h.wait(lambda s: s["failures"] > before)
    row.status = (st or {}).get("last_error") or "(no error reported)"
    h.check_serving(row)
    ok = st is not None and "claims step" in row.status and st["current_step"] == served
    head_path.write_text(head)
    scratch = h.prepare(h.model())
    h.commit(scratch)
    st = h.wait(lambda s: s["current_step"] == h.step and s["last_error"] is None)
    row.converged, row.served_after = ok and st is not None, h.status()["current_snapshot_id"]


def _killed_during(phases: tuple[str, ...]) -> Callable[[Harness, Row], None]:
    def run(h: Harness, row: Row) -> None:
        hit = None
        for _ in range(20):  # a tiny model's update lasts milliseconds: retry until a poll lands in one
            scratch = h.prepare(h.model())
            h.commit(scratch)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and hit is None:
                st = h.status()
                if st["update_phase"] in phases:
                    hit = st["update_phase"]
                    h.kill()
                elif st["current_step"] == h.step:
                    break
            if hit:
                break
        row.status = f"killed during {hit or 'no observed ' + '/'.join(phases) + ' (killed after)'}"
        if h.server is not None:
            h.kill()
        h.start()  # from the checkpoint it was started with; it must catch up to one snapshot
        h.check_serving(row)
        st = h.status()
        row.converged = st["current_step"] == h.step and st["last_error"] is None
        row.served_after = st["current_snapshot_id"]

    return run


def fault_staging_full(h: Harness, row: Row) -> None:
    """A server starts while its staging folder (where the weight arenas and staged files go) is
    full: it serves the checkpoint it started from and says why it cannot follow; once there is
    room it catches up."""
    if h.staging is None:
        row.status, row.note = "skipped", "no tmpfs staging folder (needs root to mount one)"
        return
    h.stop()
    for leftover in h.staging.glob("delta-swap-*"):
        leftover.unlink()
    subprocess.run(["mount", "-o", "remount,size=16k", str(h.staging)], check=True)
    try:
        h.commit(h.prepare(h.model()))
        h.start(wait=False)
        st = h.wait(lambda s: s["failures"] > 0 or s["current_step"] == h.step, 120)
        row.status = (st or {}).get("last_error") or f"(no error: swap path {(st or {}).get('swap_path')})"
        h.check_serving(row)
    finally:
        subprocess.run(["mount", "-o", "remount,size=256m", str(h.staging)], check=True)
    h.post("notify")
    st = h.wait(lambda s: s["current_step"] == h.step and s["last_error"] is None, 120)
    row.converged, row.served_after = st is not None, h.status()["current_snapshot_id"]
    row.note = f"swap path afterwards: {h.status().get('swap_path')}"


def fault_outage(h: Harness, row: Row) -> None:
    served = h.status()["current_step"]
    offline = h.work / "store-offline"
    h.store.rename(offline)
    generated = 0
    deadline = time.monotonic() + h.outage_s
    try:
        while time.monotonic() < deadline:
            h.generation_versions()
            generated += 1
            time.sleep(1)
        st = h.status()
        row.status = f"{st['last_error']} ({generated} completions during {h.outage_s:.0f} s)"
        h.check_serving(row)
    finally:
        offline.rename(h.store)
    ok = "missing" in (st["last_error"] or "") and st["current_step"] == served
    scratch = h.prepare(h.model())
    h.commit(scratch)
    st2 = h.wait(lambda s: s["current_step"] == h.step and s["last_error"] is None, 120)
    row.converged, row.served_after = ok and st2 is not None, h.status()["current_snapshot_id"]


def fault_resync_storm(h: Harness, row: Row) -> None:
    served = h.status()["current_step"]
    with ThreadPoolExecutor(50) as pool:
        codes = list(pool.map(lambda _: h.post("resync"), range(50)))
    unauthorized = h.post("resync", token=None)
    row.status = (
        f"{codes.count(200)}x200 {codes.count(409)}x409 others={[c for c in codes if c not in (200, 409)]}; "
        f"no token: {unauthorized}"
    )
    h.check_serving(row)
    st = h.wait(lambda s: s["current_step"] == served and s["last_error"] is None)
    row.converged = st is not None and set(codes) <= {200, 409} and unauthorized == 401
    row.served_after = h.status()["current_snapshot_id"]


def fault_tampered_without_key(h: Harness, row: Row) -> None:
    """Without a trusted key a consistent forgery is accepted: this row documents the limit."""
    h.trusted = False
    h.stop()
    h.start()
    before = h.status()["updates_applied"]
    _, pristine = _tamper(h, forge_weights)
    st = h.wait(lambda s: s["updates_applied"] > before or s["failures"] > 0)
    row.status = "accepted the forged snapshot (no trusted key: checksums catch corruption, not forgery)"
    h.check_serving(row)
    row.converged = st is not None and st["current_step"] == h.step
    row.served_after = h.status()["current_snapshot_id"] + " (forged)"
    row.note = "expected: sign snapshots in production"


def fault_other_run(h: Harness, row: Row) -> None:
    """A base and a delta of another run, signed with the trainer's key, copied in as the next
    two steps with HEAD on them (issue #29): the server stays on its run."""
    served, before = h.status()["current_step"], h.status()["failures"]
    other = Path(tempfile.mkdtemp(dir=h.work, prefix="other-run-"))
    first = h.step + 1
    h.publish(other, first, h.model(), base=True)  # an empty store: a new run
    h.publish(other, first + 1, h.models[0])
    h.step = first + 1
    h.commit(other, first, head=False)
    h.commit(other, first + 1)
    st = h.wait(lambda s: s["failures"] > before)
    row.status = (st or {}).get("last_error") or "(no error reported)"
    h.check_serving(row)
    ok = st is not None and "run" in row.status and st["current_step"] == served
    (h.store / store_keys.HEAD_KEY).write_text(json.dumps({"snapshot_id": f"step-{served:010d}", "step": served}))
    for step in (first, first + 1):
        shutil.rmtree(h.snapshot_dir(h.store, step))
    h.commit(h.prepare(h.model()))
    st = h.wait(lambda s: s["current_step"] == h.step and s["last_error"] is None)
    row.converged, row.served_after = ok and st is not None, h.status()["current_snapshot_id"]


def fault_restart_rollback(h: Harness, row: Row) -> None:
    """The server restarts while HEAD names an older, validly signed snapshot (the base): it does
    not go back (it serves the checkpoint it started from and says why) until HEAD moves on."""
    served = h.status()["current_step"]
    head_path = h.store / store_keys.HEAD_KEY
    head = head_path.read_text()
    head_path.write_text(json.dumps({"snapshot_id": "step-0000000000", "step": 0}))
    h.stop()
    h.start(wait=False)
    st = h.wait(lambda s: s["failures"] > 0, 120)
    row.status = (st or {}).get("last_error") or "(no error reported)"
    h.check_serving(row)
    ok = st is not None and "allow_older" in row.status and st["current_step"] in (None, served)
    head_path.write_text(head)
    h.post("notify")
    st = h.wait(lambda s: s["current_step"] == h.step and s["last_error"] is None, 120)
    row.converged, row.served_after = ok and st is not None and served == h.step, h.status()["current_snapshot_id"]


def fault_frozen_head(h: Harness, row: Row) -> None:
    """Two newer snapshots and the trainer's heartbeat reach the store, HEAD is held back: the
    server stays where it is but reports the staleness (published_step_seen, staleness_steps)."""
    served = h.status()["current_step"]
    scratch = h.prepare(h.model())
    h.step += 1
    h.publish(scratch, h.step, h.models[0])
    h.commit(scratch, h.step - 1, head=False)
    h.commit(scratch, h.step, head=False)
    shutil.copy(scratch / store_keys.HEARTBEAT_KEY, h.store / store_keys.HEARTBEAT_KEY)
    st = h.wait(lambda s: s["published_step_seen"] == h.step, 60)
    st = st or h.status()
    row.status = (
        f"published_step_seen={st['published_step_seen']} staleness_steps={st['staleness_steps']} "
        f"trainer_seen_seconds={st['trainer_seen_seconds']} current_step={st['current_step']}"
    )
    h.check_serving(row)
    ok = (
        st["published_step_seen"] == h.step
        and st["staleness_steps"] == h.step - served == 2
        and st["current_step"] == served
    )
    shutil.copy(scratch / store_keys.HEAD_KEY, h.store / store_keys.HEAD_KEY)
    st2 = h.wait(lambda s: s["current_step"] == h.step and s["last_error"] is None and s["staleness_steps"] == 0)
    row.converged, row.served_after = ok and st2 is not None, h.status()["current_snapshot_id"]


def fault_post_without_token(h: Harness, row: Row) -> None:
    """POST /notify and /resync without the admin token, or with a wrong one: refused."""
    served, resync_before = h.status()["current_step"], h.status()["last_resync"]
    codes = {
        f"{route} {label}": h.post(route, token=token)
        for route in ("notify", "resync")
        for label, token in (("no token", None), ("wrong token", "wrong"))
    }
    row.status = ", ".join(f"{k}: {v}" for k, v in codes.items())
    h.check_serving(row)
    st = h.status()
    row.converged = set(codes.values()) == {401} and st["current_step"] == served and st["last_resync"] == resync_before
    row.served_after = st["current_snapshot_id"]


FAULTS: dict[str, Callable[[Harness, Row], None]] = {
    "corrupted shard byte": fault_shard(flip_shard_byte, "mismatch"),
    "truncated shard": fault_shard(truncate_shard, "bytes"),
    "missing shard": fault_shard(remove_shard, "not found"),
    "tampered manifest, checksums recomputed (trusted key)": fault_shard(forge_weights, "signature"),
    "unsigned snapshot (trusted key set)": fault_unsigned,
    "wrong prev id": fault_shard(claim_older_parent, "signature"),
    "gap in the chain": fault_gap,
    "missing base (resync)": fault_missing_base,
    "shape mismatch": fault_shape,
    "unknown tensor names": fault_unknown_names,
    "HEAD claims a future step": fault_future_head,
    "process killed while staging": _killed_during(("fetch", "stage")),
    "process killed while swapping": _killed_during(("pause", "swap", "resume")),
    "staging disk full": fault_staging_full,
    "store unreachable": fault_outage,
    "resync storm (50 concurrent)": fault_resync_storm,
    "snapshot of another run, same key (#29)": fault_other_run,
    "restart while HEAD names an older signed snapshot (#29)": fault_restart_rollback,
    "HEAD frozen while the trainer publishes (#29)": fault_frozen_head,
    "POST without the admin token (#29)": fault_post_without_token,
    "tampered manifest, checksums recomputed (no key)": fault_tampered_without_key,
}


# ---------------------------------------------------------------------- driver


def run_engine(engine: str, work: Path, models: list[Path], faults: list[str], outage_s: float) -> list[Row]:
    h = Harness(engine, work, models, outage_s)
    h.publish(h.store, 0, models[0])
    staging = work / "staging"
    staging.mkdir()
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(staging)], check=False)
        h.staging = staging if mounted.returncode == 0 else None
    rows = []
    try:
        h.start()
        # A cold codec compile (the first server of an environment) would land in the first row.
        h.wait(lambda s: bool(s["codec_ready"]), 300)
        for name in faults:
            row = Row(name, engine)
            started = time.monotonic()
            try:
                if h.server is None:
                    h.start()
                FAULTS[name](h, row)
            except Exception as exc:  # a row that breaks the harness is reported, not hidden
                row.note = f"harness error: {type(exc).__name__}: {exc}"[:120]
            row.note = (row.note + f" [{time.monotonic() - started:.0f}s]").strip()
            rows.append(row)
            print(_format(row), flush=True)
    finally:
        h.stop()
        if h.staging is not None:
            subprocess.run(["umount", str(staging)], check=False)
    return rows


def _format(row: Row) -> str:
    yes = {True: "yes", False: "NO"}
    return (
        f"| {row.fault} | {row.engine} | {yes[row.generating]} | {yes[row.consistent]} | "
        f"{row.status[:110]} | {yes[row.converged]} | {row.served_after} | {row.note} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["vllm", "sglang", "both"], default="both")
    parser.add_argument("--only", nargs="*", choices=list(FAULTS), help="run these faults only")
    parser.add_argument("--outage", type=float, default=120.0, help="seconds the store stays unreachable")
    parser.add_argument("--workdir", help="where models, stores and logs go (default: a temp dir)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-faults-"))
    # ~85 MB of bf16 weights: large enough that an update lasts long enough to kill a server in it.
    models = [
        make_tiny_model(
            work / "models" / "m0", hidden_size=768, num_layers=6, num_heads=12, num_kv_heads=4, intermediate_size=2048
        )
    ]
    for i in range(1, 3):
        models.append(perturb_weights(models[-1], work / "models" / f"m{i}", seed=i, fraction=0.25))
    faults = args.only or list(FAULTS)
    print(
        "| fault | engine | kept generating | one consistent version | status says | converged | serves after | note |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for engine in ["vllm", "sglang"] if args.engine == "both" else [args.engine]:
        rows += run_engine(engine, work / engine, models, faults, args.outage)
    bad = [
        r
        for r in rows
        if not (r.converged and r.generating and r.consistent) and r.status != "skipped" and "no key" not in r.fault
    ]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} rows as expected; logs in {work}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
