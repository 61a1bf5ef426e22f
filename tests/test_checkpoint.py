"""Shard files and checkpoint directories: format, integrity, crash safety, full disks."""

from __future__ import annotations

import errno
import gc
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import tensorferry
from tensorferry import CheckpointNotFoundError, CorruptCheckpointError, ShardReader, ShardWriter
from tensorferry.shard import HEADER_CHECKSUM_KEY, gc_paused
from tensorferry.temporaries import wait_for_discards
from tensorferry.temporaries import DCP_TOKEN, held_here

DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
          ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz, np.complex64,
          np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8, np.bool_]
if hasattr(ml_dtypes, "float8_e8m0fnu"):  # ml_dtypes 0.5 on; the dependency allows 0.3
    DTYPES.append(ml_dtypes.float8_e8m0fnu)
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (5, 3), (2, 3, 4, 5), (300_001,)]


def sample(dtype, shape, seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                                               dtype=np.uint8)
    if dtype is np.bool_:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def all_kinds() -> dict[str, np.ndarray]:
    return {f"{np.dtype(d).name}/{'x'.join(map(str, s)) or 'scalar'}": sample(d, s, i * 31 + j)
            for i, d in enumerate(DTYPES) for j, s in enumerate(SHAPES)}


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert b[name].dtype == a[name].dtype, name
        assert b[name].shape == a[name].shape, name
        assert b[name].tobytes() == a[name].tobytes(), name


def test_round_trip_every_dtype_and_shape(engine, tmp_path) -> None:
    arrays = all_kinds()
    path = tmp_path / "all.safetensors"
    with ShardWriter(path, engine, buffer_size=64 << 10, metadata={"note": "hi"}) as w:
        for name, a in arrays.items():
            w.add(name, a)
    info = w.info
    assert info.size == os.path.getsize(path)
    with ShardReader(path, engine) as r:
        assert r.metadata == {"note": "hi"}
        assert r.checksum == info.checksum
        assert_same(arrays, r.read_many())


def test_gc_paused_puts_the_collector_back_as_it_found_it() -> None:
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with gc_paused():
            assert not gc.isenabled()
            raise ValueError("a failed read")
    assert gc.isenabled()  # re-enabled after an error too
    entered, leave = threading.Event(), threading.Event()

    def other_thread() -> None:
        with gc_paused():
            entered.set()
            leave.wait()

    thread = threading.Thread(target=other_thread)
    thread.start()
    entered.wait()
    with gc_paused():
        pass
    assert not gc.isenabled()  # the other thread's pause still holds
    leave.set()
    thread.join()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller who had disabled it keeps it disabled
    finally:
        gc.enable()
    seen_in_thread = []

    def background_save() -> None:  # a long pause there would hold back the training's collection
        with gc_paused(main_thread_only=True):
            seen_in_thread.append(gc.isenabled())

    thread = threading.Thread(target=background_save)
    thread.start()
    thread.join()
    with gc_paused(main_thread_only=True):
        seen_in_thread.append(gc.isenabled())
    assert seen_in_thread == [True, False]


def test_layout_is_aligned(tmp_path) -> None:
    arrays = {"u8": np.arange(3, dtype=np.uint8), "f64": np.ones(5), "f16": np.ones(3, np.float16),
              "i32": np.arange(7, dtype=np.int32)}
    path = tmp_path / "a.safetensors"
    with ShardWriter(path) as w:
        for n, a in arrays.items():
            w.add(n, a)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 4096 == 0
    header = json.loads(raw[8:8 + n])
    for name, entry in header.items():
        if name != "__metadata__":
            assert entry["data_offsets"][0] % np.dtype(arrays[name].dtype).itemsize == 0
    begins = sorted(e["data_offsets"] for k, e in header.items() if k != "__metadata__")
    assert all(a[1] == b[0] for a, b in zip(begins, begins[1:])), "packed without holes"


def test_a_plan_is_redone_after_another_add(tmp_path) -> None:
    from safetensors.numpy import load_file

    arrays = {"first": np.arange(5.0), "later": np.arange(7, dtype=np.int8), "wide": np.ones((3, 2), np.int64)}
    with ShardWriter(tmp_path / "planned.safetensors", metadata={"step": "3"}) as w:
        w.add("first", arrays["first"])
        w.plan()
        w.add("later", arrays["later"])
        w.add("wide", arrays["wide"])
    assert set(w.info.tensors) == set(arrays)
    assert_same(arrays, load_file(str(tmp_path / "planned.safetensors")))
    with ShardReader(tmp_path / "planned.safetensors") as r:
        assert_same(arrays, r.read_many(list(arrays)))
        assert r.metadata["step"] == "3"


