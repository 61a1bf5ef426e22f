"""A Hugging Face model folder: safetensors shards and ``model.safetensors.index.json``
(as ``save_pretrained`` and torch's ``HuggingFaceStorageWriter`` write them), or a
single ``model.safetensors`` (or a diffusers or PEFT folder's one safetensors file)."""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from typing import Any, Callable, Iterable, Mapping

from ..checkpoint import MANIFEST, read_directory_file
from ..errors import CorruptCheckpointError
from ..schema import PART_FILE, member_path, parse_json
from ..shard import ShardInfo, ShardReader
from . import (Chunk, ChunkSource, Layout, ShardSource, TensorEntry, TensorSource, Verification, file_row,
               size_problems, tensor_entry, verify_files)
from .safetensors import entries_of, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
INDEX_SUFFIX = ".safetensors.index.json"


def encode_index(shards: Iterable[ShardInfo], metadata: Mapping[str, Any] | None = None) -> bytes:
    """A ``model.safetensors.index.json`` for these shard files: where each tensor is,
    and their total size, as transformers' ``from_pretrained`` reads it."""
    shards = list(shards)
    weight_map = {name: os.path.basename(s.path) for s in shards for name in s.tensors}
    total = sum(t.nbytes for s in shards for t in s.tensors.values())
    return json.dumps({"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map},
                      indent=2).encode()


# A folder's lone safetensors file is read as its model where no index names files, as
# libraries name it: transformers' model.safetensors, diffusers'
# diffusion_pytorch_model.safetensors, PEFT's adapter_model.safetensors. Not where it is
# a part of a layout (schema.PART_FILE): without what ties them together, those folders
# are unfinished or damaged saves, or hold parts of tensors.


def _single_file(directory: str) -> str | None:
    """The folder's one model file: its one safetensors file, or the one beside which the
    others are variants of it (``diffusion_pytorch_model.fp16.safetensors`` beside
    ``diffusion_pytorch_model.safetensors``), which diffusers and transformers load
    unless asked for a variant; None where there is none, or it is a part of one of our layouts."""
    stems = {n[:-len(".safetensors")] for n in os.listdir(directory) if n.endswith(".safetensors")}
    plain = [stem for stem in stems if "." not in stem or stem.rsplit(".", 1)[0] not in stems]
    if len(plain) != 1 or not all(s == plain[0] or s.rsplit(".", 1)[0] == plain[0] for s in stems):
        return None
    name = plain[0] + ".safetensors"
    return None if PART_FILE.fullmatch(name) else name


def _index_of(path: str) -> str | None:
    """The index file of a folder (or the index file given), None for a lone model.safetensors."""
    if os.path.isfile(path):
        return path
    indexes = sorted(n for n in os.listdir(path) if n.endswith(INDEX_SUFFIX))
    if INDEX in indexes:
        return os.path.join(path, INDEX)
    return os.path.join(path, indexes[0]) if indexes else None


class HuggingFaceFolder(Layout):
    kind = "huggingface"
    title = "Hugging Face model folder"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.directory = (os.path.dirname(path) or ".") if os.path.isfile(path) else path
        # The folder's one model file where no index names files (given an index, unused).
        self.single = (None if os.path.isfile(path) else _single_file(path)) or SINGLE

    @classmethod
    def recognise(cls, path: str) -> bool:
        if os.path.isfile(path):
            return path.endswith(INDEX_SUFFIX)
        if not os.path.isdir(path):
            return False
        return any(n.endswith(INDEX_SUFFIX) for n in os.listdir(path)) or _single_file(path) is not None

    def _index(self) -> tuple[dict[str, str], dict[str, Any]]:
        """The weight map (tensor name: file, each file checked to lie in the folder) and the index's metadata."""
        index_path = _index_of(self.path)
        if index_path is None:
            with read_header(os.path.join(self.directory, self.single)) as reader:
                return dict.fromkeys(reader.tensors, self.single), {}
        # In a tensorferry checkpoint the index must match the manifest: an edited one
        # could leave tensors out unnoticed.
        index = parse_json(read_directory_file(self.directory, os.path.basename(index_path)), "index", index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CorruptCheckpointError(f"{index_path} has no weight_map of tensor names to files")
        for file in set(weight_map.values()):
            member_path(self.directory, file)
        metadata = index.get("metadata")
        return weight_map, metadata if isinstance(metadata, dict) else {}

    def _files(self, weight_map: Mapping[str, str]) -> list[str]:
        return sorted(set(weight_map.values()))

    def _reader(self, file: str, engine: Any = None, verify: bool = False) -> ShardReader:
        return read_header(os.fspath(member_path(self.directory, file)), engine, verify)

    def _survey(self) -> tuple[list[TensorEntry], list[dict[str, Any]], list[str], dict[str, str]]:
        """Every tensor the index names, found in its file: entries, files, problems, and
        the files' own metadata (the same in every shard, as ``save_pretrained`` writes it).
        A copy of a tensor in another file than the index names (left by an earlier save,
        say) is not read, with a warning: the index says where each tensor is. (transformers
        5's ``from_pretrained`` reads every tensor of every file, so that the last file's copy wins.)"""
        weight_map, _ = self._index()
        files = [file_row(self.directory, f) for f in self._files(weight_map)]
        problems = size_problems(files)
        held: dict[str, dict[str, TensorEntry]] = {}  # file: its tensors by name
        file_metadata: dict[str, str] = {}
        ours: list[str] = []  # files of one of our layouts, as their names and checksums say
        for f in files:
            if f["size"] is None:
                continue
            try:
                with self._reader(f["name"]) as reader:
                    held[f["name"]] = {e.name: e for e in entries_of(reader, f["name"])}
                    file_metadata.update(reader.metadata)
                    if PART_FILE.fullmatch(f["name"]) and any(t.checksum for t in reader.tensors.values()):
                        ours.append(f["name"])
            except CorruptCheckpointError as exc:
                problems.append(f"{f['name']}: {exc}")
        if ours and not os.path.exists(os.path.join(self.directory, MANIFEST)):
            # save_checkpoint's folder (its index is for transformers) that lost its manifest: read as
            # a Hugging Face folder, its state came back flattened, what was not a tensor gone, unsaid.
            problems.insert(0, f"its {MANIFEST} is missing: {ours[0]} is a shard of a tensorferry checkpoint, whose "
                               f"manifest holds its structure and checks its files; restore {MANIFEST} from a copy")
        found = []
        for name, file in weight_map.items():
            entry = held.get(file, {}).get(name)
            if entry is not None:
                found.append(entry)
            elif not any(p.startswith(f"{file}:") for p in problems):
                problems.append(f"{file}: holds no tensor {name!r}, which the index places there")
        stale = [(name, file) for file, tensors in held.items() for name in tensors
                 if name in weight_map and weight_map[name] != file]
        if stale:
            shown = ", ".join(f"{name!r} in {file}" for name, file in stale[:3])
            warnings.warn(f"{self.path}: {len(stale)} tensor(s) also held by another file than the index places "
                          f"them in ({shown}{', ...' if len(stale) > 3 else ''}): those copies are not read, "
                          "each tensor is read from the file the index names", stacklevel=3)
        return found, files, problems, file_metadata

    def describe(self) -> dict[str, Any]:
        entries, files, problems, file_metadata = self._survey()
        _, metadata = self._index()
        return self.description(entries, files, problems, {**metadata, **file_metadata},
                                index=None if _index_of(self.path) is None else os.path.basename(_index_of(self.path)))

    def verify(self, progress: Callable[[int], None] | None = None) -> Verification:
        try:
            _, _, problems, _ = self._survey()
        except CorruptCheckpointError as exc:  # the index, or the single file's header
            name = os.path.basename(_index_of(self.path) or self.single)
            return Verification([name], None, [f"{name}: {exc}"], "")
        weight_map, _ = self._index()
        found = verify_files(self.directory, self._files(weight_map), progress,
                             lambda file: self._reader(file, verify=True))
        return Verification(found.files, found.nbytes, list(dict.fromkeys(problems + found.problems)), found.checked)

    def open(self, *, verify: bool = True, engine: Any = None) -> TensorSource:
        entries, _, problems, file_metadata = self._survey()
        if problems:
            raise CorruptCheckpointError(f"{self.path}: " + "; ".join(problems))
        return ShardSource({e.name: e for e in entries}, lambda file: self._reader(file, engine, verify),
                           file_metadata, where=self.path)


# torch's HuggingFaceStorageWriter(save_distributed=True) before consolidation: each rank's
# files hold its chunks, their offsets in the header's metadata, and there is no index.
SHARDED_FILE = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")
SHARDING_KEY = "DCP_SHARDING_INFO"


class HuggingFaceShards(Layout):
    kind = "huggingface-shards"
    title = "folder of torch's distributed Hugging Face writer (not consolidated)"

    @classmethod
    def recognise(cls, path: str) -> bool:
        return os.path.isdir(path) and any(SHARDED_FILE.fullmatch(n) for n in os.listdir(path))

    def _files(self) -> list[str]:
        return sorted(n for n in os.listdir(self.path) if SHARDED_FILE.fullmatch(n))

    def _survey(self) -> tuple[list[TensorEntry], list[dict[str, Any]], list[str], dict[str, str]]:
        """Every tensor, assembled from the chunks the files hold; the files, the problems,
        and the files' own metadata."""
        chunks: dict[str, list[Chunk]] = {}
        dtypes: dict[str, str] = {}
        files = [file_row(self.path, n) for n in self._files()]
        problems: list[str] = []
        metadata: dict[str, str] = {}
        for f in files:
            try:
                with read_header(os.path.join(self.path, f["name"])) as reader:
                    sharding = parse_json(reader.metadata.get(SHARDING_KEY, "{}"), SHARDING_KEY, reader.path)
                    metadata.update((k, v) for k, v in reader.metadata.items() if k != SHARDING_KEY)
                    for name, t in reader.tensors.items():
                        offsets = _offsets(sharding, name, len(t.shape), reader.path)
                        chunks.setdefault(name, []).append(Chunk(f["name"], name, offsets, t.shape))
                        dtypes[name] = t.dtype
            except CorruptCheckpointError as exc:
                problems.append(f"{f['name']}: {exc}")
        entries = []
        for name, pieces in chunks.items():
            shape = tuple(max(c.offsets[d] + c.sizes[d] for c in pieces) for d in range(len(pieces[0].sizes)))
            entry = tensor_entry(name, dtypes[name], shape, chunks=tuple(pieces),
                                 more={"shards": len(pieces), "files": sorted({c.file for c in pieces})})
            if sum(math.prod(c.sizes) for c in pieces) != math.prod(shape):
                problems.append(f"{name}: its chunks do not cover the tensor once")
            entries.append(entry)
        return entries, files, problems, metadata

    def describe(self) -> dict[str, Any]:
        entries, files, problems, metadata = self._survey()
        return self.description(entries, files, problems, metadata)

    def verify(self, progress: Callable[[int], None] | None = None) -> Verification:
        _, _, problems, _ = self._survey()
        found = verify_files(self.path, self._files(), progress,
                             lambda file: read_header(os.path.join(self.path, file), verify=True))
        return Verification(found.files, found.nbytes, list(dict.fromkeys(problems + found.problems)), found.checked)

    def open(self, *, verify: bool = True, engine: Any = None) -> TensorSource:
        entries, _, problems, metadata = self._survey()
        if problems:
            raise CorruptCheckpointError(f"{self.path}: " + "; ".join(problems))
        return ChunkSource({e.name: e for e in entries},
                           lambda file: read_header(os.path.join(self.path, file), engine, verify), metadata,
                           where=self.path)


def _offsets(sharding: Any, name: str, ndim: int, where: str) -> tuple[int, ...]:
    """Where a file's tensor ``name`` lies in the whole tensor, as its DCP_SHARDING_INFO says
    (at the origin if it says nothing)."""
    entry = sharding.get(name) if isinstance(sharding, dict) else None
    offsets = entry.get("saved_offsets") if isinstance(entry, dict) else [0] * ndim
    if not (isinstance(offsets, list) and len(offsets) == ndim
            and all(type(o) is int and o >= 0 for o in offsets)):
        raise CorruptCheckpointError(f"{where}: {SHARDING_KEY} gives {name!r} the offsets {offsets!r}")
    return tuple(offsets)
