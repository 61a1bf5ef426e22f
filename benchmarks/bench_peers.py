"""tensorferry's load and save paths side by side with the peers people use, in one run.

Two states of the same size (64 large tensors; 4096 of 512 KiB at 2 GiB, like an FSDP
state dict) go through every contender installed here, fio included, in interleaved
rounds; then raw transfers of one file through our ``Engine`` and DeepSpeed's
``aio_handle`` at its defaults and at FastPersist's example settings, each beside fio
with the same block size and depth.

    python benchmarks/bench_peers.py --dir DIR --size 2G --repeat 3 [--results benchmarks/results]

The method (docs/benchmarks.md): writes are timed until durable (fsync counted);
before every read the files' page cache is dropped (``posix_fadvise(DONTNEED)``);
a load is timed until every byte it returned has been touched (a loader that maps
the file has read nothing before); memory as large as the step is touched and freed
before each timed step, the same for every contender. Our loads verify checksums.
Peers that are not installed, or whose native part does not build, are listed as
skipped with the reason; none of them is a test dependency.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import pickle
import sys
import time
import warnings
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from tensorferry import Engine, IOConfig, bench, default_config, gc_paused
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from tensorferry.adapters.pytorch import DCPReader, DCPWriter, load, load_checkpoint, save, save_checkpoint
from tensorferry.config import count_arg, counts_arg, size_arg

Rows = list[bench.Measurement]
PAGE = 4096


def make_state(nbytes: int, count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` random float32 tensors adding up to ``nbytes``."""
    g = torch.Generator().manual_seed(seed)
    each = max(1, nbytes // count // 4)
    return {f"layers.{i:05d}.weight": torch.randn(each, generator=g) for i in range(count)}


def touch(tensors: Any) -> None:
    """Reads one byte of every page of every tensor (torch's, or any array numpy takes: JAX's):
    a loader that maps its file (or reads lazily) is timed until it has really read what it
    returned. Every contender's load pays it alike (:meth:`Contender.load`)."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            int(t.detach().reshape(-1).view(torch.uint8)[::PAGE].sum())
        else:
            int(np.asarray(t).reshape(-1).view(np.uint8)[::PAGE].sum())


def files_of(path: str) -> list[str]:
    return bench.files_under(path) if os.path.isdir(path) else [path]


class Contender:
    """A way to save (optional) and load a state: ``write(state, path)`` and ``read(path, state)``.

    ``prepare`` makes the file a load-only contender reads, untimed (a safetensors file
    for the Run:ai streamer and fastsafetensors). ``read`` returns what it loaded (a dict,
    or arrays), which the clock then touches page by page, for every contender alike; one
    whose tensors do not outlive the call (a reused buffer) touches them itself and returns
    None. A load in place is touched in its targets. With ``in_place``, ``read`` gets, in
    place of the saved state, tensors like it to load into (a model's, made before the
    clock starts), as DCP loads. ``target``, if given, makes what ``read`` gets in place
    of the saved state, before the clock starts too (JAX's abstract target, as a user
    makes it from the state's shapes before calling restore). ``convert`` turns the
    state into another framework's arrays first (JAX's), untimed."""

    def __init__(self, name: str, path: str, read: Callable[[str, dict], object],
                 write: Callable[[dict, str], object] | None = None,
                 prepare: Callable[[dict, str], object] | None = None, *, in_place: bool = False,
                 convert: Callable[[dict], dict] | None = None, target: Callable[[dict], dict] | None = None) -> None:
        self.name, self.path, self.read, self.write, self.prepare = name, path, read, write, prepare
        self.in_place, self.convert = in_place, convert
        self.target = target or (destinations if in_place else None)

    def run(self, directory: str, state: dict[str, torch.Tensor], label: str) -> Rows:
        path = os.path.join(directory, self.path)
        nbytes = sum(t.nbytes for t in state.values())
        if self.convert is not None:  # into the framework's arrays, before the clock starts
            state = self.convert(state)
        bench.remove_path(path)
        rows = []
        try:
            if self.write is not None:
                rows.append(bench.timed(f"{self.name} [{label}]", "write", nbytes,
                                        lambda: (self.write(state, path), bench.fsync_tree(path))))
            else:
                self.prepare(state, path)
                bench.fsync_tree(path)
            target = self.target(state) if self.target is not None else state
            bench.drop_cache(files_of(path))
            rows.append(bench.timed(f"{self.name} [{label}]", "read", nbytes, lambda: self.load(path, target)))
            del target
        finally:
            bench.remove_path(path)
        return rows


    def load(self, path: str, target: dict) -> None:
        loaded = self.read(path, target)
        loaded = target if self.in_place else loaded
        if loaded is not None:
            touch(loaded.values() if isinstance(loaded, dict) else loaded)


def destinations(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # What DCP loads into: the model's tensors, already in memory (made by torch's allocator).
    return {k: torch.ones_like(v) for k, v in state.items()}


def _quiet(action: Callable[[], object]) -> object:
    with warnings.catch_warnings():
        # Without a process group DCP runs as one process, and warns that it does so.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        return action()


def _dcp_read(reader: Callable[[str], Any], *, as_checkpointer: bool = False) -> Callable[[str, dict], object]:
    """``dcp.load`` of the state; ``as_checkpointer``: as FSDPCheckpointer calls it (see
    :func:`_as_checkpointer`). DCP loads in place: ``dest`` is the model's state, made
    before the clock starts."""
    def read(path: str, dest: dict) -> None:
        with _as_checkpointer(dest) if as_checkpointer else contextlib.nullcontext(dest) as state:
            _quiet(lambda: dcp.load(state, storage_reader=reader(path)))
    return read


def _dcp_write(writer: Callable[[str], Any], *, as_checkpointer: bool = False) -> Callable[[dict, str], object]:
    def write(state: dict, path: str) -> None:
        with _as_checkpointer(state) if as_checkpointer else contextlib.nullcontext(state) as given:
            _quiet(lambda: dcp.save(given, storage_writer=writer(path)))
    return write


@contextlib.contextmanager
def _as_checkpointer(state: dict) -> Iterator[dict]:
    """The state as ``FSDPCheckpointer`` hands it to DCP, and as torch's DCP recipes do:
    the model's tensors under one key (``{"model": ...}``), with Python's collector
    paused. torch checks each top-level value for ``Stateful`` and logs a record per
    value, so 4096 tensors at the top cost it about 0.1 s more than the same tensors
    one level down."""
    with gc_paused():
        yield {"model": state}


def ours() -> list[Contender]:
    def read_file(path: str, state: dict) -> dict:
        return load(path)  # verifies every tensor's checksum: every byte is read and hashed

    return [
        Contender("tensorferry save/load", "tf.safetensors", read_file, lambda s, p: save(s, p)),
        # Load only (its file as save writes it): the tensors map the file's cached pages,
        # checksums verified, so every byte is read and hashed here too.
        Contender("tensorferry load(mmap=True)", "tf-mmap.safetensors", lambda p, s: load(p, mmap=True),
                  prepare=lambda s, p: save(s, p)),
        Contender("tensorferry save_checkpoint/load_checkpoint", "tf-ckpt",
                  lambda p, s: load_checkpoint(p), lambda s, p: save_checkpoint(p, s)),
        Contender("tensorferry DCPWriter/DCPReader", "tf-dcp", _dcp_read(DCPReader), _dcp_write(DCPWriter),
                  in_place=True),
        Contender("tensorferry DCPWriter/DCPReader, as FSDPCheckpointer calls DCP",
                  "tf-dcp-ckpt", _dcp_read(DCPReader, as_checkpointer=True),
                  _dcp_write(DCPWriter, as_checkpointer=True), in_place=True),
    ]


class _NoBytesStorage:
    """What :class:`_NoBytesWriter` and :class:`_NoBytesReader` share: a folder that
    holds DCP's ``.metadata`` alone, and plans passed through untouched."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class _NoBytesWriter(_NoBytesStorage, StorageWriter):
    """A DCP storage writer that moves no tensor bytes: it keeps only DCP's metadata,
    so that ``dcp.save`` through it measures torch's own planning and bookkeeping,
    which any storage writer pays on top of its writes."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def write_data(self, plan: Any, planner: Any) -> Future:
        future: Future = Future()
        future.set_result([WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items])
        return future

    def finish(self, metadata: Any, results: Any) -> None:
        os.makedirs(self.path)
        with open(os.path.join(self.path, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)


class _NoBytesReader(_NoBytesStorage, StorageReader):
    """The reader of :class:`_NoBytesWriter`'s metadata: every item is resolved and
    committed, as DCP's planner needs, with no bytes read."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            return pickle.load(f)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def read_data(self, plan: Any, planner: Any) -> Future:
        for item in plan.items:
            planner.commit_tensor(item, planner.resolve_tensor(item))
        future: Future = Future()
        future.set_result(None)
        return future


def torch_dcp_alone() -> list[Contender]:
    """``dcp.save``/``dcp.load`` through a storage layer that moves no tensor bytes:
    torch's own cost per save and load (planning, per-item bookkeeping, its debug
    logger), the floor under every DCP storage writer and reader; called both ways
    ours is."""
    return [Contender("reference: torch DCP alone, a storage layer that moves no bytes", "dcp-alone",
                      _dcp_read(_NoBytesReader), _dcp_write(_NoBytesWriter), in_place=True),
            Contender("reference: torch DCP alone, as FSDPCheckpointer calls DCP", "dcp-alone-ckpt",
                      _dcp_read(_NoBytesReader, as_checkpointer=True),
                      _dcp_write(_NoBytesWriter, as_checkpointer=True), in_place=True)]


def jax_contender(skipped: dict[str, str]) -> list[Contender]:
    """``FerryCheckpointHandler`` under Orbax's ``Checkpointer``: the JAX save and restore."""
    try:
        import jax
        import orbax.checkpoint as ocp

        from tensorferry.adapters.jax import FerryCheckpointHandler, FerryRestore, FerrySave
    except ImportError as exc:
        skipped["tensorferry FerryCheckpointHandler (JAX)"] = f"not installed ({exc})"
        return []
    checkpointer = ocp.Checkpointer(FerryCheckpointHandler())

    def convert(state: dict) -> dict:
        return {k: jax.device_put(v.numpy()) for k, v in state.items()}

    def abstract(state: dict) -> dict:
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}

    def reader(mapped: bool) -> Callable[[str, dict], None]:
        def read(path: str, target: dict) -> dict:
            return jax.block_until_ready(checkpointer.restore(path, args=FerryRestore(target, mmap=mapped)))
        return read

    def save(state: dict, path: str) -> None:
        checkpointer.save(path, args=FerrySave(state))

    return [Contender("tensorferry FerryCheckpointHandler (JAX)", "tf-jax", reader(False), save, convert=convert,
                      target=abstract),
            Contender("tensorferry FerryCheckpointHandler (JAX), restore with mmap=True", "tf-jax-mmap", reader(True),
                      prepare=save, convert=convert, target=abstract)]


