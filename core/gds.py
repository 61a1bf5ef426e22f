"""Device memory for the engine: kvikio's ``CuFile`` (GPUDirect Storage, or kvikio's own
compatibility mode where cuFile cannot run) behind the engine's futures.

Nothing here imports kvikio until a device buffer or ``use_gds=True`` asks for it, so
``import tensorferry`` stays numpy-only. Which path runs is a mode the engine reports:

- ``"gds"``: kvikio with cuFile, DMA between the drive and device memory;
- ``"compat"``: kvikio in compatibility mode (POSIX I/O through kvikio's own pinned
  bounce buffers), because cuFile is missing or refused (no nvidia-fs, a filesystem
  GDS does not support, ``KVIKIO_COMPAT_MODE=ON``);
- ``"off"``: no kvikio, or ``use_gds=False``: device buffers are refused with an error
  that says what to do.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any, Callable

from .errors import ConfigError, GDSUnavailableError

GDS_EXTRA = "pip install 'tensorferry[gds-cu13]' (CUDA 13) or 'tensorferry[gds-cu12]' (CUDA 12)"
GDS_MODES = ("gds", "compat", "off")

# DLPack device types (dlpack.h): host kinds, and the kinds whose memory CUDA owns.
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
_HOST_DEVICES = (KDL_CPU, KDL_CUDA_HOST)
_CUDA_DEVICES = (KDL_CUDA, KDL_CUDA_MANAGED)


def is_device_buffer(buffer: Any) -> bool:
    """Whether ``buffer`` lives in CUDA device memory (a DLPack device of type CUDA or
    CUDA-managed, or else a ``__cuda_array_interface__``). Host memory, pinned host
    memory included, is not. Memory of any other accelerator raises TypeError."""
    if isinstance(buffer, (bytes, bytearray, memoryview)):
        return False
    if hasattr(buffer, "__dlpack_device__"):
        kind = int(buffer.__dlpack_device__()[0])
        if kind in _CUDA_DEVICES:
            return True
        if kind not in _HOST_DEVICES:
            raise TypeError(f"{type(buffer).__name__} lives on DLPack device type {kind}; tensorferry reads "
                            "and writes host memory and CUDA device memory only")
        return False
    return _cuda_interface(buffer) is not None


def _cuda_interface(buffer: Any) -> dict[str, Any] | None:
    try:
        return buffer.__cuda_array_interface__
    except AttributeError:
        return None
    except (KeyError, TypeError, ValueError, RuntimeError):
        # torch raises these for device tensors it cannot describe so (bf16, fp8, a
        # tensor that requires grad): device memory all the same.
        return {}


def device_nbytes(buffer: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of a C-contiguous device buffer, from its
    ``__cuda_array_interface__``, or for a tensor that has none for its dtype (torch's
    bf16 and fp8) from ``data_ptr()`` and ``nbytes``. Raises ValueError if strided,
    TypeError if neither describes it."""
    interface = _cuda_interface(buffer)
    if not interface:
        if callable(getattr(buffer, "data_ptr", None)) and callable(getattr(buffer, "is_contiguous", None)):
            if not buffer.is_contiguous():
                raise ValueError(f"{type(buffer).__name__} is not contiguous; pass a contiguous copy")
            return int(buffer.data_ptr()), int(buffer.nbytes)
        raise TypeError(f"{type(buffer).__name__} is device memory without __cuda_array_interface__; "
                        "kvikio needs it (torch, cupy, numba and jax CUDA arrays have it)")
    shape = tuple(interface["shape"])
    itemsize = int(interface["typestr"][2:])
    strides = interface.get("strides")
    if strides is not None:
        expected, step = [], itemsize
        for dim in reversed(shape):
            expected.append(step)
            step *= dim
        if any(d > 1 and s != e for d, s, e in zip(shape, strides, reversed(expected))):
            raise ValueError(f"{type(buffer).__name__} is not C-contiguous (strides {tuple(strides)}); "
                             "pass a contiguous copy")
    count = 1
    for dim in shape:
        count *= dim
    return int(interface["data"][0]), count * itemsize


class DeviceBytes:
    """A range of device memory as kvikio takes it (a uint8 ``__cuda_array_interface__``),
    keeping its owner alive: kvikio cannot describe every dtype (bf16, fp8), bytes it can."""

    __slots__ = ("owner", "address", "nbytes")

    def __init__(self, owner: Any, address: int, nbytes: int) -> None:
        self.owner, self.address, self.nbytes = owner, address, nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "strides": None,
                "version": 3}


_kvikio_lock = threading.Lock()
_kvikio_loaded: list[Any] = []  # [module or None], once tried


def load_kvikio() -> Any:
    """The kvikio module, or None where it is not installed (tried once per process)."""
    with _kvikio_lock:
        if not _kvikio_loaded:
            try:
                import kvikio
                import kvikio.defaults  # noqa: F401
            except ImportError:
                kvikio = None
            _kvikio_loaded.append(kvikio)
        return _kvikio_loaded[0]


