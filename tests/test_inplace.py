"""The in-place swap strategy (:mod:`delta_swap.inplace`): changed elements found bit for bit,
written with one scatter per parameter, and undone bit-exact after a failure at any point."""

from __future__ import annotations

import pytest
import torch

from delta_swap.errors import EngineError
from delta_swap.inplace import UndoLog, changes_between, merge, save_old_values, scatter


def _params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.nn.Parameter(torch.randn(shape, generator=g).to(torch.bfloat16), requires_grad=False)
        for name, shape in (("a.weight", (16, 8)), ("b.weight", (32,)), ("c.bias", (4, 4)))
    }


def _moved(t: torch.Tensor, every: int) -> torch.Tensor:
    """``t`` with every ``every``-th element moved by one ULP."""
    out = t.detach().clone()
    bits = out.reshape(-1).view(torch.int16)
    bits[::every] += 1
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.reshape(-1).view(torch.int16), b.reshape(-1).view(torch.int16)))


def test_only_the_changed_elements_are_found_and_written() -> None:
    params = _params()
    new = {name: _moved(p, 5) for name, p in params.items()}
    changes = [changes_between(name, params[name].data, new[name]) for name in params]
    assert all(c is not None for c in changes)
    assert [c.positions.numel() for c in changes if c] == [(p.numel() + 4) // 5 for p in params.values()]
    undo = scatter(params, [c for c in changes if c])
    for name, p in params.items():
        assert _same_bits(p, new[name])
    # the undo log: positions (8 bytes) and old values (2 bytes) of each changed element, as the changes
    assert undo.nbytes == sum(c.nbytes for c in changes if c) == 10 * sum(c.positions.numel() for c in changes if c)


def test_no_change_is_none_and_signed_zeros_and_nans_count_as_changes() -> None:
    live = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    assert changes_between("x", live, live.clone()) is None
    other = live.clone()
    other[0] = -0.0
    other.view(torch.int16)[2] ^= 1  # another NaN payload: equal as numbers (never), not as bits
    found = changes_between("x", live, other)
    assert found is not None and found.positions.tolist() == [0, 2]


def test_a_failure_mid_scatter_puts_every_old_value_back_bit_exact() -> None:
    params = _params(1)
    before = {name: p.detach().clone() for name, p in params.items()}
    new = {name: _moved(p, 3) for name, p in params.items()}
    changes = [c for name in params if (c := changes_between(name, params[name].data, new[name]))]

    def fail_after_two(done: int) -> None:
        if done == 2:
            assert not _same_bits(params["a.weight"], before["a.weight"])  # the first writes did land
            raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        scatter(params, changes, fail_after_two)
    for name, p in params.items():
        assert _same_bits(p, before[name]), name


def test_the_undo_log_restores_after_a_completed_scatter() -> None:
    params = _params(2)
    before = {name: p.detach().clone() for name, p in params.items()}
    changes = [c for name in params if (c := changes_between(name, params[name].data, _moved(params[name], 2)))]
    undo = scatter(params, changes)
    assert not _same_bits(params["b.weight"], before["b.weight"])
    undo.undo()
    assert all(_same_bits(p, before[name]) for name, p in params.items())
    assert undo.entries == [] and isinstance(undo, UndoLog)


def test_bad_changes_are_refused_before_anything_is_written() -> None:
    params = _params(3)
    before = {name: p.detach().clone() for name, p in params.items()}
    good = changes_between("a.weight", params["a.weight"].data, _moved(params["a.weight"], 2))
    assert good is not None
    outside = changes_between("c.bias", params["c.bias"].data, _moved(params["c.bias"], 2))
    assert outside is not None
    outside = type(outside)("b.weight", outside.positions + 100, outside.values)  # b has 32 elements
    with pytest.raises(EngineError, match="outside"):
        scatter(params, [good, outside])
    with pytest.raises(EngineError, match="no parameter"):
        scatter(params, [good, type(good)("nope", good.positions, good.values)])
    wrong_dtype = type(good)("a.weight", good.positions, good.values.float())
    with pytest.raises(EngineError, match="dtype"):
        scatter(params, [wrong_dtype])
    params["c.bias"].data = params["c.bias"].data.t()  # not contiguous
    with pytest.raises(EngineError, match="contiguous"):
        scatter(params, [type(good)("c.bias", good.positions[:1] * 0, good.values[:1])])
    assert _same_bits(params["a.weight"], before["a.weight"]) and _same_bits(params["b.weight"], before["b.weight"])


def test_a_shape_or_dtype_mismatch_of_the_loaded_copy_is_an_error() -> None:
    live = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(EngineError, match="loaded copy"):
        changes_between("x", live, torch.zeros(5, dtype=torch.bfloat16))


def test_merged_changes_of_one_parameter_keep_the_last_write() -> None:
    live = torch.zeros(8, dtype=torch.bfloat16)
    first = changes_between("p", live, torch.tensor([1, 0, 2, 0, 0, 0, 0, 0], dtype=torch.bfloat16))
    second = changes_between("p", live, torch.tensor([0, 0, 5, 0, 0, 0, 0, 3], dtype=torch.bfloat16))
    assert first is not None and second is not None
    both = merge([first, second])
    out = live.clone()
    out[both.positions] = both.values
    assert out.tolist() == [1, 0, 5, 0, 0, 0, 0, 3]


def test_old_values_saved_before_the_pause_undo_a_failed_scatter() -> None:
    params = _params(4)
    before = {name: p.detach().clone() for name, p in params.items()}
    changes = [c for name in params if (c := changes_between(name, params[name].data, _moved(params[name], 4)))]
    saved = save_old_values(params, changes)

    def fail(done: int) -> None:
        if done == len(changes):
            raise RuntimeError("injected")

    with pytest.raises(RuntimeError):
        scatter(params, changes, fail, saved)
    assert all(_same_bits(p, before[name]) for name, p in params.items())
    with pytest.raises(EngineError, match="saved old values"):
        scatter(params, changes, saved=save_old_values(params, changes[:1]))
