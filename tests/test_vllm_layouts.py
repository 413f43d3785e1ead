"""Parallel layouts the vLLM plugin cannot keep exact are refused when the server starts; the
others (tensor parallel, data parallel behind one or several API servers) are served:
test_vllm_exactness."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from delta_swap.errors import ConfigError

endpoint = pytest.importorskip("vllm_delta_plugin.endpoint", exc_type=ImportError)


@pytest.mark.parametrize(
    ("dp", "api_servers", "pp", "refused"),
    [(1, 1, 1, None), (2, 1, 1, None), (2, 2, 1, None), (1, 1, 2, "pipeline")],
)
def test_pipeline_parallel_is_refused_at_start(dp, api_servers, pp, refused) -> None:
    parallel = SimpleNamespace(
        data_parallel_size=dp, _api_process_count=api_servers, pipeline_parallel_size=pp, tensor_parallel_size=2
    )
    if refused is None:
        endpoint.refuse_parallel_layouts(parallel)  # TP, and DP behind any number of API servers, are served
        return
    with pytest.raises(ConfigError, match=refused):
        endpoint.refuse_parallel_layouts(parallel)


def test_api_servers_of_one_serve_command_share_one_leader() -> None:
    """vLLM numbers its API servers (``_api_process_rank``); server 0 runs the subscriber, and all
    of them find its socket from their common parent process."""
    places = [endpoint.front_end_of(SimpleNamespace(_api_process_count=3, _api_process_rank=rank)) for rank in range(3)]
    assert [p.leads for p in places] == [True, False, False]
    assert len({p.address for p in places}) == 1 and str(os.getppid()) in str(places[0].address)
    single = endpoint.front_end_of(SimpleNamespace())  # an older vLLM, or one API server
    assert (single.index, single.count, single.leads) == (0, 1, True)


def _config(quantization=None, lora=None, multimodal=False, tp=1) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=1, pipeline_parallel_size=1, tensor_parallel_size=tp),
        model_config=SimpleNamespace(quantization=quantization, is_multimodal_model=multimodal),
        lora_config=lora,
    )


@pytest.mark.parametrize(
    ("config", "refused"),
    [
        (_config(), None),
        (_config(quantization="fp8"), "--quantization fp8"),
        (_config(quantization="int8_per_channel_weight_only"), None),  # kept exact: TestQwen3MoeInt8Shadow
        (_config(quantization="int8_per_channel_weight_only", tp=2), "over tensor- or data-parallel ranks"),
        (_config(lora=SimpleNamespace(max_loras=1)), "--enable-lora"),
        (_config(multimodal=True), "multimodal"),
    ],
)
def test_quantized_lora_and_multimodal_servers_are_refused_at_start(config, refused) -> None:
    if refused is None:
        endpoint.refuse_unsupported(config)
        return
    with pytest.raises(ConfigError, match=refused) as info:
        endpoint.refuse_unsupported(config)
    assert "\n" not in str(info.value)


@pytest.mark.engine
def test_a_lora_server_exits_at_start_with_the_reason(tmp_path) -> None:
    """The refusal is wired into the real server: it exits before serving, its log names why."""
    from examples.servers import vllm as vllm_server
    from examples.tiny_model import make_tiny_model
    from tests.support.rollout_scenarios import publish_dirs

    model = make_tiny_model(tmp_path / "A", family="llama")
    store = tmp_path / "store"
    publish_dirs(store, [(0, model)], None)
    with pytest.raises(RuntimeError, match="server exited") as info:
        server = vllm_server.start(
            model,
            tmp_path,
            settings={"store": store.as_uri()},
            served_name="tiny",
            log_name="lora.log",
            extra=["--enable-lora"],
        )
        server.stop()
    assert "delta_swap does not support --enable-lora yet" in str(info.value) + (tmp_path / "lora.log").read_text()


def test_every_worker_answers_and_the_deployment_takes_the_arena_path_only_if_all_agree(tmp_path) -> None:
    """Each worker of each data-parallel engine writes its own answer; one differing layout, or one
    worker without a layout, sends the whole deployment to the reload path."""
    from vllm_delta_plugin.adapter import merge_layouts, merge_verifications
    from vllm_delta_plugin.worker_results import read_worker_results, write_worker_result

    output = str(tmp_path / "layout.json")
    same = {"layout": {"tensors": [1]}, "reason": "plain", "packed": {}}
    for doc in (same, same):
        write_worker_result(output, doc)  # one pid here: the second replaces the first
    (tmp_path / "layout.json.99999").write_text('{"layout": {"tensors": [2]}, "reason": "plain", "packed": {}}')
    answers = read_worker_results(output)
    assert len(answers) == 2 and not list(tmp_path.iterdir())  # read once, then gone
    assert merge_layouts(answers)["layout"] is None and "different layouts" in merge_layouts(answers)["reason"]
    assert merge_layouts([same, same])["layout"] == same["layout"]
    assert merge_layouts([same, {**same, "layout": None, "reason": "packed"}])["reason"] == "packed"
    # in place (or shadow) only where every rank can: one rank that cannot sends all to the reload path
    plain, packed = {"layout": None, "reason": "plain", "inplace": True}, {"layout": None, "reason": "packed"}
    assert merge_layouts([plain, plain])["inplace"] is True
    assert merge_layouts([plain, packed])["inplace"] is False
    # what each worker does with freed memory: one answer where all agree, each one where they differ
    kept, given = {**plain, "freed_memory": "kept for the next update"}, {**plain, "freed_memory": "given back"}
    assert merge_layouts([kept, kept])["freed_memory"] == "kept for the next update"
    assert merge_layouts([kept, given])["freed_memory"] == "given back; kept for the next update"
    verified = merge_verifications([{"checks": 3, "seconds": 0.1}, {"checks": 4, "seconds": 0.2}])
    assert verified == {"checks": 7, "seconds": 0.2, "workers": 2}
    assert "shards" in merge_verifications([{"checks": 0, "seconds": 0.0, "skipped": "ranks hold shards"}])["skipped"]
