"""An Orbax checkpoint step (or one item of it). Items written by tensorferry's
``FerryCheckpointHandler`` (``process-N.safetensors`` plus the index
``process-N.json``) are listed, verified and read here without JAX; other items
are listed through orbax-checkpoint, when it is installed, and not read."""

from __future__ import annotations

import glob
import math
import os
from typing import Any, Callable

import numpy as np

from ..checkpoint import open_shard, read_manifest_file, verify_shard
from ..errors import CorruptCheckpointError, TensorferryError
from . import (OBJECT, Chunk, ChunkSource, Layout, TensorEntry, TensorSource, Verification, file_row, size_problems,
               tensor_entry)

MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "orbax.checkpoint", "manifest.ocdbt", "_sharding")
INDEX_FORMAT = "tensorferry.jax"  # what FerryCheckpointHandler's indexes say they are
INDEX_PATTERN = "process-*.json"


def _is_ferry_item(directory: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(directory), INDEX_PATTERN)))


class OrbaxStep(Layout):
    kind = "orbax"
    title = "Orbax checkpoint"

    @classmethod
    def recognise(cls, path: str) -> bool:
        if not os.path.isdir(path):
            return False
        subdirs = [os.path.join(path, n) for n in os.listdir(path) if os.path.isdir(os.path.join(path, n))]
        return any(os.path.exists(os.path.join(d, m)) for d in [path, *subdirs] for m in MARKERS) or \
            any(_is_ferry_item(d) for d in [path, *subdirs])

    def _items(self) -> list[str]:
        """The item directories: the path itself if it is one, else its subdirectories that are."""
        if _is_ferry_item(self.path) or os.path.exists(os.path.join(self.path, "_METADATA")):
            return [self.path]
        return [d for d in sorted(os.path.join(self.path, n) for n in os.listdir(self.path))
                if os.path.isdir(d) and (_is_ferry_item(d) or os.path.exists(os.path.join(d, "_METADATA")))]

    def _prefix(self, item: str) -> str:
        return "" if item == self.path else os.path.basename(item) + "/"

    def _indexes(self, item: str) -> dict[str, dict[str, Any]]:
        """Each shard file of a tensorferry item with the process index that lists it."""
        indexes = {}
        for path in sorted(glob.glob(os.path.join(glob.escape(item), INDEX_PATTERN))):
            index = read_manifest_file(path)
            if index["metadata"].get("format") != INDEX_FORMAT:
                raise CorruptCheckpointError(f"{path} is not a tensorferry JAX index")
            for file in index["files"]:
                indexes[file] = index
        return indexes

    def _ferry_entries(self, item: str, indexes: dict[str, dict[str, Any]]) -> list[TensorEntry]:
        leaves: dict[str, dict[str, Any]] = {}
        chunks: dict[str, list[Chunk]] = {}
        prefix = self._prefix(item)  # the chunks' files are named relative to the step
        for index in {id(i): i for i in indexes.values()}.values():
            for name, rec in index["metadata"]["leaves"].items():
                leaves.setdefault(name, rec)
                chunks.setdefault(name, []).extend(Chunk(prefix + rec["file"], key, tuple(offsets), tuple(sizes))
                                                   for key, offsets, sizes in rec.get("chunks", []))
        return [tensor_entry(prefix + name, rec["dtype"], rec["shape"], chunks=tuple(chunks[name]))
                if rec["kind"] == "array"
                else TensorEntry(prefix + name, OBJECT, None, None, more={"value": rec["value"]})
                for name, rec in leaves.items()]

    def _orbax_entries(self, item: str) -> list[TensorEntry]:
        try:
            import jax
            import orbax.checkpoint as ocp
        except ImportError:
            raise TensorferryError(f"{self.path} looks like an Orbax checkpoint: unsupported: install "
                                   "orbax-checkpoint (pip install 'tensorferry[jax]') to inspect it") from None
        metadata = ocp.PyTreeCheckpointer().metadata(item)
        # Newer Orbax wraps the tree in a StepMetadata; older returns the tree itself.
        tree = metadata.item_metadata if hasattr(metadata, "item_metadata") else metadata
        entries = []
        for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            shape = tuple(getattr(leaf, "shape", None) or ())
            dtype = getattr(leaf, "dtype", None)
            entries.append(TensorEntry(self._prefix(item) + jax.tree_util.keystr(keys), str(dtype), shape,
                                       None if dtype is None else math.prod(shape) * np.dtype(dtype).itemsize))
        return entries

    def _survey(self) -> tuple[list[TensorEntry], list[str], dict[str, tuple[str, dict[str, Any]]], set[str]]:
        """Every leaf, the problems, each tensorferry shard file (relative to the step)
        with its item directory and index, and the names of the leaves tensorferry reads."""
        entries, problems, shards, readable = [], [], {}, set()
        for item in self._items():
            if not _is_ferry_item(item):
                entries += self._orbax_entries(item)
                continue
            indexes = self._indexes(item)
            ferried = self._ferry_entries(item, indexes)
            entries += ferried
            readable.update(e.name for e in ferried if e.is_tensor)
            for file, index in indexes.items():
                shards[self._prefix(item) + file] = (item, index)
                row = file_row(self.path, self._prefix(item) + file, index["files"][file]["size"])
                problems += size_problems([row], by="its index")
        if "orbax-checkpoint-tmp" in os.path.basename(os.path.normpath(self.path)):
            problems.append("a temporary directory: this save did not finish")
        return entries, problems, shards, readable

    def describe(self) -> dict[str, Any]:
        entries, problems, _, _ = self._survey()
        files = [file_row(self.path, os.path.relpath(os.path.join(root, n), self.path))
                 for root, _, names in sorted(os.walk(self.path)) for n in sorted(names)]
        return self.description(entries, files, problems)

    def _open_shard(self, shards: dict[str, tuple[str, dict[str, Any]]], file: str, **kw: Any) -> Any:
        item, index = shards[file]
        return open_shard(item, index, os.path.basename(file), **kw)

    def verify(self, progress: Callable[[int], None] | None = None) -> Verification:
        _, problems, shards, _ = self._survey()
        total = 0
        for file in shards:
            try:
                with self._open_shard(shards, file) as reader:
                    total += reader.size
                    verify_shard(reader, progress)
            except (CorruptCheckpointError, OSError) as exc:
                problems.append(f"{file}: {exc}")
        others = [i for i in self._items() if not _is_ferry_item(i)]
        checked = "every checksum of the tensorferry items matches" + (
            f"; {len(others)} other item(s) not checked" if others else "")
        return Verification(list(shards), total, list(dict.fromkeys(problems)), checked)

    def open(self, *, verify: bool = True, engine: Any = None) -> TensorSource:
        entries, problems, shards, readable = self._survey()
        if problems:
            raise CorruptCheckpointError(f"{self.path}: " + "; ".join(problems))
        tensors = {e.name: e for e in entries if e.name in readable}
        return ChunkSource(tensors, lambda file: self._open_shard(shards, file, engine=engine, verify=verify),
                           skipped=len(entries) - len(tensors), where=self.path)
