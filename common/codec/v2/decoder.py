"""Decoding codec v2 payloads: the header, full and XOR planes, and ULP bodies applied in place
with pooled scratch buffers."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

import numpy as np

from ...dtypes import DTYPE_SIZES
from ...errors import CorruptDataError
from ..inputs import Payload, payload_view, raw_bytes
from . import select_apply
from .decode_kernels import WALKS, check_consumed
from .jit import readonly
from .parse import ERRORS, LAYOUT, UlpLayout, parse_ulp
from .wire import (
    FLAG_SIGN_MODEL,
    FLOATS,
    MAGIC,
    MAX_PARTS,
    METHOD_FULL,
    METHOD_SPLIT,
    METHOD_ULP,
    METHOD_XOR,
    UINT,
    Reader,
    plane_bytes,
    read_planes,
)


class _Scratch:
    """Reusable decode buffers. Fresh pages cost ~0.5 ms/MB in page faults, and apply_snapshot
    runs each snapshot on a new thread pool, so buffers are pooled process-wide (one per decoding
    thread at a time, at most ``_POOL_MAX`` kept), not per thread."""

    __slots__ = ("i64", "u8", "select")

    def __init__(self) -> None:
        self.i64 = np.empty(1 << 12, np.int64)
        self.u8 = np.empty(1 << 12, np.uint8)
        self.select = select_apply.SelectScratch()

    def grow(self, n64: int, n8: int) -> None:
        if self.i64.size < n64:
            self.i64 = np.empty(n64, np.int64)
        if self.u8.size < n8:
            self.u8 = np.empty(n8, np.uint8)


_POOL: list[_Scratch] = []
_POOL_LOCK = threading.Lock()
_POOL_MAX = max(2, os.cpu_count() or 1)


def _acquire() -> _Scratch:
    with _POOL_LOCK:
        return _POOL.pop() if _POOL else _Scratch()


def _release(scratch: _Scratch) -> None:
    with _POOL_LOCK:
        if len(_POOL) < _POOL_MAX:
            _POOL.append(scratch)


def _apply_ulp(p: np.ndarray, pos: int, elems: np.ndarray, dtype: str, flags: int = 0) -> None:
    """Parse the ULP body p[pos:] and apply it in place to elems (the old elements)."""
    exp_bits = FLOATS[dtype][2]
    full = (1 << (8 * elems.itemsize)) - 1
    scratch = _acquire()
    err = -99
    try:
        err = _apply_ulp_with(scratch, p, pos, elems, dtype, exp_bits, full, flags)
    finally:
        if err in (0, 1):  # a payload refused late may have grown the scratch: not kept for later
            _release(scratch)
    if err not in (0, 1):
        raise CorruptDataError(f"corrupt v2 delta payload: {ERRORS.get(err, 'inconsistent')} (code {err})")


def _apply_ulp_with(
    scratch: _Scratch, p: np.ndarray, pos: int, elems: np.ndarray, dtype: str, exp_bits: int, full: int, flags: int = 0
) -> int:
    layout = np.zeros(1, LAYOUT)
    err = parse_ulp(p, pos, elems.size, exp_bits, full, flags, scratch.i64, scratch.u8, layout)
    if err == 2:  # sizes were validated against n and the payload length before this request
        need = UlpLayout(*layout[0].tolist())
        scratch.grow(need.need_i64 + need.need_i64 // 4, need.need_u8 + need.need_u8 // 4)
        err = parse_ulp(p, pos, elems.size, exp_bits, full, flags, scratch.i64, scratch.u8, layout)
    i64s, u8s = scratch.i64, scratch.u8
    if err == 1:
        lay = UlpLayout(*layout[0].tolist())
        K, S, D, row_len, n_rows = lay.n_classes, lay.n_sparse, lay.dense_first, lay.walk_row_len, lay.n_rows
        predict, pred_len, c_at = lay.predict, lay.row_len, lay.codes_at_u8
        table = i64s[lay.table_at : lay.table_at + 64].view(np.uint64)
        n_pred_rows = elems.size // pred_len if predict else 0
        rc = u8s[c_at : c_at + n_pred_rows]
        cc = u8s[c_at + n_pred_rows : c_at + n_pred_rows + (pred_len if predict else 0)]
        E = 1 << exp_bits
        o_ = lay.lut_at
        lut = i64s[o_ : o_ + 2 * E]
        o_ += 2 * E
        cnt, evp, vp, vend, evend = (i64s[o_ + j * (K + 1) : o_ + (j + 1) * (K + 1)] for j in range(5))
        ev = i64s[: lay.n_event_slots]
        vals = i64s[lay.n_event_slots : lay.n_event_slots + lay.n_changed]
        row_dead = u8s[:n_rows] if n_rows else np.zeros(1, np.uint8)
        if dtype == "BF16" and select_apply.AVAILABLE and elems.flags.c_contiguous:
            return select_apply.apply_bf16(
                scratch.select,
                elems,
                row_dead,
                row_len,
                n_rows,
                lut,
                S,
                D,
                K,
                evp,
                vp,
                vend,
                evend,
                ev,
                vals,
                table,
                rc,
                cc,
                predict,
                pred_len,
            )
        u64 = np.uint64
        err = WALKS[dtype](
            elems,
            lut.view(u64),
            D,
            row_dead,
            row_len,
            cnt.view(u64),
            evp.view(u64),
            ev,
            vp.view(u64),
            vend.view(u64),
            vals,
            table,
            rc,
            cc,
            predict,
            pred_len,
        )
        if err == 0:
            err = check_consumed(evp, evend, vp, vend, S)
    return err


def _run_all(jobs: list[Callable[[], None]], executor: Executor | None) -> None:
    """Run every job, the first here and the rest on ``executor`` if given; a job no thread has
    started yet runs here instead. Raises the first job's error, after every job has ended."""
    futures: list[Future[None] | None] = [None] * len(jobs)
    if executor is not None:
        futures[1:] = [executor.submit(job) for job in jobs[1:]]
    errors: list[BaseException] = []
    for job, future in zip(jobs, futures, strict=True):
        try:
            if future is None or future.cancel():
                job()
            else:
                future.result()
        except BaseException as exc:  # every part must have ended before ``out`` is given back
            errors.append(exc)
    if errors:
        raise errors[0]