def kvikio_mode(kvikio: Any) -> str:
    """``"compat"`` where kvikio would take its compatibility path, else ``"gds"``."""
    defaults = kvikio.defaults
    # kvikio >= 24.12 resolves AUTO to what it would really do; older ones have only a bool.
    if hasattr(defaults, "is_compat_mode_preferred"):
        return "compat" if defaults.is_compat_mode_preferred() else "gds"
    return "compat" if defaults.compat_mode() else "gds"


def resolve_mode(use_gds: bool | None, load: Callable[[], Any] | None = None) -> str:
    """The mode an engine with ``use_gds`` runs device buffers in (see the module doc).

    ``None`` (auto) takes what is there; ``True`` requires GPUDirect Storage and raises
    :class:`GDSUnavailableError` (naming the extra) without kvikio, or
    :class:`ConfigError` where kvikio would fall back to its compatibility mode;
    ``False`` turns device I/O off.
    """
    if use_gds is False:
        return "off"
    kvikio = (load or load_kvikio)()
    if kvikio is None:
        if use_gds:
            raise GDSUnavailableError(f"use_gds=True needs kvikio, which is not installed: {GDS_EXTRA}")
        return "off"
    mode = kvikio_mode(kvikio)
    if use_gds and mode != "gds":
        raise ConfigError("use_gds=True, but kvikio would run in compatibility mode (cuFile unusable here: "
                          "no nvidia-fs driver, an unsupported filesystem, or KVIKIO_COMPAT_MODE=ON); "
                          "use use_gds=None to accept that path, or False for host I/O only")
    return mode


def refusal(mode_reason: str) -> GDSUnavailableError:
    """The error for a device buffer given to an engine whose mode is ``"off"``."""
    return GDSUnavailableError(f"device buffers go through kvikio, and {mode_reason}; "
                               "or copy the data to host memory first")


class CuFileRequest:
    """One kvikio read or write, with the interface :class:`tensorferry.IOFuture` expects
    of a native request (``nbytes``, ``done``, ``wait``, ``failed``, ``error``)."""

    __slots__ = ("nbytes", "_offset", "_what", "_future", "_outcome")

    def __init__(self, start: Callable[[], Any], nbytes: int, offset: int, what: str) -> None:
        self.nbytes, self._offset, self._what = nbytes, offset, what
        self._outcome: tuple[int, str] | None = None  # (errno, message) of a failure, or (0, "")
        try:
            self._future = start()
        except Exception as exc:  # noqa: BLE001 - kvikio raises RuntimeError for cuFile errors
            self._future = None
            self._outcome = (_errno_of(exc), f"{what}: {exc}")

    def done(self) -> bool:
        return self._outcome is not None or self._future.done()

    def cancel(self) -> None:
        """Nothing: kvikio's I/O cannot be stopped once started; it finishes."""

    def wait(self, timeout: float) -> bool:
        if self._outcome is None:
            if timeout >= 0:
                deadline = time.monotonic() + timeout
                while not self._future.done():
                    if time.monotonic() >= deadline:
                        return False
                    time.sleep(0.0005)
            try:
                moved = self._future.get()  # once only: kvikio's future is a std::future
            except Exception as exc:  # noqa: BLE001 - as above
                self._outcome = (_errno_of(exc), f"{self._what}: {exc}")
            else:
                short = moved != self.nbytes
                self._outcome = (errno.ENODATA if short else 0,
                                 f"{self._what}: {moved} of {self.nbytes} bytes" if short else "")
        return True

    @property
    def failed(self) -> bool:
        return bool(self._outcome and self._outcome[0])

    @property
    def error(self) -> tuple[int, str, int, int]:
        err, message = self._outcome
        return err, message, self._offset, self.nbytes


def _errno_of(exc: BaseException) -> int:
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    # kvikio's compatibility mode reports a read past the end as a RuntimeError
    # ("POSIX error on pread: EOF"): a short read, as the host engine names it.
    return errno.ENODATA if ": EOF" in str(exc) else errno.EIO


class CuFileCache:
    """kvikio file handles of one engine, by file identity and direction: registering a
    file with cuFile costs far more than a small read, so handles are reused until the
    engine closes (a file replaced under the same name gets a new handle)."""

    def __init__(self, kvikio: Any) -> None:
        self._kvikio = kvikio
        self._handles: dict[tuple[int, int, bool], Any] = {}
        self._lock = threading.Lock()

    def handle(self, path: str, writable: bool) -> Any:
        if writable:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666))  # created if missing, never truncated
        info = os.stat(path)
        key = (info.st_dev, info.st_ino, writable)
        with self._lock:
            handle = self._handles.get(key)
            if handle is None:
                handle = self._handles[key] = self._kvikio.CuFile(path, "r+" if writable else "r")
            return handle

    def close(self) -> None:
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()


__all__ = ["GDS_EXTRA", "GDS_MODES", "CuFileCache", "CuFileRequest", "DeviceBytes", "device_nbytes", "is_device_buffer",
           "kvikio_mode", "load_kvikio", "resolve_mode"]
