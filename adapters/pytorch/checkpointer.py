"""FSDPCheckpointer: sharded saves every few hundred steps, portable consolidated ones now and then."""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import os
import re
import warnings
from concurrent.futures import Future
from typing import Any, Callable, Mapping, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from ...checkpoint import committed_checkpoints, read_manifest, remove_checkpoints, remove_leftovers
from ...errors import CheckpointNotFoundError, RetentionWarning, TensorferryError, TensorferryIOError
from ...engine import Engine, absolute_local_path
from ...layouts.dcp import written_by_torch
from ...pools import SaveFuture
from ...shard import ShardWriter, gc_paused, write_order
from .dcp import DCPReader, DCPWriter
from .serialization import TORCH_FORMAT
from .staging import DeviceToHost
from .tensors import safetensors_dtype

_STEP = re.compile(r"^step_(\d+)$")
_T = TypeVar("_T")


def _told(error: BaseException) -> tuple[int | None, str]:
    """What the other ranks are told of this rank's error: its errno (None without one) and its text."""
    return getattr(error, "errno", None), f"{type(error).__name__}: {error}"


def _error_of_another_rank(rank: int, told: tuple[int | None, str], what: str, path: str) -> TensorferryError:
    """What a rank raises for ``rank``'s error (``told``): a TensorferryIOError with its errno, if it had one."""
    code, text = told
    message = f"rank {rank} {what}: {text}"
    return TensorferryIOError(code, message, path) if code else TensorferryError(message)


def _as_raised_on(rank: int, error: BaseException) -> BaseException:
    """Another rank's ``error`` as one of its class whose message names that rank. A copy: the
    error came from that rank pickled, so it copies the same way, whatever its constructor."""
    named = copy.copy(error)
    if isinstance(named, OSError) and named.strerror is not None:
        named.strerror = f"on rank {rank}: {named.strerror}"  # errno and filename stay as they were
    else:
        named.args = (f"on rank {rank}: {error}",)
    return named


def _original_error(error: BaseException, rank: int, path: str) -> BaseException:
    """What a failed dcp.save, dcp.async_save or dcp.load raises: for DCP's CheckpointException
    (a BaseException, which ``except Exception`` misses, with no errno or filename), the error a
    rank had, the same class on every rank: this rank's own, else the lowest failing rank's. A
    TensorferryError or OSError stays itself (another rank's named by it); any other is told in a
    TensorferryError naming each rank's. The CheckpointException is kept as the cause."""
    if not isinstance(error, CheckpointException) or not error.failures:
        return error
    # torch keeps each rank's failure as (exception, its stack summary)
    failures = {failed: failure[0] if isinstance(failure, tuple) else failure
                for failed, failure in sorted(error.failures.items())}
    failed = rank if rank in failures else min(failures)
    original = failures[failed]
    if isinstance(original, (TensorferryError, OSError)) or not isinstance(original, Exception):  # Ctrl-C stays
        raised = original if failed == rank else _as_raised_on(failed, original)
    else:
        told = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in failures.items())
        raised = TensorferryError(f"{path}: {told}")
    if raised.__cause__ is None:  # a cause the error had of its own stays
        raised.__cause__ = error
    return raised


