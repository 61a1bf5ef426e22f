"""A map-style torch Dataset over files or byte ranges, read through the core's FileSource.

On a CUDA device with GPUDirect Storage usable, items are read by kvikio straight into
device memory; on a CUDA device without it, into the core's pinned host buffers and then
copied with a non-blocking transfer; on the CPU, into host tensors that share the read
buffer. Reads of a whole batch (``__getitems__``, which ``DataLoader`` calls on torch >= 2.1)
are all issued before any is waited for.
"""

from __future__ import annotations

import errno
import operator
import os
import warnings
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate, get_worker_info

from ... import gds
from ...buffers import PinnedPool, pool_buffer
from ...config import default_config
from ...data import SLOT_ALIGNMENT, FileSource, Item
from ...engine import Engine
from ...errors import TensorferryIOError
from .staging import staging_pool


class GDSWorkerWarning(UserWarning):
    """A CUDA ``GDSDataset`` is read in DataLoader worker processes, so GDS is bypassed."""


_WORKER_WARNING = (
    "GDSDataset(device={device}) is being read in a DataLoader worker process; items come back "
    "as host tensors and GPUDirect Storage is bypassed. Workers are separate processes without "
    "the trainer's CUDA context (a forked child cannot use CUDA at all, and CUDA tensors made "
    "in a worker would have to cross processes through IPC), which is why a GDS reader run "
    "inside workers silently degrades to CPU bounce buffers. Use num_workers=0 for the GDS "
    "path (the batch's reads already run in parallel in the I/O engine), or keep workers and "
    "pass pin_memory=True, moving each batch to the device yourself.")


def _gds_usable(use_gds: bool | None = None) -> bool:
    """Whether reads to a CUDA device go through kvikio with cuFile: the engine's
    ``use_gds`` setting (``True`` raises where GDS cannot run, ``False`` says no) and
    what kvikio would do (its compatibility mode is left to the pinned-copy path, which
    reads with the core's engine)."""
    return gds.resolve_mode(use_gds) == "gds"


def _resolve_device(device: str | torch.device | int | None) -> torch.device:
    resolved = torch.device("cpu" if device is None else device)
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"GDSDataset reads to the CPU or a CUDA device, not {resolved}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"GDSDataset(device={str(resolved)!r}) needs CUDA, but torch.cuda.is_available() is "
            f"False (torch {torch.__version__} "
            f"{'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'}); "
            "use device=None for host tensors")
    if resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    if resolved.index >= torch.cuda.device_count():
        raise RuntimeError(f"GDSDataset(device={str(resolved)!r}): only {torch.cuda.device_count()} "
                           "CUDA devices are visible")
    return resolved


