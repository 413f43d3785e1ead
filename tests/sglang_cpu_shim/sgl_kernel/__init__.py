"""CPU TEST SHIM standing in for SGLang's ``sgl_kernel`` package. It contains no kernels.

PyPI has no CPU build of SGLang's kernel package, yet SGLang 0.5.23's CPU engine imports a few
names from ``sgl_kernel`` at module level (speculative-decoding and KV-copy helpers) that the
plain decode path with ``--attention-backend torch_native`` never calls. This module exists only
so those imports succeed in delta-swap's CPU test environment (built by scripts/sglang_env.sh).
It is not a kernel implementation and must never be installed for real serving.

Every name below raises ``RuntimeError`` when called, and first appends a line naming itself to
the file in ``$DELTA_SWAP_SGL_KERNEL_SHIM_LOG`` (when set), so a test can fail if SGLang ever
took a path that needs a real kernel. Any other attribute is missing (``AttributeError``), so
feature probes see no kernel at all.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NoReturn

__version__ = "0.0.0+delta-swap-cpu-test-shim"
IS_DELTA_SWAP_CPU_TEST_SHIM = True
LOG_ENV = "DELTA_SWAP_SGL_KERNEL_SHIM_LOG"

#: Names SGLang 0.5.23 imports from ``sgl_kernel`` on the CPU path with the torch_native backend.
SHIMMED = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)


def record_call(name: str) -> None:
    """Append ``name`` to the call log named by ``$DELTA_SWAP_SGL_KERNEL_SHIM_LOG``, if set."""
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{os.getpid()} {name}\n")


def _stand_in(name: str) -> Callable[..., NoReturn]:
    def fn(*args: Any, **kwargs: Any) -> NoReturn:
        record_call(name)
        raise RuntimeError(
            f"sgl_kernel.{name} was called, but this sgl_kernel is delta-swap's CPU test shim "
            "with no kernels (see tests/sglang_cpu_shim/README.md)"
        )

    fn.__name__ = fn.__qualname__ = name
    return fn


for _name in SHIMMED:
    globals()[_name] = _stand_in(_name)
del _name