class FSDPCheckpointer:
    """Checkpoints of an FSDP2 (``fully_shard``), DDP or plain model and its optimizer.

    ``save(step)`` writes a sharded checkpoint ``checkpoint_dir/step_<step>`` (every
    rank writes its own shards, through DCP and :class:`DCPWriter`);
    ``save_async(step)`` does the same in the background; ``save_consolidated(step)``
    writes one safetensors file of the full model on rank 0; ``load()`` restores the
    latest complete step. ``keep_last`` keeps only the newest sharded checkpoints.
    ``extra`` is more state saved and restored with them, by name: objects with
    ``state_dict()`` and ``load_state_dict()`` (DCP's ``Stateful``: an LR scheduler, a
    ``GradScaler``, a data loader that keeps its position), restored through
    ``load_state_dict``, or dicts of tensors and plain values, restored in place.
    ``save_planner`` and ``load_planner`` go to every ``dcp.save`` and ``dcp.load``:
    ``DefaultSavePlanner(enable_plan_caching=True)``, say, plans a save of an unchanged
    state once, or ``DefaultLoadPlanner(allow_partial_load=True)`` loads a checkpoint
    saved without the optimizer. ``process_group`` is the ranks that save and load (by
    default all): only they call the checkpointer, as when one HSDP replica group saves.

    A failed save or load raises on every rank, with the error a rank had rather than DCP's
    ``CheckpointException``: this rank's own, else the lowest failing rank's, named by it. A
    ``TensorferryError`` or ``OSError`` (a full disk: :class:`TensorferryIOError`, with file,
    offset and errno) stays itself; an error of another kind is told in a ``TensorferryError``
    naming each rank's. One that comes before DCP begins (an ``extra``'s ``state_dict()``
    raising on one rank) raises there, and a ``TensorferryError`` naming that rank on the others;
    so does the constructor, which every rank calls, where rank 0 cannot make ``checkpoint_dir``.

    Example::

        progress = {"tokens": 0}  # restored in place by load()
        ckpt = FSDPCheckpointer("/nvme/ckpt", model, optimizer, keep_last=3,
                                extra={"scheduler": scheduler, "progress": progress})
        start = ckpt.load() + 1 if ckpt.latest_step() is not None else 0
        for step in range(start, steps):
            train_step()
            if step % 500 == 0:
                ckpt.save_async(step)
        ckpt.wait()
    """

    def __init__(self, checkpoint_dir: str | os.PathLike, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, *, keep_last: int | None = None,
                 engine: Engine | None = None, files_per_rank: int | None = None,
                 process_group: Any = None, save_planner: SavePlanner | None = None,
                 load_planner: LoadPlanner | None = None, extra: Mapping[str, Any] | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.extra = dict(extra or {})
        if {"model", "optimizer"} & set(self.extra):
            raise ValueError("extra state cannot be named 'model' or 'optimizer': those are the checkpointer's")
        self.checkpoint_dir = absolute_local_path(checkpoint_dir)
        self.model = model
        self.optimizer = optimizer
        self.keep_last = keep_last
        self.engine = engine
        self.files_per_rank = files_per_rank
        self.process_group = process_group
        self.save_planner, self.load_planner = save_planner, load_planner
        self._pending: Future | None = None
        self._save_group: Any = None
        # Every rank raises if rank 0 cannot make it: else the others went on to fail in the first
        # save's collectives ("Connection closed by peer"), or to wait there for the group's timeout.
        self._decided_on_rank_0(functools.partial(os.makedirs, self.checkpoint_dir, exist_ok=True),
                                f"could not make {self.checkpoint_dir}")

    def step_path(self, step: int) -> str:
        """Where the sharded checkpoint of ``step`` lives."""
        return os.path.join(self.checkpoint_dir, f"step_{int(step)}")

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if dist.is_available() and dist.is_initialized() else 0

    def _decided_on_rank_0(self, decide: Callable[[], Any], failed: str | None = None) -> Any:
        """``decide()`` as rank 0 finds it, on every rank: one listing decides, not each
        rank's view of a shared filesystem (whose attribute caches may lag, and which rank
        0's retention changes). If it raises on rank 0, every rank raises; the others say
        ``failed`` (by default, that rank 0 could not list the checkpoint directory)."""
        if not (dist.is_available() and dist.is_initialized()):
            return decide()
        box: list[Any] = [None]
        error: Exception | None = None
        if self._rank() == 0:
            try:
                box[0] = (decide(), None)
            except Exception as exc:  # the other ranks are waiting in the broadcast
                error, box[0] = exc, (None, _told(exc))
        dist.broadcast_object_list(box, group=self.process_group, group_src=0)
        if error is not None:
            raise error
        decided, failure = box[0]
        if failure is not None:
            raise _error_of_another_rank(0, failure, failed or f"could not list {self.checkpoint_dir}",
                                         self.checkpoint_dir)
        return decided

    def _barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier(self.process_group)

    def _on_every_rank(self, gather: Callable[[], _T], what: str, path: str) -> _T:
        """``gather()``, raising on every rank if it raised on one: the failing rank its own
        error, the others a TensorferryError naming it. What runs before DCP's first collective
        (this rank's state, a Stateful's ``state_dict()``) failing on one rank alone left the
        others waiting in that collective until the group's timeout (30 min by default), then
        failing with a gloo error that named no checkpoint. One small collective per call."""
        gathered: Any = None
        error: Exception | None = None
        try:
            gathered = gather()
        except Exception as exc:  # the other ranks are waiting for this rank's word
            error = exc
        if dist.is_available() and dist.is_initialized():
            told: list[Any] = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(told, None if error is None else _told(error), group=self.process_group)
            failed = [(rank, failure) for rank, failure in enumerate(told) if failure is not None]
            if error is None and failed:
                raise _error_of_another_rank(*failed[0], f"failed before the {what} of {path} began", path)
        if error is not None:
            raise error
        return gathered

    def _state(self) -> dict[str, Any]:
        if self.optimizer is None:
            state = {"model": get_model_state_dict(self.model)}
        else:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optimizer": optim_state}
        # Stateful extras as their state_dict(), which DCP would call inside its first step:
        # called here, inside _on_every_rank, a failure on one rank is every rank's.
        extras = {name: value.state_dict() if isinstance(value, Stateful) else value
                  for name, value in self.extra.items()}
        return {**state, **extras}

    def _writer(self, step: int) -> DCPWriter:
        # A step saved again (after a rollback, or past a damaged one) replaces the old,
        # atomically, as torch's FileSystemWriter overwrites its folder.
        return DCPWriter(self.step_path(step), engine=self.engine, files_per_rank=self.files_per_rank,
                         overwrite=True)

    @gc_paused()  # torch's state-dict helpers and DCP planning make many small objects
    def save(self, step: int) -> str:
        """Writes a sharded checkpoint of model and optimizer; returns its path once durable."""
        self._end_background_save()
        path = self.step_path(step)
        state = self._on_every_rank(self._state, "save", path)
        writer = self._writer(step)
        try:
            dcp.save(state, storage_writer=writer, planner=self.save_planner, process_group=self.process_group)
        except BaseException as exc:
            writer._abandon_failed_save()
            raise _original_error(exc, self._rank(), path)
        self._retain()
        return path

    @gc_paused()
    def save_async(self, step: int) -> Future:
        """Starts a sharded save and returns once the state is staged in host memory.

        The write runs in the background while training goes on; a later save or load
        first waits for this one, and warns of its failure (``RuntimeWarning``) unless the
        caller had it from the returned future; :meth:`wait` raises it. The future's
        result is the path. Call
        :meth:`wait` before ``dist.destroy_process_group()``: the save ends with a
        collective of the ranks, and a save whose group is destroyed first is lost
        (its temporary is left for the next save to remove). A program that simply
        ends lets it finish. The save cannot be cancelled: the future's ``cancel()`` returns
        False, as for a running ``concurrent.futures`` future.
        """
        self._end_background_save()
        path, rank = self.step_path(step), self._rank()  # the rank now: the group may be gone when it ends
        state = self._on_every_rank(self._state, "save", path)
        writer = self._writer(step)
        outer = SaveFuture(path)

        def done(f: Future) -> None:
            error = None
            try:
                f.result()
            except BaseException as exc:
                writer._abandon_failed_save()  # before a next save, which waits for this future
                error = _original_error(exc, rank, path)
            # keep_last applies as each save completes, also one a script ended without waiting for. What
            # retention raises (a warning made an error: python -W error) is not the committed save's.
            try:
                if error is None:
                    self._retain()
            finally:
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # done() twice (below): settled once
                    if error is None:
                        outer.set_result(path)
                    else:
                        outer.set_exception(error)

        inner = dcp.async_save(state, storage_writer=writer, planner=self.save_planner,
                               process_group=self._async_group())
        # Tracked at once (nothing between these lines runs Python code, where a Ctrl-C lands): a save
        # left running untracked ran its collectives beside the next one's, and both hung.
        self._pending = outer
        try:
            inner.add_done_callback(done)
        except BaseException:  # a Ctrl-C landing as it was attached: attached again, or outer never completed
            inner.add_done_callback(done)
            raise
        return outer

    def _async_group(self) -> Any:
        # The background save runs collectives while training runs its own; on one
        # shared group their order would interleave and deadlock, so it gets its own.
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._save_group is None:
            if self.process_group is None:
                self._save_group = dist.new_group(backend="gloo")
            else:
                # Only the group's ranks save (HSDP: one replica group), so only they make
                # its save group: made as a collective of the whole world, it counted one
                # more group on them than on the other ranks, and the next group the world
                # made had two names, its creation hanging on every rank.
                self._save_group = dist.new_group(ranks=dist.get_process_group_ranks(self.process_group),
                                                  backend="gloo", use_local_synchronization=True)
        return self._save_group

    def wait(self) -> None:
        """Waits for a background save, raising its error if it failed, unless the
        caller has had it already from the save's future (``result()``, ``exception()``)."""
        pending = self._pending
        if pending is None:
            return
        # Forgotten only once it has ended: a Ctrl-C during the wait left a running save
        # untracked, and the next save ran its collectives beside it (both hung) or its error was lost.
        concurrent.futures.wait([pending])
        self._pending = None
        # A delivered error is a handled one: raised again here it would be raised twice.
        if not pending.error_delivered:
            pending.result()

    def _end_background_save(self) -> None:
        """Waits for the background save before a save or load, warning of its failure
        where no caller has had it. Not raised: whether a caller looked at the future is
        each rank's own, and a rank raising here while the others go on would leave them
        in the next save's collectives alone, until the group's timeout."""
        pending = self._pending
        if pending is not None:
            concurrent.futures.wait([pending])  # interrupted (Ctrl-C), the save stays tracked, as in wait()
            self._pending = None
            pending.report_if_undelivered()

    def _retain(self) -> None:
        """Retention after a save has committed: what fails here is a warning, not the
        save's error, since the checkpoint is in place."""
        if self._rank() != 0:
            return
        try:
            if self.keep_last is not None:
                remove_checkpoints([path for _, path in self._steps()[:-self.keep_last]], wait=False)
            remove_leftovers(self.checkpoint_dir)  # no later save to their names comes to remove them
        except OSError as exc:
            warnings.warn(f"{self.checkpoint_dir}: retention after the save failed: {exc}", RetentionWarning,
                          stacklevel=3)

    def _steps(self) -> list[tuple[int, str]]:
        """The complete ``step_<n>`` checkpoints (other checkpoints beside them are not
        steps), as ``(n, path)`` in the order they were saved."""
        steps = [(c.committed_at, int(m.group(1)), c.path) for c in committed_checkpoints(self.checkpoint_dir)
                 if (m := _STEP.match(c.name))]
        return [(step, path) for _, step, path in sorted(steps)]

    def latest_step(self) -> int | None:
        """The complete step saved last, or None. That is the newest by number unless a
        run went back: after ``load(200)`` and ``save(250)``, 250, not an abandoned 300 (as
        DeepSpeed's and Megatron's "latest" records say), and ``keep_last`` keeps the steps
        saved last."""
        steps = self._steps()
        return steps[-1][0] if steps else None

    @gc_paused()
    def load(self, step: int | None = None) -> int:
        """Restores model and optimizer from ``step`` (default: the latest complete one); returns the step.
        A ``step_<step>`` that torch's ``FileSystemWriter`` saved loads too (named by ``step``:
        the latest is looked for among tensorferry's checkpoints)."""
        self._end_background_save()
        if step is None:
            step = self._decided_on_rank_0(self.latest_step)
            if step is None:
                raise CheckpointNotFoundError(f"no complete checkpoint under {self.checkpoint_dir}",
                                              self.checkpoint_dir)
        path = self.step_path(step)

        def gather() -> dict[str, Any]:
            # The state first: its helpers may run collectives (FSDP1's optimizer state), which a rank
            # whose manifest read failed first would leave the others waiting in.
            state = self._state()
            if not written_by_torch(path):  # a step from before a switch: DCPReader hands it to torch's reader
                read_manifest(path)  # a clear error here, before DCP wraps it
            return state

        state = self._on_every_rank(gather, "load", path)
        reader = DCPReader(path, engine=self.engine)
        try:
            dcp.load(state, storage_reader=reader, planner=self.load_planner, process_group=self.process_group)
        except BaseException as exc:
            if reader._metadata_error is not None:  # of which torch kept only the text (an AssertionError)
                raise reader._metadata_error from exc
            raise _original_error(exc, self._rank(), path)
        for name, value in self.extra.items():  # as dcp.load restores a Stateful it was handed
            if isinstance(value, Stateful):
                value.load_state_dict(state[name])
        set_state_dict(self.model, self.optimizer if self.optimizer is not None else [],
                       model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}))
        return step

    def save_consolidated(self, step: int) -> str:
        """Writes the full model as one safetensors file on rank 0; returns its path.

        Sharded parameters are gathered one at a time, each written before the next
        is gathered, so no rank ever holds more than one full tensor beyond its shard.
        Every rank must call it. If rank 0 cannot write the file (a full disk, say), it
        still takes part in the remaining gathers, so no rank hangs, and every rank raises.
        """
        path = os.path.join(self.checkpoint_dir, f"consolidated_step_{int(step)}.safetensors")
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False))
        specs = {name: (safetensors_dtype(t.dtype), tuple(t.shape)) for name, t in state.items()}
        order = write_order((name, dtype) for name, (dtype, _) in specs.items())
        gathered: set[str] = set()

        def full(name: str) -> torch.Tensor:
            gathered.add(name)
            tensor = state[name]
            return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

        error: Exception | None = None
        if self._rank() == 0:
            # Gathered in the writer's order, one at a time (no window: a full tensor
            # ahead would break the memory bound above), copied through pinned memory.
            stager = DeviceToHost([lambda name=name: full(name) for name in order], window=0)
            position = {name: i for i, name in enumerate(order)}
            try:
                with ShardWriter(path, self.engine, atomic=True, metadata=TORCH_FORMAT) as writer:
                    for name in order:
                        dtype, shape = specs[name]
                        writer.add(name, dtype, shape, stager.source(position[name]))
            except Exception as exc:  # the other ranks are waiting in the gathers
                error = exc
        for name in order:  # the same collectives, in the same order, as rank 0's writer
            if name not in gathered:
                full(name)
        failure = [None if error is None else _told(error)]
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(failure, group=self.process_group, group_src=0)
        if error is not None:
            raise error
        if failure[0] is not None:
            raise _error_of_another_rank(0, failure[0], f"could not write {path}", path)
        return path

