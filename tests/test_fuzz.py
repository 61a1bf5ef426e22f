"""A seeded mutation fuzzer over everything tensorferry reads back: shard files, single
files, manifests and saved structures. Every outcome is the original data or a
TensorferryError subclass; never another exception, wrong data, or a file read from
outside the checkpoint. Damage to a file tensorferry wrote is always detected."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct

import numpy as np
import pytest

import tensorferry
from tensorferry.checkpoint import MANIFEST, seal_manifest, unseal_manifest
from tensorferry.errors import TensorferryError

SEED = 25
STATE = {"weight": np.arange(24, dtype=np.float32).reshape(4, 6), "ids": np.arange(5, dtype=np.int64),
         "mask": np.array([True, False, True]), "half": np.linspace(0, 1, 7).astype(np.float16),
         "empty": np.zeros((0, 3), np.int8), "scalar": np.array(2.5)}


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """One random damage: a flipped bit, a byte set, a range deleted, bytes inserted,
    a truncation or a duplicated range."""
    data = bytearray(data)
    at = rng.randrange(len(data))
    kind = rng.randrange(6)
    if kind == 0:
        data[at] ^= 1 << rng.randrange(8)
    elif kind == 1:
        data[at] = rng.choice([0, 0x22, 0x2c, 0x30, 0x5b, 0x7b, 0x7d, 0xff, rng.randrange(256)])
    elif kind == 2:
        del data[at:at + rng.randrange(1, 16)]
    elif kind == 3:
        data[at:at] = b"".join(rng.choice([b"[", b"{", b"9", b'"', b"\x00", b"-"]) for _ in range(rng.randrange(1, 8)))
    elif kind == 4:
        del data[at:]
    else:
        data[at:at] = data[at:at + rng.randrange(1, 64)]
    return bytes(data)


def _same(loaded: dict, expected: dict) -> bool:
    return set(loaded) == set(expected) and all(
        loaded[n].dtype == expected[n].dtype and loaded[n].shape == expected[n].shape
        and np.array_equal(loaded[n], expected[n]) for n in expected)


def _outcome(action):
    try:
        return action()
    except TensorferryError as exc:
        return exc


def test_damaged_checkpoint_files_are_detected_or_harmless(tmp_path) -> None:
    rng = random.Random(SEED)
    good = tensorferry.save_checkpoint(tmp_path / "good", STATE, {"step": 1}, max_shard_bytes=64)
    files = sorted(os.listdir(good))
    work = str(tmp_path / "work")
    detected = 0
    for _ in range(250):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(good, work)
        victim = os.path.join(work, rng.choice(files))
        with open(victim, "rb") as f:
            original = f.read()
        damaged = _mutate(rng, original)
        if damaged == original:
            continue
        with open(victim, "wb") as f:
            f.write(damaged)
        loaded = _outcome(lambda: tensorferry.load_checkpoint(work))
        problems = _outcome(lambda: tensorferry.verify_checkpoint(work))
        # Every byte of every file is covered by a checksum: damage never loads.
        assert isinstance(loaded, TensorferryError), (victim, "damage went unnoticed by load")
        assert isinstance(problems, TensorferryError) or problems, (victim, "verify passed what load refused")
        detected += 1
    assert detected > 200
    shutil.rmtree(work)


def test_hostile_manifests_are_refused_or_read_inside_the_checkpoint(tmp_path) -> None:
    """Well-formed, correctly sealed manifests with one field replaced by junk: a writer
    that means harm, not a damaged disk. Load and verify agree, and nothing outside
    the checkpoint is read."""
    rng = random.Random(SEED + 1)
    good = tensorferry.save_checkpoint(tmp_path / "good", STATE, {"step": 1}, max_shard_bytes=64)
    with tensorferry.ShardWriter(tmp_path / "outside.safetensors") as w:
        for name, array in STATE.items():
            w.add(name, array + 1 if array.dtype.kind in "fiu" else array)
    with open(os.path.join(good, MANIFEST), "rb") as f:
        manifest = json.loads(unseal_manifest(f.read()))
    junk = [None, True, -1, 2 ** 70, 1.5, "", "../outside.safetensors", "/etc/passwd", "F32", [], {}, [1] * 65,
            [[[[[]]]]], {"size": "10", "checksum": "0" * 16}, "x" * 300, [0, 2 ** 64], "0" * 16]
    work = str(tmp_path / "work")
    for _ in range(200):
        edited = json.loads(json.dumps(manifest))
        node, key = _random_member(rng, edited)
        if rng.random() < 0.2 and isinstance(node, dict):  # rename a member: a file, a tensor
            node[rng.choice(junk[5:8] + ["shard-00000.safetensors"])] = node.pop(key)
        else:
            node[key] = rng.choice(junk)
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(good, work)
        with open(os.path.join(work, MANIFEST), "wb") as f:
            f.write(seal_manifest(json.dumps(edited, separators=(",", ":")).encode()))
        loaded = _outcome(lambda: tensorferry.load_checkpoint(work))
        problems = _outcome(lambda: tensorferry.verify_checkpoint(work))
        if isinstance(loaded, TensorferryError):
            assert isinstance(problems, TensorferryError) or problems, ("verify passed what load refused", edited)
        else:
            expected = {n: STATE[n] for n in loaded}  # a manifest may list fewer tensors, never other data
            assert _same(loaded, expected), edited
    shutil.rmtree(work)


def _random_member(rng: random.Random, manifest: dict) -> tuple:
    """A random (container, key) of the manifest, its nested members included."""
    node, key = manifest, rng.choice(list(manifest))
    while isinstance(node[key], (dict, list)) and node[key] and rng.random() < 0.75:
        node = node[key]
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
    return node, key


torch = pytest.importorskip("torch")


def test_damaged_single_files_are_always_detected(tmp_path) -> None:
    from tensorferry.adapters.pytorch import load, save
    rng = random.Random(SEED + 2)
    obj = {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                     "b": torch.ones(2, dtype=torch.bfloat16)},
           "step": 7, "betas": (0.9, 0.999), "names": ["a", None], "np": np.arange(3)}
    path = str(tmp_path / "state.tf")
    save(obj, path)
    with open(path, "rb") as f:
        original = f.read()
    for _ in range(150):
        damaged = _mutate(rng, original)
        if damaged == original:
            continue
        with open(path, "wb") as f:
            f.write(damaged)
        outcome = _outcome(lambda: load(path))
        assert isinstance(outcome, TensorferryError), "a damaged single file loaded"


def test_hostile_saved_structures_load_or_raise_typed_errors(tmp_path) -> None:
    """Structures rewritten with their header checksum made anew (a hostile writer):
    whatever they hold, load returns something or raises a TensorferryError."""
    from tensorferry.adapters.pytorch import load, save
    from tensorferry.shard import HEADER_CHECKSUM_KEY, ShardReader, ShardWriter
    rng = random.Random(SEED + 3)
    obj = {"model": {"w": torch.arange(6.0), "b": torch.ones(2)}, "step": 7, "betas": (0.9, 0.999),
           "np": np.float32(3.0)}
    path = str(tmp_path / "state.tf")
    save(obj, path)
    with ShardReader(path) as reader:
        arrays = reader.read_many()
        structure = json.loads(reader.metadata["tensorferry.structure"])
    junk = [None, 1, "tensor", "model.w", {"tensor": "nope"}, {"dict": [[True, {"value": 1}]]}, {"float": "x"},
            {"npscalar": "model.w"}, {"dtype": "float99"}, {"dtype": 5}, {"list": {}}, {"value": [1]},
            {"a": 1, "b": 2}, {"tuple": [{"value": 1}] * 3}, json.loads("[" * 500 + "]" * 500),
            {"ordered_dict": {"items": [["k", {"value": 1}]], "_metadata": {"value": None}}},
            {"ordered_dict": {"items": {}}}, {"size": [2, 3]}, {"size": [1.5]}]
    deep = {"value": 0}
    for _ in range(300):
        deep = {"list": [deep]}
    junk.append(deep)
    for _ in range(200):
        edited = json.loads(json.dumps(structure))
        node, key = _random_member(rng, edited)
        node[key] = rng.choice(junk)
        with ShardWriter(path, metadata={"tensorferry.structure": json.dumps(edited)}) as w:
            for name, array in arrays.items():
                w.add(name, array)
        outcome = _outcome(lambda: load(path))
        assert not isinstance(outcome, BaseException) or isinstance(outcome, TensorferryError)
    with open(path, "rb") as f:  # the rewritten files were sealed, not merely left unverified
        (n,) = struct.unpack("<Q", f.read(8))
        assert HEADER_CHECKSUM_KEY.encode() in f.read(n)