def split_parts(payload: Payload, max_elements: int = 1 << 62) -> list[tuple[int, int, memoryview]]:
    """The parts of a split payload (method 3), as (first element, elements, payload), validated
    against each other and the payload's length (at most ``max_elements`` in all), not decoded.
    Every part must be a payload of method 0, 1 or 2 of the same element size."""
    view = payload_view(payload).cast("B")
    if len(view) < 8 or bytes(view[:4]) != MAGIC or view[4] != METHOD_SPLIT:
        raise CorruptDataError("not a v2 split payload")
    if view[6]:
        raise CorruptDataError(f"unknown payload flags {view[6]:#x}")
    rd = Reader(view)
    rd.p = 7
    n = rd.varint(max_elements, "n_elements")
    k = rd.varint(min(n, MAX_PARTS), "parts")
    if k < 2:
        raise CorruptDataError(f"a split payload of {k} part(s)")
    sizes = [(rd.varint(n, "part elements"), rd.varint(len(view), "part length")) for _ in range(k)]
    if sum(count for count, _ in sizes) != n or any(count == 0 for count, _ in sizes):
        raise CorruptDataError("the parts of a split payload do not add up to its elements")
    if sum(length for _, length in sizes) != len(view) - rd.p:
        raise CorruptDataError("the parts of a split payload do not add up to its length")
    parts, first = [], 0
    for count, length in sizes:
        part = rd.take(length, "a part")
        if len(part) < 8 or bytes(part[:4]) != MAGIC or part[5] != view[5]:
            raise CorruptDataError("a part of a split payload is not a v2 payload of the same element size")
        if part[4] not in (METHOD_FULL, METHOD_ULP, METHOD_XOR):
            raise CorruptDataError(f"a part of a split payload has method {part[4]}")
        parts.append((first, count, part))
        first += count
    return parts


def payload_is_delta(payload: Payload) -> bool:
    """Whether a v2 payload needs the previous tensor (a split one: whether any part does)."""
    view = payload_view(payload)
    if len(view) < 8 or bytes(view[:4]) != MAGIC:
        raise CorruptDataError("bad v2 payload magic")
    if view[4] == METHOD_SPLIT:
        return any(part[4] != METHOD_FULL for _, _, part in split_parts(view))
    if view[4] not in (METHOD_FULL, METHOD_ULP, METHOD_XOR):
        raise CorruptDataError(f"unknown v2 payload method {view[4]}")
    return view[4] != METHOD_FULL


