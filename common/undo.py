"""Taking a failed swap back, and knowing afterwards whether that worked.

A swap strategy (:mod:`.inplace`'s scatter, :mod:`.shadow`'s and :mod:`.param_switch`'s switch)
that fails part way runs its undo before it raises. :func:`take_back` runs that undo and, where
the undo fails too, marks the original exception, so whoever answers for the rank says whether
its old weights are back (:func:`restored`) instead of assuming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("delta_swap.undo")

_UNDO_FAILED = "delta_swap_undo_failed"


def take_back(undo: Callable[[], None], failure: BaseException) -> None:
    """Run ``undo`` after ``failure``; if it raises, log why and mark ``failure`` as not undone."""
    try:
        undo()
    except BaseException as exc:
        log.error("delta_swap: taking back the failed swap failed too: %r (after %r)", exc, failure)
        setattr(failure, _UNDO_FAILED, True)


def restored(failure: BaseException) -> bool:
    """Whether the swap that raised ``failure`` put the old values back (see :func:`take_back`)."""
    return not getattr(failure, _UNDO_FAILED, False)
