"""Host memory for I/O: page-aligned, page-locked where allowed, pooled and reused."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any, Callable

import numpy as np

from . import _native
from .errors import ConfigError

_warned_unlocked = False

# DLPack device types that live in host memory: kDLCPU and kDLCUDAHost (pinned).
_HOST_DLPACK_DEVICES = (1, 3)


class PinnedMemoryWarning(UserWarning):
    """Page-locking was refused (RLIMIT_MEMLOCK); the buffer is aligned but pageable."""


def alloc_pinned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array, locked in RAM when RLIMIT_MEMLOCK allows.

    Without permission to lock, the memory is still aligned for O_DIRECT and one
    :class:`PinnedMemoryWarning` is given per process. Use it from torch without a
    copy as ``torch.from_numpy(buf)``.
    """
    if nbytes < 0:
        raise ConfigError(f"nbytes must not be negative, got {nbytes}")
    array, locked = _native.alloc_pinned(int(nbytes))
    if not locked:
        global _warned_unlocked
        if not _warned_unlocked:
            _warned_unlocked = True
            warnings.warn(
                f"could not page-lock {nbytes} bytes (RLIMIT_MEMLOCK too low?); using aligned, "
                "pageable memory instead. Raise `ulimit -l` for pinned buffers.",
                PinnedMemoryWarning, stacklevel=2)
    return array


def _torch_bytes(tensor: Any) -> np.ndarray | None:
    """A contiguous torch tensor of a dtype numpy has no DLPack import for (bf16, fp8):
    its bytes, through torch's own uint8 view; None for anything else."""
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is imported
    if torch is None or not isinstance(tensor, torch.Tensor):
        return None
    if not tensor.is_contiguous():
        raise ValueError("buffer is not C-contiguous; pass a contiguous copy")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _refuse_lazy_torch_view(buffer: Any) -> None:
    """Refuses a torch tensor whose values are not its bytes: a lazy negation
    (``torch._neg_view``, ``x.conj().imag``) or conjugation (``x.conj()``) carries a bit
    that DLPack does not, so its bytes would be written (or read into) with the wrong sign."""
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is imported
    if torch is None or not isinstance(buffer, torch.Tensor):
        return
    if buffer.is_neg() or buffer.is_conj():
        raise ValueError("the tensor is a lazy negation or conjugation, whose memory holds other values than "
                         "it shows: call resolve_neg() / resolve_conj() on it first (a copy)")


def byte_view(buffer: Any, *, writable: bool) -> np.ndarray:
    """A zero-copy, contiguous uint8 view of a host buffer.

    Accepts numpy arrays, anything with the buffer protocol (bytes, bytearray,
    memoryview, mmap) and DLPack producers on the host (torch CPU tensors, jax
    arrays). Raises TypeError for device memory and ValueError for memory that is
    not contiguous or, where ``writable`` is asked, read-only, and for a torch tensor
    whose lazy negation or conjugation bit is set (no copy is made silently).
    """
    _refuse_lazy_torch_view(buffer)
    if isinstance(buffer, np.ndarray):
        array = buffer
    elif hasattr(buffer, "__dlpack__") and not isinstance(buffer, (bytes, bytearray, memoryview)):
        device = int(buffer.__dlpack_device__()[0])
        if device not in _HOST_DLPACK_DEVICES:
            raise TypeError(
                f"{type(buffer).__name__} lives in device memory (DLPack device {device}); "
                "host I/O needs host memory: copy it to the host or use the GDS path")
        try:
            array = np.from_dlpack(buffer)
        except (BufferError, RuntimeError, TypeError) as exc:  # "Unsupported dtype in DLTensor"
            array = _torch_bytes(buffer)
            if array is None:
                raise TypeError(f"numpy cannot take this {type(buffer).__name__}'s memory: {exc}") from None
        if writable and not array.flags.writeable and callable(getattr(buffer, "numpy", None)):
            # torch before 2.8 exports an unversioned DLPack capsule, which numpy imports
            # read-only; its numpy() is the same memory, writable.
            try:
                array = (buffer.detach() if hasattr(buffer, "detach") else buffer).numpy()
            except (TypeError, RuntimeError):
                pass  # no numpy dtype for it (bf16): read-only stays the answer
    else:
        try:
            array = np.frombuffer(memoryview(buffer), dtype=np.uint8)
        except TypeError:
            raise TypeError(f"{type(buffer).__name__} has neither the buffer protocol nor DLPack") from None
        except ValueError as exc:
            raise ValueError(f"buffer is not contiguous: {exc}") from None
    if not array.flags.c_contiguous:
        raise ValueError("buffer is not C-contiguous; pass a contiguous copy")
    if writable and not array.flags.writeable:
        raise ValueError(f"{type(buffer).__name__} is read-only and cannot receive data")
    return array.reshape(-1).view(np.uint8)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def pool_buffer(array: np.ndarray) -> np.ndarray:
    """The buffer that ``array``, handed out by a :class:`PinnedPool` (a view of it, or
    a view of one of its views), lies in; ``array`` itself if it is one."""
    return array.base if isinstance(array.base, np.ndarray) else array


HostRegister = Callable[[int, int], Callable[[], None]]
"""Registers ``(address, nbytes)`` of host memory with a device runtime (``cudaHostRegister``)
and returns the function that unregisters it."""


