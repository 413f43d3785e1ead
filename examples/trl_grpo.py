"""TRL's GRPOTrainer in vLLM server mode, weights synced through delta-swap instead of NCCL.

    python -m examples.trl_grpo                  # 6 steps on CPU, a few minutes
    python -m examples.trl_grpo --max-staleness 0

A stock TRL setup: ``GRPOTrainer`` with ``GRPOConfig(use_vllm=True, vllm_mode="server")``
generating through a vLLM server. The one change is ``callbacks=[DeltaSwapSync(store, ...)]``
(:mod:`vllm_delta_plugin.trl_sync`): TRL's weight sync then publishes each step to the store (a
signed full base every ``--base-every`` steps, lossless deltas in between) instead of opening an
NCCL group, and the server, started with the ``delta_swap`` plugin and the trainer's public key,
pulls, verifies and swaps it while it serves. This runs on a CPU, where TRL's own server-mode sync
cannot run at all (it needs CUDA for NCCL).

The policy is a small random Llama trained on a programmatic reward (the fraction of digits in
the completion). Per step the example prints the mean reward, the step the server serves when the
step ends, its staleness (steps behind the trainer), and the last step published with its bytes
(TRL syncs before generating, so at the end of step s the newest snapshot is step s-1's weights).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from delta_swap.signing import generate_keypair
from examples.rl_loop import PROMPT_WORDS
from examples.servers import vllm as vllm_server
from examples.tiny_model import make_tiny_model


def digits(completions: list[str], **kwargs: Any) -> list[float]:
    """The reward: the fraction of characters of each completion that are digits."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO group size)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--base-every", type=int, default=5)
    parser.add_argument("--max-staleness", type=int, default=1, help="each sync for step s waits for step s-k")
    parser.add_argument("--workdir")
    args = parser.parse_args(argv)

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from vllm_delta_plugin.trl_sync import DeltaSwapSync

    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-trl-"))
    model_dir = make_tiny_model(
        work / "policy-init", hidden_size=args.hidden, intermediate_size=2 * args.hidden, init_std=0.02
    )
    key, public_key = generate_keypair(work / "keys" / "trainer.key")
    store = work / "store"
    store.mkdir(parents=True, exist_ok=True)
    print(f"== starting vLLM with the delta_swap plugin, following {store.as_uri()}", flush=True)
    settings = {
        "store": store.as_uri(),
        "trusted_key": str(public_key),
        "poll_interval": 0.1,
        "admin_open_loopback": True,  # the trainer's notify after each commit comes from loopback
    }
    server = vllm_server.start(
        model_dir,
        work / "vllm",
        settings=settings,
        served_name="policy",
        env={"VLLM_SERVER_DEV_MODE": "1"},  # TRL reads /server_info (a dev route)
        extra=["--logprobs-mode", "processed_logprobs"],  # what TRL's importance sampling wants
    )
    logs: list[dict] = []
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        rng = random.Random(0)
        prompts = [" ".join(rng.sample(PROMPT_WORDS, 4)) for _ in range(args.steps)]
        sync = DeltaSwapSync(
            store.as_uri(),
            base_every=args.base_every,
            max_staleness=args.max_staleness,
            signing_key=str(key),
            files_from=str(model_dir),
        )
        printer = _StepPrinter(sync, logs)
        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=digits,
            args=GRPOConfig(
                output_dir=str(work / "out"),
                max_steps=args.steps,
                per_device_train_batch_size=args.group,
                num_generations=args.group,
                max_completion_length=args.max_tokens,
                learning_rate=args.lr,
                use_vllm=True,
                vllm_mode="server",
                vllm_server_base_url=server.url,
                use_cpu=True,
                bf16=False,
                report_to=[],
                save_strategy="no",
                logging_steps=1,
            ),
            train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
            processing_class=tokenizer,
            callbacks=[sync, printer],
        )
        trainer.train()
        served = sync.engine.served_steps()[0]
        by_step = {log["published_step"]: log["published_bytes"] for log in logs}
        last = sync.engine.publisher.last_manifest  # the final weights, published at the end of train()
        if last is not None:
            by_step[last.step] = last.payload_bytes
        published = sum(by_step.values())
        print(
            f"\n{len(logs)} GRPO steps through TRL's server mode, no NCCL: {published / 1e6:.2f} MB published "
            f"for {len(by_step)} snapshots (b: a full base, d: a delta); after train() the server serves step {served}, the trained policy"
        )
    finally:
        server.stop()
    return logs


class _StepPrinter(TrainerCallback):
    """Prints one line per optimizer step, from the trainer's log and the sync's engine."""

    def __init__(self, sync: Any, logs: list[dict]) -> None:
        self.sync, self.logs = sync, logs
        self._started = time.perf_counter()
        print(f"{'step':>4} {'reward':>7} {'served':>6} {'stale':>5} {'last published':>17} {'s':>5}", flush=True)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not logs or "reward" not in logs or self.sync.engine is None:
            return
        engine = self.sync.engine
        manifest = engine.publisher.last_manifest
        served = engine.served_steps()[0]
        log = {
            "step": state.global_step,
            "reward": float(logs["reward"]),
            "served": served,
            "staleness": None if served is None else state.global_step - served,
            "published_step": manifest.step if manifest else None,
            "kind": manifest.kind.value if manifest else "-",
            "published_bytes": manifest.payload_bytes if manifest else 0,
            "seconds": time.perf_counter() - self._started,
        }
        self.logs.append(log)
        self._started = time.perf_counter()
        print(
            f"{log['step']:>4} {log['reward']:>7.3f} {served!s:>6} {log['staleness']!s:>5} "
            f"{'s' + str(log['published_step']):>5} {log['published_bytes'] / 1e3:>7.1f}kB {log['kind'][0]} "
            f"{log['seconds']:>5.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
