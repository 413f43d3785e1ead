"""TRL's GRPOTrainer in vLLM server mode with DeltaSwapSync (vllm_delta_plugin.trl_sync).

Real TRL (the version pinned in delta_swap.integrations.versions) trains a tiny Llama on CPU for a few
steps, generating through a live vLLM server with the plugin; every weight sync lands in the store
as a snapshot (a base, then deltas), no NCCL group is made (nor asked of the server), and after
``train()`` the server serves exactly the trainer's final bf16 weights: its prompt logprobs equal
a fresh server's on a checkpoint of them.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", exc_type=ImportError)
pytest.importorskip("trl")

from delta_swap.chain import ChainReader  # noqa: E402
from delta_swap.errors import ConfigError  # noqa: E402
from delta_swap.integrations import versions as compat  # noqa: E402
from delta_swap.manifest import SnapshotKind  # noqa: E402
from delta_swap.rebuild import rebuild  # noqa: E402
from delta_swap.stores import FileStore  # noqa: E402
from tests.support.chains import assert_state_equal  # noqa: E402


def test_an_unsupported_trl_fails_in_one_line() -> None:
    assert compat.is_supported(compat.installed_version("trl"), "trl")
    with pytest.raises(ConfigError, match=r"supports 1\.16\.x, not TRL 1\.17\.0: install 'trl>=1\.16,<1\.17'"):
        compat.check_version("trl", "1.17.0")


@pytest.fixture(scope="module")
def follower(tmp_path_factory):
    """One vLLM server with the plugin following an empty store, with the dev endpoints TRL's
    server mode reads (``/server_info``)."""
    from examples.servers import vllm as vllm_server
    from examples.tiny_model import make_tiny_model

    work = tmp_path_factory.mktemp("trl-grpo")
    model_dir = make_tiny_model(work / "init")
    (work / "store").mkdir()
    settings = {"store": (work / "store").as_uri(), "poll_interval": 0.2, "admin_open_loopback": True}
    server = vllm_server.start(
        model_dir, work, settings=settings, served_name="tiny", env={"VLLM_SERVER_DEV_MODE": "1"}, log_name="plugin.log"
    )
    try:
        yield server, model_dir, work
    finally:
        server.stop()


@pytest.mark.engine
async def test_grpo_in_server_mode_syncs_through_the_store_and_ends_serving_the_trained_policy(
    follower, monkeypatch
) -> None:
    import requests
    from trl import GRPOTrainer

    from delta_swap.integrations.hf_names import checkpoint_tensors
    from delta_swap.testing.engine_exactness import PROMPTS
    from examples.trl_grpo import digits
    from tests.support.trainers import fresh_server_logprobs, grpo_config, grpo_task, write_checkpoint
    from tests.test_vllm_exactness import completion_logprobs
    from vllm_delta_plugin.trl_sync import DeltaSwapSync

    server, model_dir, work = follower
    posted: list[str] = []
    real_post = requests.Session.post

    def recording_post(self, url, *args, **kwargs):  # type: ignore[no-untyped-def]
        posted.append(str(url))
        return real_post(self, url, *args, **kwargs)

    monkeypatch.setattr(requests.Session, "post", recording_post)
    groups: list[str] = []  # process groups made while training (another test may have left one)

    def recorder(name: str, real):  # type: ignore[no-untyped-def]
        def record(*args, **kwargs):  # type: ignore[no-untyped-def]
            groups.append(name)
            return real(*args, **kwargs)

        return record

    for name in ("init_process_group", "new_group"):
        monkeypatch.setattr(torch.distributed, name, recorder(name, getattr(torch.distributed, name)))
    before = [completion_logprobs(server.url, p) for p in PROMPTS]

    tokenizer, prompts = grpo_task(model_dir)
    config = grpo_config(
        work / "out",
        max_steps=3,
        learning_rate=1e-3,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server.url,
    )
    sync = DeltaSwapSync((work / "store").as_uri(), base_every=10, max_staleness=0, files_from=str(model_dir))
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=digits,
        args=config,
        train_dataset=prompts,
        processing_class=tokenizer,
        callbacks=[sync],
    )
    trainer.train()

    assert type(trainer.vllm_generation.vllm_client).__name__ == "DeltaSwapVLLMClient"
    assert groups == []
    nccl_routes = ("init_weight_transfer_engine", "update_weights", "start_weight_update", "finish_weight_update")
    assert not [u for u in posted if u.rstrip("/").endswith(nccl_routes)], posted
    assert any(u.endswith("/v1/completions") for u in posted), "TRL generated elsewhere than through the server"

    store = FileStore(work / "store")
    chain = await ChainReader(store).list()
    assert [m.step for m in chain] == [0, 1, 2, 3]  # a sync before each step's generation, then the final weights
    assert [m.kind for m in chain] == [SnapshotKind.BASE] + [SnapshotKind.DELTA] * 3
    final = checkpoint_tensors(trainer.model, dtype=torch.bfloat16)
    _, state, _ = await rebuild(store)
    assert_state_equal(state, final)
    assert sync.engine.served_steps() == [3]
    served = [completion_logprobs(server.url, p) for p in PROMPTS]

    expected = fresh_server_logprobs(write_checkpoint(model_dir, work / "step-3", final), work)
    assert expected != before, "three GRPO steps changed no logprob: the check could not fail"
    assert served == expected
