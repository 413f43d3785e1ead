"""Publishing a live transformers model (or its state dict) publishes checkpoint names: what
``save_pretrained`` writes, so that every server can load it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from delta_swap.errors import ConfigError
from delta_swap.integrations.hf_names import check_checkpoint_names, checkpoint_tensors
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.rebuild import rebuild
from delta_swap.stores.file import FileStore

transformers = pytest.importorskip("transformers")


def _tiny(kind: str):
    shape = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    torch.manual_seed(0)
    if kind == "tied":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, tie_word_embeddings=True))
    return transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False
        )
    )


@pytest.mark.parametrize("kind", ["tied", "moe"])
def test_a_live_model_converts_to_exactly_what_save_pretrained_writes(kind, tmp_path) -> None:
    model = _tiny(kind).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    converted = checkpoint_tensors(model)
    assert sorted(converted) == sorted(saved)
    assert all(torch.equal(converted[name], saved[name]) for name in saved)


def test_fp32_master_weights_cast_to_the_serving_dtype() -> None:
    model = _tiny("tied")
    converted = checkpoint_tensors(model, dtype=torch.bfloat16)
    assert "lm_head.weight" not in converted and "model.embed_tokens.weight" in converted
    assert {t.dtype for t in converted.values()} == {torch.bfloat16}


def test_publishing_the_model_or_its_state_dict_publishes_checkpoint_names(tmp_path) -> None:
    tied, moe = _tiny("tied").to(torch.bfloat16), _tiny("moe").to(torch.bfloat16)
    for name, published in (("tied-model", tied), ("tied-state", tied.state_dict()), ("moe-model", moe)):
        store = tmp_path / name
        with Publisher(str(store), PublisherConfig()) as pub:
            pub.publish(0, published)
        state = asyncio.run(rebuild(FileStore(store)))[1]
        expected = checkpoint_tensors(tied if name.startswith("tied") else moe)
        assert sorted(state) == sorted(expected), name


def test_a_state_dict_with_fused_in_memory_experts_is_refused_on_the_trainer(tmp_path) -> None:
    moe = _tiny("moe").to(torch.bfloat16)
    with Publisher(str(tmp_path / "store"), PublisherConfig()) as pub:
        with pytest.raises(ConfigError, match=r"mlp\.experts\.(gate_up|down)_proj.*publish the model itself"):
            pub.publish(0, moe.state_dict())


def test_only_aliases_are_dropped_from_a_state_dict() -> None:
    a, b = torch.ones(4, 4), torch.ones(4, 4)  # equal values, separate storage: both kept
    out = check_checkpoint_names({"x.weight": a, "y.weight": b, "z.weight": a, "row": a[0]})
    assert sorted(out) == ["row", "x.weight", "y.weight"]
