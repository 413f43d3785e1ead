"""The exactness suite (``delta_swap.testing.engine_exactness``) on real SGLang servers (0.5.23 CPU):
every model family on the tensor (reload) path, and on the arena path where SGLang keeps plain
weights. One plugin server per family and path; a fresh server per checkpoint as the reference."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

from delta_swap.staged_swap import FAIL_BUILD_ENV, FAIL_SCATTER_ENV
from delta_swap.testing.engine_exactness import PARTIAL_DELTAS, Chain, InjectedFailureTests
from examples.servers import sglang as sglang_server
from examples.servers.process import Server
from examples.tiny_model import make_tiny_model, perturb_weights
from tests.support.exactness import TinyModelExactness
from tests.support.rollout_scenarios import publish_dirs, wait_for

pytestmark = pytest.mark.engine

#: A server that dies at start exits at once instead of dumping py-spy traces and waiting 60 s for
#: CUDA core dumps (SGLang's defaults): a family SGLang CPU cannot run costs one short start.
EXIT_AT_ONCE = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


class SglangExactness(TinyModelExactness):
    engine = "sglang"
    #: Extra SGLang arguments and environment (the same for the plugin server and the references).
    extra: tuple[str, ...] = ()
    env: dict[str, str] = {}

    def cannot_run(self, error: str) -> str | None:
        """SGLang CPU runs some layers through Triton kernels, and Triton has no CPU driver: the
        server dies at its warm-up naming the last SGLang function on the way to the kernel."""
        driver = re.search(r"RuntimeError: 0 active drivers.*", error)
        if driver is None:
            return None
        frames = re.findall(r'File ".*?/(sglang/[^"]+)", line (\d+), in (\w+)', error)
        model = [f"{path.rpartition('/')[2]}:{line} {fn}" for path, line, fn in frames if "/models/" in path]
        kernel = [fn for path, _, fn in frames if "/models/" not in path]
        return (
            f"SGLang CPU cannot run {self.family} here: {model[-1] if model else 'the model'} calls a Triton kernel "
            f"({kernel[-1] if kernel else '?'}) and Triton has no CPU driver ({driver.group(0).strip()})"
        )

    #: Without a store SGLang's plugin does nothing, so every path's reference is the same server.
    reference_swap_path = {"arena": "reload", "inplace": "reload", "shadow": "reload", "auto": "reload"}

    def start_server(self, model: Path, workdir: Path, settings: Mapping[str, object], log_name: str) -> Server:
        env = {**EXIT_AT_ONCE, **self.env}
        return sglang_server.start(
            model, workdir, settings=settings, served_name="tiny", log_name=log_name, extra=self.extra, env=env
        )

    def prompt_logprobs(self, url: str, prompt: list[int]) -> list[object]:
        body = {
            "input_ids": prompt,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 1,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
        r = httpx.post(f"{url}/generate", json=body, timeout=300)
        r.raise_for_status()
        meta = r.json()["meta_info"]
        return [meta["input_token_logprobs"], meta["input_top_logprobs"], meta["output_token_logprobs"]]


@pytest.mark.full_matrix("fused constituents on the tensor path: TestQwen2Tensor; llama: TestLlamaArena")
class TestLlamaTensor(SglangExactness):
    family, swap_path = "llama", "reload"


class TestQwen2Tensor(SglangExactness):
    family, swap_path = "qwen2", "reload"


@pytest.mark.full_matrix(
    "the tied embedding on the tensor path: TestQwen3TiedTensorTP2 and the stale-embedding read-back at TP 1 and 2"
)
class TestQwen3TiedTensor(SglangExactness):
    family, swap_path = "qwen3", "reload"


class TestQwen3MoeTensor(SglangExactness):
    family, swap_path = "qwen3_moe", "reload"


@pytest.mark.full_matrix("MoE on the tensor path: TestQwen3MoeTensor (SGLang CPU cannot run qwen2_moe)")
class TestQwen2MoeTensor(SglangExactness):
    family, swap_path = "qwen2_moe", "reload"


class TestLlamaArena(SglangExactness):
    family, swap_path = "llama", "arena"


@pytest.mark.full_matrix("a fused constituent on the arena path: TestLlamaArena; biases: TestQwen2Tensor")
class TestQwen2Arena(SglangExactness):
    family, swap_path = "qwen2", "arena"


@pytest.mark.full_matrix(
    "the tied embedding on the arena path: vLLM's TestQwen3TiedArena; SGLang's arena: TestLlamaArena; SGLang's tied model: TestQwen3TiedTensor"
)
class TestQwen3TiedArena(SglangExactness):
    family, swap_path = "qwen3", "arena"


@pytest.mark.full_matrix("nothing: fused experts have no arena slot (said and skipped); MoE: TestQwen3MoeTensor")
class TestQwen3MoeArena(SglangExactness):
    family, swap_path = "qwen3_moe", "arena"


@pytest.mark.full_matrix("nothing: SGLang CPU cannot run qwen2_moe (a Triton kernel; said and skipped)")
class TestQwen2MoeArena(SglangExactness):
    family, swap_path = "qwen2_moe", "arena"


class TestQwen3TiedTensorTP2(SglangExactness):
    """Two tensor-parallel ranks on two cores (SGLang CPU binds one core per rank when told to):
    SGLang's tensor update shards each published tensor for its rank."""

    family, swap_path = "qwen3", "reload"
    extra = ("--tp-size", "2")
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


