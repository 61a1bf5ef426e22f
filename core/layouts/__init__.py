"""Checkpoint layouts: the ways tensors are kept on disk that tensorferry reads, one module each.

A :class:`Layout` recognises itself from a path, lists its tensors (name, dtype, shape,
bytes, where), verifies what it can and opens a :class:`TensorSource` that reads
tensors through the engine. ``tensorferry inspect``, ``verify`` and ``convert`` and the
adapters' loaders all go through :func:`detect`, so that a new layout is one module
added to :data:`LAYOUTS`.

Example::

    from tensorferry import layouts
    layout = layouts.detect("hf-model/")            # a Hugging Face folder, say
    with layout.open() as source:
        arrays = source.read()                      # every tensor, all files in parallel
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

import numpy as np

from ..buffers import byte_view
from ..checkpoint import MAX_CONCURRENT_SHARDS, cancelled_on_interrupt, names_to_read, refuse_out_when_mapped
from ..dtypes import to_numpy_dtype
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, TensorferryError
from ..pools import ThreadPool
from ..shard import ShardReader, foreign_files_hint

OBJECT = "object"  # the dtype of an item that is not a tensor (DCP's pickled objects, say)


class UnknownLayoutError(TensorferryError, ValueError):
    """A path that holds no checkpoint of any layout tensorferry knows."""


@dataclass(frozen=True)
class Chunk:
    """A stored piece of a tensor: the box at ``offsets`` of size ``sizes``, kept as
    tensor ``key`` of ``file``."""

    file: str
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor (or other item) of a layout, as inspect lists it.

    ``dtype`` is a safetensors dtype name, or ``"object"`` for an item that is not a
    tensor (which sources do not read). ``chunks`` says where the pieces of a tensor
    stored in several places live.
    """

    name: str
    dtype: str
    shape: tuple[int, ...] | None
    nbytes: int | None
    file: str | None = None
    more: Mapping[str, Any] = field(default_factory=dict)
    chunks: tuple[Chunk, ...] = ()

    @property
    def is_tensor(self) -> bool:
        return self.dtype != OBJECT

    def to_json(self) -> dict[str, Any]:
        row = {"name": self.name, "dtype": self.dtype, "shape": None if self.shape is None else list(self.shape),
               "nbytes": self.nbytes}
        if self.file is not None:
            row["file"] = self.file
        return {**row, **self.more}


def tensor_entry(name: str, dtype: str, shape: Sequence[int], **kw: Any) -> TensorEntry:
    """A tensor's entry, its byte count computed from dtype and shape."""
    shape = tuple(int(d) for d in shape)
    return TensorEntry(name, dtype, shape, math.prod(shape) * to_numpy_dtype(dtype).itemsize, **kw)


@dataclass(frozen=True)
class Verification:
    """What :meth:`Layout.verify` found: the files checked, their bytes (None when not
    known), the problems (each ``"<file>: ..."`` where a file is to blame) and what was checked
    (the checks made, not their outcome: a failed verification names them too)."""

    files: list[str]
    nbytes: int | None
    problems: list[str]
    checked: str


# Verification.checked of a checkpoint whose manifest lists every file with its checksum.
CHECKSUMS_AGAINST_MANIFEST = "the checksum of every file against the manifest"


