"""Loose safetensors: one file (from anywhere), or a directory of shard files that no
manifest or index ties together (a tensorferry save that never committed, say)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable

from ..checkpoint import MANIFEST
from ..errors import CorruptCheckpointError
from ..schema import STRUCTURE_KEY, parse_json
from ..shard import ShardReader
from . import (Layout, ShardSource, TensorEntry, TensorSource, UnknownLayoutError, Verification, file_problem,
               file_row, verify_files)

# A tensorferry checkpoint's user metadata (any JSON) rides in this key of a single
# safetensors file's string-to-string metadata, so that it survives a conversion.
METADATA_KEY = "tensorferry.metadata"


def read_header(path: str, engine: Any = None, verify: bool = False) -> ShardReader:
    """A reader of one safetensors file, its header checked."""
    return ShardReader(path, engine, verify=verify)


def entries_of(reader: ShardReader, file: str | None = None) -> list[TensorEntry]:
    """The tensors of a safetensors file, in file order."""
    ordered = sorted(reader.tensors.items(), key=lambda kv: kv[1].begin)
    return [TensorEntry(n, t.dtype, t.shape, t.nbytes, file) for n, t in ordered]


def file_metadata(metadata: dict[str, str], where: str) -> dict[str, Any]:
    """A file's string metadata as a checkpoint's metadata: its own keys where they are,
    plus what :data:`METADATA_KEY` carries (JSON) unpacked beside them, and the pytorch
    adapter's structure, which a file keeps as JSON text, as the object a manifest keeps.
    A structure that is no JSON stays text, for the reader to refuse as any damaged one."""
    metadata = dict(metadata)
    if isinstance(metadata.get(STRUCTURE_KEY), str):
        with contextlib.suppress(CorruptCheckpointError):
            metadata[STRUCTURE_KEY] = parse_json(metadata[STRUCTURE_KEY], STRUCTURE_KEY, where)
    carried = metadata.pop(METADATA_KEY, None)
    if carried is None:
        return metadata
    try:
        unpacked = json.loads(carried)
    except ValueError:
        raise CorruptCheckpointError(f"{where}: metadata {METADATA_KEY!r} is not valid JSON") from None
    if not isinstance(unpacked, dict):
        raise CorruptCheckpointError(f"{where}: metadata {METADATA_KEY!r} is not a JSON object")
    return {**metadata, **unpacked}


def to_file_metadata(metadata: dict[str, Any]) -> dict[str, str]:
    """The inverse of :func:`file_metadata`: string values stay keys of their own (a
    file's ``format``, say), and so does the pytorch adapter's structure, as JSON text
    (where ``adapters.pytorch.load`` looks for it); anything else travels as JSON under
    :data:`METADATA_KEY`."""
    plain = {k: v for k, v in metadata.items() if isinstance(v, str) and k != METADATA_KEY}
    if STRUCTURE_KEY in metadata and STRUCTURE_KEY not in plain:
        plain[STRUCTURE_KEY] = json.dumps(metadata[STRUCTURE_KEY], separators=(",", ":"))
    rest = {k: v for k, v in metadata.items() if k not in plain}
    return {**plain, METADATA_KEY: json.dumps(rest)} if rest else plain


class SafetensorsFile(Layout):
    kind = "safetensors"
    title = "safetensors file"

    @classmethod
    def recognise(cls, path: str) -> bool:
        return os.path.isfile(path)

    def _reader(self, engine: Any = None, verify: bool = False) -> ShardReader:
        try:
            return read_header(self.path, engine, verify)
        except CorruptCheckpointError as exc:
            if self.path.endswith(".safetensors"):  # meant to be one, so a damaged one
                raise
            raise UnknownLayoutError(f"{self.path}: not a checkpoint tensorferry can read (not a tensorferry, "
                                     f"Hugging Face or DCP directory, not a safetensors file: {exc})") from None

    def describe(self) -> dict[str, Any]:
        with self._reader() as reader:
            name = os.path.basename(self.path)
            checksummed = bool(reader.tensors) and all(t.checksum for t in reader.tensors.values())
            return self.description(entries_of(reader), [file_row(os.path.dirname(self.path) or ".", name)],
                                    [], reader.metadata, checksummed=checksummed)

    def verify(self, progress: Callable[[int], None] | None = None) -> Verification:
        name = os.path.basename(self.path)
        try:
            self._reader().close()
        except CorruptCheckpointError as exc:
            return Verification([name], None, [file_problem(name, self.path, exc)], "")
        return verify_files(os.path.dirname(self.path) or ".", [name], progress, lambda file: self._reader(verify=True))

    def open(self, *, verify: bool = True, engine: Any = None) -> TensorSource:
        with self._reader() as reader:
            entries = entries_of(reader)
            metadata = file_metadata(reader.metadata, self.path)
        return ShardSource({e.name: e for e in entries}, lambda file: self._reader(engine, verify), metadata,
                           where=self.path)


class SafetensorsFiles(Layout):
    kind = "safetensors-dir"
    title = "directory of safetensors files"

    @classmethod
    def recognise(cls, path: str) -> bool:
        return os.path.isdir(path) and any(n.endswith(".safetensors") for n in os.listdir(path))

    def _names(self) -> list[str]:
        return sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))

    def describe(self) -> dict[str, Any]:
        problems = [f"no {MANIFEST}: not a complete tensorferry checkpoint (an unfinished save, or files "
                    "from elsewhere)"]
        files, tensors = [], []
        for name in self._names():
            files.append(file_row(self.path, name))
            try:
                with read_header(os.path.join(self.path, name)) as reader:
                    tensors += entries_of(reader, name)
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
        return self.description(tensors, files, problems)

    def verify(self, progress: Callable[[int], None] | None = None) -> Verification:
        return Verification(self._names(), None, [f"no {MANIFEST}: not a complete tensorferry checkpoint"], "")

    def open(self, *, verify: bool = True, engine: Any = None) -> TensorSource:
        raise CorruptCheckpointError(f"{self.path} has no {MANIFEST}: not a complete tensorferry checkpoint")
