"""delta-swap's code inside SGLang's scheduler process (where the model's parameters live).

* :func:`describe_after_init`, a ``HookRegistry`` AFTER hook on ``Scheduler.__init__``, lays the
  loaded model's parameters out as a weight-arena layout and writes it (or the reason there is
  none) to the file named by ``$DELTA_SWAP_LAYOUT_FILE``, which the HTTP server process reads, and
  answers the HTTP server's requests on this rank's :mod:`.scheduler_channel` (:func:`_on_channel`).
* While SGLang generates, the channel stages updates: ``stage_inplace`` works out which elements
  of this rank's parameters change, ``stage_shadow`` builds the new tensors of the parameters they
  change (:mod:`delta_swap.param_switch`), ``stage_wait`` says whether that is done.
* In the pause, the channel hands the swap to the scheduler's own thread (:mod:`.paused_loop`):
  ``commit`` points every parameter at an arena; ``scatter`` writes the staged changed elements
  with an undo log; ``switch`` points the changed parameters at their new tensors; ``verify``
  reads back what the modules a safetensors file loads into compute with
  (:mod:`delta_swap.readback`; at tensor parallel > 1 each rank its own shard, which
  :func:`local_shards` loads through the module's own weight loader into a scratch copy). With
  ``version``, the same job flushes SGLang's cache first (``flush``) and records the new weight
  version after: no weight-update session is opened. A failed ``scatter`` or ``switch`` puts the
  old values back before it is answered (``restored``); ``undo`` takes back the last switch or
  scatter (another rank failed).

Nothing here raises into SGLang: an exception in the scheduler would end the whole server.
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

LAYOUT_FILE_ENV = "DELTA_SWAP_LAYOUT_FILE"
#: Llama-style fused parameters, for models that do not declare ``packed_modules_mapping``.
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

#: The longest a swap waits for the scheduler to take it in the pause.
IN_PAUSE_TIMEOUT_S = 60.0

#: This scheduler's arena mappings (ArenaMappings, on the arena path), staged update (StagedSwap,
#: on the in-place and shadow paths) and the undo of the last scatter or switch (until dropped).
_state: dict[str, Any] = {"arenas": None, "staged": None, "undo": None}


def packed_modules(model: Any) -> dict[str, list[str]]:
    """The model's fused modules and the checkpoint tensors each is loaded from."""
    return {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED).items()}