class TensorSource:
    """Reads the tensors of an opened layout; ``tensors`` lists those it can read and
    ``metadata`` is what the layout keeps besides (JSON values), ``skipped`` the items
    it cannot give as tensors (pickled objects, say); ``where`` (the layout's path) starts
    its errors."""

    def __init__(self, tensors: Mapping[str, TensorEntry], metadata: Mapping[str, Any] | None = None,
                 skipped: int = 0, where: str = "") -> None:
        self.tensors = dict(tensors)
        self.metadata = dict(metadata or {})
        self.skipped = skipped
        self._where = where or "this layout"

    def read(self, names: Iterable[str] | None = None, out: Mapping[str, Any] | None = None, *,
             mmap: bool = False) -> dict[str, np.ndarray]:
        """Tensors ``names`` (default: all, or those of ``out``), into the host buffers of
        ``out`` where given (of the tensor's dtype and shape); with ``mmap``, as copy-on-write
        mappings of the files where the layout keeps tensors whole
        (:meth:`ShardReader.map_many`)."""
        wanted, out = names_to_read(self._where, self.tensors, names, out or {})
        if mmap:
            refuse_out_when_mapped(out)
            return self._map(wanted)
        return self._read(wanted, out)

    def _read(self, names: list[str], out: dict[str, Any]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _map(self, names: list[str]) -> dict[str, np.ndarray]:
        raise ValueError(f"{type(self).__name__} cannot map its tensors (mmap=True maps tensors kept whole "
                         "in safetensors files, not chunks or pickles): load without mmap")

    def read_range(self, name: str, start: int, nbytes: int) -> np.ndarray:
        """Bytes ``[start, start + nbytes)`` of tensor ``name`` (row-major), as uint8.
        Sources that keep tensors whole read just those bytes; others read the tensor."""
        self._check_range(name, start, nbytes)
        return byte_view(self.read([name])[name], writable=False)[start:start + nbytes].copy()

    def _check_range(self, name: str, start: int, nbytes: int) -> TensorEntry:
        entry = self.tensors[name]
        if start < 0 or nbytes < 0 or start + nbytes > entry.nbytes:
            raise ValueError(f"bytes [{start}, {start + nbytes}) lie outside {name!r} of {entry.nbytes} bytes")
        return entry

    def close(self) -> None:
        pass

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Readers:
    """Shard readers opened on first use, one per file, closed together."""

    def __init__(self, open_reader: Callable[[str], ShardReader]) -> None:
        self._open = open_reader
        self._readers: dict[str, ShardReader] = {}

    def __getitem__(self, file: str) -> ShardReader:
        if file not in self._readers:
            self._readers[file] = self._open(file)
        return self._readers[file]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


class ShardSource(TensorSource):
    """Tensors kept whole in safetensors files: each file's share read in parallel with
    the others (:meth:`ShardReader.read_many`), at most ``MAX_CONCURRENT_SHARDS`` at once."""

    def __init__(self, tensors: Mapping[str, TensorEntry], open_reader: Callable[[str], ShardReader],
                 metadata: Mapping[str, Any] | None = None, skipped: int = 0, where: str = "") -> None:
        super().__init__(tensors, metadata, skipped, where)
        self._readers = _Readers(open_reader)

    def _key(self, name: str) -> str:
        entry = self.tensors[name]
        return entry.chunks[0].key if entry.chunks else name

    def _map(self, names: list[str]) -> dict[str, np.ndarray]:
        return self._read(names, {}, mapped=True)

    def _read(self, names: list[str], out: dict[str, Any], mapped: bool = False) -> dict[str, np.ndarray]:
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.tensors[name].file, []).append(name)
        readers = {file: self._readers[file] for file in by_file}  # opened here, not in the threads

        def read(file: str) -> dict[str, np.ndarray]:
            keys = {self._key(n): n for n in by_file[file]}
            if mapped:
                got = readers[file].map_many(list(keys))
            else:
                got = readers[file].read_many(list(keys), {self._key(n): out[n] for n in by_file[file] if n in out})
            return {keys[k]: a for k, a in got.items()}

        result: dict[str, np.ndarray] = {}
        workers = min(MAX_CONCURRENT_SHARDS, max(1, len(by_file)))
        with ThreadPool(max_workers=workers) as pool:
            with cancelled_on_interrupt(pool, readers.values()):
                for part in pool.map(read, by_file):
                    result.update(part)
        return {n: result[n] for n in names}

    def read_range(self, name: str, start: int, nbytes: int) -> np.ndarray:
        reader = self._readers[self._check_range(name, start, nbytes).file]
        out = reader.buffer_for(self._key(name), start, nbytes)
        reader.pread(self._key(name), out, start).result()
        return out

    def close(self) -> None:
        self._readers.close()


