"""CUDA tensors to and from the disk through pinned host memory, copies overlapped with I/O.

Saving, :class:`DeviceToHost` copies tensors off the device on a side stream into
buffers of a pinned pool registered with CUDA (``cudaHostRegister``), a window of
bytes ahead of the one being written, so that several copies are in flight and each
tensor is handed to the writer as soon as its own copy lands. Loading,
:func:`read_to_device` reads tensors into pinned buffers and starts each one's copy to
the device on a side stream as soon as its read (and checksum) is done, while later
reads are still in flight. Pinned buffers go back to the pool when the last array over
them is dropped, and the pool is reused from one save or load to the next.
"""

from __future__ import annotations

import threading
import weakref
from copy import deepcopy
from typing import Any, Callable, Iterable, Sequence, Union

import numpy as np
import torch

from ...buffers import PinnedPool
from ...errors import TensorferryError
from ...shard import ShardReader
from .tensors import FROM_SAFETENSORS, host_bytes, resolved

# Bytes of device-to-host copies issued ahead of the tensor being written, and of reads
# ahead of the copies to the device: enough to keep a drive and a PCIe link both busy.
DEFAULT_WINDOW = 512 << 20
_pool = PinnedPool(max_cached_bytes=2 * DEFAULT_WINDOW)

TensorSource = Union[torch.Tensor, Callable[[], torch.Tensor]]


def cuda_host_register(address: int, nbytes: int) -> Callable[[], None]:
    """Registers host memory with CUDA (``cudaHostRegister`` through torch's cudart);
    returns the function that unregisters it. Raises :class:`TensorferryError` on failure."""
    cudart = torch.cuda.cudart()
    _check_cuda(cudart, cudart.cudaHostRegister(address, nbytes, 0), f"cudaHostRegister of {nbytes} bytes")
    return lambda: _check_cuda(cudart, cudart.cudaHostUnregister(address), f"cudaHostUnregister of {nbytes} bytes")


def _check_cuda(cudart: Any, status: Any, what: str) -> None:
    if status != cudart.cudaError.success:
        raise TensorferryError(f"{what} failed: {status}")


def staging_pool() -> PinnedPool:
    """The pinned pool CUDA copies go through, registered with CUDA once CUDA is available."""
    if torch.cuda.is_available() and not _pool.registered:
        _pool.register_with(cuda_host_register)
    return _pool


def leased(pool: PinnedPool, nbytes: int, copies: list[Any] | None = None) -> np.ndarray:
    """A uint8 array of ``nbytes`` from ``pool`` that goes back to it once the last array
    (or tensor) over its memory is gone: writes in flight keep their buffers alive, so
    a buffer can never be reused under a write. CUDA events put in ``copies`` (copies
    into the buffer) are waited for before it goes back: a copy still landing in a
    buffer nobody holds any more (a save that failed) must not land in its next user's."""
    buffer = pool.acquire(nbytes)
    array = np.frombuffer(memoryview(buffer), np.uint8)
    # Views of ``array`` keep ``array`` (whose base is the memoryview) alive, never the pool's buffer itself.
    weakref.finalize(array.base, _give_back, pool, buffer, copies)
    return array


def _give_back(pool: PinnedPool, buffer: np.ndarray, copies: list[Any] | None) -> None:
    for event in copies or ():
        event.synchronize()
    pool.release(buffer)


class DeviceToHost:
    """Host bytes of tensors, copied off the device ahead of need.

    ``DeviceToHost(tensors, window)`` takes tensors, or callables that make them when
    their turn comes (a gathered shard, say). :meth:`source` ``(i)`` is a callable the
    :class:`tensorferry.ShardWriter` calls when it writes tensor ``i``: it starts the
    copies of the following tensors while under ``window`` bytes are in flight, waits
    for tensor ``i``'s copy alone, and returns its bytes. Tensors are copied in the
    order given, so give them in the order they will be written. CPU tensors pass
    through without a copy (made ahead too, as a lazy source may make them).

    ``copy`` starts one tensor's copy and returns ``(host bytes, wait)``; the default
    copies a CUDA tensor on a side stream (:func:`copy_to_host_async`).
    """

    def __init__(self, tensors: Sequence[TensorSource], window: int = DEFAULT_WINDOW, *,
                 pool: PinnedPool | None = None,
                 copy: Callable[[torch.Tensor, PinnedPool], tuple[np.ndarray, Callable[[], None]]] | None = None
                 ) -> None:
        self._items = list(tensors)
        self.window = window
        self._pool = pool
        self._copy = copy or copy_to_host_async
        self._started: dict[int, tuple[np.ndarray, Callable[[], None]]] = {}
        self._next = 0  # the next tensor to start, in order
        self._ahead = 0  # bytes started and not yet taken
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def source(self, index: int) -> Callable[[], np.ndarray]:
        """A callable returning tensor ``index``'s bytes (see the class doc)."""
        return lambda: self.take(index)

    def take(self, index: int) -> np.ndarray:
        """Tensor ``index``'s bytes, once copied; each tensor is taken once."""
        with self._lock:
            # A made item is None: started, or taken out of order before the window reached it.
            if self._items[index] is not None:
                self._start(index)
            while self._next < len(self._items) and self._ahead < self.window:
                if self._items[self._next] is not None:
                    self._start(self._next)
                self._next += 1
            if index not in self._started:
                raise KeyError(f"tensor {index} was already taken")
            host, wait = self._started.pop(index)
            self._ahead -= host.nbytes
        wait()
        return host

    def _start(self, index: int) -> None:
        item = self._items[index]
        self._items[index] = None  # its tensor is not kept beyond its copy
        tensor = (item() if callable(item) else item).detach()
        if tensor.device.type == "cpu":
            host, wait = host_bytes(tensor), _nothing
        else:
            host, wait = self._copy(tensor, self._pool if self._pool is not None else staging_pool())
        self._started[index] = (host, wait)
        self._ahead += host.nbytes


