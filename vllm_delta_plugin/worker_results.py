"""Answers from vLLM's workers to the API server, through files: every worker of every engine
(tensor- and data-parallel ranks) writes its own, and the API server reads them all."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_worker_result(output: str, doc: dict[str, Any]) -> None:
    """Write this worker's answer next to ``output`` (``output.<pid>``, renamed into place whole):
    every worker of every engine answers (tensor- and data-parallel ranks), and
    :func:`read_worker_results` collects them."""
    final = f"{output}.{os.getpid()}"
    Path(final + ".tmp").write_text(json.dumps(doc))
    os.replace(final + ".tmp", final)


def read_worker_results(output: str) -> list[dict[str, Any]]:
    """The answers that :func:`write_worker_result` left for ``output`` (removed once read)."""
    out = []
    for file in sorted(Path(output).parent.glob(Path(output).name + ".*")):
        if file.suffix == ".tmp":
            continue
        out.append(json.loads(file.read_text()))
        file.unlink()
    return out
