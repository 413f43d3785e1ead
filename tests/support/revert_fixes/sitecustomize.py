"""Put back, inside a vLLM server's processes, the bugs that delta-swap's reload-path fixes
remove, so a test can show that the post-swap verification catches each of them.

Started with this folder on PYTHONPATH and ``DELTA_SWAP_REVERT_FIXES`` naming the fixes to revert
(comma-separated): ``tied`` (no re-processing of a tied lm_head), ``experts`` (no CPU experts
prepack after a reload), ``modules`` (no completion of updates to whole modules)."""

import importlib.abc
import os
import sys

_REVERT = {name for name in os.environ.get("DELTA_SWAP_REVERT_FIXES", "").split(",") if name}
_TARGETS = {"vllm_delta_plugin.transfer_engine", "vllm_delta_plugin.adapter"}


def _revert(module) -> None:
    if module.__name__ == "vllm_delta_plugin.transfer_engine":
        if "tied" in _REVERT:
            module._modules_sharing_parameters_with = lambda model, touched: []
        if "experts" in _REVERT:
            module._reloaded_cpu_experts = lambda model, touched: []
    if "modules" in _REVERT and hasattr(module, "complete_modules"):
        module.complete_modules = lambda names, groups, packed: set(names)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            _revert(module)

        spec.loader.exec_module = exec_module
        return spec


if _REVERT:
    import importlib.util

    sys.meta_path.insert(0, _Finder())