def _nothing() -> None:
    pass


_side_streams: dict[torch.device, Any] = {}
_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> Any:
    """One copy stream per CUDA device, kept for the process (streams are cheap to keep,
    and a new one per save would make each save's first copy wait on stream creation)."""
    with _streams_lock:
        stream = _side_streams.get(device)
        if stream is None:
            stream = _side_streams[device] = torch.cuda.Stream(device)
        return stream


def copy_to_host_async(tensor: torch.Tensor, pool: PinnedPool) -> tuple[np.ndarray, Callable[[], None]]:
    """Starts copying a CUDA tensor into a pinned buffer on the device's side stream, after
    the work already queued on its current stream (which made the tensor); returns the
    buffer and a function that waits for this copy alone."""
    tensor = resolved(tensor)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    copies: list[Any] = []
    host = leased(pool, tensor.numel() * tensor.element_size(), copies)
    if host.nbytes == 0:
        return host, _nothing
    stream = side_stream(tensor.device)
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        torch.from_numpy(host).copy_(tensor.reshape(-1).view(torch.uint8), non_blocking=True)
        tensor.record_stream(stream)  # the caching allocator keeps its memory until the copy is done
    done = torch.cuda.Event()
    done.record(stream)
    copies.append(done)
    return host, done.synchronize


def snapshot(tensors: Iterable[torch.Tensor], pool: PinnedPool | None = None) -> list[torch.Tensor]:
    """Host copies of tensors, all copies started before any is waited for: what an
    asynchronous save holds while its writes run (the training stall is these copies).
    CUDA tensors land in pinned pool buffers (returned to the pool when the copies are
    dropped); CPU tensors are cloned."""
    tensors = list(tensors)
    pool = pool if pool is not None else staging_pool()
    # The pool keeps a whole snapshot's buffers for the next one: allocating and
    # registering them anew would make every save's stall several times the copy's.
    held = sum(pool.size_class(t.numel() * t.element_size()) for t in tensors if t.device.type == "cuda")
    pool.max_cached_bytes = max(pool.max_cached_bytes, held + 2 * DEFAULT_WINDOW)
    started = []
    for t in tensors:
        t = t.detach()
        if t.device.type == "cuda":
            host, wait = copy_to_host_async(t, pool)
            started.append((t, host, wait))
        else:
            started.append((t, None, None))
    copies = []
    for t, host, wait in started:
        if host is None:
            copies.append(t.clone(memory_format=torch.contiguous_format))
            continue
        wait()
        copies.append(torch.from_numpy(host).view(t.dtype).reshape(t.shape))
    return copies


