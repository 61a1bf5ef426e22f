"""NVMe offload for PyTorch: optimizer state between steps, and weights streamed layer by layer.

Both build on :class:`tensorferry.OffloadStore`, for parameters on the CPU or on one CUDA
device. On CUDA, data moves between the drive and page-locked host memory (torch's pinned
allocator), and between that and the device on side streams, so that transfers overlap
the kernels on the current stream.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import errno
import inspect
import math
import os
import shutil
import sys
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from ...buffers import round_up
from ...engine import Engine, IOFuture, PathLike
from ...errors import CorruptCheckpointError, TensorferryIOError
from ...offload import OffloadStore
from ...shard import aligned_empty

_PAGE = 4096
# Memory on the host (an array, or a pinned tensor for CUDA copies) or a uint8 device tensor.
_Buffer = np.ndarray | torch.Tensor
# Tensors inside a region start on torch's own allocation alignment, so that vectorised
# kernels see the same alignment as they would on tensors torch allocated itself.
_ALIGN = 64


def _unshared(region: np.ndarray) -> bool:
    """Whether no array or tensor but ``region`` itself uses its memory. Views of a view
    name the memory's owner as their base (numpy collapses the chain), so the owner's
    references are counted: ``region.base`` and the call's argument."""
    owner = region.base
    return owner is not None and sys.getrefcount(owner) == 2


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _view(buffer: _Buffer, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``buffer[offset:]`` (a host array or a uint8
    tensor on any device), sharing its memory."""
    nbytes = math.prod(shape) * dtype.itemsize
    window = buffer[offset:offset + nbytes]
    return (torch.from_numpy(window) if isinstance(window, np.ndarray) else window).view(dtype).reshape(shape)


def _address(buffer: _Buffer) -> int:
    return buffer.ctypes.data if isinstance(buffer, np.ndarray) else buffer.data_ptr()


def _one_device(params: Iterable[torch.Tensor], what: str) -> torch.device:
    """The device that all of ``params`` are on: the CPU or one CUDA device."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"{what} needs every parameter on one device; got parameters on "
                         f"{', '.join(sorted(map(str, devices)))}")
    device = devices.pop() if devices else torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} handles parameters on the CPU or a CUDA device; got one on {device}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _pinned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` of page-locked host memory from torch's pinned allocator,
    starting on a page boundary (O_DIRECT): what an asynchronous copy to or from a CUDA
    device needs. It is a view of torch's allocation, so the allocator sees the copies that
    use it and, once it is freed, holds the memory until they are done; then it reuses it,
    so steady streaming allocates no new pinned memory."""
    pinned = torch.empty(nbytes + _PAGE, dtype=torch.uint8, pin_memory=True)
    start = -pinned.data_ptr() % _PAGE
    return pinned[start:start + nbytes]


def _host_array(buffer: _Buffer) -> np.ndarray:
    """Host memory as the store takes it (the array keeps a tensor's memory alive)."""
    return buffer if isinstance(buffer, np.ndarray) else buffer.numpy()


class _CopyStreams:
    """Side streams for moving data between pinned host memory and one CUDA device.

    Host to device runs on ``upload``, device to host on ``download``; each copy is
    ordered against the current stream with events, so it overlaps the kernels queued
    there instead of waiting for them. Device memory made here is allocated on the upload
    stream and marked as used by the current one, so the caching allocator neither hands
    it out again before the kernels reading it have run nor before a download of it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.upload = torch.cuda.Stream(device)
        self.download = torch.cuda.Stream(device)

    def upload_async(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Starts copying ``host`` (pinned) to the device; returns the copy and the event
        that marks it done. Hand both to :meth:`use` before the current stream reads it."""
        with torch.cuda.stream(self.upload):
            copy = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            copy.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.upload)
        return copy, ready

    def use(self, copy: torch.Tensor, ready: torch.cuda.Event) -> torch.Tensor:
        """Makes the current stream wait for an upload (not the host) before its next kernels."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        copy.record_stream(current)
        return copy

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of ``host`` (pinned), which the current stream waits for."""
        return self.use(*self.upload_async(host))

    def mark(self) -> torch.cuda.Event:
        """An event that fires when the work queued on the current stream so far is done."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        """Starts copying each ``(device, pinned host)`` pair to the host once the work queued
        on the current stream so far is done; returns the event that marks the copies done."""
        after = self.mark()
        done = torch.cuda.Event()
        with torch.cuda.stream(self.download):
            self.download.wait_event(after)
            for source, target in pairs:
                target.copy_(source, non_blocking=True)
                source.record_stream(self.download)
            done.record(self.download)
        return done


def _check_io(futures: Iterable[IOFuture]) -> None:
    """Waits for every future, then raises the first error among them."""
    futures = list(futures)
    for future in futures:
        future.wait()
    errors = []
    for future in futures:
        try:
            future.result()
        except (OSError, CorruptCheckpointError) as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each state tensor of one parameter lies in its region (one store key)."""

    entries: tuple[tuple[Any, torch.dtype, torch.Size, int], ...]  # name, dtype, shape, offset
    nbytes: int  # a whole number of pages, so every transfer is O_DIRECT end to end

    @classmethod
    def of(cls, tensors: dict[Any, torch.Tensor]) -> "_Layout":
        entries, offset = [], 0
        for name, t in tensors.items():
            entries.append((name, t.dtype, t.shape, offset))
            offset = round_up(offset + _nbytes(t), _ALIGN)
        return cls(tuple(entries), round_up(offset, _PAGE))

    def views(self, region: _Buffer) -> dict[Any, torch.Tensor]:
        return {name: _view(region, offset, dtype, shape) for name, dtype, shape, offset in self.entries}

    def holds(self, tensors: dict[Any, torch.Tensor], region: _Buffer) -> bool:
        """Whether ``tensors`` are exactly this layout's views of ``region`` (updated in place)."""
        if len(tensors) != len(self.entries):
            return False
        base = _address(region)
        return all(name in tensors and tensors[name].dtype == dtype and tensors[name].shape == shape
                   and tensors[name].data_ptr() == base + offset
                   for name, dtype, shape, offset in self.entries)


@dataclasses.dataclass
class _Write:
    """One parameter's state on its way to the store."""

    param: torch.Tensor
    key: str
    layout: _Layout
    region: _Buffer
    extras: dict[Any, Any]
    future: IOFuture | None
    error: OSError | None = None


@dataclasses.dataclass
class _ChunkWrite:
    """A chunk's writes: started at once from host memory, or, on a CUDA device, once the
    copies of the state to the host (``copied``) are done."""

    writes: list[_Write]
    charged: int  # host bytes they hold, uncharged when they finish
    copied: torch.cuda.Event | None = None

    def start_if_copied(self, store: OffloadStore) -> None:
        """Starts the writes not started yet, if the copies to the host are done."""
        if self.copied is not None and not self.copied.query():
            return
        self.copied = None
        for write in self.writes:
            if write.future is None and write.error is None:
                try:
                    write.future = store.swap_out(write.key, _host_array(write.region))
                except OSError as exc:
                    write.error = exc


class _StoredState(collections.abc.Mapping):
    """One parameter's state, as ``optimizer.state[p]`` shows it: its names known without
    I/O, its tensors read on first access (copies: changing them changes nothing stored;
    a parameter stepped in slices shows its slices' state put together)."""

    def __init__(self, owner: "OffloadedOptimizer", param: torch.Tensor) -> None:
        self._owner, self._param = owner, param
        self._names = owner._state_names(param)
        self._values: dict[Any, Any] | None = None

    def __getitem__(self, name: Any) -> Any:
        if self._values is None:
            self._values = self._owner._read_param_state(self._param)
        return self._values[name]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _OffloadedStateView(collections.abc.Mapping):
    """``OffloadedOptimizer.state``: every parameter with state, wherever it lies now.

    Code that inspects an optimizer's state (torch's ``get_state_dict`` and
    ``set_state_dict`` step an optimizer whose state looks empty) sees it as on a plain
    optimizer; a parameter without state reads as ``{}``, as from torch's defaultdict.
    """

    def __init__(self, owner: "OffloadedOptimizer") -> None:
        self._owner = owner

    def __getitem__(self, p: Any) -> Any:
        return _StoredState(self._owner, p) if self._owner._state_names(p) else {}

    def __iter__(self) -> Iterator[Any]:
        return (p for p in self._owner._unique_params() if self._owner._state_names(p))

    def __len__(self) -> int:
        return sum(1 for _ in self)


# Optimizers whose update of each element reads only that element's parameter, gradient
# and state (and scalars): stepping a parameter in slices gives the same bits.
_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop)
# Slices are whole multiples of this many elements, so that each slice starts aligned and
# vectorised kernels treat every element as they would in the whole tensor.
_SLICE_ELEMENTS = 4096


@dataclasses.dataclass(frozen=True)
class _StateSize:
    """Bytes of a parameter's state: ``per_element`` per element plus ``fixed``."""

    per_element: float
    fixed: int

    def of(self, elements: int) -> int:
        return round_up(int(self.per_element * elements) + self.fixed, _PAGE)


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    """The optimizer class's own ``step``, without the hook runner torch wraps it in (which
    runs the optimizer's and the global step hooks)."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def _copied(state: dict[Any, Any]) -> dict[Any, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _stored_tensors(p: torch.Tensor, held: dict[Any, Any]) -> dict[Any, torch.Tensor]:
    """The entries of ``p``'s state that go to the store: its tensors on ``p``'s device. The
    others (the step count that Adam keeps on the CPU for a CUDA parameter, None, numbers)
    are a few bytes and stay in memory."""
    return {k: v for k, v in held.items() if isinstance(v, torch.Tensor) and v.device == p.device}


def _probe_state_size(optimizer: torch.optim.Optimizer, group: dict[str, Any], dtype: torch.dtype,
                      device: torch.device) -> _StateSize:
    """Steps an optimizer of the same class and group options on a small parameter of
    ``dtype`` on ``device`` with a zero gradient, and measures the state it creates."""
    probe = torch.zeros(_SLICE_ELEMENTS, dtype=dtype, device=device)
    probe.grad = torch.zeros_like(probe)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    twin = type(optimizer)([probe], **{k: v for k, v in group.items() if k != "params" and k in accepted})
    _unhooked_step(twin)(twin)  # a measurement, not a step: no hooks
    tensors = list(_stored_tensors(probe, twin.state[probe]).values())
    shaped = sum(_nbytes(t) for t in tensors if t.shape == probe.shape)
    others = sum(_nbytes(t) for t in tensors if t.shape != probe.shape)
    return _StateSize(shaped / _SLICE_ELEMENTS, others + _ALIGN * len(tensors))


class OffloadedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer so that its state lives on NVMe between steps (ZeRO-Infinity style).

    Any optimizer whose state is per-parameter tensors works (Adam, AdamW, SGD with
    momentum, ...): :meth:`step` runs the wrapped optimizer's own ``step`` on one chunk
    of parameters at a time, by narrowing each param group's ``params`` to the chunk,
    so the arithmetic, and therefore the result, is bit-identical to the unwrapped
    optimizer. While a chunk computes, the next ``prefetch`` chunks are read and the
    previous chunk is written. The state the optimizer creates on its first step is
    offloaded the same way. Step hooks (the wrapper's, the wrapped optimizer's, torch's
    global ones) run once per step, and :attr:`state` shows every parameter's state as a
    plain optimizer would, so LR schedulers and torch's ``get_state_dict`` /
    ``set_state_dict`` (hence :class:`FSDPCheckpointer`) treat the wrapper as one.

    On a CUDA device each chunk's state is read into pinned host memory, copied to the
    device on a side stream and stepped there by the wrapped optimizer's own kernels
    (fused and foreach ones included); the copy back runs on another side stream behind
    those kernels, and the chunk's write starts once it is done. So the next chunk's read
    and the previous chunk's write overlap the current chunk's kernels. State tensors the
    optimizer keeps on the CPU for a CUDA parameter (Adam's step count, unless fused or
    capturable) are a few bytes each and stay in memory.

    Args:
        optimizer: the torch optimizer to wrap, its parameters all on the CPU or all on
            one CUDA device. Use only the wrapper from now on: between steps the wrapped
            ``optimizer.state`` is empty, and a step of the bare optimizer would start its
            state afresh.
        store_dir: an existing directory on the drive; the state goes to a private
            subdirectory that :meth:`close` removes.
        resident_bytes: bound on the optimizer state held in memory at once, in flight
            included. A step holds up to ``max(prefetch + 2, 3)`` chunks (the chunk
            computing, those prefetched, the one being written; on the first step, the
            state the optimizer creates beside its packed copy). On a CUDA device it bounds
            the device memory of the state (the optimizer's temporaries, which a plain step
            makes too, are not counted); the pinned host memory the state goes through is
            charged alike, though torch's pinned allocator rounds each block up to a power
            of two and keeps freed blocks for reuse.
        prefetch: how many chunks to read ahead.
        engine: the :class:`tensorferry.Engine` to use; by default the store's own.
        elementwise: whether the optimizer updates each element from that element alone
            (Adam, AdamW, SGD, Adagrad and RMSprop are known to; say True for others,
            Lion say). Such an optimizer steps a parameter whose state exceeds a chunk's
            share of the budget in slices, with the same result, and the budget is
            checked when the wrapper is built; others need the largest parameter's state
            to fit a chunk.
        master_weights: mixed precision, as DeepSpeed's NVMe offload does it: each bf16 or
            fp16 parameter gets an fp32 master copy, kept with its state (as the state entry
            ``"master"``) in the store. The wrapped optimizer steps the master, from the
            gradient cast to fp32, so its state is fp32 too, and the parameter becomes the
            master rounded to its dtype. The first step makes the master from the parameter.
        verify: whether the store checks the state it reads back against a checksum taken
            as it was written (:class:`tensorferry.OffloadStore`'s ``verify``, which says
            what it costs); a step that reads damaged state raises ``CorruptCheckpointError``.

    Example::

        opt = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), "/nvme/tmp",
                                 resident_bytes=2 << 30)
        loss.backward(); opt.step(); opt.zero_grad()

        # bf16 parameters on the GPU, fp32 masters and AdamW state on NVMe:
        model = model.to("cuda", torch.bfloat16)
        opt = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), fused=True), "/nvme/tmp",
                                 resident_bytes=4 << 30, master_weights=True)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, store_dir: PathLike, *,
                 resident_bytes: int = 1 << 30, prefetch: int = 1, engine: Engine | None = None,
                 elementwise: bool | None = None, master_weights: bool = False, verify: bool = True) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, OffloadedOptimizer):
            raise TypeError(f"expected a torch optimizer to wrap, got {type(optimizer).__name__}")
        if resident_bytes <= 0:
            raise ValueError(f"resident_bytes must be positive, got {resident_bytes}")
        if prefetch < 0:
            raise ValueError(f"prefetch must not be negative, got {prefetch}")
        self.device = _one_device([p for g in optimizer.param_groups for p in g["params"]], "OffloadedOptimizer")
        self._streams = _CopyStreams(self.device) if self.device.type == "cuda" else None
        # Not Optimizer.__init__: the wrapped optimizer owns the groups; the subclass is so
        # that LR schedulers and isinstance checks accept the wrapper. Step hooks are the
        # wrapper's own and run once per step (torch's hooked step, patched on the class);
        # state-dict hooks are the wrapped optimizer's, whose state_dict the wrapper calls.
        self.optimizer = optimizer
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_state_dict_pre_hooks = optimizer._optimizer_state_dict_pre_hooks
        self._optimizer_state_dict_post_hooks = optimizer._optimizer_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks = optimizer._optimizer_load_state_dict_pre_hooks
        self._optimizer_load_state_dict_post_hooks = optimizer._optimizer_load_state_dict_post_hooks
        self._patch_step_function()
        self.defaults = optimizer.defaults
        self.resident_bytes = resident_bytes
        self.prefetch = prefetch
        self.store = OffloadStore(store_dir, engine, max_pool_bytes=0, verify=verify)
        self.elementwise = isinstance(optimizer, _ELEMENTWISE) if elementwise is None else elementwise
        self.master_weights = master_weights
        # What the optimizer steps: each parameter itself, or views of its slices
        # (parameter -> [(view, start element)]), each with a store key given on first sight.
        self._keys: dict[torch.Tensor, str] = {}
        self._slices: dict[torch.Tensor, list[tuple[torch.Tensor, int]]] = {}
        self._sizes: dict[tuple[int, torch.dtype], _StateSize] = {}  # (group, dtype) -> probed
        self._expected: dict[str, int] = {}  # key -> probed state bytes, before it has state
        self._layouts: dict[str, _Layout] = {}  # keys whose state is in the store
        self._extras: dict[str, dict[Any, Any]] = {}  # non-tensor state entries, kept in memory
        # Learnt from the first parameters stepped, to size chunks of parameters that have
        # no state yet: state bytes ~ per_byte * parameter bytes + fixed.
        self._estimate: tuple[float, int] | None = None
        self._resident = 0
        self.peak_resident_bytes = 0
        try:
            self._offload_in_memory()
            self._check_budget(self._params())
        except BaseException:
            self.store.close()
            raise

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """Each parameter's state, as on a plain optimizer (read-only: the tensors of state
        in the store are read on access, as copies)."""
        return _OffloadedStateView(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group to the wrapped optimizer."""
        new = param_group["params"]
        self._require_device([new] if isinstance(new, torch.Tensor) else list(new))
        self.optimizer.add_param_group(param_group)
        self._check_budget(self._params())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Runs the wrapped optimizer's step, chunk by chunk, with the state swapped in and out.

        Args:
            closure: reevaluates the model and returns the loss; called once, before the
                first chunk (optimizers that call it several times per step, like LBFGS,
                are not supported).

        Raises:
            TensorferryIOError: some state could not be written (ENOSPC, EIO); it names
                the first failed write's file, offset and length. The step
                has still been applied to every parameter, and that state stays in memory,
                beyond ``resident_bytes``, until a later step or :meth:`load_state_dict`
                writes it.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        self._require_device(params)
        groups = self.optimizer.param_groups
        members = [g["params"] for g in groups]
        stepped = [[t for p in full for t in self._pieces(p)] for full in members]
        inner = self.optimizer
        # The wrapped optimizer's step without torch's hook runner, which would run its
        # hooks (and the global ones) once per chunk: they run once, here and around us.
        raw_step = _unhooked_step(inner)
        for pre_hook in list(inner._optimizer_step_pre_hooks.values()):
            pre_hook(inner, (inner,), {})

        def step_chunk(chunk: list[torch.Tensor]) -> None:
            ids = {id(p) for p in chunk}
            masters = self._masters_to_step(chunk)
            try:
                for group, pieces in zip(groups, stepped):
                    group["params"] = [masters.get(id(p), p) for p in pieces if id(p) in ids]
                raw_step(inner)
            finally:
                for group, full in zip(groups, members):
                    group["params"] = full
                self._masters_stepped(chunk, masters)

        for p, pieces in self._slices.items():
            for view, start in pieces:
                view.grad = None if p.grad is None else p.grad.reshape(-1)[start:start + view.numel()]
        try:
            self._pipeline(self._chunks(params), step_chunk, write_back=True)
        finally:
            for pieces in self._slices.values():
                for view, _ in pieces:
                    view.grad = None
        for post_hook in list(inner._optimizer_step_post_hooks.values()):
            post_hook(inner, (inner,), {})
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, its state read back chunk by chunk into new tensors."""
        copies: dict[torch.Tensor, dict[Any, Any]] = {}

        def collect(chunk: list[torch.Tensor]) -> None:
            for p in chunk:
                if self._keys.get(p) in self._layouts:
                    copies[p] = _copied(self.optimizer.state[p])

        params = self._params()
        stored = [p for p in params if self._keys.get(p) in self._layouts]
        self._pipeline(self._chunks(stored), collect, write_back=False)
        for p in params:  # state without tensors (SGD's momentum_buffer of None) is never stored
            if p not in copies and self._extras.get(self._keys[p]):
                copies[p] = dict(self._extras[self._keys[p]])
        # Slices' state held in memory (a write failed) goes into their parameter's whole.
        held_slices = {v: self.optimizer.state.pop(v) for pieces in self._slices.values()
                       for v, _ in pieces if self.optimizer.state.get(v)}
        copies.update(held_slices)
        whole = {p: self._joined(p, copies) for p in self._unique_params()
                 if any(piece in copies for piece in self._pieces(p))}
        self.optimizer.state.update(whole)
        try:
            return self.optimizer.state_dict()
        finally:
            for p in whole:
                del self.optimizer.state[p]
            self.optimizer.state.update(held_slices)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a (wrapped or plain) optimizer state dict into the wrapped optimizer and offloads it."""
        self.optimizer.load_state_dict(state_dict)
        if self.master_weights:
            # torch casts a parameter's state to its dtype; a master's state is fp32 (from a
            # state dict of a plain bf16 optimizer too, or the master's fp32 step would mix dtypes).
            saved = [i for g in state_dict["param_groups"] for i in g["params"]]
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            for index, p in zip(saved, params):
                for name, value in state_dict["state"].get(index, {}).items():
                    if self._has_master(p) and isinstance(value, torch.Tensor) and value.is_floating_point():
                        device = self.optimizer.state[p][name].device
                        self.optimizer.state[p][name] = value.detach().to(device, torch.float32, copy=True)
        for key in list(self._layouts):
            self.store.delete(key)
        self._layouts.clear()
        self._extras.clear()
        self._offload_in_memory()

    def stats(self) -> dict[str, int]:
        """The store's counters, plus peak_resident_bytes and resident_bytes (the bound)."""
        return {**self.store.stats(), "peak_resident_bytes": self.peak_resident_bytes,
                "resident_bytes": self.resident_bytes}

    def close(self) -> None:
        """Removes the store and its files; the state in it is lost (take a state_dict first)."""
        self.store.close()

    def __enter__(self) -> "OffloadedOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"OffloadedOptimizer({self.optimizer.__class__.__name__}, {self.store.path!r}, "
                f"resident_bytes={self.resident_bytes}, prefetch={self.prefetch})")

    # Internals.

    def _require_device(self, params: list[torch.Tensor]) -> None:
        device = _one_device(params, "OffloadedOptimizer")
        if params and device != self.device:
            raise ValueError(f"OffloadedOptimizer was built for parameters on {self.device}; got parameters "
                             f"on {device} (build a new one after moving the model)")

    def _host_empty(self, nbytes: int) -> _Buffer:
        """Host memory for state on its way to or from the drive: pinned for a CUDA device."""
        return aligned_empty(nbytes) if self._streams is None else _pinned_empty(nbytes)

    def _has_master(self, p: torch.Tensor) -> bool:
        return self.master_weights and p.dtype in (torch.bfloat16, torch.float16)

    def _masters_to_step(self, chunk: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """For each parameter of the chunk with a master and a gradient: its fp32 master (from
        its state, or made from it on the first step), with the gradient cast to fp32 and its
        state moved to the master, which the wrapped optimizer steps in its place."""
        masters = {}
        for p in chunk:
            if not self._has_master(p) or p.grad is None:
                continue
            held = dict(self.optimizer.state.pop(p, {}))
            master = held.pop("master", None)
            if master is None:
                master = p.detach().float()
            master.grad = p.grad.float()
            if held:
                self.optimizer.state[master] = held
            masters[id(p)] = master
        return masters

    def _masters_stepped(self, chunk: list[torch.Tensor], masters: dict[int, torch.Tensor]) -> None:
        """Puts each master, with its state, back under its parameter, which takes its value."""
        for p in chunk:
            master = masters.get(id(p))
            if master is None:
                continue
            master.grad = None
            self.optimizer.state[p] = {**self.optimizer.state.pop(master, {}), "master": master}
            p.copy_(master)

    def _unique_params(self) -> list[torch.Tensor]:
        """Every parameter once, in param-group order."""
        seen: dict[int, torch.Tensor] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _params(self) -> list[torch.Tensor]:
        """What the optimizer steps, in param-group order: each parameter, or its slices.

        A parameter seen for the first time gets its store keys; with an element-wise
        optimizer, one whose state would exceed a chunk's share of the budget is cut
        into slices that fit it.
        """
        for index, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if p not in self._keys and p not in self._slices:
                    self._place(index, group, p)
        return [t for p in self._unique_params() for t in self._pieces(p)]

    def _place(self, index: int, group: dict[str, Any], p: torch.Tensor) -> None:
        if not self.elementwise:
            self._keys[p] = str(len(self._keys))
            return
        size = self._sizes.get((index, p.dtype))
        if size is None:
            if self._has_master(p):  # the state of an fp32 parameter, and the fp32 master
                size = _probe_state_size(self.optimizer, group, torch.float32, self.device)
                size = _StateSize(size.per_element + 4, size.fixed + _ALIGN)
            else:
                size = _probe_state_size(self.optimizer, group, p.dtype, self.device)
            self._sizes[(index, p.dtype)] = size
        elements = p.numel()
        if size.of(elements) > self._chunk_budget() and p.is_contiguous() and elements > _SLICE_ELEMENTS:
            fits = int((self._chunk_budget() - size.fixed - _PAGE) / max(size.per_element, 1e-9))
            elements = max(_SLICE_ELEMENTS, fits // _SLICE_ELEMENTS * _SLICE_ELEMENTS)
            self._slices[p] = []
            for start in range(0, p.numel(), elements):
                view = p.detach().reshape(-1)[start:start + elements]
                self._slices[p].append((view, start))
                self._keys[view] = str(len(self._keys))
                self._expected[self._keys[view]] = size.of(view.numel())
        else:
            self._keys[p] = str(len(self._keys))
            self._expected[self._keys[p]] = size.of(elements)

    def _pieces(self, p: torch.Tensor) -> list[torch.Tensor]:
        """What the optimizer steps for ``p``: ``p``, or views of its slices (made anew, with
        their keys, if ``p`` no longer lies where they look)."""
        pieces = self._slices.get(p)
        if pieces is None:
            return [p]
        view, start = pieces[0]
        if (view.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                or view.storage_offset() != p.storage_offset() + start):
            for i, (old, begin) in enumerate(pieces):
                new = p.detach().reshape(-1)[begin:begin + old.numel()]
                self._keys[new] = self._keys.pop(old)
                if old in self.optimizer.state:
                    self.optimizer.state[new] = self.optimizer.state.pop(old)
                pieces[i] = (new, begin)
        return [view for view, _ in pieces]

    def _split_held(self) -> None:
        """Hands the state the wrapped optimizer holds for a sliced parameter to its slices."""
        for p, pieces in self._slices.items():
            held = self.optimizer.state.pop(p, None)
            if not held:
                continue
            for view, start in pieces:
                self.optimizer.state[view] = {
                    k: v.reshape(-1)[start:start + view.numel()]
                    if isinstance(v, torch.Tensor) and v.shape == p.shape else v for k, v in held.items()}

    def _joined(self, p: torch.Tensor, states: dict[torch.Tensor, dict[Any, Any]]) -> dict[Any, Any]:
        """``p``'s state from its pieces' states: slices of per-element tensors put together."""
        if p not in self._slices:
            return states[p]
        pieces = self._pieces(p)
        first = states[pieces[0]]
        return {k: torch.cat([states[view][k] for view in pieces]).view(p.shape)
                if isinstance(v, torch.Tensor) and v.shape == pieces[0].shape else v for k, v in first.items()}

    def _state_names(self, p: torch.Tensor) -> list[Any]:
        """The names of ``p``'s state entries (empty without state), found without I/O."""
        piece = self._pieces(p)[0] if p in self._keys or p in self._slices else None
        held = self.optimizer.state.get(piece) if piece is not None else None
        if held:
            return list(held)
        key = self._keys.get(piece)
        if key in self._layouts:
            return [name for name, *_ in self._layouts[key].entries] + list(self._extras[key])
        return list(self._extras.get(key, {}))

    def _read_param_state(self, p: torch.Tensor) -> dict[Any, Any]:
        """A copy of ``p``'s state, read now."""
        states = {}
        for piece in self._pieces(p):
            held = self.optimizer.state.get(piece)
            key = self._keys[piece]
            if held:
                states[piece] = _copied(held)
            elif key in self._layouts:
                region = aligned_empty(self._layouts[key].nbytes)
                _check_io([self.store.swap_in(key, region)])
                stored = {k: v.to(self.device) for k, v in self._layouts[key].views(region).items()}
                states[piece] = {**stored, **_copied(self._extras[key])}
            else:
                states[piece] = _copied(self._extras.get(key, {}))
        return self._joined(p, states)

    def _chunk_budget(self) -> int:
        return self.resident_bytes // max(self.prefetch + 2, 3)

    def _offload_in_memory(self) -> None:
        """Writes out the state the wrapped optimizer holds in memory (on wrapping, after a load)."""
        params = self._params()
        self._split_held()
        held = [p for p in params if self.optimizer.state.get(p)]
        self._pipeline(self._chunks(held), lambda chunk: None, write_back=True)

    def _charge(self, nbytes: int) -> None:
        self._resident += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self._resident)

    def _state_bytes(self, p: torch.Tensor) -> int | None:
        """Bytes of p's state in memory during a step, or None when there is nothing to go on."""
        key = self._keys[p]
        if key in self._layouts:
            return self._layouts[key].nbytes
        held = self.optimizer.state.get(p)
        if held:
            return _Layout.of(_stored_tensors(p, held)).nbytes
        if p.grad is None:
            return 0  # optimizers neither step nor create state for parameters without gradients
        if key in self._expected:
            return self._expected[key]
        if self._estimate is None:
            return None
        per_byte, fixed = self._estimate
        return round_up(int(per_byte * _nbytes(p)) + fixed, _PAGE)

    def _learn(self, p: torch.Tensor, tensors: dict[Any, torch.Tensor], layout: _Layout) -> None:
        shaped = sum(_nbytes(t) for t in tensors.values() if t.numel() == p.numel())
        per_byte = shaped / max(_nbytes(p), 1)
        fixed = layout.nbytes - shaped
        if self._estimate is not None:
            per_byte, fixed = max(per_byte, self._estimate[0]), max(fixed, self._estimate[1])
        self._estimate = (per_byte, fixed)

    def _chunks(self, params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        """Consecutive runs of ``params`` whose state fits one chunk's share of the budget.

        A generator, so that chunks drawn later are sized with what earlier chunks taught
        about state not created yet; a parameter with nothing to go on is a chunk alone.
        Sizes known beforehand are checked against the budget before the first chunk, so
        a step never stops half done; a first step's estimates are not.
        """
        self._check_budget(params)
        return self._chunk_runs(params, self._chunk_budget())

    def _check_budget(self, params: list[torch.Tensor]) -> None:
        """Raises if the state of one of ``params``, where known (held, stored or probed),
        exceeds a chunk's share of the budget."""
        budget = self._chunk_budget()
        for p in params:
            key = self._keys[p]
            held = self.optimizer.state.get(p)
            if key in self._layouts or held:
                nbytes = self._state_bytes(p)
            else:
                nbytes = self._expected.get(key, 0)
            if nbytes > budget:
                chunks = max(self.prefetch + 2, 3)
                whole = next((q for q, pieces in self._slices.items() if any(v is p for v, _ in pieces)), None)
                what = (f"a parameter of shape {tuple(p.shape)}" if whole is None else
                        f"a slice of {p.numel()} elements (the smallest) of a parameter of shape {tuple(whole.shape)}")
                raise ValueError(
                    f"resident_bytes={self.resident_bytes} is too small: the state of {what} takes {nbytes} "
                    f"bytes and a step holds up to {chunks} chunks; give at least {nbytes * chunks} bytes")

    def _chunk_runs(self, params: list[torch.Tensor], budget: int) -> Iterator[list[torch.Tensor]]:
        """The generator behind :meth:`_chunks`."""
        chunk: list[torch.Tensor] = []
        total = 0
        for p in params:
            nbytes = self._state_bytes(p)
            if chunk and (nbytes is None or total + nbytes > budget):
                yield chunk
                chunk, total = [], 0
            chunk.append(p)
            total += nbytes or 0
            if nbytes is None:
                yield chunk
                chunk, total = [], 0
        if chunk:
            yield chunk

    def _pipeline(self, chunks: Iterator[list[torch.Tensor]], visit: Callable[[list[torch.Tensor]], None],
                  *, write_back: bool) -> None:
        """Runs ``visit`` on each chunk with its state in ``optimizer.state``.

        Reads run ``prefetch`` chunks ahead; with ``write_back`` the state is written back
        after ``visit``, and the write of one chunk overlaps the next chunk's ``visit``.
        On a CUDA device the state goes through pinned host memory: each chunk is copied
        to the device once its read is done, ``visit`` queues the optimizer's kernels, the
        copy back is queued behind them, and the chunk's write starts once that copy is
        done, during the next chunk's ``visit``, whose kernels run meanwhile.
        """
        reads: collections.deque[tuple[list[torch.Tensor], _Buffer, list[tuple[torch.Tensor, str, int]],
                                       list[IOFuture]]] = collections.deque()
        writes: collections.deque[_ChunkWrite] = collections.deque()
        failed: list[_Write] = []
        chunks = iter(chunks)
        exhausted = False
        try:
            while True:
                while not exhausted and len(reads) <= self.prefetch:
                    chunk = next(chunks, None)
                    if chunk is None:
                        exhausted = True
                    else:
                        reads.append(self._start_read(chunk))
                if not reads:
                    break
                for pending in writes:
                    pending.start_if_copied(self.store)
                chunk, arena, placed, futures = reads.popleft()
                _check_io(futures)
                on_device = self._to_device(arena)
                for p, key, offset in placed:
                    region = on_device[offset:offset + self._layouts[key].nbytes]
                    self.optimizer.state[p] = {**self._layouts[key].views(region), **self._extras[key]}
                visit(chunk)
                if write_back:
                    writes.append(self._start_write(chunk, arena, on_device, placed))
                else:
                    for p, _, _ in placed:
                        del self.optimizer.state[p]
                    self._resident -= arena.nbytes
                del on_device  # the device copy goes before the next chunk's comes
                while len(writes) > (1 if write_back and reads else 0):
                    failed += self._finish_write(writes.popleft())
        finally:
            # On an exception, let the I/O in flight finish before its buffers go.
            while writes:
                failed += self._finish_write(writes.popleft())
            for _, arena, _, futures in reads:
                for future in futures:
                    future.wait()
                self._resident -= arena.nbytes
        if failed:
            # Named as the first failed write names itself: its file, offset and length.
            first = failed[0].error
            err = first.errno or errno.EIO
            raise TensorferryIOError(
                err, f"could not offload the optimizer state of {len(failed)} parameters (it stays in memory "
                     f"and a later step retries); the first: {os.strerror(err)}",
                first.filename or self.store.path, getattr(first, "offset", 0), getattr(first, "length", 0)) from first

    def _to_device(self, arena: _Buffer) -> _Buffer:
        """The chunk's state where the optimizer steps it: the arena itself on the CPU, a
        copy of it on a CUDA device (the current stream waits for the copy, not the host)."""
        if self._streams is None or arena.nbytes == 0:
            return arena
        return self._streams.to_device(arena)

    def _start_read(self, chunk: list[torch.Tensor]) -> tuple[list[torch.Tensor], _Buffer,
                                                               list[tuple[torch.Tensor, str, int]], list[IOFuture]]:
        """Allocates one arena for the chunk's stored state and starts reading each key into it."""
        placed, offset = [], 0
        for p in chunk:
            key = self._keys[p]
            if key in self._layouts and not self.optimizer.state.get(p):
                placed.append((p, key, offset))
                offset += self._layouts[key].nbytes
        arena = self._host_empty(offset)
        self._charge(arena.nbytes)
        futures = []
        try:
            for p, key, start in placed:
                futures.append(self.store.swap_in(key, _host_array(arena[start:start + self._layouts[key].nbytes])))
        except BaseException:
            for future in futures:
                future.wait()
            self._resident -= arena.nbytes
            raise
        return chunk, arena, placed, futures

    def _start_write(self, chunk: list[torch.Tensor], arena: _Buffer, on_device: _Buffer,
                     placed: list[tuple[torch.Tensor, str, int]]) -> _ChunkWrite:
        """Starts writing the chunk's state from host memory: from the arena where the optimizer
        updated it there (on a CUDA device, in the arena's device copy, which is copied back
        into the arena), else from a fresh region. On a CUDA device the writes start once
        the copies to the host are done (:meth:`_ChunkWrite.start_if_copied`)."""
        offsets = {id(p): offset for p, _, offset in placed}
        writes = _ChunkWrite([], arena.nbytes)
        # State the optimizer allocated itself (on its first step) is resident until packed.
        fresh = {id(p): sum(_nbytes(v) for v in _stored_tensors(p, self.optimizer.state[p]).values())
                 for p in chunk if self.optimizer.state.get(p) and id(p) not in offsets}
        self._charge(sum(fresh.values()))
        for p in chunk:
            held = self.optimizer.state.pop(p, None)
            if not held:
                continue
            key = self._keys[p]
            tensors = _stored_tensors(p, held)
            extras = {k: v for k, v in held.items() if k not in tensors}
            layout = self._layouts.get(key)
            region = None
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (state, its host copy) to fill
            if id(p) in offsets and layout is not None:
                start = offsets[id(p)]
                span = on_device[start:start + layout.nbytes]
                if layout.holds(tensors, span):
                    region = arena[start:start + layout.nbytes]
                    if self._streams is not None:
                        pairs.append((span, region))
            if region is None:
                layout = _Layout.of(tensors)
                region = self._host_empty(layout.nbytes)
                self._charge(region.nbytes)
                writes.charged += region.nbytes
                pairs = [(t.detach(), view) for view, t in zip(layout.views(region).values(), tensors.values())]
                self._learn(p, tensors, layout)
            if self._streams is None:
                for source, target in pairs:
                    target.copy_(source)
            elif pairs:
                writes.copied = self._streams.to_host(pairs)  # the stream is in order: the last event covers all
            del pairs
            del held, tensors
            self._resident -= fresh.get(id(p), 0)
            if layout.nbytes == 0:
                self._drop_key(key)
                self._extras[key] = extras
                continue
            writes.writes.append(_Write(p, key, layout, region, extras, None))
        if self._estimate is None and any(p.grad is not None for p in chunk):
            self._estimate = (0.0, 0)  # stepped, and created no state: this optimizer keeps none
        if writes.copied is None:
            writes.start_if_copied(self.store)
        return writes

    def _finish_write(self, pending: _ChunkWrite) -> list[_Write]:
        """Waits for a chunk's writes; state that could not be written goes back into memory."""
        failed = []
        if pending.copied is not None:
            pending.copied.synchronize()
            pending.start_if_copied(self.store)
        for write in pending.writes:
            if write.error is None:
                try:
                    write.future.result()
                except OSError as exc:
                    write.error = exc
            if write.error is None:
                self._layouts[write.key] = write.layout
                self._extras[write.key] = write.extras
            else:
                self._layouts.pop(write.key, None)
                self._extras.pop(write.key, None)
                stored = {k: v.to(self.device) for k, v in write.layout.views(write.region).items()}
                self.optimizer.state[write.param] = {**stored, **write.extras}
                failed.append(write)
        self._resident -= pending.charged
        return failed

    def _drop_key(self, key: str) -> None:
        if self._layouts.pop(key, None) is not None:
            self.store.delete(key)


# Modules whose forward uses their children's weights without calling the children
# (MultiheadAttention reads out_proj.weight; TransformerEncoderLayer's inference fast path
# hands every weight of its subtree to one fused kernel): streamed as one unit.
_WHOLE_UNITS = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer)


def _streaming_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward hooks read weights, in ``model.modules()`` order; raises,
    naming the module, for one that runs without hooks."""
    units: list[torch.nn.Module] = []
    inside: set[int] = set()  # modules within a whole unit, loaded with it
    for name, module in model.named_modules(remove_duplicate=True):
        if id(module) in inside:
            continue
        if isinstance(module, torch.jit.ScriptModule):
            raise TypeError(f"stream_weights cannot stream {name or 'the model'} "
                            f"({type(module).__name__}): a TorchScript module runs no forward hooks")
        if isinstance(module, _WHOLE_UNITS):
            inside.update(id(m) for m in module.modules())
            units.append(module)
        elif next(module.parameters(recurse=False), None) is not None:
            units.append(module)
    return units


class StreamedWeights:
    """The handle :func:`stream_weights` returns: hooks that read each layer's weights from NVMe.

    ``remove()`` (or leaving the ``with`` block) reads every weight back into memory,
    removes the hooks and the store. ``peak_resident_bytes`` is the most parameter memory
    this handle has held at once (loaded and in flight).
    """

    def __init__(self, model: torch.nn.Module, store_dir: PathLike, *, resident_bytes: int,
                 prefetch: int, engine: Engine | None, verify: bool = True) -> None:
        if resident_bytes <= 0:
            raise ValueError(f"resident_bytes must be positive, got {resident_bytes}")
        if prefetch < 0:
            raise ValueError(f"prefetch must not be negative, got {prefetch}")
        self.device = _one_device(list(model.parameters()), "stream_weights")
        self._streams = _CopyStreams(self.device) if self.device.type == "cuda" else None
        self.resident_bytes = resident_bytes
        self.prefetch = prefetch
        # A unit is a module with parameters of its own, or one that uses its children's
        # weights without calling them, with its whole subtree; a parameter tied into
        # several units is read once and released when the last of them is done.
        # Parameters are told apart by identity: `in` on a list of tensors compares values.
        self._units = _streaming_units(model)
        self._unit_params: dict[torch.nn.Module, list[torch.nn.Parameter]] = {}
        self._unit_ids: dict[torch.nn.Module, set[int]] = {}
        self._params: dict[torch.nn.Parameter, tuple[str, torch.dtype, torch.Size]] = {}
        for unit in self._units:
            own = list(unit.parameters(recurse=isinstance(unit, _WHOLE_UNITS)))
            for p in own:
                if p not in self._params:
                    self._params[p] = (str(len(self._params)), p.dtype, p.shape)
            self._unit_params[unit] = own
            self._unit_ids[unit] = {id(p) for p in own}
        largest = self._nested_bytes(model, {})
        if largest > resident_bytes:
            raise ValueError(f"resident_bytes={resident_bytes} is too small: one layer's weights, with those "
                             f"of the layers around it (held while it runs), take {largest} bytes")
        total = sum(self._param_bytes(p) for p in self._params)
        free = shutil.disk_usage(store_dir).free if os.path.isdir(store_dir) else None
        self.store = OffloadStore(store_dir, engine, max_pool_bytes=0, verify=verify)
        if free is not None and free < total:
            self.store.close()
            raise TensorferryIOError(errno.ENOSPC, f"the model's weights take {total} bytes and "
                                                    f"{store_dir} has {free} free", str(store_dir))
        self._write_all()
        self._loaded: dict[torch.nn.Parameter, int] = {}  # parameter -> units using it now
        self._pending: dict[torch.nn.Parameter, tuple[torch.Tensor, IOFuture]] = {}  # being read
        # On a CUDA device: weights read ahead whose copy to the device has started.
        self._uploaded: dict[torch.nn.Parameter, tuple[torch.Tensor, torch.cuda.Event]] = {}
        # On a CUDA device: weights of layers whose kernels may not have run yet, with the
        # event that marks them run. They stay charged until then, so that the host, which
        # runs ahead of the device, holds no more device memory than the budget.
        self._releasing: collections.deque[tuple[torch.cuda.Event, list[torch.nn.Parameter]]] = collections.deque()
        self._order: list[torch.nn.Module] = list(self._units)  # last forward's order, for prefetch
        self._seen: list[torch.nn.Module] = []
        self._resident = 0
        self.peak_resident_bytes = 0
        # Regions of released weights, kept for the next read of the same size: fresh
        # memory would be faulted in and zeroed for every layer of every forward.
        self._region_of: dict[torch.nn.Parameter, np.ndarray] = {}
        self._spare: dict[int, list[np.ndarray]] = {}
        self._spare_bytes = 0
        self._hooks = []
        for unit in self._units:
            self._hooks.append(unit.register_forward_pre_hook(self._before))
            self._hooks.append(unit.register_forward_hook(self._after, always_call=True))

    def _param_bytes(self, p: torch.Tensor) -> int:
        _, dtype, shape = self._params[p]
        return round_up(math.prod(shape) * dtype.itemsize, _PAGE)

    def _nested_bytes(self, module: torch.nn.Module, held: dict[int, int]) -> int:
        """The most weight bytes loaded at once while ``module`` or a module inside it runs,
        ``held`` (parameter id -> bytes) being loaded already by the modules around it."""
        if module in self._unit_params:
            held = {**held, **{id(p): self._param_bytes(p) for p in self._unit_params[module]}}
            if isinstance(module, _WHOLE_UNITS):
                return sum(held.values())
        return max([sum(held.values())] + [self._nested_bytes(child, held) for child in module.children()])

    def _write_all(self) -> None:
        """Writes every weight, a bounded amount in flight; replaces them by empty tensors only
        once all are written, so a failure leaves the model as it was."""
        in_flight: collections.deque[tuple[np.ndarray, IOFuture]] = collections.deque()
        held = 0
        try:
            for p, (key, dtype, shape) in self._params.items():
                region = aligned_empty(self._param_bytes(p))
                _view(region, 0, dtype, shape).copy_(p.detach())
                in_flight.append((region, self.store.swap_out(key, region)))
                held += region.nbytes
                while held > self.resident_bytes:
                    done, future = in_flight.popleft()
                    future.result()
                    held -= done.nbytes
            _check_io(future for _, future in in_flight)
        except BaseException as exc:
            for _, future in in_flight:
                future.wait()
            self.store.close()
            if isinstance(exc, OSError):
                raise TensorferryIOError(exc.errno or errno.EIO, f"could not offload the model's weights "
                                         f"to {self.store.path} ({exc.strerror or exc}); the model is "
                                         f"unchanged", getattr(exc, "filename", None)) from exc
            raise
        for p, (_, dtype, _) in self._params.items():
            p.data = torch.empty(0, dtype=dtype, device=self.device)

    def _charge(self, nbytes: int) -> None:
        self._resident += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self._resident)

    def _start_read(self, p: torch.nn.Parameter, *, streaming: bool = True) -> None:
        """Starts reading ``p``'s weight: into memory of its own, on the CPU; into pinned
        memory (torch reuses it once the copy to the device is done), for a CUDA device."""
        key, dtype, shape = self._params[p]
        nbytes = self._param_bytes(p)
        if not streaming:
            region = aligned_empty(nbytes)
        elif self._streams is not None:
            self._charge(nbytes)
            region = _pinned_empty(nbytes)
        else:
            self._charge(nbytes)
            region = self._region_of[p] = self._take_region(nbytes)
        self._pending[p] = (_view(region, 0, dtype, shape), self.store.swap_in(key, _host_array(region)))

    def _upload_ready(self) -> None:
        """On a CUDA device, starts copying to it the weights whose reads are done, so the
        copies run on the side stream while the current layer computes."""
        if self._streams is None:
            return
        for p, (tensor, future) in list(self._pending.items()):
            if future.done():
                del self._pending[p]
                future.result()
                self._uploaded[p] = self._streams.upload_async(tensor)

    def _discard(self, p: torch.nn.Parameter) -> None:
        """Drops a weight read ahead for a layer that did not come next."""
        if p in self._pending:
            _, future = self._pending.pop(p)
            _check_io([future])
        else:
            del self._uploaded[p]
        self._release(p)

    def _take_region(self, nbytes: int) -> np.ndarray:
        """A spare region of this size if there is one, else new memory, for which spare
        regions of other sizes make room: weights in use plus spares stay within the bound."""
        spares = self._spare.get(nbytes)
        if spares:
            self._spare_bytes -= nbytes
            return spares.pop()
        for size, regions in self._spare.items():
            while regions and self._resident + self._spare_bytes > self.resident_bytes:
                regions.pop()
                self._spare_bytes -= size
        return aligned_empty(nbytes)

    def _release(self, p: torch.nn.Parameter) -> None:
        """Uncharges a weight that is no longer used; its region becomes a spare unless
        something (a view the caller kept, say) still holds its memory."""
        self._resident -= self._param_bytes(p)
        region = self._region_of.pop(p, None)
        if (region is not None and _unshared(region)
                and self._resident + self._spare_bytes + region.nbytes <= self.resident_bytes):
            self._spare.setdefault(region.nbytes, []).append(region)
            self._spare_bytes += region.nbytes

    def _missing(self, unit: torch.nn.Module) -> list[torch.nn.Parameter]:
        return [p for p in self._unit_params[unit]
                if p not in self._loaded and p not in self._pending and p not in self._uploaded]

    def _before(self, unit: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and any(p.requires_grad for p in self._unit_params[unit]):
            raise RuntimeError("stream_weights is for inference: run the model under torch.no_grad() "
                               "or torch.inference_mode()")
        if unit in self._seen:
            # A new forward pass began: the last one's order predicts this one's.
            self._order = self._seen + [u for u in self._units if u not in self._seen]
            self._seen = []
        self._seen.append(unit)
        need = sum(self._param_bytes(p) for p in self._missing(unit))
        self._reclaim()
        # Prefetches for layers the order predicted wrongly give way first; then the
        # host waits for the device to finish the layers before.
        for p in list(self._pending) + list(self._uploaded):
            if self._resident + need <= self.resident_bytes:
                break
            if id(p) not in self._unit_ids[unit]:
                self._discard(p)
        self._reclaim(need)
        for p in self._missing(unit):
            self._start_read(p)
        for p in self._unit_params[unit]:
            if p in self._pending:
                tensor, future = self._pending.pop(p)
                future.result()
                p.data = tensor if self._streams is None else self._streams.to_device(tensor)
            elif p in self._uploaded:
                p.data = self._streams.use(*self._uploaded.pop(p))
            self._loaded[p] = self._loaded.get(p, 0) + 1
        self._prefetch_after(unit)
        self._upload_ready()

    def _reclaim(self, need: int | None = None) -> None:
        """Uncharges the weights of layers the device has run; with ``need``, waits for the
        oldest until ``need`` more bytes fit in the budget (or none is left to wait for)."""
        while self._releasing:
            done, params = self._releasing[0]
            if not done.query():
                if need is None or self._resident + need <= self.resident_bytes:
                    return
                done.synchronize()
            self._releasing.popleft()
            for p in params:
                self._release(p)

    def _prefetch_after(self, unit: torch.nn.Module) -> None:
        if unit not in self._order:
            return
        self._reclaim()
        start = self._order.index(unit) + 1
        for ahead in self._order[start:start + self.prefetch]:
            missing = self._missing(ahead)
            if self._resident + sum(self._param_bytes(p) for p in missing) > self.resident_bytes:
                return
            for p in missing:
                self._start_read(p)

    def _after(self, unit: torch.nn.Module, args: Any, output: Any) -> None:
        freed = []
        for p in self._unit_params[unit]:
            count = self._loaded.pop(p, 0) - 1
            if count > 0:
                self._loaded[p] = count
            else:
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
                freed.append(p)
        if self._streams is None:
            for p in freed:
                self._release(p)
        elif freed:
            # The memory is back with torch's allocator, which reuses it only after the
            # kernels queued so far; it stays charged here until they have run.
            self._releasing.append((self._streams.mark(), freed))
        self._upload_ready()

    def remove(self) -> None:
        """Reads every weight back onto the model's device (new tensors), removes the hooks and the store."""
        if self.store.closed:
            return
        for hook in self._hooks:
            hook.remove()
        for _, future in self._pending.values():
            future.wait()  # reads ahead, of weights read again below: their errors would be raised there
        self._pending.clear()
        self._uploaded.clear()
        self._releasing.clear()
        # Each weight gets a page-aligned buffer of its own, read straight from the drive.
        for p in self._params:
            if p not in self._loaded:
                self._start_read(p, streaming=False)
        try:
            _check_io(future for _, future in self._pending.values())
            for p, (tensor, _) in self._pending.items():
                p.data = tensor.to(self.device)
        finally:
            self._pending.clear()
            self._loaded.clear()
            self._region_of.clear()
            self._spare.clear()
            self._spare_bytes = 0
            self._resident = 0
            self.store.close()

    def __enter__(self) -> "StreamedWeights":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def stream_weights(model: torch.nn.Module, store_dir: PathLike, *, resident_bytes: int = 1 << 30,
                   prefetch: int = 1, engine: Engine | None = None, verify: bool = True) -> StreamedWeights:
    """Moves a model's weights to NVMe and reads each layer's just before its forward (ZeRO-Inference style).

    Every module with parameters of its own gets a forward pre-hook that reads them
    (and starts reading the next ``prefetch`` layers, in the order of the last forward
    pass) and a forward hook that releases them. A module that uses its children's
    weights without calling them (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``)
    is read as one unit with its children; a TorchScript module, which runs no hooks, is
    refused. Buffers stay in memory. Inference only: a forward with gradients enabled raises.

    On a CUDA model the weights are read into pinned host memory and copied to the
    device on a side stream as soon as each read is done, so the reads and copies of the
    layers ahead overlap the kernels of the layer running; the current stream waits for a
    layer's copies (not the host) just before its forward, and the device memory is
    freed after it. ``model.generate`` of a transformers model works as ``model(...)`` does.

    Args:
        model: the model, its parameters all on the CPU or all on one CUDA device. Its
            parameters become empty tensors (on that device) outside their layer's forward.
        store_dir: an existing directory on the drive.
        resident_bytes: bound on parameter memory held at once, prefetched layers included
            (on a CUDA model, the device memory of the weights, counted until the device
            has run the layer that used them; the pinned host memory they pass through is
            charged alike, though torch's pinned allocator rounds each block up to a power
            of two and keeps freed blocks for reuse);
            must hold the largest layer with the layers around it (a layer whose children
            also have weights holds its own while they run), which is checked here.
        prefetch: how many layers to read ahead.
        engine: the :class:`tensorferry.Engine` to use; by default the store's own.
        verify: whether each weight read is checked against a checksum taken as it was
            written (:class:`tensorferry.OffloadStore`'s ``verify``, which says what it
            costs); a forward that reads a damaged weight raises ``CorruptCheckpointError``.

    Example::

        with torch.no_grad(), stream_weights(model, "/nvme/tmp", resident_bytes=1 << 30):
            logits = model(tokens)
    """
    return StreamedWeights(model, store_dir, resident_bytes=resident_bytes, prefetch=prefetch, engine=engine,
                           verify=verify)

