"""A tensorferry checkpoint: safetensors shard files and the manifest ``tensorferry.json``."""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable

from ..checkpoint import MANIFEST, open_shard, read_manifest, refuse_dcp_folder_without_metadata, verify_checkpoint
from ..errors import CorruptCheckpointError
from . import (CHECKSUMS_AGAINST_MANIFEST, Layout, ShardSource, TensorEntry, TensorSource, Verification, file_row,
               size_problems)

_PLACEMENT = ("dtype", "shape", "data_offsets")


class TensorferryCheckpoint(Layout):
    kind = "tensorferry"
    title = "tensorferry checkpoint"

    @classmethod
    def recognise(cls, path: str) -> bool:
        return os.path.isfile(os.path.join(path, MANIFEST))

    def _entries(self, manifest: dict[str, Any]) -> list[TensorEntry]:
        entries = []
        for name, entry in manifest["tensors"].items():
            begin, end = entry["data_offsets"]
            more = {k: v for k, v in entry.items() if k not in _PLACEMENT and k != "file"}
            entries.append(TensorEntry(name, entry["dtype"], tuple(entry["shape"]), end - begin, entry["file"], more))
        return entries

    def describe(self) -> dict[str, Any]:
        manifest = read_manifest(self.path)
        files = [{**file_row(self.path, name, entry["size"]), "checksum": entry["checksum"]}
                 for name, entry in manifest["files"].items()]
        # A DCPWriter folder's .metadata, say, which a copy without hidden files leaves behind
        others = [file_row(self.path, name, entry["size"]) for name, entry in manifest.get("other_files", {}).items()]
        problems = size_problems(files + others, by="the manifest")
        committed = manifest.get("committed_at")
        return self.description(
            self._entries(manifest), files, problems, manifest.get("metadata", {}),
            format_version=manifest.get("format_version"),
            committed_at=None if committed is None else datetime.datetime.fromtimestamp(
                committed, datetime.timezone.utc).isoformat(timespec="seconds"),
            checksum_algorithm=manifest.get("checksum_algorithm"),
            other_files=sorted(set(os.listdir(self.path)) - set(manifest["files"]) - {MANIFEST}))

    def verify(self, progress: Callable[[int], None] | None = None) -> Verification:
        return verify_against_manifest(self.path, progress)

    def open(self, *, verify: bool = True, engine: Any = None) -> TensorSource:
        manifest = read_manifest(self.path)
        refuse_dcp_folder_without_metadata(self.path, manifest)  # even where no shard is opened (meta tensors)
        return ShardSource({e.name: e for e in self._entries(manifest)},
                           lambda file: open_shard(self.path, manifest, file, engine=engine, verify=verify),
                           manifest.get("metadata", {}), where=self.path)


def verify_against_manifest(path: str, progress: Callable[[int], None] | None = None) -> Verification:
    """:func:`verify_checkpoint` of a folder with a manifest (ours, or a DCPWriter's), as a
    :class:`Verification` that counts every file the manifest lists, a damaged manifest
    the one bad file."""
    try:
        manifest = read_manifest(path)
    except CorruptCheckpointError as exc:
        return Verification([MANIFEST], None, [f"{MANIFEST}: {exc}"], "")
    listed = {**manifest["files"], **manifest.get("other_files", {})}
    total = sum(entry["size"] for entry in listed.values())
    return Verification(list(listed), total, verify_checkpoint(path, progress=progress), CHECKSUMS_AGAINST_MANIFEST)
