"""The SGLang adapter against a real SGLang 0.5.23 server (CPU) with the ``delta_swap`` plugin.

SGLang runs in its own cached environment (``scripts/sglang_env.sh``, see docs/SGLANG.md), which
includes a CPU test shim standing in for ``sgl_kernel``; the last tests check that none of the
shim's functions was ever called. One plugin server runs for the whole module and follows a local
store; the trainer side publishes with the real Publisher. Reference outputs come from fresh
SGLang servers (plugin disabled) started directly on the target checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from delta_swap import codec
from examples.servers import sglang as sglang_server
from examples.tiny_model import make_tiny_model, perturb_weights
from tests.support.rollout_scenarios import (
    Credentials,
    bad_snapshots_never_reach_the_model,
    drop_snapshot,
    openai_routes_tag_the_weight_version,
    publish_dirs,
    stage_tampered,
    status,
    swaps_under_load,
    undone_on_failure,
    untrusted_inputs_never_reach_the_model,
    wait_for,
)
from tests.support.sse import sse_lines

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
SHIMMED = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)
PROMPTS = [
    [5, 17, 99, 230, 41],
    [300, 301, 302, 7, 8, 9, 10],
    [42] * 3 + [77, 78, 79, 12],
    list(np.random.default_rng(0).integers(3, 500, size=300)),  # long: exercises the radix cache
]
#: SGLang computes this tiny model robustly enough that a 2% nudge leaves greedy outputs as they
#: were; a quarter of the elements moved by 1-3 ULP changes them and still publishes as deltas.
PERTURB_FRACTION = 0.25
#: Tokens of a request that is still running when a swap is asked for (3 of them fit the KV pool).
LONG = 600


@pytest.fixture(scope="module")
def sglang_python() -> str:
    """The SGLang environment's interpreter (built once by scripts/sglang_env.sh, then cached)."""
    python = sglang_server.python()
    probe = (
        "from importlib.metadata import entry_points\n"
        "print([e.value for e in entry_points(group='sglang.srt.plugins') if e.name == 'delta_swap'])"
    )
    registered = subprocess.run([python, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert "sglang_delta_plugin.plugin:register" in registered, (
        "pyproject.toml lacks the sglang.srt.plugins entry point"
    )
    return python


@pytest.fixture(scope="module")
def shim_log(tmp_path_factory) -> Path:
    """Where the sgl_kernel CPU test shim records any call (every server of this module)."""
    return tmp_path_factory.mktemp("shim") / "sgl_kernel-calls.log"


def generate_raw(url: str, prompt: list[int], max_tokens: int = 12, client: httpx.Client | None = None) -> dict:
    """Greedy generation through SGLang's native route; its outputs tag weight versions."""
    body = {
        "input_ids": [int(t) for t in prompt],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    r = (client or httpx).post(f"{url}/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


def generate_streamed(
    url: str, prompt: list[int], max_tokens: int, started: threading.Event, barrier: threading.Barrier | None = None
) -> dict:
    """Like generate_raw, streamed: ``started`` is set once the first tokens arrived; returns the
    final chunk (cumulative output ids, meta_info with the weight-version spans). With a
    ``barrier``, the request is sent once every party's client is ready (making a client takes
    up to seconds on a loaded machine: one CI run's first request ended before the others began)."""
    body = {
        "input_ids": [int(t) for t in prompt],
        "stream": True,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    last: dict = {}
    with httpx.Client(timeout=300) as client:
        if barrier is not None:
            barrier.wait(120)
        with client.stream("POST", f"{url}/generate", json=body) as r:
            r.raise_for_status()
            for line in sse_lines(r.iter_text()):
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
                    if last.get("output_ids"):
                        started.set()
    return last


def generate(url: str, prompt: list[int], max_tokens: int = 12, client: httpx.Client | None = None) -> dict:
    """Like generate_raw, for a request that must run to its length."""
    out = generate_raw(url, prompt, max_tokens, client)
    meta = out["meta_info"]
    if meta["finish_reason"]["type"] != "length" or len(out["output_ids"]) != max_tokens:
        raise AssertionError(f"request did not complete: {meta['finish_reason']}")
    return {
        "token_ids": out["output_ids"],
        "weight_versions": meta["weight_versions"],
        "logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]],
    }


def greedy(url: str) -> list[tuple[list[int], list[float]]]:
    """Token ids and their logprobs for every prompt: stale KV can keep tokens but not logprobs."""
    outs = [generate(url, p) for p in PROMPTS]
    return [(o["token_ids"], o["logprobs"]) for o in outs]


def weight_checksums(url: str) -> dict[str, str]:
    """SGLang's own per-parameter checksums of the weights its scheduler holds."""
    r = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, timeout=60)
    r.raise_for_status()
    return r.json()["ranks"][0]["checksums"]


def kind(store: Path, step: int) -> str:
    return json.loads((store / "snapshots" / f"step-{step:010d}" / "manifest.json").read_text())["kind"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {"A": make_tiny_model(root / "A")}
    for prev, name, seed in (("A", "B", 1), ("B", "C", 2), ("C", "D", 3), ("D", "E", 4)):
        out[name] = perturb_weights(out[prev], root / name, seed=seed, fraction=PERTURB_FRACTION)
    return out


@pytest.fixture(scope="module")
def references(models, sglang_python, shim_log, tmp_path_factory) -> dict[str, dict]:
    """Greedy outputs and weight checksums of fresh plain SGLang servers started on A, B and D."""
    tmp = tmp_path_factory.mktemp("ref")
    out = {}
    for name in ("A", "B", "D"):
        server = sglang_server.start(
            models[name], tmp, plugin=False, served_name="tiny", shim_log=shim_log, log_name=f"ref-{name}.log"
        )
        try:
            out[name] = {"greedy": greedy(server.url), "weights": weight_checksums(server.url)}
        finally:
            server.stop()
    assert out["A"]["greedy"] != out["B"]["greedy"] != out["D"]["greedy"], "perturbations must change outputs"
    return out


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Credentials:
    """The trainer signs; the plugin server trusts its key and has an admin token (given as flags)."""
    return Credentials.make(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def live(models, references, sglang_python, shim_log, creds, tmp_path_factory):
    """The plugin server, started on A, following a store whose base is A."""
    tmp = tmp_path_factory.mktemp("live")
    store = tmp / "store"
    publish_dirs(store, [(0, models["A"])], creds)
    # drain_timeout: the wait-mode test lets 600-token requests finish, also on a busy CI machine.
    settings = {
        "store": store.as_uri(),
        "poll_interval": 0.2,
        "drain": "wait",
        "drain_timeout": 180,
        **creds.settings(),
    }
    server = sglang_server.start(
        models["A"],
        tmp,
        settings=settings,
        served_name="tiny",
        shim_log=shim_log,
        extra=["--enable-metrics"],
        log_name="live.log",
    )
    try:
        wait_for(server.url, lambda s: s["current_step"] == 0)
        yield server, store
    finally:
        server.stop()
        print(server.log_tail(40))


def test_the_plugin_adds_its_flags_to_sglangs_parser(sglang_python, shim_log) -> None:
    out = subprocess.run(
        [sglang_python, "-m", "sglang.launch_server", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **sglang_server.environment(shim_log=shim_log)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in (
        "--delta-swap-store",
        "--delta-swap-source",
        "--delta-swap-poll-interval",
        "--delta-swap-drain",
        "--delta-swap-drain-timeout",
        "--delta-swap-fetch-concurrency",
        "--delta-swap-replay-cost-ratio",
        "--delta-swap-staging-dir",
        "--delta-swap-trusted-key",
        "--delta-swap-admin-token",
        "--delta-swap-max-model-bytes",
        "--delta-swap-max-step-jump",
        "--delta-swap-recompute-kv",
    ):
        assert flag in out.stdout


def test_swaps_are_transactional_against_a_scripted_engine(sglang_python) -> None:
    """Refused loads roll back, misfits never reach SGLang, wait mode aborts after its timeout and
    always releases the lock, weights SGLang's AMX backend packed refuse every update (tests/support/sglang_adapter_probe.py: the core's apply_update and the
    real adapter with SGLang's real types, no server)."""
    out = subprocess.run(
        [sglang_python, str(ROOT / "tests" / "support" / "sglang_adapter_probe.py")],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    scenarios = [line[4:] for line in out.stdout.splitlines() if line.startswith("ok: ")]
    assert scenarios == [
        "swap",
        "rollback",
        "misfit",
        "wait timeout",
        "wait gives up on a stuck request",
        "wait keeps the lock granted mid-swap",
        "version only",
        "amx refused",
    ], out.stdout


@pytest.mark.parametrize("drain", ["keep", "abort"])
def test_keep_and_abort_drain_modes(drain, models, references, sglang_python, shim_log, tmp_path) -> None:
    """keep: running requests are retracted and continue on the new weights (KV recomputed);
    abort: they end with finish reason abort. Either way the server then serves the new weights.
    (Runs before the module's plugin server starts: an idle SGLang CPU scheduler spins on a core,
    and two servers on two cores slow each other down many times over.)"""
    store = tmp_path / "store"
    publish_dirs(store, [(0, models["A"])], None)  # unsigned: this server trusts no key and has no token
    # No token: the notify below comes from loopback, which the server must be told to allow.
    server = sglang_server.start(
        models["A"],
        tmp_path,
        served_name="tiny",
        shim_log=shim_log,
        # its own freshness record: the default one (per store URL, in the staging dir) outlives
        # this test's folder, and a rerun at the same path would find the last run's steps there
        extra=[
            "--delta-swap-source",
            store.as_uri(),
            "--delta-swap-drain",
            drain,
            "--delta-swap-freshness-file",
            str(tmp_path / "freshness.json"),
        ],
        env={"DELTA_SWAP_POLL_INTERVAL": "0.2", "DELTA_SWAP_ADMIN_OPEN_LOOPBACK": "1"},
    )
    try:
        st = wait_for(server.url, lambda s: s["current_step"] == 0)
        assert st["drain"] == drain  # from the flag; the poll interval came from the environment
        results = _swap_during_requests(server.url, store, 1, models["B"], None)
        for out in results:
            meta = out["meta_info"]
            if drain == "keep":
                assert meta["finish_reason"]["type"] == "length" and len(out["output_ids"]) == LONG
                versions = [span["version"] for span in meta["weight_versions"]]
                assert versions == ["step-0000000000", "step-0000000001"], meta["weight_versions"]
            else:
                assert meta["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < LONG, meta["finish_reason"]
        assert greedy(server.url) == references["B"]["greedy"]
        assert weight_checksums(server.url) == references["B"]["weights"]
    finally:
        server.stop()


def test_swap_matches_a_fresh_server_with_no_stale_radix_cache(live, models, references, creds) -> None:
    server, store = live
    assert greedy(server.url) == references["A"]["greedy"]  # also fills the radix cache with A's KV
    publish_dirs(store, [(1, models["B"])], creds)
    st = wait_for(server.url, lambda s: s["current_step"] == 1)
    assert st["current_snapshot_id"] == "step-0000000001" and st["weight_version"] == "step-0000000001"
    assert st["staleness_steps"] == 0 and st["last_error"] is None and st["authenticated"]
    assert set(st["last_update_timings_s"]) >= {"fetch", "decode", "verify", "stage", "pause", "swap"}
    assert weight_checksums(server.url) == references["B"]["weights"]
    assert greedy(server.url) == references["B"]["greedy"]
    out = generate(server.url, PROMPTS[0])
    assert out["weight_versions"] == [{"version": "step-0000000001", "start": 0, "end": 12}]
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text  # next to SGLang's own metrics
    assert "sglang:" in metrics and 'delta_swap_phase_seconds_count{phase="swap"' in metrics
    assert any(line.startswith("delta_swap_current_step{") and line.endswith(" 1.0") for line in metrics.splitlines())


def test_the_openai_routes_report_the_weight_version(live) -> None:
    server, _ = live
    st = status(server.url)
    assert st["swap_path"] == "arena"  # SGLang packs CPU weights only on AMX, which CI machines lack
    openai_routes_tag_the_weight_version(server.url, "tiny", st["current_snapshot_id"])


def test_a_chain_of_deltas_is_applied_in_order(live, models, references, creds) -> None:
    server, store = live
    publish_dirs(store, [(2, models["C"]), (3, models["D"])], creds)
    assert kind(store, 2) == kind(store, 3) == "delta"
    st = wait_for(server.url, lambda s: s["current_step"] == 3)
    assert st["last_update_path"][-1] == "step-0000000003"
    assert all(p.startswith("step-") for p in st["last_update_path"])
    assert weight_checksums(server.url) == references["D"]["weights"]
    assert greedy(server.url) == references["D"]["greedy"]


def test_corrupt_missing_or_out_of_order_deltas_never_reach_the_model(
    live, models, references, creds, tmp_path
) -> None:
    server, store = live

    def serves_d() -> None:
        assert greedy(server.url) == references["D"]["greedy"]

    bad_snapshots_never_reach_the_model(server.url, store, models, tmp_path, serves_d, creds)
    assert weight_checksums(server.url) == references["D"]["weights"]


def test_a_snapshot_that_does_not_fit_the_served_model_never_reaches_it(
    live, models, references, creds, tmp_path
) -> None:
    """Names, shapes and dtypes are checked before SGLang sees a byte (a failed load inside its
    scheduler would end the whole server)."""
    server, store = live
    weights = load_file(str(models["D"] / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"][:-1].clone()  # wrong shape
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(128, dtype=torch.bfloat16)  # unknown name
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(weights, str(bad / "model.safetensors"))
    before = status(server.url)["failures"]
    with undone_on_failure(store):
        stage_tampered(store, tmp_path / "s4", 8, bad, lambda snapshot: None, creds)
        st = wait_for(server.url, lambda s: s["failures"] > before)
        assert st["current_step"] == 7 and st["newest_step"] == 8
        assert "IncompatibleSnapshotError" in st["last_error"]
        assert "lm_head.weight" in st["last_error"] and "q_proj.bias" in st["last_error"]
        assert weight_checksums(server.url) == references["D"]["weights"]
        assert greedy(server.url) == references["D"]["greedy"]
        drop_snapshot(store, 8, head_step=7)


def test_resync_reloads_the_base_and_replays_the_chain(live, references, creds) -> None:
    server, _ = live
    r = httpx.post(f"{server.url}/delta_swap/resync", headers=creds.headers(), timeout=300)
    assert r.status_code == 200, r.text
    st = r.json()
    assert st["resynced"] and st["current_step"] == 7
    assert st["last_update_path"][0] == "step-0000000000"  # from the full base
    assert greedy(server.url) == references["D"]["greedy"]


def _swap_during_requests(
    url: str, store: Path, step: int, model: Path, creds: Credentials | None, *, n: int = 3, tokens: int = LONG
):
    """Start ``n`` long requests, publish ``step`` once each has produced tokens, return their final
    outputs."""
    # A fresh environment JIT-compiles the codec's kernels at start (~15 s of a core; numba's cache
    # is keyed by the checkout's path, so every new checkout compiles, and a loaded 2-core machine
    # took over 180 s once): wait for the server's decoder, and compile this process's encoder before
    # the requests (a fresh checkout running this module alone compiled it inside the publish below,
    # which outlasted them).
    wait_for(url, lambda s: s["codec_ready"], timeout=420)
    codec.warm_up()
    started = [threading.Event() for _ in range(n)]
    together = threading.Barrier(n)
    with ThreadPoolExecutor(n) as pool:
        # Prompts sharing no prefix with PROMPTS: KV that the radix cache keeps from these long runs
        # was computed in other batch shapes, which moves this chaotic tiny model's logits a little.
        futures = [
            pool.submit(generate_streamed, url, [2, 3 + i, 11, 13], tokens, started[i], together) for i in range(n)
        ]
        for event in started:
            assert event.wait(120), "a long request produced no token"
        assert not any(f.done() for f in futures), "a long request ended before the others had started"
        publish_dirs(store, [(step, model)], creds)
        httpx.post(f"{url}/delta_swap/notify", headers=creds.headers() if creds else {}, timeout=30).raise_for_status()
        results = [f.result() for f in futures]
    wait_for(url, lambda s: s["current_step"] == step)
    return results


def test_unsigned_snapshots_forged_heads_and_admin_abuse_never_reach_the_model(
    live, models, references, creds, tmp_path
) -> None:
    server, store = live

    def serves_d() -> None:
        assert greedy(server.url) == references["D"]["greedy"]

    untrusted_inputs_never_reach_the_model(server.url, store, models, tmp_path, serves_d, creds, served=7, step=9)
    assert weight_checksums(server.url) == references["D"]["weights"]


def test_in_flight_requests_finish_on_one_weight_version_in_wait_mode(live, models, creds) -> None:
    server, store = live
    # 8 was the misfit and 9 the unsigned snapshot: snapshot ids are never reused
    results = _swap_during_requests(server.url, store, 10, models["B"], creds)
    for out in results:
        assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == LONG
        assert len(out["meta_info"]["weight_versions"]) == 1, out["meta_info"]["weight_versions"]
    # They were running when the swap was asked for, and finished on the old weights first.
    assert {o["meta_info"]["weight_versions"][0]["version"] for o in results} == {"step-0000000007"}
    assert generate(server.url, PROMPTS[0])["weight_versions"][0]["version"] == "step-0000000010"


def test_twenty_swaps_under_steady_load_without_a_failed_request(live, models, creds) -> None:
    server, store = live
    weights = load_file(str(models["B"] / "model.safetensors"))

    def request(client: httpx.Client, i: int) -> None:
        generate(server.url, PROMPTS[i % 3], 8, client=client)

    st = swaps_under_load(server, store, weights, request, first_step=11, creds=creds)
    print(f"swap timings of the last update: {st['last_update_timings_s']}")


def test_the_cpu_kernel_shim_raises_and_records_any_call(sglang_python, tmp_path) -> None:
    """The stand-in ``sgl_kernel`` has no kernels: a call raises and is logged (so the next test
    means something)."""
    log = tmp_path / "calls.log"
    code = (
        "import sgl_kernel\n"
        f"assert sgl_kernel.IS_DELTA_SWAP_CPU_TEST_SHIM and sorted(sgl_kernel.SHIMMED) == sorted({SHIMMED!r})\n"
        "sgl_kernel.verify_tree_greedy_cpu(1, 2)\n"
    )
    out = subprocess.run(
        [sglang_python, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DELTA_SWAP_SGL_KERNEL_SHIM_LOG": str(log)},
    )
    assert out.returncode != 0 and "CPU test shim" in out.stderr, out.stderr[-2000:]
    assert log.read_text().split()[-1] == "verify_tree_greedy_cpu"


def test_no_server_ever_called_the_cpu_kernel_shim(live, references, shim_log) -> None:
    """Every SGLang server of this module ran with the shim logging to ``shim_log``: SGLang's CPU
    path must not have needed a single real kernel."""
    assert not shim_log.exists(), f"sgl_kernel CPU test shim was called: {shim_log.read_text()[:2000]}"
