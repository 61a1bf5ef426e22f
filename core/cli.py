"""The tensorferry command: bench, tune, inspect, verify, convert, clean and interval.

inspect, verify and convert hold no format logic: they go through the layout registry
(:mod:`tensorferry.layouts`), which recognises the checkpoint and reads it.

Every subcommand takes --help, --json (one JSON document on stdout instead of
text) and --quiet (no progress bars or notes). Progress bars (tqdm) go to stderr,
and only when it is a terminal.

Exit status: 0 when all is well; 1 when a check found a problem (a checkpoint that
is incomplete or fails its checksums); 2 on bad usage or input, or when the work
could not be done (the message on stderr says why).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from . import __version__, bench, layouts
from .checkpoint import (DEFAULT_SHARD_BYTES, MANIFEST, PendingCheckpoint, leftovers, occupied, remove_leftovers,
                         split_by_size)
from .config import count_arg, parse_size, size_arg
from .errors import CorruptCheckpointError, TensorferryError
from .layouts.safetensors import to_file_metadata
from .schema import STRUCTURE_KEY, check_structure, parse_json
from .shard import ShardWriter, write_order
from .temporaries import is_temporary_name

EXIT_OK, EXIT_FINDING, EXIT_ERROR = 0, 1, 2


class CLIError(Exception):
    """Ends a command with a message on stderr and an exit status."""

    def __init__(self, message: str, status: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------- output helpers

class _NoBar:
    """Stands in for a tqdm bar where none is shown."""

    def update(self, n: float = 1) -> None:
        pass

    def set_description_str(self, text: str) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_bar(args: argparse.Namespace, total: float | None = None, unit: str = "B") -> Any:
    """A tqdm bar on stderr, or a silent stand-in with --quiet, off a terminal or without tqdm."""
    if args.quiet or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the [cli] extra; without it the work runs silently
        return _NoBar()
    scale = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return tqdm(total=total, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True, **scale)


def _stepper(bar: Any) -> Callable[[str], None]:
    """A progress callback for steps of unknown number: shows each one's name and counts it."""
    def step(name: str) -> None:
        bar.set_description_str(name)
        bar.update()

    return step


def note(args: argparse.Namespace, message: str) -> None:
    """An informational message on stderr (silenced by --quiet)."""
    if not args.quiet:
        print(f"tensorferry {args.command}: {message}", file=sys.stderr)


def emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    """Prints the command's result: JSON with --json, else the text."""
    print(to_json(data) if args.json else text)


