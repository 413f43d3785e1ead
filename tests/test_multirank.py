"""Several ranks, in separate processes, publish their own tensor subsets into one snapshot."""

from __future__ import annotations

import multiprocessing as mp

from delta_swap.chain import ChainReader
from delta_swap.rebuild import rebuild
from delta_swap.stores import FileStore
from tests.support.chains import assert_state_equal, rl_steps

WORLD = 3
STEPS = 7


def _rank_main(store_dir: str, rank: int) -> None:
    from delta_swap.publisher import Publisher, PublisherConfig

    steps = rl_steps(STEPS, seed=7)
    names = sorted(steps[0])
    mine = names[rank::WORLD]
    with Publisher(
        store_dir,
        PublisherConfig(rank=rank, world_size=WORLD, base_every=4),
        files={"config.json": b"{}"} if rank == 0 else None,
    ) as pub:
        for i, state in enumerate(steps):
            pub.publish(i, {n: state[n] for n in mine})


async def test_three_processes_publish_one_consistent_chain(tmp_path) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(str(tmp_path), r)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = FileStore(tmp_path)
    manifests = await ChainReader(store).list()
    assert [m.step for m in manifests] == list(range(STEPS))
    assert [m.kind for m in manifests] == ["base" if i % 4 == 0 else "delta" for i in range(STEPS)]
    for m in manifests:
        assert len({s.name for s in m.shards}) == (WORLD if m.kind == "base" else len(m.shards))
        assert all(s.name.endswith(f"-of-{WORLD:05d}.safetensors") for s in m.shards) or m.kind == "delta"
    head = await ChainReader(store).head()
    assert head is not None and head.step == STEPS - 1
    steps = rl_steps(STEPS, seed=7)
    for i in (0, 3, STEPS - 1):
        assert_state_equal((await rebuild(store, manifests[i].snapshot_id))[1], steps[i])


def test_shares_are_balanced_by_elements_and_every_tensor_has_one_owner() -> None:
    """A Llama-like stream (embeddings first, output head last, layers between): round robin gave
    both large tensors to rank 0; the least loaded rank takes each tensor in turn, so the shares
    differ by at most one tensor, and every rank computes the same owners."""
    import torch

    from delta_swap.integrations.sharded import Share, balanced_share, owned_tensors

    stream = [("model.embed_tokens.weight", torch.zeros(64, 16))]
    for i in range(3):
        stream += [
            (f"model.layers.{i}.q_proj.weight", torch.zeros(16, 16)),
            (f"model.layers.{i}.norm", torch.zeros(16)),
        ]
        stream += [(f"model.layers.{i}.mlp.weight", torch.zeros(32, 16))]
    stream.append(("lm_head.weight", torch.zeros(64, 16)))
    largest = max(t.numel() for _, t in stream)
    for world in (2, 3):
        shares = [balanced_share(stream, rank, world) for rank in range(world)]
        owners = [name for share in shares for name in share]
        assert sorted(owners) == sorted(name for name, _ in stream)  # each tensor exactly once
        loads = [sum(t.numel() for t in share.values()) for share in shares]
        assert max(loads) - min(loads) <= largest, loads
        share = Share(0, world)
        for name, tensor in stream:
            share.add(name, tensor)
        assert share.loads == loads  # what every rank tracks
        by_name = [owned_tensors(reversed(stream), rank, world) for rank in range(world)]  # dealt in name order
        assert sorted(n for s in by_name for n in s) == sorted(name for name, _ in stream)
    two = [sum(t.numel() for t in balanced_share(stream, rank, 2).values()) for rank in range(2)]
    round_robin = [sum(t.numel() for _, t in stream[rank::2]) for rank in range(2)]
    assert max(two) < max(round_robin), (two, round_robin)  # the slowest rank has less to encode
