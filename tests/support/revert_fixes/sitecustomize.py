"""Put back, inside a vLLM server's processes, the bugs that delta-swap's reload-path fixes
remove, so a test can show that the post-swap verification catches each of them.

Started with this folder on PYTHONPATH and ``DELTA_SWAP_REVERT_FIXES`` naming the fixes to revert
(comma-separated): ``tied`` (no re-processing of a tied lm_head), ``experts`` (no CPU experts
prepack after a reload), ``modules`` (no completion of updates to whole modules),
``stale_quantized_experts`` (the switch of a layer of experts quantized as vLLM loads them keeps
the live layer's packed int8 gate/up weights: stale weights, the kind of bug the read-back is
there for; it checks them against a fresh quantization, which a bug in the switch cannot reach).

For SGLang, whose loader needs none of those fixes, ``stale_embedding`` puts in an engine bug of
the same kind instead: its tensor updates leave ``embed_tokens`` as it was (and, on a tied model,
the lm_head that shares it), with a clean result, so a test can show the read-back catches it."""

import importlib.abc
import os
import sys

_REVERT = {name for name in os.environ.get("DELTA_SWAP_REVERT_FIXES", "").split(",") if name}
_SGLANG_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
_TARGETS = {
    "vllm_delta_plugin.transfer_engine",
    "vllm_delta_plugin.adapter",
    "delta_swap.shadow",
    _SGLANG_UPDATER,
}


def _revert(module) -> None:
    if module.__name__ == "vllm_delta_plugin.transfer_engine":
        if "tied" in _REVERT:
            module._modules_sharing_parameters_with = lambda model, touched: []
        if "experts" in _REVERT:
            module._reloaded_cpu_experts = lambda model, touched: []
    if module.__name__ == "delta_swap.shadow" and "stale_quantized_experts" in _REVERT:
        switch = module.ShadowBuild.switch

        def switch_leaving_stale_experts(self, after_each=None):
            for item in self.switches:
                if type(item.module.__dict__.get("quant_method")).__name__ == "Int8OnlineMoEMethod":
                    item.state["_parameters"]["w13_weight"] = item.module._parameters["w13_weight"]
            return switch(self, after_each)

        module.ShadowBuild.switch = switch_leaving_stale_experts
    if "modules" in _REVERT and hasattr(module, "complete_modules"):
        module.complete_modules = lambda names, groups, packed: set(names)
    if module.__name__ == _SGLANG_UPDATER and "stale_embedding" in _REVERT:
        load = module.WeightUpdater._update_weights_from_flattened_bucket

        def stale(self, *args, **kwargs):
            params = dict(self.get_model().named_parameters())
            kept = {n: p.detach().clone() for n, p in params.items() if "embed_tokens" in n}
            out = load(self, *args, **kwargs)
            for name, value in kept.items():
                params[name].data.copy_(value)
            return out

        module.WeightUpdater._update_weights_from_flattened_bucket = stale


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
