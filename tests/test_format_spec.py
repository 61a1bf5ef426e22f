"""docs/format.md is enough to read a checkpoint: a reader written from it alone (json,
struct and xxhash, nothing of tensorferry) reads and verifies what tensorferry writes.
When this fails, the format changed: update docs/format.md with it."""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict

import numpy as np
import pytest
import xxhash

import tensorferry

ELEMENT_SIZES = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                 "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                 "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}


def checksum(data: bytes) -> str:
    return format(xxhash.xxh3_64_intdigest(data, seed=0), "016x")


def check_header_checksum(header: bytes) -> None:
    """The header checksum, as docs/format.md defines it: the whole header with the
    key's own 16 digits zeroed."""
    mark = b'"tensorferry.header_checksum":"'
    at = header.index(mark) + len(mark)
    zeroed = header[:at] + b"0" * 16 + header[at + 16:]
    assert checksum(zeroed) == header[at:at + 16].decode()


def read_as_specified(directory: str) -> tuple[dict, dict[str, bytes]]:
    """The manifest and every tensor's bytes, following docs/format.md step by step."""
    with open(os.path.join(directory, "tensorferry.json"), "rb") as f:
        raw_manifest = f.read()
    manifest = json.loads(raw_manifest)
    assert manifest["format"] == "tensorferry" and manifest["format_version"] == 2
    assert raw_manifest.endswith(b'"}') and list(manifest)[-1] == "manifest_checksum"
    covered = raw_manifest[:raw_manifest.rindex(b',"manifest_checksum":"')]
    assert checksum(covered) == manifest["manifest_checksum"], "the manifest checksum covers what precedes it"
    assert manifest["checksum_algorithm"] == "xxh3_64"
    tensors = {}
    for name, entry in manifest["files"].items():
        with open(os.path.join(directory, name), "rb") as f:
            raw = f.read()
        assert len(raw) == entry["size"]
        (n,) = struct.unpack("<Q", raw[:8])
        assert (8 + n) % 4096 == 0, "the data section starts on a 4096-byte boundary"
        assert checksum(raw[:8 + n]) == entry["checksum"], "the file checksum covers length, JSON and padding"
        check_header_checksum(raw[:8 + n])
        header = json.loads(raw[8:8 + n].decode("utf-8"))
        raw[8:8 + n].decode("ascii")  # the writer escapes non-ASCII characters
        metadata = header.pop("__metadata__")
        digests = json.loads(metadata["tensorferry.checksums"])
        assert list(digests) == list(header), "checksums listed in file order, exactly the file's tensors"
        position, sizes = 0, []
        for tensor, info in header.items():  # in file order, packed without holes
            begin, end = info["data_offsets"]
            size = ELEMENT_SIZES[info["dtype"]]
            assert begin == position and end - begin == int(np.prod(info["shape"])) * size
            assert (8 + n + begin) % size == 0, "each tensor starts aligned to its element size"
            sizes.append(size)
            data = raw[8 + n + begin:8 + n + end]
            assert checksum(data) == digests[tensor]
            listed = manifest["tensors"][tensor]
            assert listed["file"] == name and listed["checksum"] == digests[tensor]
            assert (listed["dtype"], listed["shape"], listed["data_offsets"]) == \
                (info["dtype"], info["shape"], info["data_offsets"])
            tensors[tensor] = data
            position = end
        assert 8 + n + position == len(raw), "the file ends where the last tensor ends"
        assert sizes == sorted(sizes, reverse=True), "largest element size first"
    assert set(tensors) == set(manifest["tensors"])
    return manifest, tensors


def test_a_reader_written_from_the_spec_reads_a_checkpoint(tmp_path) -> None:
    rng = np.random.default_rng(0)
    state = {"weight": rng.standard_normal((33, 7)).astype(np.float32), "ids": np.arange(5, dtype=np.int64),
             "mask": np.array([True, False, True]), "half": np.ones(3, np.float16), "empty": np.zeros(0, np.int8),
             "scalar": np.array(3.5), "caf\u00e9": np.arange(4, dtype=np.uint8)}
    path = tensorferry.save_checkpoint(tmp_path / "step_1", state, metadata={"lr": 0.1}, max_shard_bytes=256)
    manifest, tensors = read_as_specified(path)
    assert len(manifest["files"]) > 1 and manifest["metadata"] == {"lr": 0.1}
    for name, array in state.items():
        assert tensors[name] == np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes(), name
    assert checksum(b"") == "2d06800538d394c2", "the empty tensor's checksum as format.md gives it"


def test_the_structure_of_a_saved_state_dict_reads_as_specified(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from tensorferry.adapters.pytorch import save

    shared = torch.ones(2, 2)
    versions = OrderedDict([("", {"version": 1})])
    ordered = OrderedDict([("z", 1)])
    ordered._metadata = versions  # as nn.Module.state_dict() returns it
    save({"model": {"a": shared, "b": shared}, "step": 7, "lr": float("inf"), "dtype": torch.bfloat16,
          "betas": (0.9, 0.99), 3: None, "sd": ordered, "size": torch.Size([2, 3])}, tmp_path / "state.safetensors")
    raw = (tmp_path / "state.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    check_header_checksum(raw[:8 + n])  # a single file vouches for its own header
    header = json.loads(raw[8:8 + n])
    structure = json.loads(header["__metadata__"]["tensorferry.structure"])
    assert [name for name in header if name != "__metadata__"] == ["model.a"], "a tied tensor is stored once"
    assert structure == {"dict": [
        ["model", {"dict": [["a", {"tensor": "model.a"}], ["b", {"tensor": "model.a"}]]}],
        ["step", {"value": 7}], ["lr", {"float": "inf"}], ["dtype", {"dtype": "bfloat16"}],
        ["betas", {"tuple": [{"value": 0.9}, {"value": 0.99}]}], [3, {"value": None}],
        ["sd", {"ordered_dict": {"items": [["z", {"value": 1}]], "_metadata": {"ordered_dict": {"items": [
            ["", {"dict": [["version", {"value": 1}]]}]]}}}}], ["size", {"size": [2, 3]}]]}