class TestQwen2Inplace(InjectedFailureTests, SglangExactness):
    """Changed elements written into the live parameters by the scheduler (biases alone, one
    constituent of a fused module); then a failure injected after the first of several parameters
    is written."""

    family, swap_path = "qwen2", "inplace"

    def start_server(self, model: Path, workdir: Path, settings: Mapping[str, object], log_name: str) -> Server:
        self.env = self.failure_env(workdir, log_name)
        return super().start_server(model, workdir, settings, log_name)

    def test_a_failure_mid_scatter_keeps_the_previous_weights_served_exactly(self, chain: Chain) -> None:
        self.check_a_failed_swap(chain, FAIL_SCATTER_ENV, "injected failure after writing 1 parameters")


class TestQwen3MoeInplace(SglangExactness):
    """Each changed expert element written into the fused expert parameters in place."""

    family, swap_path = "qwen3_moe", "inplace"


class TestQwen2Shadow(InjectedFailureTests, SglangExactness):
    """New tensors of the changed parameters built by the scheduler before the pause and switched
    in it (biases alone, one constituent of a fused module); then failures injected mid-build and
    mid-switch."""

    family, swap_path = "qwen2", "shadow"

    def start_server(self, model: Path, workdir: Path, settings: Mapping[str, object], log_name: str) -> Server:
        self.env = self.failure_env(workdir, log_name)
        return super().start_server(model, workdir, settings, log_name)

    def test_a_failure_mid_build_never_touches_the_served_weights(self, chain: Chain) -> None:
        self.check_a_failed_swap(chain, FAIL_BUILD_ENV, "injected failure mid-build after 1 modules")

    def test_a_failure_mid_switch_keeps_the_previous_weights_served_exactly(self, chain: Chain) -> None:
        self.check_a_failed_swap(chain, FAIL_SCATTER_ENV, "injected failure after switching 1 parameters")


class TestQwen3MoeShadow(SglangExactness):
    """One expert's new values built into a new copy of the fused expert parameters before the
    pause, switched in it; the router alone."""

    family, swap_path = "qwen3_moe", "shadow"


class TestQwen3TiedInplaceTP2(TestQwen3TiedTensorTP2):
    """The in-place path at TP 2 (``swap_path=inplace``, what ``auto`` takes on a GPU): each rank
    writes the changed elements of its own shard of the tied embedding in the pause."""

    swap_path = "inplace"


class TestQwen3TiedAutoTP2(InjectedFailureTests, TestQwen3TiedTensorTP2):
    """``auto`` at TP 2 (no arena) takes the shadow path on the host: each rank builds the new
    tensors of its own shard (the tied embedding's vocabulary half) before the pause. A switch
    that fails on rank 1 alone is taken back on rank 0 too, in the same pause: the core then runs
    no rollback, so served weights other than the last good step's fail the test."""

    swap_path, auto_takes = "auto", "shadow"

    def start_server(self, model: Path, workdir: Path, settings: Mapping[str, object], log_name: str) -> Server:
        self.env = {**TestQwen3TiedTensorTP2.env, **self.failure_env(workdir, log_name)}
        return super().start_server(model, workdir, settings, log_name)

    def test_a_failure_on_one_rank_is_undone_on_every_rank(self, chain: Chain) -> None:
        message = "taken back on every rank: RuntimeError: delta_swap: injected failure after switching 1 parameters"
        self.check_a_failed_swap(chain, FAIL_SCATTER_ENV, message, "1@1")


REVERT_FIXES = Path(__file__).parent / "support" / "revert_fixes"


@pytest.mark.parametrize("tp", [1, 2])
def test_the_read_back_catches_an_engine_whose_load_leaves_the_embedding_stale(tp, tmp_path) -> None:
    """The scheduler reads back what it computes with after each tensor load: an engine bug that
    keeps the old embedding (put in by tests/support/revert_fixes) is refused before it serves,
    the status names the tensor, and the server stays on the last good step. At TP 2 each rank
    reads back its own shard of the vocabulary."""
    base = make_tiny_model(tmp_path / "A", family="qwen3")
    what, only = PARTIAL_DELTAS["qwen3"][0]  # the embedding alone of a tied model
    step1 = perturb_weights(base, tmp_path / "B", only=only, seed=1)
    store = tmp_path / "store"
    publish_dirs(store, [(0, base)], None)
    env = {
        "DELTA_SWAP_REVERT_FIXES": "stale_embedding",
        "PYTHONPATH": os.pathsep.join([str(REVERT_FIXES), os.environ.get("PYTHONPATH", "")]),
        **({"SGLANG_CPU_OMP_THREADS_BIND": "0|1"} if tp > 1 else {}),
    }
    settings = {"store": store.as_uri(), "poll_interval": 0.2, "swap_path": "reload", "verify_swaps": "always"}
    extra = ("--tp-size", str(tp)) if tp > 1 else ()
    server = sglang_server.start(base, tmp_path, settings=settings, served_name="tiny", env=env, extra=extra)
    try:
        first = wait_for(server.url, lambda s: s["current_step"] == 0, timeout=300)
        if tp > 1:  # every rank read back its shard of the first sync
            assert first["last_verification"]["workers"] == tp and first["last_verification"]["checks"] > 0, first
        publish_dirs(store, [(1, step1)], None)
        st = wait_for(server.url, lambda s: s["failures"] > 0 or s["current_step"] == 1, timeout=300)
        assert st["current_step"] == 0, f"{what}: a stale embedding was served without a complaint: {st}"
        assert "other values than the snapshot" in st["last_error"] and "embed_tokens" in st["last_error"], st
        # The subscriber retries the refused step at each poll, and the engine holds the new
        # version while a swap is under way (paused): between attempts it must be back on step 0.
        wait_for(server.url, lambda s: s["update_phase"] is None and s["weight_version"] == "step-0000000000", 120)
    finally:
        server.stop()
