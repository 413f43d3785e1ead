"""How much further contexts could shrink codec v2's payload (issue 12), measured, not built.

    python -m benchmarks.context_entropy [--corpus llama qwen2] [--steps 4]

On codec_bench's corpora (``rl_corpus.py``), for every bf16 tensor of every checkpoint pair that
has a previous pair, it codes the delta with codec v2 (the real payload size) and estimates the
bits a static per-class model would save with more context, against v2's own model (a change
rate per exponent class, 5 bytes per class record; raw sign bits, as v2 wrote them before
predicted signs):

* ``rows``: each matrix's rows in 2, 4 or 8 groups by their change rate (where that pays; 3 bits
  per row to name the group), one rate per exponent class and group;
* ``columns``: the same with each matrix's columns (3 bits per column);
* ``previous``: one rate per exponent class and "changed in the previous step";
* ``both``: exponent class x row group x changed-before;
* ``signs``: the sign of a change whose element also changed in the previous step, coded as
  same-or-not as the previous sign;
* ``values``: each change's |step| and sign coded together, given the exponent class and the
  element's previous step (0, 1, 2 or 3+ ULPs; or only whether there was one, whichever is
  cheaper for the tensor; none when neither pays), the sign relative to the previous step's;
  against v2's |step| given the exponent class and one raw bit per sign. Both sides pay a 12-bit
  table entry per symbol a context uses.

Savings are printed as a percentage of the v2 payload of the same tensors. Estimates are ideal
code lengths (binary entropies), so a coder would land slightly above them.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.rl_corpus import add_corpus_arguments, changed_bf16_triples, corpus_runs
from delta_swap.codec import v1, v2

RECORD_BITS = 40  # one class record in a v2 payload, about 5 bytes
TABLE_ENTRY_BITS = 12  # one quantised frequency of a rANS table
MAX_STEP = 64  # |step| above this shares one symbol (an escape, as in v2's tables)
GROUPS = (2, 4, 8)


def _binary_bits(k: np.ndarray, n: np.ndarray) -> float:
    p = np.clip(k / np.maximum(n, 1), 1e-12, 1 - 1e-12)
    return float((n * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))).sum())


def _class_bits(context: np.ndarray, changed: np.ndarray) -> float:
    """Ideal bits of the change mask with one rate per context, plus a record per used context."""
    n = np.bincount(context)
    k = np.bincount(context, weights=changed)
    used = k > 0
    return _binary_bits(k[used], n[used]) + RECORD_BITS * int(used.sum())


def _table_bits(context: np.ndarray, symbol: np.ndarray) -> float:
    """Ideal bits of the symbols with one static distribution per context, plus its table."""
    pairs, count = np.unique(context * (4 * MAX_STEP) + symbol, return_counts=True)
    _, ctx = np.unique(pairs // (4 * MAX_STEP), return_inverse=True)
    total = np.bincount(ctx, weights=count)
    return float((count * np.log2(total[ctx] / count)).sum()) + TABLE_ENTRY_BITS * pairs.size


def bf16_keys(bits: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) as int64 keys in float order (codec v1's ordered key): a difference of
    two keys is a step in ULPs."""
    return v1._ordered_key(bits, 16).astype(np.int64)


def _row_groups(
    exp: np.ndarray, changed: np.ndarray, shape: tuple[int, ...], axis: int = 1
) -> tuple[np.ndarray, int, float]:
    """(group of every element, number of groups, side bits) of the cheapest grouping of a
    matrix's rows (``axis`` 1: a row's rate is summed over its columns) or of its columns
    (``axis`` 0)."""
    best = (np.zeros(exp.size, np.int64), 1, 0.0)
    if len(shape) != 2 or shape[1] < 256:
        return best
    lines = shape[1 - axis]
    rate = np.bincount(exp, weights=changed, minlength=256) / np.maximum(np.bincount(exp, minlength=256), 1)
    ratio = changed.reshape(shape).sum(axis) / np.maximum(rate[exp].reshape(shape).sum(axis), 1e-9)
    best_bits = _class_bits(exp, changed)
    for g in GROUPS:
        cuts = np.quantile(ratio, np.linspace(0, 1, g + 1)[1:-1])
        line_group = np.searchsorted(cuts, ratio, side="right")
        group = np.repeat(line_group, shape[1]) if axis == 1 else np.tile(line_group, shape[0])
        side = lines * np.log2(g)
        bits = _class_bits(exp * g + group, changed) + side
        if bits < best_bits:
            best, best_bits = (group, g, side), bits
    return best


