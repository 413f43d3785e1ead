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
