"""Parallel layouts the vLLM plugin cannot keep exact are refused when the server starts; the
others (tensor parallel, data parallel behind one API server) are served: test_vllm_exactness."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from delta_swap.errors import ConfigError

endpoint = pytest.importorskip("vllm_delta_plugin.endpoint", exc_type=ImportError)


@pytest.mark.parametrize(
    ("dp", "api_servers", "pp", "refused"),
    [(1, 1, 1, None), (2, 1, 1, None), (2, 2, 1, "--api-server-count 1"), (1, 1, 2, "pipeline")],
)
def test_pipeline_parallel_and_several_api_servers_are_refused_at_start(dp, api_servers, pp, refused) -> None:
    parallel = SimpleNamespace(
        data_parallel_size=dp, _api_process_count=api_servers, pipeline_parallel_size=pp, tensor_parallel_size=2
    )
    if refused is None:
        endpoint.refuse_parallel_layouts(parallel)  # TP, and DP behind one API server, are served
        return
    with pytest.raises(ConfigError, match=refused):
        endpoint.refuse_parallel_layouts(parallel)


def _config(quantization=None, lora=None, multimodal=False) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(quantization=quantization, is_multimodal_model=multimodal),
        lora_config=lora,
    )


@pytest.mark.parametrize(
    ("config", "refused"),
    [
        (_config(), None),
        (_config(quantization="fp8"), "--quantization fp8"),
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