def test_files_open_with_the_safetensors_library(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.numpy import load_file

    arrays = {k: v for k, v in all_kinds().items() if "float8" not in k and "bfloat16" not in k}
    path = tmp_path / "compat.safetensors"
    with ShardWriter(path) as w:
        for n, a in arrays.items():
            w.add(n, a)
    assert_same(arrays, {k: np.asarray(v) for k, v in load_file(str(path)).items()})
    special = {"bf": sample(ml_dtypes.bfloat16, (9, 4), 1), "f8": sample(ml_dtypes.float8_e5m2, (6,), 2)}
    with ShardWriter(path) as w:
        for n, a in special.items():
            w.add(n, a)
    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("bf").dtype == torch.bfloat16
        assert f.get_tensor("bf").view(torch.uint16).numpy().tobytes() == special["bf"].tobytes()
        assert f.get_tensor("f8").view(torch.uint8).numpy().tobytes() == special["f8"].tobytes()


def test_a_stream_is_written_as_one_whatever_its_name_says(tmp_path, monkeypatch) -> None:
    """A file object's name only labels it. A stream wrapper's "s3://bucket/model.safetensors"
    was taken for the path of a file to write and refused as a URL, so that the way to write
    a stream, a ShardWriter named as it with write_to(stream), failed for it; ShardWriter now
    takes the stream itself, and reads and errors name it by its name."""
    import io
    monkeypatch.chdir(tmp_path)  # a URL taken for a path would make a folder "s3:" here
    url = "s3://bucket/model.safetensors"

    class Named(io.BytesIO):
        name = url

    arrays = {"a": sample(np.float32, (5, 3), 0), "b": sample(np.int8, (7,), 1)}
    stream = Named()
    with ShardWriter(stream) as w:
        for n, a in arrays.items():
            w.add(n, a)
    assert w.info.path == url and w.info.size == len(stream.getvalue())
    stream.seek(0)
    with tensorferry.StreamReader(stream) as reader:
        assert reader.path == url
        assert_same(arrays, reader.map_many())
    # A real file behind a buffered writer, holding bytes already: written the stream's way, after them.
    (tmp_path / "f").write_bytes(b"head")
    with open(tmp_path / "f", "ab") as f:
        f.raw.name = url
        w = ShardWriter(f)
        w.add("a", arrays["a"])
        assert w.close().path == url
    with open(tmp_path / "f", "rb") as f:
        f.raw.name = url
        assert f.read(4) == b"head"
        with tensorferry.StreamReader(f) as reader:
            assert_same({"a": arrays["a"]}, reader.map_many())
    with pytest.raises(ValueError, match=f"{url}: a file object is written in place; atomic needs a path"):
        ShardWriter(Named(), atomic=True)
    assert os.listdir(tmp_path) == ["f"]


def test_reads_files_written_by_safetensors(tmp_path) -> None:
    from safetensors.numpy import save_file
    arrays = {"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 3), np.int16)}
    save_file(arrays, str(tmp_path / "peer.safetensors"), metadata={"k": "v"})
    with ShardReader(tmp_path / "peer.safetensors") as r:
        assert r.metadata == {"k": "v"}
        assert_same(arrays, r.read_many())


def test_read_subsets_and_into_destinations(engine, tmp_path) -> None:
    arrays = {f"t{i}": sample(np.float32, (1000 + i,), i) for i in range(20)}
    path = tmp_path / "s.safetensors"
    with ShardWriter(path, engine) as w:
        for n, a in arrays.items():
            w.add(n, a)
    with ShardReader(path, engine, chunk_size=16 << 10) as r:
        np.testing.assert_array_equal(r.read("t7"), arrays["t7"])
        dest = np.empty(1003, np.float32)
        r.read("t3", out=dest)
        np.testing.assert_array_equal(dest, arrays["t3"])
        got = r.read_many(["t1", "t19", "t5"], out={"t19": np.empty(1019, np.float32)})
        assert_same({k: arrays[k] for k in ("t1", "t19", "t5")}, got)
        with pytest.raises(ValueError, match="destination"):
            r.read("t0", out=np.empty(3, np.float32))
        with pytest.raises(KeyError):
            r.read("nope")


def test_lazy_sources_and_explicit_dtype(tmp_path) -> None:
    path = tmp_path / "lazy.safetensors"
    calls = []

    def produce() -> bytes:
        calls.append(1)
        return np.arange(6, dtype=np.int32).tobytes()

    with ShardWriter(path) as w:
        w.add("lazy", "I32", (2, 3), produce)
        w.add("raw", np.float16, (2,), np.array([1, 2], np.float16).tobytes())
        with pytest.raises(ValueError, match="twice"):
            w.add("raw", np.ones(1))
    assert calls == [1]
    with ShardReader(path) as r:
        np.testing.assert_array_equal(r.read("lazy"), np.arange(6, dtype=np.int32).reshape(2, 3))
    with pytest.raises(ValueError, match="needs 24 bytes"):
        with ShardWriter(tmp_path / "bad.safetensors") as w:
            w.add("x", "F32", (6,), b"short")
    assert not (tmp_path / "bad.safetensors").exists()


# --- boxes: the part of a stored chunk a reader with another sharding wants -----------

BOX_ARRAYS = {"v": sample(np.float32, (300,), 1), "m": sample(ml_dtypes.bfloat16, (64, 64), 2),
              "c": sample(np.int16, (4, 5, 6), 3), "tall": sample(np.bool_, (300, 10), 4),
              "s": sample(np.float64, (), 5), "empty": sample(np.float32, (3, 0, 2), 6)}


@pytest.fixture
def box_file(tmp_path):
    path = tmp_path / "boxes.safetensors"
    with ShardWriter(path) as w:
        for name, a in BOX_ARRAYS.items():
            w.add(name, a)
    return path


def _box(name, offsets, lengths) -> np.ndarray:
    return BOX_ARRAYS[name][tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


@pytest.mark.parametrize("name, offsets, lengths, read_bytes", [
    ("v", (17,), (100,), 400),  # 1-D: always one range
    ("m", (3, 0), (2, 64), 256),  # whole rows: one range
    ("m", (5, 7), (1, 20), 40),  # part of one row: one range
    ("m", (2, 1), (2, 60), 2 * (64 + 60)),  # an envelope little larger than the box
    ("m", (10, 5), (8, 4), 8 * 4 * 2),  # far larger: one read per row
    ("c", (1, 2, 3), (2, 2, 2), 2 * 2 * 2 * 2),  # 3-D, runs of 2 elements
    ("c", (1, 0, 0), (2, 5, 6), 2 * 30 * 2),  # 3-D, whole trailing dims: one range
    ("tall", (0, 3), (300, 1), 2991),  # too many runs: the envelope after all
    ("s", (), (), 8),
    ("m", (0, 0), (64, 64), 64 * 64 * 2),  # the whole tensor: verified
])
def test_read_box_matches_numpy_slicing(engine, box_file, name, offsets, lengths, read_bytes) -> None:
    want = _box(name, offsets, lengths)
    with ShardReader(box_file, engine) as r:
        read = r.read_box(name, offsets, lengths)
        assert read.future.result() == read_bytes
        got = read.result()
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
        assert read.whole == (want.size == BOX_ARRAYS[name].size)
        # Into a strided slice of a larger array, and into raw bytes.
        big = np.zeros(tuple(n + 3 for n in lengths), want.dtype)
        dest = big[(*(slice(1, 1 + n) for n in lengths), ...)]  # a view, even 0-d
        assert r.read_box(name, offsets, lengths, out=dest).result() is dest
        assert dest.tobytes() == want.tobytes()
        raw = bytearray(want.nbytes)
        r.read_box(name, offsets, lengths, out=raw).result()
        assert bytes(raw) == want.tobytes()


def test_read_box_in_place(engine, box_file) -> None:
    with ShardReader(box_file, engine) as r:
        out = np.zeros((3, 64), ml_dtypes.bfloat16)
        read = r.read_box("m", (4, 0), (3, 64), out=out)
        assert read.future.result() == out.nbytes
        assert read.result() is out
        assert out.tobytes() == _box("m", (4, 0), (3, 64)).tobytes()
        raw = bytearray(5 * 6 * 2)
        got = r.read_box("c", (2, 0, 0), (1, 5, 6), out=raw).result()
        assert np.shares_memory(got, np.frombuffer(raw, np.uint8))
        assert bytes(raw) == _box("c", (2, 0, 0), (1, 5, 6)).tobytes()


def test_read_box_zero_size(engine, box_file) -> None:
    with ShardReader(box_file, engine) as r:
        for name, offsets, lengths in [("m", (4, 64), (3, 0)), ("c", (0, 0, 0), (0, 5, 6)),
                                       ("empty", (0, 0, 0), (3, 0, 2))]:
            read = r.read_box(name, offsets, lengths)
            assert read.future.result() == 0
            got = read.result()
            assert got.shape == lengths and got.dtype == BOX_ARRAYS[name].dtype
            out = np.empty(lengths, BOX_ARRAYS[name].dtype)
            assert r.read_box(name, offsets, lengths, out=out).result() is out


def test_read_box_out_of_range_and_bad_destinations(box_file) -> None:
    with ShardReader(box_file) as r:
        for offsets, lengths in [((60, 0), (5, 1)), ((-1, 0), (2, 2)), ((0,), (4,)), ((0, 0), (1, -1)),
                                 ((65, 0), (0, 0))]:
            with pytest.raises(CorruptCheckpointError, match="outside tensor 'm'"):
                r.read_box("m", offsets, lengths)
        with pytest.raises(ValueError, match="has 10 bytes, the box 16"):
            r.read_box("m", (0, 0), (2, 4), out=bytearray(10))
        with pytest.raises(ValueError, match="2-byte items"):
            r.read_box("m", (0, 0), (2, 4), out=np.empty((2, 4), np.float32))


def test_read_box_checksums_cover_only_whole_tensors(box_file) -> None:
    raw = bytearray(box_file.read_bytes())
    with ShardReader(box_file) as r:
        t = r.info("v")
        raw[r.data_start + t.begin + 4 * 200] ^= 0x40  # element 200 of "v"
    box_file.write_bytes(bytes(raw))
    with ShardReader(box_file) as r:
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            r.read_box("v", (0,), (300,)).result()
        assert r.read_box("v", (0,), (100,)).result().tobytes() == BOX_ARRAYS["v"][:100].tobytes()
    with ShardReader(box_file, verify=False) as r:
        assert r.read_box("v", (0,), (300,)).result()[200] != BOX_ARRAYS["v"][200]


def test_whole_reads_start_each_run_with_its_first_tensor(engine, tmp_path) -> None:
    arrays = {f"t{i}": sample(np.float32, (5000 + i,), i) for i in range(12)}
    arrays["empty"] = np.zeros((0, 3), np.float32)
    path = tmp_path / "runs.safetensors"
    with ShardWriter(path) as w:
        for name, a in arrays.items():
            w.add(name, a)
    submitted = []
    original = engine.pread
    engine.pread = lambda *args, **kw: submitted.append(args[2]) or original(*args, **kw)
    with ShardReader(path, engine, chunk_size=3 * 20_100) as r:
        asked = [n for n in arrays if n != "t5"]  # t5 is left out, so its neighbours are two runs
        submitted.clear()  # the header's reads
        whole = r.start_whole(asked)
        assert "t5" not in whole and "empty" not in whole and submitted == []
        finish_t7 = whole.start("t7")
        assert len(submitted) == 1
        finish_t6 = whole.start("t6")  # the run t7 started holds it: no new request
        assert len(submitted) == 1
        np.testing.assert_array_equal(finish_t6(), arrays["t6"])
        np.testing.assert_array_equal(finish_t7(), arrays["t7"])
        got = {n: whole.start(n)() for n in asked if n != "empty"}
        assert 2 < len(submitted) < len(asked) - 1
    for name, a in got.items():
        np.testing.assert_array_equal(a, arrays[name])
        assert a.dtype == np.float32 and a.shape == arrays[name].shape


def test_whole_reads_verify_each_tensor(engine, tmp_path) -> None:
    path = tmp_path / "bad.safetensors"
    with ShardWriter(path) as w:
        w.add("a", sample(np.float32, (1000,), 1))
        w.add("b", sample(np.float32, (1000,), 2))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40  # in b, the last tensor
    path.write_bytes(bytes(raw))
    with ShardReader(path, engine) as r:
        whole = r.start_whole(["a", "b"])
        finish_a, finish_b = whole.start("a"), whole.start("b")
        np.testing.assert_array_equal(finish_a(), sample(np.float32, (1000,), 1))
        with pytest.raises(CorruptCheckpointError, match="tensor 'b'"):
            finish_b()
        # One read holds both; hashed together as it lands, each still answers for itself.
        whole = r.start_whole(["a", "b"])
        finish_a, finish_b = whole.start("a"), whole.start("b")
        with pytest.raises(CorruptCheckpointError, match="tensor 'b'"):
            finish_b()
        np.testing.assert_array_equal(finish_a(), sample(np.float32, (1000,), 1))


# --- corruption: every case is a clear CorruptCheckpointError ------------------------


@pytest.fixture
def good_file(tmp_path):
    path = tmp_path / "good.safetensors"
    with ShardWriter(path) as w:
        w.add("a", sample(np.float32, (1000,), 1))
        w.add("b", sample(np.int64, (300,), 2))
    return path


def rewrite_header(path, mutate) -> None:
    """Changes a file's header as a hostile writer would: its header checksum made anew,
    so that what is checked after it is reached."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    mutate(header)
    header["__metadata__"][HEADER_CHECKSUM_KEY] = "0" * 16
    body = json.dumps(header).encode()
    assert len(body) <= n
    raw[8:8 + n] = body + b" " * (n - len(body))
    mark = f'"{HEADER_CHECKSUM_KEY}": "'.encode()
    at = raw.index(mark) + len(mark)
    raw[at:at + 16] = tensorferry.shard.digest(raw[:8 + n]).encode()
    path.write_bytes(bytes(raw))


def test_flipped_data_byte_fails_the_checksum(good_file) -> None:
    raw = bytearray(good_file.read_bytes())
    raw[-5] ^= 0x40
    good_file.write_bytes(bytes(raw))
    with ShardReader(good_file) as r, pytest.raises(CorruptCheckpointError, match="checksum"):
        r.read_many()
    with ShardReader(good_file, verify=False) as r:
        r.read_many()  # opting out reads the damaged bytes


def test_truncated_file(good_file) -> None:
    raw = good_file.read_bytes()
    good_file.write_bytes(raw[:-100])
    with pytest.raises(CorruptCheckpointError, match="outside"):
        ShardReader(good_file)
    good_file.write_bytes(raw[:5])
    with pytest.raises(CorruptCheckpointError, match="too short"):
        ShardReader(good_file)


def test_header_length_past_eof(good_file) -> None:
    raw = bytearray(good_file.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) * 2)
    good_file.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="past the end"):
        ShardReader(good_file)
    raw[:8] = struct.pack("<Q", 2**63)
    good_file.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="cap"):
        ShardReader(good_file)


def test_overlapping_offsets(good_file) -> None:
    def overlap(h):
        h["b"]["data_offsets"] = [h["a"]["data_offsets"][0], h["a"]["data_offsets"][0] + 2400]
    rewrite_header(good_file, overlap)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        ShardReader(good_file)


def test_absurd_shape_allocates_nothing(good_file) -> None:
    def absurd(h):
        h["a"]["shape"] = [2**40, 2**40]
    rewrite_header(good_file, absurd)
    with pytest.raises(CorruptCheckpointError, match="needs"):
        ShardReader(good_file)


@pytest.mark.parametrize("bad", [
    {"dtype": "F99"}, {"shape": [-1]}, {"shape": "big"}, {"data_offsets": [5]}, {"data_offsets": [10, 2]},
])
def test_invalid_entries(good_file, bad) -> None:
    rewrite_header(good_file, lambda h: h["a"].update(bad))
    with pytest.raises(CorruptCheckpointError):
        ShardReader(good_file)


def test_non_json_header(good_file) -> None:
    raw = bytearray(good_file.read_bytes())
    raw[8:12] = b"\xff{[("
    good_file.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="header does not match its checksum"):
        ShardReader(good_file)
    good_file.write_bytes(struct.pack("<Q", 8) + b"\xff{[(    ")  # no seal to check: a foreign file
    with pytest.raises(CorruptCheckpointError, match="JSON"):
        ShardReader(good_file)
    assert issubclass(CorruptCheckpointError, ValueError)


# --- checkpoint directories --------------------------------------------------------


def test_checkpoint_round_trip_with_sharding(engine, tmp_path) -> None:
    arrays = {f"layer{i}": sample(np.float32, (50_000,), i) for i in range(12)}
    arrays.update(all_kinds())
    path = tensorferry.save_checkpoint(tmp_path / "step_10", arrays, {"step": 10, "lr": 0.1},
                                       engine=engine, max_shard_bytes=600_000)
    files = sorted(os.listdir(path))
    assert "tensorferry.json" in files and len(files) > 3
    manifest = tensorferry.read_manifest(path)
    assert manifest["metadata"] == {"step": 10, "lr": 0.1}
    assert manifest["tensors"]["layer3"]["file"].endswith(".safetensors")
    assert_same(arrays, tensorferry.load_checkpoint(path, engine=engine))
    part = tensorferry.load_checkpoint(path, ["layer2", "layer7"], engine=engine)
    assert_same({k: arrays[k] for k in ("layer2", "layer7")}, part)
    assert tensorferry.verify_checkpoint(path) == []


def test_checkpoint_detects_damage(tmp_path) -> None:
    arrays = {f"w{i}": sample(np.float32, (40_000,), i) for i in range(4)}
    path = tensorferry.save_checkpoint(tmp_path / "c", arrays, max_shard_bytes=200_000)
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    victim = os.path.join(path, shards[0])
    with open(victim, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        tensorferry.load_checkpoint(path)
    assert tensorferry.verify_checkpoint(path) and shards[0] in tensorferry.verify_checkpoint(path)[0]
    os.unlink(os.path.join(path, shards[1]))
    with pytest.raises(CorruptCheckpointError, match="missing"):
        tensorferry.load_checkpoint(path)
    with open(victim, "ab") as f:
        f.write(b"extra")
    with pytest.raises(CorruptCheckpointError, match="manifest says"):
        tensorferry.load_checkpoint(path, list(arrays)[:1])


def test_verify_checks_what_load_reads_besides_checkpoint_directories(tmp_path) -> None:
    """A single file (as the adapters' save writes it) and a Hugging Face folder are
    verified as load_checkpoint reads them, not refused for lacking a manifest."""
    from safetensors.numpy import save_file

    arrays = {f"w{i}": sample(np.float32, (40_000,), i) for i in range(3)}
    with ShardWriter(tmp_path / "one.safetensors") as w:
        for name, a in arrays.items():
            w.add(name, a)
    assert tensorferry.verify_checkpoint(tmp_path / "one.safetensors") == []
    with open(tmp_path / "one.safetensors", "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\xff")
    (problem,) = tensorferry.verify_checkpoint(tmp_path / "one.safetensors")
    assert problem.startswith("one.safetensors: ") and "checksum" in problem
    (tmp_path / "hf").mkdir()
    save_file(arrays, str(tmp_path / "hf" / "model.safetensors"))  # no checksums: headers and sizes
    assert tensorferry.verify_checkpoint(tmp_path / "hf") == []
    os.truncate(tmp_path / "hf" / "model.safetensors", 1000)
    assert tensorferry.verify_checkpoint(tmp_path / "hf")[0].startswith("model.safetensors: ")


def test_directory_without_manifest_is_not_a_checkpoint(tmp_path) -> None:
    (tmp_path / "step_5").mkdir()
    (tmp_path / "step_5" / "shard-00000.safetensors").write_bytes(b"junk")
    with pytest.raises(CheckpointNotFoundError, match="not a complete checkpoint"):
        tensorferry.load_checkpoint(tmp_path / "step_5")
    with pytest.raises(CheckpointNotFoundError):
        tensorferry.load_checkpoint(tmp_path / "absent")
    assert tensorferry.latest_checkpoint(tmp_path) is None
    tensorferry.save_checkpoint(tmp_path / "step_2", {"x": np.ones(3)})
    assert tensorferry.latest_checkpoint(tmp_path) == str(tmp_path / "step_2")
    # The run's root given for one of its checkpoints: the error names those inside.
    with pytest.raises(CheckpointNotFoundError, match=r"it holds checkpoints \(step_2\): give one of them"):
        tensorferry.load_checkpoint(tmp_path)


def test_latest_and_retention(tmp_path) -> None:
    for step in (1, 2, 10, 9):
        tensorferry.save_checkpoint(tmp_path / f"step_{step}", {"x": np.full(3, step)})
    (tmp_path / f"step_11{tensorferry.checkpoint.TMP_MARKER}0123456789ab").mkdir()
    assert tensorferry.latest_checkpoint(tmp_path) == str(tmp_path / "step_10")
    removed = tensorferry.prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(os.path.basename(p) for p in removed) == ["step_1", "step_2"]
    assert [os.path.basename(p) for p in tensorferry.list_checkpoints(tmp_path)] == ["step_9", "step_10"]
    tensorferry.prune_checkpoints(tmp_path, keep_last=1, remove_unfinished=True)
    assert sorted(os.listdir(tmp_path)) == ["step_10"]


def test_a_save_leaves_a_users_names_with_tmp_in_them_alone(tmp_path) -> None:
    """A save removes what killed saves to its target left, and took for that any unheld
    <target>.tmp-*: a user's model.safetensors.tmp-backup, or photos.tmp-2024/ with all in it."""
    (tmp_path / "model.safetensors.tmp-backup").write_bytes(b"mine")
    (tmp_path / "photos.tmp-2024").mkdir()
    (tmp_path / "photos.tmp-2024" / "a.jpg").write_bytes(b"img")
    (tmp_path / "model.safetensors.tmp-0123abcd").write_bytes(b"partial")  # what killed saves left
    (tmp_path / "photos.tmp-0123456789ab").mkdir()
    with ShardWriter(tmp_path / "model.safetensors", atomic=True) as writer:
        writer.add("x", np.ones(3))
    tensorferry.save_checkpoint(tmp_path / "photos", {"x": np.ones(3)})
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "model.safetensors.tmp-backup", "photos",
                                            "photos.tmp-2024"]
    assert (tmp_path / "photos.tmp-2024" / "a.jpg").read_bytes() == b"img"


def test_a_checkpoint_in_a_folder_named_with_tmp_by_its_user_loads(tmp_path) -> None:
    """Any folder with '.tmp-' in its name was taken for a save's temporary: a user's
    copy step_2.tmp-2024 did not load ("unfinished checkpoint")."""
    tensorferry.save_checkpoint(tmp_path / "step_1", {"x": np.arange(3)})
    shutil.copytree(tmp_path / "step_1", tmp_path / "step_2.tmp-2024")
    shutil.copytree(tmp_path / "step_1", tmp_path / "step_3.tmp-0123456789ab")  # a save killed before its rename
    assert np.array_equal(tensorferry.load_checkpoint(tmp_path / "step_2.tmp-2024")["x"], np.arange(3))
    with pytest.raises(CheckpointNotFoundError, match="unfinished"):
        tensorferry.read_manifest(tmp_path / "step_3.tmp-0123456789ab")


def test_a_users_folder_named_with_tmp_is_no_step_of_the_run_and_retention_leaves_it(tmp_path) -> None:
    """A user's copy step_2.tmp-2024 was listed as step 2024: it became latest_checkpoint,
    and prune_checkpoints(keep_last=2) kept it and removed the real step_4. No save is made
    under a name with '.tmp-' in it, so such a folder is its user's: it loads, but is not
    listed, not latest and not pruned, and the run's own checkpoints keep their order."""
    for step in (1, 2, 3, 4, 5):
        tensorferry.save_checkpoint(tmp_path / f"step_{step}", {"x": np.full(2, step)})
    shutil.copytree(tmp_path / "step_2", tmp_path / "step_2.tmp-2024")
    shutil.copytree(tmp_path / "step_5", tmp_path / "step_5.tmp-2024")  # a copy of the newest alike
    shutil.copytree(tmp_path / "step_1", tmp_path / "photos.tmp-2024")
    run = [str(tmp_path / f"step_{step}") for step in (1, 2, 3, 4, 5)]
    assert tensorferry.list_checkpoints(tmp_path) == run
    assert tensorferry.latest_checkpoint(tmp_path) == run[-1]
    assert tensorferry.prune_checkpoints(tmp_path, keep_last=2, remove_unfinished=True) == run[:3]
    assert sorted(os.listdir(tmp_path)) == ["photos.tmp-2024", "step_2.tmp-2024", "step_4", "step_5",
                                            "step_5.tmp-2024"]
    assert tensorferry.load_checkpoint(tmp_path / "step_2.tmp-2024")["x"][0] == 2


def test_every_temporary_name_made_is_one_that_is_recognised() -> None:
    from tensorferry.temporaries import is_leftover_name, is_temporary_name, temporary_name, temporary_token
    made = ("0123abcd", "0123456789ab", DCP_TOKEN, "replaced-0123abcd", "old-0123abcd", "pruned-0123abcd",
            *(temporary_token() for _ in range(200)), *(temporary_token(6) for _ in range(200)))
    for tail in made:
        assert is_temporary_name(temporary_name("step_1", tail)) and is_leftover_name(f"step_1.tmp-{tail}")
    # An earlier version's token of digits alone (1 in 43): never a checkpoint, but it may be
    # a user's date, so clean-up leaves it; after a reason it is ours whatever its digits.
    for tail in ("20240315", "202403151200"):
        assert is_temporary_name(f"step_1.tmp-{tail}") and not is_leftover_name(f"step_1.tmp-{tail}")
    for tail in ("old-20240315", "pruned-31415926", "replaced-31415926"):
        assert is_temporary_name(f"step_1.tmp-{tail}") and is_leftover_name(f"step_1.tmp-{tail}")
    for tail in ("backup", "2024", "old-dcp", "0123ABCD"):  # a tail no leftover could be told by
        assert not is_temporary_name(f"step_1.tmp-{tail}") and not is_leftover_name(f"step_1.tmp-{tail}")
        with pytest.raises(ValueError, match="cannot end a temporary's name"):
            temporary_name("step_1", tail)


def test_an_earlier_versions_asides_of_digits_alone_are_neither_listed_nor_kept_over_checkpoints(tmp_path) -> None:
    """Asides an earlier version named with a token of digits alone (1 in 43) were listed as
    checkpoints once tokens had to have a letter: the newest step "latest", and a prune kept
    it and removed every real checkpoint."""
    for step in (1, 2, 3):
        tensorferry.save_checkpoint(tmp_path / f"step_{step}", {"x": np.full(2, step)})
    shutil.copytree(tmp_path / "step_1", tmp_path / "step_1.tmp-pruned-20481024")
    shutil.copytree(tmp_path / "step_2", tmp_path / "step_2.tmp-replaced-31415926")
    shutil.copytree(tmp_path / "step_1", tmp_path / "step_4.tmp-123456789012")  # a killed save's, complete
    names = ["step_1", "step_2", "step_3"]
    assert [os.path.basename(p) for p in tensorferry.list_checkpoints(tmp_path)] == names
    assert os.path.basename(tensorferry.latest_checkpoint(tmp_path)) == "step_3"
    tensorferry.prune_checkpoints(tmp_path, keep_last=1, remove_unfinished=True)
    assert [os.path.basename(p) for p in tensorferry.list_checkpoints(tmp_path)] == ["step_3"]
    assert "step_4.tmp-123456789012" in os.listdir(tmp_path), "digits alone may be a user's: left to them"


def test_retention_keeps_whole_what_it_cannot_remove(tmp_path) -> None:
    """prune_checkpoints in a directory it may not change: it returned the checkpoints as
    removed, all still there, and (where the folder itself was writable) could empty one
    half way. Now each stays whole, with a RetentionWarning, and is not reported removed."""
    from conftest import mounted
    for step in (1, 2, 3):
        tensorferry.save_checkpoint(tmp_path / f"step_{step}", {"x": np.full(2, step)})
    with mounted("tmpfs") as target:
        subprocess.run(["mount", "--bind", str(tmp_path), target], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)
            with pytest.warns(tensorferry.RetentionWarning, match="could not remove .*it is kept"):
                assert tensorferry.prune_checkpoints(target, keep_last=1) == []
        finally:
            subprocess.run(["umount", "-l", target], capture_output=True)
    assert [os.path.basename(p) for p in tensorferry.list_checkpoints(tmp_path)] == ["step_1", "step_2", "step_3"]
    assert tensorferry.load_checkpoint(tmp_path / "step_1")["x"][0] == 1


def test_a_name_that_marks_temporaries_is_refused_before_a_save(tmp_path) -> None:
    """A checkpoint or file named with '.tmp-' saved, then could not be loaded (taken for
    an unfinished save), and a save to the name before the marker removed it."""
    with pytest.raises(ValueError, match="'.tmp-' in it"):
        tensorferry.save_checkpoint(tmp_path / "model.tmp-finetune", {"x": np.ones(2)})
    with pytest.raises(ValueError, match="'.tmp-' in it"):
        ShardWriter(tmp_path / "w.safetensors.tmp-best", atomic=True)
    assert os.listdir(tmp_path) == []


def test_a_path_through_a_link_and_dotdot_is_where_the_kernel_puts_it(tmp_path) -> None:
    """'runs/../c' with 'runs' a link to 'real/runs': os.path.abspath made it 'c' beside
    'runs', where open() and the shell take 'real/c'; the checkpoint was saved where the
    same path then did not find it."""
    (tmp_path / "real" / "runs").mkdir(parents=True)
    os.symlink(tmp_path / "real" / "runs", tmp_path / "runs")
    path = str(tmp_path / "runs" / ".." / "c")
    assert tensorferry.save_checkpoint(path, {"x": np.arange(3.0)}) == str(tmp_path / "real" / "c")
    assert os.path.isdir(tmp_path / "real" / "c") and not os.path.exists(tmp_path / "c")
    assert tensorferry.load_checkpoint(path)["x"].tolist() == [0.0, 1.0, 2.0]


def test_links_to_checkpoints_are_not_checkpoints(tmp_path) -> None:
    """A "latest" or "best" link beside the steps: listed, it broke the ordering by step
    number and pruning removed it like a checkpoint."""
    for step in (1, 2, 3):
        tensorferry.save_checkpoint(tmp_path / f"step_{step}", {"x": np.full(2, step)})
    os.symlink("step_3", tmp_path / "latest")
    os.symlink("step_1", tmp_path / "best")
    assert tensorferry.list_checkpoints(tmp_path) == [str(tmp_path / f"step_{s}") for s in (1, 2, 3)]
    assert tensorferry.prune_checkpoints(tmp_path, keep_last=2) == [str(tmp_path / "step_1")]
    assert sorted(os.listdir(tmp_path)) == ["best", "latest", "step_2", "step_3"]
    assert os.path.islink(tmp_path / "latest") and tensorferry.load_checkpoint(tmp_path / "latest")["x"][0] == 3


def test_existing_checkpoint_is_replaced_only_on_request(tmp_path) -> None:
    tensorferry.save_checkpoint(tmp_path / "c", {"x": np.ones(3)})
    with pytest.raises(FileExistsError):
        tensorferry.save_checkpoint(tmp_path / "c", {"x": np.zeros(3)})
    assert tensorferry.load_checkpoint(tmp_path / "c")["x"][0] == 1
    assert os.listdir(tmp_path) == ["c"], "the failed save left no temporary directory"
    tensorferry.save_checkpoint(tmp_path / "c", {"x": np.zeros(3)}, overwrite=True)
    assert tensorferry.load_checkpoint(tmp_path / "c")["x"][0] == 0
    wait_for_discards()  # the replaced checkpoint is removed in the background
    assert os.listdir(tmp_path) == ["c"]
    # A link replaced ("latest" naming a step): the link goes, never the checkpoint it named.
    # The save failed after its commit (the link set aside could not be locked) and left it.
    os.symlink("c", tmp_path / "latest")
    tensorferry.save_checkpoint(tmp_path / "latest", {"x": np.full(3, 2.0)}, overwrite=True)
    wait_for_discards()
    assert sorted(os.listdir(tmp_path)) == ["c", "latest"] and not os.path.islink(tmp_path / "latest")
    assert tensorferry.load_checkpoint(tmp_path / "c")["x"][0] == 0
    assert tensorferry.load_checkpoint(tmp_path / "latest")["x"][0] == 2


def test_multi_writer_commit(tmp_path) -> None:
    pending = tensorferry.PendingCheckpoint.begin(tmp_path / "step_3")
    joined = tensorferry.PendingCheckpoint(pending.directory, pending.token)  # another rank
    infos = []
    for rank, p in enumerate([pending, joined]):
        with p.writer(f"rank{rank}.safetensors") as w:
            w.add(f"w.rank{rank}", np.full(10, rank, np.float32))
        infos.append(w.info)
    assert tensorferry.latest_checkpoint(tmp_path) is None  # nothing visible before commit
    pending.commit(infos, {"world_size": 2})
    loaded = tensorferry.load_checkpoint(tmp_path / "step_3")
    assert loaded["w.rank1"][0] == 1 and loaded["w.rank0"][0] == 0
    with pytest.raises(ValueError):
        pending.writer("../escape.safetensors")
    manifest = tensorferry.read_manifest(tmp_path / "step_3")
    assert manifest["metadata"] == {"world_size": 2}
    for rank, info in enumerate(infos):
        name = f"rank{rank}.safetensors"
        assert manifest["files"][name] == {"size": info.size, "checksum": info.checksum}
        stored = info.tensors[f"w.rank{rank}"]
        assert manifest["tensors"][f"w.rank{rank}"] == {
            "file": name, "dtype": "F32", "shape": [10], "data_offsets": [stored.begin, stored.end],
            "checksum": stored.checksum}


def test_commit_refuses_a_tensor_in_two_files(tmp_path) -> None:
    pending = tensorferry.PendingCheckpoint.begin(tmp_path / "step_4")
    infos = []
    for rank in range(2):
        with pending.writer(f"rank{rank}.safetensors") as w:
            w.add("shared", np.zeros(4))
        infos.append(w.info)
    with pytest.raises(ValueError, match="'shared' is in both rank0.safetensors and rank1.safetensors"):
        pending.commit(infos)
    assert tensorferry.latest_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="__metadata__"):
        pending.writer("rank2.safetensors").add("__metadata__", np.zeros(1))


def test_an_existing_target_is_refused_before_anything_is_written(tmp_path, monkeypatch) -> None:
    """Without overwrite, a save to an existing checkpoint (or file, or link) fails before
    it writes its state, not after; an empty directory, made for the checkpoint
    beforehand, is no obstacle: the commit's rename replaces it."""
    tensorferry.save_checkpoint(tmp_path / "ckpt", {"a": np.ones(3)})
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "nowhere", tmp_path / "link")

    def written(*_args, **_kwargs):
        raise AssertionError("the state was written before the existing target was refused")

    with monkeypatch.context() as patched:
        patched.setattr(ShardWriter, "add", written)
        for target in ("ckpt", "file", "link"):
            with pytest.raises(FileExistsError, match=f"{target} exists; pass overwrite=True"):
                tensorferry.save_checkpoint(tmp_path / target, {"a": np.zeros(3)})
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "file", "link"]
    np.testing.assert_array_equal(tensorferry.load_checkpoint(tmp_path / "ckpt")["a"], np.ones(3))
    (tmp_path / "made").mkdir()
    tensorferry.save_checkpoint(tmp_path / "made", {"a": np.full(3, 2.0)})
    np.testing.assert_array_equal(tensorferry.load_checkpoint(tmp_path / "made")["a"], np.full(3, 2.0))


