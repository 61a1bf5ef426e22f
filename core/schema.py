"""What a checkpoint's files may contain, checked in one place before anything trusts them.

Every name a manifest, index or metadata file gives is taken through :func:`member_path`
(a plain name inside the checkpoint, never a path leading out of it); every small file
(a manifest, an index) through :func:`read_small_file` (a regular file, of bounded size:
never a FIFO that blocks, never ``/dev/zero``); every JSON document through
:func:`parse_json`. Whatever fails is a :class:`CorruptCheckpointError` naming the file
and what is wrong in it, never a ``KeyError``, ``TypeError`` or ``RecursionError``.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .dtypes import to_numpy_dtype
from .errors import CorruptCheckpointError

MAX_NAME_BYTES = 255  # NAME_MAX of Linux filesystems
MAX_SMALL_FILE_BYTES = 256 << 20  # a manifest of a million tensors is about 200 MiB
MAX_DIMS = 64  # numpy 2 allows no more (a 65-dimensional shape failed there, untyped)
MAX_TENSOR_NAME_CHARS = 4096
MAX_TENSORS = 10_000_000
MANIFEST_VERSION = 2
MANIFEST_CHECKSUM_KEY = b',"manifest_checksum":"'
_HEX16 = re.compile(r"[0-9a-f]{16}")


def member_path(directory: str | os.PathLike, name: Any) -> Path:
    """The path of file ``name`` inside ``directory``, where ``name`` comes from a file
    that may be damaged or hostile (a manifest, an index, a metadata file).

    ``name`` must be a plain file name: a non-empty string without a path separator or
    NUL, not ``.`` or ``..``, at most ``MAX_NAME_BYTES`` bytes in UTF-8. If the entry is
    a symbolic link, it must resolve to a place inside ``directory``, or, where
    ``directory`` is a snapshot of a Hugging Face cache, into that repository's ``blobs``
    (:func:`hub_cache_blobs`). Raises :class:`CorruptCheckpointError` naming both.
    """
    directory = os.fspath(directory)
    problem = _name_problem(name)
    if problem is not None:
        raise CorruptCheckpointError(f"{directory}: the file name {_shown(name)} {problem}; "
                                     "a checkpoint names only plain files inside itself")
    path = Path(directory, name)
    if path.is_symlink():
        target = os.path.realpath(path)
        roots = [os.path.realpath(directory)] + [b for b in [hub_cache_blobs(directory)] if b is not None]
        if not any(os.path.commonpath([root, target]) == root for root in roots):
            raise CorruptCheckpointError(f"{directory}: {name} is a symbolic link leading out of the "
                                         f"checkpoint (to {target})")
    return path


def hub_cache_blobs(directory: str | os.PathLike) -> str | None:
    """The ``blobs`` folder of the Hugging Face cache repository ``directory`` is a
    snapshot of (or lies in), or None: ``snapshot_download`` gives
    ``<cache>/models--org--name/snapshots/<revision>/``, whose files are links to
    ``../../blobs/<hash>``, the files the repository holds, downloaded once for all its
    revisions."""
    at = Path(os.path.realpath(directory))
    for revision in (at, *at.parents):
        if revision.parent.name == "snapshots":
            blobs = revision.parent.parent / "blobs"
            return str(blobs) if blobs.is_dir() else None
    return None


def hub_cache_hint(directory: str | os.PathLike) -> str:
    """For a Hugging Face cache repository (``models--org--name``) given instead of one
    of its snapshots: which snapshot to give, as a clause to add to the error, or ``""``."""
    snapshots = os.path.join(directory, "snapshots")
    if not (os.path.isdir(snapshots) and os.path.isdir(os.path.join(directory, "blobs"))):
        return ""
    try:
        revisions = sorted(os.listdir(snapshots))
    except OSError:  # a hint must not hide the error it is added to
        return ""
    if not revisions:
        return ""
    try:
        main = read_small_file(os.path.join(directory, "refs", "main")).decode().strip()
    except (OSError, CorruptCheckpointError, UnicodeDecodeError):
        main = None
    chosen = main if main in revisions else revisions[0] if len(revisions) == 1 else None
    if chosen is not None:
        return (f"; it is a Hugging Face cache repository: give its snapshot {os.path.join(snapshots, chosen)} "
                "(what huggingface_hub.snapshot_download returns)")
    return f"; it is a Hugging Face cache repository: give one of its snapshots in {snapshots} ({', '.join(revisions)})"


# The files of tensorferry's own layouts (a checkpoint's shard, a DCPWriter rank's, a JAX
# process's) and a rank's file of torch's distributed Hugging Face writer: parts of a
# save, never a model by themselves.
PART_FILE = re.compile(r"(shard-\d{5}|rank\d{5}-\d{3}|process-\d+|shard-\d{5}-model-\d{5}-of-\d{5})\.safetensors")

ORBAX_STEP_MARKER = "_CHECKPOINT_METADATA"  # what Orbax writes into each step directory
ORBAX_TEMPORARY_MARKER = ".orbax-checkpoint-tmp"  # in the name of a step Orbax is still writing

# The step a checkpoint's directory is of: the number its name ends with (step_1000, an
# Orbax step "1000" or "checkpoint_1000").
STEP_NUMBER = re.compile(r"(\d+)$")


def _name_problem(name: Any) -> str | None:
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if name in ("", ".", ".."):
        return "is not a file name"
    if "/" in name or os.sep in name or (os.altsep and os.altsep in name):
        return "contains a path separator"
    if "\0" in name:
        return "contains a NUL character"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode"
    if size > MAX_NAME_BYTES:
        return f"is {size} bytes long (at most {MAX_NAME_BYTES})"
    return None


def check_name(where: str, name: Any) -> str:
    """``name`` if it is a plain file name (:func:`member_path`'s rules, without looking at
    the filesystem); raises :class:`CorruptCheckpointError` otherwise."""
    problem = _name_problem(name)
    if problem is not None:
        raise CorruptCheckpointError(f"{where}: the file name {_shown(name)} {problem}; "
                                     "a checkpoint names only plain files inside itself")
    return name


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def read_small_file(path: str | os.PathLike, limit: int = MAX_SMALL_FILE_BYTES) -> bytes:
    """The contents of a small file (a manifest, an index), read only if it is a regular
    file of at most ``limit`` bytes.

    Opened non-blocking, so that a FIFO in its place cannot hang the reader, and checked
    with ``fstat`` before a byte is read, so that a link to ``/dev/zero`` cannot make it
    read until memory runs out. ``FileNotFoundError`` passes through (callers say what is
    missing); anything else that is not a regular file, or is too large, raises
    :class:`CorruptCheckpointError`.
    """
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpointError(f"{path} is not a regular file ({_file_kind(info.st_mode)})")
        if info.st_size > limit:
            raise CorruptCheckpointError(f"{path} has {info.st_size} bytes, more than the {limit} "
                                         "a file of its kind may have")
        chunks, total = [], 0
        while True:  # to the end, in case the file grew since fstat; never past the cap
            chunk = os.read(fd, min(limit + 1 - total, 1 << 24) or 1)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise CorruptCheckpointError(f"{path} grew past the {limit} bytes a file of its kind may have")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def parse_json(data: bytes | str, what: str, path: str | os.PathLike) -> Any:
    """``data`` decoded as JSON; a malformed document, or one nested too deeply for the
    decoder, raises :class:`CorruptCheckpointError` naming ``path`` and ``what`` it is."""
    try:
        return json.loads(data)
    except RecursionError:
        raise CorruptCheckpointError(f"{os.fspath(path)}: the {what} is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{os.fspath(path)}: the {what} is not valid JSON ({exc})") from None


NON_FINITE_FLOATS = ("nan", "inf", "-inf")


def non_finite_name(value: Any) -> str | None:
    """The name (one of ``NON_FINITE_FLOATS``) under which a JSON document here stores a
    float JSON has no number for; None for any other value. ``json.dumps`` would write a
    bare ``NaN`` or ``Infinity``, which jq, JavaScript and strict parsers refuse."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else "inf" if value > 0 else "-inf"
    return None


