"""The tensorferry command: bench, tune, inspect, verify, convert and interval.

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
import datetime
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from . import __version__, bench
from .checkpoint import (DEFAULT_SHARD_BYTES, MANIFEST, PendingCheckpoint, open_shard, read_manifest,
                         split_by_size, verify_checkpoint, verify_shard)
from .config import parse_size
from .errors import ConfigError, CorruptCheckpointError, TensorferryError
from .shard import ShardReader, ShardWriter

EXIT_OK, EXIT_FINDING, EXIT_ERROR = 0, 1, 2
# A tensorferry checkpoint's user metadata (any JSON) rides in this key of a
# consolidated safetensors file's string-to-string metadata, so it survives a round trip.
METADATA_KEY = "tensorferry.metadata"
DCP_METADATA = ".metadata"
ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "orbax.checkpoint", "manifest.ocdbt", "_sharding")


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
    print(json.dumps(data, indent=2) if args.json else text)


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


def _backends(text: str | None) -> list[str]:
    """The backends named (comma-separated), or every one this machine can use."""
    if text is None:
        return ["io_uring", "threads"] if bench.io_uring_probe()[0] else ["threads"]
    names = [b.strip() for b in text.split(",") if b.strip()]
    for name in names:
        if name not in bench.PARALLELISM:
            raise CLIError(f"unknown backend {name!r} (choose from {', '.join(bench.PARALLELISM)})")
        if name == "io_uring" and not bench.io_uring_probe()[0]:
            raise CLIError(f"io_uring is not usable here: {bench.io_uring_probe()[1]}")
    return names


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
    plt = _pyplot() if args.plot else None  # fail before minutes of measuring, not after
    backends = _backends(args.backends)
    if not bench.fio_available():
        note(args, "fio is not installed: no ceiling to compare with")
    if not bench.torch_available():
        note(args, "torch is not installed: torch.save and DCP are not measured")
    scratch = _scratch(directory, "bench")
    try:
        with progress_bar(args, unit="step") as bar:
            results = bench.bench_engine(scratch, args.size, backends, progress=_stepper(bar))
            state = bench.make_state(args.size, args.count)
            results += bench.bench_checkpoint(scratch, state, fio=False, progress=_stepper(bar))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = bench.report_rows(results)
    if plt is not None:
        _plot_bench(plt, rows, directory, args.plot)
        note(args, f"wrote {args.plot}")
    data = {"directory": directory, "size": args.size, "arrays": args.count, "results": rows}
    header = f"{directory}: {human_bytes(args.size)} per run, checkpoint of {args.count} arrays"
    emit(args, data, header + "\n" + bench.report(results))
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
    if args.output:
        with open(args.output, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        note(args, f"wrote {args.output}")
    if plt is not None:
        _plot_tune(plt, result, directory, args.plot)
        note(args, f"wrote {args.plot}")
    emit(args, data, _tune_text(result, directory))
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


# ---------------------------------------------------------------- checkpoint formats

def checkpoint_kind(path: str) -> str:
    """What ``path`` holds: "tensorferry", "safetensors" (a file), "safetensors-dir" (shard files
    without a manifest), "torch-dcp" or "orbax"; raises CLIError for anything else."""
    if os.path.isfile(path):
        return "safetensors"
    if not os.path.exists(path):
        raise CLIError(f"{path}: no such file or directory")
    if not os.path.isdir(path):
        raise CLIError(f"{path}: neither a file nor a directory")
    names = set(os.listdir(path))
    if MANIFEST in names:
        return "tensorferry"
    if DCP_METADATA in names or any(n.endswith(".distcp") for n in names):
        return "torch-dcp"
    subdirs = [os.path.join(path, n) for n in names if os.path.isdir(os.path.join(path, n))]
    if names & set(ORBAX_MARKERS) or any(os.path.exists(os.path.join(d, m)) for d in subdirs for m in ORBAX_MARKERS):
        return "orbax"
    if any(n.endswith(".safetensors") for n in names):
        return "safetensors-dir"
    raise CLIError(f"{path}: not a checkpoint (no {MANIFEST}, no DCP {DCP_METADATA}, no Orbax metadata, "
                   "no safetensors files)")


def _tensor_row(name: str, dtype: str, shape: Sequence[int] | None, nbytes: int | None, **more: Any) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": None if shape is None else list(shape), "nbytes": nbytes, **more}


def _read_safetensors(path: str) -> dict[str, Any]:
    """The tensors, metadata and consistency of one safetensors file (its header only is read)."""
    try:
        reader = ShardReader(path, verify=False)
    except CorruptCheckpointError as exc:
        if path.endswith(".safetensors"):  # meant to be one, so a damaged one: a finding
            raise CLIError(str(exc), EXIT_FINDING) from None
        raise CLIError(f"{path}: not a checkpoint tensorferry can read (not a tensorferry or DCP directory, "
                       f"not a safetensors file: {exc})") from None
    with reader:
        ordered = sorted(reader.tensors.items(), key=lambda kv: kv[1].begin)
        tensors = [_tensor_row(n, t.dtype, t.shape, t.nbytes) for n, t in ordered]
        end = reader.data_start + max((t.end for t in reader.tensors.values()), default=0)
        problems = []
        if reader.size > end:
            problems.append(f"{os.path.basename(path)}: {reader.size - end} bytes after the last tensor")
        return {"tensors": tensors, "metadata": reader.metadata, "size": reader.size,
                "checksummed": bool(reader.tensors) and all(t.checksum for t in reader.tensors.values()),
                "problems": problems}


def describe(path: str) -> dict[str, Any]:
    """What a checkpoint holds and whether it is complete, in one shape for every format."""
    kind = checkpoint_kind(path)
    try:
        return {"tensorferry": _describe_tensorferry, "safetensors": _describe_safetensors,
                "safetensors-dir": _describe_safetensors_dir, "torch-dcp": _describe_dcp,
                "orbax": _describe_orbax}[kind](path)
    except CLIError as exc:
        if exc.status != EXIT_FINDING:
            raise
        # Unreadable (a corrupt manifest or header): still a description, of a broken checkpoint.
        return {"path": path, "format": kind, "complete": False, "problems": [str(exc)], "metadata": {},
                "files": [], "tensors": [], "total_bytes": None}


def _describe_tensorferry(path: str) -> dict[str, Any]:
    try:
        manifest = read_manifest(path)
    except TensorferryError as exc:
        raise CLIError(str(exc), EXIT_FINDING) from None
    files, problems = [], []
    for name, entry in manifest["files"].items():
        file_path = os.path.join(path, name)
        size = os.path.getsize(file_path) if os.path.isfile(file_path) else None
        if size is None:
            problems.append(f"{name}: missing")
        elif size != entry["size"]:
            problems.append(f"{name}: {size} bytes, the manifest says {entry['size']}")
        files.append({"name": name, "size": size, "expected_size": entry["size"], "checksum": entry["checksum"]})
    tensors = []
    for name, entry in manifest["tensors"].items():
        begin, end = entry["data_offsets"]
        more = {k: v for k, v in entry.items() if k not in ("dtype", "shape", "data_offsets")}
        tensors.append(_tensor_row(name, entry["dtype"], entry["shape"], end - begin, **more))
    committed = manifest.get("committed_at")
    return {"path": path, "format": "tensorferry", "format_version": manifest.get("format_version"),
            "committed_at": None if committed is None else
            datetime.datetime.fromtimestamp(committed, datetime.timezone.utc).isoformat(timespec="seconds"),
            "checksum_algorithm": manifest.get("checksum_algorithm"),
            "complete": not problems, "problems": problems, "metadata": manifest.get("metadata", {}),
            "files": files, "other_files": sorted(set(os.listdir(path)) - set(manifest["files"]) - {MANIFEST}),
            "tensors": tensors, "total_bytes": sum(t["nbytes"] for t in tensors)}


def _describe_safetensors(path: str) -> dict[str, Any]:
    info = _read_safetensors(path)
    return {"path": path, "format": "safetensors", "complete": not info["problems"], "problems": info["problems"],
            "metadata": info["metadata"], "checksummed": info["checksummed"],
            "files": [{"name": os.path.basename(path), "size": info["size"], "expected_size": None}],
            "tensors": info["tensors"], "total_bytes": sum(t["nbytes"] for t in info["tensors"])}


def _describe_safetensors_dir(path: str) -> dict[str, Any]:
    problems = [f"no {MANIFEST}: not a complete tensorferry checkpoint (an unfinished save, or files "
                "from elsewhere)"]
    files, tensors = [], []
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        file_path = os.path.join(path, name)
        files.append({"name": name, "size": os.path.getsize(file_path), "expected_size": None})
        try:
            info = _read_safetensors(file_path)
        except CLIError as exc:
            problems.append(str(exc))
            continue
        problems += info["problems"]
        tensors += [{**t, "file": name} for t in info["tensors"]]
    return {"path": path, "format": "safetensors-dir", "complete": False, "problems": problems, "metadata": {},
            "files": files, "tensors": tensors, "total_bytes": sum(t["nbytes"] for t in tensors)}


def _describe_dcp(path: str) -> dict[str, Any]:
    names = sorted(os.listdir(path))
    if DCP_METADATA not in names:
        files = [{"name": n, "size": os.path.getsize(os.path.join(path, n)), "expected_size": None}
                 for n in names if n.endswith(".distcp")]
        return {"path": path, "format": "torch-dcp", "complete": False,
                "problems": [f"no {DCP_METADATA}: DCP writes it last, so this save did not finish"],
                "metadata": {}, "files": files, "tensors": [], "total_bytes": None}
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:
        raise CLIError("reading a torch DCP checkpoint needs torch: pip install 'tensorferry[torch]'") from None
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # DCP unpickles the file: any error means it is unreadable
        raise CLIError(f"{os.path.join(path, DCP_METADATA)} cannot be read: {exc}", EXIT_FINDING) from None
    extents: dict[str, int] = {}
    files_of: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
        files_of.setdefault(index.fqn, set()).add(info.relative_path)
    tensors = []
    for fqn, item in metadata.state_dict_metadata.items():
        files = sorted(files_of.get(fqn, ()))
        if hasattr(item, "chunks"):  # a tensor, possibly in pieces from several ranks
            dtype = item.properties.dtype
            tensors.append(_tensor_row(fqn, str(dtype).removeprefix("torch."), item.size,
                                       math.prod(item.size) * dtype.itemsize, shards=len(item.chunks), files=files))
        else:  # any other object, pickled as bytes
            tensors.append(_tensor_row(fqn, "object", None, None, shards=1, files=files))
    files, problems = [], []
    for name in sorted(extents):
        file_path = os.path.join(path, name)
        size = os.path.getsize(file_path) if os.path.isfile(file_path) else None
        if size is None:
            problems.append(f"{name}: missing")
        elif size < extents[name]:
            problems.append(f"{name}: {size} bytes, the metadata needs at least {extents[name]}")
        files.append({"name": name, "size": size, "expected_size": extents[name]})
    ranks = sorted({int(m.group(1)) for m in (re.match(r"__(\d+)_\d+\.distcp$", n) for n in extents) if m})
    return {"path": path, "format": "torch-dcp", "complete": not problems, "problems": problems,
            "metadata": {}, "ranks": ranks or None, "files": files, "tensors": tensors,
            "total_bytes": sum(t["nbytes"] or 0 for t in tensors)}


def _describe_orbax(path: str) -> dict[str, Any]:
    try:
        import jax
        import orbax.checkpoint as ocp
    except ImportError:
        raise CLIError(f"{path} looks like an Orbax checkpoint: unsupported: install orbax-checkpoint "
                       "(pip install 'tensorferry[jax]') to inspect it") from None
    items = [d for d in [path] + sorted(os.path.join(path, n) for n in os.listdir(path))
             if os.path.isdir(d) and os.path.exists(os.path.join(d, "_METADATA"))]
    tensors = []
    for item in items:
        metadata = ocp.PyTreeCheckpointer().metadata(item)
        # Newer Orbax wraps the tree in a StepMetadata; older returns the tree itself.
        tree = metadata.item_metadata if hasattr(metadata, "item_metadata") else metadata
        prefix = "" if item == path else os.path.basename(item) + "/"
        for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            shape = tuple(getattr(leaf, "shape", None) or ())
            dtype = getattr(leaf, "dtype", None)
            tensors.append(_tensor_row(prefix + jax.tree_util.keystr(keys), str(dtype), shape,
                                       None if dtype is None else math.prod(shape) * np.dtype(dtype).itemsize))
    files = [{"name": os.path.relpath(f, path), "size": os.path.getsize(f), "expected_size": None}
             for f in sorted(bench.files_under(path))]
    unfinished = "orbax-checkpoint-tmp" in os.path.basename(os.path.normpath(path))
    problems = ["a temporary directory: this save did not finish"] if unfinished else []
    return {"path": path, "format": "orbax", "complete": not problems, "problems": problems, "metadata": {},
            "files": files, "tensors": tensors, "total_bytes": sum(t["nbytes"] or 0 for t in tensors)}


# ---------------------------------------------------------------- inspect

def cmd_inspect(args: argparse.Namespace) -> int:
    """What a checkpoint holds and whether it is complete."""
    info = describe(args.checkpoint)
    emit(args, info, _inspect_text(info, args.limit))
    return EXIT_OK if info["complete"] else EXIT_FINDING


_KIND_NAMES = {"tensorferry": "tensorferry checkpoint", "safetensors": "safetensors file",
               "safetensors-dir": "directory of safetensors files", "torch-dcp": "torch DCP checkpoint",
               "orbax": "Orbax checkpoint"}


def _file_status(kind: str, file: dict[str, Any]) -> str:
    size, expected = file["size"], file["expected_size"]
    if size is None:
        return "missing"
    # DCP records where its data ends, not the file's size: a longer file is fine.
    if expected is None or size == expected or (kind == "torch-dcp" and size > expected):
        return "ok"
    return f"expected {expected} bytes"


def _inspect_text(info: dict[str, Any], limit: int) -> str:
    head = f"{info['path']}: {_KIND_NAMES[info['format']]}"
    if info.get("format_version") is not None:
        head += f", format {info['format_version']}"
    if info.get("committed_at"):
        head += f", committed {info['committed_at']}"
    lines = [head]
    if info["complete"]:
        lines.append("complete: yes" + {"tensorferry": " (every file the manifest lists is there with its size)",
                                        "torch-dcp": " (every file .metadata names is there and long enough)"}
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
    """Re-hashes a checkpoint against its manifest (or checksums); names every bad file."""
    path = args.checkpoint
    kind = checkpoint_kind(path)
    if kind == "orbax":
        raise CLIError(f"{path} looks like an Orbax checkpoint: unsupported: verifying Orbax checkpoints "
                       "is not implemented")
    if kind == "safetensors-dir":
        names, total, problems, checked = [], None, [f"no {MANIFEST}: not a complete tensorferry checkpoint"], ""
    else:
        verify = {"tensorferry": _verify_tensorferry, "safetensors": _verify_safetensors, "torch-dcp": _verify_dcp}
        names, total, problems, checked = verify[kind](path, args)
    bad = [n for n in names if any(p.startswith(n + ": ") for p in problems)]
    data = {"path": path, "format": kind, "ok": not problems, "checked": checked, "files": len(names),
            "bytes": total, "bad_files": bad, "problems": problems}
    if problems:
        count = f": {len(bad)} of {plural(len(names), 'file')} bad" if bad else ""
        text = [f"{path}: FAILED{count}"] + [f"  {p}" for p in problems]
        print(f"tensorferry verify: {path}: " + (f"bad file(s): {', '.join(bad)}" if bad else problems[0]),
              file=sys.stderr)
    else:
        size = "" if total is None else f", {human_bytes(total)}"
        text = [f"{path}: OK: {plural(len(names), 'file')}{size}; {checked}"]
    emit(args, data, "\n".join(text))
    return EXIT_FINDING if problems else EXIT_OK


Verified = tuple[list[str], int | None, list[str], str]  # file names, bytes, problems, what was checked


def _verify_tensorferry(path: str, args: argparse.Namespace) -> Verified:
    try:
        manifest = read_manifest(path)
    except TensorferryError as exc:
        return [MANIFEST], None, [f"{MANIFEST}: {exc}"], ""
    total = sum(entry["size"] for entry in manifest["files"].values())
    with progress_bar(args, total) as bar:
        problems = verify_checkpoint(path, progress=bar.update)
    return list(manifest["files"]), total, problems, "every checksum matches"


def _verify_safetensors(path: str, args: argparse.Namespace) -> Verified:
    name = os.path.basename(path)
    try:
        info = _read_safetensors(path)
    except CLIError as exc:
        if exc.status != EXIT_FINDING:
            raise
        return [name], None, [f"{name}: {exc}"], ""
    problems = list(info["problems"])
    if not info["checksummed"]:
        return [name], info["size"], problems, "header and sizes consistent (the file carries no checksums)"
    with ShardReader(path) as reader, progress_bar(args, info["size"]) as bar:
        try:
            verify_shard(reader, bar.update)
        except (CorruptCheckpointError, OSError) as exc:
            problems.append(f"{name}: {exc}")
    return [name], info["size"], problems, "every checksum matches"


def _verify_dcp(path: str, args: argparse.Namespace) -> Verified:
    info = describe(path)
    return ([f["name"] for f in info["files"]], None, info["problems"],
            "every file present and long enough (DCP keeps no checksums)")


# ---------------------------------------------------------------- convert

def cmd_convert(args: argparse.Namespace) -> int:
    """A tensorferry or DCP checkpoint to one safetensors file, or a safetensors file to a checkpoint."""
    src, dst = args.src, args.dst
    kind = checkpoint_kind(src)
    through_dcp = kind == "torch-dcp" or (kind == "tensorferry" and os.path.exists(os.path.join(src, DCP_METADATA)))
    if through_dcp and args.to == "safetensors":
        kind = "tensorferry"  # converted below, through DCP's own planner
    if kind == "orbax":
        raise CLIError(f"{src} looks like an Orbax checkpoint: converting from Orbax is not yet supported")
    if kind == "safetensors-dir":
        raise CLIError(f"{src} has no {MANIFEST}: not a complete tensorferry checkpoint")
    wanted_source = {"safetensors": "tensorferry", "tensorferry": "safetensors"}[args.to]
    if kind != wanted_source:
        raise CLIError(f"{src} is already a {kind} {'file' if kind == 'safetensors' else 'checkpoint'}; "
                       f"--to {args.to} converts from a {wanted_source} "
                       f"{'file' if wanted_source == 'safetensors' else 'checkpoint'}")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise CLIError(f"{parent}: no such directory")
    source_root = os.path.realpath(src)
    if os.path.commonpath([source_root, os.path.realpath(dst)]) == source_root:
        raise CLIError(f"{dst} is {src} or lies inside it: write it elsewhere")
    if os.path.lexists(dst):
        if not args.overwrite:
            raise CLIError(f"{dst} exists; pass --overwrite to replace it")
        # Only what this command could have made is replaced, never a directory of other things.
        if args.to == "safetensors" and not os.path.isfile(dst):
            raise CLIError(f"{dst} exists and is not a file: not replacing it")
        if args.to == "tensorferry" and not os.path.isfile(os.path.join(dst, MANIFEST)):
            raise CLIError(f"{dst} exists and is not a tensorferry checkpoint: not replacing it")
    start = time.perf_counter()
    if args.to == "safetensors" and through_dcp:
        count, nbytes = _dcp_to_safetensors(args, src, dst)
    elif args.to == "safetensors":
        count, nbytes = _to_safetensors(args, src, dst)
    else:
        count, nbytes = _to_tensorferry(args, src, dst)
    seconds = time.perf_counter() - start
    data = {"source": src, "destination": dst, "to": args.to, "tensors": count, "bytes": nbytes,
            "seconds": round(seconds, 3), "gbps": round(nbytes / seconds / 1e9, 3)}
    emit(args, data, f"wrote {dst}: {count} tensors, {human_bytes(nbytes)} in {seconds:.1f} s "
                     f"({nbytes / seconds / 1e9:.2f} GB/s)")
    return EXIT_OK


def _lazy(reader: ShardReader, name: str, bar: Any) -> Callable[[], Any]:
    """A source that reads one tensor when the writer gets to it, so only a few are in memory at once."""
    def read() -> Any:
        array = reader.read(name)
        bar.update(array.nbytes)
        return array

    return read


def _to_safetensors(args: argparse.Namespace, src: str, dst: str) -> tuple[int, int]:
    """Streams every tensor of a checkpoint into one safetensors file, written under a
    temporary name and renamed into place once durable."""
    try:
        manifest = read_manifest(src)
    except TensorferryError as exc:
        raise CLIError(str(exc)) from None
    tensors = manifest["tensors"]
    nbytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in tensors.values())
    readers: dict[str, ShardReader] = {}
    try:
        for filename in manifest["files"]:
            readers[filename] = open_shard(src, manifest, filename, verify=not args.no_verify)
        user_metadata = manifest.get("metadata") or {}
        metadata = {METADATA_KEY: json.dumps(user_metadata)} if user_metadata else None
        with progress_bar(args, nbytes) as bar, ShardWriter(dst, metadata=metadata, atomic=True) as writer:
            for name, entry in tensors.items():
                writer.add(name, entry["dtype"], entry["shape"], data=_lazy(readers[entry["file"]], name, bar))
    finally:
        for reader in readers.values():
            reader.close()
    return len(tensors), nbytes


def _dcp_to_safetensors(args: argparse.Namespace, src: str, dst: str) -> tuple[int, int]:
    """Consolidates a DCP checkpoint (tensorferry's DCPWriter or torch's FileSystemWriter)
    into one safetensors file: each tensor is assembled from its shards by DCP's own
    planner, written, and dropped before the next is loaded. Non-tensor items
    (pickled objects) are left out."""
    try:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    except ImportError:
        raise CLIError("converting a DCP checkpoint needs PyTorch: pip install 'tensorferry[torch]'") from None
    from .adapters.pytorch.dcp import DCPReader
    from .adapters.pytorch.tensors import host_bytes, safetensors_dtype

    ours = os.path.exists(os.path.join(src, MANIFEST))

    def reader() -> Any:
        return DCPReader(src, verify=not args.no_verify) if ours else dcp.FileSystemReader(src)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            metadata = reader().read_metadata()
        except Exception as exc:
            raise CLIError(f"{src}: cannot read the DCP metadata ({exc})") from None
        tensors = {fqn: md for fqn, md in metadata.state_dict_metadata.items()
                   if isinstance(md, TensorStorageMetadata)}
        nbytes = sum(math.prod(md.size) * md.properties.dtype.itemsize for md in tensors.values())
        def load_one(fqn: str, md: Any, bar: Any) -> Callable[[], Any]:
            def load() -> Any:
                tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
                dcp.load({fqn: tensor}, storage_reader=reader(), no_dist=True)
                bar.update(tensor.numel() * tensor.element_size())
                return host_bytes(tensor)
            return load

        with progress_bar(args, nbytes) as bar, ShardWriter(dst, atomic=True) as writer:
            for fqn, md in tensors.items():
                writer.add(fqn, safetensors_dtype(md.properties.dtype), tuple(md.size), load_one(fqn, md, bar))
    skipped = len(metadata.state_dict_metadata) - len(tensors)
    if skipped:
        note(args, f"left out {plural(skipped, 'non-tensor item')} (DCP stores them pickled)")
    return len(tensors), nbytes


def _to_tensorferry(args: argparse.Namespace, src: str, dst: str) -> tuple[int, int]:
    """Streams a safetensors file into a checkpoint directory, one shard file at a time,
    split like :func:`tensorferry.save_checkpoint` splits, committed atomically."""
    info = _read_safetensors(src)
    if info["problems"]:
        raise CLIError("; ".join(info["problems"]))
    metadata: dict[str, Any] = dict(info["metadata"])
    if METADATA_KEY in metadata:
        try:
            metadata = json.loads(metadata[METADATA_KEY])
        except ValueError:
            raise CLIError(f"{src}: metadata {METADATA_KEY!r} is not valid JSON") from None
    nbytes = sum(t["nbytes"] for t in info["tensors"])
    with ShardReader(src, verify=not args.no_verify) as reader:
        groups = split_by_size({n: t.nbytes for n, t in reader.tensors.items()}, args.shard_size)
        pending = PendingCheckpoint.begin(dst)
        try:
            shards = []
            with progress_bar(args, nbytes) as bar:
                for index, group in enumerate(groups):
                    with pending.writer(f"shard-{index:05d}.safetensors") as writer:
                        for name in group:
                            t = reader.tensors[name]
                            writer.add(name, t.dtype, t.shape, data=_lazy(reader, name, bar))
                    shards.append(writer.info)
            pending.commit(shards, metadata, overwrite=args.overwrite)
        except BaseException:
            pending.abort()
            raise
    return len(info["tensors"]), nbytes


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

def _size_arg(text: str) -> int:
    try:
        value = parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1 << 20:
        raise argparse.ArgumentTypeError(f"{text}: at least 1M, please")
    return value


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


def _count_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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
    p.add_argument("--size", type=_size_arg, default=parse_size("2G"), help="bytes per run (default 2G)")
    p.add_argument("--count", type=_count_arg, default=64, help="arrays in the checkpoint (default 64)")
    p.add_argument("--backends", help="comma-separated engine backends (default: every usable one)")
    p.add_argument("--plot", metavar="PNG", help="also draw a bar chart (needs the [plot] extra)")
    p.set_defaults(func=cmd_bench)

    p = add("tune", "find the fastest block size, depth/threads and backend for a drive",
            "Searches block_size x queue_depth (io_uring) or threads (threads backend) on DIR: a coarse\n"
            "grid, then a hill climb that stops when steps stop improving, cut short once a setting comes\n"
            "within --tolerance of fio; the best few are measured again. Each trial writes --size bytes\n"
            "with an fsync and reads them back from a dropped page cache. Prints (or writes with -o) the\n"
            "result as IOConfig keywords (\"io_config\") and as a DeepSpeed \"aio\" section (\"deepspeed\").")
    p.add_argument("dir", metavar="DIR", help="a directory on the drive to tune for")
    p.add_argument("--size", type=_size_arg, default=parse_size("1G"), help="bytes per trial (default 1G)")
    p.add_argument("--op", choices=("both", "write", "read"), default="both",
                   help="what to be fast at (default both: a write and a read)")
    p.add_argument("--max-seconds", type=_positive_arg, default=120.0,
                   help="time budget for the search (default 120)")
    p.add_argument("--tolerance", type=_positive_arg, default=0.03,
                   help="stop refining within this fraction of fio (default 0.03)")
    p.add_argument("--backends", help="comma-separated engine backends (default: every usable one)")
    p.add_argument("-o", "--output", metavar="JSON", help="also write the result to this file")
    p.add_argument("--plot", metavar="PNG", help="also draw a heat map (needs the [plot] extra)")
    p.set_defaults(func=cmd_tune)

    p = add("inspect", "what a checkpoint holds and whether it is complete",
            "Lists the tensors (shape, dtype, size), files, ranks and user metadata of a tensorferry\n"
            "checkpoint directory, a safetensors file, a torch DCP directory or (with orbax-checkpoint\n"
            "installed) an Orbax checkpoint, and says whether it is complete. Exit status 1 if it is not.")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or safetensors file")
    p.add_argument("--limit", type=int, default=50, help="tensors to list in the text output (0: all; default 50)")
    p.set_defaults(func=cmd_inspect)

    p = add("verify", "re-hash a checkpoint against its manifest",
            "Re-reads every file of a tensorferry checkpoint and checks it against the manifest and the\n"
            "per-tensor checksums; for a safetensors file, its own checksums where it has them; for a\n"
            "torch DCP directory (which keeps no checksums), that every file is there and long enough.\n"
            "Exit status 1, with the names of the bad files, on any mismatch or missing file.")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or safetensors file")
    p.set_defaults(func=cmd_verify)

    p = add("convert", "tensorferry checkpoint <-> one safetensors file",
            "--to safetensors: a tensorferry checkpoint (all its shards), or a torch DCP checkpoint\n"
            "(tensorferry's DCPWriter or torch's FileSystemWriter; pickled objects are left out), into\n"
            "one consolidated safetensors file. --to tensorferry: a safetensors file into a checkpoint.\n"
            "Streams one tensor at a time (memory stays near a few tensors), checks the source's\n"
            "checksums as it reads, and replaces DST only once the new one is complete.")
    p.add_argument("src", metavar="SRC", help="source checkpoint directory or safetensors file")
    p.add_argument("dst", metavar="DST", help="destination file (--to safetensors) or directory")
    p.add_argument("--to", choices=("safetensors", "tensorferry"), required=True, help="the format to write")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--shard-size", type=_size_arg, default=DEFAULT_SHARD_BYTES,
                   help="--to tensorferry: about this many bytes per shard file (default 512M)")
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
    p.add_argument("--probe-size", type=_size_arg, default=parse_size("1G"),
                   help="bytes to write when measuring (default 1G)")
    p.set_defaults(func=cmd_interval)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        # Library warnings (O_DIRECT refused, memory not page-locked) as one plain line each.
        warnings.showwarning = lambda message, category, *rest, **kw: print(
            f"tensorferry {args.command}: warning: {message}", file=sys.stderr)
        try:
            return args.func(args)
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