class ChunkSource(TensorSource):
    """Tensors stored in pieces (a sharded save's chunks, possibly in several files): each
    assembled from its chunks' boxes, every read of a call in flight at once."""

    def __init__(self, tensors: Mapping[str, TensorEntry], open_reader: Callable[[str], ShardReader],
                 metadata: Mapping[str, Any] | None = None, skipped: int = 0, where: str = "") -> None:
        super().__init__(tensors, metadata, skipped, where)
        self._readers = _Readers(open_reader)

    def _read(self, names: list[str], out: dict[str, Any]) -> dict[str, np.ndarray]:
        results, reads = {}, []
        for name in names:
            entry = self.tensors[name]
            dtype = to_numpy_dtype(entry.dtype)
            if name in out:
                array = byte_view(out[name], writable=True).view(dtype).reshape(entry.shape)
            else:
                array = np.empty(entry.shape, dtype)
            covered = 0
            for chunk in entry.chunks:
                # The Ellipsis keeps a 0-d tensor's box a view: array[()] is a copy, a numpy scalar.
                box = (*(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes)), ...)
                reads.append(self._readers[chunk.file].read_box(chunk.key, [0] * len(chunk.sizes), chunk.sizes,
                                                                out=array[box]))
                covered += math.prod(chunk.sizes)
            if covered != math.prod(entry.shape):
                raise CorruptCheckpointError(f"{self._where}: the stored chunks of {name!r} cover {covered} of its "
                                             f"{math.prod(entry.shape)} elements")
            results[name] = out.get(name, array)
        for read in reads:
            read.result()
        return results

    def close(self) -> None:
        self._readers.close()


class Layout:
    """A way of keeping tensors on disk. Subclasses set ``kind`` (a short name, as
    ``inspect --json`` reports it) and ``title``, and implement the four methods."""

    kind: ClassVar[str]
    title: ClassVar[str]

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def recognise(cls, path: str) -> bool:
        """Whether ``path`` (an existing file or directory) is of this layout."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What :func:`describe` returns for this layout."""
        raise NotImplementedError

    def verify(self, progress: Callable[[int], None] | None = None) -> Verification:
        """Checks what the layout allows (checksums where it keeps them; else that every
        file is there and long enough); ``progress`` gets counts of bytes checked."""
        raise NotImplementedError

    def open(self, *, verify: bool = True, engine: Any = None) -> TensorSource:
        """A source of the layout's tensors (checksums checked where kept, unless ``verify`` is false)."""
        raise NotImplementedError

    def description(self, tensors: Sequence[TensorEntry], files: list[dict[str, Any]], problems: list[str],
                    metadata: Mapping[str, Any] | None = None, **more: Any) -> dict[str, Any]:
        """The common shape of :meth:`describe`'s result."""
        return {"path": self.path, "format": self.kind, "complete": not problems, "problems": problems,
                "metadata": dict(metadata or {}), **more, "files": files,
                "tensors": [t.to_json() for t in tensors], "total_bytes": sum(t.nbytes or 0 for t in tensors)}


def file_row(directory: str, name: str, expected: int | None = None) -> dict[str, Any]:
    """A file of a layout as :meth:`Layout.describe` lists it (size None: missing)."""
    path = os.path.join(directory, name)
    return {"name": name, "size": os.path.getsize(path) if os.path.isfile(path) else None, "expected_size": expected}


def size_problems(files: Iterable[Mapping[str, Any]], by: str = "the index", at_least: bool = False) -> list[str]:
    """A problem for each file missing, or of another size than ``by`` expects (shorter,
    with ``at_least``)."""
    problems = []
    for f in files:
        size, expected = f["size"], f["expected_size"]
        if size is None:
            problems.append(f"{f['name']}: missing")
        elif expected is not None and (size < expected if at_least else size != expected):
            what = "needs at least" if at_least else "says"
            problems.append(f"{f['name']}: {size} bytes, {by} {what} {expected}")
    return problems


def file_problem(name: str, path: str, error: BaseException) -> str:
    """A problem of file ``name`` (at ``path``), as :class:`Verification` lists them: its
    name first, and once, where the error's message starts with the path already."""
    message = str(error)
    for prefix in {path, os.path.normpath(path)}:
        message = message.removeprefix(f"{prefix}: ")
    return f"{name}: {message}"