def test_disk_full_keeps_the_previous_checkpoint(small_tmpfs) -> None:
    root = small_tmpfs
    previous = {"w": sample(np.float32, (200_000,), 1)}  # 800 kB
    tensorferry.save_checkpoint(os.path.join(root, "step_1"), previous)
    with pytest.raises(OSError) as info:
        tensorferry.save_checkpoint(os.path.join(root, "step_2"), {"w": sample(np.float32, (2_000_000,), 2)})
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(root)) == ["step_1"], "the temporary directory is removed"
    assert_same(previous, tensorferry.load_checkpoint(os.path.join(root, "step_1")))
    assert tensorferry.latest_checkpoint(root) == os.path.join(root, "step_1")


def test_missing_parent_is_created(tmp_path) -> None:
    tensorferry.save_checkpoint(tmp_path / "runs" / "a" / "step_1", {"x": np.ones(2)})
    assert tensorferry.latest_checkpoint(tmp_path / "runs" / "a").endswith("step_1")


def test_a_file_saved_into_a_missing_directory_names_it(tmp_path) -> None:
    """As torch.save, a single file needs its directory; the error names that directory,
    not the temporary the save would have written first."""
    with ShardWriter(tmp_path / "f.safetensors") as w:
        w.add("x", np.ones(2))
    for parent, code in ((tmp_path / "no" / "such"), errno.ENOENT), ((tmp_path / "f.safetensors"), errno.ENOTDIR):
        with pytest.raises(tensorferry.TensorferryIOError) as info:
            with ShardWriter(parent / "g.safetensors", atomic=True) as w:
                w.add("x", np.ones(2))
        assert info.value.errno == code and info.value.filename == str(parent)
        assert ".tmp-" not in str(info.value)
    # Over a directory: refused before a byte is written (the rename failed after the whole file).
    (tmp_path / "a_directory").mkdir()
    with pytest.raises(tensorferry.TensorferryIOError, match="cannot save a file over a directory") as info:
        with ShardWriter(tmp_path / "a_directory", atomic=True) as w:
            w.add("x", np.ones(2))
    assert info.value.errno == errno.EISDIR and sorted(os.listdir(tmp_path)) == ["a_directory", "f.safetensors"]
    with pytest.raises(FileNotFoundError, match="an empty path names no file or directory"):
        ShardWriter("", atomic=True)


