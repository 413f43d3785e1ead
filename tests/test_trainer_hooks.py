"""Trainer hooks: the plain PyTorch loop of the README, a transformers Trainer with
DeltaSwapCallback, and two sharded (FSDP2) ranks that publish without gathering the whole model."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from delta_swap import Publisher, PublisherConfig
from delta_swap.chain import ChainReader
from delta_swap.rebuild import rebuild
from delta_swap.stores import FileStore
from tests.support.chains import assert_state_equal


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from examples.tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        init_std=0.02,
    )


async def test_the_readme_training_loop_publishes_every_step(tmp_path, tiny) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with Publisher(str(tmp_path), PublisherConfig(base_every=5)) as pub:  # the README's loop
        for step in range(3):
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            pub.publish(step, {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()})
    _, state, _ = await rebuild(FileStore(tmp_path))
    assert_state_equal(state, {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()})


async def test_a_transformers_trainer_publishes_after_each_optimizer_step(tmp_path, tiny) -> None:
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from delta_swap.integrations.hf_trainer import DeltaSwapCallback

    model = LlamaForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    rows = [{"input_ids": list(range(3 + i, 19 + i)), "labels": list(range(3 + i, 19 + i))} for i in range(8)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_strategy="no",
    )
    callback = DeltaSwapCallback(str(tmp_path / "store"), PublisherConfig(base_every=10))
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback]).train()
    store = FileStore(tmp_path / "store")
    manifests = await ChainReader(store).list()
    assert [m.step for m in manifests] == [1, 2, 3] and [m.kind.value for m in manifests] == ["base", "delta", "delta"]
    _, state, _ = await rebuild(store)
    assert_state_equal(state, {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()})


async def test_a_trl_grpo_trainer_publishes_with_the_callback(tmp_path, tiny) -> None:
    """TRL's trainers are transformers Trainers: the same callback publishes from GRPOTrainer."""
    from trl import GRPOTrainer

    from delta_swap.integrations.hf_trainer import DeltaSwapCallback
    from examples.trl_grpo import digits
    from tests.support.trainers import grpo_config, grpo_task

    tokenizer, prompts = grpo_task(tiny)
    config = grpo_config(tmp_path / "out", max_steps=2, learning_rate=1e-4)
    trainer = GRPOTrainer(
        model=str(tiny),
        reward_funcs=digits,
        args=config,
        train_dataset=prompts,
        processing_class=tokenizer,
        callbacks=[DeltaSwapCallback(str(tmp_path / "store"))],
    )
    trainer.train()
    store = FileStore(tmp_path / "store")
    assert [m.step for m in await ChainReader(store).list()] == [1, 2]
    _, state, _ = await rebuild(store)
    assert_state_equal(state, {k: v.detach().to(torch.bfloat16) for k, v in trainer.model.state_dict().items()})


def _run_two_ranks(target, model_dir, tmp_path) -> dict:
    """Run ``target(rank, 2, port, model_dir, store, out)`` in two spawned processes publishing to
    ``tmp_path/store``; return what rank 0 saved to ``out``."""
    from examples.servers.process import free_port

    ctx = mp.get_context("spawn")
    port, out = free_port(), tmp_path / "rank0.pt"
    procs = [
        ctx.Process(target=target, args=(r, 2, port, str(model_dir), str(tmp_path / "store"), str(out)))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    return torch.load(out)


def _fsdp2_model(rank: int, world: int, port: int, model_dir: str) -> torch.nn.Module:
    """Join a gloo group of ``world`` processes and load ``model_dir`` sharded by FSDP2 (per layer)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _sharded_rank(rank: int, world: int, port: int, model_dir: str, store: str, out: str) -> None:
    import torch.distributed as dist

    from delta_swap.integrations.sharded import owned_tensors

    model = _fsdp2_model(rank, world, port, model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(rank))
    largest_share = 0
    with Publisher(store, PublisherConfig(rank=rank, world_size=world, base_every=10)) as pub:
        for step in range(3):
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            share = owned_tensors(model.state_dict().items(), rank, world, torch.bfloat16)
            largest_share = max(largest_share, sum(t.numel() * t.element_size() for t in share.values()))
            pub.publish(step, share)
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to(torch.bfloat16)
        for k, v in model.state_dict().items()
    }
    total = sum(t.numel() * t.element_size() for t in full.values())
    if rank == 0:
        torch.save({"state": full, "largest_share": largest_share, "total": total}, out)
    dist.barrier()  # no rank tears its connections down while another may still use them
    dist.destroy_process_group()


async def test_two_sharded_ranks_publish_their_shares_without_gathering_the_model(tmp_path, tiny) -> None:

    result = _run_two_ranks(_sharded_rank, tiny, tmp_path)
    assert result["largest_share"] < 0.75 * result["total"]  # no rank held the whole model to publish
    store = FileStore(tmp_path / "store")
    manifests = await ChainReader(store).list()
    assert [m.step for m in manifests] == [0, 1, 2]
    assert len(manifests[0].shards) == 2  # one shard per rank
    _, state, _ = await rebuild(store)
    assert_state_equal(state, result["state"])


def _sharded_moe_rank(rank: int, world: int, port: int, model_dir: str, store: str, out: str) -> None:
    import torch.distributed as dist

    from delta_swap.integrations.hf_names import checkpoint_tensors
    from delta_swap.integrations.hf_trainer import DeltaSwapCallback

    model = _fsdp2_model(rank, world, port, model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(rank))
    callback = DeltaSwapCallback(store, PublisherConfig(base_every=10))
    for step in range(2):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        callback.publish(step, model)
    callback.on_train_end(None, None, None)
    full = [(k, v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()]
    if rank == 0:
        torch.save(checkpoint_tensors(model, full, torch.bfloat16), out)
    dist.barrier()  # no rank tears its connections down while another may still use them
    dist.destroy_process_group()


async def test_fsdp2_ranks_publish_a_transformers5_moe_under_its_checkpoint_names(tmp_path) -> None:
    """Transformers 5 keeps a Qwen3-MoE's experts fused in memory (``mlp.experts.gate_up_proj``, one
    3-D tensor per layer), FSDP2 shards them, and each rank publishes its share through
    DeltaSwapCallback: the snapshot holds exactly the checkpoint's names (``experts.N.gate_proj``...)
    and the trained values."""
    from safetensors.torch import load_file

    from examples.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "moe", family="qwen3_moe")
    saved = {}
    for shard in model_dir.glob("*.safetensors"):
        saved.update(load_file(shard))
    expected = _run_two_ranks(_sharded_moe_rank, model_dir, tmp_path)
    assert set(expected) == set(saved)  # the converted names are the checkpoint's
    assert any(".experts.3.gate_proj.weight" in name for name in saved)
    store = FileStore(tmp_path / "store")
    assert [m.step for m in await ChainReader(store).list()] == [0, 1]
    _, state, _ = await rebuild(store)
    assert set(state) == set(saved)
    assert_state_equal(state, expected)
    assert not all(torch.equal(expected[k], saved[k].to(torch.bfloat16)) for k in saved)  # it trained
