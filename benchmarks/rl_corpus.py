"""A small, realistic RL-like checkpoint corpus for benchmarking weight-delta codecs.

Two model shapes: ``llama`` (the default, 7M parameters) and ``qwen2`` (a 27M-parameter
Qwen2-style model: attention biases, wider MLP, 8 layers), so a codec is not tuned to one shape.
A Llama-style model (GQA, byte-level BPE vocabulary trained offline on the Python standard library's
source) is briefly pretrained on that text, then fine-tuned once per learning rate with a fresh AdamW
optimizer on fp32 master weights and a policy-gradient-like objective: per-sequence advantage-weighted
token log-likelihood on real text, with GRPO-style normalised advantages. After a few unsaved warm-up
steps, a bf16 copy of every weight is saved before the first step and after each optimizer step, so
``steps`` optimizer steps give ``steps + 1`` consecutive checkpoints (``steps`` adjacent pairs).

Everything is cached under ``${DELTA_SWAP_CACHE:-~/.cache/delta-swap}/rl-corpus`` keyed by the
parameters, so reruns only read safetensors files. No network access is needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CORPUS_VERSION = 1
StateDict = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
    """Model, data and optimisation parameters of the corpus; all of them key the cache."""

    architecture: str = "llama"  # or "qwen2"
    hidden_size: int = 320
    intermediate_size: int = 864
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    vocab_size: int = 4096
    text_bytes: int = 2_000_000
    seq_len: int = 128
    pretrain_steps: int = 100
    pretrain_lr: float = 1e-3
    pretrain_batch: int = 8
    rl_batch: int = 8
    warmup_steps: int = 3
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0


def cache_root() -> Path:
    """Directory holding every cached corpus."""
    base = os.environ.get("DELTA_SWAP_CACHE", str(Path.home() / ".cache" / "delta-swap"))
    return Path(base) / "rl-corpus"


#: The learning rates and configuration of each corpus: ``python -m benchmarks.codec_bench --corpus NAME``.
CORPORA: dict[str, tuple[CorpusConfig, tuple[float, ...]]] = {
    "llama": (CorpusConfig(), (1e-6, 3e-6, 1e-5)),
    "qwen2": (
        CorpusConfig(
            architecture="qwen2",
            hidden_size=512,
            intermediate_size=1408,
            num_layers=8,
            num_heads=8,
            num_kv_heads=2,
            vocab_size=4096,
            seed=7,
        ),
        (3e-6, 1e-5),
    ),
    # A 0.1M-parameter model built in seconds: the CI-sized smoke run of the codec benchmark.
    "smoke": (
        CorpusConfig(
            hidden_size=64,
            intermediate_size=160,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            vocab_size=512,
            text_bytes=200_000,
            seq_len=64,
            pretrain_steps=10,
            seed=3,
        ),
        (1e-5,),
    ),
}


def _config_key(config: CorpusConfig) -> str:
    fields = dataclasses.asdict(config)
    if fields["architecture"] == "llama":  # corpora cached before the field existed keep their key
        del fields["architecture"]
    blob = json.dumps({"v": CORPUS_VERSION, "py": sys.version_info[:2], **fields}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _read_text(limit: int) -> list[str]:
    """Source files of the standard library (sorted, deterministic), about ``limit`` bytes in all."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= limit:
            break
    return texts


def _token_stream(config: CorpusConfig) -> torch.Tensor:
    from tokenizers import ByteLevelBPETokenizer

    texts = _read_text(config.text_bytes)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=config.vocab_size, min_frequency=2, show_progress=False)
    ids = [token for encoding in tokenizer.encode_batch(texts) for token in encoding.ids]
    return torch.tensor(ids, dtype=torch.long)


def _batch(tokens: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=gen)
    return torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])


