"""The RL example end to end, short: a GRPO trainer and a live vLLM server with the plugin that
hot-swaps every step. The reward must rise, and every rollout must come from a snapshot the
trainer published, no staler than the bound."""

from __future__ import annotations

import statistics

import pytest

pytestmark = pytest.mark.engine


def test_reward_rises_while_the_server_swaps_every_step(tmp_path) -> None:
    from examples.rl_loop import main

    steps, bound = 14, 1
    logs = main(
        [
            "--steps",
            str(steps),
            "--max-staleness",
            str(bound),
            "--workdir",
            str(tmp_path),
            "--plot",
            str(tmp_path / "rl.png"),
        ]
    )
    assert [log.step for log in logs] == list(range(1, steps + 1))
    first = statistics.fmean(log.reward for log in logs[:4])
    last = statistics.fmean(log.reward for log in logs[-4:])
    assert last > 2 * first and last > first + 0.05, [round(log.reward, 3) for log in logs]
    for log in logs:
        assert log.versions and all(v is not None and 0 <= v < log.step for v in log.versions)  # published steps
        assert max(log.staleness) <= bound
        assert log.published_bytes > 0
    assert (tmp_path / "rl.png").stat().st_size > 10_000
