"""Tiny, deterministic Llama checkpoints for tests and demos (built offline, no hub access).

`make_tiny_model` writes a Hugging Face Llama directory (config.json, model.safetensors, tokenizer
files) with random weights and a byte-level BPE tokenizer trained on an in-code corpus.
`perturb_weights` writes a copy whose tensors differ from the source by a few ULPs in a small
fraction of elements: a realistic "next RL step" for delta / hot-swap tests.

torch, transformers, tokenizers and safetensors are imported lazily, inside the functions.
"""

from __future__ import annotations

import random
import shutil
import zlib
from pathlib import Path

__all__ = ["FAMILIES", "make_tiny_model", "perturb_weights"]

_BOS, _EOS = "<|begin_of_text|>", "<|end_of_text|>"
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = (
    "the of and to in is that it for on with as was at by be this from or have an are not but what all "
    "were when we there can one your which their said if will each about how up out them then she many "
    "some so these would other into has more her two like him see time could no make than first been "
    "its who now people my made over did down only way find use may water long little very after words "
    "called just where most know get through back much before go good new write our used me man too any "
    "day same right look think also around another came come work three word must because does part even "
    "place well such here take why things help put years different away again off went old number great "
    "tell men say small every found still between name should home big give air line set own under read "
    "last never us left end along while might next sound below saw something thought both few those always "
    "looked show large often together asked house world going want school important until form food keep "
    "children feet land side without boy once animals life enough took sometimes four head above kind began "
    "almost live page got earth need far hand high year mother light parts country father let night following "
    "picture being study second eyes soon times story boys since white days ever paper hard near sentence "
    "better best across during today others however sure means knew try told young miles sun ways thing "
    "whole hear example heard several change answer room sea against top turned learn point city play toward "
    "five using himself usually weight tensor model layer token engine swap delta rollout server worker"
).split()
_CODE = (
    "def {a}({b}, {c}):\n    return {b} + {c} * {n}\n",
    "for {a} in range({n}):\n    {b}[{a}] = {c}({a})\n",
    "class {A}:\n    {a}: int = {n}\n",
    "if {a} is None:\n    raise ValueError('{b} {c}')\n",
)


def _corpus(n_sentences: int = 4000) -> list[str]:
    """Deterministic English-like prose, numbers and Python snippets (independent of any model seed)."""
    rng = random.Random(20240611)
    out: list[str] = []
    for i in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        line = " ".join(words) + rng.choice(".?!,;:")
        if i % 5 == 0:
            line += f" In {rng.randint(1000, 2100)} there were {rng.randint(0, 99999)} of them."
        if i % 9 == 0:
            a, b, c = (rng.choice(_WORDS) for _ in range(3))
            line += "\n" + rng.choice(_CODE).format(a=a, b=b, c=c, A=a.capitalize(), n=rng.randint(0, 512))
        out.append(line)
    return out