class GDSDataset(Dataset):
    """The bytes of files, or of ``(file, offset, length)`` records, as uint8 tensors.

    Args:
        items: paths (each a whole file, sized now) or ``(path, offset, length)``
            records. A missing file raises FileNotFoundError here; a record past the
            end of its file raises the engine's OSError (``errno.ENODATA``) when read.
        device: ``None`` or ``"cpu"`` for host tensors; a CUDA device for tensors on it,
            read through GPUDirect Storage when kvikio has it on and the engine's
            ``use_gds`` allows it (see :attr:`uses_gds`; ``use_gds=True`` raises where it
            cannot run), else through pinned host buffers and a non-blocking copy.
        transform: applied to each item's tensor; its result is what indexing returns.
        engine: the core :class:`Engine` for host reads (default: the process's
            :func:`default_engine`, looked up per read, so DataLoader workers each use
            their own, whether forked, spawned or started by a forkserver). An explicit
            engine cannot be used in worker processes: its I/O threads do not survive a
            fork, and it cannot be sent to a spawned process.
        pool: the pool host reads take buffers from (default: a new one of pageable
            buffers, or for a CUDA device the staging pool, locked and registered with CUDA).

    With ``num_workers > 0`` and a CUDA device, workers return host tensors and one
    :class:`GDSWorkerWarning` per worker process says why.

    Batches: the items of one ``__getitems__`` call of equal length (a multiple of 4 KiB)
    and without ``transform`` are rows of one ``[batch, length]`` tensor, read in place.
    ``DataLoader(..., collate_fn=GDSDataset.collate)`` hands that tensor out as the batch;
    ``default_collate`` would copy the rows into a new one (0.7-0.9 CPU-s/GB more on the
    development VM, where it lost 15-40% of the throughput too).
    """

    def __init__(self, items: Iterable[Item], *, device: str | torch.device | int | None = None,
                 transform: Callable[[torch.Tensor], Any] | None = None, engine: Engine | None = None,
                 pool: PinnedPool | None = None) -> None:
        self.device = _resolve_device(device)
        self.transform = transform
        if pool is None and self.device.type == "cuda":
            pool = staging_pool()  # registered with CUDA: the copies to the device are asynchronous DMA
        self._source = FileSource(items, engine=engine, pool=pool)
        # The process an explicit engine belongs to, to refuse its use after a fork.
        self._engine_pid = os.getpid() if engine is not None else None
        use_gds = (engine.config if engine is not None else default_config()).use_gds
        self.uses_gds = self.device.type == "cuda" and _gds_usable(use_gds)
        self._cufiles: dict[str, Any] = {}
        # Host buffers of non-blocking copies in flight, with the event that marks their
        # end: the copy reads them after the call returns, so they are kept until then.
        self._copying: list[tuple[torch.cuda.Event, list[np.ndarray]]] = []
        self._warned_worker = False

    @property
    def records(self) -> Sequence[tuple[str, int, int]]:
        """Each item as ``(path, offset, length)``."""
        return self._source.records

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The items at ``indices``, their reads all issued before any is waited for."""
        indices = list(indices)
        if self._engine_pid is not None and self._engine_pid != os.getpid():
            raise RuntimeError("GDSDataset was given an explicit engine, which cannot be used in a "
                               "forked process (a DataLoader worker); leave engine=None so that each "
                               "process uses its own default engine")
        if self.device.type == "cuda" and get_worker_info() is not None:
            self._warn_worker()
            tensors = self._read_host(indices)
        elif self.uses_gds:
            tensors = self._read_gds(indices)
        elif self.device.type == "cuda":
            tensors = self._read_copied(indices)
        else:
            tensors = self._read_host(indices)
        if self.transform is None:
            return tensors
        return [self.transform(t) for t in tensors]

    @staticmethod
    def collate(items: list[Any]) -> Any:
        """A ``collate_fn`` that hands out rows of one tensor (what ``__getitems__`` reads
        for a batch of equal records) as that tensor, without a copy; anything else goes
        to torch's ``default_collate``."""
        first = items[0] if items else None
        if isinstance(first, torch.Tensor) and first.is_contiguous() and first.numel():
            storage, step = first.untyped_storage(), first.numel()
            if all(isinstance(t, torch.Tensor) and t.is_contiguous() and t.shape == first.shape
                   and t.dtype == first.dtype and t.device == first.device
                   and t.untyped_storage().data_ptr() == storage.data_ptr()
                   and t.storage_offset() == first.storage_offset() + i * step for i, t in enumerate(items)):
                batch = torch.empty(0, dtype=first.dtype, device=first.device)
                return batch.set_(storage, first.storage_offset(), (len(items), *first.shape))
        return default_collate(items)

    def close(self) -> None:
        """Closes the kvikio file handles of the GDS path (reopened if read again)."""
        for handle in self._cufiles.values():
            handle.close()
        self._cufiles.clear()

    def __repr__(self) -> str:
        path = "gds" if self.uses_gds else "host"
        return f"<tensorferry GDSDataset {len(self)} items device={self.device} path={path}>"

    def __getstate__(self) -> dict[str, Any]:
        # What a DataLoader worker started by spawn or forkserver receives: the items and
        # settings; kvikio handles, copies in flight and the pinned pool stay here (the
        # worker reads into host buffers of its own, as a forked one does). FileSource
        # refuses to travel with an explicit engine.
        return {**self.__dict__, "_cufiles": {}, "_copying": [], "_warned_worker": False}

    def _warn_worker(self) -> None:
        # Each worker is its own process holding its own copy of this flag: once per worker.
        if not self._warned_worker:
            self._warned_worker = True
            warnings.warn(_WORKER_WARNING.format(device=self.device), GDSWorkerWarning, stacklevel=3)

    def _read_host(self, indices: list[int]) -> list[torch.Tensor]:
        # The arrays belong to the caller (FileSource's contract), so the tensors can
        # share them without a copy.
        arrays = self._source.read_batch(indices)
        batch = self._as_batch(arrays)
        if batch is not None:
            return list(torch.from_numpy(batch).unbind(0))
        return [torch.from_numpy(array) for array in arrays]

    def _as_batch(self, arrays: list[np.ndarray]) -> np.ndarray | None:
        """``arrays`` as the rows of one matrix, where read_batch placed them so: equal
        lengths of whole slots, one after another in one buffer (and no transform, which
        could make anything of them)."""
        if self.transform is not None or len(arrays) < 2:
            return None
        length = len(arrays[0])
        if not length or length % SLOT_ALIGNMENT or any(len(a) != length for a in arrays):
            return None
        buffer = pool_buffer(arrays[0])
        start = buffer.ctypes.data
        if any(pool_buffer(a) is not buffer or a.ctypes.data != start + i * length for i, a in enumerate(arrays)):
            return None
        return buffer[:len(arrays) * length].reshape(len(arrays), length)

    def _read_copied(self, indices: list[int]) -> list[torch.Tensor]:
        self._release_copied()
        arrays = self._source.read_batch(indices)
        batch = self._as_batch(arrays)
        if batch is not None:  # one copy, and rows of one device tensor (for collate)
            tensors = list(torch.from_numpy(batch).to(self.device, non_blocking=True).unbind(0))
        else:
            tensors = [torch.from_numpy(a).to(self.device, non_blocking=True) for a in arrays]
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._copying.append((event, arrays))
        return tensors

    def _release_copied(self) -> None:
        """Gives the pool back the host buffers whose copies to the device have ended."""
        pending = []
        for event, arrays in self._copying:
            if event.query():
                for array in arrays:
                    self._source.release(array)
            else:
                pending.append((event, arrays))
        self._copying = pending

    def _read_gds(self, indices: list[int]) -> list[torch.Tensor]:
        import kvikio

        records = [self._source.records[operator.index(i)] for i in indices]
        tensors = [torch.empty(length, dtype=torch.uint8, device=self.device) for _, _, length in records]
        reads: list[Any] = []
        for path, offset, length in records:
            try:
                handle = self._cufiles.get(path)
                if handle is None:
                    handle = self._cufiles[path] = kvikio.CuFile(path, "r")
                reads.append(handle.pread(tensors[len(reads)], length, offset))
            except Exception as exc:  # noqa: BLE001 - kept and raised once the others are done
                reads.append(exc)
        # Every read is waited for before anything is raised: kvikio's threads may still
        # be writing into the tensors of the others, which an early raise would free.
        errors: list[BaseException] = []
        for (path, offset, length), read in zip(records, reads):
            if isinstance(read, Exception):
                errors.append(read)
                continue
            try:
                done = read.get()
            except Exception as exc:  # noqa: BLE001 - as above
                errors.append(exc)
                continue
            if done != length:
                # What the engine raises for a record that runs past the end of its file.
                errors.append(TensorferryIOError(errno.ENODATA, f"read past end of file ({done} bytes read)", path,
                                                 offset, length))
        if errors:
            raise errors[0]
        return tensors


__all__ = ["GDSDataset", "GDSWorkerWarning"]
