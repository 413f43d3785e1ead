"""Answers from vLLM's workers to the API server, through files: every worker of every engine
(tensor- and data-parallel ranks) writes its own, and the API server reads them all. A worker
reports a failed read-back here (``"error"``) rather than raising it: vLLM's multiprocess executor
stops reading answers at the first failed worker, and the others' answers would then be taken for
the next call's. :func:`read_worker_results` raises it in the API server instead."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from delta_swap.errors import EngineError


def write_worker_result(output: str, doc: dict[str, Any]) -> None:
    """Write this worker's answer next to ``output`` (``output.<pid>``, renamed into place whole):
    every worker of every engine answers (tensor- and data-parallel ranks), and
    :func:`read_worker_results` collects them."""
    final = f"{output}.{os.getpid()}"
    Path(final + ".tmp").write_text(json.dumps(doc))
    os.replace(final + ".tmp", final)


def read_worker_results(output: str, raise_errors: bool = True) -> list[dict[str, Any]]:
    """The answers that :func:`write_worker_result` left for ``output`` (removed once read); raises
    EngineError with the first worker's ``"error"`` if any worker reported one (unless not
    ``raise_errors``)."""
    out = []
    for file in sorted(Path(output).parent.glob(Path(output).name + ".*")):
        if file.suffix == ".tmp":
            continue
        out.append(json.loads(file.read_text()))
        file.unlink()
    errors = [answer["error"] for answer in out if answer.get("error")]
    if errors and raise_errors:
        raise EngineError(f"vllm: {errors[0]}")
    return out
