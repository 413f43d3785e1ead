"""The SGLang engine adapter: swaps verified updates into a running SGLang through its tokenizer manager.

Four paths, chosen once per server from what the scheduler reports when it starts
(:mod:`.engine_ops`):

* **arena** (one tensor-parallel rank whose parameters are plain host tensors, as on CPUs without
  AMX): updates are decoded straight into the spare one of two shared-memory weight arenas laid
  out like SGLang's parameters, and the swap has delta-swap's custom weight loader point every
  parameter at it: the pause does not grow with the model;
* **shadow** (``swap_path=shadow``, and ``auto`` where no arena applies: tensor parallelism, MoE
  experts; where every parameter of every tensor-parallel rank is a plain host tensor holding the
  checkpoint's elements): the changed tensors are staged, and while the engine generates each
  rank's scheduler builds the new tensors of the parameters they change (through the model's own
  loaders; asked through :mod:`.scheduler_channel`); the pause points those parameters at them
  (delta-swap's custom weight loader, :mod:`delta_swap.param_switch`), keeping the old ones for
  the undo until the swap is final;
* **inplace** (``swap_path=inplace``, and ``auto`` where such parameters live on a GPU, whose CUDA
  graphs keep their addresses): staged likewise, but each rank works out which elements of its
  parameters change, and the pause writes only those with an undo log (:mod:`delta_swap.inplace`);
* **tensor** (everywhere else): the changed tensors are packed into one shared-memory bucket
  while SGLang keeps generating and loaded through ``load_weights`` (SGLang's Llama-style loader
  takes q/k/v and gate/up one by one, so only changed tensors are sent).

On the arena, shadow and in-place paths the swap is one job per rank run on the scheduler's own
thread in the pause (:mod:`.paused_loop`: flush the radix cache, switch or write, read back if
due, record the weight version), sent to every rank at once through :mod:`.scheduler_channel`; no
weight-update session is opened. The tensor path runs SGLang's ``begin_weight_update`` /
``update_weights_from_tensor`` (which flushes the radix cache and sets the weight version) /
``end_weight_update``.

Drain policies on SGLang 0.5.23 (its pause modes are ``abort``, ``retract`` and ``in_place``):

* ``wait``: take the tokenizer manager's model-update writer lock, which SGLang's own updates
  use to wait for in-flight requests and to hold new ones; abort what still runs after the
  timeout. Then a ``retract`` pause (nothing left to retract) marks the engine paused.
* ``keep``: ``in_place``: running requests stay where they are and continue on the new weights
  with the KV they have (the radix cache is not flushed, which SGLang refuses while requests hold
  KV; the version in every request's cache salt keeps new requests off old KV). With
  ``recompute_kv``: ``retract``: they go back to the queue and resume with their KV recomputed.
* ``abort``: hold new requests and abort the running ones (what SGLang's ``abort`` pause does,
  but checking every 20 ms, not every second, whether they are gone), then ``retract`` so the
  scheduler is paused for the flush too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from delta_swap.arena import Arena, ArenaPair
from delta_swap.engine_adapter import EngineAdapter, WeightUpdate
from delta_swap.errors import EngineError, SwapUndoneError
from delta_swap.module_groups import tensors_of_modules
from delta_swap.served_model import ServedModel
from delta_swap.settings import DrainPolicy, Settings
from delta_swap.staged_swap import FAIL_SCATTER_ENV, injected_failure_rank, injected_swap_failure, merge_staged
from delta_swap.staging_files import StagedTensors, stage_tensors, until_staged
from delta_swap.tensors import StateDict, TensorSpecs
from delta_swap.verify_budget import VerifyBudget

from . import scheduler_channel
from .engine_ops import DEFAULT_PACKED, LAYOUT_FILE_ENV
from .staging import Bucket, pack

log = logging.getLogger("sglang_delta_plugin")

#: The longest the ``wait`` drain goes on aborting requests that outlived its timeout before it
#: swaps without them (capped by the timeout itself).
ABORT_GRACE_S = 10.0
#: The longest the adapter waits for a scheduler's answer to a staging request, and to an
#: operation in the pause.
STAGE_CALL_TIMEOUT_S = 60.0
IN_PAUSE_CALL_TIMEOUT_S = 600.0


def merge_rank_outcomes(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer from every tensor-parallel rank's: the first failure, or checks summed over the
    ranks and the slowest rank's seconds."""
    failed = next((o for o in outcomes if not o.get("ok")), None)
    if failed is not None or len(outcomes) == 1:
        return dict(failed or outcomes[0])
    merged: dict[str, Any] = {"ok": True, "ranks": len(outcomes)}
    merged["seconds"] = max(float(o.get("seconds", 0.0)) for o in outcomes)
    if all("checks" in o for o in outcomes):
        merged["checks"] = sum(int(o["checks"]) for o in outcomes)
    return merged


