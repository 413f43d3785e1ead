"""What the trainer-integration tests share: a tiny GRPO task for TRL and a trainer's weights
written as a checkpoint a fresh server can start on."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Prompts of the tiny GRPO task (the reward is examples.trl_grpo.digits).
GRPO_PROMPTS = ("the model", "write a number", "count to", "years like")


def grpo_task(model_dir: Path) -> tuple[Any, Any]:
    """The tiny model's tokenizer (with a pad token) and a dataset of :data:`GRPO_PROMPTS`."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer, Dataset.from_list([{"prompt": p} for p in GRPO_PROMPTS])


def grpo_config(output_dir: Path, **fields: Any) -> Any:
    """A GRPOConfig for a few CPU steps of the tiny task (no saving, logging or reporting)."""
    from trl import GRPOConfig

    base: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 4,
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "logging_strategy": "no",
        "bf16": False,
    }
    return GRPOConfig(output_dir=str(output_dir), **{**base, **fields})


def write_checkpoint(like: Path, out: Path, tensors: Mapping[str, Any]) -> Path:
    """``out``: the files of the checkpoint ``like`` other than its weights, and ``tensors`` as its
    weights (what ``save_pretrained`` writes)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    for file in like.iterdir():
        if not file.name.endswith(".safetensors"):
            (out / file.name).write_bytes(file.read_bytes())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def fresh_server_logprobs(checkpoint: Path, workdir: Path, settings: Mapping[str, object] | None = None) -> list:
    """The prompt logprobs (engine_exactness.PROMPTS) of a fresh vLLM server with the plugin and no
    store, started on ``checkpoint`` and stopped again: the reference a swapped server must equal."""
    from delta_swap.testing.engine_exactness import PROMPTS
    from examples.servers import vllm as vllm_server
    from tests.test_vllm_exactness import completion_logprobs

    reference = vllm_server.start(checkpoint, workdir, settings=settings, served_name="tiny", log_name="ref.log")
    try:
        return [completion_logprobs(reference.url, p) for p in PROMPTS]
    finally:
        reference.stop()