class PinnedPool:
    """A bounded cache of pinned buffers, reused by size class (powers of two).

    ``acquire(n)`` returns a buffer of at least ``n`` bytes; ``release(buf)`` gives it
    back. Released buffers are kept while the cache holds under ``max_cached_bytes``.

    With ``register`` (or after :meth:`register_with`), every buffer of the pool is
    also registered with the device runtime (the PyTorch adapter passes
    ``cudaHostRegister`` through ``torch.cuda.cudart()``), so that copies between it
    and device memory are asynchronous DMA rather than staged by the driver. A buffer
    is unregistered when the pool drops it (on a release past the cap, or ``clear``);
    one acquired and never released stays registered, so give buffers back.

    ``lock=False`` leaves the buffers pageable (page-aligned all the same): what host-only
    I/O wants, since O_DIRECT pins the pages of each transfer itself; such a pool gives
    no :class:`PinnedMemoryWarning` where ``RLIMIT_MEMLOCK`` forbids locking.
    """

    def __init__(self, max_cached_bytes: int = 256 << 20, *, register: HostRegister | None = None,
                 lock: bool = True) -> None:
        self.max_cached_bytes = max_cached_bytes
        self.page_locked = lock
        self._free: dict[int, list[np.ndarray]] = {}
        self._leased: set[int] = set()  # addresses of the buffers handed out and not yet given back
        self._cached = 0
        self._lock = threading.Lock()
        self._register = register
        self._unregister: dict[int, Callable[[], None]] = {}  # base address: its unregistration
        # Registration belongs to the process that asked for it: a forked child (a
        # DataLoader worker) cannot use the parent's CUDA context, so it registers nothing.
        self._register_pid = os.getpid()

    def register_with(self, register: HostRegister) -> None:
        """Registers the idle buffers, and every buffer made or given back from now on,
        through ``register``. Calling it again with the same function does nothing; a
        pool registers with one runtime only."""
        with self._lock:
            if self._register is register:
                return
            if self._register is not None:
                raise ConfigError("this pool is already registered with another device runtime")
            self._register = register
            self._register_pid = os.getpid()
            for buffers in self._free.values():
                for base in buffers:
                    self._ensure_registered(base)

    @property
    def registered(self) -> bool:
        """Whether the pool registers its buffers with a device runtime."""
        return self._register is not None and self._register_pid == os.getpid()

    def _ensure_registered(self, base: np.ndarray) -> None:
        address = base.ctypes.data
        if self.registered and address not in self._unregister:
            self._unregister[address] = self._register(address, base.nbytes)

    def _drop(self, base: np.ndarray) -> None:
        unregister = self._unregister.pop(base.ctypes.data, None)
        if unregister is not None and self._register_pid == os.getpid():
            unregister()  # before the memory can be freed

    @staticmethod
    def size_class(nbytes: int) -> int:
        """The bytes a buffer of ``nbytes`` really takes from the pool (a power of two, >= 4 KiB)."""
        return max(4096, 1 << (max(nbytes, 1) - 1).bit_length())

    def acquire(self, nbytes: int, *, exact: bool = False) -> np.ndarray:
        """A page-aligned uint8 buffer of exactly ``nbytes`` (a view into its size class; with
        ``exact``, into a buffer of ``nbytes`` rounded up to the page, which only a request
        of the same rounded size reuses: for memory that is mostly handed away, where a
        size class would cost up to twice the memory)."""
        if nbytes < 0:
            raise ValueError(f"cannot acquire a buffer of {nbytes} bytes")
        size = round_up(max(nbytes, 1), 4096) if exact else self.size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                base = free.pop()
                self._cached -= size
                self._leased.add(base.ctypes.data)
                return base[:nbytes]
        if self.page_locked:
            base = alloc_pinned(size)
        else:
            base = _native.alloc_pinned(size, lock=False)[0]
            # Faulted in at once, as mlock does: cheaper than page by page as reads land
            # (measured, 1 MiB reads: 0.10-0.16 s of system time per GB against 0.15-0.18).
            _native.populate(base.ctypes.data, base.nbytes)
        with self._lock:
            self._ensure_registered(base)
            self._leased.add(base.ctypes.data)
        return base[:nbytes]

    def release(self, buffer: np.ndarray) -> None:
        """Returns a buffer from :meth:`acquire` to the pool (dropped if the pool is full).
        One released twice, or never acquired here, is a ``ValueError``: cached twice, it
        would be handed to two users at once."""
        base = pool_buffer(buffer)
        size = base.nbytes
        with self._lock:
            if base.ctypes.data not in self._leased:
                raise ValueError("release() of a buffer this pool did not hand out, or has back already")
            self._leased.discard(base.ctypes.data)
            if self._cached + size <= self.max_cached_bytes:
                self._ensure_registered(base)
                self._free.setdefault(size, []).append(base)
                self._cached += size
            else:
                self._drop(base)

    @property
    def cached_bytes(self) -> int:
        """Bytes held by idle buffers."""
        return self._cached

    def clear(self) -> None:
        """Frees every idle buffer."""
        with self._lock:
            for buffers in self._free.values():
                for base in buffers:
                    self._drop(base)
            self._free.clear()
            self._cached = 0