def verify_files(directory: str, files: Iterable[str], progress: Callable[[int], None] | None,
                 open_reader: Callable[[str], ShardReader]) -> Verification:
    """Reads every tensor of safetensors files, checking the checksums they carry (those
    tensorferry wrote); files without checksums are checked for a consistent header."""
    from ..checkpoint import verify_shard

    names, total, problems, unchecked = list(files), 0, [], 0
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):  # the engine's open names it too: said once, as the layouts say it
            problems.append(f"{name}: missing")
            continue
        try:
            with open_reader(name) as reader:
                total += reader.size
                if all(t.checksum for t in reader.tensors.values()) and reader.tensors:
                    verify_shard(reader, progress)
                else:
                    unchecked += 1
        except (CorruptCheckpointError, OSError) as exc:
            problems.append(file_problem(name, path, exc))
    checked = "the checksums the files carry" if not unchecked else \
        "the checksums the files carry, and the headers of those without" if unchecked < len(names) else \
        "that headers and sizes are consistent (the files carry no checksums)"
    return Verification(names, total, problems, checked)


from .dcp import DCPFolder  # noqa: E402  (the layouts build on the classes above)
from .huggingface import HuggingFaceFolder, HuggingFaceShards  # noqa: E402
from .orbax import OrbaxStep  # noqa: E402
from .safetensors import SafetensorsFile, SafetensorsFiles  # noqa: E402
from .tensorferry import TensorferryCheckpoint  # noqa: E402

# Tried in order: the first that recognises a path is its layout (DCP before tensorferry,
# since a DCPWriter checkpoint has a manifest too; loose safetensors files last).
LAYOUTS: list[type[Layout]] = [DCPFolder, TensorferryCheckpoint, HuggingFaceFolder, HuggingFaceShards, OrbaxStep,
                               SafetensorsFile, SafetensorsFiles]


def register(layout: type[Layout], *, before: type[Layout] | None = None) -> None:
    """Adds a layout to the registry (tried before ``before``, else last)."""
    LAYOUTS.insert(LAYOUTS.index(before) if before is not None else len(LAYOUTS), layout)


def detect(path: str | os.PathLike) -> Layout:
    """The layout of ``path``; raises :class:`CheckpointNotFoundError` if nothing is
    there, :class:`UnknownLayoutError` if no layout recognises it."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such file or directory", path)
    for layout in LAYOUTS:
        if layout.recognise(path):
            return layout(path)
    hint = foreign_files_hint(path) if os.path.isdir(path) else ""
    raise UnknownLayoutError(f"{path}: not a checkpoint (no tensorferry manifest, no Hugging Face index, no DCP "
                             f".metadata, no Orbax metadata, no safetensors files){hint}")


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint holds and whether it is complete, in one shape for every layout:
    path, format, complete, problems, metadata, files (name, size, expected_size),
    tensors (name, dtype, shape, nbytes, ...) and total_bytes. A checkpoint too damaged
    to list (an unreadable manifest, say) is described as incomplete, with the reason."""
    layout = detect(path)
    try:
        return layout.describe()
    except CorruptCheckpointError as exc:
        return {"path": layout.path, "format": layout.kind, "complete": False, "problems": [str(exc)],
                "metadata": {}, "files": [], "tensors": [], "total_bytes": None}


def foreign_layout(path: str | os.PathLike) -> Layout | None:
    """The layout of a checkpoint tensorferry reads but did not write as a checkpoint
    directory (a Hugging Face folder, torch's DCP, Orbax), or None."""
    path = os.fspath(path)
    for layout in LAYOUTS:
        if layout not in (TensorferryCheckpoint, SafetensorsFiles) and layout.recognise(path):
            return layout(path)
    return None


def open_layout(path: str | os.PathLike, *, verify: bool = True, engine: Any = None) -> TensorSource:
    """A :class:`TensorSource` over whatever checkpoint ``path`` holds."""
    return detect(path).open(verify=verify, engine=engine)


__all__ = ["Chunk", "ChunkSource", "DCPFolder", "HuggingFaceFolder", "HuggingFaceShards", "LAYOUTS", "Layout", "OBJECT",
           "OrbaxStep", "SafetensorsFile", "SafetensorsFiles", "ShardSource", "TensorEntry", "TensorSource",
           "TensorferryCheckpoint", "UnknownLayoutError", "Verification", "describe", "detect", "foreign_layout",
           "open_layout", "register", "tensor_entry"]
