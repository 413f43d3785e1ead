"""sglang_delta_plugin.engine_ops.in_pause, the swap a scheduler runs in the pause, on the stand-in
torch model of tests/test_staged_swap.py and a scripted scheduler (no SGLang here; the real
schedulers run in tests/test_sglang_exactness.py): a failed ``scatter`` answers ``restored`` with
the old values back, wherever it failed, and ``undo`` takes back only the last finished one."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from delta_swap.staged_swap import StagedSwap
from sglang_delta_plugin import engine_ops
from tests.test_staged_swap import Model, _checkpoint, _done, _moved, default_loader


class Scheduler:
    """The slice of SGLang's Scheduler that ``in_pause`` uses."""

    def __init__(self, model: Model) -> None:
        self.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
        self.versions: list[str] = []
        self.refuse_version = False

    def flush_cache(self, empty_cache: bool = True) -> bool:
        return True

    def record_weight_version_change(self, new_version: str) -> None:
        if self.refuse_version:
            raise RuntimeError("scripted: the version could not be recorded")
        self.versions.append(new_version)


@pytest.fixture
def scheduler() -> Iterator[Scheduler]:
    staged = StagedSwap()
    engine_ops._state.update(staged=staged, undo=None)
    yield Scheduler(Model())
    engine_ops._state.update(staged=None, undo=None)
    staged.shutdown()


def _stage(scheduler: Scheduler, every: int) -> dict[str, torch.Tensor]:
    """Stage an update that moves every ``every``-th element of both parameters; its tensors."""
    model = scheduler.tp_worker.model_runner.model
    new = {name: _moved(t, every) for name, t in _checkpoint(model).items()}
    engine_ops._state["staged"].stage_inplace(model, list(new.items()), {}, default_loader)
    _done(engine_ops._state["staged"])
    return new


def _bits(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {name: t.view(torch.int16).reshape(-1).tolist() for name, t in state.items()}


def _served(scheduler: Scheduler) -> dict[str, list[int]]:
    return _bits(_checkpoint(scheduler.tp_worker.model_runner.model))


def test_a_scatter_that_fails_mid_way_answers_restored_with_the_old_values_back(scheduler) -> None:
    before = _served(scheduler)
    _stage(scheduler, 3)
    out = engine_ops.in_pause(scheduler, {"op": "scatter", "fail_after": 1, "version": "v1", "flush": True})
    assert not out["ok"] and out["restored"] and "injected failure after writing 1" in out["error"], out
    assert _served(scheduler) == before and scheduler.versions == []


def test_a_failure_after_the_scatter_is_taken_back_before_it_is_answered(scheduler) -> None:
    before = _served(scheduler)
    _stage(scheduler, 3)
    scheduler.refuse_version = True  # the weights are written, then recording the version fails
    out = engine_ops.in_pause(scheduler, {"op": "scatter", "version": "v1", "flush": True})
    assert not out["ok"] and out["restored"] and "could not be recorded" in out["error"], out
    assert _served(scheduler) == before


def test_undo_takes_back_the_last_finished_scatter_once(scheduler) -> None:
    before = _served(scheduler)
    new = _stage(scheduler, 3)
    assert engine_ops.in_pause(scheduler, {"op": "scatter", "version": "v1", "flush": True})["ok"]
    assert _served(scheduler) == _bits(new) and scheduler.versions == ["v1"]
    out = engine_ops.in_pause(scheduler, {"op": "undo", "version": "v0", "flush": False})
    assert out["ok"] and out["undone"] and scheduler.versions == ["v1", "v0"]
    assert _served(scheduler) == before
    assert not engine_ops.in_pause(scheduler, {"op": "undo"})["undone"]  # nothing left to take back


def test_a_failed_scatter_never_takes_back_the_one_before_it(scheduler) -> None:
    first = _stage(scheduler, 3)
    assert engine_ops.in_pause(scheduler, {"op": "scatter", "version": "v1", "flush": True})["ok"]
    _stage(scheduler, 2)  # the next update (its staging drops the first one's undo log)
    out = engine_ops.in_pause(scheduler, {"op": "scatter", "fail_after": 0, "version": "v2", "flush": True})
    assert not out["ok"] and out["restored"], out
    assert _served(scheduler) == _bits(first)  # still v1's weights, not v0's


def test_a_failed_scatter_whose_undo_fails_too_is_not_called_restored(scheduler, monkeypatch) -> None:
    from delta_swap.inplace import UndoLog

    def broken_undo(self) -> None:
        raise RuntimeError("scripted: the undo failed")

    _stage(scheduler, 3)
    monkeypatch.setattr(UndoLog, "undo", broken_undo)
    out = engine_ops.in_pause(scheduler, {"op": "scatter", "fail_after": 1, "version": "v1", "flush": True})
    assert not out["ok"] and out["restored"] is False, out