def test_a_checkpoint_never_replaces_the_working_directory(tmp_path, monkeypatch) -> None:
    """save_checkpoint("") (an unset variable, say) or into the working directory, empty:
    the empty directory a save replaces was this process's own, left deleted under it."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for where, error in (("", FileNotFoundError), (".", ValueError), (str(work), ValueError),
                         (str(tmp_path), ValueError)):
        with pytest.raises(error, match="empty path|working directory, or holds it"):
            tensorferry.save_checkpoint(where, {"x": np.ones(2)}, overwrite=True)
    assert os.getcwd() == str(work) and os.listdir(work) == [] and os.listdir(tmp_path) == ["work"]


def test_unwritable_directory() -> None:
    from conftest import mounted
    with mounted("tmpfs", "size=1m,ro") as root:
        with pytest.raises(OSError) as info:
            tensorferry.save_checkpoint(os.path.join(root, "step_1"), {"x": np.ones(2)})
        assert info.value.errno in (errno.EROFS, errno.EACCES)
        assert os.listdir(root) == []


SAVE_AT_EXIT_SCRIPT = textwrap.dedent("""
    import sys, threading, numpy as np, tensorferry
    root = sys.argv[1]
    arrays = {f"w{i}": np.full(300_000, 2, np.float32) for i in range(24)}
    # The main thread ends at once: the save runs while the interpreter exits, as a
    # background save does when a script ends without waiting for it.
    threading.Thread(target=tensorferry.save_checkpoint, args=(root + "/step_1", arrays),
                     kwargs={"max_shard_bytes": 4 << 20, "overwrite": True}).start()
