"""A real RL loop on a live fleet: a GRPO trainer and rollout servers that hot-swap every step.

    python -m examples.rl_loop                       # one vLLM server with the delta_swap plugin
    python -m examples.rl_loop --engine sglang       # one SGLang server
    python -m examples.rl_loop --engine both         # one of each, rollouts spread over both

The trainer holds fp32 master weights of a small Llama (generated on the spot, random init) and
optimizes it with AdamW. Each step it asks the fleet for groups of completions through the
official ``openai`` client (the OpenAI-compatible API only: the snapshot that produced each
completion comes back on the completion itself), scores them with a programmatic reward (the
fraction of generated tokens that contain a digit), computes GRPO advantages (rewards normalised
within each group of completions of one prompt), takes one policy-gradient step, and publishes the
new bf16 weights through ``delta_swap.Publisher`` (a full base every ``--base-every`` steps, lossless
deltas in between). The servers pull each step, verify it and swap it in while they keep serving.

Off-policy control: before sampling for step s the trainer waits until every server serves at least
step s-1-k (``--max-staleness k``, read from ``/delta_swap/status``), and it drops any rollout made by
an older snapshot (it reports how many). By default the next batch is sampled while the trainer
trains (``--no-async-rollouts`` turns that off), as production RL systems do, so rollouts lag a
step behind and the bound does real work. The loop prints, per step, the reward, the snapshots the
rollouts came from, their staleness (trainer step minus rollout version, p50/max), the servers'
last swap window and the bytes published, and writes a PNG of reward and staleness over steps.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from delta_swap import Publisher, PublisherConfig
from examples.servers.process import Server
from examples.tiny_model import make_tiny_model

PROMPT_WORDS = "the model learns to write numbers like years and counts in every short answer it gives".split()


def version_step(version: str | None) -> int | None:
    """``step-0000000012`` -> 12."""
    try:
        return int(str(version).rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return None


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float
    version: int | None
    group: int


@dataclass
class StepLog:
    step: int
    reward: float
    versions: list[int | None]
    staleness: list[int]
    dropped: int
    window_ms: float | None
    published_bytes: int
    seconds: float
    extra: dict = field(default_factory=dict)


class Fleet:
    """The rollout servers, reached only through their OpenAI-compatible API and status route."""

    def __init__(self, servers: list[tuple[str, Server]]) -> None:
        from openai import OpenAI

        self.servers = servers
        self.clients = [OpenAI(base_url=f"{s.url}/v1", api_key="none", timeout=300) for _, s in servers]

    def sample(self, i: int, prompt: str, n: int, max_tokens: int) -> list[tuple[list[int], list[int], int | None]]:
        """``n`` completions of ``prompt`` from server ``i``: (prompt ids, completion ids, version step)."""
        client = self.clients[i % len(self.clients)]
        response = client.completions.create(
            model="policy",
            prompt=prompt,
            n=n,
            max_tokens=max_tokens,
            temperature=1.0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        out = []
        for choice in response.choices:
            extra = choice.model_extra or {}
            spans = extra.get("weight_versions") or []
            version = version_step(spans[0]["version"]) if spans else None  # the oldest snapshot that contributed
            prompt_ids = extra.get("prompt_token_ids") or []
            out.append((list(prompt_ids), list(extra.get("token_ids") or []), version))
        return out

    def statuses(self) -> list[dict]:
        return [httpx.get(f"{s.url}/delta_swap/status", timeout=30).json() for _, s in self.servers]

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all((st["current_step"] or 0) >= step for st in self.statuses()):
                return
            time.sleep(0.05)
        raise TimeoutError(f"the fleet did not reach step {step}: {[st['current_step'] for st in self.statuses()]}")


def digit_reward(tokenizer, completion_ids: list[int]) -> float:
    """The fraction of generated tokens whose text contains a digit."""
    if not completion_ids:
        return 0.0
    return sum(any(c.isdigit() for c in tokenizer.decode([t])) for t in completion_ids) / len(completion_ids)


def grpo_loss(model: torch.nn.Module, rollouts: list[Rollout]) -> torch.Tensor:
    """Policy-gradient loss with group-normalised advantages (GRPO without a KL term)."""
    groups: dict[int, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group, []).append(r)
    losses = []
    for members in groups.values():
        rewards = torch.tensor([r.reward for r in members])
        advantages = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-4)
        for r, advantage in zip(members, advantages):
            if not r.completion_ids or advantage == 0:
                continue
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            taken = logprobs.gather(1, torch.tensor(r.completion_ids).unsqueeze(1)).squeeze(1)
            losses.append(-advantage * taken.mean())
    return torch.stack(losses).mean() if losses else torch.zeros((), requires_grad=True)


def start_fleet(engine: str, model: Path, store: Path, work: Path) -> list[tuple[str, Server]]:
    from examples.servers import sglang as sglang_server
    from examples.servers import vllm as vllm_server

    settings = {"store": store.as_uri(), "poll_interval": 0.1}
    servers = []
    if engine in ("vllm", "both"):
        servers.append(("vllm", vllm_server.start(model, work / "vllm", settings=settings, served_name="policy")))
    if engine in ("sglang", "both"):
        servers.append(("sglang", sglang_server.start(model, work / "sglang", settings=settings, served_name="policy")))
    return servers


def train(args: argparse.Namespace) -> list[StepLog]:
    from transformers import AutoTokenizer, LlamaForCausalLM

    work = Path(args.workdir)
    model_dir = make_tiny_model(
        work / "policy-init",
        hidden_size=args.hidden,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=2 * args.hidden,
        init_std=0.02,
        seed=args.seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(args.seed)
    policy = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)  # fp32 master weights
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    store = work / "store"
    publisher = Publisher(
        str(store),
        PublisherConfig(base_every=args.base_every),
        files={n: (model_dir / n).read_bytes() for n in ("config.json", "tokenizer.json", "tokenizer_config.json")},
    )

    def publish(step: int) -> str:
        return publisher.publish(step, {k: v.detach().to(torch.bfloat16) for k, v in policy.state_dict().items()})

    publish(0)
    publisher.flush()
    print(f"== starting {args.engine} rollout server(s) on the initial policy, following {store.as_uri()}", flush=True)
    fleet = Fleet(start_fleet(args.engine, model_dir, store, work))
    rng = random.Random(args.seed)
    logs: list[StepLog] = []
    pipeline: Pipeline | None = None
    try:
        fleet.wait_for_step(0)
        print(
            f"{'step':>4} {'reward':>7} {'rollout versions':>18} {'stale p50/max':>13} {'dropped':>7} "
            f"{'swap window':>11} {'published':>10} {'s':>5}",
            flush=True,
        )

        def sample_batch() -> list:
            prompts = [" ".join(rng.sample(PROMPT_WORDS, 4)) for _ in range(args.prompts)]
            with ThreadPoolExecutor(len(prompts)) as pool:
                return list(
                    pool.map(lambda ip: fleet.sample(ip[0], ip[1], args.group, args.max_tokens), enumerate(prompts))
                )

        if args.async_rollouts:
            pipeline = Pipeline(sample_batch, fleet, args.max_staleness)
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            oldest_allowed = step - 1 - args.max_staleness
            rollouts, dropped = [], 0
            while not rollouts:  # a batch made entirely of too-old rollouts is dropped; sample again
                if pipeline is not None:  # rollouts were made while the previous steps trained
                    batches = pipeline.next(step)
                else:
                    fleet.wait_for_step(max(0, oldest_allowed))
                    batches = sample_batch()
                for g, batch in enumerate(batches):
                    for prompt_ids, completion_ids, version in batch:
                        if version is None or version < oldest_allowed:
                            dropped += 1  # too old (or unknown): off-policy beyond the bound
                            continue
                        rollouts.append(
                            Rollout(prompt_ids, completion_ids, digit_reward(tokenizer, completion_ids), version, g)
                        )
            loss = grpo_loss(policy, rollouts)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            publish(step)
            publisher.flush()
            manifest_bytes = _payload_bytes(store, step)
            windows = [st["last_update_timings_s"] for st in fleet.statuses()]
            window = [sum(t.get(p, 0.0) for p in ("pause", "swap", "resume")) for t in windows if t]
            log = StepLog(
                step,
                statistics.fmean(r.reward for r in rollouts) if rollouts else 0.0,
                [r.version for r in rollouts],
                [step - 1 - r.version for r in rollouts if r.version is not None],
                dropped,
                1000 * max(window) if window else None,
                manifest_bytes,
                time.perf_counter() - started,
            )
            logs.append(log)
            stale = log.staleness or [0]
            print(
                f"{step:>4} {log.reward:>7.3f} {_versions(log.versions):>18} "
                f"{statistics.median(stale):>6.0f}/{max(stale):<6} {dropped:>7} "
                f"{(f'{log.window_ms:.0f} ms' if log.window_ms is not None else '-'):>11} "
                f"{manifest_bytes / 1e3:>8.1f}kB {log.seconds:>5.1f}",
                flush=True,
            )
    finally:
        if pipeline is not None:
            pipeline.close()
        publisher.close()
        for _, server in fleet.servers:
            server.stop()
    return logs


class Pipeline:
    """Asynchronous rollouts: a thread keeps sampling batches from whatever snapshots the fleet
    serves while the trainer trains, a bounded queue ahead; before each batch it waits until the
    fleet serves at least the oldest step the trainer will accept (bounded staleness)."""

    def __init__(self, sample: Callable[[], list], fleet: Fleet, max_staleness: int, depth: int = 1) -> None:
        self.sample, self.fleet, self.max_staleness = sample, fleet, max_staleness
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.next_step = 1  # the trainer step the batch being sampled now will feed
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.fleet.wait_for_step(max(0, self.next_step - 1 - self.max_staleness))
                batch = self.sample()
            except Exception as exc:  # surfaced to the trainer
                batch = exc
            while not self.stop.is_set():
                try:
                    self.queue.put(batch, timeout=0.2)
                    break
                except queue.Full:
                    continue

    def next(self, step: int) -> list:
        self.next_step = step + 1  # set before taking a batch: the producer's next batch is for step+1
        batch = self.queue.get()
        if isinstance(batch, Exception):
            raise batch
        return batch

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


def _payload_bytes(store: Path, step: int) -> int:
    manifest = store / "snapshots" / f"step-{step:010d}" / "manifest.json"
    return int(json.loads(manifest.read_text())["payload_bytes"])


def _versions(versions: list[int | None]) -> str:
    known = sorted({v for v in versions if v is not None})
    return ",".join(f"s{v}" for v in known) or "-"


def plot(logs: list[StepLog], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    steps = [log.step for log in logs]
    ax.plot(steps, [log.reward for log in logs], "o-", color="tab:green", label="mean reward (digit tokens)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax2 = ax.twinx()
    ax2.plot(steps, [max(log.staleness or [0]) for log in logs], "s:", color="tab:gray", label="max staleness")
    ax2.plot(
        steps,
        [statistics.median(log.staleness or [0]) for log in logs],
        ".--",
        color="tab:purple",
        label="median staleness",
    )
    ax2.set_ylabel("staleness (steps)")
    ax2.set_ylim(-0.2, max(2, max(max(log.staleness or [0]) for log in logs)) + 0.5)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[StepLog]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["vllm", "sglang", "both"], default="vllm")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (one group of completions each)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO group size)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--base-every", type=int, default=10)
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="k: sample step s only once the fleet serves step s-1-k; drop older rollouts",
    )
    parser.add_argument(
        "--async-rollouts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sample the next batch while the trainer trains (rollouts then lag behind); "
        "--no-async-rollouts samples only once the fleet serves the newest step",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir")
    parser.add_argument("--plot", help="where the reward/staleness PNG goes (default: the work folder)")
    args = parser.parse_args(argv)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="delta-swap-rl-")
    args.plot = args.plot or str(Path(args.workdir) / "rl_loop.png")
    logs = train(args)
    first = statistics.fmean(log.reward for log in logs[: max(1, len(logs) // 4)])
    last = statistics.fmean(log.reward for log in logs[-max(1, len(logs) // 4) :])
    published = sum(log.published_bytes for log in logs)
    print(
        f"\nreward {first:.3f} -> {last:.3f} over {len(logs)} steps; {published / 1e6:.2f} MB published in "
        f"{len(logs)} snapshots; max staleness {max(max(log.staleness or [0]) for log in logs)} "
        f"(bound {args.max_staleness}); {sum(log.dropped for log in logs)} rollouts dropped"
    )
    engines = {"vllm": "vLLM", "sglang": "SGLang", "both": "vLLM + SGLang"}[args.engine]
    mode = "asynchronous rollouts" if args.async_rollouts else "synchronous rollouts"
    plot(
        logs,
        Path(args.plot),
        f"GRPO on a live {engines} fleet, hot-swapped every step ({mode}, max staleness {args.max_staleness})",
    )
    print(f"wrote {args.plot}")
    return logs


if __name__ == "__main__":
    main(sys.argv[1:])
