"""The fleet benchmark's trainer: a process that publishes an RL-sized update of one model every
few seconds through the Publisher, in phases driven by files in a control folder.

    python -m benchmarks.fleet_trainer --store s3://fleet/run --model DIR --control DIR \
        --every 8 --steps 10 --phases delta full

It publishes step 0 (a base) and writes ``ready``; then, for each phase, waits for ``go-<phase>``,
publishes ``--steps`` snapshots ``--every`` seconds apart (``delta``: a chain on that base;
``full``: a full base at every step) and writes ``done-<phase>``. Each commit is a JSON line in
``trainer.jsonl`` (phase, step, kind, commit time, payload and model bytes). The updates are
synthetic (2% of elements moved by 1-3 ULP, as between adjacent RL steps): what is measured is
distribution, not learning. Store credentials and endpoint come from the usual AWS variables.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.harness import rl_update
from delta_swap.publisher import Publisher, PublisherConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--control", required=True, type=Path)
    parser.add_argument("--every", type=float, default=8.0, help="seconds between publishes")
    parser.add_argument("--steps", type=int, default=10, help="snapshots per phase")
    parser.add_argument("--phases", nargs="+", default=["delta", "full"], choices=["delta", "full"])
    parser.add_argument("--signing-key", help="private key that signs every manifest")
    parser.add_argument("--keep-bases", type=int, default=2, help="retention: bases kept in the store")
    args = parser.parse_args()

    control: Path = args.control
    weights = load_file(str(args.model / "model.safetensors"))
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    gen = torch.Generator().manual_seed(0)
    files = {
        n: (args.model / n).read_bytes()
        for n in ("config.json", "tokenizer.json", "tokenizer_config.json")
        if (args.model / n).exists()
    }
    config = PublisherConfig(
        base_every=1_000_000, keep_bases=args.keep_bases, signing_key=args.signing_key, resume=False
    )
    log = (control / "trainer.jsonl").open("a")
    with Publisher(args.store, config, files=files) as publisher:

        def publish(step: int, phase: str) -> None:
            start = time.time()
            snapshot_id = publisher.publish(step, weights, force_base=phase != "delta")
            publisher.flush()
            manifest = publisher.last_manifest
            assert manifest is not None and manifest.snapshot_id == snapshot_id
            log.write(
                json.dumps(
                    {
                        "phase": phase,
                        "step": step,
                        "kind": str(manifest.kind),
                        "t": time.time(),
                        "publish_s": time.time() - start,
                        "payload_bytes": manifest.payload_bytes,
                        "model_bytes": model_bytes,
                    }
                )
                + "\n"
            )
            log.flush()

        publish(0, "setup")
        rl_update(weights, gen)  # each next step is computed while waiting for its slot
        (control / "ready").touch()
        step = 0
        for phase in args.phases:
            while not (control / f"go-{phase}").exists():
                time.sleep(0.1)
            started = time.monotonic()
            for k in range(args.steps):
                time.sleep(max(0.0, started + k * args.every - time.monotonic()))
                step += 1
                publish(step, phase)
                rl_update(weights, gen)
            (control / f"done-{phase}").touch()


if __name__ == "__main__":
    main()