""")


def test_a_save_still_running_at_exit_completes(tmp_path) -> None:
    """Python finishes running threads at exit, after concurrent.futures stops taking
    work: a save spreading its files over a pool then failed with "cannot schedule new
    futures after interpreter shutdown" (and overwrote nothing)."""
    root = str(tmp_path)
    tensorferry.save_checkpoint(os.path.join(root, "step_1"), {"w0": np.ones(3, np.float32)})
    script = tmp_path / "save.py"
    script.write_text(SAVE_AT_EXIT_SCRIPT)
    result = subprocess.run([sys.executable, str(script), root], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    loaded = tensorferry.load_checkpoint(os.path.join(root, "step_1"))
    assert len(loaded) == 24 and all((a == 2).all() for a in loaded.values())
    assert len(tensorferry.read_manifest(os.path.join(root, "step_1"))["files"]) > 1  # the pool was used
    assert sorted(os.listdir(root)) == ["save.py", "step_1"]  # the replaced one removed too


CRASH_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, tensorferry
    root = sys.argv[1]
    arrays = {f"w{i}": np.full(300_000, 2, np.float32) for i in range(24)}
    print("ready", flush=True)
    tensorferry.save_checkpoint(root + "/step_2", arrays, max_shard_bytes=4 << 20)
    print("done", flush=True)
""")


@pytest.mark.slow
def test_killed_saves_never_damage_the_previous_checkpoint(tmp_path) -> None:
    root = str(tmp_path)
    good = {f"w{i}": np.full(300_000, 1, np.float32) for i in range(24)}
    tensorferry.save_checkpoint(os.path.join(root, "step_1"), good, max_shard_bytes=4 << 20)
    script = tmp_path / "save.py"
    script.write_text(CRASH_SCRIPT)
    rng = random.Random(1234)
    completed = 0
    for trial in range(24):
        proc = subprocess.Popen([sys.executable, str(script), root], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.25))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        latest = tensorferry.latest_checkpoint(root)
        assert latest in (os.path.join(root, "step_1"), os.path.join(root, "step_2"))
        assert_same(good, tensorferry.load_checkpoint(os.path.join(root, "step_1")))
        for entry in os.listdir(root):
            path = os.path.join(root, entry)
            if entry.startswith("step_2") and os.path.isdir(path):
                if tensorferry.checkpoint.TMP_MARKER in entry:
                    with pytest.raises(CheckpointNotFoundError):
                        tensorferry.read_manifest(path)
                else:  # a finished save is whole
                    completed += 1
                    loaded = tensorferry.load_checkpoint(path)
                    assert all((a == 2).all() for a in loaded.values())
                    assert latest == path
        tensorferry.prune_checkpoints(root, keep_last=10, remove_unfinished=True)
        if os.path.exists(os.path.join(root, "step_2")):
            shutil.rmtree(os.path.join(root, "step_2"))
    assert completed < 24, "some trials must kill the save mid-way"


def test_non_contiguous_and_big_endian_arrays(tmp_path) -> None:
    base = sample(np.float32, (64, 64), 5)
    arrays = {"strided": base[::2, 1::3], "transposed": base.T, "big_endian": base.astype(">f4")}
    path = tmp_path / "layouts.safetensors"
    with ShardWriter(path) as w:
        for n, a in arrays.items():
            w.add(n, a)
    with ShardReader(path) as r:
        got = r.read_many()
    for n, a in arrays.items():
        np.testing.assert_array_equal(got[n], a)
        assert got[n].dtype == np.float32


def test_load_in_place_into_existing_arrays(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    arrays = {"w": sample(np.float32, (300, 70), 1), "b": sample(np.int64, (70,), 2), "x": np.ones(3)}
    path = tensorferry.save_checkpoint(tmp_path / "c", arrays, max_shard_bytes=50_000)
    dest = {"w": np.zeros((300, 70), np.float32), "b": torch.zeros(70, dtype=torch.int64)}
    loaded = tensorferry.load_checkpoint(path, out=dest)
    assert set(loaded) == {"w", "b"} and loaded["w"] is dest["w"] and loaded["b"] is dest["b"]
    np.testing.assert_array_equal(dest["w"], arrays["w"])
    assert dest["b"].numpy().tobytes() == arrays["b"].tobytes()
    both = tensorferry.load_checkpoint(path, ["x"], out={"w": np.zeros((300, 70), np.float32)})
    assert set(both) == {"x", "w"}
    with pytest.raises(ValueError, match="shape"):
        tensorferry.load_checkpoint(path, out={"w": np.zeros((70, 300), np.float32)})
    with pytest.raises(ValueError, match="F32"):
        tensorferry.load_checkpoint(path, out={"w": np.zeros((300, 70), np.float64)})
    with pytest.raises(KeyError) as missing:
        tensorferry.load_checkpoint(path, out={"nope": np.zeros(1)})
    assert str(missing.value).count("nope") == 1


def test_load_in_place_into_torch_tensors_of_dtypes_numpy_lacks(tmp_path) -> None:
    """bf16 and fp8 torch tensors as destinations, as the docstring promises: numpy's
    DLPack import refuses their dtypes ("Unsupported dtype in DLTensor")."""
    torch = pytest.importorskip("torch")
    import ml_dtypes
    arrays = {"bf16": sample(np.float32, (64, 8), 3).astype(ml_dtypes.bfloat16),
              "fp8": sample(np.float32, (128,), 4).astype(ml_dtypes.float8_e4m3fn)}
    path = tensorferry.save_checkpoint(tmp_path / "c", arrays)
    dest = {"bf16": torch.zeros(64, 8, dtype=torch.bfloat16), "fp8": torch.zeros(128, dtype=torch.float8_e4m3fn)}
    assert tensorferry.load_checkpoint(path, out=dest)["bf16"] is dest["bf16"]
    for name, tensor in dest.items():
        assert tensor.view(torch.uint8).numpy().tobytes() == arrays[name].tobytes(), name
    with pytest.raises(ValueError, match="not C-contiguous"):
        tensorferry.load_checkpoint(path, out={"bf16": torch.zeros(8, 64, dtype=torch.bfloat16).T})
    with pytest.raises(ValueError, match="BF16"):
        tensorferry.load_checkpoint(path, out={"bf16": torch.zeros(64, 8, dtype=torch.float16)})


def test_missing_names_are_listed_briefly_with_the_closest_held(tmp_path) -> None:
    state = {f"model.layers.{i}.weight": np.full(2, i, np.float32) for i in range(500)}
    tensorferry.save_checkpoint(tmp_path / "c", state)
    asked = [f"layers.{i}.weight" for i in range(500)]  # the prefix dropped, as after unwrapping a model
    with pytest.raises(KeyError) as missing:
        tensorferry.load_checkpoint(tmp_path / "c", asked)
    message = str(missing.value)
    assert "'layers.0.weight'" in message and "and 492 more" in message and len(message) < 600, message
    assert "closest held: 'model.layers.0.weight'" in message


def test_atomic_writer_replaces_only_when_complete(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"previous contents")
    with pytest.raises(ValueError):
        with ShardWriter(path, atomic=True) as w:
            w.add("x", "F32", (4,), b"too short")
    assert path.read_bytes() == b"previous contents"  # the old file is untouched
    with ShardWriter(path, atomic=True) as w:
        w.add("x", np.arange(4, dtype=np.float32))
    assert w.info.path == str(path)
    with ShardReader(path) as r:
        np.testing.assert_array_equal(r.read("x"), np.arange(4, dtype=np.float32))
    wait_for_discards()  # the replaced file is removed in the background
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_small_file_takes_staging_of_its_own_size(tmp_path) -> None:
    from tensorferry import shard
    shard._pool.clear()
    arrays = {f"t{i}": np.full(64 << 10, i, np.uint8) for i in range(16)}  # 1 MiB of small tensors
    with ShardWriter(tmp_path / "small.safetensors") as w:  # the default buffer is 64 MiB
        for name, a in arrays.items():
            w.add(name, a)
    assert shard._pool.cached_bytes <= 2 << 20, "staging went back to the pool: one slot of about the file's size"
    with ShardReader(tmp_path / "small.safetensors") as r:
        assert all(np.array_equal(r.read(n), a) for n, a in arrays.items())


def test_default_files_per_process_follows_the_cores_of_its_share(monkeypatch):
    from tensorferry.checkpoint import default_files_per_process
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_files_per_process() == 4  # capped
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_files_per_process() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_files_per_process() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert default_files_per_process() == 1  # never none
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert default_files_per_process() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert default_files_per_process() == 1


def test_a_temporary_held_only_by_garbage_is_taken_over_by_the_next_save(tmp_path) -> None:
    # A failed save's exception keeps the writer's frames in a reference cycle, and with
    # them its lock on a temporary of a fixed name (DCP's): the next save to the same path
    # in this process frees it, while a holder still reachable (a save running) keeps it.
    target = str(tmp_path / "ck")
    with gc_paused():
        first = tensorferry.PendingCheckpoint.begin(target, DCP_TOKEN)
        cycle: list = [first]
        cycle.append(cycle)
        del first, cycle  # the collector is paused: the cycle stays until a collection
        second = tensorferry.PendingCheckpoint.begin(target, DCP_TOKEN)
        with pytest.raises(FileExistsError):
            tensorferry.PendingCheckpoint.begin(target, DCP_TOKEN)
    assert held_here(second.tmp_path)
    second.abort()
    assert not held_here(second.tmp_path) and os.listdir(tmp_path) == []


@pytest.mark.parametrize("protocol", ["exchange", "two renames"])
def test_a_save_with_a_fixed_token_right_after_an_overwrite_finds_its_temporary_free(
        tmp_path, monkeypatch, discards_held_up, protocol) -> None:
    """DCPWriter's saves all write <path>.tmp-dcp. An overwrite left the checkpoint it
    replaced under that name (or, without an atomic exchange, under <path>.tmp-old-dcp)
    while the background thread freed its files, so the next save to the path failed
    ("is held", or ENOTEMPTY) until they were: half the time for a few MB, always for many GB."""
    if protocol == "two renames":
        monkeypatch.setattr(tensorferry.checkpoint, "exchange", lambda a, b: False)  # no RENAME_EXCHANGE
    target = str(tmp_path / "latest")
    for value in range(3):
        pending = tensorferry.PendingCheckpoint.begin(target, DCP_TOKEN)
        with pending.writer("x.safetensors") as writer:
            writer.add("x", np.full(4, value))
        pending.commit([writer.info], overwrite=True)
        assert not os.path.lexists(pending.tmp_path)
        assert tensorferry.load_checkpoint(target)["x"][0] == value
    assert tensorferry.list_checkpoints(tmp_path) == [target], "what is being freed is no checkpoint"
    discards_held_up()
    wait_for_discards()
    assert os.listdir(tmp_path) == ["latest"]


@pytest.mark.parametrize("action", [
    lambda url: tensorferry.save_checkpoint(url, {"a": np.ones(3)}),
    lambda url: tensorferry.load_checkpoint(url),
    lambda url: tensorferry.latest_checkpoint(url),
    lambda url: tensorferry.prune_checkpoints(url, keep_last=1),
    lambda url: ShardWriter(url + "/x.safetensors"),
    lambda url: ShardReader(url + "/x.safetensors"),
    lambda url: tensorferry.Engine().pwrite(np.ones(4096, np.uint8), url + "/x").result(),
    lambda url: tensorferry.Engine().pread_files([(url + "/x", [(np.ones(4096, np.uint8), 0)])]),
    lambda url: tensorferry.FileSource([url + "/x", (url + "/y", 0, 8)]),
    lambda url: tensorferry.OffloadStore(url),
    lambda url: tensorferry.checkpoint.recoverable_checkpoints(url),
], ids=["save_checkpoint", "load_checkpoint", "latest_checkpoint", "prune_checkpoints", "ShardWriter",
        "ShardReader", "Engine.pwrite", "Engine.pread_files", "FileSource", "OffloadStore",
        "recoverable_checkpoints"])
def test_a_url_is_refused_not_made_a_local_folder(tmp_path, monkeypatch, action) -> None:
    """s3://bucket/run would be a local folder "s3:" to os.makedirs, and latest_checkpoint
    would find no checkpoint there: a training job would start afresh, saving locally."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="'s3://bucket/run.*' is a URL"):
        action("s3://bucket/run")
    assert not os.listdir(tmp_path)


def test_what_a_save_replaces_is_freed_in_the_background(tmp_path) -> None:
    """A replaced file, a checkpoint replaced with overwrite=True, and pruned checkpoints
    leave their names at once and are removed by a background thread; a file's save over
    a folder still fails and leaves the folder."""
    path = tmp_path / "state.safetensors"
    _write_file(path, 1.0)
    with ShardReader(path) as old_reader:  # open across the replacement: still the old bytes
        _write_file(path, 2.0)
        assert old_reader.read("x")[0] == 1.0
    with ShardReader(path) as reader:
        assert reader.read("x")[0] == 2.0
    for step in range(3):
        tensorferry.save_checkpoint(tmp_path / "c", {"x": np.full(8, step)}, overwrite=True)
    for step in range(3):
        tensorferry.save_checkpoint(tmp_path / "run" / f"step_{step}", {"x": np.full(8, step)})
    removed = tensorferry.prune_checkpoints(tmp_path / "run", keep_last=1, wait=False)
    assert [os.path.basename(p) for p in removed] == ["step_0", "step_1"]
    assert [os.path.basename(p) for p in tensorferry.list_checkpoints(tmp_path / "run")] == ["step_2"]
    wait_for_discards()
    assert sorted(os.listdir(tmp_path)) == ["c", "run", "state.safetensors"]
    assert os.listdir(tmp_path / "run") == ["step_2"]
    assert tensorferry.load_checkpoint(tmp_path / "c")["x"][0] == 2
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "keep").write_text("mine")
    with pytest.raises(OSError):
        _write_file(tmp_path / "folder", 3.0)
    assert (tmp_path / "folder" / "keep").read_text() == "mine"
    wait_for_discards()
    assert sorted(os.listdir(tmp_path)) == ["c", "folder", "run", "state.safetensors"]


