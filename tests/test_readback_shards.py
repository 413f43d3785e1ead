"""The tensor-parallel read-back without a server: vLLM's own layer classes (QKV, merged gate/up,
row-parallel, vocabulary-parallel embedding with a tied lm_head) built as ranks 0 and 1 of two,
loaded through their own loaders and repacked as the CPU worker does; each rank's read-back
(``delta_swap.readback`` with ``vllm_delta_plugin.readback_shards``) passes on its own shard and
refuses a rank that holds another rank's shard or a stale value, naming the tensor."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", exc_type=ImportError)

from delta_swap.errors import ChecksumMismatchError  # noqa: E402
from delta_swap.readback import verify_modules  # noqa: E402

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
HIDDEN, HEAD, HEADS, KV_HEADS, INTER, VOCAB = 64, 16, 4, 2, 96, 100


@pytest.fixture(scope="module")
def vllm_config() -> Iterator[object]:
    """A one-process world (gloo) so vLLM's layers can be built; ranks are patched per layer."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    config = VllmConfig()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():  # once per process
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
            initialize_model_parallel(1)
        yield config


@contextmanager
def as_rank(rank: int, size: int = 2) -> Iterator[None]:
    """vLLM's layers and parameters read the tensor-parallel rank and size when built."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab
    import vllm.model_executor.parameter as parameter

    patches = [
        mock.patch.object(module, name, value)
        for module in (linear, vocab, parameter)
        for name, value in (
            ("get_tensor_model_parallel_rank", lambda: rank),
            ("get_tensor_model_parallel_world_size", lambda: size),
        )
        if hasattr(module, name)
    ]
    for patch in patches:
        patch.start()
    try:
        yield
    finally:
        for patch in patches:
            patch.stop()


def published() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return {
        "attn.q_proj.weight": rand(HEADS * HEAD, HIDDEN),
        "attn.k_proj.weight": rand(KV_HEADS * HEAD, HIDDEN),
        "attn.v_proj.weight": rand(KV_HEADS * HEAD, HIDDEN),
        "attn.q_proj.bias": rand(HEADS * HEAD),
        "attn.k_proj.bias": rand(KV_HEADS * HEAD),
        "attn.v_proj.bias": rand(KV_HEADS * HEAD),
        "attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD),
        "mlp.gate_proj.weight": rand(INTER, HIDDEN),
        "mlp.up_proj.weight": rand(INTER, HIDDEN),
        "mlp.down_proj.weight": rand(HIDDEN, INTER),
        "embed_tokens.weight": rand(VOCAB, HIDDEN),
    }


def build(
    config: object,
    rank: int,
    weights: dict[str, torch.Tensor],
    donor: torch.nn.Module | None = None,
    process: bool = True,
    size: int = 2,
) -> torch.nn.Module:
    """One rank's layers, loaded as vLLM's models load them (or holding ``donor``'s loaded values
    instead: a rank given another rank's shard), then processed (the CPU repack) if ``process``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with as_rank(rank, size), set_current_vllm_config(config):  # type: ignore[arg-type]
            model = torch.nn.Module()
            model.attn = torch.nn.Module()
            model.attn.qkv_proj = linear.QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=True, prefix="qkv")
            model.attn.o_proj = linear.RowParallelLinear(HEADS * HEAD, HIDDEN, bias=False, prefix="o")
            model.mlp = torch.nn.Module()
            model.mlp.gate_up_proj = linear.MergedColumnParallelLinear(HIDDEN, [INTER] * 2, bias=False, prefix="gu")
            model.mlp.down_proj = linear.RowParallelLinear(INTER, HIDDEN, bias=False, prefix="down")
            model.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN)
            model.lm_head = ParallelLMHead(VOCAB, HIDDEN).tie_weights(model.embed_tokens)
            record_metadata_for_reloading(model)
            params = dict(model.named_parameters())
            for name, tensor in weights.items():
                module, _, kind = name.rpartition(".")
                head, _, part = module.rpartition(".")
                fused = next((f for f, parts in PACKED.items() if part in parts), None)
                if fused is None:
                    param = params[name]
                    param.weight_loader(param, tensor)
                else:
                    param = params[f"{head}.{fused}.{kind}"]
                    index = PACKED[fused].index(part)
                    param.weight_loader(param, tensor, ("q", "k", "v")[index] if fused == "qkv_proj" else index)
            if donor is not None:
                for name, value in donor.named_parameters():
                    params[name].data.copy_(value)
            for layer in model.modules() if process else ():
                method = getattr(layer, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(layer)
    finally:
        torch.set_default_dtype(default)
    return model


def read_back(
    config: object, model: torch.nn.Module, rank: int, weights: dict[str, torch.Tensor], size: int = 2
) -> int:
    """The read-back as a rank of ``size`` runs it (one rank: against whole tensors, as vLLM's
    worker does at tensor parallel 1)."""
    from vllm.config import set_current_vllm_config

    from vllm_delta_plugin.readback_shards import local_shards

    shard = local_shards(PACKED) if size > 1 else None
    with as_rank(rank, size), set_current_vllm_config(config), torch.inference_mode():  # type: ignore[arg-type]
        return verify_modules(model, weights, PACKED, shard)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_passes_on_its_own_shard(vllm_config, rank) -> None:
    weights = published()
    model = build(vllm_config, rank, weights)
    # qkv weight + bias, o_proj, gate_up, down_proj, the embedding (plain and probed), the tied lm_head
    assert read_back(vllm_config, model, rank, weights) >= 7


def test_a_rank_holding_another_ranks_shard_is_refused(vllm_config) -> None:
    """Rank 1's layers holding what rank 0 loaded (the same shapes, the wrong half)."""
    weights = published()
    wrong = build(vllm_config, 1, weights, donor=build(vllm_config, 0, weights, process=False))
    with pytest.raises(ChecksumMismatchError, match="other values than the snapshot"):
        read_back(vllm_config, wrong, 1, weights)


@pytest.mark.parametrize(
    ("moved", "named"),
    [
        ("attn.o_proj.weight", "attn.o_proj.weight"),  # row-parallel: a local input slice
        ("attn.k_proj.weight", "qkv_proj.weight"),  # one constituent of a fused module
        ("embed_tokens.weight", "embed_tokens.weight"),  # the rank's slice of the vocabulary
    ],
)
def test_a_stale_tensor_in_rank_1s_shard_is_named(vllm_config, moved, named) -> None:
    """Rank 1 serves the old value of one tensor while the snapshot has a new one."""
    weights = published()
    model = build(vllm_config, 1, weights)
    new = dict(weights)
    new[moved] = weights[moved] + 1
    with pytest.raises(ChecksumMismatchError, match=named.replace(".", r"\.")):
        read_back(vllm_config, model, 1, new)


def with_non_finite(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Values a diverging run publishes (or a synthetic update wrapping a zero's bits to 0xFFFE):
    NaN and Inf off the probed columns (0, 21, 42, 63 of 64; 0, 32, 63, 95 of 96), where a one-hot
    probe of the row computes 0 * NaN, and an Inf on one."""
    new = {name: t.clone() for name, t in weights.items()}
    new["mlp.gate_proj.weight"][5, 7] = float("nan")
    new["mlp.up_proj.weight"][3, 10] = float("inf")
    new["attn.q_proj.weight"][2, 21] = float("-inf")
    new["mlp.down_proj.weight"][1, 50] = float("nan")
    return new


@pytest.mark.parametrize(("rank", "size"), [(0, 1), (1, 2)])
def test_published_nan_and_inf_read_back_as_served(vllm_config, rank, size) -> None:
    """A server holding exactly the published weights passes, NaN and Inf included: the probe's
    expected outputs are the exact one-hot products, not the columns' values."""
    weights = with_non_finite(published())
    model = build(vllm_config, rank, weights, size=size)
    assert read_back(vllm_config, model, rank, weights, size) >= 7


@pytest.mark.parametrize("size", [1, 2])
def test_a_stale_value_beside_a_nan_row_is_named(vllm_config, size) -> None:
    """A NaN row hides nothing else: the row beside it, stale in a probed column, is refused."""
    weights = with_non_finite(published())
    model = build(vllm_config, 0, weights, size=size)
    new = dict(weights)
    new["mlp.gate_proj.weight"] = weights["mlp.gate_proj.weight"].clone()
    new["mlp.gate_proj.weight"][6, 0] += 1
    with pytest.raises(ChecksumMismatchError, match=r"gate_up_proj\.weight.*element 6: "):  # row 6 of probe 0
        read_back(vllm_config, model, 0, new, size)
