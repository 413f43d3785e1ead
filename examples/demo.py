"""delta-swap demo: publish a few RL-like steps of a tiny generated model, pull, verify.

Runs entirely on this machine: a local ``file://`` store, a tiny Llama-style model made on the
spot, and the ``delta-swap`` CLI as a user would call it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from delta_swap.tiny_model import make_tiny_model, perturb_weights


def cli(*args: str, show: bool = True) -> str:
    """Run the delta-swap command as a user would, echoing it and its output."""
    out = subprocess.run([sys.executable, "-m", "delta_swap.cli", *args], check=True, capture_output=True, text=True).stdout
    if show:
        print("$ delta-swap " + " ".join(args) + "\n" + out, end="", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", help="where to put the model and the store (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-demo-"))
    store = (work / "store").as_uri()

    print(f"== generating a tiny Llama-style model in {work}")
    checkpoints = [make_tiny_model(work / "step-0")]
    for step in range(1, args.steps):
        checkpoints.append(perturb_weights(checkpoints[-1], work / f"step-{step}", seed=step))

    print(f"== publishing {args.steps} steps to {store} (a base, then deltas)")
    for step, ckpt in enumerate(checkpoints):
        cli("publish", str(ckpt), "--store", store, "--step", str(step))
    cli("inspect", "--store", store)
    rows = json.loads(cli("inspect", "--store", store, "--json", show=False))

    print("== pulling the newest snapshot and comparing it with the trainer's checkpoint")
    out = work / "pulled"
    cli("pull", "--store", store, "--out", str(out), "--quiet")
    got, want = load_file(str(out / "model.safetensors")), load_file(str(checkpoints[-1] / "model.safetensors"))
    same = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    delta_bytes = sum(r["payload_bytes"] for r in rows if r["kind"] == "delta")
    n_deltas = sum(r["kind"] == "delta" for r in rows)
    print(f"bit-exact: {same}; average delta: {100 * delta_bytes / max(1, n_deltas) / rows[0]['model_bytes']:.2f}% "
          f"of the model")
    if not same:
        sys.exit("demo failed: pulled tensors differ")


if __name__ == "__main__":
    main()
