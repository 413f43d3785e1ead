"""delta-swap demo: a trainer publishes RL-like steps of a tiny model; a live vLLM server follows.

Everything runs on this machine: a local ``file://`` store, a tiny Llama-style model generated on
the spot, the ``delta-swap`` CLI, and a real vLLM server (CPU build) with the ``delta_swap``
plugin that hot-swaps each new snapshot while it keeps answering requests.

    python -m examples.demo              # the full demo (from the repository root)
    python -m examples.demo --no-engine  # store round trip only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from examples.servers import vllm as vllm_server
from examples.tiny_model import make_tiny_model, perturb_weights

PROMPT = [5, 17, 99, 230, 41, 300, 301, 302]


def cli(*args: str, show: bool = True) -> str:
    """Run the delta-swap command as a user would, echoing it and its output."""
    out = subprocess.run(
        [sys.executable, "-m", "delta_swap.cli", *args], check=True, capture_output=True, text=True
    ).stdout
    if show:
        print("$ delta-swap " + " ".join(args) + "\n" + out, end="", flush=True)
    return out


def store_round_trip(work: Path, store: str, checkpoints: list[Path]) -> None:
    print(f"== publishing {len(checkpoints)} steps to {store} (a base, then deltas)")
    for step, ckpt in enumerate(checkpoints):
        cli("publish", str(ckpt), "--store", store, "--step", str(step))
    cli("inspect", "--store", store)
    rows = json.loads(cli("inspect", "--store", store, "--json", show=False))

    print("== pulling the newest snapshot and comparing it with the trainer's checkpoint")
    out = work / "pulled"
    cli("pull", "--store", store, "--out", str(out), "--quiet")
    got, want = load_file(str(out / "model.safetensors")), load_file(str(checkpoints[-1] / "model.safetensors"))
    same = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    deltas = [r for r in rows if r["kind"] == "delta"]
    avg = sum(r["payload_bytes"] for r in deltas) / max(1, len(deltas)) / rows[0]["model_bytes"]
    print(f"bit-exact: {same}; average delta: {100 * avg:.2f}% of the model\n")
    if not same:
        sys.exit("demo failed: pulled tensors differ")


def generate(url: str) -> dict:
    body = {"model": "tiny", "token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "temperature": 0.0}}
    return httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120).json()["choices"][0]


def live_swap(work: Path, store: str, checkpoints: list[Path]) -> None:
    print("== starting vLLM with the delta_swap plugin, following a store that holds step 0")
    cli("publish", str(checkpoints[0]), "--store", store, "--step", "0", show=False)
    settings = {"store": store, "poll_interval": 0.5}
    print(
        f"$ VLLM_PLUGINS=delta_swap DELTA_SWAP_STORE={store} python -m vllm.entrypoints.openai.api_server "
        f'--model {checkpoints[0]} ... --weight-transfer-config \'{{"backend": "delta_swap"}}\''
    )
    server = vllm_server.start(checkpoints[0], work, settings=settings, served_name="tiny")
    try:
        status_url = f"{server.url}/delta_swap/status"
        for step, ckpt in enumerate(checkpoints):
            if step:  # the trainer publishes the next step while the server keeps serving
                cli("publish", str(ckpt), "--store", store, "--step", str(step), show=False)
            deadline = time.monotonic() + 120
            while (st := httpx.get(status_url, timeout=30).json())["current_step"] != step:
                if time.monotonic() > deadline:
                    sys.exit(f"demo failed: server did not reach step {step}: {st}")
                time.sleep(0.2)
            out = generate(server.url)
            timings = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in st["last_update_timings_s"].items())
            print(
                f"step {step}: serving {st['current_snapshot_id']}  tokens {out['token_ids']}  "
                f"tagged {out['weight_versions'][0]['version']}\n          last update: {timings}"
            )
        print(f"\n$ curl {status_url}\n{json.dumps(httpx.get(status_url).json(), indent=1)}")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", help="where to put the model and the store (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-engine", action="store_true", help="skip the live vLLM part")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="delta-swap-demo-"))

    print(f"== generating a tiny Llama-style model and {args.steps - 1} RL-like updates in {work}")
    checkpoints = [make_tiny_model(work / "step-0")]
    for step in range(1, args.steps):
        checkpoints.append(perturb_weights(checkpoints[-1], work / f"step-{step}", seed=step))

    store_round_trip(work, (work / "store").as_uri(), checkpoints)
    if not args.no_engine:
        live_swap(work, (work / "live-store").as_uri(), checkpoints)
        print("demo ok: every step was hot-swapped into the running server")


if __name__ == "__main__":
    main()
