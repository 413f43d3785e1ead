"""A verl actor's weight sync on CPU, with delta-swap's checkpoint engine: run by
tests/test_verl_engine.py in the verl environment (scripts/verl_env.sh), as ``python -m``.

Every rank (``torch.distributed`` over gloo, as verl's actor workers are) builds the engine from
a verl config exactly as verl's actor worker does (``verl/workers/engine_workers.py``: the config
node turned into verl's ``CheckpointEngineConfig``, ``import_external_libs`` of the custom
backend module, ``CheckpointEngineRegistry.new(backend, is_master=..., bucket_size=...,
**engine_kwargs)``), trains steps ``--first`` to ``--last``, and after each awaits
``send_weights`` with a per-tensor generator of the model's ``state_dict`` (the names verl's
``get_per_tensor_param`` yields, tied ``lm_head.weight`` included; each tensor through a
broadcast, as an FSDP gather is a collective), then calls ``finalize``. After the second step it
syncs that step again and then with no step, as verl does around a validation; with
``--resume`` it first syncs step ``--first`` - 1, as a verl run restarted from that checkpoint
does. Rank 0 also builds the rollout side's engine as verl's ``CheckpointEngineWorker`` does and
reads its ``receive_weights`` through verl's ``ensure_async_iterator`` (as verl's vLLM adapter
does).

With ``--server-url``, rank 0's ``send_weights`` returns once those servers serve the step
(``max_staleness: 0``). Every rank prints one JSON line per sync (its metrics and share; rank 0
also the steps the servers serve); rank 0 writes the final weights (bf16, ``save_pretrained``) to
``--out``: what the servers must serve after the last step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
from typing import Any

CONFIG = """
backend: delta_swap
custom_backend_module: delta_swap.integrations.verl
update_weights_bucket_megabytes: 64
engine_kwargs:
  delta_swap:
    store_url: {store}
    base_every: {base_every}
    signing_key: {key}
    model_path: {model}
    server_urls: {servers}
    max_staleness: 0
"""


def build_engine(config_text: str, *, actor: bool, rank: int) -> Any:
    """The checkpoint engine as verl's actor worker (``actor``) or CheckpointEngineWorker builds it."""
    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import CheckpointEngineConfig

    config = omega_conf_to_dataclass(OmegaConf.create(config_text), CheckpointEngineConfig)
    bucket_size = config.update_weights_bucket_megabytes << 20
    engine_kwargs = config.engine_kwargs.get(config.backend, {})
    import_external_libs(config.custom_backend_module or None)
    if actor:
        return CheckpointEngineRegistry.new(
            config.backend, is_master=(rank == 0), bucket_size=bucket_size, **engine_kwargs
        )
    return CheckpointEngineRegistry.new(config.backend, bucket_size=bucket_size, **engine_kwargs)


def skewed_param(model: Any, rank: int):  # -> Generator[tuple[str, torch.Tensor]]
    """A broken trainer's generator: rank 1 yields the tensors in reverse order (no collectives)."""
    items = list(model.state_dict().items())
    yield from reversed(items) if rank == 1 else items


def per_tensor_param(model: Any):  # -> Generator[tuple[str, torch.Tensor]]
    """(name, tensor) of every state_dict entry, as verl's engines yield them (tied ``lm_head``
    included, no dtype cast), each through a collective as an FSDP gather is (rank 0's values):
    a rank that stopped draining would leave the others waiting."""
    import torch.distributed as dist

    for name, tensor in model.state_dict().items():
        value = tensor.detach().clone()
        dist.broadcast(value, src=0)
        yield name, value


async def rollout_side(engine: Any, step: int) -> list[Any]:
    """What a rollout worker hands its server adapter for ``step`` (verl's own iterator)."""
    from verl.workers.rollout.utils import ensure_async_iterator

    return [item async for item in ensure_async_iterator(engine.receive_weights(global_steps=step))]


def run_rank(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from delta_swap.integrations.servers import served_steps

    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    servers = json.dumps(args.server_url)  # a YAML flow list
    checkpoint = args.checkpoint or args.model
    text = CONFIG.format(store=args.store, base_every=args.base_every, key=args.key, model=checkpoint, servers=servers)
    engine = build_engine(text, actor=True, rank=rank)
    rollout = build_engine(text, actor=False, rank=rank) if rank == 0 else None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batch = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(args.first))
    syncs: list[int | None] = [args.first - 1] if args.resume else []  # verl syncs the step it resumed from
    for step in range(args.first, args.last + 1):
        syncs.append(step)
        if step == args.first + 1 and not args.resume:
            syncs += [step, None]  # verl syncs again after a validation: at the step, and with none
    trained = args.first - 1
    for step in syncs:
        while step is not None and trained < step:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            trained += 1
        weights = skewed_param(model, rank) if args.skew else per_tensor_param(model)
        metrics = asyncio.run(engine.send_weights(weights, global_steps=step))
        received = asyncio.run(rollout_side(rollout, step)) if rollout is not None else []
        engine.finalize()
        line = {"rank": rank, "step": step, "metrics": metrics, "received": len(received), "share": engine.last_names}
        if rank == 0:  # with max_staleness 0, the servers serve this step when send_weights returns
            line["served"] = served_steps(args.server_url)
        print(json.dumps(line), flush=True)
    engine.flush()
    if rank == 0:
        model.to(torch.bfloat16).save_pretrained(args.out)
        kinds = {
            "engine": type(engine).__module__ + "." + type(engine).__qualname__,
            "wire_format": engine.wire_format,
        }
        print(json.dumps(kinds), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the weights training starts from")
    parser.add_argument("--checkpoint", help="the servers' checkpoint (engine_kwargs model_path; default --model)")
    parser.add_argument("--store", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--first", type=int, default=1, help="the first step trained")
    parser.add_argument("--last", type=int, default=4, help="the last step trained")
    parser.add_argument("--resume", action="store_true", help="sync step first-1 first, as a resumed verl run")
    parser.add_argument("--base-every", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--skew", action="store_true", help="rank 1 yields its tensors in another order")
    parser.add_argument("--server-url", action="append", default=[], help="a server following the store")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    import torch.multiprocessing as mp

    mp.spawn(run_rank, args=(args,), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