@dataclass(frozen=True)
class StagedFile:
    """An update staged in the schedulers (the shadow and in-place paths): the changed tensors
    (each rank's scheduler holds what it built from them) and the read-back's, if due."""

    update: StagedTensors
    check: StagedTensors | None


class SglangAdapter(EngineAdapter):
    """Drives SGLang's RL weight-update API in the HTTP server process."""

    name = "sglang"
    copies_updates = True  # its schedulers copy every tensor they read from a staged file

    def __init__(
        self, tokenizer_manager: Any, served: ServedModel, settings: Settings | None = None, tp_size: int = 1
    ) -> None:
        self.tm = tokenizer_manager
        self.served = served
        self.settings = settings or Settings()
        self.tp_size = tp_size
        self._holds_writer_lock = False
        #: A request for SGLang's writer lock still waiting when the wait drain gave up on it.
        self._writer_wait: asyncio.Future | None = None
        self._keep_kv = False
        #: The two weight arenas, on the arena path (None: the tensor path, or not read yet).
        self.arenas: ArenaPair | None = None
        #: How the schedulers stage updates: ``shadow`` (new tensors switched in), ``inplace``
        #: (changed elements written), or None (the arena or tensor path).
        self.staged_path: str | None = None
        #: What the schedulers staged for the last swap ({"parameters" or "elements", "bytes", "seconds"}).
        self.last_staged: dict[str, Any] | None = None
        self._described = False
        #: Why this engine takes no update at all (its weights cannot be loaded exactly), if so.
        self.refused: str | None = None
        #: Why this server swaps the way it does (shown in the status).
        self.path_reason: str | None = None
        #: Which loads are read back (verify_swaps), how many were, and what the last one checked.
        self.verify_budget = VerifyBudget(self.settings.verify_swaps)
        self.last_verification: dict[str, Any] | None = None
        self._packed: dict[str, list[str]] | None = None

    async def weight_version(self) -> str | None:
        return self.tm.config_value("weight_version")

    async def describe(self) -> dict[str, Any]:
        return {
            "swap_path": "refused"
            if self.refused
            else "arena"
            if self.arenas
            else self.staged_path
            if self.staged_path
            else "tensor"
            if self._described
            else None,
            "swap_path_reason": self.path_reason,
            "last_staged": self.last_staged,
            "last_verification": self.last_verification,
            "verification": self.verify_budget.describe(),
        }

    async def destination(self, specs: TensorSpecs) -> StateDict | None:
        if not self._described:
            self._described = True
            layout_file = os.environ.get(LAYOUT_FILE_ENV)
            try:
                doc = json.loads(Path(layout_file).read_text()) if layout_file else {"layout": None}
            except (OSError, ValueError):
                doc = {"layout": None, "reason": "the scheduler wrote no layout"}
            self.path_reason = doc.get("reason") or ("parameters are plain host tensors" if doc["layout"] else None)
            self.refused = doc.get("refuse")
            self._packed = doc.get("packed")
            if doc.get("staged"):
                self.staged_path, self.path_reason = _every_rank_stages(doc, layout_file or "", self.tp_size)
            if self.staged_path:
                log.info(
                    "delta_swap: staging each update in the schedulers, %s path (%s)",
                    self.staged_path,
                    self.path_reason,
                )
            elif doc["layout"]:
                self.arenas, why_not = await asyncio.to_thread(ArenaPair.open, self.settings.staging_dir, doc["layout"])
                self.path_reason = why_not or self.path_reason
            elif not self.refused:
                log.info("delta_swap: loading changed tensors on each swap (%s)", doc.get("reason"))
        if self.refused:  # before a byte is fetched: the engine keeps serving what it serves
            raise EngineError(f"sglang: {self.refused}")
        return await asyncio.to_thread(self.arenas.spare_for, specs) if self.arenas else None

    async def stage(self, update: WeightUpdate) -> Bucket | Arena | StagedFile | None:
        arena = self.arenas.staged(update.state, "sglang") if self.arenas else None
        if arena is not None:
            return arena
        if not update.names:  # same bytes as now (e.g. a step that reverts): only the version moves
            return None
        if self.staged_path:
            return await self._stage_on_ranks(update, self.staged_path)
        bucket = await asyncio.to_thread(pack, update.state, sorted(update.names), update.checksums, self.tp_size)
        if self.verify_budget.due():  # every tensor-parallel rank reads back its shard of these
            bucket.check = await asyncio.to_thread(self._check_tensors, update)
        return bucket

    def _check_tensors(self, update: WeightUpdate) -> StagedTensors:
        """What the read-back compares with: every tensor of the modules the update loads into
        (and, for a tied embedding, the module sharing it reads the same file)."""
        names = tensors_of_modules(update.names, update.state, self._packed or DEFAULT_PACKED)
        return stage_tensors(self.settings.staging_dir, "check", update.state_file, update.state, names)

    async def _stage_on_ranks(self, update: WeightUpdate, path_name: str) -> StagedFile:
        """Hand the changed tensors to every rank's scheduler (the subscriber's copy of the weights,
        else a file of their own) and have each, while SGLang generates, build the new tensors of
        the parameters they change (``shadow``) or work out which elements change (``inplace``);
        wait until all have."""
        tensors = await asyncio.to_thread(
            stage_tensors,
            self.settings.staging_dir,
            f"update-{update.version}",
            update.state_file,
            update.state,
            update.names,
        )
        staged = StagedFile(tensors, None)
        try:
            if self.verify_budget.due():
                staged = StagedFile(tensors, await asyncio.to_thread(self._check_tensors, update))
            await self._on_ranks({"op": f"stage_{path_name}", "path": tensors.path, "names": tensors.names})
            answers = await until_staged(lambda: self._on_ranks({"op": "stage_wait"}))
        except BaseException:
            await self.unstage(staged)
            raise
        self.last_staged = merge_staged(answers)
        return staged

    async def _on_ranks(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """One request to every rank's scheduler (:mod:`.scheduler_channel`); raises the first error."""
        answers = await self._ask_ranks(request, range(self.tp_size), STAGE_CALL_TIMEOUT_S)
        failed = next((a for a in answers if a.get("error")), None)
        if failed is not None:
            raise EngineError(f"sglang: {request['op']} failed in the scheduler: {failed['error']}")
        return answers

    @staticmethod
    async def _ask_ranks(request: dict[str, Any], ranks: Iterable[int], timeout_s: float) -> list[dict[str, Any]]:
        """``request`` to the schedulers of ``ranks`` at once; their answers (a channel that fails
        answers ``{"error": ...}`` with why)."""

        def call(rank: int) -> dict[str, Any]:
            try:
                return scheduler_channel.call(rank, request, timeout_s=timeout_s)
            except Exception as exc:  # a refused connection, a failed handshake, no answer
                return {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}

        return list(await asyncio.gather(*(asyncio.to_thread(call, rank) for rank in ranks)))

    async def unstage(self, staged: Any) -> None:
        if isinstance(staged, Bucket) and staged.check:
            staged.check.remove()
        if isinstance(staged, StagedFile):
            for tensors in (staged.update, staged.check):
                if tensors is not None:
                    tensors.remove()
            await self._on_ranks({"op": "drop_staged"})  # the old values it kept, too

    async def close(self) -> None:
        if self.arenas is not None:  # the scheduler keeps its mappings until it exits
            self.arenas.close()

    # ------------------------------------------------------------------ drain

    async def pause(self, drain: DrainPolicy, timeout_s: float) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._keep_kv = drain is DrainPolicy.KEEP and not self.settings.recompute_kv
        try:
            if drain is DrainPolicy.WAIT:
                await self._acquire_writer(timeout_s)
            elif drain is DrainPolicy.ABORT:
                await self._abort_running(timeout_s)
            await self.tm.pause_generation(PauseGenerationReqInput(mode="in_place" if self._keep_kv else "retract"))
        except BaseException:
            await self.resume()
            raise

    async def _abort_running(self, timeout_s: float) -> None:
        """Hold new requests and abort the running ones; return once none holds the model-update
        lock (each request holds it while it runs), or after ``timeout_s``. The abort is sent
        again every half second for requests that were admitted meanwhile."""
        async with self.tm.is_pause_cond:
            self.tm.is_pause = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        sent = float("-inf")
        while await self.tm.model_update_lock.is_locked():
            now = loop.time()
            if now >= deadline:
                log.warning("delta_swap: aborted requests still running after %.1fs; retracting them", timeout_s)
                return
            if now - sent >= 0.5:
                self.tm.abort_request(abort_all=True)
                sent = now
            await asyncio.sleep(0.02)

    async def _acquire_writer(self, timeout_s: float) -> None:
        """Wait for in-flight requests (new ones queue behind); after ``timeout_s`` abort them. If
        some still hold the lock ``min(timeout_s, ABORT_GRACE_S)`` later (a request whose client
        stopped reading its stream stays in SGLang until the client reads), go on without the lock:
        new requests stay queued behind the pending writer until :meth:`resume`, and the pause
        retracts whatever still runs."""
        lock = self.tm.model_update_lock
        task = asyncio.ensure_future(lock.acquire_writer())
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                log.warning("delta_swap: requests still running after %.1fs, aborting them", timeout_s)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + min(timeout_s, ABORT_GRACE_S)
                while not task.done() and loop.time() < deadline:
                    self.tm.abort_request(abort_all=True)
                    await asyncio.wait({task}, timeout=min(0.5, max(0.0, deadline - loop.time())))
                if not task.done():
                    log.warning("delta_swap: aborted requests still hold the model; swapping without them")
                    self._writer_wait = task
                    self.tm.abort_request(abort_all=True)  # the last abort just before the pause
                    return
            await task
            self._holds_writer_lock = True
        except BaseException:
            await asyncio.shield(self._withdraw_writer(task))
            raise

    async def _end_writer_wait(self) -> None:
        """Withdraw a pending request for the writer lock (releasing it if it was granted meanwhile)
        and wake the requests queued behind it: SGLang's lock wakes them only when it is released.
        Shielded: a cancelled caller must not leave them blocked."""
        task, self._writer_wait = self._writer_wait, None
        if task is not None:
            await asyncio.shield(self._withdraw_writer(task))

    async def _withdraw_writer(self, task: asyncio.Future) -> None:
        task.cancel()
        await asyncio.wait({task})
        lock = self.tm.model_update_lock
        if task.cancelled() or task.exception() is not None:  # it holds nothing
            async with lock._cond:  # noqa: SLF001 - aio_rwlock.RWLock has no public way to do this
                lock._cond.notify_all()  # noqa: SLF001
        else:
            await lock.release_writer()

    async def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        try:
            if self.tm.is_pause:
                await self.tm.continue_generation(ContinueGenerationReqInput())
        finally:
            if self._holds_writer_lock:
                self._holds_writer_lock = False
                await self.tm.model_update_lock.release_writer()
            await self._end_writer_wait()

    # ------------------------------------------------------------------ load

    async def swap(self, update: WeightUpdate, staged: Bucket | Arena | StagedFile | None) -> None:
        version = update.version or await self.weight_version() or "default"
        if staged is None:
            await self._set_version(version)
        elif isinstance(staged, Arena):
            await self._commit(staged, version)
        elif isinstance(staged, StagedFile):
            await self._apply_on_ranks(update, staged, version)
        else:
            started = time.perf_counter()
            await self._update(staged.payloads, "flattened_bucket", version)
            log.info("delta_swap: loaded %d tensors (%.1f MB) as %s", len(update.names), staged.nbytes / 1e6, version)
            check_s = await self._read_back(staged.check) if staged.check else None
            self.verify_budget.record(time.perf_counter() - started - (check_s or 0.0), check_s)

    async def _read_back(self, check: StagedTensors) -> float:
        """Have the scheduler read back what the loaded modules compute with (before the engine
        generates on them); the check's seconds."""
        outcome = await self._run_op({"op": "verify", "path": check.path, "names": check.names}, None)
        if not outcome.get("ok"):
            raise EngineError(f"sglang: {outcome.get('error')}")
        return self._record_verification(outcome)

    def _record_verification(self, outcome: dict[str, Any]) -> float:
        """Keep what every rank read back (merged) for the status; the read-back's seconds."""
        self.last_verification = {
            "checks": outcome["checks"],
            "seconds": outcome["seconds"],
            "workers": outcome.get("ranks", 1),
        }
        return float(outcome["seconds"])

    async def _apply_on_ranks(self, update: WeightUpdate, staged: StagedFile, version: str) -> None:
        """Have every rank switch in its staged tensors or write its staged changed elements (and
        read the changed modules back, if due); a rank that fails undoes itself and answers why."""
        fail_after = await injected_swap_failure(update.version, self.weight_version)
        op: dict[str, Any] = {"op": "switch" if self.staged_path == "shadow" else "scatter", "fail_after": fail_after}
        if fail_after >= 0:
            op["fail_rank"] = injected_failure_rank(FAIL_SCATTER_ENV)
        if staged.check:
            op["verify_path"], op["verify_names"] = staged.check.path, staged.check.names
        started = time.perf_counter()
        outcome = await self._run_op(op, version)
        if not outcome.get("ok"):
            if outcome.get("undone_everywhere"):
                raise SwapUndoneError(
                    f"sglang: the {op['op']} failed and was taken back on every rank: {outcome.get('error')}"
                )
            raise EngineError(f"sglang: the {op['op']} failed: {outcome.get('error')}")
        check_s = self._record_verification(outcome) if staged.check else None
        log.info(
            "delta_swap: %s %d changed tensors as %s",
            "switched in the new parameters of" if op["op"] == "switch" else "wrote the changed elements of",
            len(update.names),
            version,
        )
        self.verify_budget.record(time.perf_counter() - started - (check_s or 0.0), check_s)

    async def _commit(self, arena: Arena, version: str) -> None:
        """Have the scheduler point every parameter at ``arena``, in the pause."""
        outcome = await self._run_op({"op": "commit", "path": str(arena.path)}, version)
        if not outcome.get("ok"):
            raise EngineError(f"sglang: switching to the new weights failed: {outcome.get('error')}")
        assert self.arenas is not None
        self.arenas.live = arena

    async def _run_op(self, op: dict[str, Any], version: str | None) -> dict[str, Any]:
        """One operation in the pause on every tensor-parallel rank's scheduler thread
        (:mod:`.engine_ops`), and their outcomes merged. With ``version``, each rank flushes its
        cache first (unless requests keep their KV) and records the version once the weights are
        in; the tokenizer manager then records it as SGLang's own updates do. Where some ranks failed a
        ``scatter`` or ``switch`` (each taking its own back), the others take theirs back, so every
        rank serves the same weights: ``undone_everywhere`` says that all of them did."""
        request = dict(op) if version is None else {**op, "version": version, "flush": not self._keep_kv}
        started = time.perf_counter()
        outcomes = await self._in_pause_on_ranks(request, range(self.tp_size))
        answered = time.perf_counter()
        merged = merge_rank_outcomes(outcomes)
        if not merged.get("ok") and op["op"] in ("scatter", "switch"):
            done = [rank for rank, outcome in enumerate(outcomes) if outcome.get("ok")]
            undone = await self._in_pause_on_ranks({"op": "undo", "version": await self.weight_version()}, done)
            stuck = [f"rank {rank}" for rank, o in enumerate(outcomes) if not o.get("ok") and not o.get("restored")]
            stuck += [f"rank {rank}" for rank, o in zip(done, undone) if not (o.get("ok") and o.get("undone"))]
            merged["undone_everywhere"] = not stuck
            if stuck:
                merged["error"] = f"{merged.get('error')}; not taken back on {', '.join(stuck)}"
        elif merged.get("ok") and version is not None:  # the schedulers recorded it: no round trip
            self.tm.record_config_updates("tokenizer.weight_version", weight_version=version)
        log.info(
            "delta_swap: %s in the pause: %.1f ms in the slowest scheduler (read-back included), %.1f ms until "
            "every rank answered, %.1f ms in all",
            op["op"],
            1000 * float(merged.get("seconds", 0.0)),
            1000 * (answered - started),
            1000 * (time.perf_counter() - started),
        )
        return merged

    async def _in_pause_on_ranks(self, request: dict[str, Any], ranks: Iterable[int]) -> list[dict[str, Any]]:
        """Each rank's outcome of an operation in the pause (``ok`` False, with why, where it failed)."""
        answers = await self._ask_ranks(request, ranks, IN_PAUSE_CALL_TIMEOUT_S)
        return [a if "ok" in a else {"ok": False, "error": a.get("error")} for a in answers]

    async def _update(self, payloads: list[bytes], load_format: str, version: str) -> None:
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )

        ok, message = await self.tm.begin_weight_update(BeginWeightUpdateReqInput(), None)
        if not ok:
            raise EngineError(f"sglang: begin_weight_update refused: {message}")
        try:
            # flush_cache drops every KV computed with the old weights (SGLang refuses while requests
            # kept in place hold KV: then the version salt keeps new requests off it).
            request = UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=payloads,
                load_format=load_format,
                flush_cache=not self._keep_kv,
                weight_version=version,
            )
            ok, message = await self.tm.update_weights_from_tensor(request, None)
        finally:
            end_ok, end_message = await self.tm.end_weight_update(EndWeightUpdateReqInput(), None)
        if not ok:
            raise EngineError(f"sglang: update_weights_from_tensor refused: {message}")
        if not end_ok:
            raise EngineError(f"sglang: end_weight_update refused: {end_message}")

    async def _set_version(self, version: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        await self.tm.update_weight_version(UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False))


def _every_rank_stages(doc: dict[str, Any], layout_file: str, ranks: int) -> tuple[str | None, str]:
    """The staged path every tensor-parallel rank's scheduler can take (rank 0 answered in
    ``doc``, rank k in ``layout_file.k``), or None; and why (or why not)."""
    for rank in range(1, ranks):
        try:
            other = json.loads(Path(f"{layout_file}.{rank}").read_text())
        except (OSError, ValueError):
            return None, f"tensor-parallel rank {rank} described nothing"
        if other.get("staged") != doc.get("staged"):
            return None, f"rank {rank}: {other.get('reason')}"
    return str(doc["staged"]), str(doc.get("reason"))