def to_json(data: Any) -> str:
    """``data`` as JSON, an infinite or NaN number as null: Python's ``Infinity`` and
    ``NaN`` are no JSON, and strict parsers (jq, JSON.parse) refuse the whole document."""
    return json.dumps(_finite(data), indent=2, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def human_bytes(n: float | None) -> str:
    """A byte count in binary units: ``64.0 MiB``."""
    if n is None:
        return "-"
    for power, unit in enumerate(("B", "KiB", "MiB", "GiB")):
        if abs(n) < 1024 ** (power + 1):
            return f"{n:.0f} B" if power == 0 else f"{n / 1024 ** power:.1f} {unit}"
    return f"{n / 1024 ** 4:.1f} TiB"


def plural(count: int, noun: str) -> str:
    """``1 file``, ``2 files``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def human_duration(seconds: float) -> str:
    """Seconds as ``14.0 s``, ``30.0 min`` or ``2.5 h``."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> list[str]:
    """Columns padded to their widest cell; columns listed in ``right`` right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in cells]


def _pyplot() -> Any:
    """matplotlib's pyplot without a display, or a CLIError naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install 'tensorferry[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _existing_dir(path: str) -> str:
    if not os.path.isdir(path):
        raise CLIError(f"{path}: no such directory")
    return os.path.abspath(path)


def _backends(names: list[str] | None) -> list[str]:
    """The backends named, or every one this machine can use."""
    if names is not None:
        return names
    return ["io_uring", "threads"] if bench.io_uring_probe()[0] else ["threads"]


def _writable_folder(path: str, option: str) -> None:
    """Refuses, before minutes of measuring, an output file whose folder is not there or not writable."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CLIError(f"{option} {path}: no such directory {folder}")
    if not os.access(folder, os.W_OK):
        raise CLIError(f"{option} {path}: cannot write in {folder}")


def _scratch(directory: str, what: str) -> str:
    """A private directory under ``directory``, so that nothing of the user's is touched."""
    try:
        return tempfile.mkdtemp(prefix=f".tensorferry-{what}-", dir=directory)
    except OSError as exc:
        raise CLIError(f"cannot write in {directory}: {exc.strerror}") from None


# ---------------------------------------------------------------- bench

def cmd_bench(args: argparse.Namespace) -> int:
    """Engine and checkpoint throughput on a directory, against fio and the installed peers."""
    directory = _existing_dir(args.dir)
    if args.count > args.size // 4:  # each array holds a float32 at least: an empty one has no speed
        raise CLIError(f"--count {args.count}: at most {args.size // 4:,} arrays in --size {human_bytes(args.size)} "
                       "(4 bytes each, at least)")
    plt = _pyplot() if args.plot else None  # fail before minutes of measuring, not after
    if args.plot:
        _writable_folder(args.plot, "--plot")
    backends = _backends(args.backends)
    if not bench.fio_available():
        note(args, "fio is not installed: no ceiling to compare with")
    if not bench.torch_available():
        note(args, "torch is not installed: torch.save and DCP are not measured")
    scratch = _scratch(directory, "bench")
    try:
        with bench.freed_memory_kept(), progress_bar(args, unit="step") as bar:
            results = bench.bench_engine(scratch, args.size, backends, progress=_stepper(bar))
            state = bench.make_state(args.size, args.count)
            results += bench.bench_checkpoint(scratch, state, fio=False, progress=_stepper(bar))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = bench.report_rows(results)
    data = {"directory": directory, "size": args.size, "arrays": args.count, "results": rows}
    header = f"{directory}: {human_bytes(args.size)} per run, checkpoint of {args.count} arrays"
    emit(args, data, header + "\n" + bench.report(results))  # first: minutes of measuring are not lost to the plot
    if plt is not None:
        _plot_bench(plt, rows, directory, args.plot)
        note(args, f"wrote {args.plot}")
    return EXIT_OK


def _plot_bench(plt: Any, rows: list[dict[str, Any]], directory: str, path: str) -> None:
    """Horizontal bars of GB/s, writes and reads side by side, fio in its own colour."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.4 * max(len(rows), 6) + 1.5))
    for ax, op in zip(axes, ("write", "read")):
        picked = [r for r in rows if r["op"] == op]
        names = [r["name"] for r in picked]
        colours = ["tab:gray" if n.startswith("fio") else "tab:blue" if n.startswith("tensorferry")
                   else "tab:orange" for n in names]
        ax.barh(names, [r["gbps"] for r in picked], color=colours)
        ax.invert_yaxis()
        ax.set_xlabel("GB/s")
        ax.set_title(f"{op}s" + (" (until durable)" if op == "write" else " (cold cache)"))
    fig.suptitle(f"tensorferry bench: {directory}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- tune

def cmd_tune(args: argparse.Namespace) -> int:
    """Adaptive search for the fastest engine settings on a directory."""
    directory = _existing_dir(args.dir)
    plt = _pyplot() if args.plot else None
    for path, option in ((args.output, "--output"), (args.plot, "--plot")):
        if path:
            _writable_folder(path, option)
    backends = _backends(args.backends)
    if not bench.fio_available():
        note(args, "fio is not installed: no ceiling to compare with, and no early stop at it")
    scratch = _scratch(directory, "tune")
    try:
        with progress_bar(args, unit="run") as bar:
            result = bench.tune(scratch, args.size, backends=backends, op=args.op, tolerance=args.tolerance,
                                max_seconds=args.max_seconds, progress=_stepper(bar))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    data = {"directory": directory, **result.to_json()}
    emit(args, data, _tune_text(result, directory))  # first: a search of minutes is not lost to a bad -o path
    if args.output:
        with open(args.output, "w") as f:
            f.write(to_json(data) + "\n")
        note(args, f"wrote {args.output}")
    if plt is not None:
        _plot_tune(plt, result, directory, args.plot)
        note(args, f"wrote {args.plot}")
    return EXIT_OK


def _tune_text(result: bench.TuneResult, directory: str) -> str:
    best, knob = result.best, "queue_depth" if result.best.backend == "io_uring" else "threads"
    what = {"both": "a write and a read", "write": "writes", "read": "reads"}[result.op]
    speeds = ", ".join(f"{op} {v:.2f} GB/s" for op, v in (("write", best.write_gbps), ("read", best.read_gbps))
                       if v is not None)
    lines = [f"best setting for {directory} ({what} of {human_bytes(result.nbytes)} per trial):",
             f"  backend {best.backend}, block_size {human_bytes(best.block_size)}, {knob} {best.parallelism}",
             f"  {speeds}"]
    if result.fio:
        lines.append(f"  fio (1 MiB blocks, depth 32): write {result.fio['write_gbps']:.2f} GB/s, "
                     f"read {result.fio['read_gbps']:.2f} GB/s; the best setting reaches "
                     f"{result.ratio_to_fio:.2f}x fio")
    lines.append(f"search: {len(result.trials)} trials in {result.seconds:.1f} s; stopped: {result.stopped}")
    top = sorted(result.trials, key=lambda t: -t.score)[:5]
    lines += ["fastest trials:"] + ["  " + line for line in _table(
        ["backend", "block", "depth/threads", "stage", "write GB/s", "read GB/s"],
        [[t.backend, human_bytes(t.block_size), t.parallelism, t.stage,
          "-" if t.write_gbps is None else f"{t.write_gbps:.2f}", "-" if t.read_gbps is None else f"{t.read_gbps:.2f}"]
         for t in top], right=(2, 4, 5))]
    lines.append("IOConfig: " + json.dumps(dataclasses.asdict(result.config)))
    lines.append("DeepSpeed: " + json.dumps(result.config.to_deepspeed()))
    return "\n".join(lines)


def _plot_tune(plt: Any, result: bench.TuneResult, directory: str, path: str) -> None:
    """A heat map of throughput over block size x depth (or threads), one panel per backend."""
    backends = sorted({t.backend for t in result.trials})
    scores = [t.score for t in result.trials]
    fig, axes = plt.subplots(1, len(backends), figsize=(6 * len(backends), 5), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        trials = [t for t in result.trials if t.backend == backend]
        blocks = sorted({t.block_size for t in trials})
        pars = sorted({t.parallelism for t in trials})
        grid = np.full((len(blocks), len(pars)), np.nan)  # blank where untried
        for block, par in {(t.block_size, t.parallelism) for t in trials}:
            grid[blocks.index(block), pars.index(par)] = np.mean(
                [t.score for t in trials if (t.block_size, t.parallelism) == (block, par)])
        image = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower", vmin=min(scores), vmax=max(scores))
        for (i, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white", fontsize=8)
        ax.set_xticks(range(len(pars)), [str(p) for p in pars])
        ax.set_yticks(range(len(blocks)), [human_bytes(b) for b in blocks])
        ax.set_xlabel("queue depth" if backend == "io_uring" else "threads")
        ax.set_ylabel("block size")
        ax.set_title(backend)
        fig.colorbar(image, ax=ax, label="GB/s")
    ceiling = f", fio {result.fio['score']:.2f} GB/s" if result.fio else ""
    fig.suptitle(f"tensorferry tune: {directory} ({result.op}{ceiling})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- inspect

def cmd_inspect(args: argparse.Namespace) -> int:
    """What a checkpoint holds and whether it is complete."""
    info = layouts.describe(args.checkpoint)
    emit(args, info, _inspect_text(info, args.limit))
    return EXIT_OK if info["complete"] else EXIT_FINDING


def _title(kind: str) -> str:
    return next((layout.title for layout in layouts.LAYOUTS if layout.kind == kind), kind)


def _file_status(kind: str, file: dict[str, Any]) -> str:
    size, expected = file["size"], file["expected_size"]
    if size is None:
        return "missing"
    # DCP records where its data ends, not the file's size: a longer file is fine.
    if expected is None or size == expected or (kind == "torch-dcp" and size > expected):
        return "ok"
    return f"expected {expected} bytes"


def _inspect_text(info: dict[str, Any], limit: int) -> str:
    head = f"{info['path']}: {_title(info['format'])}"
    if info.get("format_version") is not None:
        head += f", format {info['format_version']}"
    if info.get("committed_at"):
        head += f", committed {info['committed_at']}"
    lines = [head]
    if info["complete"]:
        lines.append("complete: yes" + {"tensorferry": " (every file the manifest lists is there with its size)",
                                        "torch-dcp": " (every file .metadata names is there and long enough)",
                                        "huggingface": " (every tensor the index names is in its file)"}
                     .get(info["format"], ""))
    else:
        lines += ["complete: NO"] + [f"  {p}" for p in info["problems"]]
    if info.get("ranks"):
        lines.append(f"ranks: {len(info['ranks'])} ({', '.join(map(str, info['ranks']))})")
    if info.get("checksummed") is not None:
        lines.append("checksums: " + ("per tensor (written by tensorferry)" if info["checksummed"] else "none"))
    if info["metadata"]:
        lines.append("metadata: " + json.dumps(info["metadata"]))
    files = info["files"]
    if files:
        lines.append(f"files ({len(files)}, {human_bytes(sum(f['size'] or 0 for f in files))}):")
        lines += ["  " + line for line in _table(
            ["name", "size", "status"], [[f["name"], human_bytes(f["size"]), _file_status(info["format"], f)]
                                         for f in files], right=(1,))]
    if info.get("other_files"):
        lines.append("other files: " + ", ".join(info["other_files"]))
    tensors = info["tensors"]
    if not tensors:
        return "\n".join(lines)
    total = "" if info["total_bytes"] is None else f", {human_bytes(info['total_bytes'])}"
    lines.append(f"tensors ({len(tensors)}{total}):")
    shown = tensors if limit <= 0 else tensors[:limit]
    has_file = any("file" in t for t in shown)
    has_shards = any("shards" in t for t in shown)
    header = ["name", "dtype", "shape", "size"] + (["file"] if has_file else []) + (["shards"] if has_shards else [])
    rows = []
    for t in shown:
        row = [t["name"], t["dtype"], "-" if t["shape"] is None else "[" + ",".join(map(str, t["shape"])) + "]",
               human_bytes(t["nbytes"])]
        row += [t.get("file", "")] if has_file else []
        row += [t.get("shards", "")] if has_shards else []
        rows.append(row)
    lines += ["  " + line for line in _table(header, rows, right=(3,))]
    if len(shown) < len(tensors):
        lines.append(f"  ... and {len(tensors) - len(shown)} more (--limit 0 lists all)")
    return "\n".join(lines)

# ---------------------------------------------------------------- verify

def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hashes a checkpoint against its checksums (or checks what its layout allows); names every bad file."""
    path = args.checkpoint
    layout = layouts.detect(path)
    total = sum(f["size"] or 0 for f in layouts.describe(path)["files"])
    with progress_bar(args, total) as bar:
        found = layout.verify(bar.update)
    names, problems = found.files, found.problems
    bad = [n for n in names if any(p.startswith(n + ": ") for p in problems)]
    # "checked": the checks made, whatever their outcome
    data = {"path": path, "format": layout.kind, "ok": not problems, "checked": found.checked, "files": len(names),
            "bytes": found.nbytes, "bad_files": bad, "problems": problems}
    if problems:
        count = f": {len(bad)} of {plural(len(names), 'file')} bad" if bad else ""
        text = [f"{path}: FAILED{count}"] + [f"  {p}" for p in problems]
        print(f"tensorferry verify: {path}: " + (f"bad file(s): {', '.join(bad)}" if bad else problems[0]),
              file=sys.stderr)
    else:
        size = "" if found.nbytes is None else f", {human_bytes(found.nbytes)}"
        text = [f"{path}: OK: {plural(len(names), 'file')}{size}; checked: {found.checked}"]
    emit(args, data, "\n".join(text))
    return EXIT_FINDING if problems else EXIT_OK


# ---------------------------------------------------------------- clean

def cmd_clean(args: argparse.Namespace) -> int:
    """Removes what killed saves left in a directory and those under it (temporaries no running save holds)."""
    if not os.path.isdir(args.root):
        raise CLIError(f"{args.root} is not a directory")
    found: list[str] = []
    unread: list[str] = []  # folders under the root it could not list: not cleaned
    for directory in _directories_to_clean(args.root, unread):
        if args.dry_run:  # not an interrupted overwrite's old checkpoint
            found += leftovers(directory)
        else:
            found += remove_leftovers(directory)
    verb = "would remove" if args.dry_run else "removed"
    text = [f"{args.root}: {verb} {plural(len(found), 'leftover')}"] + [f"  {p}" for p in found]
    text += [f"not searched (could not list it): {p}" for p in unread]
    emit(args, {"path": args.root, "dry_run": args.dry_run, "removed": found, "not_searched": unread},
         "\n".join(text))
    return EXIT_FINDING if unread else EXIT_OK


def _directories_to_clean(root: str, unread: list[str]) -> Iterator[str]:
    """``root`` and the directories under it where a save's leftovers can be (checkpoints
    sit in run folders: ckpt/run1/step_5), but not inside a checkpoint (a save writes
    none there) nor a temporary (it goes whole, or a save holds it), on another filesystem
    (a mount under the root: as ``find -xdev``), nor through a symbolic link (it may lead
    out of ``root``). A folder it cannot list goes into ``unread``; ``root`` itself, an
    error."""
    device = os.stat(root).st_dev

    def unlisted(error: OSError) -> None:
        if os.path.samefile(error.filename, root):
            raise error
        unread.append(error.filename)

    for parent, subdirs, _ in os.walk(root, onerror=unlisted):  # os.walk does not enter links to folders
        yield parent
        subdirs[:] = sorted(d for d in subdirs if not is_temporary_name(d)
                            and not os.path.lexists(os.path.join(parent, d, MANIFEST))
                            and _on_device(os.path.join(parent, d), device))


def _on_device(path: str, device: int) -> bool:
    try:
        return os.lstat(path).st_dev == device
    except FileNotFoundError:  # gone since it was listed
        return False


# ---------------------------------------------------------------- convert

# Tensors are read ahead in batches of about this many bytes: files read in parallel and
# few calls into a source (one dcp.load per batch), memory bounded all the same.
CONVERT_BATCH_BYTES = 16 << 20
SKIPPED_KINDS = ("DCP's pickled objects, scalars kept as values, dtypes safetensors has no name for, "
                 "items of Orbax's other handlers")


def cmd_convert(args: argparse.Namespace) -> int:
    """Any checkpoint layout tensorferry reads to one safetensors file or to a tensorferry checkpoint."""
    src, dst = args.src, args.dst
    layout = layouts.detect(src)
    if layout.kind == args.to:
        # Any file is a candidate safetensors file: one that is not (a torch.save zip named
        # .pt) gets its own error from opening it, not "already a safetensors file".
        layout.open(verify=False).close()
        raise CLIError(f"{src} is already a {layout.title}; --to {args.to} converts from any other layout")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise CLIError(f"{parent}: no such directory")
    source_root = os.path.realpath(src)
    if os.path.commonpath([source_root, os.path.realpath(dst)]) == source_root:
        raise CLIError(f"{dst} is {src} or lies inside it: write it elsewhere")
    # An empty folder made for the checkpoint is taken, with or without --overwrite, as save_checkpoint takes it.
    if os.path.lexists(dst) and not (args.to == "tensorferry" and not occupied(dst)):
        if not args.overwrite:
            raise CLIError(f"{dst} exists; pass --overwrite to replace it")
        # Only what this command could have made is replaced, never a directory of other things.
        if args.to == "safetensors" and not os.path.isfile(dst):
            raise CLIError(f"{dst} exists and is not a file: not replacing it")
        if args.to == "tensorferry" and not os.path.isfile(os.path.join(dst, MANIFEST)):
            raise CLIError(f"{dst} exists and is not a tensorferry checkpoint: not replacing it")
    start = time.perf_counter()
    with layout.open(verify=not args.no_verify) as source:
        names = _selected(source, args.select, src)
        if not names:  # an empty file, reported as written, would pass for a conversion
            raise CLIError(f"{src} holds no tensor to convert" + (
                f" ({plural(source.skipped, 'item')} that tensorferry does not read as a tensor: {SKIPPED_KINDS})"
                if source.skipped else ""))
        nbytes = sum(source.tensors[n].nbytes for n in names.values())
        metadata = _carried_metadata(args, source.metadata, names)
        with progress_bar(args, nbytes) as bar:
            if args.to == "safetensors":
                _to_safetensors(source, names, metadata, dst, bar)
            else:
                _to_tensorferry(source, names, metadata, dst, bar, args.shard_size, args.overwrite)
    if source.skipped:
        note(args, f"left out {plural(source.skipped, 'item')} that tensorferry does not read as a tensor "
                   f"({SKIPPED_KINDS})")
    seconds = time.perf_counter() - start
    count = len(names)
    data = {"source": src, "destination": dst, "to": args.to, "tensors": count, "bytes": nbytes,
            "seconds": round(seconds, 3), "gbps": round(nbytes / seconds / 1e9, 3)}
    emit(args, data, f"wrote {dst}: {plural(count, 'tensor')}, {human_bytes(nbytes)} in {seconds:.1f} s "
                     f"({nbytes / seconds / 1e9:.2f} GB/s)")
    return EXIT_OK


def _selected(source: layouts.TensorSource, prefix: str | None, src: str) -> dict[str, str]:
    """The tensors to write, each by its new name: all as they are, or with ``--select``
    those under ``prefix``, without it."""
    if prefix is None:
        return {name: name for name in source.tensors}
    names = {name[len(prefix):]: name for name in source.tensors if name.startswith(prefix) and name != prefix}
    if not names:
        tops = sorted({name.split(".")[0] + "." for name in source.tensors})
        raise CLIError(f"no tensor of {src} has a name that starts with {prefix!r} (they start with "
                       f"{', '.join(tops[:8])}{', ...' if len(tops) > 8 else ''})")
    return names


def _carried_metadata(args: argparse.Namespace, metadata: Mapping[str, Any], names: Mapping[str, str]) -> dict:
    """The source's metadata for the destination (:func:`to_file_metadata` puts it as a
    file keeps it), the pytorch adapter's structure (how its load nests the tensors and
    the values saved beside them) only where it names the very tensors written: with
    --select, or where it names tensors the source does not hold, it is left out (said on
    stderr), and the adapter loads the result as a flat dict of tensors."""
    metadata = dict(metadata)
    structure = metadata.pop(STRUCTURE_KEY, None)
    if structure is None:
        return metadata
    why = ""
    if any(new != old for new, old in names.items()):
        why = "--select renames the tensors it names"
    else:
        try:
            if isinstance(structure, str):  # as an earlier convert put a file's into a manifest
                structure = parse_json(structure, STRUCTURE_KEY, args.src)
            check_structure(structure, args.src, names)
        except CorruptCheckpointError as exc:
            why = str(exc)
    if why:
        note(args, f"left out {STRUCTURE_KEY} (how tensorferry.adapters.pytorch nests the tensors and keeps other "
                   f"values): {why}; the adapter's load gives the tensors as a flat dict")
        return metadata
    return {**metadata, STRUCTURE_KEY: structure}


def _read_ahead(source: layouts.TensorSource, names: Sequence[str], bar: Any) -> dict[str, Callable[[], Any]]:
    """A lazy data source per tensor for a ShardWriter, which calls them in its write
    order: each call hands out one tensor of a batch read at once."""
    order = write_order([(n, source.tensors[n].dtype) for n in names])
    batches: list[list[str]] = [[]]
    batch_bytes = 0
    for name in order:
        size = source.tensors[name].nbytes
        if batches[-1] and batch_bytes + size > CONVERT_BATCH_BYTES:
            batches.append([])
            batch_bytes = 0
        batches[-1].append(name)
        batch_bytes += size
    batch_of = {name: batch for batch in batches for name in batch}
    ready: dict[str, Any] = {}

    def fetch(name: str) -> Any:
        if name not in ready:
            ready.update(source.read(batch_of[name]))
        array = ready.pop(name)
        bar.update(array.nbytes)
        return array

    return {name: functools.partial(fetch, name) for name in names}


def _to_safetensors(source: layouts.TensorSource, names: Mapping[str, str], metadata: Mapping[str, Any], dst: str,
                    bar: Any) -> None:
    """Streams the tensors (``names``: new name -> the source's) into one safetensors
    file, written under a temporary name and renamed into place once durable; the
    metadata keys stay where they were."""
    lazy = _read_ahead(source, list(names.values()), bar)
    with ShardWriter(dst, metadata=to_file_metadata(dict(metadata)), atomic=True) as writer:
        for name, old in names.items():
            t = source.tensors[old]
            writer.add(name, t.dtype, t.shape, data=lazy[old])


def _to_tensorferry(source: layouts.TensorSource, names: Mapping[str, str], metadata: Mapping[str, Any], dst: str,
                    bar: Any, shard_size: int, overwrite: bool) -> None:
    """Streams the tensors (``names``: new name -> the source's) into a checkpoint
    directory, one shard file at a time, split like :func:`tensorferry.save_checkpoint`
    splits, committed atomically."""
    groups = split_by_size({n: source.tensors[old].nbytes for n, old in names.items()}, shard_size)
    pending = PendingCheckpoint.begin(dst)
    try:
        shards = []
        for index, group in enumerate(groups):
            lazy = _read_ahead(source, [names[n] for n in group], bar)
            with pending.writer(f"shard-{index:05d}.safetensors") as writer:
                for name in group:
                    t = source.tensors[names[name]]
                    writer.add(name, t.dtype, t.shape, data=lazy[names[name]])
            shards.append(writer.info)
        pending.commit(shards, dict(metadata), overwrite=overwrite)
    except BaseException:
        pending.abort()
        raise


# ---------------------------------------------------------------- interval

def checkpoint_interval(model_gb: float, samples_per_sec: float, bandwidth_gbps: float,
                        rework_hours: float = 0.5, max_overhead: float = 0.05) -> dict[str, Any]:
    """How often to checkpoint: as seldom as the rework bound allows, but never so often
    that saving takes more than ``max_overhead`` of training time.

    A crash loses up to one interval of work, so ``rework_hours`` of training sets
    the interval; a save of ``model_gb`` at ``bandwidth_gbps`` taking more than
    ``max_overhead`` of that interval lengthens it (and the rework bound is then missed).
    """
    checkpoint_seconds = model_gb / bandwidth_gbps
    rework_samples = samples_per_sec * rework_hours * 3600
    min_interval_seconds = checkpoint_seconds / max_overhead
    min_interval_samples = min_interval_seconds * samples_per_sec
    interval_samples = max(rework_samples, min_interval_samples)
    interval_seconds = interval_samples / samples_per_sec
    return {
        "model_gb": model_gb, "samples_per_sec": samples_per_sec, "bandwidth_gbps": bandwidth_gbps,
        "rework_hours": rework_hours, "max_overhead": max_overhead,
        "checkpoint_seconds": checkpoint_seconds,
        "rework_samples": rework_samples,
        "min_interval_seconds": min_interval_seconds, "min_interval_samples": min_interval_samples,
        "interval_samples": interval_samples, "interval_seconds": interval_seconds,
        "overhead": checkpoint_seconds / interval_seconds,
        "rework_bound_met": min_interval_samples <= rework_samples,
        # The bandwidth at which a save every rework_hours costs exactly max_overhead.
        "bandwidth_needed_gbps": model_gb / (max_overhead * rework_hours * 3600),
    }


def cmd_interval(args: argparse.Namespace) -> int:
    """The checkpoint interval calculator, with the bandwidth measured where asked."""
    measured = None
    if args.bandwidth_gbps == "auto":
        directory = _existing_dir(args.dir)
        note(args, f"measuring write bandwidth in {directory} ({human_bytes(args.probe_size)}, fsync included)")
        scratch = _scratch(directory, "interval")
        try:
            measurement = bench.write_bandwidth(scratch, args.probe_size)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        bandwidth = measurement.gbps
        measured = {"directory": directory, "bytes": args.probe_size, "seconds": round(measurement.seconds, 3)}
    else:
        bandwidth = _positive_float(args.bandwidth_gbps, "--bandwidth-gbps")
    plan = checkpoint_interval(args.model_gb, args.samples_per_sec, bandwidth, args.rework_hours,
                               args.max_overhead_pct / 100)
    plan["measured"] = measured
    overflowed = [key for key, value in plan.items() if isinstance(value, float) and not math.isfinite(value)]
    if overflowed:
        print(f"tensorferry interval: warning: with these inputs the results overflow: {', '.join(overflowed)} "
              "(null with --json)", file=sys.stderr)
    if not plan["rework_bound_met"]:
        print(f"tensorferry interval: warning: keeping saves under {args.max_overhead_pct:g}% of training time "
              f"needs an interval of {human_duration(plan['min_interval_seconds'])}, longer than the "
              f"{human_duration(args.rework_hours * 3600)} of rework allowed; meeting both takes "
              f"{plan['bandwidth_needed_gbps']:.2f} GB/s or more", file=sys.stderr)
    source = f"measured in {measured['directory']}" if measured else "given"
    lines = [
        f"checkpoint every {plan['interval_samples']:,.0f} samples ({human_duration(plan['interval_seconds'])} "
        f"of training)",
        f"  a save of {args.model_gb:g} GB at {bandwidth:.2f} GB/s ({source}) takes "
        f"{human_duration(plan['checkpoint_seconds'])}: {plan['overhead']:.1%} of training time "
        f"(limit {args.max_overhead_pct:g}%)",
        f"  a crash loses at most {human_duration(plan['interval_seconds'])} of training "
        f"({plan['interval_samples']:,.0f} samples), half that on average",
        f"  bounds: rework {args.rework_hours:g} h = {plan['rework_samples']:,.0f} samples; "
        f"overhead {args.max_overhead_pct:g}% = at least {plan['min_interval_samples']:,.0f} samples",
    ]
    emit(args, plan, "\n".join(lines))
    return EXIT_OK


# ---------------------------------------------------------------- arguments

def _positive_float(text: str, name: str = "value") -> float:
    try:
        value = float(text)
    except ValueError:
        raise CLIError(f"{name}: expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise CLIError(f"{name}: must be a positive number, got {text!r}")
    return value


def _positive_arg(text: str) -> float:
    try:
        return _positive_float(text)
    except CLIError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tensorferry`` command."""
    parser = argparse.ArgumentParser(prog="tensorferry", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tensorferry {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of text")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars or notes on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help_text, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    p = add("bench", "engine and checkpoint throughput vs fio and peers",
            "Measures engine write/read and checkpoint save/load on DIR, with fio (if installed) and the\n"
            "installed peers (a plain write, safetensors, torch.save, torch DCP) in the same run. Writes\n"
            "are timed until durable (fsync), reads start from a dropped page cache. Everything is\n"
            "written in a private temporary directory under DIR and removed afterwards.")
    p.add_argument("dir", metavar="DIR", help="a directory on the drive to measure")
    p.add_argument("--size", type=size_arg, default=parse_size("2G"), help="bytes per run (default 2G)")
    p.add_argument("--count", type=count_arg, default=64, help="arrays in the checkpoint (default 64)")
    p.add_argument("--backends", type=bench.backends_arg,
                   help="comma-separated engine backends (default: every usable one)")
    p.add_argument("--plot", metavar="PNG", help="also draw a bar chart (needs the [plot] extra)")
    p.set_defaults(func=cmd_bench)

    p = add("tune", "find the fastest block size, depth/threads and backend for a drive",
            "Searches block_size x queue_depth (io_uring) or threads (threads backend) on DIR: a coarse\n"
            "grid, then a hill climb that stops when steps stop improving, cut short once a setting comes\n"
            "within --tolerance of fio; the best few are measured again. Each trial writes --size bytes\n"
            "with an fsync and reads them back from a dropped page cache. Prints (or writes with -o) the\n"
            "result as IOConfig keywords (\"io_config\") and as a DeepSpeed \"aio\" section (\"deepspeed\").")
    p.add_argument("dir", metavar="DIR", help="a directory on the drive to tune for")
    p.add_argument("--size", type=size_arg, default=parse_size("1G"), help="bytes per trial (default 1G)")
    p.add_argument("--op", choices=("both", "write", "read"), default="both",
                   help="what to be fast at (default both: a write and a read)")
    p.add_argument("--max-seconds", type=_positive_arg, default=120.0,
                   help="time budget for the search (default 120)")
    p.add_argument("--tolerance", type=_positive_arg, default=0.03,
                   help="stop refining within this fraction of fio (default 0.03)")
    p.add_argument("--backends", type=bench.backends_arg,
                   help="comma-separated engine backends (default: every usable one)")
    p.add_argument("-o", "--output", metavar="JSON", help="also write the result to this file")
    p.add_argument("--plot", metavar="PNG", help="also draw a heat map (needs the [plot] extra)")
    p.set_defaults(func=cmd_tune)

    known = ("a tensorferry checkpoint, a safetensors file, a Hugging Face model folder (shards and\n"
             "model.safetensors.index.json, or torch's distributed HuggingFaceStorageWriter's shards), a torch\n"
             "DCP directory (torch's writer or tensorferry's) or an Orbax checkpoint (items of tensorferry's\n"
             "handler; those of Orbax's pytree handlers with orbax-checkpoint installed)")
    p = add("inspect", "what a checkpoint holds and whether it is complete",
            f"Lists the tensors (shape, dtype, size), files, ranks and metadata of\n{known},\n"
            "and says whether it is complete. Exit status 1 if it is not.")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or file")
    p.add_argument("--limit", type=int, default=50, help="tensors to list in the text output (0: all; default 50)")
    p.set_defaults(func=cmd_inspect)

    p = add("verify", "re-hash a checkpoint against its checksums",
            "Re-reads every file of a checkpoint and checks the checksums tensorferry wrote: against the\n"
            "manifest for a tensorferry checkpoint (or a DCPWriter's, or the index of an Orbax item), per\n"
            "tensor in safetensors files that carry them. Where a layout keeps no checksums (torch's DCP,\n"
            "files from elsewhere), checks that every file is there, long enough and consistent (torch's\n"
            "DCP: that every tensor loads).\n"
            "Exit status 1, with the names of the bad files, on any mismatch or missing file.")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or file")
    p.set_defaults(func=cmd_verify)

    p = add("clean", "remove what killed saves left in a directory",
            "Removes the temporaries of interrupted saves in ROOT and the directories under it: files and\n"
            "checkpoint directories named <name>.tmp-<token> (as tensorferry names them: other names with\n"
            "'.tmp-' in them are left alone) that no running save holds (each save holds a lock on its own).\n"
            "Checkpoint directories are not searched, nor other filesystems, nor symbolic links followed; a\n"
            "directory it cannot list is named, and the exit status is 1. An old checkpoint that an\n"
            "interrupted overwrite moved aside, with nothing at its name, is kept: it is the checkpoint.")
    p.add_argument("root", metavar="ROOT", help="the directory holding checkpoints or saved files")
    p.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    p.set_defaults(func=cmd_clean)

    p = add("convert", "any checkpoint layout -> a tensorferry checkpoint or one safetensors file",
            f"Reads\n{known},\n"
            "and writes one safetensors file (--to safetensors) or a tensorferry checkpoint (--to tensorferry).\n"
            "Items that are not tensors (DCP's pickled objects, Orbax scalars) are left out. Metadata keys of\n"
            "string values stay where they were; others travel as JSON under 'tensorferry.metadata'. The\n"
            "structure of tensorferry.adapters.pytorch goes where that adapter's load reads it (left out, and\n"
            "said, with --select).\n"
            "Streams tensors in batches of a few MiB (memory stays near that), checks the source's\n"
            "checksums as it reads, and replaces DST only once the new one is complete.")
    p.add_argument("src", metavar="SRC", help="source checkpoint directory or file")
    p.add_argument("dst", metavar="DST", help="destination file (--to safetensors) or directory")
    p.add_argument("--to", choices=("safetensors", "tensorferry"), required=True, help="the format to write")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--shard-size", type=size_arg, default=DEFAULT_SHARD_BYTES,
                   help="--to tensorferry: about this many bytes per shard file (default 512M)")
    p.add_argument("--select", metavar="PREFIX",
                   help="only the tensors whose names start with PREFIX, written without it: --select model. "
                        "takes the model's weights from a step of FSDPCheckpointer, as the module names them")
    p.add_argument("--no-verify", action="store_true", help="do not check the source's checksums")
    p.set_defaults(func=cmd_convert)

    p = add("interval", "how often to checkpoint",
            "Checkpoint as seldom as the rework bound allows (a crash loses up to one interval), but\n"
            "never so often that saving takes more than --max-overhead-pct of training time.\n"
            "--bandwidth-gbps auto (the default) measures the write bandwidth of --dir with a short\n"
            "engine write, fsync included.")
    p.add_argument("--model-gb", type=_positive_arg, required=True, help="checkpoint size in GB (1e9 bytes)")
    p.add_argument("--samples-per-sec", type=_positive_arg, required=True, help="training throughput")
    p.add_argument("--bandwidth-gbps", default="auto", help="checkpoint write bandwidth in GB/s, or auto")
    p.add_argument("--rework-hours", type=_positive_arg, default=0.5,
                   help="training a crash may lose, at most (default 0.5)")
    p.add_argument("--max-overhead-pct", type=_positive_arg, default=5.0,
                   help="most of training time saving may take (default 5)")
    p.add_argument("--dir", default=".", help="where to measure with auto (default: the current directory)")
    p.add_argument("--probe-size", type=size_arg, default=parse_size("1G"),
                   help="bytes to write when measuring (default 1G)")
    p.set_defaults(func=cmd_interval)
    return parser


def _reader_gone() -> int:
    """The end of a command whose stdout's reader stopped reading (``tensorferry inspect
    CKPT | head``): no message, as ``cat`` gives none, and the status a shell reports for a
    command ended by SIGPIPE (128 + 13), which ``set -o pipefail`` scripts already expect
    of ``cat | head``; the command's own status (0 or 1) would claim a whole output. The
    rest of stdout goes to /dev/null, or the flush at exit would fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        # Library warnings (O_DIRECT refused, memory not page-locked) as one plain line each.
        warnings.showwarning = lambda message, category, *rest, **kw: print(
            f"tensorferry {args.command}: warning: {message}", file=sys.stderr)
        try:
            status = args.func(args)
            if sys.stdout is not None:  # None where the command started with stdout closed (>&-): print wrote nothing
                sys.stdout.flush()  # a reader gone (| head) is found here, not in the flush at exit
            return status
        except BrokenPipeError:
            return _reader_gone()
        except CLIError as exc:
            print(f"tensorferry {args.command}: {'error: ' if exc.status == EXIT_ERROR else ''}{exc}",
                  file=sys.stderr)
            return exc.status
        except (TensorferryError, OSError) as exc:
            print(f"tensorferry {args.command}: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt:
            print(f"tensorferry {args.command}: interrupted", file=sys.stderr)
            return 130
        except Exception:  # a bug: keep the traceback, and keep status 1 for findings
            traceback.print_exc()
            print(f"tensorferry {args.command}: internal error; please report it with the traceback above",
                  file=sys.stderr)
            return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
