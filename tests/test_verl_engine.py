"""verl 0.9's checkpoint-engine interface with delta-swap's ``delta_swap`` backend, on CPU.

verl pins transformers below what vLLM 0.32 needs, so it runs in its own environment
(scripts/verl_env.sh: verl and its pins, layered on the project's environment). verl's checkpoint
engines, registry and config import there without a GPU; its trainer (Ray workers over FSDP) and
its own rollout servers are not started: tests/support/verl_trainer.py builds the engine on two
gloo ranks exactly as verl's actor worker and CheckpointEngineWorker do and drives it with a
trained model's weights, while a real vLLM server with the plugin follows the store (the engine
waits for it: ``max_staleness: 0``). After the last step the server's prompt logprobs must equal
a fresh server's on the trainer's final checkpoint, and ``delta-swap pull`` must rebuild that
checkpoint bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from safetensors.torch import load_file

from delta_swap.errors import ConfigError
from delta_swap.integrations import versions
from delta_swap.signing import generate_keypair
from examples.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def verl_python() -> str:
    """The verl environment's interpreter (built once by scripts/verl_env.sh, then cached)."""
    built = subprocess.run(
        ["bash", str(ROOT / "scripts" / "verl_env.sh")], check=True, capture_output=True, text=True, timeout=900
    )
    return str(Path(built.stdout.strip().splitlines()[-1]) / "bin" / "python")