def peers(skipped: dict[str, str]) -> list[Contender]:
    """The peers installed here; those that are not go into ``skipped`` with the reason."""
    found = [
        Contender("torch.save/torch.load", "peer.pt", lambda p, s: torch.load(p, map_location="cpu"),
                  lambda s, p: torch.save(s, p)),
        # Four writer threads, as ours write: its thread_count is 1 unless asked.
        Contender("DCP FileSystemWriter/Reader", "peer-dcp", _dcp_read(dcp.FileSystemReader),
                  _dcp_write(_dcp_file_system_writer), in_place=True),
        Contender("DCP FileSystemWriter/Reader, as FSDPCheckpointer calls DCP", "peer-dcp-ckpt",
                  _dcp_read(dcp.FileSystemReader, as_checkpointer=True),
                  _dcp_write(_dcp_file_system_writer, as_checkpointer=True), in_place=True),
    ]
    try:
        from safetensors.torch import load_file, save_file

        found.append(Contender("safetensors save_file/load_file", "peer.safetensors",
                               lambda p, s: load_file(p), lambda s, p: save_file(s, p)))
    except ImportError as exc:
        skipped["safetensors"] = f"not installed ({exc})"
        save_file = None
    if save_file is not None:
        found.append(_huggingface_folder(save_file))
    for make in (_runai, _fastsafetensors, _tensorizer, _fastpersist):
        try:
            found.append(make(save_file))
        except Exception as exc:  # an optional peer: why it cannot run is the result
            skipped[make.__doc__.split(":")[0]] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return found


