"""The exactness suite (``delta_swap.testing.engine_exactness``) on real SGLang servers (0.5.23 CPU):
every model family on the tensor (reload) path, and on the arena path where SGLang keeps plain
weights. One plugin server per family and path; a fresh server per checkpoint as the reference."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

from examples.servers import sglang as sglang_server
from examples.servers.process import Server
from tests.support.exactness import TinyModelExactness

pytestmark = pytest.mark.engine


class SglangExactness(TinyModelExactness):
    #: Extra SGLang arguments and environment (the same for the plugin server and the references).
    extra: tuple[str, ...] = ()
    env: dict[str, str] = {}

    def start_server(self, model: Path, workdir: Path, settings: Mapping[str, object], log_name: str) -> Server:
        return sglang_server.start(
            model, workdir, settings=settings, served_name="tiny", log_name=log_name, extra=self.extra, env=self.env
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


class TestQwen2Tensor(SglangExactness):
    family, swap_path = "qwen2", "reload"


class TestQwen3TiedTensor(SglangExactness):
    family, swap_path = "qwen3", "reload"


class TestQwen3MoeTensor(SglangExactness):
    family, swap_path = "qwen3_moe", "reload"


class TestQwen3TiedArena(SglangExactness):
    family, swap_path = "qwen3", "arena"


class TestQwen3MoeArena(SglangExactness):
    family, swap_path = "qwen3_moe", "arena"


class TestQwen3TiedTensorTP2(SglangExactness):
    """Two tensor-parallel ranks on two cores (SGLang CPU binds one core per rank when told to):
    SGLang's tensor update shards each published tensor for its rank."""

    family, swap_path = "qwen3", "reload"
    extra = ("--tp-size", "2")
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
