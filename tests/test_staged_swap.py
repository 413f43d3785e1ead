"""delta_swap.staged_swap (the engine-process half of the in-place path) on a stand-in torch model
that loads by name through its parameters' loaders, as engines do. The real engines run in
tests/test_vllm_exactness.py and tests/test_sglang_exactness.py (the Inplace classes)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from delta_swap.served_model import ServedModel
from delta_swap.staged_swap import (
    FAIL_SCATTER_ENV,
    StagedSwap,
    injected_failure,
    injected_swap_failure,
    inplace_possible,
    merge_staged,
    read_staged,
)


def default_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(4, 8, generator=gen).to(torch.bfloat16), requires_grad=False)
        self.b = torch.nn.Parameter(torch.randn(16, generator=gen).to(torch.bfloat16), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            param = params[name]
            getattr(param, "weight_loader", default_loader)(param, tensor)


def _checkpoint(model: Model) -> dict[str, torch.Tensor]:
    return {name: p.data.clone() for name, p in model.named_parameters()}


def _moved(t: torch.Tensor, every: int) -> torch.Tensor:
    bits = t.clone().view(torch.int16).reshape(-1)
    bits[::every] += 1
    return bits.view(torch.bfloat16).reshape(t.shape)


def _done(staged: StagedSwap) -> dict:
    deadline = time.monotonic() + 30
    while not (answer := staged.answer())["done"]:
        assert time.monotonic() < deadline, answer
        time.sleep(0.01)
    return answer


def test_a_staged_update_is_written_only_in_the_pause_and_only_where_it_changes() -> None:
    model, staged = Model(), StagedSwap()
    before = _checkpoint(model)
    new_a = _moved(before["a"], 5)
    staged.stage_inplace(model, [("a", new_a), ("b", before["b"])], {}, default_loader)
    answer = _done(staged)
    assert answer["elements"] == new_a.numel() // 5 + (new_a.numel() % 5 > 0) and answer["bytes"] > 0
    assert torch.equal(model.a.data.view(torch.int16), before["a"].view(torch.int16))  # not yet
    count, _undo = staged.apply("scatter", model)
    assert count == 1 and torch.equal(model.a.data.view(torch.int16), new_a.view(torch.int16))
    assert torch.equal(model.b.data.view(torch.int16), before["b"].view(torch.int16))
    staged.drop()
    assert staged.answer()["error"]
    staged.shutdown()


def test_a_failure_in_the_pause_puts_the_old_values_back_and_the_undo_outlives_the_swap() -> None:
    model, staged = Model(), StagedSwap()
    before = _checkpoint(model)
    staged.stage_inplace(model, [("a", _moved(before["a"], 3)), ("b", _moved(before["b"], 2))], {}, default_loader)
    _done(staged)
    with pytest.raises(RuntimeError, match="injected failure after writing 1 parameters"):
        staged.apply("scatter", model, fail_after=1)
    for name, p in model.named_parameters():
        assert torch.equal(p.data.view(torch.int16), before[name].view(torch.int16)), name
    staged.stage_inplace(model, [("a", _moved(before["a"], 3)), ("b", _moved(before["b"], 2))], {}, default_loader)
    _done(staged)  # a retry stages again: the failed apply used up its saved old values
    _count, undo = staged.apply("scatter", model)
    assert not torch.equal(model.a.data.view(torch.int16), before["a"].view(torch.int16))
    undo.undo()  # a rollback after the swap: bit-exact
    for name, p in model.named_parameters():
        assert torch.equal(p.data.view(torch.int16), before[name].view(torch.int16)), name
    staged.shutdown()


def test_applying_nothing_staged_or_the_wrong_kind_is_refused() -> None:
    model, staged = Model(), StagedSwap()
    with pytest.raises(RuntimeError, match="scatter before stage_inplace"):
        staged.apply("scatter", model)
    staged.stage_inplace(model, [("a", model.a.data.clone())], {}, default_loader)
    assert _done(staged)["elements"] == 0
    with pytest.raises(RuntimeError, match="switch before stage_shadow"):
        staged.apply("switch", model)
    staged.shutdown()


def test_a_staging_error_is_answered_not_raised() -> None:
    model, staged = Model(), StagedSwap()
    staged.stage_inplace(model, [("a", torch.zeros(3, 3, dtype=torch.bfloat16))], {}, default_loader)
    answer = _done(staged)
    assert answer["done"] and "RuntimeError" in answer["error"], answer  # the loader's copy_ fails
    staged.shutdown()


def test_in_place_is_possible_only_where_parameters_hold_the_checkpoint_elements(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = Model()
    save_file(_checkpoint(model), str(tmp_path / "model.safetensors"))
    served = ServedModel.from_checkpoint(tmp_path)
    assert inplace_possible(model, served, {}, default_loader) == (
        True,
        "parameters are plain tensors holding the checkpoint's elements",
    )
    model.b.data.mul_(2)  # an engine that keeps another form of b (a kernel's packing)
    possible, reason = inplace_possible(model, served, {}, default_loader)
    assert not possible and "holds b in another form" in reason
    assert inplace_possible(model, ServedModel(None, {}), {}, default_loader) == (
        False,
        "the served checkpoint is not a local folder",
    )
    model.b = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)  # vLLM's AMX-packed linears
    possible, reason = inplace_possible(model, served, {}, default_loader)
    assert not possible and "holds b in another form" in reason and "empty parameter" in reason


def test_the_check_at_start_stops_at_the_first_module_held_in_another_form() -> None:
    """A server whose engine repacks its weights must not load its whole checkpoint twice at start
    to learn that in place is impossible: the comparison stops at the first differing module."""
    from delta_swap.inplace import element_changes

    model = Model()
    weights = list(_checkpoint(model).items())
    model.a.data.mul_(2)
    model.b.data.mul_(2)
    every, _ = element_changes(model, weights, {}, default_loader)
    first, _ = element_changes(model, weights, {}, default_loader, stop_at_first=True)
    assert sorted(c.param for c in every) == ["a", "b"] and [c.param for c in first] == ["a"]


def test_staged_files_are_read_back_by_name(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.arange(4.0), "y": torch.ones(2)}, str(tmp_path / "s.safetensors"))
    assert [n for n, _ in read_staged(str(tmp_path / "s.safetensors"), {"y"})] == ["y"]
    assert [n for n, _ in read_staged(str(tmp_path))] == ["x", "y"]


def test_an_injected_failure_is_read_from_its_marker_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "marker"
    monkeypatch.setenv(FAIL_SCATTER_ENV, str(marker))
    assert injected_failure(FAIL_SCATTER_ENV) == -1
    marker.write_text("2")
    assert injected_failure(FAIL_SCATTER_ENV) == 2
    monkeypatch.delenv(FAIL_SCATTER_ENV)
    assert injected_failure(FAIL_SCATTER_ENV) == -1


def test_every_ranks_staging_is_summed_and_any_fallback_wins() -> None:
    ranks = [
        {"done": True, "elements": 3, "bytes": 30, "seconds": 0.5},
        {"done": True, "elements": 4, "bytes": 40, "seconds": 0.2},
    ]
    assert merge_staged(ranks) == {"elements": 7, "bytes": 40, "seconds": 0.5}
    shadows = [{"done": True, "modules": 2, "bytes": 8, "seconds": 0.1}] * 2
    assert merge_staged(shadows) == {"modules": 4, "bytes": 8, "seconds": 0.1}
    assert merge_staged([ranks[0], {"done": True, "fallback": "experts"}]) == {"fallback": "experts"}


async def test_an_injected_swap_failure_spares_the_rollback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "marker"
    marker.write_text("1")
    monkeypatch.setenv(FAIL_SCATTER_ENV, str(marker))

    async def served() -> str:
        return "step-1"

    assert await injected_swap_failure("step-2", served) == 1
    assert await injected_swap_failure("step-1", served) == -1  # back to what is served: a rollback
    assert await injected_swap_failure(None, served) == 1


def test_the_adapters_staged_file_holds_the_named_tensors_and_is_read_back_by_the_engine(tmp_path: Path) -> None:
    import numpy as np

    from delta_swap.staging_files import staging_file, write_tensors
    from delta_swap.tensors import HostTensor

    state = {
        n: HostTensor("F32", (2,), np.frombuffer(np.array([i, i], np.float32).tobytes(), np.uint8))
        for i, n in enumerate("abc")
    }
    first, second = staging_file(str(tmp_path), "update-s1"), staging_file(str(tmp_path), "update-s1")
    assert first != second and Path(first).name.startswith("delta-swap-update-s1-") and first.endswith(".safetensors")
    write_tensors(first, state, ["c", "a"])
    assert [(n, t.tolist()) for n, t in read_staged(first)] == [("a", [0.0, 0.0]), ("c", [2.0, 2.0])]


async def test_the_adapter_waits_until_every_process_has_staged() -> None:
    from delta_swap.staging_files import until_staged

    asked = []

    async def ask() -> list[dict]:
        asked.append(1)
        return [{"done": True}, {"done": len(asked) >= 3, "elements": 5}]

    answers = await until_staged(ask)
    assert len(asked) == 3 and answers[1] == {"done": True, "elements": 5}


async def test_with_a_doorbell_the_adapter_asks_again_once_every_process_rang(tmp_path, monkeypatch) -> None:
    """Each question goes through the engine (and keeps an idle vLLM worker spinning): with a
    doorbell the adapter asks once, then again only when both processes rang it."""
    import asyncio
    import threading

    from delta_swap import staging_files
    from delta_swap.staging_files import doorbells_rung, make_doorbell, remove_doorbells, ring_doorbell, until_staged

    monkeypatch.setattr(staging_files, "STAGE_ASK_S", 60.0)
    (tmp_path / "delta-swap-arena-1-x").touch()  # the staging folder's other files do not count
    doorbell = make_doorbell(str(tmp_path))
    done = threading.Event()
    asked = []

    async def ask() -> list[dict]:
        asked.append(1)
        return [{"done": done.is_set()}, {"done": done.is_set()}]

    def two_processes_finish() -> None:
        ring_doorbell(doorbell)  # the first: not enough
        Path(doorbell, "other-pid").touch()
        done.set()

    threading.Timer(0.2, two_processes_finish).start()
    started = time.monotonic()
    answers = await asyncio.wait_for(until_staged(ask, doorbell), timeout=30)
    assert answers == [{"done": True}] * 2 and len(asked) == 2 and time.monotonic() - started < 30
    assert doorbells_rung(doorbell) == 2
    remove_doorbells(doorbell)
    assert doorbells_rung(doorbell) == 0 and [p.name for p in tmp_path.iterdir()] == ["delta-swap-arena-1-x"]
    ring_doorbell(doorbell)  # a process done after the adapter stopped waiting: nothing is left
    assert [p.name for p in tmp_path.iterdir()] == ["delta-swap-arena-1-x"]


async def test_without_a_rung_doorbell_the_adapter_still_asks_every_stage_ask_s(tmp_path, monkeypatch) -> None:
    """A doorbell that never rings (a process that died) costs at most STAGE_ASK_S per question."""
    import asyncio

    from delta_swap import staging_files
    from delta_swap.staging_files import until_staged

    monkeypatch.setattr(staging_files, "STAGE_ASK_S", 0.05)
    asked = []

    async def ask() -> list[dict]:
        asked.append(1)
        return [{"done": len(asked) >= 4}]

    answers = await asyncio.wait_for(until_staged(ask, str(tmp_path / "never.done")), timeout=30)
    assert answers == [{"done": True}] and len(asked) == 4


def test_a_staging_rings_its_doorbell_when_done_or_failed(tmp_path) -> None:
    """``on_done`` runs once staging ends, also when it failed, and the answer is ready by then."""
    import threading

    from delta_swap.staged_swap import StagedSwap

    model = torch.nn.Linear(2, 2, bias=False)
    staged = StagedSwap()
    try:
        for weights in ([("weight", torch.ones(2, 2))], [("weight", torch.ones(3, 3))]):
            rung = threading.Event()
            answers = []
            staged.stage_inplace(
                model,
                weights,
                {},
                lambda p, w: p.data.copy_(w),
                on_done=lambda answers=answers, rung=rung: (answers.append(staged.answer()), rung.set()),
            )
            assert rung.wait(30) and answers[0]["done"]
        assert "error" in answers[0]  # the second: a 3x3 tensor does not fit the 2x2 parameter
    finally:
        staged.shutdown()
