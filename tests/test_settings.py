"""Settings: one name per setting across field, variable and flag; flags win over variables,
which win over defaults; both engines read the same dataclass."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from delta_swap.errors import ConfigError
from delta_swap.settings import DrainPolicy, Settings, field_docs


def test_flags_then_environment_then_defaults() -> None:
    env = {
        "DELTA_SWAP_STORE": "s3://b/p",
        "DELTA_SWAP_DRAIN": "keep",
        "DELTA_SWAP_POLL_INTERVAL": "0.5",
        "DELTA_SWAP_FETCH_CONCURRENCY": "9",
        "DELTA_SWAP_REPLAY_COST_RATIO": "2.5",
    }
    settings = Settings.load({"delta_swap_drain": "abort", "delta_swap_drain_timeout": None}, env)
    assert settings == Settings(
        store="s3://b/p",
        poll_interval=0.5,
        drain=DrainPolicy.ABORT,
        drain_timeout=30.0,
        fetch_concurrency=9,
        replay_cost_ratio=2.5,
    )
    assert Settings.load(None, {"DELTA_SWAP_RECOMPUTE_KV": "yes"}).recompute_kv is True
    assert Settings.load(None, {}) == Settings()


def test_repr_shows_no_secret() -> None:
    env = {
        "DELTA_SWAP_STORE": "https://reader:pw-Zq81xK@cdn.example.com/run",
        "DELTA_SWAP_ADMIN_TOKEN": "tok-Hj27Lm",
        "DELTA_SWAP_ADMIN_OPEN_LOOPBACK": "1",
    }
    settings = Settings.load(None, env)
    assert settings.admin_open_loopback is True and settings.admin_token == "tok-Hj27Lm"
    for text in (repr(settings), str(settings), f"{settings}", repr([settings])):
        assert "pw-Zq81xK" not in text and "tok-Hj27Lm" not in text and "reader" not in text, text
        assert "https://cdn.example.com/run" in text and "admin_token='<redacted>'" in text
    assert "admin_token=None" in repr(Settings()) and Settings().admin_open_loopback is False


def test_bad_settings_name_the_variable_or_flag() -> None:
    with pytest.raises(ConfigError, match="DELTA_SWAP_DRAIN='sometimes'"):
        Settings.load(None, {"DELTA_SWAP_DRAIN": "sometimes"})
    with pytest.raises(ConfigError, match="DELTA_SWAP_POLL_INTERVAL"):
        Settings.load(None, {"DELTA_SWAP_POLL_INTERVAL": "soon"})
    with pytest.raises(ConfigError, match="--delta-swap-fetch-concurrency"):
        Settings.load({"delta_swap_fetch_concurrency": "many"}, {})


def test_every_setting_has_a_docstring_a_variable_and_a_flag() -> None:
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    Settings.add_arguments(parser)  # idempotent: SGLang may run the hook twice
    docs = field_docs(Settings)
    for field in dataclasses.fields(Settings):
        assert len(docs.get(field.name, "")) > 20, f"{field.name} has no docstring"
        flag = "--delta-swap-" + field.name.replace("_", "-")
        assert (
            Settings.flag_name(field.name) == flag
            and Settings.env_name(field.name) == "DELTA_SWAP_" + field.name.upper()
        )
        assert flag in parser.format_help()
    args = parser.parse_args(
        ["--delta-swap-source", "file:///s", "--delta-swap-drain", "keep", "--delta-swap-poll-interval", "0.25"]
    )  # the old spelling of the store flag still works
    settings = Settings.load(args, {"DELTA_SWAP_STORE": "/ignored", "DELTA_SWAP_DRAIN_TIMEOUT": "5"})
    assert (settings.store, settings.drain, settings.poll_interval, settings.drain_timeout) == (
        "file:///s",
        DrainPolicy.KEEP,
        0.25,
        5.0,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--delta-swap-drain", "sometimes"])
