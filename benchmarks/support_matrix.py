"""The README's support matrix from the exactness suite's records.

    DELTA_SWAP_FULL_MATRIX=1 DELTA_SWAP_MATRIX_OUT=matrix.jsonl pytest tests/test_vllm_exactness.py tests/test_sglang_exactness.py
    python -m benchmarks.support_matrix matrix.jsonl

The suite (``delta_swap.testing.engine_exactness``) appends one JSON line per swap, or per path the
engine could not take, to the file ``DELTA_SWAP_MATRIX_OUT`` names. This prints them as a markdown
table, one row per model family, engine, layout (extra engine flags) and swap path: exact or not
(every swap's served logprobs equal to a fresh server's), or skipped with the engine's reason; the
median no-generation window (pause + swap + resume) over the cell's swaps; and the test. A heading
line gives the dates of the records and the CPU flags that decide vLLM's CPU weight layout
(``amx_bf16``, ``avx512_bf16`` in ``/proc/cpuinfo`` of the machine printing the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.machine import cpu_flags

#: The README's names of the suite's families, in the matrix's order.
FAMILIES: dict[str, str] = {
    "llama": "Llama",
    "qwen2": "Qwen2 (biases)",
    "qwen3": "Qwen3 (tied)",
    "qwen3_moe": "Qwen3-MoE",
    "qwen2_moe": "Qwen2-MoE (shared expert)",
}
ENGINES: dict[str, str] = {"vllm": "vLLM", "sglang": "SGLang"}


@dataclass
class Cell:
    """The records of one family x engine x layout x path."""

    family: str
    engine: str
    layout: str
    path: str
    swaps: list[Mapping[str, Any]] = field(default_factory=list)
    skipped: str | None = None
    taken: set[str] = field(default_factory=set)
    tests: set[str] = field(default_factory=set)

    def result(self) -> str:
        """exact, inexact (which steps, by how much), or the reason the path was skipped."""
        if not self.swaps:
            return f"skipped: {self.skipped}" if self.skipped else "not run"
        n = f"{len(self.swaps)} swap{'s' if len(self.swaps) != 1 else ''}"
        bad = [s for s in self.swaps if not s.get("exact")]
        if not bad:
            return f"exact ({n})"
        steps = ", ".join(f"step {s.get('step')} (max diff {s.get('max_difference', float('nan')):.3g})" for s in bad)
        return f"INEXACT: {steps} of {n}"

    def window_ms(self) -> str:
        """The median window of the cell's swaps, in milliseconds."""
        windows = [s["window_s"] for s in self.swaps if s.get("window_s") is not None]
        return f"{1000 * statistics.median(windows):.1f}" if windows else "-"


def read_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON records of a matrix file (blank lines ignored)."""
    return [json.loads(line) for line in lines if line.strip()]


def cells(records: Iterable[Mapping[str, Any]]) -> list[Cell]:
    """Group records by family, engine, layout and requested path, in the matrix's order."""
    by_key: dict[tuple[str, str, str, str], Cell] = {}
    for r in records:
        key = (r["family"], r["engine"], r.get("layout") or "", r["path"])
        cell = by_key.setdefault(key, Cell(*key))
        cell.tests.add(r["test"].split("::test_")[0])
        if "skipped" in r:
            cell.skipped = r["skipped"]
        else:
            cell.swaps.append(r)
            cell.taken.add(r["taken"])

    def rank(c: Cell) -> tuple[int, str, int, str, str, bool, str]:
        family, engine = list(FAMILIES), list(ENGINES)
        return (
            family.index(c.family) if c.family in family else len(family),
            c.family,
            engine.index(c.engine) if c.engine in engine else len(engine),
            c.engine,
            c.layout,
            c.path == "arena",  # the engine's own loader first
            c.path,
        )

    return sorted(by_key.values(), key=rank)


def table(records: list[Mapping[str, Any]], cpuinfo: str) -> list[str]:
    """The matrix as markdown lines: a heading line, then the table."""
    days = sorted({str(r.get("time", ""))[:10] for r in records} - {""})
    when = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}" if days else "unknown date"
    lines = [
        f"Measured {when}; CPU: {cpu_flags(cpuinfo, model=False)}. Window: pause + swap + resume, median over the cell's "
        "swaps (the suite reads back every reload or tensor load, inside the window).",
        "",
        "| family | engine | layout | path | served = fresh server | window ms | test |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in cells(records):
        path = c.path if not c.taken or c.taken == {c.path} else f"{c.path} ({'/'.join(sorted(c.taken))})"
        tests = ", ".join(f"`{t}`" for t in sorted(c.tests))
        lines.append(
            f"| {FAMILIES.get(c.family, c.family)} | {ENGINES.get(c.engine, c.engine)} | "
            f"{f'`{c.layout}`' if c.layout else '-'} | {path} | {c.result()} | {c.window_ms()} | {tests} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path, help="the JSON-lines file the suite wrote (DELTA_SWAP_MATRIX_OUT)")
    parser.add_argument("--cpuinfo", type=Path, default=Path("/proc/cpuinfo"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cpuinfo = args.cpuinfo.read_text() if args.cpuinfo.exists() else ""
    print("\n".join(table(read_records(args.file.read_text().splitlines()), cpuinfo)))


if __name__ == "__main__":
    main()
