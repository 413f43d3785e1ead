"""Tensor element types, named as safetensors names them ("BF16", "F32", ...)."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError, CorruptDataError

#: Bytes per element of every dtype the format knows.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

#: Sign-magnitude float formats: the codec diffs them as ordered integers (ULP distance).
ORDERED_FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F8_E4M3", "F8_E5M2"})

_TORCH_NAMES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "bool": "BOOL",
}
_NUMPY_NAMES = {
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "bool": "BOOL",
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of ``dtype``; raises CorruptDataError for unknown names."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise CorruptDataError(f"unknown dtype {dtype!r}") from None


def from_torch_dtype(torch_dtype: Any) -> str:
    """The safetensors name of a ``torch.dtype``."""
    name = str(torch_dtype).removeprefix("torch.")
    if name not in _TORCH_NAMES:
        raise ConfigError(f"unsupported torch dtype {torch_dtype}")
    return _TORCH_NAMES[name]


def to_torch_dtype(dtype: str) -> Any:
    """The ``torch.dtype`` for a safetensors name (imports torch)."""
    import torch

    for torch_name, name in _TORCH_NAMES.items():
        if name == dtype:
            return getattr(torch, torch_name)
    raise ConfigError(f"unsupported dtype {dtype!r}")


def from_numpy_dtype(np_dtype: Any) -> str:
    """The safetensors name of a numpy dtype (bf16/fp8 have no numpy dtype: pass raw bytes)."""
    name = str(np_dtype)
    if name not in _NUMPY_NAMES:
        raise ConfigError(f"unsupported numpy dtype {np_dtype}")
    return _NUMPY_NAMES[name]