def _dcp_file_system_writer(path: str) -> Any:
    return dcp.FileSystemWriter(path, thread_count=bench.DCP_THREADS)


def _huggingface_folder(save_file: Any) -> Contender:
    """Our ``load_checkpoint`` of a Hugging Face folder: ``model.safetensors`` as the
    safetensors package writes it, hence without checksums to verify."""
    def prepare(state: dict, path: str) -> None:
        os.makedirs(path)
        save_file(state, os.path.join(path, "model.safetensors"))

    return Contender("tensorferry load_checkpoint (Hugging Face folder)", "hf-folder",
                     lambda p, s: load_checkpoint(p), prepare=prepare)


def _runai(save_file: Any) -> Contender:
    """Run:ai model streamer: ``SafetensorsStreamer`` on a safetensors file"""
    from runai_model_streamer import SafetensorsStreamer

    def read(path: str, state: dict) -> None:
        loaded = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(path)
            for name, tensor in streamer.get_tensors():
                touch([tensor])  # its tensors are views of a buffer it may reuse: touched as they come
                loaded[name] = tensor

    return Contender("Run:ai model streamer", "runai.safetensors", read, prepare=_needs(save_file))


def _fastsafetensors(save_file: Any) -> Contender:
    """fastsafetensors: ``SafeTensorsFileLoader`` in CPU mode (nogds)"""
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    def read(path: str, state: dict) -> None:
        loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
        try:
            loader.add_filenames({0: [path]})
            buffer = loader.copy_files_to_device()
            try:
                touch(buffer.get_tensor(name) for name in state)
            finally:
                buffer.close()
        finally:
            loader.close()

    return Contender("fastsafetensors (CPU, nogds)", "fst.safetensors", read, prepare=_needs(save_file))


