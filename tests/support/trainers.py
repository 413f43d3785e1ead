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