def _train_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[_BOS, _EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer reached {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def make_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "bfloat16",
    init_std: float = 1.0,
    family: str = "llama",
) -> Path:
    """Write a random-weight Llama checkpoint (untied embeddings, GQA) with its tokenizer to `out_dir`.

    The defaults give head_dim 32 and 2 KV heads for 4 query heads, so the fused q/k/v projection has
    shards of different sizes. The same arguments always produce byte-identical weights and tokenizer.
    `init_std` (at most 1.0) is the std of the normal init of every matrix: the large default makes greedy
    outputs sensitive enough that `perturb_weights` (a few ULPs) changes completions; at HF's 0.02 it
    does not.
    `vocab_size` must exceed 258 (256 byte tokens + BOS/EOS). `family` picks the architecture (see
    `FAMILIES`); every family but llama is written by `save_pretrained`. Returns `out_dir` as a Path.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(vocab_size),
        bos_token=_BOS,
        eos_token=_EOS,
        model_max_length=2048,
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    if family != "llama":
        return _save_family(
            out,
            family,
            tokenizer,
            seed=seed,
            torch_dtype=torch_dtype,
            init_std=init_std,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=hidden_size // num_heads,
        )
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=2048,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids(_BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(_EOS),
    )
    config.architectures = ["LlamaForCausalLM"]
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", torch_dtype)  # renamed in 4.56
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch_dtype).eval()
    config.save_pretrained(out)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


#: The model families tests run (transformers' own config classes): what breaks engines in each.
FAMILIES = {
    "llama": "LlamaForCausalLM: untied embeddings, GQA, fused q/k/v and gate/up in the engines",
    "qwen2": "Qwen2ForCausalLM: q/k/v biases",
    "qwen3": "Qwen3ForCausalLM: tied embeddings (lm_head is embed_tokens), q/k norms",
    "qwen3_moe": "Qwen3MoeForCausalLM: 8 experts, top 2, router, tied embeddings off",
    "qwen2_moe": "Qwen2MoeForCausalLM: 8 routed experts, top 2, a shared expert and its gate, q/k/v biases",
}


def _save_family(out: Path, family: str, tokenizer, *, seed: int, torch_dtype, init_std: float, **shape) -> Path:
    """Write a random `family` checkpoint with `save_pretrained` (so names are what a trainer saves)."""
    import torch
    import transformers

    special = {
        "bos_token_id": tokenizer.convert_tokens_to_ids(_BOS),
        "eos_token_id": tokenizer.convert_tokens_to_ids(_EOS),
        "max_position_embeddings": 2048,
        "initializer_range": init_std,
    }
    moe = {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": shape["intermediate_size"] // 4,
        "norm_topk_prob": True,
    }
    configs = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True}),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"tie_word_embeddings": False, **moe}),
        "qwen2_moe": (
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            {"tie_word_embeddings": False, **moe, "shared_expert_intermediate_size": shape["intermediate_size"]},
        ),
    }
    if family not in configs:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    config_name, model_name, extra = configs[family]
    if family == "qwen2_moe":
        shape.pop("head_dim")
    config = getattr(transformers, config_name)(**shape, **special, **extra)
    config.architectures = [model_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch_dtype).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: give them values a delta can move
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_(
                    1.0 + 0.1 * torch.randn_like(param, dtype=torch.float32)
                    if name.endswith("norm.weight")
                    else torch.randn_like(param, dtype=torch.float32)
                )
    model.save_pretrained(out)
    return out


# dtype -> (integer view, magnitude mask, largest finite magnitude as bits)
_BITS = {
    "bfloat16": ("int16", 0x7FFF, 0x7F7F),
    "float16": ("int16", 0x7FFF, 0x7BFF),
    "float32": ("int32", 0x7FFFFFFF, 0x7F7FFFFF),
}


def perturb_weights(
    src_dir: str | Path, out_dir: str | Path, *, fraction: float = 0.02, seed: int = 1, only: str | None = None
) -> Path:
    """Copy the checkpoint in `src_dir` to `out_dir`, nudging `fraction` of each tensor's elements.

    Chosen elements of every float tensor move by +-1..3 ULP (the magnitude's bit pattern, clamped to
    finite values, sign kept); at least one element per tensor changes. With `only` (a regular
    expression), only the tensors whose names it matches (`re.search`) change: a partial delta; it
    must match at least one. Non-safetensors files are copied unchanged. Deterministic in (`seed`,
    tensor name). Returns `out_dir` as a Path.
    """
    import re

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    moved: list[str] = []
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            key = str(t.dtype).removeprefix("torch.")
            if key not in _BITS or (only is not None and not re.search(only, name)):
                continue
            moved.append(name)
            int_name, mag_mask, max_mag = _BITS[key]
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            n = t.numel()
            k = max(1, round(fraction * n))
            idx = torch.randperm(n, generator=gen)[:k]
            step = torch.randint(1, 4, (k,), generator=gen) * (torch.randint(0, 2, (k,), generator=gen) * 2 - 1)
            bits = t.contiguous().view(getattr(torch, int_name)).reshape(-1).to(torch.int64)
            bits &= (mag_mask << 1) | 1  # unsigned bit pattern
            sign, mag = bits & ~mag_mask, bits & mag_mask
            mag[idx] = (mag[idx] + step).clamp(0, max_mag)
            new = sign | mag
            new = torch.where(new > mag_mask, new - (mag_mask + 1) * 2, new)  # back to signed range
            tensors[name] = new.to(getattr(torch, int_name)).view(t.dtype).reshape(t.shape).contiguous()
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    if only is not None and not moved:
        raise ValueError(f"no tensor of {src} matches {only!r}")
    return out
