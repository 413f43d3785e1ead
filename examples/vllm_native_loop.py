"""vLLM's native trainer API with delta-swap underneath: a plain RL loop of vLLM's kind, one backend changed.

    python -m examples.vllm_native_loop                  # 8 steps on CPU, a few minutes
    python -m examples.vllm_native_loop --max-staleness 0

The trainer creates its weight-transfer engine as vLLM's RL examples do, through
``WeightTransferTrainerFactory.trainer_init`` with an ``HTTPVLLMWeightSyncClient`` and a
``ModuleSource`` over the policy; only the init info differs: ``DeltaSwapTrainerInitInfo`` names a
store, a base interval and a signing key instead of an NCCL rendezvous. Each ``send_weights()``
publishes the next step to the store (a signed full base every ``--base-every`` steps, lossless
deltas in between); the vLLM server, started with the ``delta_swap`` plugin and the trainer's public
key, pulls it, verifies it and swaps it in while it keeps serving. With ``--max-staleness k``,
``send_weights()`` for step s returns once the server serves step s-k (k=0 is vLLM's own contract).

The policy is a small random Llama with fp32 master weights, trained by GRPO on a programmatic
reward (the fraction of generated tokens that contain a digit), with rollouts from the server's
OpenAI-compatible API; the loss and reward are examples/rl_loop.py's. Per step the loop prints the
snapshot versions the rollouts came from, their staleness (how many steps their snapshot lags behind
the newest one published when they are trained on: 0 is on-policy), the step the server serves
after ``send_weights()`` and the bytes that step published.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from delta_swap.signing import generate_keypair
from examples.rl_loop import PROMPT_WORDS, Fleet, Rollout, digit_reward, grpo_loss
from examples.servers import vllm as vllm_server
from examples.tiny_model import make_tiny_model


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (one group of completions each)")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO group size)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--base-every", type=int, default=5)
    parser.add_argument("--max-staleness", type=int, default=1, help="send_weights() for step s waits for step s-k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir")
    args = parser.parse_args(argv)

    # vLLM's native trainer API; the init info is delta-swap's (importing it registers the engine)
    from transformers import AutoTokenizer, LlamaForCausalLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from vllm_delta_plugin.trainer_engine import DeltaSwapTrainerInitInfo

    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-vllm-native-"))
    model_dir = make_tiny_model(
        work / "policy-init",
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        init_std=0.02,
        seed=args.seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(args.seed)
    policy = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)  # fp32 master weights
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    key, public_key = generate_keypair(work / "keys" / "trainer.key")
    store = work / "store"
    store.mkdir(parents=True, exist_ok=True)

    print(f"== starting vLLM with the delta_swap plugin, following {store.as_uri()}", flush=True)
    settings = {
        "store": store.as_uri(),
        "trusted_key": str(public_key),
        "poll_interval": 0.1,
        "admin_open_loopback": True,
    }
    server = vllm_server.start(model_dir, work / "vllm", settings=settings, served_name="policy")
    logs: list[dict] = []
    try:
        engine = WeightTransferTrainerFactory.trainer_init(
            DeltaSwapTrainerInitInfo(
                store.as_uri(),
                base_every=args.base_every,
                signing_key=str(key),
                rank=0,
                max_staleness=args.max_staleness,
                files_from=str(model_dir),
            ),
            client=HTTPVLLMWeightSyncClient(server.url),
            source=ModuleSource(policy),
        )
        engine.send_weights()  # step 0: the initial policy
        fleet = Fleet([("vllm", server)])
        rng = random.Random(args.seed)
        print(
            f"{'step':>4} {'reward':>7} {'rollout versions':>16} {'stale p50/max':>13} {'served':>6} "
            f"{'published':>10} {'s':>5}",
            flush=True,
        )
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            prompts = [" ".join(rng.sample(PROMPT_WORDS, 4)) for _ in range(args.prompts)]
            with ThreadPoolExecutor(len(prompts)) as pool:
                batches = list(pool.map(lambda p: fleet.sample(0, p, args.group, args.max_tokens), prompts))
            rollouts = [
                Rollout(prompt_ids, completion_ids, digit_reward(tokenizer, completion_ids), version, g)
                for g, batch in enumerate(batches)
                for prompt_ids, completion_ids, version in batch
            ]
            loss = grpo_loss(policy, rollouts)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            engine.send_weights()  # publishes `step`; returns once the server serves step - max_staleness
            engine.flush()  # only to print the step's bytes: publishing runs in the background
            manifest = engine.publisher.last_manifest
            staleness = [step - 1 - r.version for r in rollouts if r.version is not None] or [0]
            log = {
                "step": step,
                "reward": statistics.fmean(r.reward for r in rollouts) if rollouts else 0.0,
                "versions": sorted({r.version for r in rollouts if r.version is not None}),
                "staleness": staleness,
                "served": engine.served_steps()[0],
                "kind": manifest.kind.value if manifest else "-",
                "published_bytes": manifest.payload_bytes if manifest else 0,
                "seconds": time.perf_counter() - started,
            }
            logs.append(log)
            print(
                f"{step:>4} {log['reward']:>7.3f} {','.join(f's{v}' for v in log['versions']) or '-':>16} "
                f"{statistics.median(staleness):>6.0f}/{max(staleness):<6} {log['served']!s:>6} "
                f"{log['published_bytes'] / 1e3:>6.1f}kB {log['kind'][0]} {log['seconds']:>5.1f}",
                flush=True,
            )
        engine.shutdown()
    finally:
        server.stop()
    published = sum(log["published_bytes"] for log in logs)
    print(
        f"\n{len(logs)} steps through vLLM's trainer API: {published / 1e6:.2f} MB published "
        f"(b: a full base, d: a delta), max staleness {max(max(log['staleness']) for log in logs)} "
        f"(bound {args.max_staleness}: send_weights() for step s-1 returned once the server served s-1-k)"
    )
    return logs


if __name__ == "__main__":
    main(sys.argv[1:])