def run_in_verl(python: str, *args: str, timeout: float = 900) -> str:
    """Run ``python *args`` in the verl environment and return its stdout; fail with its stderr's
    tail if it fails."""
    done = _verl_process(python, *args, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _verl_process(python: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python *args`` from the checkout, with this checkout's code first on its path."""
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([python, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


PROBE = """
import asyncio, json, torch
import verl
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs
import_external_libs("delta_swap.integrations.verl")
from delta_swap.errors import ConfigError
from delta_swap.integrations.verl import DeltaSwapCheckpointEngine

from verl.workers.rollout.utils import ensure_async_iterator

async def collect(items):
    return [item async for item in items]

engine_cls = CheckpointEngineRegistry.get("delta_swap")
engine = CheckpointEngineRegistry.new(
    "delta_swap", bucket_size=1 << 20, store_url="file:///nonexistent/store", model_path=MODEL
)
errors = []
for kwargs in (
    {"store_url": "file:///tmp/x", "model_path": MODEL, "base_evry": 3},
    {"model_path": MODEL},
    {"store_url": "file:///tmp/x", "model_path": MODEL + "/missing"},
):
    try:
        CheckpointEngineRegistry.new("delta_swap", bucket_size=1 << 20, **kwargs)
    except ConfigError as exc:
        errors.append(str(exc))
print(json.dumps({
    "verl": verl.__version__,
    "cuda": torch.cuda.is_available(),
    "registered": engine_cls is DeltaSwapCheckpointEngine,
    "subclass": issubclass(engine_cls, CheckpointEngine),
    "abstract_left": sorted(engine_cls.__abstractmethods__),
    # verl's SGLang adapter iterates the rollout side's flushes with `for`, its vLLM adapter async
    "received_sync": list(engine.receive_weights(global_steps=1)),
    "received_async": asyncio.run(collect(ensure_async_iterator(engine.receive_weights(global_steps=1)))),
    "topology": engine_cls.build_topology(2, 4, [{}] * 6),
    "errors": errors,
}))
"""


def test_engine_registers_with_verl_and_implements_its_abstract_base(verl_python: str, tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", family="qwen3")
    found = json.loads(run_in_verl(verl_python, "-c", f"MODEL = {str(model)!r}\n" + PROBE).strip().splitlines()[-1])
    assert versions.is_supported(found["verl"], "verl"), found["verl"]
    assert found["cuda"] is False  # verl's checkpoint engines import and run here without a GPU
    assert found["registered"] and found["subclass"] and found["abstract_left"] == []
    assert found["received_sync"] == [] and found["received_async"] == []
    assert found["topology"] == [{}, {}]  # no process group between trainer and servers
    unknown, missing, not_a_folder = found["errors"]
    assert "unknown base_evry" in unknown and "\n" not in unknown
    assert "store_url is required" in missing
    assert "missing is not a folder" in not_a_folder


def test_unsupported_verl_fails_in_one_line() -> None:
    assert versions.is_supported("0.9.1", "verl") and not versions.is_supported("0.10.0", "verl")
    with pytest.raises(ConfigError) as raised:
        versions.check_version("verl", "0.10.0")
    assert "verl 0.10.0" in str(raised.value) and "verl>=0.9,<0.10" in str(raised.value)
    with pytest.raises(ConfigError, match="verl, which is not installed: install 'verl>=0.9,<0.10'"):
        versions.check_version("verl")  # the project's environment has no verl
    pins = [line for line in (ROOT / "requirements" / "verl.txt").read_text().splitlines() if line.startswith("verl==")]
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["verl"]
    pins += [pin for pin in extra if pin.startswith("verl==")]
    assert len(pins) == 2 and all(versions.is_supported(line.split("==")[1], "verl") for line in pins), pins


def test_ranks_that_yield_different_streams_fail_on_every_rank_before_publishing(verl_python, tmp_path) -> None:
    model = make_tiny_model(tmp_path / "model", family="qwen3")
    key, _ = generate_keypair(tmp_path / "trainer.key")
    args = ["-m", "tests.support.verl_trainer", "--model", str(model), "--store", (tmp_path / "store").as_uri()]
    args += ["--key", str(key), "--out", str(tmp_path / "out"), "--first", "1", "--last", "1", "--skew"]
    done = _verl_process(verl_python, *args, timeout=600)
    assert done.returncode != 0
    assert done.stderr.count("yielded different tensor names or orders (2 different streams among 2 ranks)") >= 1
    assert not (tmp_path / "store" / "HEAD").exists() and not list((tmp_path / "store").glob("**/*.dsd"))


@pytest.fixture(scope="module")
def follower(tmp_path_factory):
    """One vLLM server with the plugin following an empty store, on a tiny Qwen3 (tied embeddings)."""
    from examples.servers import vllm as vllm_server

    work = tmp_path_factory.mktemp("verl")
    model_dir = make_tiny_model(work / "init", family="qwen3")
    (work / "store").mkdir()
    key, public = generate_keypair(work / "trainer.key")
    settings = {
        "store": (work / "store").as_uri(),
        "trusted_key": str(public),
        "poll_interval": 0.2,
        "swap_path": "reload",
        "admin_open_loopback": True,
    }
    server = vllm_server.start(model_dir, work, settings=settings, served_name="tiny", log_name="plugin.log")
    try:
        yield server, model_dir, work, key, public
    finally:
        server.stop()


@pytest.mark.engine
def test_actor_ranks_publish_every_sync_and_a_server_ends_on_the_trained_weights(verl_python: str, follower) -> None:
    from delta_swap.testing.engine_exactness import PROMPTS
    from tests.support.trainers import fresh_server_logprobs, write_checkpoint
    from tests.test_vllm_exactness import completion_logprobs

    server, model, work, key, public = follower
    store = (work / "store").as_uri()
    before = [completion_logprobs(server.url, p) for p in PROMPTS]
    common = ("--store", store, "--key", str(key), "--checkpoint", str(model), "--base-every", "3")
    common += ("--world-size", "2", "--server-url", server.url)
    trainer = ("-m", "tests.support.verl_trainer")
    first = _lines(run_in_verl(verl_python, *trainer, *common, "--model", str(model), "--out", str(work / "run1")))
    # a restarted verl run: it loads the step-4 checkpoint, syncs step 4 again, then trains 5 and 6
    run1 = str(work / "run1")
    args = ("--model", run1, "--out", str(work / "run2"), "--first", "5", "--last", "6", "--resume")
    second = _lines(run_in_verl(verl_python, *trainer, *common, *args))

    for lines, steps in ((first, [1, 2, 2, None, 3, 4]), (second, [4, 5, 6])):
        syncs = [line for line in lines if "rank" in line]
        for rank in (0, 1):
            mine = [s for s in syncs if s["rank"] == rank]
            assert [s["step"] for s in mine] == steps
            assert all(s["received"] == 0 for s in mine)  # nothing travels through verl to the rollout side
            # verl merges every rank's metrics into one dict: only rank 0 reports
            assert all(bool(s["metrics"]) == (rank == 0) for s in mine)
        ours = [s for s in syncs if s["rank"] == 0]
        # a sync with no step re-syncs the last one; max_staleness 0: each sync returned with the server on it
        assert [s["metrics"]["delta_swap/step"] for s in ours] == [s if s is not None else 2 for s in steps]
        assert [s["served"] for s in ours] == [[s if s is not None else 2] for s in steps]
        engine = {"engine": "delta_swap.integrations.verl.DeltaSwapCheckpointEngine", "wire_format": "delta_flush"}
        assert engine in lines
    served = [completion_logprobs(server.url, p) for p in PROMPTS]

    # every step once (syncs of a published step publish nothing), signed; base, deltas, base, deltas
    chain = json.loads(_cli("inspect", "--store", store, "--trusted-key", str(public), "--json"))
    kinds = ["base", "delta", "delta", "base", "delta", "delta"]
    assert [(s["step"], s["kind"]) for s in chain] == list(zip(range(1, 7), kinds))

    # each rank published its own half, whole tensors: together the checkpoint's names, tied head left out
    final = load_file(str(work / "run2" / "model.safetensors"))
    shares = [set(next(s["share"] for s in first if s.get("rank") == r and s["step"] == 4)) for r in (0, 1)]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert shares[0] | shares[1] == set(final) == set(load_file(str(model / "model.safetensors")))
    assert "lm_head.weight" not in final

    # what the store rebuilds is the trainer's bf16 weights after the last step, bit for bit
    _cli("pull", "--store", store, "--out", str(work / "pulled"), "--trusted-key", str(public), "--quiet")
    pulled = load_file(str(work / "pulled" / "model.safetensors"))
    assert set(pulled) == set(final)
    for name, tensor in final.items():
        assert pulled[name].dtype == tensor.dtype == torch.bfloat16
        assert torch.equal(pulled[name].view(torch.int16), tensor.view(torch.int16)), name
    assert json.loads((work / "pulled" / "config.json").read_text())["tie_word_embeddings"] is True

    # and the server serves exactly what a fresh server started on that checkpoint serves
    last = write_checkpoint(model, work / "step-6", final)  # the servers' config and tokenizer, trained weights
    expected = fresh_server_logprobs(last, work, settings={"swap_path": "reload"})
    assert expected != before, "six optimizer steps change no logprob: the check could not fail"
    assert served == expected


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "delta_swap.cli", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout
