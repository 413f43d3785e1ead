"""Engine-agnostic pieces of the engine tests: talk to ``/delta_swap/status``, publish checkpoints,
and play the scenarios every adapter must survive (bad snapshots, untrusted inputs, swaps under
load). The engine test modules supply how to check that a server still serves the last good
weights. Servers run with a trusted key and an admin token (:class:`Credentials`), as in
production; publishers sign."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from delta_swap import store_keys
from delta_swap.chain import encode_head
from delta_swap.manifest import Manifest, snapshot_id_for_step
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.signing import generate_keypair
from delta_swap.stores.file import FileStore
from delta_swap.testing.engine_exactness import status, wait_for
from examples.servers.process import Server
from tests.support.sse import data_documents, sse_lines


@dataclass(frozen=True)
class Credentials:
    """The trainer's signing key, the servers' trusted key and admin token of one test module."""

    signing_key: Path
    trusted_key: Path
    admin_token: str

    @classmethod
    def make(cls, folder: Path) -> Credentials:
        key, pub = generate_keypair(folder / "trainer.key")
        return cls(key, pub, "test-admin-token-" + folder.name)

    def settings(self) -> dict[str, str]:
        """The delta-swap settings a server is started with."""
        return {"trusted_key": str(self.trusted_key), "admin_token": self.admin_token}

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}


def publish_dirs(store: Path, steps: list[tuple[int, Path]], creds: Credentials | None) -> None:
    """Publish checkpoint folders as the given steps, as a trainer would (signed with ``creds``)."""
    key = str(creds.signing_key) if creds else None
    with Publisher(str(store), PublisherConfig(base_every=1000, signing_key=key)) as pub:
        for step, ckpt in steps:
            pub.publish(step, load_file(str(ckpt / "model.safetensors")))


def put_head(store: Path, data: bytes) -> None:
    """Replace the live store's HEAD through the file store, which writes whole files (a poll
    never reads half of one)."""
    asyncio.run(FileStore(store).put(store_keys.HEAD_KEY, data))


def put_snapshot(store: Path, source: Path) -> None:
    """Add the snapshot folder ``source`` to a live store in one rename (a poll never sees a
    manifest whose files are still on their way)."""
    staging = store.parent / f".staging-{source.name}"
    shutil.copytree(source, staging)
    os.rename(staging, store / store_keys.snapshot_prefix(source.name))


@contextmanager
def undone_on_failure(store: Path) -> Iterator[None]:
    """On an exception, put the live store back as it was (HEAD and the snapshot folders), so one
    failed scenario does not leave a bad snapshot that fails the tests after it."""
    head = (store / store_keys.HEAD_KEY).read_bytes()
    before = set((store / store_keys.SNAPSHOTS_PREFIX).iterdir())
    try:
        yield
    except BaseException:
        put_head(store, head)
        for folder in set((store / store_keys.SNAPSHOTS_PREFIX).iterdir()) - before:
            shutil.rmtree(folder)
        raise


def stage_tampered(
    store: Path, scratch: Path, step: int, model: Path, tamper: Callable[[Path], None], creds: Credentials | None
) -> None:
    """Publish ``step`` into a copy of the store, damage it, then commit it to the live store
    as the publisher does (the snapshot's files, then HEAD)."""
    shutil.copytree(store, scratch, dirs_exist_ok=True)
    publish_dirs(scratch, [(step, model)], creds)
    snapshot = scratch / store_keys.snapshot_prefix(snapshot_id_for_step(step))
    tamper(snapshot)
    put_snapshot(store, snapshot)
    put_head(store, (scratch / store_keys.HEAD_KEY).read_bytes())


def drop_snapshot(store: Path, step: int, head_step: int) -> None:
    """Point HEAD back at ``head_step`` and remove a snapshot again (ids are never reused)."""
    manifest = Manifest.from_json((store / store_keys.manifest_key(snapshot_id_for_step(head_step))).read_bytes())
    put_head(store, encode_head(manifest))
    shutil.rmtree(store / store_keys.snapshot_prefix(snapshot_id_for_step(step)))


def flip_a_shard_bit(snapshot: Path) -> None:
    shard = next(snapshot.glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x04
    shard.write_bytes(bytes(data))


def claim_to_follow_step_2(snapshot: Path) -> None:
    manifest = snapshot / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["prev_snapshot_id"] = "step-0000000002"
    manifest.write_text(json.dumps(doc))


def bad_snapshots_never_reach_the_model(
    url: str, store: Path, models: dict[str, Path], tmp_path: Path, serves_d: Callable[[], None], creds: Credentials
) -> None:
    """From a server on step 3 (model D): a corrupt delta (step 4), an out-of-order one whose
    manifest was edited (5: its signature no longer matches) and a missing link (7 without 6) are
    all refused while ``serves_d`` keeps passing; once step 6 shows up the server catches up to 7
    (D's weights again) by itself. If it fails, the store is put back and steps 6 and 7 are
    published intact, so the tests after it still start from step 7."""
    try:
        with undone_on_failure(store):
            _bad_snapshots(url, store, models, tmp_path, serves_d, creds)
    except BaseException:
        try:  # best effort: the original failure is the one to report
            publish_dirs(store, [(6, models["E"]), (7, models["D"])], creds)
            wait_for(url, lambda s: s["current_step"] == 7)
        except Exception:
            pass
        raise


def _bad_snapshots(
    url: str, store: Path, models: dict[str, Path], tmp_path: Path, serves_d: Callable[[], None], creds: Credentials
) -> None:
    before = status(url)["failures"]
    stage_tampered(store, tmp_path / "s1", 4, models["E"], flip_a_shard_bit, creds)
    st = wait_for(url, lambda s: s["failures"] > before)
    assert st["current_step"] == 3 and st["newest_step"] == 4 and st["staleness_steps"] == 1
    assert "ChecksumMismatchError" in st["last_error"]
    assert 'delta_swap_failures_total{kind="checksum"' in httpx.get(f"{url}/metrics", timeout=30).text
    serves_d()

    drop_snapshot(store, 4, head_step=3)
    before = status(url)["failures"]
    stage_tampered(store, tmp_path / "s2", 5, models["E"], claim_to_follow_step_2, creds)
    st = wait_for(url, lambda s: s["failures"] > before)
    assert st["current_step"] == 3 and st["last_error_kind"] == "signature", st["last_error"]
    drop_snapshot(store, 5, head_step=3)

    scratch = tmp_path / "s3"
    shutil.copytree(store, scratch)
    publish_dirs(scratch, [(6, models["E"]), (7, models["D"])], creds)
    before = status(url)["failures"]
    put_snapshot(store, scratch / store_keys.snapshot_prefix(snapshot_id_for_step(7)))
    put_head(store, (scratch / store_keys.HEAD_KEY).read_bytes())
    st = wait_for(url, lambda s: s["failures"] > before)
    assert st["current_step"] == 3 and "step-0000000006" in st["last_error"]
    serves_d()

    put_snapshot(store, scratch / store_keys.snapshot_prefix(snapshot_id_for_step(6)))
    st = wait_for(url, lambda s: s["current_step"] == 7)
    assert st["last_error"] is None
    serves_d()


def untrusted_inputs_never_reach_the_model(
    url: str,
    store: Path,
    models: dict[str, Path],
    tmp_path: Path,
    serves_d: Callable[[], None],
    creds: Credentials,
    served: int,
    step: int,
) -> None:
    """From a server on step ``served`` (model D), with a trusted key and an admin token: an
    unsigned snapshot (as ``step``), a HEAD that claims a future step, POSTs without the token
    and a storm of 50 concurrent resyncs all leave it serving D, and status says what happened."""
    with undone_on_failure(store):
        before = status(url)["failures"]
        stage_tampered(store, tmp_path / "unsigned", step, models["E"], lambda snapshot: None, None)
        st = wait_for(url, lambda s: s["failures"] > before)
        assert st["current_step"] == served and st["last_error_kind"] == "signature", st
        assert "not signed" in st["last_error"], st["last_error"]
        serves_d()
        drop_snapshot(store, step, head_step=served)

        before = status(url)["failures"]
        head = json.loads((store / store_keys.HEAD_KEY).read_text())
        put_head(store, json.dumps({**head, "step": 10**12}).encode())  # a future step
        st = wait_for(url, lambda s: s["failures"] > before)
        assert st["current_step"] == served and "claims step" in st["last_error"]
        serves_d()
        put_head(store, json.dumps(head).encode())

        for route in ("resync", "notify"):
            assert httpx.post(f"{url}/delta_swap/{route}", timeout=30).status_code == 401
            assert (
                httpx.post(
                    f"{url}/delta_swap/{route}", headers={"Authorization": "Bearer wrong"}, timeout=30
                ).status_code
                == 401
            )
        updates_before = status(url)["updates_applied"]
        with ThreadPoolExecutor(50) as pool:
            codes = list(
                pool.map(
                    lambda _: httpx.post(f"{url}/delta_swap/resync", headers=creds.headers(), timeout=300).status_code,
                    range(50),
                )
            )
        # Resyncs never overlap: the calls that arrive while one runs get 409, each 200 is one resync.
        assert set(codes) <= {200, 409} and codes.count(409) >= 1 and codes.count(200) >= 1, codes
        st = wait_for(url, lambda s: s["current_step"] == served and s["last_error"] is None)
        assert st["updates_applied"] - updates_before == codes.count(200)
        assert st["last_resync"]["ok"] and st["last_resync"]["to_step"] == served
        serves_d()


def swaps_under_load(
    server: Server,
    store: Path,
    weights: dict,
    request: Callable[[httpx.Client, int], object],
    first_step: int,
    creds: Credentials,
    swaps: int = 20,
) -> dict:
    """Publish ``swaps`` RL-sized updates of ``weights`` one after another, each applied before the
    next, while two clients keep calling ``request``; no request may fail. Returns the status.

    Each request goes out on a new connection. On a reused one, a server whose event loop stalls
    for the keep-alive timeout (5 s) right after answering closes that connection as idle before
    it reads the next request, already sent: httpx's "Server disconnected without sending a
    response". CI met that twice in one run of ~16,000 requests on a loaded host (20 swaps took
    300 s there, 60 s here; one request took 49 s). That race belongs to HTTP keep-alive; with one
    connection per request it cannot happen, so every closed connection fails the test.

    On a failed request it says when it failed, how long its client had been idle before it and
    how long it ran, beside the slowest request, the swap timings and the server log's lines
    other than the access log."""
    url = server.url
    gen = torch.Generator().manual_seed(0)
    stop = threading.Event()
    t0 = time.monotonic()
    calls: list[tuple[int, float, float, float, str | None]] = []  # client, idle before, start, end, error

    def client(k: int) -> None:
        last_end = time.monotonic()
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:  # a new connection each
            while not stop.is_set():
                start, error = time.monotonic(), None
                try:
                    request(c, len(calls))
                except Exception as exc:  # recorded, asserted below
                    error = repr(exc)
                end = time.monotonic()
                calls.append((k, start - last_end, start - t0, end - t0, error))
                last_end = end

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    start_updates = status(url)["updates_applied"]
    published: list[tuple[int, float, float]] = []  # step, published at, serving at
    try:
        with Publisher(str(store), PublisherConfig(base_every=20, signing_key=str(creds.signing_key))) as pub:
            for step in range(first_step, first_step + swaps):
                for w in weights.values():  # an RL-sized nudge: a few ULPs on ~2% of elements
                    mask = torch.rand(w.shape, generator=gen) < 0.02
                    bits = w.view(torch.int16)
                    bits[mask] += torch.randint(-2, 3, (int(mask.sum()),), generator=gen, dtype=torch.int16)
                pub.publish(step, weights)
                pub.flush()
                at = time.monotonic() - t0
                wait_for(url, lambda s, step=step: s["current_step"] == step, timeout=60)
                published.append((step, at, time.monotonic() - t0))
    finally:
        stop.set()
        for t in threads:
            t.join()
    st = status(url)
    assert st["updates_applied"] - start_updates >= swaps and st["last_error"] is None
    failed = [c for c in calls if c[4] is not None]
    slowest = max(calls, key=lambda c: c[3] - c[2], default=None)
    most_idle = max(calls, key=lambda c: c[1], default=None)
    print(f"{len(calls)} requests over {swaps} swaps; slowest {slowest}; longest idle before one {most_idle}")
    if not calls or failed:
        first = min(c[2] for c in failed) if failed else None
        lines = [f"{len(failed)} of {len(calls)} requests failed (client, idle before s, start s, end s, error):"]
        lines += [f"  {c}" for c in failed[:5]]
        lines += [
            f"slowest request: {slowest}",
            f"longest idle before a request: {most_idle}",
            f"steps (step, published s, serving s) near the failures: "
            f"{[p for p in published if first is not None and abs(p[1] - first) < 10]}",
            f"last update timings: {st['last_update_timings_s']}",
            "server log, access lines left out:",
        ]
        log = server.log_path.read_text(errors="replace").splitlines()
        lines += [line for line in log if '" 200 OK' not in line][-60:]
        raise AssertionError("\n".join(lines))
    return st


def openai_routes_tag_the_weight_version(url: str, model: str, version: str) -> None:
    """/v1/completions and /v1/chat/completions, plain and streaming, say which snapshot produced
    each choice (headers, per-choice spans, the finishing chunk of a stream)."""
    completion = {"model": model, "prompt": "the model", "max_tokens": 6, "temperature": 1.0, "seed": 0, "n": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "swap"}], "max_tokens": 6, "temperature": 0.0}
    for route, body in (("completions", completion), ("chat/completions", chat)):
        r = httpx.post(f"{url}/v1/{route}", json=body, timeout=300)
        r.raise_for_status()
        assert r.headers["x-weight-version"] == version, r.headers
        for choice in r.json()["choices"]:
            spans = choice["weight_versions"]
            assert [s["version"] for s in spans] == [version] and spans[0]["start"] == 0, spans
        with httpx.stream("POST", f"{url}/v1/{route}", json={**body, "stream": True}, timeout=300) as s:
            assert s.headers["x-weight-version"] == version
            events = list(data_documents(sse_lines(s.iter_text())))
        finishing = [c for e in events for c in e["choices"] if c.get("finish_reason")]
        assert finishing and all(c["weight_versions"][-1]["version"] == version for c in finishing), finishing