def describe_after_init(result: Any, scheduler: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Write how this scheduler's rank swaps (rank 0 to the layout file, rank k to ``FILE.k``):
    its arena layout (one rank), or whether it stages updates (``staged``: ``shadow``, new tensors
    of the changed parameters switched in; ``inplace``, changed elements written in place; ``auto``
    where no arena applies, or when asked), with the reason, and its fused-module mapping (which
    checkpoint tensors load into one module, for the read-back)."""
    output = os.environ.get(LAYOUT_FILE_ENV)  # set by the HTTP server process when following a store
    if not output:
        return
    refuse = amx_packed(scheduler)  # then no path is worked out: no update will be taken
    model, packed, layout, staged, reason = None, None, None, None, refuse or ""
    try:
        model = scheduler.tp_worker.model_runner.model
        packed = packed_modules(model)
        if refuse is None:
            layout, staged, reason = _choose_path(scheduler, server_args, model, packed)
    except Exception as exc:  # never break the scheduler's start
        layout, staged, reason = None, None, f"describing the parameters failed: {type(exc).__name__}: {exc}"
    if layout is not None:
        from delta_swap.torch_params import ArenaMappings

        _state["arenas"] = ArenaMappings(layout)
    rank = _tp_rank()
    if refuse is None:  # every swap goes through the channel: without one no update is taken
        refuse = _open_channel(model, packed or {}, rank)
        if refuse is not None:
            layout, staged, reason, _state["arenas"] = None, None, refuse, None
    try:
        doc = {"layout": layout and layout.to_json(), "reason": reason, "packed": packed, "staged": staged}
        if refuse:
            doc["refuse"] = refuse
        Path(output if rank == 0 else f"{output}.{rank}").write_text(json.dumps(doc))
    except OSError:  # a full staging folder: the HTTP server then takes the tensor path
        log.exception("delta_swap: cannot write the parameter layout to %s", output)


def _choose_path(
    scheduler: Any, server_args: Any, model: Any, packed: dict[str, list[str]]
) -> tuple[Any, str | None, str]:
    """(arena layout or None, the staged path or None, why) for this rank, as ``swap_path`` asks.
    Where the parameters are plain tensors holding the checkpoint's elements and no arena applies,
    ``auto`` builds the changed parameters' new tensors before the pause and switches them in
    (``shadow``) on the host, and writes the changed elements in place on a device (a CUDA graph
    keeps the addresses it captured)."""
    from delta_swap.settings import Settings, SwapPath

    swap_path = Settings.load().swap_path  # the HTTP server process exported it
    if swap_path is SwapPath.INPLACE:
        plain, reason = _inplace_possible(model, server_args, packed)
        return None, "inplace" if plain else None, reason
    if swap_path is SwapPath.SHADOW:
        staged, why = _staged_path(model, server_args, packed, on_device=None)
        return None, staged, f"{why}; {_SHADOW_WHY}" if staged else why
    layout, reason = _describe(scheduler, server_args)
    if layout is None and swap_path is SwapPath.AUTO:  # no arena (TP > 1, MoE experts...)
        staged, why = _staged_path(model, server_args, packed, on_device="inplace")
        how = {"shadow": _SHADOW_WHY, "inplace": "changed elements written in place"}.get(staged or "", why)
        return None, staged, f"{reason}; {how}"
    return layout, None, reason


#: Why the shadow path, in the status.
_SHADOW_WHY = "new tensors of the changed parameters built before the pause"


def _staged_path(
    model: Any, server_args: Any, packed: dict[str, list[str]], on_device: str | None
) -> tuple[str | None, str]:
    """(the staged path this rank's parameters allow: ``shadow`` where they are plain host tensors
    holding the checkpoint's elements, ``on_device`` where such tensors live on a device, else
    None; why they are plain, or why not)."""
    plain, why = _inplace_possible(model, server_args, packed)
    if not plain:
        return None, why
    device = _device_of(model)
    if device == "cpu":
        return "shadow", why
    if on_device is None:
        return None, f"parameters on {device}: a CUDA graph keeps their addresses (swap_path inplace writes there)"
    return on_device, why


def _device_of(model: Any) -> str:
    """The device type of the model's parameters (``cpu``, ``cuda``...; the first one not on the host)."""
    return next((p.device.type for p in model.parameters() if p.device.type != "cpu"), "cpu")


def amx_packed(scheduler: Any) -> str | None:
    """Why no update can be loaded exactly into this model (None: it can): SGLang's AMX backend
    (CPUs with AMX and SGLang's CPU kernels) packed some modules' weights after loading, and SGLang
    0.5.23 cannot unpack them (``restore_weights_before_loading`` skips AMX packing) while its
    ``end_weight_update`` runs every module's post-load processing again, which packs packed
    weights a second time. Unverified on a real AMX build (this project's environment has no CPU
    build of SGLang's kernels): refused rather than risk serving wrong weights."""
    try:
        model = scheduler.tp_worker.model_runner.model
        packed = [path for path, m in model.named_modules() if getattr(m, "use_intel_amx_backend", False) is True]
    except Exception:  # a scheduler without a model runner: nothing to refuse here
        return None
    if not packed:
        return None
    return (
        f"SGLang's AMX backend packed the weights of {len(packed)} modules ({packed[0]}...) and re-packs every "
        "module after each weight update: delta-swap refuses updates here rather than serve wrong weights"
    )


def _inplace_possible(model: Any, server_args: Any, packed: dict[str, list[str]]) -> tuple[bool, str]:
    """Whether this rank's parameters hold the served checkpoint's elements where SGLang's own
    loaders put them (else: why not)."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    from delta_swap.served_model import ServedModel
    from delta_swap.staged_swap import inplace_possible

    served = ServedModel.from_checkpoint(server_args.model_path)
    return inplace_possible(model, served, packed, default_weight_loader)


def _open_channel(model: Any, packed: dict[str, list[str]], rank: int) -> str | None:
    """Keep a :class:`~delta_swap.staged_swap.StagedSwap` and answer the HTTP server's requests on
    this rank's channel (None; or why it cannot)."""
    from delta_swap.staged_swap import StagedSwap

    from . import scheduler_channel

    _state["staged"] = StagedSwap()
    try:
        scheduler_channel.serve(rank, lambda request: _on_channel(model, packed, request))
    except (OSError, KeyError) as exc:
        return f"no channel into the scheduler: {type(exc).__name__}: {exc}"
    return None


#: The operations that run in the pause, on the scheduler's thread.
IN_PAUSE_OPS = ("commit", "scatter", "switch", "verify", "undo")


def _on_channel(model: Any, packed: dict[str, list[str]], request: dict[str, Any]) -> dict[str, Any]:
    """One request from the HTTP server, on the channel's thread. While SGLang generates:
    ``stage_inplace`` starts working out which elements of this rank's parameters the tensors of
    ``path`` change; ``stage_shadow`` starts building the new tensors of the parameters they
    change; ``stage_wait`` answers whether that is done; ``drop_staged`` forgets it. In the pause,
    the operations of :data:`IN_PAUSE_OPS` (handed to the scheduler's thread)."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    from delta_swap.staged_swap import FAIL_BUILD_ENV, injected_failure, read_staged

    from .paused_loop import run_when_paused

    staged = _state["staged"]
    op = request.get("op")
    if op in IN_PAUSE_OPS:
        return run_when_paused(lambda scheduler: in_pause(scheduler, request), IN_PAUSE_TIMEOUT_S)
    if op in ("stage_inplace", "stage_shadow"):
        _state["undo"] = None  # a new update: the last one's swap is final
    if op == "stage_inplace":
        weights = read_staged(str(request["path"]), set(request["names"]))
        staged.stage_inplace(model, weights, packed, default_weight_loader)
        return {"ok": True}
    if op == "stage_shadow":
        weights = read_staged(str(request["path"]), set(request["names"]))
        fail_after = injected_failure(FAIL_BUILD_ENV)
        staged.stage_switch(model, weights, packed, default_weight_loader, fail_after=fail_after)
        return {"ok": True}
    if op == "stage_wait":
        return dict(staged.answer())
    if op == "drop_staged":
        _state["undo"] = None
        staged.drop()
        return {"ok": True}
    return {"error": f"unknown operation {op!r}"}


def _describe(scheduler: Any, server_args: Any) -> tuple[Any, str]:
    from delta_swap.served_model import ServedModel
    from delta_swap.settings import Settings, SwapPath
    from delta_swap.torch_params import describe_arena

    swap_path = Settings.load().swap_path  # the HTTP server process exported it
    if swap_path is SwapPath.RELOAD:
        return None, "--delta-swap-swap-path reload"
    if (getattr(server_args, "tp_size", 1) or 1) != 1:
        return None, "tensor parallelism: every rank holds its own shard"
    model = scheduler.tp_worker.model_runner.model
    served = ServedModel.from_checkpoint(server_args.model_path)
    return describe_arena(dict(model.named_parameters()), packed_modules(model), served)


def in_pause(scheduler: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Perform one of :data:`IN_PAUSE_OPS` on the scheduler's thread, the engine paused; the outcome
    (``ok``, ``seconds``, ``checks`` read back, ``parameters`` written or switched, or ``error``).
    With ``version``: flush SGLang's cache first if ``flush`` (the KV of the old weights; nothing
    runs until the engine resumes), then record the version once the weights are in."""
    import torch

    started = time.perf_counter()
    if request.get("op") in ("scatter", "switch"):
        _state["undo"] = None  # an earlier update's: never taken back for this one
    try:
        model = scheduler.tp_worker.model_runner.model
        op = request.get("op")
        if torch.accelerator.is_available():  # a forward the overlap scheduler launched may still run
            torch.accelerator.synchronize()
        if request.get("version") is not None and request.get("flush") and not scheduler.flush_cache(empty_cache=False):
            return {
                "ok": False,
                "error": "SGLang did not flush its cache (requests still hold KV): nothing was swapped",
            }
        outcome: dict[str, Any] = {"ok": True}
        if op == "commit":
            _commit(model, str(request["path"]))
        elif op == "verify":
            outcome["checks"] = _verify(model, str(request["path"]), request.get("names"))
        elif op in ("scatter", "switch"):
            outcome.update(_apply_staged(model, request))
        elif op == "undo":
            outcome["undone"] = _undo()
        else:
            raise ValueError(f"unknown operation {op!r}")
        if request.get("version") is not None:
            scheduler.record_weight_version_change(new_version=str(request["version"]))
    except Exception as exc:  # an exception here would end the whole server
        log.error("delta_swap: %s", traceback.format_exc())
        failed: dict[str, Any] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if request.get("op") in ("scatter", "switch"):
            failed["restored"] = _restore(exc)
        return failed
    outcome["seconds"] = time.perf_counter() - started
    return outcome


def _restore(failure: BaseException) -> bool:
    """After a failed ``scatter`` or ``switch``: whether this rank holds its old weights again. A
    failure inside the apply was undone there (:meth:`StagedSwap.apply`, which marks it if that
    failed too); one after it (the read-back, recording the version) is undone here."""
    from delta_swap.undo import restored

    if not restored(failure):
        return False
    try:
        _undo()
    except Exception:
        log.error("delta_swap: taking back the failed swap failed: %s", traceback.format_exc())
        return False
    return True


def _commit(model: Any, path: str) -> None:
    arenas = _state["arenas"]
    if arenas is None:
        raise ValueError("commit before the parameters were described")
    arenas.point(dict(model.named_parameters()), path)


def _apply_staged(model: Any, op: dict[str, Any]) -> dict[str, Any]:
    """In the pause: write the staged changed elements into the live parameters (``scatter``) or
    point the changed parameters at their new tensors (``switch``), then read the changed modules
    back against ``verify_path`` if given. A failure in the apply puts the old values back before it
    is raised; the undo of a finished apply is kept (``_state["undo"]``), for :func:`in_pause` to
    take back after a later failure or for another rank's failure (``undo``)."""
    staged = _state["staged"]
    if staged is None:
        raise ValueError(f"{op['op']} without a staging channel")
    fail_rank = op.get("fail_rank")
    fail_after = int(op.get("fail_after", -1)) if fail_rank is None or fail_rank == _tp_rank() else -1
    count, _state["undo"] = staged.apply(str(op["op"]), model, fail_after)  # undone in it if it fails
    outcome: dict[str, Any] = {"parameters": count}
    if op.get("verify_path"):  # a failure from here on is undone by in_pause
        outcome["checks"] = _verify(model, str(op["verify_path"]), op.get("verify_names"))
    return outcome


def _undo() -> bool:
    """Take back the last scatter or switch (another rank's failed); whether there was one."""
    import torch

    undo, _state["undo"] = _state["undo"], None
    if undo is None:
        return False
    with torch.inference_mode():
        undo.undo()
    return True


def _tp_rank() -> int:
    """This scheduler's tensor-parallel rank (0 where SGLang's parallel state is not set up)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:  # a scripted engine without SGLang's parallel context
        return 0


def _verify(model: Any, path: str, names: list[str] | None = None) -> int:
    """Read back the modules the tensors ``names`` (default: all) of the safetensors file ``path``
    load into (and those sharing a parameter with them) against those tensors, or this rank's
    shard of them at tensor parallel > 1; raises on the first difference."""
    import torch

    from delta_swap.readback import verify_modules
    from delta_swap.staged_swap import read_staged

    published = dict(read_staged(path, set(names) if names else None))
    packed = packed_modules(model)
    shard = local_shards(packed) if _tp_size() > 1 else None
    with torch.inference_mode():
        return verify_modules(model, published, packed, shard)


def _tp_size() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_size)
    except Exception:
        return 1


#: The shard id SGLang's models load each experts projection with.
_EXPERT_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def local_shards(packed: dict[str, list[str]]) -> Any:
    """A :data:`delta_swap.readback.Shard`: what this rank's parameter must hold once the published
    tensors go through the module's own weight loader (with the shard ids SGLang's models give
    fused constituents: "q"/"k"/"v", 0/1), loaded into a NaN-filled scratch copy of the live
    parameter (same local shape, class and attributes). The live model is not touched."""
    import torch

    def shard(path: str, module: Any, kind: str, parts: list[tuple[str, Any]]) -> Any:
        from sglang.srt.layers.linear import QKVParallelLinear
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        live = getattr(module, kind, None)
        if live is None:
            return None
        experts = kind in ("w13_weight", "w2_weight")
        if experts:  # every expert shares one row of storage: the scratch costs one expert
            data = torch.full((1, *live.shape[1:]), float("nan"), dtype=live.dtype, device=live.device)
            data = data.expand(live.shape)
        else:
            data = torch.full(live.shape, float("nan"), dtype=live.dtype, device=live.device)
        data.__class__ = live.__class__
        data.__dict__ = live.__dict__.copy()
        loader = getattr(data, "weight_loader", default_weight_loader)
        if experts:
            index = int(parts[0][0].split(".experts.", 1)[1].split(".")[0])
            for name, tensor in parts:
                loader(data, tensor, name, _EXPERT_SHARD[name.rsplit(".", 2)[-2]], index)
            local = module._map_global_expert_id_to_local_expert_id(index)
            return None if local < 0 else data.data[local].clone()
        constituents = packed.get(path.rsplit(".", 1)[-1], [])
        for name, tensor in parts:
            part = name.rsplit(".", 2)[-2]
            if part in constituents:
                index = constituents.index(part)
                loader(data, tensor, ("q", "k", "v")[index] if isinstance(module, QKVParallelLinear) else index)
            else:
                loader(data, tensor)
        return data.data

    return shard
