"""Throughput benchmarks against fio and the stock peers, measured in the same run,
and the adaptive search for the best engine settings of a drive (:func:`tune`).

Writes are timed until durable (fsync included); reads start from a dropped page
cache (``posix_fadvise(DONTNEED)`` on each file after an fsync). Run
``python -m tensorferry.bench engine --dir DIR --size 2G``; ``--results DIR`` also
writes the run as a JSON result file (see :func:`save_results`), from which
``benchmarks/report.py`` renders docs/benchmarks.md. The method: docs/benchmarks.md.

Run as root in a VM guest, a benchmark holds the guest's free page reporting back
while it runs (/sys/module/page_reporting/parameters) and puts it back after; of
overlapping runs, the last to end puts back what the first found (:func:`freed_memory_kept`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import fcntl
import gc
import json
import math
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from .buffers import byte_view
from .config import IOConfig, count_arg, counts_arg, parse_size, size_arg
from .engine import DirectIOFallbackWarning, Engine, io_uring_probe
from .engine import open as open_file
from .errors import TensorferryError

Progress = Callable[[str], None]
FIO_FILE = "fio.bin"


@dataclass
class Measurement:
    """One timed transfer."""

    name: str
    op: str  # "write" or "read"
    nbytes: int
    seconds: float
    cpu_seconds: float
    peak_rss_growth: int | None = None  # bytes, where the run measured it
    # Set by best_of: the median over rounds of this contender's speed divided by that of
    # the fio run of the same round, which the drive's drift between rounds does not move.
    median_round_ratio: float | None = None

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def cpu_per_gb(self) -> float:
        return self.cpu_seconds / (self.nbytes / 1e9)


CHECKSUM_ROW = "xxh3 checksums of the state"


def drop_cache(paths: Iterable[str]) -> None:
    """Evicts the files' pages from the page cache (written data is flushed first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(directory: str) -> list[str]:
    """Every regular file below ``directory``."""
    return [os.path.join(root, f) for root, _, names in os.walk(directory) for f in names]


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def timed(name: str, op: str, nbytes: int, action: Callable[[], object],
          progress: Progress | None = None, *, track_rss: bool = False) -> Measurement:
    """Runs ``action`` and measures wall and CPU time (this process and its children).

    ``progress``, if given, is told the step's name before it starts. Memory for
    ``nbytes`` is touched and freed first (see :func:`warm_memory`), the same for
    every contender. ``track_rss`` records how far the resident set grew at its peak.

    Python's collector runs to the end first: a full collection is set off by the
    objects that all earlier steps left promoted, and walks the whole process (0.2-0.28 s
    in the peers benchmark, with every peer imported), so without it a step paid for
    the steps before it, by chance. A step still pays for the collections it sets off.
    """
    if progress is not None:
        progress(f"{name} {op}")
    gc.collect()
    warm_memory(nbytes)
    _peak_rss_reset()
    rss_before = _rss_bytes("VmRSS")
    cpu0 = _cpu_seconds(resource.RUSAGE_SELF) + _cpu_seconds(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    action()
    seconds = time.perf_counter() - start
    cpu = _cpu_seconds(resource.RUSAGE_SELF) + _cpu_seconds(resource.RUSAGE_CHILDREN) - cpu0
    growth = _rss_bytes("VmHWM") - rss_before if track_rss else None
    return Measurement(name, op, nbytes, seconds, cpu, growth)


def fio_available() -> bool:
    return shutil.which("fio") is not None


def run_fio(directory: str, op: str, nbytes: int, block_size: int = 1 << 20, iodepth: int = 32,
            progress: Progress | None = None) -> Measurement:
    """fio with io_uring and O_DIRECT on ``directory``: the drive's ceiling.

    Writes go to a new file and end with an fsync (``--end_fsync=1``), which fio
    counts in its runtime of the op; that runtime (not fio's start-up) is the time taken.
    A read reads the file the last write made; :func:`remove_fio_file` cleans up.
    Where the filesystem refuses O_DIRECT (a ramfs), fio runs buffered, as the engine
    does there, with a :class:`DirectIOFallbackWarning`. A failed run raises a
    :class:`TensorferryError` with the end of fio's own message.
    """
    if progress is not None:
        progress(f"fio {op}")
    path = os.path.join(directory, FIO_FILE)
    if op == "write" and os.path.exists(path):
        os.unlink(path)
    cmd = ["fio", "--name=ceiling", f"--filename={path}", f"--size={nbytes}", f"--rw={op}",
           f"--bs={block_size}", f"--iodepth={iodepth}", "--ioengine=io_uring", "--end_fsync=1",
           "--output-format=json"]
    if op == "read":
        drop_cache([path])
    cpu0 = _cpu_seconds(resource.RUSAGE_CHILDREN)
    direct = _filesystem_id(directory) not in _fio_buffered_filesystems
    # At its fastest: buffers and file registered with the ring, so that the kernel does not
    # pin each request's pages again (reads measured 0.8-1.0 GB/s without, 1.0-2.0 with, here).
    registered = ["--fixedbufs", "--registerfiles"] if _fio_registers else []
    run = subprocess.run(cmd + ["--direct=1"] * direct + registered, capture_output=True, text=True)
    if registered and run.returncode != 0 and _fio_job(run.stdout).get("error") in (errno.ENOMEM, errno.EPERM):
        _fio_registers.clear()  # RLIMIT_MEMLOCK too low to register its buffers: as fio runs by default
        registered = []
        run = subprocess.run(cmd + ["--direct=1"] * direct, capture_output=True, text=True)
    if direct and run.returncode != 0 and _fio_job(run.stdout).get("error") == errno.EINVAL:
        _fio_buffered_filesystems.add(_filesystem_id(directory))
        warnings.warn(f"the filesystem holding {directory} does not support O_DIRECT; fio runs buffered "
                      "there, as the engine does", DirectIOFallbackWarning, stacklevel=2)
        run = subprocess.run(cmd + registered, capture_output=True, text=True)
    cpu = _cpu_seconds(resource.RUSAGE_CHILDREN) - cpu0
    if run.returncode != 0:
        said = [line for line in (run.stderr + run.stdout).splitlines() if line.startswith("fio")]
        raise TensorferryError(f"fio could not {op} {path} (exit status {run.returncode}): "
                               + ("; ".join(said[-3:]) or run.stderr.strip()[-500:] or "it gave no reason"))
    # fio's time of the op in whole ms (its start-up not counted, the end fsync counted),
    # rounded up from microseconds: never 0 once it moved a byte, and 1 ms too long at most.
    # The finer clocks fio reports (latencies in ns) time single requests, not the run, and
    # timing the process here would count its start-up (about 0.3 s on the development VM).
    milliseconds = _fio_job(run.stdout).get(op, {}).get("runtime", 0)
    if milliseconds <= 0:
        raise TensorferryError(f"fio timed no {op} of {path}: nothing to compare with")
    if milliseconds < FIO_FINE_MS and nbytes not in _fio_coarse_sizes:
        _fio_coarse_sizes.add(nbytes)  # once: Python's own once-only is reset by any catch_warnings
        warnings.warn(f"fio's {op} of {nbytes / 2**20:g} MiB took under {FIO_FINE_MS} ms, and its clock counts "
                      "whole ms: its GB/s may be understated; a larger --size times it better", stacklevel=2)
    return Measurement("fio", op, nbytes, milliseconds / 1e3, cpu)


FIO_FINE_MS = 20  # fio's runtime is in whole ms: below this the rounding may exceed 5%
_fio_buffered_filesystems: set[int] = set()  # where fio's O_DIRECT open was refused (EINVAL)
_fio_coarse_sizes: set[int] = set()  # sizes warned of as too small for fio's clock
_fio_registers = [True]  # emptied where fio could not register its buffers (memlock)


def _filesystem_id(directory: str) -> int:
    return os.stat(directory).st_dev


def _fio_job(output: str) -> dict[str, Any]:
    """The first job of fio's JSON report (fio prints it after a failure too), or {}."""
    try:
        return json.loads(output[output.index("{"):])["jobs"][0]
    except (ValueError, LookupError):
        return {}


def rounds_beside_fio(action: Callable[[], float], directory: str, nbytes: int, rounds: int,
                      ops: Sequence[str] = ("read",)) -> tuple[list[float], list[float]]:
    """Each of ``rounds`` runs of ``action`` (which returns the seconds it took) right
    after fio moved ``nbytes`` with each op of ``ops`` in turn: the action's seconds, and
    fio's (its ops' summed, per round; empty without fio). The disk here changes speed
    from minute to minute, so each round is judged against the fio run beside it."""
    times: list[float] = []
    fio_times: list[float] = []
    paired = fio_available()
    try:
        if paired and ops[0] != "write":  # a read needs the file a write makes
            run_fio(directory, "write", nbytes)
        for _ in range(rounds):
            if paired:
                fio_times.append(sum(run_fio(directory, op, nbytes).seconds for op in ops))
            times.append(action())
    finally:
        remove_fio_file(directory)
    return times, fio_times


def remove_fio_file(directory: str) -> None:
    """Deletes the file :func:`run_fio` left in ``directory``, if any."""
    path = os.path.join(directory, FIO_FILE)
    if os.path.exists(path):
        os.unlink(path)


def fio_rows(directory: str, nbytes: int, progress: Progress | None = None) -> list[Measurement]:
    """fio's write and then read of ``nbytes`` (nothing where fio is not installed); the
    file is removed afterwards. Benchmarks run this as one contender among the others,
    in turn with them: it too gains or loses by where it stands in a round."""
    if not fio_available():
        return []
    try:
        return [run_fio(directory, "write", nbytes, progress=progress),
                run_fio(directory, "read", nbytes, progress=progress)]
    finally:
        remove_fio_file(directory)


def aligned_random(nbytes: int, seed: int = 0) -> np.ndarray:
    """Random bytes in page-aligned memory, as fio's buffers are.

    numpy's own large allocations start 16 bytes past a page boundary, which would
    send every O_DIRECT transfer through the engine's staging copies.
    """
    base = np.empty(nbytes + 4096, np.uint8)
    data = base[(-base.ctypes.data) % 4096:][:nbytes]
    data[:] = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    return data


def engine_round(directory: str, backend: str, data: np.ndarray, config: IOConfig | None = None,
                 read: bool = True, progress: Progress | None = None) -> list[Measurement]:
    """Writes ``data`` to a new file through an engine (fsync included), then (unless
    ``read`` is false) reads it back cold; the file is removed afterwards.

    ``config`` (default: the default configuration) supplies the settings other than the backend.
    """
    path = os.path.join(directory, f"engine-{backend}.bin")
    if os.path.exists(path):
        os.unlink(path)
    try:
        with Engine(config, backend=backend) as engine:
            def write() -> None:
                with open_file(path, "w") as f:
                    engine.write(data, f)
                    f.fsync()

            results = [timed(f"tensorferry {backend}", "write", data.nbytes, write, progress)]
            if read:
                drop_cache([path])
                results.append(timed(f"tensorferry {backend}", "read", data.nbytes,
                                     lambda: engine.read(data, path), progress))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return results


def write_bandwidth(directory: str, nbytes: int, chunk: int = 64 << 20) -> Measurement:
    """Writes ``nbytes`` to a new file in ``directory`` with the default engine
    settings, fsync included, and deletes it: the drive's durable write speed.

    One ``chunk`` of memory is written over and over, so memory stays small.
    """
    data = aligned_random(min(chunk, nbytes))
    path = os.path.join(directory, "tensorferry-write-probe.bin")
    try:
        with Engine() as engine:
            def write() -> None:
                with open_file(path, "w") as f:
                    futures = [engine.pwrite(data, f, offset, min(data.nbytes, nbytes - offset))
                               for offset in range(0, nbytes, data.nbytes)]
                    for future in futures:
                        future.result()
                    f.fsync()

            return timed("tensorferry write", "write", nbytes, write)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def report_rows(measurements: list[Measurement]) -> list[dict[str, Any]]:
    """Each measurement as a dict with GB/s, CPU s/GB and the ratio to fio for the same operation."""
    # Each measurement is compared with the fio run of the same operation and label.
    ceilings = {(m.op, _label(m)): m.gbps for m in measurements if m.name.startswith("fio")}
    rows = []
    for m in measurements:
        ceiling = ceilings.get((m.op, _label(m)))
        ratio = m.gbps / ceiling if ceiling else None
        rows.append({**asdict(m), "gbps": round(m.gbps, 3), "cpu_s_per_gb": round(m.cpu_per_gb, 3),
                     "ratio_to_fio": None if ratio is None else round(ratio, 3)})
    return rows


def report(measurements: list[Measurement], as_json: bool = False) -> str:
    """A table (or JSON) of GB/s, CPU s/GB and the ratio to fio for the same operation;
    after rounds (see :func:`best_of`), also the median of the same-round ratios."""
    rows = report_rows(measurements)
    if as_json:
        return json.dumps(rows, indent=2)
    width = max([len("what"), *(len(r["name"]) for r in rows)]) + 2
    rounds = any(r["median_round_ratio"] is not None for r in rows)
    lines = [f"{'what':<{width}}{'op':<7}{'GB/s':>8}{'CPU s/GB':>10}{'vs fio':>8}"
             + (f"{'median same-round vs fio':>26}" if rounds else "")]
    for r in rows:
        ratio = "" if r["ratio_to_fio"] is None else f"{r['ratio_to_fio']:.2f}"
        median = "" if r["median_round_ratio"] is None else f"{r['median_round_ratio']:.2f}"
        lines.append(f"{r['name']:<{width}}{r['op']:<7}{r['gbps']:>8.2f}{r['cpu_s_per_gb']:>10.2f}{ratio:>8}"
                     + (f"{median:>26}" if rounds else ""))
    lines += [f"peak RSS growth during {r['name']}: {r['peak_rss_growth'] / 2**20:.0f} MiB"
              for r in rows if r["peak_rss_growth"] is not None]
    for r in rows:
        if r["op"] == "hash":
            suffix = r["name"].removeprefix(CHECKSUM_ROW)
            save = next((s for s in rows if s["name"] == "tensorferry save" + suffix), None)
            if save:
                lines.append(f"checksums{suffix}: {save['gbps'] / r['gbps']:.1%} of the save's time "
                             "if none of it overlapped the writes")
    return "\n".join(lines)


def bench_engine(directory: str, nbytes: int, backends: list[str], repeat: int = 1,
                 progress: Progress | None = None, *, rounds: bool = False) -> list[Measurement]:
    """fio and each backend, interleaved so that drift in the drive hits all alike: the
    best round of each (see :func:`best_of`), or with ``rounds`` every round's measurements."""
    data = aligned_random(nbytes)
    results: list[Measurement] = []
    contenders = [lambda: fio_rows(directory, nbytes, progress),
                  *(lambda backend=backend: engine_round(directory, backend, data, progress=progress)
                    for backend in backends)]
    for turn in range(repeat):
        for contender in in_turn(contenders, turn):
            results += contender()
    return results if rounds else best_of(results)


def reader_rounds(directory: str, files: list[str], nbytes: int, readers: dict[str, Callable[[], object]],
                  repeat: int = 1, *, rounds: bool = False) -> list[Measurement]:
    """fio's read of ``nbytes`` on ``directory``, then each reader (a callable that reads
    ``files`` through), every one from a dropped page cache, ``repeat`` times, fio
    included in an order rotated every round; the best round of each (see
    :func:`best_of`), or with ``rounds`` every round's measurements."""
    def reader(name: str, read: Callable[[], object]) -> Callable[[], list[Measurement]]:
        def run() -> list[Measurement]:
            drop_cache(files)
            return [timed(name, "read", nbytes, read)]
        return run

    def fio_read() -> list[Measurement]:
        return [m for m in fio_rows(directory, nbytes) if m.op == "read"]

    contenders = [fio_read, *(reader(name, read) for name, read in readers.items())]
    results = []
    for turn in range(repeat):
        for contender in in_turn(contenders, turn):
            results += contender()
    return results if rounds else best_of(results)


def _label(m: Measurement) -> str:
    return m.name[m.name.index(" ["):] if " [" in m.name else ""


def best_of(results: list[Measurement]) -> list[Measurement]:
    """The fastest round of each contender, with the largest memory growth of any round
    and the median of its ratios to the fio run of its own round. ``results`` are in
    the order they were measured; a round ends where a contender comes again."""
    best: dict[tuple[str, str], Measurement] = {}
    growth: dict[tuple[str, str], int] = {}
    ratios: dict[tuple[str, str], list[float]] = {}

    def close_round(round_: dict[tuple[str, str], Measurement]) -> None:
        fio = {(m.op, _label(m)): m.gbps for m in round_.values() if m.name.startswith("fio")}
        for key, m in round_.items():
            if not m.name.startswith("fio") and (m.op, _label(m)) in fio:
                ratios.setdefault(key, []).append(m.gbps / fio[(m.op, _label(m))])

    current: dict[tuple[str, str], Measurement] = {}
    for m in results:
        key = (m.name, m.op)
        if key in current:
            close_round(current)
            current = {}
        current[key] = m
        if key not in best or m.gbps > best[key].gbps:
            best[key] = m
        if m.peak_rss_growth is not None:
            growth[key] = max(growth.get(key, 0), m.peak_rss_growth)
    close_round(current)
    return [replace(m, peak_rss_growth=growth.get(key),
                    median_round_ratio=statistics.median(ratios[key]) if key in ratios else None)
            for key, m in best.items()]


def _peak_rss_reset() -> None:
    # Writing 5 to clear_refs resets VmHWM, the peak resident set, for this process.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def make_state(nbytes: int, count: int) -> dict[str, np.ndarray]:
    """``count`` random float32 arrays adding up to ``nbytes``."""
    rng = np.random.default_rng(1)
    each = nbytes // count // 4
    return {f"layer{i:05d}.weight": rng.standard_normal(each, dtype=np.float32) for i in range(count)}


def in_turn(contenders: list, turn: int) -> list:
    """``contenders`` in the order of round ``turn`` of a Williams design: over ``n``
    rounds (``2n`` for an odd count) each takes every place, and follows every other
    contender, equally often. On the development VM a write was often slower right
    after another's; a plain rotation keeps who follows whom, so the same contender
    would always pay for the same predecessor."""
    n = len(contenders)
    if n < 2:
        return list(contenders)
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    order = [(j + turn) % n for j in first]
    if n % 2 and (turn // n) % 2:  # an odd count needs the mirrored rounds too
        order.reverse()
    return [contenders[j] for j in order]


def bench_checkpoint(directory: str, state: dict[str, np.ndarray], label: str | None = None, *,
                     fio: bool = True, progress: Progress | None = None, turn: int = 0) -> list[Measurement]:
    """save_checkpoint / load_checkpoint against fio and the usual ways of saving state.

    The peers are a plain Python write, safetensors, ``torch.save`` and torch's DCP
    ``FileSystemWriter``/``FileSystemReader``, each where installed; they and fio run
    in an order rotated by ``turn`` (pass the round's number). ``label``, if given, is
    appended to every name (and pairs each row with its own fio run); ``fio=False``
    leaves the fio runs to the caller.
    """
    from . import shard

    nbytes = sum(a.nbytes for a in state.values())
    results: list[Measurement] = []
    contenders = [_tensorferry_rows, _python_write_rows, _safetensors_rows, _torch_peers]
    if fio:
        contenders.insert(0, lambda directory, state, progress: fio_rows(directory, nbytes, progress))
    for contender in in_turn(contenders, turn):
        results += contender(directory, state, progress)
    # The checksums alone, on one core: an upper bound on what they add to a save, where
    # they run while the writes are in flight (``checksum_cost`` measures what they add).
    results.append(timed(CHECKSUM_ROW, "hash", nbytes,
                         lambda: [shard.digest(byte_view(a, writable=False)) for a in state.values()], progress))
    if label is not None:
        for m in results:
            m.name = f"{m.name} [{label}]"
    return results


def _tensorferry_rows(directory: str, state: dict[str, np.ndarray], progress: Progress | None) -> list[Measurement]:
    from . import checkpoint

    nbytes = sum(a.nbytes for a in state.values())
    target = os.path.join(directory, "ckpt")
    shutil.rmtree(target, ignore_errors=True)
    results = [timed("tensorferry save", "write", nbytes, lambda: checkpoint.save_checkpoint(target, state),
                     progress, track_rss=True)]
    drop_cache(files_under(target))
    results.append(timed("tensorferry load", "read", nbytes, lambda: checkpoint.load_checkpoint(target), progress))
    existing = {name: a.copy() for name, a in state.items()}  # a model's parameters, already in memory
    drop_cache(files_under(target))
    results.append(timed("tensorferry load in place", "read", nbytes,
                         lambda: checkpoint.load_checkpoint(target, out=existing), progress))
    existing.clear()  # the copies go before the peers run
    shutil.rmtree(target)
    return results


def _python_write_rows(directory: str, state: dict[str, np.ndarray], progress: Progress | None) -> list[Measurement]:
    nbytes = sum(a.nbytes for a in state.values())
    plain = os.path.join(directory, "plain.bin")

    def python_write() -> None:
        with open(plain, "wb") as f:
            for a in state.values():
                f.write(memoryview(a).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    result = timed("python write+fsync", "write", nbytes, python_write, progress)
    os.unlink(plain)
    return [result]


def _safetensors_rows(directory: str, state: dict[str, np.ndarray], progress: Progress | None) -> list[Measurement]:
    from . import shard

    try:
        import safetensors.numpy as stnp
    except ImportError:
        return []
    nbytes = sum(a.nbytes for a in state.values())
    st_path = os.path.join(directory, "peer.safetensors")

    def st_save() -> None:
        stnp.save_file(state, st_path)
        _fsync_path(st_path)

    def st_load() -> None:
        loaded = stnp.load_file(st_path)
        for a in loaded.values():  # make sure every byte really came off the disk
            shard.digest(a)

    results = [timed("safetensors save_file", "write", nbytes, st_save, progress)]
    drop_cache([st_path])
    results.append(timed("safetensors load_file", "read", nbytes, st_load, progress))
    os.unlink(st_path)
    return results


def paired_saves(directory: str, nbytes: int, counts: list[int], rounds: int) -> list[dict[str, Any]]:
    """fio's write and one ``save_checkpoint`` per array count, round after round; each
    save is compared with the fio run of its round, so the drive's drift between rounds
    cancels out, and the median of those ratios is reported. fio and the counts take
    turns at going first: on the development VM a write that directly follows another's
    was often the slower."""
    from . import checkpoint

    target = os.path.join(directory, "ckpt")
    states = {count: make_state(nbytes, count) for count in counts}
    fio, saves = [], {count: [] for count in counts}
    for i in range(rounds):
        for count in in_turn([None, *counts], i):  # None: fio's turn
            shutil.rmtree(target, ignore_errors=True)
            if count is None:
                fio.append(run_fio(directory, "write", nbytes).gbps)
                remove_fio_file(directory)
                continue
            state = states[count]
            saves[count].append(timed("save", "write", nbytes, lambda: checkpoint.save_checkpoint(target, state)).gbps)
    shutil.rmtree(target, ignore_errors=True)
    rows = []
    for count in counts:
        ratios = [round(s / f, 3) for s, f in zip(saves[count], fio)]
        rows.append({"arrays": count, "median_ratio": statistics.median(ratios), "ratios": ratios,
                     "save_gbps": [round(g, 3) for g in saves[count]], "fio_gbps": [round(g, 3) for g in fio]})
    return rows


class _NoHash:
    """Stands in for the streaming hasher when saves are timed without checksums."""

    def update(self, data: Any) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 16


def checksum_cost(directory: str, state: dict[str, np.ndarray], pairs: int) -> dict[str, Any]:
    """Saves with and without checksums, alternated (and the order of each pair swapped)
    so that a drive's drift falls on both alike; the medians are compared. The checksums
    run while the writes are in flight, so timing them alone would overstate them."""
    from . import checkpoint, shard

    target = os.path.join(directory, "ckpt")
    nbytes = sum(a.nbytes for a in state.values())
    real = shard.digest, shard.new_hasher
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for i in range(pairs):
            for hashing in (True, False) if i % 2 == 0 else (False, True):
                shutil.rmtree(target, ignore_errors=True)
                shard.digest, shard.new_hasher = real if hashing else (lambda data: "0" * 16, _NoHash)
                times[hashing].append(timed("save", "write", nbytes,
                                            lambda: checkpoint.save_checkpoint(target, state)).seconds)
    finally:
        shard.digest, shard.new_hasher = real
        shutil.rmtree(target, ignore_errors=True)
    with_s, without_s = statistics.median(times[True]), statistics.median(times[False])
    return {"with_s": with_s, "without_s": without_s, "cost": (with_s - without_s) / with_s,
            "pair_differences_s": [round(a - b, 3) for a, b in zip(times[True], times[False])]}


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsyncs a file, or every file below a directory: how a benchmark makes a peer's
    write durable when the peer does not."""
    for name in files_under(path) if os.path.isdir(path) else [path]:
        _fsync_path(name)


def remove_path(path: str) -> None:
    """Removes a file or a directory tree, if it exists."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def torch_available() -> bool:
    """Whether torch (and with it DCP) can be imported, without importing it."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


DCP_THREADS = 4  # as many writers as save_checkpoint runs shards concurrently


def _torch_peers(directory: str, state: dict[str, np.ndarray], progress: Progress | None) -> list[Measurement]:
    """torch.save/torch.load and DCP's FileSystemWriter/Reader (single process), where torch is installed."""
    if not torch_available():
        return []
    import torch
    import torch.distributed.checkpoint as dcp

    nbytes = sum(a.nbytes for a in state.values())
    tensors = {name: torch.from_numpy(a) for name, a in state.items()}  # shares the arrays' memory
    results = []
    path = os.path.join(directory, "peer.pt")

    def torch_save() -> None:
        torch.save(tensors, path)
        _fsync_path(path)

    results.append(timed("torch.save", "write", nbytes, torch_save, progress))
    drop_cache([path])
    results.append(timed("torch.load", "read", nbytes, lambda: torch.load(path, weights_only=True), progress))
    os.unlink(path)

    target = os.path.join(directory, "peer-dcp")
    destination = {name: torch.empty_like(t) for name, t in tensors.items()}
    with warnings.catch_warnings():
        # Without a process group DCP saves as one process, and warns that it does so.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        # FileSystemWriter fsyncs every file it writes (sync_files=True, its default).
        results.append(timed(f"DCP FileSystemWriter, {DCP_THREADS} threads", "write", nbytes,
                             lambda: dcp.save(tensors, storage_writer=dcp.FileSystemWriter(
                                 target, thread_count=DCP_THREADS)), progress))
        drop_cache(files_under(target))
        results.append(timed("DCP FileSystemReader", "read", nbytes,
                             lambda: dcp.load(destination, storage_reader=dcp.FileSystemReader(target)), progress))
    shutil.rmtree(target)
    return results


BLOCK_SIZES = tuple(1 << p for p in range(16, 25))  # 64 KiB .. 16 MiB
PARALLELISM = {"io_uring": tuple(1 << p for p in range(0, 9)),  # queue_depth 1 .. 256
               "threads": tuple(1 << p for p in range(0, 7))}   # threads 1 .. 64
_COARSE_BLOCKS = (256 << 10, 1 << 20, 4 << 20)
_COARSE_PARALLELISM = (4, 16, 64)
_CONFIRM = 3  # the best few settings are measured again before one is chosen


@dataclass
class Trial:
    """One setting tried by :func:`tune`: its throughput and the stage that tried it."""

    backend: str
    block_size: int
    parallelism: int  # queue_depth for io_uring, threads for the threads backend
    stage: str  # "coarse", "refine" or "confirm"
    write_gbps: float | None
    read_gbps: float | None
    score: float  # GB/s for the operation tuned for (both: a write and a read together)

    def config(self, base: IOConfig | None = None) -> IOConfig:
        """The :class:`IOConfig` of this setting (other fields from ``base``)."""
        knob = "queue_depth" if self.backend == "io_uring" else "threads"
        return (base or IOConfig()).replace(backend=self.backend, block_size=self.block_size,
                                            **{knob: self.parallelism})


@dataclass
class TuneResult:
    """What :func:`tune` found: the best setting, the fio ceiling, every trial and why it stopped."""

    config: IOConfig
    best: Trial  # the best setting, with its throughput averaged over its trials
    op: str
    nbytes: int
    fio: dict[str, float] | None  # write_gbps / read_gbps / score, at 1 MiB blocks and depth 32 (best of two)
    stopped: str
    seconds: float
    trials: list[Trial] = field(default_factory=list)

    @property
    def ratio_to_fio(self) -> float | None:
        return self.best.score / self.fio["score"] if self.fio else None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``io_config`` is ``IOConfig(**...)``'s keywords, ``deepspeed`` an ``"aio"`` section."""
        knob = "queue_depth" if self.best.backend == "io_uring" else "threads"
        return {
            "io_config": asdict(self.config),
            "deepspeed": self.config.to_deepspeed(),
            "tuned": ["backend", "block_size", knob],
            "op": self.op, "size": self.nbytes,
            "best": {"write_gbps": self.best.write_gbps, "read_gbps": self.best.read_gbps,
                     "score_gbps": round(self.best.score, 3)},
            "fio": self.fio,
            "ratio_to_fio": None if self.ratio_to_fio is None else round(self.ratio_to_fio, 3),
            "stopped": self.stopped, "seconds": round(self.seconds, 1),
            "trials": [asdict(t) for t in self.trials],
        }


class _Stop(Exception):
    """Ends the search early; the message says why."""


def _score(op: str, write: float | None, read: float | None) -> float:
    if op == "write":
        return write or 0.0
    if op == "read":
        return read or 0.0
    return 2 / (1 / write + 1 / read) if write and read else 0.0  # bytes moved / time, one of each


def _fio_ceiling(directory: str, nbytes: int, op: str, progress: Progress | None) -> dict[str, float] | None:
    """fio's write and read throughput at 1 MiB blocks and depth 32, and their score for ``op``."""
    if not fio_available():
        return None
    write = run_fio(directory, "write", nbytes, progress=progress).gbps
    read = run_fio(directory, "read", nbytes, progress=progress).gbps
    remove_fio_file(directory)
    return {"write_gbps": write, "read_gbps": read, "score": _score(op, write, read),
            "block_size": 1 << 20, "iodepth": 32}


def tune(directory: str, nbytes: int, *, backends: Iterable[str] | None = None, op: str = "both",
         tolerance: float = 0.03, min_gain: float = 0.02, max_seconds: float = 120.0,
         progress: Progress | None = None) -> TuneResult:
    """Searches block size, parallelism and backend for the fastest engine setting on ``directory``.

    Coarse to fine: a 3 x 3 grid of block sizes (256 KiB, 1 MiB, 4 MiB) by depth or
    threads (4, 16, 64) for each backend, then a hill climb in steps of two from the
    best point so far, which stops when no neighbour beats it by ``min_gain``. The
    climb is skipped or cut short once a setting comes within ``tolerance`` of fio's
    throughput (the drive is saturated), and the whole search ends after about
    ``max_seconds``. The best few settings are then measured again and the best on
    average wins. Each trial writes ``nbytes`` to a new file with an fsync and reads
    it back after dropping the page cache; ``op`` ("write", "read" or "both") says
    which throughput counts. Every file made here is removed.
    """
    if op not in ("write", "read", "both"):
        raise ValueError(f"op must be write, read or both, got {op!r}")
    backends = list(backends) if backends is not None else \
        (["io_uring", "threads"] if io_uring_probe()[0] else ["threads"])
    unknown = [b for b in backends if b not in PARALLELISM]
    if unknown or not backends:
        raise ValueError(f"backends must be among {', '.join(PARALLELISM)}, got {backends}")
    start = time.perf_counter()
    data = aligned_random(nbytes)
    blocks = [b for b in BLOCK_SIZES if b <= max(BLOCK_SIZES[0], nbytes // 4)]  # at least 4 blocks
    fio = _fio_ceiling(directory, nbytes, op, progress)
    trials: list[Trial] = []
    measured: dict[tuple[str, int, int], list[Trial]] = {}
    longest = 0.0

    def mean(key: tuple[str, int, int]) -> float:
        return sum(t.score for t in measured[key]) / len(measured[key])

    def run(key: tuple[str, int, int], stage: str) -> float:
        nonlocal longest
        elapsed = time.perf_counter() - start
        # Leave room for the confirmation round, which is not cut short.
        if stage != "confirm" and measured and elapsed + (1 + _CONFIRM) * longest > max_seconds:
            raise _Stop("time budget")
        backend, block, par = key
        trial = Trial(backend, block, par, stage, None, None, 0.0)
        if progress is not None:
            progress(f"{stage} {backend} block {block >> 10} KiB x {par}")
        began = time.perf_counter()
        results = engine_round(directory, backend, data, trial.config(), read=op != "write")
        longest = max(longest, time.perf_counter() - began)
        speeds = {m.op: round(m.gbps, 3) for m in results}
        trial.write_gbps, trial.read_gbps = speeds.get("write"), speeds.get("read")
        trial.score = round(_score(op, trial.write_gbps, trial.read_gbps), 3)
        trials.append(trial)
        measured.setdefault(key, []).append(trial)
        if stage == "refine":
            saturated()
        return trial.score

    def saturated() -> None:
        if fio and max(map(mean, measured)) >= (1 - tolerance) * fio["score"]:
            raise _Stop(f"a setting came within {tolerance:.0%} of fio")

    stopped = "no further improvement"
    try:
        for backend in backends:
            pars = PARALLELISM[backend]
            grid = {(backend, min(blocks, key=lambda b: abs(b - cb)), min(pars, key=lambda p: abs(p - cp)))
                    for cb in _COARSE_BLOCKS for cp in _COARSE_PARALLELISM}
            # The middle of the grid first: the likeliest to be good, should time run out.
            for key in sorted(grid, key=lambda k: (abs(math.log2(k[1] / (1 << 20))) + abs(math.log2(k[2] / 16)), k)):
                run(key, "coarse")
        saturated()
        current = max(measured, key=mean)
        while True:
            backend, block, par = current
            pars = PARALLELISM[backend]
            neighbours = [(backend, b, p) for b, p in ((block // 2, par), (block * 2, par),
                                                       (block, par // 2), (block, par * 2))
                          if b in blocks and p in pars and (backend, b, p) not in measured]
            for key in neighbours:
                run(key, "refine")
            best = max(measured, key=mean)
            if not neighbours or mean(best) <= mean(current) * (1 + min_gain):
                break
            current = best
    except _Stop as stop:
        stopped = str(stop)
    finalists = sorted(measured, key=mean, reverse=True)[:_CONFIRM]
    if len(measured) > 1:
        for key in finalists:
            run(key, "confirm")
    winner = max(finalists, key=mean)
    runs = measured[winner]
    writes = [t.write_gbps for t in runs if t.write_gbps is not None]
    reads = [t.read_gbps for t in runs if t.read_gbps is not None]
    best = Trial(*winner, "best", round(sum(writes) / len(writes), 3) if writes else None,
                 round(sum(reads) / len(reads), 3) if reads else None, round(mean(winner), 3))
    if fio:
        # fio again after the search: one run of a drive that drifts can understate its ceiling.
        again = _fio_ceiling(directory, nbytes, op, progress)
        write, read = max(fio["write_gbps"], again["write_gbps"]), max(fio["read_gbps"], again["read_gbps"])
        fio.update(write_gbps=round(write, 3), read_gbps=round(read, 3), score=round(_score(op, write, read), 3))
    return TuneResult(best.config(), best, op, nbytes, fio, stopped, time.perf_counter() - start, trials)


def warm_memory(nbytes: int) -> None:
    """Touches and frees memory once, so that a virtual machine's first touch of guest
    pages is charged to no contender. Seen here: 0.3 to 3 s per GiB for memory the
    guest has not used lately, against 0.07 for recycled memory; a contender that
    allocates what it loads (all but fio) would otherwise be timed on the hypervisor."""
    block = np.ones(nbytes, np.uint8)
    del block


RESULTS_SCHEMA = "tensorferry.bench/1"


def machine_info(directory: str) -> dict[str, Any]:
    """What a result depends on besides the code: CPUs, memory, kernel, the filesystem
    and device under ``directory``, and the versions of the contenders."""
    from importlib import metadata

    def first_line(path: str, prefix: str = "") -> str | None:
        try:
            with open(path) as f:
                return next((line.split(":", 1)[1].strip() if prefix else line.strip()
                             for line in f if line.startswith(prefix)), None)
        except OSError:
            return None

    mount = ("", None)  # the longest mount point that holds the directory wins
    try:
        with open("/proc/mounts") as f:
            real = os.path.realpath(directory)
            for line in f:
                source, point, fstype = line.split()[:3]
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) > len(mount[0]):
                    mount = (point, f"{fstype} on {source}")
    except OSError:
        pass
    versions = {}
    for package in ("tensorferry", "numpy", "torch", "safetensors", "jax", "orbax-checkpoint", "tensorflow"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    from . import __version__
    versions.setdefault("tensorferry", __version__)
    if fio_available():
        versions["fio"] = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    memory = first_line("/proc/meminfo", "MemTotal")
    return {"cpus": len(os.sched_getaffinity(0)), "cpu_model": first_line("/proc/cpuinfo", "model name"),
            "memory": memory, "kernel": platform.release(), "python": platform.python_version(),
            "filesystem": mount[1], "io_uring": io_uring_probe()[0], "versions": versions,
            "commit": _source_commit(), "free_page_reporting": _outside_runs(_free_page_reporting()),
            "free_page_reporting_during_run": _held_page_reporting}


PAGE_REPORTING = "/sys/module/page_reporting/parameters"
# While a benchmark runs, freed memory waits a minute before it is reported, and up to
# 64 GiB of it may wait: what warm_memory touched is still the guest's when a step runs.
HELD_PAGE_REPORTING = {"min_free_ms": "60000", "max_waiting_mib": "65536"}
_held_page_reporting: dict[str, str] | None = None  # the settings the last run held
_holders_here = 0  # nested holders in this process: the outermost holds and puts back
_holders_lock = threading.Lock()
_record_fd: int | None = None  # while this process holds: the record, under its shared lock


def _free_page_reporting() -> dict[str, str] | None:
    """A VM guest's free page reporting settings, or None where there is none. With it,
    memory a process frees goes back to the host (at once where ``min_free_ms`` is 0),
    and whoever touches it next pays the host's faults."""
    settings = {}
    for name in ("page_reporting_order", "min_free_ms", "max_waiting_mib"):
        try:
            with open(os.path.join(PAGE_REPORTING, name)) as f:
                settings[name] = f.read().strip()
        except OSError:
            continue
    return settings or None


def _outside_runs(settings: dict[str, str] | None) -> dict[str, str] | None:
    """``settings`` as they are when no benchmark (of any process) holds reporting back."""
    return None if settings is None else {**settings, **_recorded_originals()}


def _page_reporting_record() -> str:
    """The file that keeps the settings found by the first of overlapping runs, of any
    process, until the last one ends; each run holds a shared lock on it meanwhile. In
    /run, emptied at boot as the settings are reset (elsewhere only when /run is closed
    to this user, who then cannot change the settings either)."""
    folder = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
    return os.path.join(folder, "tensorferry" + PAGE_REPORTING.replace(os.sep, "-") + ".json")


def _recorded_originals(fd: int | None = None) -> dict[str, str]:
    """The settings in the record (read from ``fd`` if given), or {} where there is none."""
    try:
        if fd is not None:
            return json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
        with open(_page_reporting_record()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _runs_excluded() -> Iterator[None]:
    """Keeps other processes' runs from starting or ending meanwhile: an exclusive lock on
    the settings' own folder."""
    fd = os.open(PAGE_REPORTING, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _no_other_holder(fd: int) -> bool:
    """Whether no other process holds the record. flock converts a lock by dropping it
    first: a shared lock of this process's on ``fd`` is gone either way."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _set_page_reporting(settings: dict[str, str]) -> None:
    for name, value in settings.items():
        with contextlib.suppress(OSError), open(os.path.join(PAGE_REPORTING, name), "w") as f:
            f.write(value)


def _hold_page_reporting() -> dict[str, str] | None:
    """Holds reporting back for this process's run; the settings then in force, or None
    where this process may not change them."""
    global _record_fd
    names = [n for n in HELD_PAGE_REPORTING if os.access(os.path.join(PAGE_REPORTING, n), os.W_OK)]
    if not names:
        return None
    with _runs_excluded():
        fd = os.open(_page_reporting_record(), os.O_RDWR | os.O_CREAT, 0o644)
        # Alone, this run finds the original settings in force, unless a killed run left
        # them held: its record, kept, names the originals then.
        if _no_other_holder(fd) and not _recorded_originals(fd):
            found = _free_page_reporting() or {}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({n: found[n] for n in names if n in found}).encode(), 0)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _record_fd = fd
        _set_page_reporting({n: HELD_PAGE_REPORTING[n] for n in names})
    return _free_page_reporting()


def _put_back_page_reporting() -> None:
    """Ends this process's run: the last run of all puts the recorded originals back."""
    global _record_fd
    fd, _record_fd = _record_fd, None
    if fd is None:
        return
    with _runs_excluded():
        try:
            if _no_other_holder(fd):
                _set_page_reporting(_recorded_originals(fd))
                os.unlink(_page_reporting_record())
        finally:
            os.close(fd)


@contextlib.contextmanager
def freed_memory_kept() -> Iterator[dict[str, str] | None]:
    """Holds a VM guest's free page reporting back while a benchmark runs (where this
    process may change it: root), and puts the settings back after; yields those in
    force. With reporting at once, the memory :func:`warm_memory` touched and freed went
    back to the host before a loader took it, or not, by a race: on the development VM
    a load into new memory cost 0.23 or 1.2 CPU-s/GB from round to round, the same code
    on the same file, and held back 0.23 in every round (docs/benchmarks.md).

    Runs may overlap, nested in one process or in several processes (``tensorferry
    bench`` beside a benchmark script): the first to start records the settings it
    found (see :func:`_page_reporting_record`), and the last to end puts those back.
    A run killed before its end leaves reporting held until another run ends."""
    global _holders_here, _held_page_reporting
    with _holders_lock:
        if _holders_here == 0:
            _held_page_reporting = _hold_page_reporting()
        _holders_here += 1
    try:
        yield _held_page_reporting
    finally:
        with _holders_lock:
            _holders_here -= 1
            if _holders_here == 0:
                _put_back_page_reporting()


def _source_commit(source: str = __file__) -> str | None:
    """The git commit of the code measured (``+dirty`` with uncommitted changes), where
    it runs from a git checkout that tracks ``source``; for an installed copy, the commit
    it was built from (``build_commit.txt``, written by the build). An installed copy may
    lie inside another repository (pyenv's, say), whose commit says nothing about this code."""
    source = os.path.realpath(source)
    here = os.path.dirname(source)
    try:
        with open(os.path.join(here, "build_commit.txt")) as f:
            built = f.read().strip()
    except OSError:
        built = ""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True)

    try:
        if git("ls-files", "--error-unmatch", os.path.basename(source)).returncode != 0:
            return built or None
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return built or None
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except OSError:
        return built or None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def save_results(results_dir: str, benchmark: str, command: list[str], settings: dict[str, Any], directory: str,
                 started: float, *, measurements: list[Measurement] | None = None,
                 rows: list[dict[str, Any]] | None = None, skipped: dict[str, str] | None = None) -> str:
    """Writes one run as ``<results_dir>/<UTC time>-<benchmark>.json``; returns its path.

    ``measurements`` are every round's, in the order they ran (what :func:`best_of`
    reduces); the file holds them and the reduced ``results`` (as :func:`report_rows`),
    so a report can recompute anything. ``rows`` hold the results of benchmarks that
    are not made of measurements (``paired``, ``checksums``); ``skipped``, the contenders
    that could not run, each with the reason.
    """
    os.makedirs(results_dir, exist_ok=True)
    stamp = datetime.datetime.fromtimestamp(started, datetime.timezone.utc)
    document: dict[str, Any] = {
        "schema": RESULTS_SCHEMA, "benchmark": benchmark, "command": shlex.join(command),
        "started": stamp.strftime("%Y-%m-%dT%H:%M:%SZ"), "seconds": round(time.time() - started, 1),
        "settings": settings, "machine": machine_info(directory)}
    if measurements is not None:
        document["measurements"] = [asdict(m) for m in measurements]
        document["results"] = report_rows(best_of(measurements))
    if rows is not None:
        document["rows"] = rows
    if skipped is not None:
        document["skipped"] = skipped
    path = os.path.join(results_dir, f"{stamp.strftime('%Y%m%dT%H%M%SZ')}-{benchmark}.json")
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
        f.write("\n")
    return path


def add_results_option(parser: argparse.ArgumentParser) -> None:
    """The ``--results DIR`` option of every benchmark command."""
    parser.add_argument("--results", default=None, metavar="DIR",
                        help="also write the run as a JSON result file in DIR (e.g. benchmarks/results)")


def save_run(args: argparse.Namespace, benchmark: str, command: list[str], directory: str, started: float,
             **results: Any) -> str | None:
    """With ``--results``, writes the run of a benchmark command (its options are the
    settings; ``--dir``, ``--json`` and ``--results`` are not) as :func:`save_results`
    does; returns the file's path (None without ``--results``)."""
    if not args.results:
        return None
    settings = {k: v for k, v in vars(args).items() if k not in ("what", "dir", "json", "results")}
    # Lists (--counts 64,4096 read by counts_arg) as typed, as earlier result files hold them.
    settings = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in settings.items()}
    settings["size"] = parse_size(args.size)
    path = save_results(args.results, benchmark, command, settings, directory, started, **results)
    print(f"results written to {path}", file=sys.stderr)
    return path


def load_results(path: str) -> dict[str, Any]:
    """A result file written by :func:`save_results`, with its measurements as
    :class:`Measurement` objects (``measurements``, in the order they ran)."""
    with open(path) as f:
        try:
            document = json.load(f)
        except ValueError as exc:
            raise ValueError(f"{path} is not a tensorferry benchmark result (not JSON: {exc})") from None
    if not isinstance(document, dict) or document.get("schema") != RESULTS_SCHEMA or "benchmark" not in document:
        raise ValueError(f"{path} is not a tensorferry benchmark result ({RESULTS_SCHEMA})")
    document["measurements"] = [Measurement(**m) for m in document.get("measurements", [])]
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorferry.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    engine = sub.add_parser("engine", help="raw engine write/read of one file vs fio")
    engine.add_argument("--backends", type=backends_arg, default="io_uring,threads")
    ckpt = sub.add_parser("checkpoint", help="save_checkpoint/load_checkpoint vs fio and peers")
    ckpt.add_argument("--counts", type=counts_arg, default="64,4096", help="comma-separated array counts to try")
    paired = sub.add_parser("paired", help="save_checkpoint against fio write, alternated round by round; "
                                           "per-round ratios and their median (steadier on a drifting drive)")
    paired.add_argument("--counts", type=counts_arg, default="64,4096", help="comma-separated array counts to try")
    paired.add_argument("--rounds", type=count_arg, default=5, help="rounds of fio then one save per count")
    sums = sub.add_parser("checksums", help="what the checksums add to save_checkpoint: interleaved pairs "
                                            "of saves with and without them, medians compared")
    sums.add_argument("--counts", type=counts_arg, default="64,4096", help="comma-separated array counts to try")
    sums.add_argument("--pairs", type=count_arg, default=6, help="saves with and without checksums, alternated")
    for p in (engine, ckpt, paired, sums):
        p.add_argument("--repeat", type=count_arg, default=1,
                       help="rounds, fio included in each; the best of each contender is reported")
        p.add_argument("--dir", default=None, help="directory on the drive to measure (default: a temp dir)")
        p.add_argument("--size", type=size_arg, default="2G", help="bytes to move (default 2G)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        add_results_option(p)
    args = parser.parse_args(argv)
    command = ["python", "-m", "tensorferry.bench", *(sys.argv[1:] if argv is None else argv)]
    if not fio_available():
        print("fio is not installed: no ceiling to compare with", file=sys.stderr)
    try:
        if args.dir:
            os.makedirs(args.dir, exist_ok=True)
            return _run(args, args.dir, command)
        directory = tempfile.mkdtemp(prefix="tensorferry-bench-")
        try:
            return _run(args, directory, command)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    except TensorferryError as exc:  # fio failed, say: its message, not a traceback
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


def backends_arg(text: str) -> list[str]:
    """An argparse ``type=`` for comma-separated engine backends, each one usable here."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:  # else tune fails with a traceback and bench measures no engine at all
        raise argparse.ArgumentTypeError(f"{text!r} names no backend (choose from {', '.join(PARALLELISM)})")
    for name in names:
        if name not in PARALLELISM:
            raise argparse.ArgumentTypeError(f"unknown backend {name!r} (choose from {', '.join(PARALLELISM)})")
        if name == "io_uring" and not io_uring_probe()[0]:
            raise argparse.ArgumentTypeError(f"io_uring is not usable here: {io_uring_probe()[1]}")
    return names


def _run(args: argparse.Namespace, directory: str, command: list[str]) -> int:
    """Runs the benchmark ``args.what`` in ``directory``, prints its report and, with
    ``--results``, writes its result file."""
    nbytes = args.size
    started = time.time()

    def save(**results: Any) -> None:
        save_run(args, args.what, command, directory, started, **results)

    counts = getattr(args, "counts", [])
    if args.what == "paired":
        rows = paired_saves(directory, nbytes, counts, args.rounds)
        remove_fio_file(directory)
        save(rows=rows)
        print(json.dumps(rows, indent=2) if args.json else "\n".join(
            f"{r['arrays']} arrays: median ratio to fio {r['median_ratio']:.2f} (rounds: {r['ratios']}; "
            f"save GB/s {r['save_gbps']}, fio GB/s {r['fio_gbps']})" for r in rows))
        return 0
    if args.what == "checksums":
        rows = [checksum_cost(directory, make_state(nbytes, c), args.pairs) | {"arrays": c} for c in counts]
        save(rows=rows)
        print(json.dumps(rows, indent=2) if args.json else "\n".join(
            f"{r['arrays']} arrays: median save {r['with_s']:.3f} s with checksums, {r['without_s']:.3f} s "
            f"without: the checksums cost {r['cost']:+.1%} (differences of the pairs: {r['pair_differences_s']})"
            for r in rows))
        return 0
    if args.what == "engine":
        raw = bench_engine(directory, nbytes, args.backends, args.repeat, rounds=True)
    else:
        raw = []
        for count in counts:
            state = make_state(nbytes, count)
            for turn in range(args.repeat):
                raw += bench_checkpoint(directory, state, f"{count} arrays", turn=turn)
            del state
    remove_fio_file(directory)
    save(measurements=raw)
    print(report(best_of(raw), args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
