"""What vLLM's CPU path does with bf16 weights on this machine, asked of vLLM itself."""

from __future__ import annotations

import functools
import subprocess
import sys

_PROBE = """
import torch
from vllm import _custom_ops as ops
if torch.cpu._is_amx_tile_supported():
    print("repacks")  # its sgl-kernel packing of small linears, and oneDNN for the rest
else:
    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=torch.bfloat16).t(), 32)
        print("repacks")
    except (AttributeError, RuntimeError):
        print("plain")  # no oneDNN bf16 matmul here (no AVX512-BF16): vLLM falls back to torch's linear
"""


@functools.cache
def vllm_repacks_bf16_linears() -> bool:
    """Whether vLLM's CPU linear layers repack bf16 weights here (then a tied ``lm_head`` keeps a
    packed copy of the embedding, and ``auto`` takes the shadow path), or keep them plain (the
    arena path). Decided the way vLLM decides it (AMX, or oneDNN accepting a bf16 matmul), in a
    child process."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1] == "repacks"


_INT8_EXPERTS_PROBE = """
from vllm.model_executor.layers.fused_moe.experts import cpu_moe
kernels = [getattr(cpu_moe, name) for name in dir(cpu_moe) if name.endswith("ExpertsInt8")]
print(" ".join(k.__name__ for k in kernels if k._supports_current_device()) or "none")
"""


@functools.cache
def vllm_int8_experts() -> str | None:
    """Why vLLM cannot serve MoE experts quantized to int8 (``--quantization
    int8_per_channel_weight_only``) on this CPU, or None where one of its CPU int8 experts kernels
    runs here (x86: AMX tiles; asked of vLLM's kernels themselves, in a child process)."""
    out = subprocess.run(
        [sys.executable, "-c", _INT8_EXPERTS_PROBE], capture_output=True, text=True, timeout=300, check=True
    )
    if out.stdout.strip().splitlines()[-1] != "none":
        return None
    return "vLLM has no int8 MoE experts kernel for this CPU (its x86 one needs AMX tiles)"
