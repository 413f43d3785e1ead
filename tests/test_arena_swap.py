"""The arena strategy's two halves as both engine adapters use them: the engine process's
(:func:`delta_swap.torch_params.describe_arena`, :class:`~delta_swap.torch_params.ArenaMappings`)
and the adapter's (:meth:`ArenaPair.open`, ``spare_for``, ``staged``), on plain torch parameters
and a checkpoint folder written here. The real engines run in the exactness suites' Arena classes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from delta_swap.arena import ArenaPair
from delta_swap.errors import EngineError
from delta_swap.served_model import ServedModel
from delta_swap.tensors import HostTensor
from delta_swap.torch_params import ArenaMappings, describe_arena


def _served(tmp_path: Path) -> tuple[dict[str, torch.nn.Parameter], ServedModel]:
    weights = {"a.weight": torch.randn(4, 8).to(torch.bfloat16), "b.bias": torch.randn(8).to(torch.bfloat16)}
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"))
    params = {n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in weights.items()}
    return params, ServedModel.from_checkpoint(folder)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint8).reshape(-1)


def test_a_layout_is_described_only_where_the_live_bytes_are_the_checkpoints(tmp_path: Path) -> None:
    params, served = _served(tmp_path)
    layout, reason = describe_arena(params, {}, served)
    assert layout is not None and set(layout.specs) == set(params), reason
    params["b.bias"].data.mul_(2)  # an engine that transformed a weight after loading
    layout, reason = describe_arena(params, {}, served)
    assert layout is None and "b.bias" in reason
    assert describe_arena(params, {}, ServedModel(None, {})) == (None, "the served checkpoint is not a local folder")


def test_an_update_decoded_into_the_spare_arena_becomes_what_the_parameters_point_at(tmp_path: Path) -> None:
    params, served = _served(tmp_path)
    layout, _ = describe_arena(params, {}, served)
    assert layout is not None
    pair, why_not = ArenaPair.open(tmp_path, layout.to_json())
    assert pair is not None and why_not is None
    try:
        assert pair.spare_for({"other": ("BF16", (1,))}) is None  # not this layout's tensors
        spare = pair.spare_for(layout.specs)
        assert spare is not None
        for name, p in params.items():  # the update: every element one ULP up
            spare[name].data[:] = _bytes(p.data.view(torch.int16) + 1)
        arena = pair.staged(spare, "engine")
        assert arena is not None
        ArenaMappings(layout).point(params, str(arena.path))  # the swap, in the engine process
        pair.live = arena
        for name, p in params.items():
            assert np.array_equal(_bytes(p.data), spare[name].data)
        elsewhere = {"a.weight": HostTensor("BF16", (4, 8), np.zeros(64, np.uint8))}
        with pytest.raises(EngineError, match="engine: an update outside the weight arenas"):
            pair.staged(elsewhere, "engine")
    finally:
        pair.close()


def test_no_room_for_two_arenas_is_a_reason_not_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params, served = _served(tmp_path)
    layout, _ = describe_arena(params, {}, served)
    assert layout is not None
    monkeypatch.setattr("delta_swap.arena._free_bytes", lambda folder: 10)
    pair, why_not = ArenaPair.open(tmp_path, layout.to_json())
    assert pair is None and why_not is not None and why_not.startswith("no weight arenas: no room")