def _write_file(path, value: float) -> None:
    with ShardWriter(path, atomic=True) as writer:
        writer.add("x", np.full(1 << 20, value))


def test_concurrent_saves_to_one_target_all_succeed_and_reads_see_whole_saves(tmp_path) -> None:
    """Six writers replacing one file and one checkpoint (every rank saving what rank 0
    alone should, say) while reading them back: each save either lands whole or is
    replaced whole, and none fails. Each used to lose races now and then: a temporary
    taken for a leftover by another save's clean-up before its maker held it, a name
    committed between a check and a rename, a read whose checkpoint was replaced twice."""
    errors: list[str] = []

    def writer(k: int) -> None:
        for i in range(12):
            value = k * 100 + i
            try:
                _write_file(tmp_path / "same.safetensors", float(value))
                with ShardReader(tmp_path / "same.safetensors") as reader:
                    assert len(set(reader.read("x")[:: 4096].tolist())) == 1
                tensorferry.save_checkpoint(tmp_path / "ck", {"x": np.full(1 << 14, value)}, overwrite=True)
                assert len(set(tensorferry.load_checkpoint(tmp_path / "ck")["x"].tolist())) == 1
            except Exception as exc:  # noqa: BLE001 (every failure is reported)
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    wait_for_discards()
    assert sorted(os.listdir(tmp_path)) == ["ck", "same.safetensors"]