def stage_state_dict(state_dict: Any, pool: PinnedPool | None = None) -> Any:
    """The state dict with every tensor replaced by its host snapshot (:func:`snapshot`:
    every copy started before any is waited for); a DTensor keeps its mesh and placements
    around a host copy of its local shard. Other values are deep copies, as torch's own
    stager makes them: DCP pickles them on the background thread, after the training has
    gone on and changed them (a counter, a numpy array), which saved them of a later step
    than the tensors."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

    leaves, spec = tree_flatten(state_dict)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    local = [leaves[i].to_local() if isinstance(leaves[i], DTensor) else leaves[i] for i in positions]
    # An object that holds one of the state's tensors gets its snapshot, not a copy of its own.
    memo: dict[int, Any] = {}
    for i, staged in zip(positions, snapshot(local, pool)):
        leaf = leaves[i]
        if isinstance(leaf, DTensor):
            # As torch's own staging does: the same spec around a host local tensor
            # (DTensor.from_local would move it back to the mesh's device).
            staged = DTensor(staged, leaf._spec, requires_grad=False)
        memo[id(leaf)] = staged
        leaves[i] = staged
    tensors = set(positions)
    for i, leaf in enumerate(leaves):
        if i in tensors:
            continue
        try:
            leaves[i] = deepcopy(leaf, memo)
        except Exception as exc:
            where = keystr(tree_flatten_with_path(state_dict)[0][i][0])
            raise TypeError(f"state{where}: a {type(leaf).__name__} that cannot be copied, as a background save "
                            f"must copy it before training changes it: {exc}") from exc
    return tree_unflatten(leaves, spec)


def read_to_device(reader: ShardReader, names: Iterable[str], device: torch.device | str,
                   out: dict[str, torch.Tensor] | None = None, window: int = DEFAULT_WINDOW,
                   pool: PinnedPool | None = None) -> dict[str, torch.Tensor]:
    """Reads tensors of a shard file into CUDA tensors on ``device``: each read lands in a
    pinned buffer, is checked against its checksum (if the reader verifies), and its
    copy to the device starts on a side stream while later reads (up to ``window``
    bytes) are still in flight. A reader that does not verify, on an engine whose
    ``gds_mode`` is ``"gds"``, reads straight into device memory instead (checksums
    need the bytes on the host). Tensors named in ``out`` (contiguous CUDA tensors of
    the stored byte size) are filled in place. Returns once every tensor is in place."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"read_to_device reads to a CUDA device, not {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out = dict(out or {})
    names = sorted(dict.fromkeys([*names, *out]), key=lambda n: reader.info(n).begin)  # file order

    def destination(name: str) -> torch.Tensor:
        info = reader.info(name)
        target = out.get(name)
        if target is None:
            return torch.empty(info.shape, dtype=FROM_SAFETENSORS[info.dtype], device=device)
        if target.device != device or not target.is_contiguous() or \
                target.numel() * target.element_size() != info.nbytes:
            raise ValueError(f"{reader.path}: the destination of {name!r} must be a contiguous tensor of "
                             f"{info.nbytes} bytes on {device}")
        return target

    if not reader.verify and reader.engine.gds_mode == "gds":
        return _read_direct(reader, names, device, destination)
    pool = pool if pool is not None else staging_pool()
    stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # work the caller queued on the ``out`` tensors
    results: dict[str, torch.Tensor] = {}
    in_flight: list[tuple[str, np.ndarray, Any]] = []  # (name, pinned buffer, read future)
    copying: list[tuple[torch.cuda.Event, np.ndarray]] = []
    ahead = 0

    def land(name: str, host: np.ndarray, future: Any) -> None:
        future.result()
        if reader.verify:
            reader.check_checksum(name, host)
        target = destination(name)
        with torch.cuda.stream(stream):
            if host.nbytes:
                target.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(host), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        copying.append((done, host))  # the pinned buffer lives until its copy is over
        results[name] = target

    try:
        for name in names:
            info = reader.info(name)
            host = leased(pool, info.nbytes)
            in_flight.append((name, host, reader.pread(name, host)))
            ahead += info.nbytes
            while ahead > window and len(in_flight) > 1:
                first = in_flight.pop(0)
                ahead -= first[1].nbytes
                land(*first)
                copying[:] = [(e, h) for e, h in copying if not e.query()]
        while in_flight:
            land(*in_flight.pop(0))
    finally:
        for _, _, future in in_flight:
            future.wait()
        for event, _ in copying:
            event.synchronize()
    # The tensors were filled on the side stream: work the caller queues on its own
    # stream must come after those copies.
    torch.cuda.current_stream(device).wait_stream(stream)
    return results


def _read_direct(reader: ShardReader, names: list[str], device: torch.device,
                 destination: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPUDirect Storage: every tensor read by kvikio straight into its device memory."""
    # kvikio's DMA is not ordered with torch's streams: memory the caching allocator hands
    # out may still be in use by work queued before it was freed, so that work ends first.
    torch.cuda.current_stream(device).synchronize()
    results: dict[str, torch.Tensor] = {}
    futures = []
    try:
        for name in names:
            info = reader.info(name)
            results[name] = target = destination(name)
            if info.nbytes:
                # A uint8 view: bf16 and fp8 tensors have no __cuda_array_interface__.
                futures.append(reader.engine.pread(target.reshape(-1).view(torch.uint8), reader.path,
                                                   reader.data_start + info.begin, info.nbytes))
        for future in futures:
            future.result()
    finally:
        for future in futures:
            future.wait()  # kvikio's threads may still write into tensors an early raise would free
    return results


__all__ = ["DEFAULT_WINDOW", "DeviceToHost", "copy_to_host_async", "cuda_host_register", "leased",
           "read_to_device", "side_stream", "snapshot", "stage_state_dict", "staging_pool"]