def _tensorizer(save_file: Any) -> Contender:
    """tensorizer: ``TensorSerializer``/``TensorDeserializer``"""
    from tensorizer import TensorDeserializer, TensorSerializer

    def write(state: dict, path: str) -> None:
        serializer = TensorSerializer(path)
        serializer.write_state_dict(state)
        serializer.close()

    def read(path: str, state: dict) -> None:
        with TensorDeserializer(path, device="cpu") as tensors:
            touch(tensors.values())  # its tensors may not outlive the deserializer

    return Contender("tensorizer", "peer.tensors", read, write)


def _fastpersist(save_file: Any) -> Contender:
    """DeepSpeed FastPersist: ``torch.save`` into ``deepspeed.io.FastFileWriter``"""
    handle = _deepspeed_handle(8 << 20, 32)
    import deepspeed.io.fast_file_writer as fast_file_writer
    from deepspeed.io import FastFileWriter, FastFileWriterConfig
    from deepspeed.ops.op_builder.utils import UtilsBuilder

    # FastFileWriter loads DeepSpeed's "utils" op (a byte cast, plain C++). Without a GPU,
    # DeepSpeed's CPU accelerator names a builder that refuses to load it; the generic
    # builder, the one a GPU machine uses, builds and runs it here.
    fast_file_writer.UtilsBuilder = UtilsBuilder
    UtilsBuilder().load()

    pinned = torch.zeros(64 << 20, dtype=torch.uint8).pin_memory() if torch.cuda.is_available() \
        else handle.new_cpu_locked_tensor(64 << 20, torch.empty(0, dtype=torch.uint8))

    def write(state: dict, path: str) -> None:
        config = FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=pinned, double_buffer=True,
                                      num_parallel_writers=1, writer_rank=0)
        writer = FastFileWriter(file_path=path, config=config)
        torch.save(state, writer)
        writer.close()

    return Contender("DeepSpeed FastPersist (torch.save into FastFileWriter)", "fastpersist.pt",
                     lambda p, s: torch.load(p, map_location="cpu"), write)


def _needs(save_file: Any) -> Callable[[dict, str], object]:
    if save_file is None:
        raise ImportError("needs the safetensors package to write its input")
    return lambda state, path: save_file(state, path)


