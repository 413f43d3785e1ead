"""The machine a figure is measured on: the CPU's model and the flags that decide the engines' path.

vLLM repacks bf16 linear weights on CPUs with AMX or AVX512-BF16 (so ``swap_path=auto`` takes the
reload path there); every benchmark that prints a figure prints this line beside it.
"""

from __future__ import annotations

from pathlib import Path

#: The CPU flags that decide the engines' CPU weight layout.
CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str | None = None, *, model: bool = True) -> str:
    """``MODEL; amx_bf16=yes|no avx512_bf16=yes|no`` from ``/proc/cpuinfo`` (or the given text)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown CPU"
    flags: set[str] = set()
    name = "unknown CPU"
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
        elif line.startswith("model name"):
            name = line.partition(":")[2].strip()
    listed = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in CPU_FLAGS)
    return f"{name}; {listed}" if model else listed