def test_an_interrupted_load_stops_reading(tmp_path, monkeypatch) -> None:
    """Ctrl-C during a load: read_many submits a file's reads at once, and load_checkpoint
    reads files on worker threads; interrupted, they went on reading every byte (a 4 GiB
    load took 4.9 s to exit after SIGINT on the development VM, 0.8 s now). What is not
    yet issued is cancelled, in the interrupted reader and in the other files' readers."""
    arrays = {f"w{i}": np.full(1 << 20, i, np.uint8) for i in range(12)}
    path = tmp_path / "one.safetensors"
    with ShardWriter(path) as w:
        for name, a in arrays.items():
            w.add(name, a)
    cancelled: list[object] = []
    real_cancel = tensorferry.IOFuture.cancel
    monkeypatch.setattr(tensorferry.IOFuture, "cancel", lambda self: cancelled.append(self) or real_cancel(self))
    real_result = tensorferry.IOFuture.result

    def interrupted(self, timeout=None):
        raise KeyboardInterrupt

    with ShardReader(path, chunk_size=1 << 20) as reader:
        monkeypatch.setattr(tensorferry.IOFuture, "result", interrupted)
        with pytest.raises(KeyboardInterrupt):
            reader.read_many()
        assert len(cancelled) == 12  # every run started, each cancelled
        monkeypatch.setattr(tensorferry.IOFuture, "result", real_result)
        reader.cancel()  # before a read: that read is cancelled, the next is not
        with pytest.raises(tensorferry.TensorferryIOError, match="read cancelled") as info:
            reader.read_many()
        assert info.value.errno == errno.ECANCELED
        assert all(np.array_equal(a, arrays[n]) for n, a in reader.read_many().items())

    tensorferry.save_checkpoint(tmp_path / "ckpt", arrays, max_shard_bytes=3 << 20)
    stopped: list[str] = []
    real_read_many, real_reader_cancel = ShardReader.read_many, ShardReader.cancel

    def first_file_interrupted(self, *args, **kwargs):
        if self.path.endswith("shard-00000.safetensors"):
            raise KeyboardInterrupt
        return real_read_many(self, *args, **kwargs)

    monkeypatch.setattr(ShardReader, "read_many", first_file_interrupted)
    monkeypatch.setattr(ShardReader, "cancel", lambda self: stopped.append(os.path.basename(self.path))
                        or real_reader_cancel(self))
    with pytest.raises(KeyboardInterrupt):
        tensorferry.load_checkpoint(tmp_path / "ckpt")
    assert set(stopped) == {n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".safetensors")}


