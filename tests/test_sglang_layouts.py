"""Layouts and servers the SGLang plugin cannot keep exact are refused when the server starts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from delta_swap.errors import ConfigError
from sglang_delta_plugin.server import refuse_unsupported


def _args(tmp_path, **over) -> SimpleNamespace:
    base = {
        "dp_size": 1,
        "pp_size": 1,
        "tp_size": 2,
        "quantization": None,
        "enable_lora": None,
        "lora_paths": None,
        "enable_multimodal": None,
        "model_path": str(tmp_path),
    }
    return SimpleNamespace(**{**base, **over})


@pytest.mark.parametrize(
    ("over", "refused"),
    [
        ({}, None),
        ({"dp_size": 2}, "--dp-size"),
        ({"pp_size": 2}, "--pp-size"),
        ({"quantization": "fp8"}, "--quantization fp8"),
        ({"enable_lora": True}, "LoRA"),
        ({"lora_paths": ["a=/x"]}, "LoRA"),
        ({"enable_multimodal": True}, "multimodal"),
    ],
)
def test_unsupported_servers_are_refused_with_one_line(tmp_path, over, refused) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    args = _args(tmp_path, **over)
    if refused is None:
        refuse_unsupported(args)  # TP alone is supported
        return
    with pytest.raises(ConfigError, match=refused) as info:
        refuse_unsupported(args)
    assert "\n" not in str(info.value)


def test_a_checkpoint_with_a_vision_tower_is_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}))
    with pytest.raises(ConfigError, match="multimodal"):
        refuse_unsupported(_args(tmp_path))
