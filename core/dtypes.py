"""The safetensors dtype names and their numpy counterparts (bf16 and fp8 via ml_dtypes),
and torch's names for them."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .errors import CorruptCheckpointError

_PLAIN = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
    "BOOL": np.bool_, "C64": np.complex64,
}
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
              "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu"}

SAFETENSORS_DTYPES = tuple(_PLAIN) + tuple(_ML_DTYPES)

# The safetensors name of each torch dtype that has one, by the dtype's name in torch
# (``torch.<name>``), for code that must not import torch.
TORCH_DTYPE_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL", "complex64": "C64",
}


@lru_cache(maxsize=None)
def _tables() -> tuple[dict[str, np.dtype], dict[np.dtype, str]]:
    to_numpy = {name: np.dtype(t) for name, t in _PLAIN.items()}
    try:
        import ml_dtypes
    except ImportError:  # bf16/fp8 files then fail with a message naming the package
        ml_dtypes = None
    if ml_dtypes is not None:
        for name, attr in _ML_DTYPES.items():
            if hasattr(ml_dtypes, attr):  # float8_e8m0fnu since ml_dtypes 0.5
                to_numpy[name] = np.dtype(getattr(ml_dtypes, attr))
    return to_numpy, {dt: name for name, dt in to_numpy.items()}


def to_numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a safetensors dtype name such as ``"BF16"``."""
    to_numpy, _ = _tables()
    if name in to_numpy:
        return to_numpy[name]
    if name in _ML_DTYPES:
        raise ImportError(f"dtype {name} needs the ml_dtypes package with {_ML_DTYPES[name]}: "
                          "pip install -U ml_dtypes")
    raise CorruptCheckpointError(f"unknown dtype {name!r} (known: {', '.join(SAFETENSORS_DTYPES)})")


def to_safetensors_dtype(dtype: np.dtype | str, where: str = "") -> str:
    """The safetensors name of a numpy dtype (or a safetensors name, checked); the
    refusal of a dtype without one starts with ``where`` (the entry's name), if given."""
    if isinstance(dtype, str) and dtype in SAFETENSORS_DTYPES:
        return dtype
    _, from_numpy = _tables()
    if isinstance(dtype, np.dtype) and dtype in from_numpy:  # once per tensor of a save: keep it short
        return from_numpy[dtype]
    dt = np.dtype(dtype).newbyteorder("=") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    try:
        return from_numpy[dt]
    except KeyError:
        raise TypeError(f"{where}{': ' if where else ''}dtype {dt} has no safetensors equivalent "
                        f"(supported: {', '.join(SAFETENSORS_DTYPES)})") from None