def test_an_abort_called_again_leaves_a_later_saves_temporary_alone(tmp_path) -> None:
    """Saves with a fixed token (DCP's "<path>.tmp-dcp") reuse one temporary name: a
    second abort() of an earlier, failed save removed the later save's files."""
    first = tensorferry.PendingCheckpoint.begin(tmp_path / "step_1", DCP_TOKEN)
    first.abort()
    later = tensorferry.PendingCheckpoint.begin(tmp_path / "step_1", DCP_TOKEN)
    with open(os.path.join(later.tmp_path, "part"), "wb") as f:
        f.write(b"written by the later save")
    first.abort()
    assert os.listdir(later.tmp_path) == ["part"]
    later.abort()
    assert not os.path.exists(later.tmp_path)


def test_a_superseded_save_leaves_what_is_at_its_path(tmp_path) -> None:
    """``superseded`` (save_checkpoint, PendingCheckpoint.commit, an atomic ShardWriter) is
    asked just before the rename: True drops the save, its temporary too, and leaves the
    path as it is; False commits as without it."""
    tensorferry.save_checkpoint(tmp_path / "step_1", {"x": np.full(3, 1)})
    asked = []
    tensorferry.save_checkpoint(tmp_path / "step_1", {"x": np.full(3, 2)}, overwrite=True,
                                superseded=lambda: asked.append("dir") or True)
    path = tmp_path / "model.safetensors"
    with ShardWriter(path, atomic=True) as w:
        w.add("x", np.full(3, 1))
    writer = ShardWriter(path, atomic=True, superseded=lambda: asked.append("file") or True)
    writer.add("x", np.full(3, 2))
    writer.close()
    wait_for_discards()
    assert asked == ["dir", "file"]
    assert tensorferry.load_checkpoint(tmp_path / "step_1")["x"].tolist() == [1, 1, 1]
    with ShardReader(path) as r:
        assert r.read("x").tolist() == [1, 1, 1]
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "step_1"], "no temporary is left"
    tensorferry.save_checkpoint(tmp_path / "step_1", {"x": np.full(3, 3)}, overwrite=True, superseded=lambda: False)
    assert tensorferry.load_checkpoint(tmp_path / "step_1")["x"].tolist() == [3, 3, 3]