def _deepspeed_handle(block_size: int, queue_depth: int) -> Any:
    """DeepSpeed's ``aio_handle`` (its async I/O op, built on first use; needs libaio-dev)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise ImportError("DeepSpeed's async_io op cannot build here (libaio-dev missing?)")
    return builder.load(verbose=False).aio_handle(block_size, queue_depth, False, True, 1)


def state_rounds(directory: str, states: dict[str, dict[str, torch.Tensor]], repeat: int,
                 skipped: dict[str, str], progress: Callable[[str], None]) -> Rows:
    """Every contender on every state, fio included, in interleaved rounds."""
    contenders = [*ours(), *torch_dcp_alone(), *jax_contender(skipped), *peers(skipped)]
    rows: Rows = []
    for label, state in states.items():
        nbytes = sum(t.nbytes for t in state.values())

        def fio(label: str = label, nbytes: int = nbytes) -> Rows:
            measured = bench.fio_rows(directory, nbytes)
            for m in measured:
                m.name = f"fio [{label}]"
            return measured

        runs = [fio, *(lambda c=c, label=label, state=state: c.run(directory, state, label) for c in contenders)]
        for turn in range(repeat):
            progress(f"{label}: round {turn + 1} of {repeat}")
            for run in bench.in_turn(runs, turn):
                rows += run()
    return rows


RAW_SETTINGS = {"1 MiB blocks, depth 32": (1 << 20, 32), "16 MiB blocks, depth 64": (16 << 20, 64)}


def raw_rounds(directory: str, nbytes: int, repeat: int, skipped: dict[str, str],
               progress: Callable[[str], None]) -> Rows:
    """One file written (fsync counted) and read cold: fio, our ``Engine`` at its
    default settings and at each of ``RAW_SETTINGS``, and DeepSpeed's ``aio_handle``
    at each of them (its own page-locked tensor), where it builds."""
    data = bench.aligned_random(nbytes)
    rows: Rows = []
    try:
        handles = {label: _deepspeed_handle(*s) for label, s in RAW_SETTINGS.items()}
    except Exception as exc:
        skipped["DeepSpeed aio_handle"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        handles = {}
    locked = None
    if handles:
        first = next(iter(handles.values()))
        locked = first.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
        locked.copy_(torch.from_numpy(data))
    path = os.path.join(directory, "raw.bin")

    def engine(label: str, config: IOConfig | None) -> Callable[[], Rows]:
        name = f"tensorferry Engine, {'defaults' if config is None else 'these settings'} [{label}]"

        def run() -> Rows:
            bench.remove_path(path)
            with Engine(config) as e:
                def write() -> None:
                    with open(path, "wb") as f:
                        e.pwrite(data, path, 0).result()
                        os.fsync(f.fileno())
                rows = [bench.timed(name, "write", nbytes, write)]
                bench.drop_cache([path])
                rows.append(bench.timed(name, "read", nbytes,
                                        lambda: e.pread(data, path, 0).result()))
            bench.remove_path(path)
            return rows
        return run

    def deepspeed(label: str, handle: Any) -> Callable[[], Rows]:
        def run() -> Rows:
            bench.remove_path(path)

            def write() -> None:
                handle.sync_pwrite(locked, path)
                bench.fsync_tree(path)
            rows = [bench.timed(f"DeepSpeed aio_handle [{label}]", "write", nbytes, write)]
            bench.drop_cache([path])
            rows.append(bench.timed(f"DeepSpeed aio_handle [{label}]", "read", nbytes,
                                    lambda: handle.sync_pread(locked, path)))
            bench.remove_path(path)
            return rows
        return run

    def fio(label: str, block: int, depth: int) -> Callable[[], Rows]:
        def run() -> Rows:
            try:
                measured = [bench.run_fio(directory, op, nbytes, block, depth) for op in ("write", "read")]
            finally:
                bench.remove_fio_file(directory)
            for m in measured:
                m.name = f"fio [{label}]"
            return measured
        return run

    runs = []
    for label, (block, depth) in RAW_SETTINGS.items():
        block = min(block, nbytes)  # fio refuses blocks larger than the file
        runs += [fio(label, block, depth), engine(label, None)]
        runs.append(engine(label, default_config().replace(block_size=block, queue_depth=depth)))
        if label in handles:
            runs.append(deepspeed(label, handles[label]))
    for turn in range(repeat):
        progress(f"raw: round {turn + 1} of {repeat}")
        for run in bench.in_turn(runs, turn):
            rows += run()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--size", type=size_arg, default="2G", help="bytes of each state and of the raw transfers")
    parser.add_argument("--counts", type=counts_arg, default="64,4096", help="tensors per state, comma-separated")
    parser.add_argument("--repeat", type=count_arg, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--no-raw", dest="raw", action="store_false", help="leave out the raw engine rounds")
    parser.add_argument("--json", action="store_true")
    bench.add_results_option(parser)
    args = parser.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    started = time.time()
    nbytes = args.size

    def progress(step: str) -> None:
        print(f"[{time.time() - started:6.0f} s] {step}", file=sys.stderr, flush=True)

    skipped: dict[str, str] = {}
    with _stdout_to_stderr():  # the peers' own output (DeepSpeed logs there) stays out of the report
        states = {f"{count} arrays": make_state(nbytes, count) for count in args.counts}
        rows = state_rounds(args.dir, states, args.repeat, skipped, progress)
        states.clear()
        if args.raw:
            rows += raw_rounds(args.dir, nbytes, args.repeat, skipped, progress)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}", file=sys.stderr)
    bench.save_run(args, "peers", ["python", *sys.argv], args.dir, started, measurements=rows, skipped=skipped)
    print(bench.report(bench.best_of(rows), args.json))
    return 0


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Sends what is written to stdout meanwhile to stderr, at the file descriptor: print,
    loggers that took ``sys.stdout`` when made (DeepSpeed's) and native code alike."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        ctypes.CDLL(None).fflush(None)  # C's buffered stdout, before it is stdout again
        os.dup2(saved, 1)
        os.close(saved)


if __name__ == "__main__":
    with bench.freed_memory_kept():
        sys.exit(main())