def check_tensor_entry(where: str, name: Any, entry: Any) -> tuple[str, tuple[int, ...], int, int]:
    """``(dtype, shape, begin, end)`` of a tensor as a safetensors header or a manifest
    lists it, with every field checked: a known dtype, at most ``MAX_DIMS`` non-negative
    integer dimensions, integer ``data_offsets`` spanning exactly the tensor's bytes."""
    if not isinstance(name, str) or len(name) > MAX_TENSOR_NAME_CHARS:
        raise CorruptCheckpointError(f"{where}: tensor name {_shown(name)} is not a string of at most "
                                     f"{MAX_TENSOR_NAME_CHARS} characters")
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{where}: entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has no dtype")
    try:
        itemsize = to_numpy_dtype(dtype).itemsize
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: tensor {name!r}: {exc}") from None
    if not (type(shape) is list and len(shape) <= MAX_DIMS and all(type(d) is int and d >= 0 for d in shape)):
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has an invalid shape {_shown(shape)} "
                                     f"(at most {MAX_DIMS} non-negative integers)")
    if not (type(offsets) is list and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has invalid data_offsets {_shown(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has invalid data_offsets {offsets}")
    expected = math.prod(shape) * itemsize  # Python ints: no overflow on absurd shapes
    if expected != end - begin:
        raise CorruptCheckpointError(f"{where}: tensor {name!r}: {dtype}{shape} needs {expected} bytes "
                                     f"but data_offsets span {end - begin}")
    return dtype, tuple(shape), begin, end


STRUCTURE_KEY = "tensorferry.structure"
MAX_STRUCTURE_DEPTH = 200  # nodes within nodes; a state dict nests a few levels deep
_LEAF_KINDS = ("tensor", "tensor_requires_grad", "parameter", "parameter_no_grad", "ndarray", "npscalar")


def walk_structure(structure: Any, where: str, what: str, children_of: Callable[[Any], Iterable[Any]]) -> None:
    """Visits every node of a saved tree, ``children_of(node)`` giving each node's
    children (and raising :class:`CorruptCheckpointError` for a node it cannot read),
    refusing trees more than ``MAX_STRUCTURE_DEPTH`` deep. Walked without recursion, so
    that no depth of a damaged file reaches Python's recursion limit before it is refused."""
    stack = [(structure, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_STRUCTURE_DEPTH:
            raise CorruptCheckpointError(f"{where}: the {what} nests more than {MAX_STRUCTURE_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in children_of(node))


def check_structure(structure: Any, where: str, tensor_names: Any) -> None:
    """Raises :class:`CorruptCheckpointError` unless ``structure`` is a tree as
    ``adapters.pytorch.save`` encodes it: nodes ``{"dict": [[str or int, node], ...]}``,
    ``{"ordered_dict": {"items": [[str or int, node], ...], "_metadata": node}}`` (``_metadata``
    optional), ``{"list" | "tuple": [node, ...]}``, ``{"tensor" | "tensor_requires_grad" | "parameter" |
    "parameter_no_grad" | "ndarray" | "npscalar": name}``
    (a name in ``tensor_names``), ``{"value": scalar}``, ``{"float": "nan" | "inf" | "-inf"}``,
    ``{"dtype": str}`` or ``{"size": [int64, ...]}``, at most ``MAX_STRUCTURE_DEPTH`` deep
    (:func:`walk_structure`)."""

    def pairs_of(kind: str, value: Any) -> list[Any]:
        if not (type(value) is list and all(type(item) is list and len(item) == 2
                                            and type(item[0]) in (str, int) for item in value)):
            raise CorruptCheckpointError(f"{where}: {kind} node holds {_shown(value)}, not [key, node] pairs "
                                         "with str or int keys")
        return [item[1] for item in value]

    def children_of(node: Any) -> Iterable[Any]:
        if not isinstance(node, dict) or len(node) != 1:
            raise CorruptCheckpointError(f"{where}: unreadable structure node {_shown(node)}")
        (kind, value), = node.items()
        if kind == "dict":
            return pairs_of("a dict", value)
        if kind == "ordered_dict":
            if not (isinstance(value, dict) and "items" in value and set(value) <= {"items", "_metadata"}):
                raise CorruptCheckpointError(f"{where}: an ordered_dict node holds {_shown(value)}, not "
                                             '{"items": [...]} and at most a "_metadata" node')
            return pairs_of("an ordered_dict", value["items"]) + ([value["_metadata"]] if "_metadata" in value else [])
        if kind in ("list", "tuple"):
            if type(value) is not list:
                raise CorruptCheckpointError(f"{where}: a {kind} node holds {_shown(value)}, not a list")
            return value
        if kind in _LEAF_KINDS:
            if not isinstance(value, str) or value not in tensor_names:
                raise CorruptCheckpointError(f"{where}: the structure names a missing tensor {_shown(value)}")
        elif kind == "value":
            if value is not None and type(value) not in (bool, int, float, str):
                raise CorruptCheckpointError(f"{where}: a value node holds {_shown(value)}, not a scalar")
        elif kind == "float":
            if value not in NON_FINITE_FLOATS:
                raise CorruptCheckpointError(f"{where}: a float node holds {_shown(value)}")
        elif kind == "dtype":
            if not isinstance(value, str):
                raise CorruptCheckpointError(f"{where}: a dtype node holds {_shown(value)}")
        elif kind == "size":
            if not (type(value) is list and all(type(d) is int and -2**63 <= d < 2**63 for d in value)):
                raise CorruptCheckpointError(f"{where}: a size node holds {_shown(value)}, not a list of "
                                             "64-bit integers")
        else:
            raise CorruptCheckpointError(f"{where}: unknown structure node {_shown(kind)}")
        return ()

    walk_structure(structure, where, "saved structure", children_of)


def seal_manifest(body: bytes) -> bytes:
    """A manifest (a JSON object, compact) with its own checksum as its last member:
    ``"manifest_checksum"``, the xxh3-64 of every byte before ``,"manifest_checksum"``."""
    from .shard import digest
    head = body.rstrip()[:-1]
    return head + MANIFEST_CHECKSUM_KEY + digest(head).encode() + b'"}'


def unseal_manifest(data: bytes, path: str | os.PathLike = "manifest") -> bytes:
    """The manifest ``data`` without its checksum member, once that checksum is found to
    match; a manifest without one (format version 1) as it is. A mismatch raises
    :class:`CorruptCheckpointError`."""
    at = data.rfind(MANIFEST_CHECKSUM_KEY)
    if at < 0:
        return data
    from .shard import digest
    start = at + len(MANIFEST_CHECKSUM_KEY)
    stored, tail = data[start:start + 16], data[start + 16:]
    if tail.rstrip() != b'"}' or digest(data[:at]).encode() != stored:
        raise CorruptCheckpointError(f"{os.fspath(path)}: the manifest does not match its checksum: "
                                     "it is damaged")
    return data[:at] + b"}"


def validate_manifest(manifest: Any, path: str | os.PathLike, *, sealed: bool) -> dict[str, Any]:
    """``manifest`` if every field has the type and range the format gives it (``sealed``:
    it carried a matching checksum); raises :class:`CorruptCheckpointError` naming the
    first field that does not."""
    path = os.fspath(path)

    def corrupt(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {why}")

    if not isinstance(manifest, dict) or manifest.get("format") != "tensorferry":
        raise corrupt("not a tensorferry manifest")
    version = manifest.get("format_version")
    if type(version) is not int or version < 1:
        raise corrupt(f"format_version {_shown(version)} is not a positive integer")
    if version > MANIFEST_VERSION:
        raise corrupt(f"format version {version}; this tensorferry reads up to {MANIFEST_VERSION}")
    if version >= 2 and not sealed:
        raise corrupt(f"format version {version} needs a manifest_checksum, and it has none: it is damaged")
    if manifest.get("checksum_algorithm", "xxh3_64") != "xxh3_64":
        raise corrupt(f"unknown checksum_algorithm {_shown(manifest['checksum_algorithm'])}")
    committed = manifest.get("committed_at", 0.0)
    if type(committed) not in (int, float):
        raise corrupt(f"committed_at {_shown(committed)} is not a number")
    metadata = manifest.setdefault("metadata", {})
    if not isinstance(metadata, dict):
        raise corrupt("metadata is not an object")
    for section in ("files", "tensors", "other_files"):
        if not isinstance(manifest.get(section, {}), dict) or section not in manifest and section != "other_files":
            raise corrupt(f"{section} is missing or not an object")
    if len(manifest["tensors"]) > MAX_TENSORS:
        raise corrupt(f"lists {len(manifest['tensors'])} tensors, more than {MAX_TENSORS}")
    for section in ("files", "other_files"):
        for name, entry in manifest.get(section, {}).items():
            check_name(path, name)
            if not (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
                    and isinstance(entry.get("checksum"), str) and _HEX16.fullmatch(entry["checksum"])):
                raise corrupt(f"{section} entry {name!r} needs an integer size and a 16-digit hex checksum, "
                              f"not {_shown(entry)}")
    files = manifest["files"]
    for name, entry in manifest["tensors"].items():
        check_tensor_entry(path, name, entry)
        if not isinstance(entry.get("file"), str) or entry["file"] not in files:
            raise corrupt(f"tensor {name!r} lies in {_shown(entry.get('file'))}, which the manifest "
                          "does not list among its files")
        if not isinstance(entry.get("checksum", ""), str):
            raise corrupt(f"tensor {name!r} has a checksum that is not a string")
    return manifest


def check_index(where: str, index: Mapping[str, Any], name: str, header: Any) -> None:
    """Raises :class:`CorruptCheckpointError` unless tensor ``name`` of a manifest
    (``index``, as :func:`validate_manifest` passed it) is where and what the shard file's
    header (a :class:`tensorferry.shard.TensorInfo`, or None if absent) says."""
    entry = index[name]
    if header is None:
        raise CorruptCheckpointError(f"{where}: the manifest places tensor {name!r} in this file, "
                                     "which does not hold it")
    if (entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]) != (header.dtype, header.shape,
                                                                         [header.begin, header.end]):
        raise CorruptCheckpointError(f"{where}: the manifest and the file disagree about tensor {name!r}")


__all__ = ["MAX_DIMS", "MAX_NAME_BYTES", "MAX_SMALL_FILE_BYTES", "check_index", "check_name",
           "check_structure", "check_tensor_entry", "walk_structure", "STRUCTURE_KEY", "member_path", "parse_json",
           "read_small_file", "seal_manifest", "unseal_manifest", "validate_manifest", "hub_cache_blobs",
           "hub_cache_hint", "NON_FINITE_FLOATS", "non_finite_name", "ORBAX_STEP_MARKER", "PART_FILE", "STEP_NUMBER"]