def measure(checkpoints: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Savings of each context, in bits, and the v2 payload bits they compare with."""
    out = {"v2_payload": 0.0, "rows": 0.0, "columns": 0.0, "previous": 0.0, "both": 0.0, "signs": 0.0, "values": 0.0}
    for shape, u, v, w in changed_bf16_triples(checkpoints):
        payload = v2.encode_delta(u.view(np.uint8), v.view(np.uint8), "BF16", shape, predict_signs=False)
        out["v2_payload"] += 8 * len(payload)
        step, previous = bf16_keys(v) - bf16_keys(u), bf16_keys(u) - bf16_keys(w)
        changed, changed_before = step != 0, (previous != 0).astype(np.int64)
        exp = ((u >> 7) & 0xFF).astype(np.int64)
        base = _class_bits(exp, changed)
        group, g, side = _row_groups(exp, changed, shape)
        out["rows"] += base - _class_bits(exp * g + group, changed) - side
        col_group, cg, col_side = _row_groups(exp, changed, shape, axis=0)
        out["columns"] += base - _class_bits(exp * cg + col_group, changed) - col_side
        out["previous"] += base - _class_bits(exp * 2 + changed_before, changed)
        out["both"] += base - _class_bits((exp * g + group) * 2 + changed_before, changed) - side
        again = changed & (changed_before == 1)
        if again.any():
            same = np.sign(step[again]) == np.sign(previous[again])
            out["signs"] += again.sum() - _binary_bits(np.array([same.sum()]), np.array([again.sum()])) - 16
        step_c, prev_c, exp_c = step[changed], previous[changed], exp[changed]
        size, negative = np.minimum(np.abs(step_c), MAX_STEP), (step_c < 0).astype(np.int64)
        relative = negative ^ (prev_c < 0)  # 0: the direction of the previous step (or +, if none)
        v2_values = _table_bits(exp_c, size) + size.size
        out["values"] += max(
            0.0,
            v2_values
            - min(  # the cheapest per tensor, as an encoder would choose
                _table_bits(exp_c * 4 + np.minimum(np.abs(prev_c), 3), size * 2 + relative),
                _table_bits(exp_c * 2 + (prev_c != 0), size * 2 + relative),
            ),
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_corpus_arguments(parser)
    args = parser.parse_args(argv)
    print(f"{'corpus':<7} {'lr':>7}  saving as % of the v2 payload (pairs 2-{args.steps})")
    print(
        f"{'':<7} {'':>7}  {'rows':>6} {'columns':>8} {'previous':>9} {'both':>6} {'signs':>6} {'both+signs':>11} {'values':>7} "
        f"{'both+values':>12}"
    )
    for name, lr, checkpoints in corpus_runs(args.corpus, args.steps):
        r = measure(checkpoints)
        pct = {k: 100 * v / r["v2_payload"] for k, v in r.items() if k != "v2_payload"}
        print(
            f"{name:<7} {lr:>7g}  {pct['rows']:>6.2f} {pct['columns']:>8.2f} {pct['previous']:>9.2f} {pct['both']:>6.2f} "
            f"{pct['signs']:>6.2f} {pct['both'] + pct['signs']:>11.2f} {pct['values']:>7.2f} "
            f"{pct['both'] + pct['values']:>12.2f}"
        )


if __name__ == "__main__":
    main()