def _sequence_nll(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean token negative log-likelihood of each sequence, shape (batch,)."""
    logits = model(input_ids=windows[:, :-1]).logits.float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none")
    return nll.mean(dim=1)


def _new_model(config: CorpusConfig) -> torch.nn.Module:
    shape = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.seq_len,
        tie_word_embeddings=False,
    )
    if config.architecture == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(**shape)).float()
    if config.architecture != "llama":
        raise ValueError(f"unknown architecture {config.architecture!r}")
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**shape)).float()


def _pretrained(config: CorpusConfig, tokens: torch.Tensor, directory: Path) -> StateDict:
    """fp32 weights after a short pretraining run (cached)."""
    path = directory / "pretrained-fp32.safetensors"
    if path.exists():
        return load_file(path)
    torch.manual_seed(config.seed)
    model = _new_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.pretrain_lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(config.seed)
    for _ in range(config.pretrain_steps):
        loss = _sequence_nll(model, _batch(tokens, config.pretrain_batch, config.seq_len, gen)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, path)
    return state


def _bf16(model: torch.nn.Module) -> StateDict:
    return {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()}


def _rl_run(config: CorpusConfig, tokens: torch.Tensor, start: StateDict, lr: float, steps: int) -> list[StateDict]:
    """bf16 snapshots before and after each of ``steps`` AdamW steps at learning rate ``lr``."""
    model = _new_model(config)
    model.load_state_dict(start)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=config.weight_decay)
    gen = torch.Generator().manual_seed(config.seed + 1)
    snapshots: list[StateDict] = []
    for step in range(config.warmup_steps + steps):
        if step >= config.warmup_steps:
            snapshots.append(_bf16(model))
        nll = _sequence_nll(model, _batch(tokens, config.rl_batch, config.seq_len, gen))
        advantages = torch.randn(nll.shape, generator=gen)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-6)
        loss = (advantages * nll).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
    snapshots.append(_bf16(model))
    return snapshots


def build_corpus(
    lrs: tuple[float, ...] = (1e-6, 3e-6, 1e-5),
    steps: int = 4,
    config: CorpusConfig = CorpusConfig(),
) -> dict[float, list[Path]]:
    """Build (or reuse) the corpus; per lr, the paths of ``steps + 1`` consecutive bf16 checkpoints."""
    directory = cache_root() / _config_key(config)
    wanted = {lr: [directory / f"lr{lr:g}" / f"step{i:04d}.safetensors" for i in range(steps + 1)] for lr in lrs}
    missing = [lr for lr, paths in wanted.items() if not all(p.exists() for p in paths)]
    if missing:
        tokens = _token_stream(config)
        start = _pretrained(config, tokens, directory)
        for lr in missing:
            for path, state in zip(wanted[lr], _rl_run(config, tokens, start, lr, steps)):
                path.parent.mkdir(parents=True, exist_ok=True)
                save_file(state, path)
    return wanted


def rl_checkpoints(
    lrs: tuple[float, ...] = (1e-6, 3e-6, 1e-5),
    steps: int = 4,
    config: CorpusConfig = CorpusConfig(),
) -> dict[float, list[StateDict]]:
    """Per lr, ``steps + 1`` consecutive bf16 state dicts (built on first use, then read from the cache)."""
    return {lr: [load_file(p) for p in paths] for lr, paths in build_corpus(lrs, steps, config).items()}


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """``--corpus`` and ``--steps``, as every benchmark over these corpora takes them."""
    parser.add_argument("--corpus", nargs="+", choices=sorted(CORPORA), default=["llama", "qwen2"])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (= checkpoint pairs) per lr")


def corpus_runs(names: list[str], steps: int) -> Iterator[tuple[str, float, list[StateDict]]]:
    """(corpus, lr, checkpoints) for every learning rate of every named corpus."""
    for name in names:
        config, lrs = CORPORA[name]
        for lr, checkpoints in rl_checkpoints(lrs, steps, config).items():
            yield name, lr, checkpoints


def changed_bf16_triples(
    checkpoints: list[StateDict],
) -> Iterator[tuple[tuple[int, ...], np.ndarray, np.ndarray, np.ndarray]]:
    """For every checkpoint pair that has a previous one, every bf16 tensor that changed:
    (shape, old, new, before) as flat uint16 arrays of bits (before: the checkpoint before old)."""
    for before, old, new in zip(checkpoints, checkpoints[1:], checkpoints[2:]):
        for name, tensor in old.items():
            if tensor.dtype != torch.bfloat16:
                continue
            u, v, w = (t[name].view(torch.int16).numpy().view(np.uint16).ravel() for t in (old, new, before))
            if not np.array_equal(u, v):
                yield tuple(tensor.shape), u, v, w


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "llama"
    config, lrs = CORPORA[name]
    for lr, paths in build_corpus(lrs, 4, config).items():
        print(f"{name} lr={lr:g}: {len(paths)} checkpoints in {paths[0].parent}")
