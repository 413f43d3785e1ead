"""Parallel layouts the vLLM plugin cannot keep exact are refused when the server starts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from delta_swap.errors import ConfigError

endpoint = pytest.importorskip("vllm_delta_plugin.endpoint", exc_type=ImportError)


@pytest.mark.parametrize(("dp", "pp", "refused"), [(1, 1, None), (2, 1, "data-parallel"), (1, 2, "pipeline")])
def test_data_and_pipeline_parallel_are_refused_at_start(dp, pp, refused) -> None:
    parallel = SimpleNamespace(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=2)
    if refused is None:
        endpoint.refuse_parallel_layouts(parallel)  # TP alone is supported
        return
    with pytest.raises(ConfigError, match=refused):
        endpoint.refuse_parallel_layouts(parallel)