def full_payload_nbytes(payload: Payload) -> int:
    """The tensor size a v2 full payload rebuilds, from its header (planes validated, not decoded)."""
    view = payload_view(payload).cast("B")
    if not payload_is_delta(view) and view[5] in UINT:
        if view[4] == METHOD_SPLIT:
            return sum(full_payload_nbytes(part) for _, _, part in split_parts(view))
        rd = Reader(view)
        rd.p = 7
        n = rd.varint(1 << 62, "n_elements")
        read_planes(rd, n, view[5])
        return n * view[5]
    raise CorruptDataError("not a v2 full payload")


def decode_into(out: np.ndarray, payload: Payload, dtype: str, executor: Executor | None = None) -> None:
    """Rebuild a tensor in place: ``out`` (raw bytes of ``dtype``) holds the previous tensor for a
    delta payload (anything for a full one) and receives the new bytes. The parts of a split
    payload decode on ``executor``'s threads where one is given (the calling thread decodes those
    no thread has started, so a caller that is itself one of its threads never waits on a queue).

    The payload's header, counts, lengths and tables are validated before ``out`` is written;
    errors found during the pass (values that do not add up) raise CorruptDataError after part of
    ``out`` was rewritten, so its content is then undefined.
    """
    out = raw_bytes(out, "out")
    view = payload_view(payload).cast("B")
    if len(view) < 8 or bytes(view[:4]) != MAGIC:
        raise CorruptDataError("bad v2 payload magic")
    if dtype not in DTYPE_SIZES:
        raise CorruptDataError(f"unknown dtype {dtype!r}")
    width = DTYPE_SIZES[dtype]
    if view[4] == METHOD_SPLIT:  # every part's framing is checked before any part is decoded
        if view[5] != width:
            raise CorruptDataError(f"payload element size {view[5]} does not match {dtype}")
        if out.size % width:
            raise CorruptDataError("expected byte count is not a whole number of elements")
        parts = split_parts(view, out.size // width)
        if sum(count for _, count, _ in parts) * width != out.size:
            raise CorruptDataError(f"payload rebuilds {sum(c for _, c, _ in parts) * width} bytes, expected {out.size}")
        jobs: list[Callable[[], None]] = [
            functools.partial(decode_into, out[f * width : (f + c) * width], part, dtype) for f, c, part in parts
        ]
        _run_all(jobs, executor)
        return
    rd = Reader(view)
    rd.p = 4
    method, pwidth, flags = rd.u8(), rd.u8(), rd.u8()
    if pwidth != width:
        raise CorruptDataError(f"payload element size {pwidth} does not match {dtype}")
    if flags & ~FLAG_SIGN_MODEL or (flags and method != METHOD_ULP):
        raise CorruptDataError(f"unknown payload flags {flags:#x}")
    if out.size % width:
        raise CorruptDataError("expected byte count is not a whole number of elements")
    n = rd.varint(out.size // width, "n_elements")
    if n * width != out.size:
        raise CorruptDataError(f"payload rebuilds {n * width} bytes, expected {out.size}")
    if method in (METHOD_FULL, METHOD_XOR):
        if method == METHOD_XOR and dtype in FLOATS:
            raise CorruptDataError(f"XOR payload for the float dtype {dtype}")
        planes = read_planes(rd, n, width)
        if rd.p != len(view):
            raise CorruptDataError(f"{len(view) - rd.p} trailing bytes")
        columns = out.reshape(-1, width)
        for j, (coder, stored) in enumerate(planes):
            data = plane_bytes(coder, stored, n)
            if method == METHOD_FULL:
                columns[:, j] = data
            else:
                columns[:, j] ^= data
        return
    if method != METHOD_ULP:
        raise CorruptDataError(f"unknown v2 payload method {method}")
    if dtype not in FLOATS:
        raise CorruptDataError(f"ULP payload for the non-float dtype {dtype}")
    _apply_ulp(readonly(np.frombuffer(view, np.uint8), np.uint8), rd.p, out.view(UINT[width]), dtype, flags)
