"""delta-swap's code inside SGLang's scheduler process (where the model's parameters live).

* :func:`describe_after_init`, a ``HookRegistry`` AFTER hook on ``Scheduler.__init__``, lays the
  loaded model's parameters out as a weight-arena layout and writes it (or the reason there is
  none) to the file named by ``$DELTA_SWAP_LAYOUT_FILE``, which the HTTP server process reads;
* :func:`run` is registered as a ``--custom-weight-loader``: the adapter calls it through
  ``update_weights_from_tensor(load_format=...)`` with one operation encoded in the tensor's name:
  ``{"op": "commit", "path": ARENA, "result": FILE}`` points every parameter at that arena;
  ``{"op": "verify", "path": SAFETENSORS, "result": FILE}`` reads back, after a load, what the
  modules those tensors load into now compute with (:mod:`delta_swap.readback`).

An exception escaping a custom loader ends SGLang's whole server, so :func:`run` never raises: it
validates everything before the first parameter moves and reports the outcome in the result file.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

log = logging.getLogger("sglang_delta_plugin")

#: Import path of :func:`run`, as SGLang's ``--custom-weight-loader`` names it.
LOADER = "sglang_delta_plugin.engine_ops.run"
LAYOUT_FILE_ENV = "DELTA_SWAP_LAYOUT_FILE"
#: Llama-style fused parameters, for models that do not declare ``packed_modules_mapping``.
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

_state: dict[str, Any] = {"layout": None, "arenas": {}}


def packed_modules(model: Any) -> dict[str, list[str]]:
    """The model's fused modules and the checkpoint tensors each is loaded from."""
    return {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED).items()}


def describe_after_init(result: Any, scheduler: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Write the arena layout of this scheduler's model (TP rank 0 of a single-rank server) and its
    fused-module mapping (which checkpoint tensors load into one module, for the read-back)."""
    output = os.environ.get(LAYOUT_FILE_ENV)
    if not output or LOADER not in (getattr(server_args, "custom_weight_loader", None) or []):
        return
    packed = None
    try:
        packed = packed_modules(scheduler.tp_worker.model_runner.model)
        layout, reason = _describe(scheduler, server_args)
    except Exception as exc:  # never break the scheduler's start
        layout, reason = None, f"describing the parameters failed: {type(exc).__name__}: {exc}"
    _state["layout"] = layout
    try:
        doc = {"layout": layout and layout.to_json(), "reason": reason, "packed": packed}
        Path(output).write_text(json.dumps(doc))
    except OSError:  # a full staging folder: the HTTP server then takes the tensor path
        log.exception("delta_swap: cannot write the parameter layout to %s", output)


def _describe(scheduler: Any, server_args: Any) -> tuple[Any, str]:
    from delta_swap.checkpoint_dir import read_checkpoint_dir
    from delta_swap.served_model import ServedModel
    from delta_swap.settings import Settings, SwapPath
    from delta_swap.torch_params import check_matches, plan_layout

    if Settings.load().swap_path is SwapPath.RELOAD:  # the HTTP server process exported it
        return None, "--delta-swap-swap-path reload"
    if (getattr(server_args, "tp_size", 1) or 1) != 1:
        return None, "tensor parallelism: every rank holds its own shard"
    model = scheduler.tp_worker.model_runner.model
    served = ServedModel.from_checkpoint(server_args.model_path)
    if not served.specs or served.checkpoint_dir is None:
        return None, "the served checkpoint is not a local folder"
    params = dict(model.named_parameters())
    layout, reason = plan_layout(params, packed_modules(model), served.specs)
    if layout is not None:
        checkpoint, _ = read_checkpoint_dir(served.checkpoint_dir)
        mismatch = check_matches(params, layout, checkpoint)
        if mismatch is not None:
            return None, mismatch
    return layout, reason


def run(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom-weight-loader entry: perform the operation named by the first tensor."""
    result = None
    try:
        op = json.loads(named_tensors[0][0])
        result = op.get("result")
        started = time.perf_counter()
        outcome: dict[str, Any] = {"ok": True}
        if op.get("op") == "commit":
            _commit(model, str(op["path"]))
        elif op.get("op") == "verify":
            outcome["checks"] = _verify(model, str(op["path"]))
        else:
            raise ValueError(f"unknown operation {op.get('op')!r}")
        outcome["seconds"] = time.perf_counter() - started
    except Exception as exc:  # an exception here would end the whole server
        log.error("delta_swap: %s", traceback.format_exc())
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    if result:
        try:
            Path(result).write_text(json.dumps(outcome))
        except OSError:
            log.exception("delta_swap: cannot write the result file")


def _commit(model: Any, path: str) -> None:
    from delta_swap.arena import Arena
    from delta_swap.torch_params import point_parameters

    layout = _state["layout"]
    if layout is None:
        raise ValueError("commit before the parameters were described")
    arenas: dict[str, Arena] = _state["arenas"]
    if path not in arenas:
        arenas[path] = Arena(path, layout)
    point_parameters(dict(model.named_parameters()), arenas[path])


def _verify(model: Any, path: str) -> int:
    """Read back the modules the tensors of the safetensors file ``path`` load into (and those
    sharing a parameter with them) against those tensors; raises on the first difference."""
    import torch
    from safetensors.torch import load_file

    from delta_swap.readback import verify_modules

    published = load_file(path)
    with torch.inference_mode():
        return verify_modules(model, published, packed_modules(model))
