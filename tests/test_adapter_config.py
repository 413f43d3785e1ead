"""Adapter settings: flags win over DELTA_SWAP_* variables, which win over defaults."""

from __future__ import annotations

import argparse

import pytest

from delta_swap.engine_adapter import DrainPolicy, SwapConfig


def test_given_values_then_environment_then_defaults() -> None:
    env = {"DELTA_SWAP_STORE": "s3://b/p", "DELTA_SWAP_DRAIN": "keep", "DELTA_SWAP_POLL_INTERVAL": "0.5"}
    cfg = SwapConfig.load({"drain": "abort", "drain_timeout_s": None}, env)
    assert cfg == SwapConfig("s3://b/p", poll_interval_s=0.5, drain=DrainPolicy.ABORT, drain_timeout_s=30.0)
    assert SwapConfig.load(None, {}) == SwapConfig(None)


def test_bad_settings_name_the_variable() -> None:
    with pytest.raises(ValueError, match="DELTA_SWAP_DRAIN='sometimes'"):
        SwapConfig.load(None, {"DELTA_SWAP_DRAIN": "sometimes"})
    with pytest.raises(ValueError, match="DELTA_SWAP_POLL_INTERVAL"):
        SwapConfig.load(None, {"DELTA_SWAP_POLL_INTERVAL": "soon"})


def test_engine_configs_extend_the_shared_one() -> None:
    pytest.importorskip("vllm", reason="the vLLM adapter's config needs vLLM installed")  # it is, in scripts/env.sh
    from vllm_delta_plugin.config import PluginConfig as VllmConfig

    cfg = VllmConfig.load(None, {"DELTA_SWAP_STORE": "/x", "DELTA_SWAP_STAGING_DIR": "/tmp/stage"})
    assert cfg.store_url == "/x" and cfg.staging_dir == "/tmp/stage" and cfg.drain is DrainPolicy.WAIT

    from sglang_delta_plugin.config import PluginConfig as SglangConfig

    args = argparse.Namespace(delta_swap_source="file:///s", delta_swap_poll_interval=None,
                              delta_swap_drain="keep", delta_swap_drain_timeout=5.0)
    cfg = SglangConfig.from_sources(args, {"DELTA_SWAP_POLL_INTERVAL": "0.25", "DELTA_SWAP_STORE": "/ignored"})
    assert (cfg.store_url, cfg.poll_interval_s, cfg.drain, cfg.drain_timeout_s) == ("file:///s", 0.25, DrainPolicy.KEEP, 5.0)
