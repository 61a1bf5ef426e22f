"""Torch tensors to and from the byte buffers the core reads and writes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...dtypes import TORCH_DTYPE_NAMES, to_numpy_dtype

TO_SAFETENSORS = {getattr(torch, name): safetensors for name, safetensors in TORCH_DTYPE_NAMES.items()
                  if hasattr(torch, name)}  # float8_e8m0fnu since torch 2.7
FROM_SAFETENSORS = {name: dtype for dtype, name in TO_SAFETENSORS.items()}


def safetensors_dtype(dtype: torch.dtype, where: str = "") -> str:
    """The safetensors name of a torch dtype; the refusal of one without a name starts
    with ``where`` (the entry's name), if given."""
    try:
        return TO_SAFETENSORS[dtype]
    except KeyError:
        raise TypeError(f"{where}{': ' if where else ''}torch dtype {dtype} has no safetensors equivalent "
                        f"(supported: {', '.join(map(str, TO_SAFETENSORS))})") from None


def refuse_wrapper_subclass(tensor: torch.Tensor, where: str) -> None:
    """Refuses a tensor subclass that wraps other tensors (torchao's), whose bytes are not its own."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and tensor.device.type != "meta":
        try:
            tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # torch's "invalid python storage"
            raise TypeError(f"{where} is a {type(tensor).__name__}, a tensor subclass that wraps other tensors "
                            "(as torchao's quantized and float8 tensors do) and holds no bytes of its own: save "
                            "the tensors it wraps, or a plain tensor made from it (dequantize it first)") from None


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's elements as a contiguous uint8 array in host memory (no copy when
    the tensor is already contiguous on the CPU).

    A CUDA tensor is copied into page-locked memory from torch's caching host allocator
    (reused from one tensor to the next): the copy runs at full PCIe speed, and the
    page-aligned result is written with O_DIRECT without a staging copy."""
    t = resolved(tensor.detach())
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        t = host
    elif t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def resolved(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values in memory: a lazy conjugate (``x.conj()`` of a complex tensor)
    or negation (``x.conj().imag``) is applied, as no raw view of its bytes can be taken
    before it is (a copy for those alone)."""
    return tensor.resolve_conj().resolve_neg()


# Integers of each width, through which torch takes arrays of dtypes it does not know
# from numpy (ml_dtypes' bf16 and fp8) before viewing them as its own.
_SAME_WIDTH = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def from_array(array: np.ndarray, dtype_name: str) -> torch.Tensor:
    """A tensor sharing the memory of an array read by the core (bf16 and fp8 included)."""
    dtype = FROM_SAFETENSORS[dtype_name]
    if array.dtype.isbuiltin == 1:  # numpy's own dtypes (2: user-defined): torch takes the array as it is
        tensor = torch.from_numpy(array)
        if tensor.dtype == dtype:
            return tensor
    return torch.from_numpy(array.view(_SAME_WIDTH[array.itemsize])).view(dtype)


def host_array(tensor: torch.Tensor, *, writable: bool = False, where: str = "") -> np.ndarray:
    """The tensor as a numpy array of its safetensors dtype (ml_dtypes' for bf16 and fp8),
    which the core reads and writes without knowing torch; with ``writable``, over the
    tensor's own memory, for reads into it. A refusal starts with ``where`` (the entry), if given."""
    if writable:
        lazy = tensor.is_conj() or tensor.is_neg()
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or lazy:
            raise ValueError(f"{where}{': ' if where else ''}can read in place only into a contiguous CPU tensor, "
                             f"got one on {tensor.device}{'' if tensor.is_contiguous() else ' (not contiguous)'}"
                             f"{' (a lazy conjugate or negation: resolve_conj()/resolve_neg() it)' if lazy else ''}")
    raw = writable_bytes(tensor) if writable else host_bytes(tensor)
    return raw.view(to_numpy_dtype(safetensors_dtype(tensor.dtype, where))).reshape(tensor.shape)


def writable_bytes(tensor: torch.Tensor) -> Any:
    """The tensor's memory as a writable uint8 array, for reads straight into it."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


__all__ = ["FROM_SAFETENSORS", "TO_SAFETENSORS", "from_array", "host_array", "host_bytes", "refuse_wrapper_subclass",
           "resolved", "safetensors_dtype", "to_numpy_dtype", "writable_bytes"]
