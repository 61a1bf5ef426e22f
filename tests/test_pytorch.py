"""The PyTorch adapter: DCP storage, FSDPCheckpointer on real FSDP2 with gloo, save/load."""

from __future__ import annotations

import errno
import functools
import importlib.util
import gc
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402 (a BaseException)

import tensorferry  # noqa: E402
from conftest import ctrl_c, once_blocked_in, requires_cuda  # noqa: E402
from tensorferry import CheckpointNotFoundError  # noqa: E402
from tensorferry.adapters.pytorch import (DCPReader, DCPWriter, FSDPCheckpointer, load,  # noqa: E402
                                          load_checkpoint, save, save_checkpoint)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DTYPES = [getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "complex64", "int64", "int32", "int16", "int8", "uint8", "bool")
    if hasattr(torch, name)]  # float8_e8m0fnu since torch 2.7


def random_tensor(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8)) if a.dim() else \
        a.dtype == b.dtype and a.reshape(1).view(torch.uint8).equal(b.reshape(1).view(torch.uint8))


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 8))


# --- save/load: the torch.save drop-in ----------------------------------------------------


def test_save_load_nested_state(tmp_path) -> None:
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    obj = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7, "lr": 1e-3,
           "name": "run-1", "flags": [True, None, float("inf")], "shape": (3, 4),
           "tensors": {str(d).split(".")[-1]: random_tensor(d, (5, 3), i) for i, d in enumerate(DTYPES)},
           "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "dtype": torch.bfloat16}
    path = tmp_path / "state.safetensors"
    save(obj, path)
    back = load(path)
    assert back["step"] == 7 and back["name"] == "run-1" and back["flags"] == [True, None, float("inf")]
    assert back["shape"] == (3, 4) and back["dtype"] is torch.bfloat16
    for name, t in obj["tensors"].items():
        assert same(t, back["tensors"][name]), name
    assert same(obj["scalar"], back["scalar"]) and back["empty"].shape == (0, 4)
    for k, v in obj["model"].items():
        assert torch.equal(v, back["model"][k])
    assert set(back["optimizer"]["state"]) == {0, 1, 2, 3, 4, 5}  # int keys survive
    fresh = torch.optim.AdamW(small_model().parameters(), lr=1e-3)
    fresh.load_state_dict(back["optimizer"])  # a real optimizer accepts it
    from safetensors.torch import load_file
    theirs = load_file(str(path))
    assert torch.equal(theirs["model.0.weight"], obj["model"]["0.weight"])
    for name, t in obj["tensors"].items():  # every dtype, complex and e8m0 included, as safetensors reads it
        assert same(t, theirs[f"tensors.{name}"]), name


class Wrapping(torch.Tensor):
    """A tensor subclass over another tensor, holding no bytes of its own (a "wrapper
    subclass", as torchao's quantized and float8 tensors are)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "Wrapping":
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = functools.partial(torch.utils._pytree.tree_map, lambda x: x.inner if isinstance(x, Wrapping) else x)
        return func(*unwrap(args), **unwrap(kwargs or {}))


def test_save_keeps_tied_tensors_tied_and_refuses_pickle_only_objects(tmp_path) -> None:
    w = torch.randn(4, 4)
    save({"a": w, "b": w}, tmp_path / "tied.safetensors")
    back = load(tmp_path / "tied.safetensors")
    assert back["a"] is back["b"]
    with pytest.raises(TypeError, match="without pickle"):
        save({"f": object()}, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()
    with pytest.raises(TypeError, match="complex128 has no safetensors equivalent"):  # safetensors has no C128
        save({"z": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "bad.safetensors")
    no_dense_form = {"is a sparse_coo tensor": torch.eye(2).to_sparse(),
                     "is on the meta device": torch.empty(3, device="meta")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: CSR tensors are beta, nested ones a prototype
        no_dense_form["is a sparse_csr tensor"] = torch.eye(2).to_sparse_csr()
        no_dense_form["is a nested tensor"] = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    no_dense_form["is a Wrapping, a tensor subclass that wraps"] = Wrapping(torch.ones(2, 2))  # torchao's kind
    for why, tensor in no_dense_form.items():
        with pytest.raises(TypeError, match=f"m.x {why}"):
            save({"m": {"x": tensor}}, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tied.safetensors"]


def test_the_cores_save_names_a_tensor_numpy_cannot_hold_and_the_adapter(tmp_path) -> None:
    """``tensorferry.save_checkpoint`` (numpy's) given a state dict with bf16 or wrapping
    tensors: torch's numpy() error named neither the entry nor the way that works."""
    import tensorferry
    for tensor in (torch.ones(2, dtype=torch.bfloat16), Wrapping(torch.ones(2))):
        with pytest.raises(TypeError, match=r"layer\.w: a .* is no array numpy can hold .*adapters\.pytorch"):
            tensorferry.save_checkpoint(tmp_path / "c", {"layer.b": torch.ones(2), "layer.w": tensor})
    assert os.listdir(tmp_path) == []
    save_checkpoint(tmp_path / "c", {"layer.w": torch.ones(2, dtype=torch.bfloat16)})  # the adapter's


def test_file_objects_as_torch_save_and_load_take_them(tmp_path, monkeypatch) -> None:
    """``save(state, f)`` and ``load(f)`` with a file object (``io.BytesIO``, an open file,
    an fsspec stream), from where it stands, as ``torch.save``/``torch.load`` do: the same
    bytes as a file saved by path. Both raised TypeError from os.fspath."""
    import io

    import fsspec

    import tensorferry.shard

    w = torch.randn(300, 70)
    state = {"model": {"w": w, "b": torch.arange(5)}, "tied": w, "step": 7, "name": "run"}
    save(state, tmp_path / "by_path.safetensors")
    on_disk = (tmp_path / "by_path.safetensors").read_bytes()
    stream = io.BytesIO()
    stream.write(b"before")
    save(state, stream)
    assert stream.getvalue() == b"before" + on_disk

    class PassingOn(io.BytesIO):
        """Passes each write on as it comes (an upload's buffer, say): nothing may be
        written behind, so its header cannot come last."""

        def write(self, data):
            self.at.append(self.tell())
            return super().write(data)

    passing = PassingOn()
    passing.at = []
    save(state, passing)
    assert passing.getvalue() == on_disk and passing.at == sorted(passing.at)
    stream.seek(len(b"before"))
    with open(tmp_path / "by_path.safetensors", "rb") as opened:
        with fsspec.open("memory://tensorferry-test/state.safetensors", "wb") as remote:
            save(state, remote)
        with fsspec.open("memory://tensorferry-test/state.safetensors", "rb") as remote:
            for back in (load(stream), load(opened), load(remote)):
                assert torch.equal(back["model"]["w"], w) and torch.equal(back["model"]["b"], state["model"]["b"])
                assert back["tied"] is back["model"]["w"] and back["step"] == 7 and back["name"] == "run"
                back["model"]["w"].add_(1)  # the memory a stream was read into is the caller's
    for junk, named in ((b"not a checkpoint", "header length"), (on_disk[:-100], "fall outside")):
        with pytest.raises(tensorferry.CorruptCheckpointError, match=f"<BytesIO>: .*{named}"):
            load(io.BytesIO(junk))
    pickled = io.BytesIO()
    torch.save(state, pickled)
    pickled.seek(0)
    with pytest.raises(tensorferry.CorruptCheckpointError, match="<BytesIO>: not a safetensors file but a zip archive"):
        load(pickled)
    # A file opened at its start is read as the file (O_DIRECT, no copy in memory), and
    # left just past the object (here its end); after a prefix it goes through memory. Errors name its path.
    (tmp_path / "prefixed").write_bytes(b"before" + on_disk)
    in_memory = []
    real_reader = tensorferry.shard.StreamReader.__init__
    monkeypatch.setattr(tensorferry.shard.StreamReader, "__init__",
                        lambda self, *a, **k: in_memory.append(1) or real_reader(self, *a, **k))
    with open(tmp_path / "by_path.safetensors", "rb") as opened, open(tmp_path / "prefixed", "rb") as prefixed:
        prefixed.seek(len(b"before"))
        for f, through_memory in ((opened, 0), (prefixed, 1)):
            assert torch.equal(load(f)["model"]["w"], w) and len(in_memory) == through_memory and f.read() == b""
    import gzip  # its fileno() is the compressed file's: read through the stream, decompressed
    with gzip.open(tmp_path / "state.safetensors.gz", "wb") as packed:
        save(state, packed)
    with gzip.open(tmp_path / "state.safetensors.gz", "rb") as packed:
        assert torch.equal(load(packed)["model"]["w"], w) and len(in_memory) == 2
    import bz2
    import lzma  # these seek from their end by decompressing through: asked no length
    for opener in (lzma.open, bz2.open):
        with opener(tmp_path / "state.safetensors.z", "wb") as packed:
            save(state, packed)
        with opener(tmp_path / "state.safetensors.z", "rb") as packed:
            assert torch.equal(load(packed)["model"]["w"], w)
    (tmp_path / "pickled.pt").write_bytes(pickled.getvalue())
    with open(tmp_path / "pickled.pt", "rb") as opened:
        with pytest.raises(tensorferry.CorruptCheckpointError, match=f"{tmp_path}/pickled.pt: not a safetensors"):
            load(opened)


def test_a_file_just_opened_for_writing_is_written_as_the_file(tmp_path, small_tmpfs, monkeypatch) -> None:
    """``with open(path, "wb") as f: save(state, f)`` (torch.save's old idiom; any file
    opened for writing that is still empty, a NamedTemporaryFile too) is written by
    the engine as ``save(state, path)`` writes (it went through Python's buffered writes,
    hashing every tensor first: 2.4 CPU-s per GiB against 0.15 on the development VM), and
    is left at its end; the same bytes, and the caller may write on after them. Files
    holding bytes already, or opened to append, go the stream's way: written over or after
    what they hold, as torch.save writes them. A full disk is named by the file's path."""
    import errno
    import io

    import tensorferry.shard

    state = {"w": torch.randn(300, 70), "b": torch.arange(5), "step": 7}
    save(state, tmp_path / "by_path.safetensors")
    on_disk = (tmp_path / "by_path.safetensors").read_bytes()
    through_stream = []
    real_write_to = tensorferry.shard.ShardWriter.write_to
    monkeypatch.setattr(tensorferry.shard.ShardWriter, "write_to",
                        lambda self, stream: through_stream.append(1) or real_write_to(self, stream))
    for mode in ("wb", "xb", "w+b", "ab"):  # empty files, whatever the mode
        with open(tmp_path / f"opened_{mode}", mode) as f:
            save(state, f)
            assert f.tell() == len(on_disk)
            f.write(b"trailer")
        assert (tmp_path / f"opened_{mode}").read_bytes() == on_disk + b"trailer" and not through_stream
        with open(tmp_path / f"opened_{mode}", "rb") as f:
            assert torch.equal(load(f)["w"], state["w"])  # a file object is read up to its last tensor
        with pytest.raises(tensorferry.CorruptCheckpointError, match="goes on 7 bytes after its last tensor"):
            load(tmp_path / f"opened_{mode}")  # a path is a file, which safetensors too takes whole
    with tempfile.NamedTemporaryFile(dir=tmp_path) as f:
        save(state, f)
        f.flush()
        assert open(f.name, "rb").read() == on_disk and not through_stream
    with tempfile.TemporaryFile(dir=tmp_path) as f:  # no name (O_TMPFILE): reopened through /proc all the same
        save(state, f)
        f.seek(0)
        assert f.read() == on_disk and not through_stream
    (tmp_path / "appended").write_bytes(b"before")
    with open(tmp_path / "appended", "ab") as f:
        save(state, f)
    (tmp_path / "overwritten").write_bytes(b"x" * (len(on_disk) + 3))
    with open(tmp_path / "overwritten", "r+b") as f:
        save(state, f)
    assert len(through_stream) == 2
    assert (tmp_path / "appended").read_bytes() == b"before" + on_disk
    assert (tmp_path / "overwritten").read_bytes() == on_disk + b"xxx"
    big = {"w": torch.zeros(8 << 20, dtype=torch.uint8)}
    with open(os.path.join(small_tmpfs, "full.safetensors"), "wb") as f:
        with pytest.raises(tensorferry.TensorferryIOError, match=f"{small_tmpfs}/full.safetensors") as caught:
            save(big, f)
    assert caught.value.errno == errno.ENOSPC and len(through_stream) == 2
    with open(tmp_path / "opened_wb", "rb") as f, pytest.raises(io.UnsupportedOperation):
        save(state, f)  # a file opened for reading alone


_AS_ANOTHER_USER = """
import io, os, sys, torch, xxhash
from tensorferry.adapters.pytorch import load, save
state = {"w": torch.arange(5000, dtype=torch.float32)}
warm = io.BytesIO()  # torch imports modules lazily: import them while the files are readable
save(state, warm)
warm.seek(0)
load(warm)
os.setgid(65534)
os.setuid(65534)
written, read = sys.argv[1], sys.argv[2]
with open(written, "wb") as f:
    os.chmod(written, 0o400)  # made read-only once opened: the open file still writes
    save(state, f)
with open(read, "rb") as f:
    os.chmod(read, 0o000)
    assert torch.equal(load(f)["w"], state["w"])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run as another user whose opens the mode bits refuse")
def test_an_open_file_the_mode_bits_no_longer_allow_to_open_goes_the_streams_way() -> None:
    """The engine opens a file object's file again, through /proc/self/fd: where the
    file's mode now refuses that open (chmod after opening), the stream is used as it is,
    as torch.save and torch.load would; the open failed with EACCES."""
    import pathlib
    import shutil
    import subprocess
    import sys

    work = pathlib.Path(tempfile.mkdtemp(dir="/tmp"))  # the tests' own temporary folders are closed to others
    try:
        work.chmod(0o777)
        read = work / "read.safetensors"
        save({"w": torch.arange(5000, dtype=torch.float32)}, read)
        os.chown(read, 65534, 65534)  # the other user's, so that it may change its mode
        result = subprocess.run([sys.executable, "-c", _AS_ANOTHER_USER, str(work / "written.safetensors"), str(read)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert torch.equal(load(work / "written.safetensors")["w"], torch.arange(5000, dtype=torch.float32))
    finally:
        shutil.rmtree(work)


def test_a_bytesio_over_bytes_is_not_copied_to_be_loaded() -> None:
    """``load(io.BytesIO(response_bytes))``: the BytesIO shares the bytes until someone
    asks for its buffer; asking it its length that way (getbuffer()) copied them whole
    first, 0.1 s and as much memory again per GiB. The load's own memory is allocated
    natively, out of tracemalloc's sight, so what it traces is such Python copies."""
    import io
    import tracemalloc

    state = {"w": torch.randn(4 << 20), "b": torch.arange(3)}
    stream = io.BytesIO()
    save(state, stream)
    data = stream.getvalue()
    del stream
    tracemalloc.start()
    try:
        loaded = load(io.BytesIO(data))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(loaded["w"], state["w"])
    assert peak < len(data) // 4, f"{peak} bytes traced while loading {len(data)}"


def test_streams_read_once_through_the_last_tensor() -> None:
    """A stream that is not a file at its start is read into new memory through its last
    tensor, and no further: two saves written back to back into a pipe load one after the
    other. Streams without seek or readinto load too; a short one is truncated, a damaged
    one fails its checksum, naming the stream; the source stays the caller's to change."""
    import io
    import threading

    first = {"w": torch.randn(1000, 300), "step": 1}
    second = {"w": torch.randn(7), "b": torch.ones(3, dtype=torch.bfloat16), "step": 2}
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as pipe:
        def writer() -> None:
            with os.fdopen(write_end, "wb") as out:
                save(first, out)
                save(second, out)
        thread = threading.Thread(target=writer)
        thread.start()
        loaded = [load(pipe), load(pipe)]
        thread.join()
        assert pipe.read() == b""
    for back, state in zip(loaded, (first, second)):
        assert back["step"] == state["step"] and all(torch.equal(back[k], state[k]) for k in state if k != "step")

    class ReadOnly:  # read() alone: no readinto, seek or tell, as some wrappers have
        def __init__(self, data: bytes) -> None:
            self.data, self.at = data, 0

        def read(self, n: int = -1) -> bytes:
            piece = self.data[self.at:] if n < 0 else self.data[self.at:self.at + n]
            self.at += len(piece)
            return piece

    source = io.BytesIO()
    save(first, source)
    data = source.getvalue()
    assert torch.equal(load(ReadOnly(data))["w"], first["w"])
    arrays = tensorferry.StreamReader(io.BytesIO(data)).map_many()  # the core's reader, for numpy and JAX
    assert list(arrays) == ["w"] and np.array_equal(arrays["w"], first["w"].numpy())
    source.seek(0)
    back = load(source)
    source.write(b"changed")  # the tensors hold memory of their own, not a view of the BytesIO's
    assert torch.equal(back["w"], first["w"])
    with pytest.raises(tensorferry.CorruptCheckpointError, match=r"<ReadOnly>: the stream ends 100 bytes .*truncated"):
        load(ReadOnly(data[:-100]))
    header = json.dumps({"x": {"dtype": "U8", "shape": [1 << 60], "data_offsets": [0, 1 << 60]}}).encode()
    with pytest.raises(MemoryError, match=f"<ReadOnly>: its tensors take {1 << 60} bytes"):
        load(ReadOnly(len(header).to_bytes(8, "little") + header))
    damaged = bytearray(data)
    damaged[-5] ^= 1
    with pytest.raises(tensorferry.CorruptCheckpointError, match=r"<BytesIO>: checksum mismatch in tensor"):
        load(io.BytesIO(bytes(damaged)))
    assert torch.equal(load(io.BytesIO(bytes(damaged)), verify=False)["w"].flatten()[:-2], first["w"].flatten()[:-2])
    class WriteOnly:
        def write(self, data: bytes) -> int:
            return len(data)

    with pytest.raises(TypeError, match="WriteOnly has no read"):
        load(WriteOnly())


def test_a_file_resaved_by_safetensors_with_our_metadata_loads(tmp_path) -> None:
    """The conversion scripts' ``metadata = f.metadata(); save_file(tensors, out,
    metadata=metadata)`` on a file we wrote: its header checksum (or, dropped, its absence
    beside our other keys) was taken for damage, with or without verify. Such a file is
    now read as the safetensors file it is, with a warning naming it; its structure is
    kept while it fits the tensors."""
    import io

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    source = tmp_path / "ours.safetensors"
    save({"model": {"w": torch.randn(4, 4), "b": torch.randn(4)}, "step": 7}, source)
    with safe_open(str(source), "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert {"tensorferry.checksums", "tensorferry.header_checksum", "tensorferry.structure"} <= set(metadata)
    without_seal = {k: v for k, v in metadata.items() if k != "tensorferry.header_checksum"}
    out = tmp_path / "out.safetensors"
    for kept, changed in [(metadata, tensors), (metadata, {k: v.bfloat16() for k, v in tensors.items()}),
                          (without_seal, tensors)]:
        save_file(changed, str(out), metadata=kept)
        for loads in (lambda: load(out), lambda: load(out, verify=False), lambda: load(io.BytesIO(out.read_bytes()))):
            with pytest.warns(tensorferry.RewrittenFileWarning, match="was rewritten by another tool"):
                back = loads()
            assert back["step"] == 7 and set(back["model"]) == {"w", "b"}
            assert all(same(back["model"][k], changed[f"model.{k}"]) for k in ("w", "b"))
        os.makedirs(tmp_path / "folder", exist_ok=True)
        shutil.copy(out, tmp_path / "folder" / "model.safetensors")
        with pytest.warns(tensorferry.RewrittenFileWarning, match="model.safetensors was rewritten"):
            back = load_checkpoint(tmp_path / "folder")  # a folder of safetensors files: its tensors by name
        assert all(same(back[k], changed[k]) for k in changed) and len(back) == 2
    save_file({k.replace("model.", "m."): v for k, v in tensors.items()}, str(out), metadata=metadata)
    with pytest.warns(tensorferry.RewrittenFileWarning, match="tensorferry.structure no longer fits") as caught:
        back = load(out)
    assert str(out) in str(caught[0].message) and set(back) == {"m.w", "m.b"}  # a flat dict, as safetensors gives
    assert set(load_file(str(out))) == {"m.w", "m.b"}


def test_load_plain_safetensors_and_map_location(tmp_path) -> None:
    from safetensors.torch import save_file
    save_file({"x": torch.arange(6.0)}, str(tmp_path / "peer.safetensors"))
    assert torch.equal(load(tmp_path / "peer.safetensors", map_location="cpu")["x"], torch.arange(6.0))
    every = {str(d).split(".")[-1]: random_tensor(d, (5, 3), i) for i, d in enumerate(DTYPES)}
    save_file(every, str(tmp_path / "dtypes.safetensors"))
    back = load(tmp_path / "dtypes.safetensors")
    assert all(same(t, back[name]) for name, t in every.items())
    # torch.load's dict and callable forms, as code written for it passes them: a file's
    # tensors count as saved at "cpu" (the classic "load a GPU checkpoint on the CPU").
    save({"x": torch.arange(6.0), "n": 3}, tmp_path / "ours.safetensors")
    # A callable returning None keeps torch.load's default placement; it raised AttributeError.
    for torch_load_form in (lambda storage, loc: storage, lambda storage, loc: None, {"cuda:0": "cpu"}, {"cpu": "cpu"}):
        for path in (tmp_path / "peer.safetensors", tmp_path / "ours.safetensors"):
            loaded = load(path, map_location=torch_load_form)
            assert loaded["x"].device.type == "cpu" and torch.equal(loaded["x"], torch.arange(6.0))
    with pytest.raises(TypeError, match="map_location must be a device, a device name, a dict"):
        load(tmp_path / "peer.safetensors", map_location=3)
    if not torch.cuda.is_available():  # torch's own failure inside was "Torch not compiled with CUDA enabled"
        for to_a_gpu in ("cuda", "cuda:1", {"cpu": "cuda:0"}):
            with pytest.raises(RuntimeError, match="torch.cuda.is_available\\(\\) is False.*map_location='cpu'"):
                load(tmp_path / "ours.safetensors", map_location=to_a_gpu)


def test_a_load_to_the_meta_device_reads_no_tensor(tmp_path) -> None:
    """``map_location="meta"``, as torch.load takes it (shapes and dtypes for a model built
    on the meta device, say): tensors on the meta device, the saved structure kept, nothing
    of them read (a damaged tensor goes unnoticed there); numpy arrays in the structure are
    read. It was refused."""
    import io

    from tensorferry.shard import ShardReader

    state = {"model": {"w": torch.randn(64, 32).to(torch.bfloat16), "b": torch.nn.Parameter(torch.zeros(32))},
             "step": 9, "rng": np.arange(4)}
    path = tmp_path / "state.safetensors"
    save(state, path)
    save_checkpoint(tmp_path / "ckpt", state, max_shard_bytes=2048)
    tensorferry.save_checkpoint(tmp_path / "plain", {"w": np.ones((3, 5), np.float32)})
    with ShardReader(str(path)) as reader:  # a byte of the largest tensor flipped
        largest = max(reader.tensors, key=lambda name: reader.tensors[name].nbytes)
        at = len(reader.header_bytes) + reader.tensors[largest].begin + 5
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(tensorferry.CorruptCheckpointError, match="checksum"):
        load(path)
    for loaded in (load(path, map_location="meta"),
                   load_checkpoint(tmp_path / "ckpt", map_location=torch.device("meta"))):
        w, b = loaded["model"]["w"], loaded["model"]["b"]
        assert (w.device.type, w.dtype, w.shape) == ("meta", torch.bfloat16, (64, 32))
        assert isinstance(b, torch.nn.Parameter) and b.is_meta and b.shape == (32,)
        assert loaded["step"] == 9 and np.array_equal(loaded["rng"], np.arange(4))
    flat = load_checkpoint(tmp_path / "plain", map_location="meta", names=["w"])
    assert flat["w"].is_meta and flat["w"].shape == (3, 5)
    stream = io.BytesIO((tmp_path / "ckpt" / "shard-00000.safetensors").read_bytes())  # read, then dropped
    assert all(t.is_meta for t in load(stream, map_location="meta").values())
    with pytest.raises(ValueError, match="map_location='meta' reads none"):
        load_checkpoint(tmp_path / "plain", map_location="meta", out={"w": torch.empty(3, 5)})


ALL_DTYPES = DTYPES + [torch.uint16, torch.uint32, torch.uint64]


def test_checkpoint_directories_of_every_dtype(tmp_path) -> None:
    state = {"model": {str(d).split(".")[-1]: random_tensor(d, (5, 3), i) for i, d in enumerate(ALL_DTYPES)},
             "scalar": torch.tensor(1.5, dtype=torch.bfloat16), "step": 3}
    path = save_checkpoint(tmp_path / "c", state, {"note": "x"}, max_shard_bytes=64)
    assert len(tensorferry.read_manifest(path)["files"]) > 1
    assert tensorferry.read_manifest(path)["metadata"]["note"] == "x"
    for back in (load_checkpoint(path), load(path)):  # the directory through the file verb too
        assert back["step"] == 3 and same(state["scalar"], back["scalar"])
        for name, t in state["model"].items():
            assert same(t, back["model"][name]), name
    # In place, into tensors of every dtype.
    into = {f"model.{name}": torch.zeros_like(t) for name, t in state["model"].items()}
    got = load_checkpoint(path, out=into)
    for name, t in state["model"].items():
        assert got[f"model.{name}"] is into[f"model.{name}"] and same(t, into[f"model.{name}"]), name
    assert same(load_checkpoint(path, names=["model.bfloat16"])["model.bfloat16"], state["model"]["bfloat16"])
    with pytest.raises(ValueError, match=f"^{path}: out\\['model.float32'\\]: can read in place only into a contig"):
        load_checkpoint(path, out={"model.float32": torch.zeros(3, 5).t()})


def _ours_and_torchs(state: Any, tmp_path: Path, as_directory: bool, weights_only: bool = True) -> tuple[Any, Any]:
    """``state`` saved and loaded by tensorferry (as a file, or a checkpoint directory), and by torch."""
    import io
    if as_directory:
        save_checkpoint(tmp_path / "c", state)
        ours = load_checkpoint(tmp_path / "c")
    else:
        save(state, tmp_path / "s.safetensors")
        ours = load(tmp_path / "s.safetensors")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return ours, torch.load(buffer, weights_only=weights_only)


@pytest.mark.parametrize("as_directory", [False, True], ids=["file", "checkpoint"])
def test_parameters_and_requires_grad_come_back_as_torch_load_gives_them(tmp_path, as_directory: bool) -> None:
    """A tensor saved while it requires grad (a learned prompt, say) loaded without it
    would be skipped by an optimizer made over it, without a word."""
    linear = torch.nn.Linear(3, 2)
    linear.bias.requires_grad_(False)
    prompt = torch.randn(4, requires_grad=True)
    state = {"w": linear.weight, "b": linear.bias, "w_again": linear.weight, "w_data": linear.weight.data,
             "prompt": prompt, "plain": torch.ones(2), "model": linear.state_dict()}
    ours, theirs = _ours_and_torchs(state, tmp_path, as_directory)

    def described(loaded):
        leaves = ({k: v for k, v in loaded.items() if k != "model"}
                  | {f"model.{k}": v for k, v in loaded["model"].items()})
        return {k: (type(t).__name__, t.requires_grad, t.is_leaf) for k, t in leaves.items()}, \
            loaded["w"] is loaded["w_again"], loaded["w_data"].data_ptr() == loaded["w"].data_ptr()

    assert described(ours) == described(theirs)
    if not as_directory:  # torch.load's arguments, as callers pass them
        again = load(tmp_path / "s.safetensors", map_location="cpu", weights_only=True, mmap=True)
        assert described(again) == described(theirs)
    assert described(ours)[0]["w"] == ("Parameter", True, True) and described(ours)[0]["b"][:2] == ("Parameter", False)
    optimizer = torch.optim.SGD([ours["prompt"]], lr=1.0)
    ours["prompt"].sum().backward()
    optimizer.step()
    assert torch.equal(ours["prompt"].detach(), prompt.detach() - 1)


class Renamed(torch.nn.Module):
    """A module whose version 2 renamed its parameter ``w`` to ``weight``: it migrates
    state saved by version 1 as torch's own modules do (BatchNorm's num_batches_tracked),
    by the version ``load_state_dict`` finds in the state dict's ``_metadata``."""
    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(3.0))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args) -> None:
        if local_metadata.get("version", 1) < 2:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def _described(value: Any) -> Any:
    """The types, order and values of a loaded object, each state dict's ``_metadata`` included."""
    if isinstance(value, dict):
        metadata = _described(getattr(value, "_metadata", None))
        return type(value), [(k, _described(v)) for k, v in value.items()], metadata
    if isinstance(value, (list, tuple)):
        return type(value), [_described(v) for v in value]
    if isinstance(value, torch.Tensor):
        return type(value), value.dtype, value.tolist()
    return type(value), value


@pytest.mark.parametrize("as_directory", [False, True], ids=["file", "checkpoint"])
def test_state_dicts_and_sizes_come_back_as_torch_load_gives_them(tmp_path, as_directory: bool) -> None:
    """A state dict came back a plain dict without its ``_metadata``, so ``load_state_dict``
    handed every module no version and each migrated its current state as the oldest's;
    a torch.Size came back a tuple."""
    from collections import OrderedDict
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), Renamed())
    model[1](torch.randn(3, 4))  # num_batches_tracked counts
    state = {"model": model.state_dict(), "size": torch.Size([2, 3]), "sizes": [torch.Size([]), (torch.Size([4]),)],
             "nested": [OrderedDict(b=1, a=[OrderedDict(z=torch.ones(2), y=OrderedDict())])], "plain": {"b": 1, "a": 2}}
    ours, theirs = _ours_and_torchs(state, tmp_path, as_directory)
    assert _described(ours) == _described(theirs) == _described(state)
    assert type(ours["model"]) is OrderedDict and list(ours["model"]) == list(state["model"])
    assert ours["model"]._metadata == theirs["model"]._metadata == state["model"]._metadata
    assert ours["model"]._metadata["2"]["version"] == 2 and type(ours["size"]) is torch.Size
    assert type(ours["plain"]) is dict and not hasattr(ours["nested"][0], "_metadata")
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), Renamed())
    fresh.load_state_dict(ours["model"], strict=True)  # Renamed, given version 2, leaves its weight be
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k

    old = OrderedDict((("2.w" if k == "2.weight" else k), v) for k, v in model.state_dict().items())
    old._metadata = OrderedDict((k, {**v, "version": 1}) if k == "2" else (k, v)  # as version 1 saved it
                                for k, v in model.state_dict()._metadata.items())
    save(old, tmp_path / "old.safetensors")
    fresh.load_state_dict(load(tmp_path / "old.safetensors"), strict=True)  # migrated: w is weight now
    assert torch.equal(fresh[2].weight, model[2].weight)


def test_what_a_state_dicts_metadata_cannot_save_is_named(tmp_path) -> None:
    state = torch.nn.Linear(2, 2).state_dict()
    state._metadata[""]["hook"] = object()
    with pytest.raises(TypeError, match=r"model\._metadata\.\.hook: cannot save a object without pickle"):
        save({"model": state}, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


@pytest.mark.parametrize("as_directory", [False, True], ids=["file", "checkpoint"])
def test_odd_entries_torch_save_takes_come_back_or_are_refused_by_name(tmp_path, as_directory: bool) -> None:
    """A tensor under the key "__metadata__" (the safetensors header's own) failed the save,
    naming a temporary shard; a numpy str was refused as a numpy array of dtype <U2; a lazy
    module's uninitialized parameter raised torch's ValueError, naming no entry."""
    state = {"__metadata__": torch.ones(2), "label": np.str_("ab"), "n": np.int64(3)}
    ours, theirs = _ours_and_torchs(state, tmp_path, as_directory, weights_only=False)  # numpy's str is pickled
    assert torch.equal(ours["__metadata__"], theirs["__metadata__"]) and ours["n"] == theirs["n"] == 3
    assert ours["label"] == theirs["label"] == "ab" and type(ours["label"]) is str  # numpy's own str type is lost
    lazy = torch.nn.LazyLinear(3).state_dict()
    with pytest.raises(TypeError, match=r"^model\.weight is an uninitialized parameter or buffer of a lazy module"):
        save({"model": lazy}, tmp_path / "lazy.safetensors")


@pytest.mark.parametrize("node", [{"ordered_dict": [["a", {"value": 1}]]}, {"ordered_dict": {"items": {}}},
                                  {"ordered_dict": {"_metadata": {"value": 1}}},
                                  {"ordered_dict": {"items": [], "_metadata": {"bogus": 1}}},
                                  {"ordered_dict": {"items": [], "extra": 1}},
                                  {"ordered_dict": {"items": [[True, {}]]}},
                                  {"size": 3}, {"size": [2.0]}, {"size": [True]}, {"size": [2 ** 63]}])
def test_a_damaged_ordered_dict_or_size_node_is_refused(tmp_path, node) -> None:
    """Rewritten by a hostile writer (the header sealed anew): refused as damaged, naming the
    file, not a KeyError or TypeError from deep inside the decoder."""
    from tensorferry.shard import ShardReader, ShardWriter
    path = str(tmp_path / "state.safetensors")
    save({"model": torch.nn.Linear(2, 2).state_dict(), "size": torch.Size([1])}, path)
    with ShardReader(path) as reader:
        arrays = reader.read_many()
        structure = json.loads(reader.metadata["tensorferry.structure"])
    structure["dict"][1][1] = node
    with ShardWriter(path, metadata={"tensorferry.structure": json.dumps(structure)}) as writer:
        for name, array in arrays.items():
            writer.add(name, array)
    with pytest.raises(tensorferry.CorruptCheckpointError, match="state.safetensors: .*node"):
        load(path)


def test_tied_weights_are_found_by_storage(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    sd = model.state_dict()
    assert sd["0.weight"] is not sd["1.weight"]  # a new tensor object per entry
    sd["0.view"] = sd["0.weight"][1:]  # same storage, another view: not a tie
    save(sd, tmp_path / "tied.safetensors")
    save_checkpoint(tmp_path / "dir", sd)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "tied.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["0.view", "0.weight"]
    assert sorted(tensorferry.read_manifest(tmp_path / "dir")["tensors"]) == ["0.view", "0.weight"]
    for back in (load(tmp_path / "tied.safetensors"), load_checkpoint(tmp_path / "dir")):
        assert back["0.weight"] is back["1.weight"] and torch.equal(back["0.weight"], sd["0.weight"])
        assert torch.equal(back["0.view"], sd["0.weight"][1:])
    save({"a": torch.zeros(0), "b": torch.zeros(0)}, tmp_path / "empty.safetensors")
    empties = load(tmp_path / "empty.safetensors")
    assert empties["a"] is not empties["b"]


def test_numpy_arrays_in_a_state_dict(tmp_path) -> None:
    rng = np.random.get_state()
    obj = {"rng": rng, "torch_rng": torch.get_rng_state(), "mask": np.array([[True, False]]),
           "half": np.arange(6, dtype=np.float16).reshape(2, 3)[:, ::2], "count": np.int64(7),
           "phases": np.exp(1j * np.arange(4)).astype(np.complex64), "bf16": np.arange(3).astype(ml_dtypes.bfloat16)}
    save(obj, tmp_path / "rng.safetensors")
    save_checkpoint(tmp_path / "rng", obj)
    for back in (load(tmp_path / "rng.safetensors"), load(tmp_path / "rng")):
        assert back["rng"][0] == "MT19937" and isinstance(back["rng"][1], np.ndarray)
        np.testing.assert_array_equal(back["rng"][1], rng[1])
        assert back["rng"][1].dtype == rng[1].dtype and back["rng"][2:] == rng[2:]
        np.random.set_state(back["rng"])
        assert torch.equal(back["torch_rng"], obj["torch_rng"])
        np.testing.assert_array_equal(back["mask"], obj["mask"])
        np.testing.assert_array_equal(back["half"], obj["half"])
        assert back["half"].dtype == np.float16 and back["count"] == 7 and isinstance(back["count"], np.int64)
        for name in ("phases", "bf16"):
            assert back[name].dtype == obj[name].dtype and back[name].tobytes() == obj[name].tobytes()
    with pytest.raises(TypeError, match="without pickle"):
        save({"s": np.array(["a"])}, tmp_path / "str.safetensors")
    with pytest.raises(TypeError, match="z: dtype complex128 has no safetensors equivalent"):
        save({"z": np.zeros(2, np.complex128)}, tmp_path / "c128.safetensors")
    assert not (tmp_path / "str.safetensors").exists() and not (tmp_path / "c128.safetensors").exists()


def test_loading_a_directory_neither_warns_nor_hides_a_later_warning(tmp_path) -> None:
    import warnings
    (tmp_path / "plain").mkdir()
    tensorferry.engine._warned_filesystems.discard(os.stat(tmp_path).st_dev)  # another test may have warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointNotFoundError):
            load(tmp_path / "plain")
        with pytest.raises(IsADirectoryError):
            tensorferry.open(tmp_path / "plain")
    assert os.stat(tmp_path).st_dev not in tensorferry.engine._warned_filesystems


# --- DCPWriter / DCPReader, one process ------------------------------------------------


@requires_cuda
def test_cuda_tensors_are_staged_through_pinned_memory(tmp_path) -> None:
    from tensorferry.adapters.pytorch.tensors import host_bytes

    state = {"w": torch.randn(1 << 20, device="cuda"), "h": torch.randn(3, 5, device="cuda").to(torch.bfloat16)}
    staged = host_bytes(state["w"])
    assert staged.ctypes.data % 4096 == 0, "pinned staging memory is page-aligned: no bounce copy"
    save(state, tmp_path / "s.safetensors")
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "d"))
    loaded = load(tmp_path / "s.safetensors", map_location="cuda")
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(into, storage_reader=DCPReader(tmp_path / "d"))
    for k, v in state.items():
        assert torch.equal(loaded[k], v) and torch.equal(into[k], v)


@requires_cuda
def test_cuda_state_through_streams(tmp_path) -> None:
    """CUDA tensors saved into a file object (``io.BytesIO``, gzip, an open file) and loaded from one,
    to the GPU in every form of ``map_location`` and to the host: the stream path
    (:class:`~tensorferry.StreamReader`), not the file path of the test above."""
    import gzip
    import io

    state = {"w": torch.randn(1 << 20, device="cuda"), "h": torch.randn(3, 5, device="cuda").to(torch.bfloat16),
             "t": torch.arange(12, device="cuda").reshape(3, 4).t(), "step": 7}  # t: not contiguous
    buffer = io.BytesIO()
    save(state, buffer)
    with gzip.open(tmp_path / "s.gz", "wb") as packed:
        save(state, packed)
    with open(tmp_path / "opened", "wb") as opened:  # written as the file, by the engine
        save(state, opened)
    assert (tmp_path / "opened").read_bytes() == buffer.getvalue()
    for where in ("cuda", "cuda:0", torch.device("cuda"), {"cpu": "cuda:0"}, lambda s, _: s.cuda()):
        for stream in (io.BytesIO(buffer.getvalue()), gzip.open(tmp_path / "s.gz", "rb")):
            loaded = load(stream, map_location=where)
            assert loaded["step"] == 7
            for k in ("w", "h", "t"):
                assert loaded[k].device.type == "cuda" and torch.equal(loaded[k], state[k]), (k, where)
    on_host = load(io.BytesIO(buffer.getvalue()))
    assert all(on_host[k].device.type == "cpu" and torch.equal(on_host[k], state[k].cpu()) for k in ("w", "h", "t"))


@pytest.mark.slow
def test_a_tensor_past_2_gib_on_every_path(tmp_path) -> None:
    """A tensor of more than 2**31 bytes (an LLM's embedding in bf16 is about that), and a
    tensor stored after it at a file offset past 2**31: where a 32-bit length or offset
    in the native engine, the checksums or the layout code would wrap or a read would
    stop at Linux's 2 GiB per call, some path here gets wrong bytes or a short read."""
    psutil = pytest.importorskip("psutil")
    if psutil.virtual_memory().available < 8 << 30:
        pytest.skip("needs 8 GiB of free memory (a 2 GiB tensor and its copies)")
    big = torch.zeros((1 << 31) + 4096 + 3, dtype=torch.uint8)  # untouched pages cost no memory
    marks = [0, 4095, (1 << 31) - 1, 1 << 31, (1 << 31) + 4097, big.numel() - 1]
    big[marks] = torch.arange(1, len(marks) + 1, dtype=torch.uint8)
    # Of the same element size, so laid out after it (write_order: largest element size first).
    state = {"a.embed": big, "b.after": (torch.arange(1000) % 251).to(torch.uint8)}

    def check(loaded: dict, how: str) -> None:
        assert loaded["a.embed"].shape == big.shape, how
        assert loaded["a.embed"][marks].tolist() == big[marks].tolist(), how
        assert int(loaded["a.embed"].count_nonzero()) == len(marks), how
        assert torch.equal(loaded["b.after"], state["b.after"]), how

    save(state, tmp_path / "one.safetensors")
    with tensorferry.ShardReader(tmp_path / "one.safetensors") as reader:
        assert reader.tensors["b.after"].begin > 1 << 31, "the second tensor is stored past 2 GiB"
    check(load(tmp_path / "one.safetensors"), "load")
    check(load(tmp_path / "one.safetensors", mmap=True), "load(mmap=True)")
    save_checkpoint(tmp_path / "ckpt", state)
    check(load_checkpoint(tmp_path / "ckpt"), "load_checkpoint")
    assert tensorferry.verify_checkpoint(tmp_path / "ckpt") == []
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "dcp"))
    into = {name: torch.ones_like(t) for name, t in state.items()}
    dcp.load(into, storage_reader=DCPReader(tmp_path / "dcp"))
    check(into, "DCPReader")
    # The engine alone, one request of more than 2 GiB each way.
    with tensorferry.Engine() as engine:
        engine.pwrite(big, tmp_path / "raw", offset=4096).result()
        back = torch.empty_like(big)
        engine.pread(back, tmp_path / "raw", offset=4096).result()
    check({"a.embed": back, "b.after": state["b.after"]}, "Engine.pread/pwrite")


def test_dcp_round_trip_single_process(tmp_path) -> None:
    state = {"model": {f"t{i}": random_tensor(d, (7, 5), i) for i, d in enumerate(DTYPES)},
             "meta": {"step": 12, "note": "x"}}
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "c"))
    files = sorted(os.listdir(tmp_path / "c"))
    assert ".metadata" in files and "tensorferry.json" in files
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "meta": {"step": 0, "note": ""}}
    dcp.load(target, storage_reader=DCPReader(tmp_path / "c"))
    assert target["meta"] == {"step": 12, "note": "x"}
    for k, v in state["model"].items():
        assert same(v, target["model"][k]), k
    # The shard files are plain safetensors holding the raw bytes.
    manifest = tensorferry.read_manifest(tmp_path / "c")
    assert manifest["tensors"]["model.t1"]["dtype"] == "F32"
    assert tensorferry.verify_checkpoint(tmp_path / "c") == []


def test_lazy_conjugates_and_negations_are_saved_as_their_values(tmp_path) -> None:
    """x.conj() of a complex tensor and x.conj().imag are views with a lazy bit set,
    whose bytes no raw view can take: every way of saving stores their values."""
    c = torch.randn(6, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    # Beside the tensors they view (same memory, shape and strides), they were taken for ties
    # of them and stored once, unconjugated.
    real = torch.randn(6, generator=torch.Generator().manual_seed(1))
    state = {"conj": c.conj(), "neg": c.conj().imag, "plain": c, "imag": c.imag,
             "neg_view": torch._neg_view(real), "bf16_neg_view": torch._neg_view(real.to(torch.bfloat16))}
    assert state["conj"].is_conj() and state["neg"].is_neg() and state["bf16_neg_view"].is_neg()
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    save(state, tmp_path / "s.safetensors")
    save_checkpoint(tmp_path / "ckpt", state)
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "dcp"))
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(target, storage_reader=DCPReader(tmp_path / "dcp"))
    for loaded in (load(tmp_path / "s.safetensors"), load_checkpoint(tmp_path / "ckpt"), target):
        for k, v in expected.items():
            assert torch.equal(loaded[k], v) and not loaded[k].is_conj() and not loaded[k].is_neg(), k
    with pytest.raises(ValueError, match="lazy conjugate"):
        load_checkpoint(tmp_path / "ckpt", out={"conj": torch.zeros(6, dtype=torch.complex64).conj()})


class Progress:
    """A plain object in a state dict, which DCP saves pickled."""

    def __init__(self, samples: int = 0, tensor: torch.Tensor | None = None) -> None:
        self.samples = samples
        self.tensor = tensor


def test_dcp_async_save_snapshots_the_other_values_of_the_state_too(tmp_path) -> None:
    """DCPWriter.stage, through which dcp.async_save snapshots the state, copied the
    tensors only: a numpy array or an object the training changed once async_save had
    returned was saved as the background thread found it, of a later step than the
    tensors. They are deep copies now, as torch's own stager makes them."""
    weights = torch.zeros(1 << 16)
    state = {"w": weights, "seen": np.zeros(4), "progress": Progress(0, weights), "step": 3}
    staged = DCPWriter(tmp_path / "unused").stage(state)
    state["seen"] += 1
    state["progress"].samples = 999
    weights.add_(1)
    assert staged["seen"].tolist() == [0] * 4 and staged["progress"].samples == 0 and staged["step"] == 3
    assert staged["progress"].tensor is staged["w"], "the object's tensor is the staged one, not a copy of its own"
    with pytest.raises(TypeError, match=r"state\['lock'\]: a lock that cannot be copied"):
        DCPWriter(tmp_path / "unused").stage({"w": weights, "lock": threading.Lock()})

    state = {"w": torch.zeros(1 << 16), "seen": np.zeros(4), "progress": Progress()}
    future = dcp.async_save(state, storage_writer=DCPWriter(tmp_path / "c"))
    state["seen"] += 1  # training goes on while the background thread writes
    state["progress"].samples = 999
    state["w"] += 1
    future.result()
    back = {"w": torch.ones(1 << 16), "seen": None, "progress": None}
    dcp.load(back, storage_reader=DCPReader(tmp_path / "c"))
    assert (back["w"] == 0).all() and back["seen"].tolist() == [0] * 4 and back["progress"].samples == 0


@pytest.mark.filterwarnings("ignore:Ignoring pin_memory flag")  # torch, on a machine without CUDA
@pytest.mark.parametrize("pinned", [False, True])
def test_dcp_async_save_with_torchs_own_stager(tmp_path, pinned: bool) -> None:
    """dcp.async_save(..., async_stager=DefaultStager(...)): torch stages the state itself
    (in pinned, shared memory, in the background when asked) and hands DCPWriter the copy."""
    staging = pytest.importorskip("torch.distributed.checkpoint.staging")
    if not hasattr(staging, "DefaultStager"):
        pytest.skip("torch's DefaultStager came after this torch")
    DefaultStager, StagingOptions = staging.DefaultStager, staging.StagingOptions
    state = {"model": {f"t{i}": random_tensor(d, (64, 5), i) for i, d in enumerate(DTYPES)}, "meta": {"step": 3}}
    stager = DefaultStager(StagingOptions(pinned, pinned, pinned, False))
    response = dcp.async_save(state, storage_writer=DCPWriter(tmp_path / "c"), async_stager=stager)
    getattr(response, "upload_completion", response).result()
    stager.close()
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "meta": {"step": 0}}
    dcp.load(target, storage_reader=DCPReader(tmp_path / "c"))
    assert target["meta"] == {"step": 3} and all(same(v, target["model"][k]) for k, v in state["model"].items())
    assert tensorferry.verify_checkpoint(tmp_path / "c") == []


def test_dcp_async_save_in_torchs_checkpoint_process(tmp_path) -> None:
    """dcp.async_save(..., async_checkpointer_type=PROCESS): torch sends the writer to a
    background process of its own (pickled, with the staged state) and saves there; the
    process serves the next saves too, each to its own folder."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        for step in (1, 2):
            state = {"model": {f"t{i}": random_tensor(d, (64, 5), i + step) for i, d in enumerate(DTYPES)},
                     "meta": {"step": step}}
            dcp.async_save(state, storage_writer=DCPWriter(tmp_path / f"step{step}"),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
            target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "meta": {"step": 0}}
            dcp.load(target, storage_reader=DCPReader(tmp_path / f"step{step}"))
            assert target["meta"] == {"step": step}
            assert all(same(v, target["model"][k]) for k, v in state["model"].items())
            assert tensorferry.verify_checkpoint(tmp_path / f"step{step}") == []
    finally:
        # torch keeps its checkpoint process for later saves, and ends it only when its
        # handle is collected: ended here, it would outlive the test as an active child
        # (which other tests' fixtures wait on).
        from torch.distributed.checkpoint import _async_process_executor as executor
        process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
        if process is not None:
            process.__del__()
            assert not process._save_process.is_alive()
        dist.destroy_process_group()


def test_dcp_into_a_directory_made_beforehand(tmp_path) -> None:
    """os.makedirs(path, exist_ok=True) before dcp.save, as code written for torch's
    FileSystemWriter does: DCPWriter saves into the empty directory; a second save there
    is refused before writing, without overwrite=True."""
    state = {"w": torch.arange(6.0), "step": 3}
    os.makedirs(tmp_path / "step3", exist_ok=True)
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "step3"))
    with pytest.raises(CheckpointException, match="exists; pass DCPWriter"):
        dcp.save(state, storage_writer=DCPWriter(tmp_path / "step3"))
    target = {"w": torch.zeros(6), "step": 0}
    dcp.load(target, storage_reader=DCPReader(tmp_path / "step3"))
    assert torch.equal(target["w"], state["w"]) and target["step"] == 3
    assert tensorferry.verify_checkpoint(tmp_path / "step3") == []


def test_dcp_reads_keys_without_a_template(tmp_path) -> None:
    """torch's _load_state_dict_from_keys (what torchtune and torchtitan call to read a
    checkpoint whose structure they do not hold): the whole state, or chosen keys."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    state = {"model": {"w": torch.randn(4, 4), "b": torch.ones(3, dtype=torch.bfloat16)}, "step": 5,
             "opt": {"lr": 0.1}}
    dcp.save(state, checkpoint_id=tmp_path / "torchs")
    if not _load_state_dict_from_keys(checkpoint_id=tmp_path / "torchs"):
        pytest.skip("this torch's _load_state_dict_from_keys reads nothing of its own folders either (2.7)")
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "c"))
    whole = _load_state_dict_from_keys(storage_reader=DCPReader(tmp_path / "c"))
    assert whole["step"] == 5 and whole["opt"] == {"lr": 0.1}
    assert same(whole["model"]["w"], state["model"]["w"]) and same(whole["model"]["b"], state["model"]["b"])
    chosen = _load_state_dict_from_keys(keys={"model.w", "step"}, storage_reader=DCPReader(tmp_path / "c"))
    assert set(chosen) == {"model", "step"} and set(chosen["model"]) == {"w"}
    assert same(chosen["model"]["w"], state["model"]["w"])


def test_dcp_reader_reads_folders_of_torchs_own_writer(tmp_path) -> None:
    """Checkpoints from before a switch to tensorferry: DCPReader hands a folder of
    torch's FileSystemWriter to torch's FileSystemReader, tensors and objects alike."""
    state = {"model": {f"t{i}": random_tensor(d, (7, 5), i) for i, d in enumerate(DTYPES)},
             "meta": {"step": 12, "note": "before"}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "torchs")))
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "meta": {"step": 0, "note": ""}}
    dcp.load(target, storage_reader=DCPReader(tmp_path / "torchs"))
    assert target["meta"] == {"step": 12, "note": "before"}
    assert all(same(v, target["model"][k]) for k, v in state["model"].items())
    partial = {"model": {"t1": torch.zeros(7, 5)}}  # a subset, as a model without its optimizer asks
    dcp.load(partial, storage_reader=DCPReader(tmp_path / "torchs"),
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert same(partial["model"]["t1"], state["model"]["t1"])


def test_dcp_files_written_in_parallel_past_the_staging_window(tmp_path, monkeypatch) -> None:
    # A rank's files write in parallel, taking their tensors from one stager; past its window
    # one file takes a tensor the window has not reached yet. That once made the window make
    # it a second time and fail ('NoneType' has no 'detach'): 1 GiB saves with 4 files.
    from tensorferry.adapters.pytorch import dcp as dcp_adapter, staging

    monkeypatch.setattr(dcp_adapter, "DeviceToHost", functools.partial(staging.DeviceToHost, window=3 << 20))
    state = {f"t{i:02d}": torch.full((1 << 18,), i, dtype=torch.int32) for i in range(32)}  # 1 MiB each
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "c", files_per_rank=4))
    back = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=DCPReader(tmp_path / "c"))
    assert all(torch.equal(back[k], state[k]) for k in state)


def _forget_torchs_cached_plans() -> None:
    """Empties the process-wide caches of torch's save planners (keyed by the planner's
    class name), all five together as torch fills them, so that a test's saves fill them
    afresh and no earlier test's plans stand in for its own."""
    from torch.distributed.checkpoint.planner import SavePlanner
    if not hasattr(SavePlanner, "_cached_metadata"):
        pytest.skip("this torch keeps its cached plans otherwise (before 2.8)")
    for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                  SavePlanner._cached_metadata, SavePlanner._cached_final_save_plan):
        cache.clear()


def _saves_with_cached_plans(root: str, state: dict[str, torch.Tensor], full: Callable[[dict], dict]) -> None:
    """Three dcp.saves of the state, changed in place between them, with torch's planner
    caching its plans (the second and third reuse the first's); each loads back as saved."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner
    _forget_torchs_cached_plans()
    saved = []
    for step in range(3):
        dcp.save(state, storage_writer=DCPWriter(os.path.join(root, f"step_{step}")),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        saved.append(full(state))
        for v in state.values():
            v.add_(1)
    assert SavePlanner._cached_final_save_plan, "torch cached the plans"
    for step, expected in enumerate(saved):
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(back, storage_reader=DCPReader(os.path.join(root, f"step_{step}")))
        for k, v in full(back).items():
            assert torch.equal(v, expected[k]), (step, k)


def test_dcp_saves_with_torch_caching_its_plans(tmp_path) -> None:
    # A token in the plan named the first save's directory in every later one (ENOENT).
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64)}
    _saves_with_cached_plans(str(tmp_path), state, lambda s: {k: v.clone() for k, v in s.items()})
    assert sorted(os.listdir(tmp_path)) == ["step_0", "step_1", "step_2"]


def test_dcp_save_while_another_to_the_same_path_runs_is_refused(tmp_path) -> None:
    from tensorferry.adapters.pytorch.dcp import SAVE_TOKEN
    running = tensorferry.PendingCheckpoint.begin(tmp_path / "c", SAVE_TOKEN)  # holds its directory's lock
    with pytest.raises(CheckpointException, match="another save to .* is running"):
        dcp.save({"x": torch.ones(3)}, storage_writer=DCPWriter(tmp_path / "c"))
    running.abort()
    dcp.save({"x": torch.ones(3)}, storage_writer=DCPWriter(tmp_path / "c"))
    assert os.listdir(tmp_path) == ["c"]


def test_dcp_save_while_another_threads_save_to_the_same_path_writes_is_refused(tmp_path) -> None:
    """An earlier save's temporary is freed for a new one only where that save has ended:
    one still writing on another thread keeps it, and commits."""
    import threading
    entered, go_on = threading.Event(), threading.Event()

    class Held(DCPWriter):
        def write_data(self, plan, planner):
            entered.set()
            go_on.wait(60)
            return super().write_data(plan, planner)

    first = threading.Thread(target=dcp.save, args=({"x": torch.ones(3)},),
                             kwargs={"storage_writer": Held(tmp_path / "c")})
    first.start()
    assert entered.wait(60)
    with pytest.raises(CheckpointException, match="another save to .* is running"):
        dcp.save({"x": torch.zeros(3)}, storage_writer=DCPWriter(tmp_path / "c"))
    go_on.set()
    first.join(60)
    back = {"x": torch.zeros(3)}
    dcp.load(back, storage_reader=DCPReader(tmp_path / "c"))
    assert torch.equal(back["x"], torch.ones(3)) and os.listdir(tmp_path) == ["c"]


def dcp_loaded(path: Path) -> torch.Tensor:
    back = {"w": torch.zeros(4)}
    dcp.load(back, storage_reader=DCPReader(path))
    return back["w"]


def test_dcp_a_writer_in_a_save_refuses_another_save_beside_it(tmp_path) -> None:
    """One DCPWriter in two saves at once (dcp.async_save twice, no wait between): the second's
    reset() or planning took the first's state (its pending checkpoint aborted, its path moved),
    and the first committed the other's temporary with its own manifest: a save reported success
    while its checkpoint was missing or corrupt, and with overwrite=True a good checkpoint was
    replaced by it. While the writer writes a save, another is refused before it touches
    anything of that save, which commits; the writer saves again once it has."""
    good = tmp_path / "good"
    dcp.save({"w": torch.zeros(4)}, storage_writer=DCPWriter(good))
    planner = HeldSavePlanner(while_writing=True)
    writer = DCPWriter(overwrite=True)
    first = dcp.async_save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "one", storage_writer=writer,
                           planner=planner)
    refused = rf"this DCPWriter is in a save to {tmp_path}/one \(on thread .*\) now; .*make a DCPWriter for each save"
    try:
        assert planner.holding.wait(120)
        for checkpoint_id in (tmp_path / "two", good, None):  # None: the writer's own path
            second = dcp.async_save({"w": torch.full((4,), 2.0)}, checkpoint_id=checkpoint_id, storage_writer=writer)
            with pytest.raises((RuntimeError, CheckpointException), match=refused):
                second.result(120)
        with pytest.raises(CheckpointException, match=refused):  # a plain save, on this thread
            dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=writer)
    finally:
        planner.go_on.set()
    first.result(120)
    assert torch.equal(dcp_loaded(tmp_path / "one"), torch.ones(4))
    assert torch.equal(dcp_loaded(good), torch.zeros(4)) and not (tmp_path / "two").exists()
    dcp.async_save({"w": torch.full((4,), 2.0)}, checkpoint_id=tmp_path / "two", storage_writer=writer).result(120)
    dcp.save({"w": torch.full((4,), 3.0)}, checkpoint_id=good, storage_writer=writer)
    assert torch.equal(dcp_loaded(tmp_path / "two"), torch.full((4,), 2.0))
    assert torch.equal(dcp_loaded(good), torch.full((4,), 3.0))
    assert sorted(os.listdir(tmp_path)) == ["good", "one", "two"]


def test_dcp_a_save_between_its_writers_steps_is_overtaken_and_fails_before_touching_anything(tmp_path) -> None:
    """torch tells a DCPWriter nothing of a save that failed outside the writer's steps (on
    another rank, in the planner), whose thread may run on (the caller's, for dcp.save): a
    save between the writer's steps may have ended, and a new save takes the writer. The
    earlier one, still running here, fails at its next step: neither commits the other's files."""
    planner = HeldSavePlanner()  # between the writer's planning and its write_data
    writer = DCPWriter()
    first = dcp.async_save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "one", storage_writer=writer,
                           planner=planner)
    try:
        assert planner.holding.wait(120)
        dcp.save({"w": torch.full((4,), 2.0)}, checkpoint_id=tmp_path / "two", storage_writer=writer)
    finally:
        planner.go_on.set()
    with pytest.raises(CheckpointException, match="this save through a DCPWriter .* was overtaken"):
        first.result(120)
    assert torch.equal(dcp_loaded(tmp_path / "two"), torch.full((4,), 2.0))
    assert os.listdir(tmp_path) == ["two"]


def test_dcp_retry_of_a_path_leaves_the_writers_later_save_to_another_path_alone(tmp_path) -> None:
    """A writer whose save to A failed after planning, reused for a save to B on another
    thread: a retry of A by a new writer freed the temporary of the writer's save to B,
    still writing, which then failed."""
    import threading
    from torch.distributed.checkpoint import DefaultSavePlanner
    entered, go_on = threading.Event(), threading.Event()

    class FailsAfterPlanning(DefaultSavePlanner):  # as a failure on another rank leaves the coordinator
        def finish_plan(self, plan):
            raise RuntimeError("failed on another rank")

    class Held(DCPWriter):
        def write_data(self, plan, planner):
            entered.set()
            go_on.wait(60)
            return super().write_data(plan, planner)

    state = {"w": torch.arange(16.0)}
    writer = Held(tmp_path / "A")
    with pytest.raises(CheckpointException):
        dcp.save(state, storage_writer=writer, planner=FailsAfterPlanning())
    entered.clear()
    to_b = threading.Thread(target=dcp.save, args=(state,), kwargs={"storage_writer": writer,
                                                                    "checkpoint_id": tmp_path / "B"})
    to_b.start()
    assert entered.wait(60)
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "A"))  # the retry of A
    go_on.set()
    to_b.join(60)
    assert sorted(os.listdir(tmp_path)) == ["A", "B"]


def test_dcp_saves_again_to_a_path_whose_replaced_checkpoint_is_still_being_freed(tmp_path,
                                                                                 discards_held_up) -> None:
    """Every DCPWriter save writes <path>.tmp-dcp, where an overwrite left the checkpoint
    it replaced while its files were freed in the background: the next save to the path
    (a "latest" saved each time, FSDPCheckpointer saving a step again) failed, "another
    save is running", half the time for a few MB."""
    path = tmp_path / "latest"
    for value in range(3):
        dcp.save({"w": torch.full((1000,), float(value))}, storage_writer=DCPWriter(path, overwrite=True))
        dcp.async_save({"w": torch.full((1000,), value + 0.5)}, storage_writer=DCPWriter(path, overwrite=True)).result()
        back = {"w": torch.zeros(1000)}
        dcp.load(back, storage_reader=DCPReader(path))
        assert (back["w"] == value + 0.5).all()
    ckpt = FSDPCheckpointer(tmp_path / "run", small_model())
    for _ in range(2):  # the same step saved again, as after a rollback
        ckpt.save(7)
        assert ckpt.save_async(7).result().endswith("step_7")
    discards_held_up()
    from tensorferry.temporaries import wait_for_discards
    wait_for_discards()
    assert sorted(os.listdir(tmp_path)) == ["latest", "run"] and os.listdir(tmp_path / "run") == ["step_7"]


def test_dcp_partial_load_reads_only_what_the_state_asks_for(tmp_path) -> None:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    dcp.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}, "step": 3},
             storage_writer=DCPWriter(tmp_path / "c"))
    part = {"model": {"w": torch.zeros(3, 4), "added_since": torch.zeros(2)}}
    dcp.load(part, storage_reader=DCPReader(tmp_path / "c"), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(part["model"]["w"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(part["model"]["added_since"], torch.zeros(2))
    with pytest.raises(CheckpointException, match="added_since"):  # and without it, torch's error
        dcp.load(part, storage_reader=DCPReader(tmp_path / "c"))


@pytest.mark.parametrize("read_ahead", [0, "64K", None])
def test_dcp_load_reads_ahead_while_torch_plans(tmp_path, monkeypatch, read_ahead) -> None:
    """The shard files are read ahead from when the reader is set up until read_data knows
    where their bytes go. What was read ahead (all of it, part, nothing) lands where the
    plan puts it, for whole, cast and partial loads alike; nothing stays open or leased."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from tensorferry.shard import _pool, _ReadAhead
    monkeypatch.setattr(_ReadAhead, "PIECE", 16 << 10)  # tensors across the ends of pieces
    state = {"model": {f"t{i}": random_tensor(torch.float32, (64, 33 + i), i) for i in range(12)},
             "half": random_tensor(torch.bfloat16, (300,), 99), "meta": {"step": 4}}
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "c"))
    leases = len(_pool._leased)
    looked_at = DCPReader(tmp_path / "c", read_ahead=read_ahead)
    assert "model.t0" in looked_at.read_metadata().state_dict_metadata
    assert looked_at._opened == {}  # only looked at: nothing read ahead
    whole = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
             "half": torch.zeros(300), "meta": {"step": 0}}  # "half" cast to float32 on the way
    reader = DCPReader(tmp_path / "c", read_ahead=read_ahead)
    dcp.load(whole, storage_reader=reader)
    assert whole["meta"] == {"step": 4} and same(whole["half"], state["half"].float())
    assert all(same(whole["model"][k], v) for k, v in state["model"].items())
    assert reader._opened == {}
    part = {"model": {k: torch.zeros_like(state["model"][k]) for k in ("t3", "t11")}}
    dcp.load(part, storage_reader=DCPReader(tmp_path / "c", read_ahead=read_ahead),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    assert all(same(v, state["model"][k]) for k, v in part["model"].items())
    assert len(_pool._leased) == leases


def test_dcp_read_ahead_of_a_load_whose_planning_failed(tmp_path) -> None:
    """torch calls no method of the reader after a failed planning (a key the checkpoint
    lacks): what it read ahead goes with the reader, or with its next load, which reads
    the folder as it is now (rewritten meanwhile), not what the failed one read."""
    from tensorferry.shard import _pool
    leases = len(_pool._leased)
    dcp.save({"w": torch.ones(1000)}, storage_writer=DCPWriter(tmp_path / "c"))
    reader = DCPReader(tmp_path / "c")
    with pytest.raises(CheckpointException, match="missing"):
        dcp.load({"w": torch.zeros(1000), "missing": torch.zeros(2)}, storage_reader=reader)
    assert reader._opened and len(_pool._leased) > leases
    dcp.save({"w": torch.full((1000,), 2.0)}, storage_writer=DCPWriter(tmp_path / "c", overwrite=True))
    again = {"w": torch.zeros(1000)}
    dcp.load(again, storage_reader=reader)
    assert torch.equal(again["w"], torch.full((1000,), 2.0))
    with pytest.raises(CheckpointException, match="missing"):
        dcp.load({"w": torch.zeros(1000), "missing": torch.zeros(2)}, storage_reader=reader)
    del reader
    gc.collect()
    assert len(_pool._leased) == leases


def test_dcp_partial_load_needs_only_the_files_it_reads(tmp_path) -> None:
    """A shard file the plan does not need may be missing (or damaged): read ahead or not."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(8)}
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "c", files_per_rank=4))
    holder = tensorferry.read_manifest(tmp_path / "c")["metadata"]["dcp_items"]["tensors"]["t0"]["chunks"][0][0]
    others = sorted(f for f in os.listdir(tmp_path / "c") if f.endswith(".safetensors") and f != holder)
    os.unlink(tmp_path / "c" / others[0])
    for read_ahead in (0, None):
        part = {"t0": torch.zeros(1000)}
        dcp.load(part, storage_reader=DCPReader(tmp_path / "c", read_ahead=read_ahead),
                 planner=DefaultLoadPlanner(allow_partial_load=True))
        assert torch.equal(part["t0"], state["t0"])


def test_dcp_loads_a_step_an_interrupted_overwrite_left_aside(tmp_path) -> None:
    """Without an atomic exchange, an overwrite killed between its two renames leaves
    step_1 as step_1.tmp-old-<token>: still the checkpoint, as load_checkpoint and
    latest_step find it. DCPReader and FSDPCheckpointer.load failed there, naming it a
    checkpoint without DCP metadata."""
    from tensorferry.checkpoint import OLD_TAIL
    from tensorferry.temporaries import temporary_name
    model = torch.nn.Linear(4, 4)
    FSDPCheckpointer(tmp_path, model).save(1)
    os.rename(tmp_path / "step_1", temporary_name(str(tmp_path / "step_1"), OLD_TAIL + "0123abcd"))
    other = torch.nn.Linear(4, 4)
    checkpointer = FSDPCheckpointer(tmp_path, other)
    assert checkpointer.latest_step() == 1 and checkpointer.load() == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(target, storage_reader=DCPReader(tmp_path / "step_1"))
    assert all(torch.equal(target["model"][k], v) for k, v in model.state_dict().items())


def test_dcp_refuses_to_overwrite(tmp_path) -> None:
    dcp.save({"x": torch.ones(3)}, storage_writer=DCPWriter(tmp_path / "c"))
    with pytest.raises(CheckpointException, match="exists"):
        dcp.save({"x": torch.zeros(3)}, storage_writer=DCPWriter(tmp_path / "c"))
    dcp.save({"x": torch.zeros(3)}, storage_writer=DCPWriter(tmp_path / "c", overwrite=True))
    x = {"x": torch.ones(3)}
    dcp.load(x, storage_reader=DCPReader(tmp_path / "c"))
    assert x["x"].sum() == 0


def test_dcp_refuses_dtypes_without_a_safetensors_name_before_writing(tmp_path) -> None:
    for dtype in (torch.complex128, torch.complex32):
        with pytest.raises(CheckpointException, match=rf"model\.w: torch dtype {dtype} has no safetensors"):
            dcp.save({"model": {"b": torch.ones(3), "w": torch.zeros(2, dtype=dtype)}},
                     storage_writer=DCPWriter(tmp_path / "c"))
        assert os.listdir(tmp_path) == [], "nothing written, not even the temporary"


def test_dcp_refuses_a_tensor_subclass_that_wraps_others(tmp_path) -> None:
    """torchao's kind of tensor holds no bytes of its own: the save fails naming it, and
    leaves nothing behind. It failed in numpy() deep in the writer, naming neither."""
    with pytest.raises(CheckpointException, match=r"model\.w is a Wrapping, a tensor subclass that wraps"):
        dcp.save({"model": {"b": torch.ones(3), "w": Wrapping(torch.ones(2, 2))}},
                 storage_writer=DCPWriter(tmp_path / "c"))
    assert os.listdir(tmp_path) == []


def test_dcp_load_errors(tmp_path) -> None:
    state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "c", files_per_rank=2))
    (tmp_path / "incomplete").mkdir()
    # DCP wraps storage errors in its CheckpointException; the message is ours.
    with pytest.raises(CheckpointException, match="not a complete checkpoint"):
        dcp.load({"w": torch.zeros(64, 64)}, storage_reader=DCPReader(tmp_path / "incomplete"))
    with pytest.raises(CheckpointException, match="[Ss]ize|shape"):
        dcp.load({"w": torch.zeros(32, 64)}, storage_reader=DCPReader(tmp_path / "c"))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")))
    stock = {"w": torch.zeros(64, 64)}  # torch's own folder: read, through torch's reader
    dcp.load(stock, storage_reader=DCPReader(tmp_path / "stock"))
    assert torch.equal(stock["w"], state["w"])
    shards = sorted((tmp_path / "c").glob("*.safetensors"))
    raw = bytearray(shards[0].read_bytes())
    raw[-3] ^= 0xFF
    shards[0].write_bytes(bytes(raw))
    with pytest.raises(CheckpointException, match="checksum"):
        dcp.load({"w": torch.zeros(64, 64), "b": torch.zeros(64)}, storage_reader=DCPReader(tmp_path / "c"))
    shards[1].unlink()
    with pytest.raises(CheckpointException, match="missing"):
        dcp.load({"w": torch.zeros(64, 64), "b": torch.zeros(64)}, storage_reader=DCPReader(tmp_path / "c"))


def test_dcp_saves_an_entry_named_like_the_safetensors_header(tmp_path) -> None:
    """A state-dict key "__metadata__", which torch's FileSystemWriter saves: DCPWriter
    failed in write_data, after planning, as the safetensors header's own name."""
    state = {"__metadata__": torch.arange(2.0), "w": torch.ones(3), "m": {"__metadata__": torch.full((2,), 5.0)}}
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "c"))
    dest = {"__metadata__": torch.zeros(2), "w": torch.zeros(3), "m": {"__metadata__": torch.zeros(2)}}
    dcp.load(dest, storage_reader=DCPReader(tmp_path / "c"))
    assert torch.equal(dest["__metadata__"], state["__metadata__"])
    assert torch.equal(dest["m"]["__metadata__"], state["m"]["__metadata__"])
    whole = load_checkpoint(tmp_path / "c")
    assert set(whole) == {"__metadata__", "w", "m.__metadata__"}
    assert torch.equal(whole["__metadata__"], torch.arange(2.0))


def test_save_to_a_raw_stream_that_takes_a_few_bytes_a_call(tmp_path) -> None:
    """A raw stream (io.RawIOBase) may take part of a write and say how much: save
    ignored what write() returned, and the file came out short, without an error."""
    import io

    class Trickle(io.RawIOBase):
        def __init__(self) -> None:
            self.taken = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            part = bytes(memoryview(data).cast("B")[:7])
            self.taken += part
            return len(part)

    state = {"w": torch.randn(50, 3), "step": 4}
    stream = Trickle()
    save(state, stream)
    back = load(io.BytesIO(bytes(stream.taken)))
    assert torch.equal(back["w"], state["w"]) and back["step"] == 4


def test_a_non_blocking_stream_that_would_block_is_refused_not_taken_as_written_or_ended() -> None:
    """A raw stream's write() returns None where it is non-blocking and can take nothing now
    (io.RawIOBase; a socket's makefile("wb", buffering=0)): save took None for "all
    written", returned, and most of the file never went out. Its readinto() returns None
    where no bytes are there yet: load took None for the end and called the file truncated.
    Both raise EAGAIN naming the stream, as a buffered stream over one does; a file-like
    outside io whose write() returns None, having taken it all, is written as ever."""
    import io
    import socket

    state = {"w": torch.randn(1024, 1024)}  # 4 MiB: more than a socket's buffers take with nobody reading
    sending, receiving = socket.socketpair()
    sending.setblocking(False)
    with sending, receiving, sending.makefile("wb", buffering=0) as raw:
        with pytest.raises(tensorferry.TensorferryIOError, match="writing to the stream would block") as caught:
            save(state, raw)
        assert caught.value.errno == errno.EAGAIN and caught.value.filename == "<SocketIO>"
        buffered = sending.makefile("wb")  # raises BlockingIOError once its buffer is full too
        with pytest.raises(tensorferry.TensorferryIOError, match="writing to the stream would block") as caught:
            save(state, buffered)
        assert caught.value.errno == errno.EAGAIN and caught.value.filename == "<BufferedWriter>"
        with pytest.raises(BlockingIOError):  # what it holds cannot go out either; it closes all the same
            buffered.close()
    saved = io.BytesIO()
    save(state, saved)
    sending, receiving = socket.socketpair()
    receiving.setblocking(False)
    with sending, receiving:
        sending.sendall(saved.getvalue()[:1000])  # the rest is yet to come
        for buffering in (0, -1):
            with receiving.makefile("rb", buffering=buffering) as incoming:
                with pytest.raises(tensorferry.TensorferryIOError, match="reading the stream would block") as caught:
                    load(incoming)
            assert caught.value.errno == errno.EAGAIN

    class Sink:
        """Writes as many file-likes written before io did: all of it, returning None."""

        def __init__(self) -> None:
            self.parts: list[bytes] = []

        def write(self, data) -> None:
            self.parts.append(bytes(memoryview(data).cast("B")))

    sink = Sink()
    save(state, sink)
    assert b"".join(sink.parts) == saved.getvalue()


def test_objects_saved_one_after_another_into_a_file_load_one_after_another(tmp_path) -> None:
    """Two objects saved into one file, one after the other, loaded back from the same bytes
    in an io.BytesIO one after the other, but not from open(path, "rb"): the first load,
    which reads a file at its start as the file, left it at its end, and the second found
    "0 bytes is too short for a safetensors header". A load leaves a file just past the
    object it read, as it leaves any stream; a save, just past what it wrote."""
    import io

    first, second = {"w": torch.randn(300, 70), "step": 1}, {"b": torch.arange(5), "name": "second"}
    expected = io.BytesIO()
    save(first, expected)
    first_size = expected.tell()
    save(second, expected)
    path = tmp_path / "two.safetensors"
    with open(path, "wb") as f:
        save(first, f)  # an empty file: written by the engine as the file
        assert f.tell() == first_size
        save(second, f)  # one holding bytes: written the stream's way, after them
        assert f.tell() == len(expected.getvalue())
        f.write(b"trailer")
    assert path.read_bytes() == expected.getvalue() + b"trailer"
    for mmap in (False, True):
        with open(path, "rb") as f:
            back = load(f, mmap=mmap)
            assert torch.equal(back["w"], first["w"]) and back["step"] == 1 and f.tell() == first_size
            back = load(f, mmap=mmap)
            assert torch.equal(back["b"], second["b"]) and back["name"] == "second" and f.read() == b"trailer"


def test_errors_of_the_callers_own_stream_name_it(tmp_path) -> None:
    """An OSError that the caller's stream raised (a full disk or a refused upload behind
    it, a dropped connection) came through alone, naming nothing: "[Errno 28] No space left
    on device". It is a TensorferryIOError naming the stream, with its errno (EIO where it
    had none) and the stream's own error as __cause__."""
    import io

    class Upload(io.RawIOBase):
        name = "/mnt/bucket/model.safetensors"

        def __init__(self, error: OSError) -> None:
            self.error = error

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            raise self.error

    class Download(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            raise OSError(errno.ECONNRESET, "Connection reset by peer")

    state = {"w": torch.ones(3)}
    full = OSError(errno.ENOSPC, "No space left on device")
    named = r"\[Errno 28\] writing to the stream failed: No space left on device: '/mnt/bucket/model.safetensors'"
    with pytest.raises(tensorferry.TensorferryIOError, match=named) as caught:
        save(state, Upload(full))
    assert caught.value.errno == errno.ENOSPC and caught.value.__cause__ is full
    with pytest.raises(tensorferry.TensorferryIOError, match="writing to the stream failed: upload refused") as caught:
        save(state, Upload(OSError("upload refused")))
    assert caught.value.errno == errno.EIO and caught.value.filename == Upload.name
    with pytest.raises(tensorferry.TensorferryIOError, match="reading the stream failed: Connection reset by peer: "
                                                             "'<Download>'") as caught:
        load(Download())
    assert caught.value.errno == errno.ECONNRESET and isinstance(caught.value.__cause__, ConnectionResetError)
    (tmp_path / "read_only").write_bytes(b"")
    with open(tmp_path / "read_only", "rb") as f, pytest.raises(io.UnsupportedOperation, match=str(tmp_path)):
        save(state, f)  # not open for writing: the type a file gives, the file named


def test_a_stream_named_by_a_url_is_written_as_a_stream(tmp_path, small_tmpfs, monkeypatch) -> None:
    """save(state, stream) failed, "'s3://bucket/model.safetensors' is a URL", for a stream
    whose name is a URL (as some stream wrappers name theirs): the name was taken for the
    path of the file to write. A stream is written as a stream; its name only labels errors."""
    import io
    monkeypatch.chdir(tmp_path)  # a URL taken for a path would make a folder "s3:" here
    url = "s3://bucket/model.safetensors"

    class Named(io.BytesIO):
        name = url

    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}
    stream = Named()
    save(state, stream)
    stream.seek(0)
    back = load(stream)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 7
    for opening in ("wb", "ab"):  # an empty file is written as the file, one holding bytes the stream's way
        (tmp_path / "f").write_bytes(b"" if opening == "wb" else b"head")
        with open(tmp_path / "f", opening) as f:
            f.raw.name = url
            save(state, f)
        with open(tmp_path / "f", "rb") as f:
            f.raw.name = url
            f.seek(0 if opening == "wb" else 4)
            back = load(f)
        assert torch.equal(back["w"], state["w"]) and back["step"] == 7, opening
    with open(os.path.join(small_tmpfs, "full"), "wb") as f:
        f.write(b"head")
        f.raw.name = url
        with pytest.raises(tensorferry.TensorferryIOError, match=f"No space left on device: '{url}'") as caught:
            save({"w": torch.zeros(1 << 21)}, f)  # 8 MiB on a 4 MiB disk
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == url
    assert os.listdir(tmp_path) == ["f"]


def test_checkpointer_single_process(tmp_path) -> None:
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = FSDPCheckpointer(tmp_path, model, opt, keep_last=2)
    assert ckpt.latest_step() is None
    with pytest.raises(CheckpointNotFoundError):
        ckpt.load()
    (tmp_path / "step_9").mkdir()  # a save that died before its commit
    with pytest.raises(CheckpointNotFoundError, match="not a complete checkpoint"):
        ckpt.load(9)  # FSDPCheckpointer raises tensorferry's own error, not DCP's wrapper
    assert gc.isenabled()  # paused during the call (torch's many small objects), back on after an error
    (tmp_path / "step_9").rmdir()
    for step in range(1, 5):
        train_step(model, opt, step)
        if step % 2:
            ckpt.save_async(step)
            assert gc.isenabled()  # its writes, in the background, leave the collector to the training
        else:
            ckpt.save(step)  # which first waits for the one before
            assert gc.isenabled()
    ckpt.wait()
    assert gc.isenabled()
    assert [os.path.basename(p) for p in tensorferry.list_checkpoints(tmp_path)] == ["step_3", "step_4"]
    from tensorferry.temporaries import wait_for_discards
    wait_for_discards()  # the pruned ones' files are freed in the background
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_3", "step_4"]
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model, opt, 99)
    assert ckpt.load() == 4
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k])
    path = ckpt.save_consolidated(4)
    from safetensors import safe_open
    from safetensors.torch import load_file
    consolidated = load_file(path)
    assert set(consolidated) == set(expected) and all(torch.equal(consolidated[k], expected[k]) for k in expected)
    with safe_open(path, "pt") as f:  # transformers 4.x refuses a file without it
        assert f.metadata()["format"] == "pt"
    with pytest.raises(ValueError, match="cannot be named 'model' or 'optimizer'"):
        FSDPCheckpointer(tmp_path, model, opt, extra={"optimizer": {}})
    # A step saved by torch's own writer, before the switch to FSDPCheckpointer, loads by its number.
    torch_dir = tmp_path / "torchs"
    dcp.save(ckpt._state(), storage_writer=dcp.FileSystemWriter(str(torch_dir / "step_7")))
    before = FSDPCheckpointer(torch_dir, model, opt)
    assert before.latest_step() is None  # the latest is looked for among tensorferry's checkpoints
    train_step(model, opt, 100)
    assert before.load(7) == 7
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def test_checkpointer_steps_are_its_own_and_in_the_order_saved(tmp_path) -> None:
    """Another checkpoint beside the steps (an export) made latest_step() None and load()
    raise, so a resume started from 0, and keep_last pruned a step to keep it. A step saved
    again (after going back to an earlier one) was refused as existing, and after load(200)
    and save(250) the latest was the abandoned 300."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = FSDPCheckpointer(tmp_path, model, opt, keep_last=2)
    for step in (100, 200):
        train_step(model, opt, step)
        ckpt.save(step)
    save_checkpoint(tmp_path / "hf_export", model.state_dict())
    assert ckpt.latest_step() == 200 and ckpt.load() == 200
    ckpt.save(300)
    from tensorferry.temporaries import wait_for_discards
    wait_for_discards()
    assert sorted(os.listdir(tmp_path)) == ["hf_export", "step_200", "step_300"]
    at_200 = {k: v.clone() for k, v in model.state_dict().items()}
    assert ckpt.load(200) == 200
    train_step(model, opt, 201)
    ckpt.save(250)
    assert ckpt.latest_step() == 250
    train_step(model, opt, 299)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save(300)  # replaces the abandoned step 300
    wait_for_discards()
    assert sorted(os.listdir(tmp_path)) == ["hf_export", "step_250", "step_300"]
    assert ckpt.load() == 300 and all(torch.equal(v, after[k]) for k, v in model.state_dict().items())
    assert not all(torch.equal(after[k], at_200[k]) for k in after)


def test_checkpointer_removes_what_killed_saves_and_prunes_left(tmp_path) -> None:
    """A save or a prune killed midway left step_5.tmp-<token> (a partial checkpoint as
    large as a whole one) or step_1.tmp-pruned-<token>: only a later save to the same
    name removed them, and a training run never saves a step twice."""
    model = small_model()
    ckpt = FSDPCheckpointer(tmp_path, model)
    ckpt.save(1)
    (tmp_path / "step_0.tmp-pruned-0a1b2c3d").mkdir()
    (tmp_path / "step_5.tmp-0a1b2c3d4e5f").mkdir()
    (tmp_path / "step_5.tmp-0a1b2c3d4e5f" / "rank00000-000.safetensors").write_bytes(b"x" * 4096)
    ckpt.save(2)
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]


def test_a_dcpwriter_folder_copied_without_its_metadata_is_refused(tmp_path) -> None:
    """cp dir/* leaves out .metadata: the folder was then read as listed, DCP's pickled
    objects coming back as uint8 tensors of their bytes, with no error."""
    dcp.save({"w": torch.ones(2, 3), "progress": {"tokens": 7, "name": "run"}},
             storage_writer=DCPWriter(tmp_path / "c"))
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in glob.glob(str(tmp_path / "c" / "*")):  # as the shell's * copies: no names starting with a dot
        shutil.copy(f, copy)
    assert not (copy / ".metadata").exists()
    missing = r"\.metadata, which the manifest lists, is missing"
    for load_it in (tensorferry.load_checkpoint, load_checkpoint, lambda p: load_checkpoint(p, map_location="meta")):
        with pytest.raises(tensorferry.CorruptCheckpointError, match=missing):
            load_it(copy)
    shutil.copy(tmp_path / "c" / ".metadata", copy)
    assert load_checkpoint(copy)["w"].shape == (2, 3)


def test_a_checkpoint_folder_that_lost_its_manifest_is_refused_not_read_as_a_hugging_face_folder(tmp_path) -> None:
    """save_checkpoint's folder holds model.safetensors.index.json, for transformers: without
    its manifest it loaded as a Hugging Face folder, with no word of the loss, its state
    flattened (model.weight, optimizer.state.0.exp_avg), what was not a tensor gone."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7}
    save_checkpoint(tmp_path / "step_1", state)
    (tmp_path / "step_1" / "tensorferry.json").unlink()
    missing = r"step_1(/model\.safetensors\.index\.json)?: its tensorferry\.json is missing: shard-00000\.safetensors"
    for load_it in (load_checkpoint, tensorferry.load_checkpoint, load):
        for path in (tmp_path / "step_1", tmp_path / "step_1" / "model.safetensors.index.json"):
            with pytest.raises(tensorferry.CorruptCheckpointError, match=missing):
                load_it(path)
    assert tensorferry.latest_checkpoint(tmp_path) is None


def test_checkpointer_extra_state_with_async_saves(tmp_path) -> None:
    """A GradScaler and a scheduler beside the model, through save_async: restored with it."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # its state is made at the first scale()
    ckpt = FSDPCheckpointer(tmp_path, model, opt, extra={"scheduler": scheduler, "scaler": scaler})
    for step in range(3):
        train_step(model, opt, step)
        scheduler.step()
    scaler.update(512.0)
    ckpt.save_async(3).result()
    saved_lr = opt.param_groups[0]["lr"]
    for step in range(3, 6):
        scheduler.step()
    scaler.update(64.0)
    assert ckpt.load() == 3
    assert scheduler.last_epoch == 3 and opt.param_groups[0]["lr"] == saved_lr and scaler.get_scale() == 512.0


def test_checkpointer_async_save_left_running_at_exit_completes(tmp_path) -> None:
    """A script that ends right after save_async: Python lets torch's checkpoint thread
    finish, but DCPWriter's pool of file writers then refused work ("cannot schedule new
    futures after interpreter shutdown") and the checkpoint was lost without a word.
    keep_last was applied only by the next save or wait(), so never here."""
    script = (
        "import sys, torch\n"
        "from tensorferry.adapters.pytorch import FSDPCheckpointer\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])\n"
        "ckpt = FSDPCheckpointer(sys.argv[1], model, files_per_rank=2, keep_last=1)\n"
        "ckpt.save(4)\n"
        "ckpt.save_async(5)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    torch.manual_seed(0)
    expected = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).state_dict()
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    assert FSDPCheckpointer(tmp_path, model).load() == 5
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert os.listdir(tmp_path) == ["step_5"]  # keep_last applied as the save completed


def test_checkpointer_async_save_failing_with_no_one_waiting_is_reported_at_exit(small_tmpfs) -> None:
    """A background save that failed (a full disk) in a script that ended without wait():
    nothing said so, and the run's last checkpoint was silently missing. It is reported
    at exit, on stderr; a save whose failure was asked for is not reported again."""
    script = (
        "import sys, torch\n"
        "from tensorferry.adapters.pytorch import FSDPCheckpointer\n"
        "ckpt = FSDPCheckpointer(sys.argv[1], torch.nn.Linear(1024, 1024))\n"  # 4 MiB: more than the disk holds
        "future = ckpt.save_async(7)\n"
        "if len(sys.argv) > 2:\n"
        "    try:\n"
        "        future.result()\n"
        "    except BaseException as exc:\n"
        "        print('raised', exc)\n"
    )
    for asked in (False, True):
        result = subprocess.run([sys.executable, "-c", script, small_tmpfs, *(["asked"] if asked else [])],
                                capture_output=True, text=True, timeout=300)
        reported = f"the background save to {small_tmpfs}/step_7 failed and no one waited for it"
        assert result.returncode == 0 and (reported in result.stderr) != asked, result.stderr[-3000:]
        assert "No space left on device" in (result.stdout if asked else result.stderr)
        assert ("raised" in result.stdout) == asked
        assert not os.path.exists(os.path.join(small_tmpfs, "step_7"))


def test_a_failed_async_save_keeps_no_copy_of_the_state(small_tmpfs) -> None:
    """Every failed background save was kept until exit, for the exit report, and with
    its error's traceback the staged copy of the whole state and its writer."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(1 << 20))  # 4 MiB: more than the disk holds
    ckpt = FSDPCheckpointer(small_tmpfs, model)
    ckpt.save_async(1)
    with pytest.raises(tensorferry.TensorferryIOError, match="No space left on device"):
        ckpt.wait()
    gc.collect()
    alive = [o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter) and o.numel() == 1 << 20]
    assert len(alive) == 1, "the model's own parameter, no copy"


def test_a_failed_async_save_handled_through_its_future_is_not_raised_again(small_tmpfs) -> None:
    """A failure the caller had from the future (result(), exception()) was raised again
    by the next save_async, which wait()s first, and that save was never attempted."""
    blob = {"x": torch.zeros(4)}
    ckpt = FSDPCheckpointer(small_tmpfs, torch.nn.Linear(8, 8), extra={"blob": blob})

    def fill_the_disk(fill: bool) -> None:
        blob["x"] = torch.zeros((1 << 20) if fill else 4)  # 4 MiB: more than the disk holds

    fill_the_disk(True)
    with pytest.raises(tensorferry.TensorferryIOError, match="No space left on device"):
        ckpt.save_async(1).result()
    fill_the_disk(False)
    assert ckpt.save_async(2).result().endswith("step_2")
    fill_the_disk(True)
    assert isinstance(ckpt.save_async(3).exception(), tensorferry.TensorferryIOError)
    ckpt.wait()
    fill_the_disk(False)
    ckpt.save(4)
    assert sorted(os.listdir(small_tmpfs)) == ["step_2", "step_4"] and ckpt.latest_step() == 4
    fill_the_disk(True)
    ckpt.save_async(5)  # a failure no one had yet is raised by wait()
    with pytest.raises(tensorferry.TensorferryIOError, match="No space left on device"):
        ckpt.wait()
    ckpt.wait()
    ckpt.save_async(6)  # and a save after it warns of it, and runs
    fill_the_disk(False)
    with pytest.warns(RuntimeWarning, match=r"the background save to .*step_6 failed: TensorferryIOError"):
        ckpt.save(7)
    assert ckpt.latest_step() == 7


class HeldSavePlanner(dcp.DefaultSavePlanner):
    """Holds each save it plans until ``go_on`` is set: a background save surely still runs
    while the test does what it must meanwhile. Held before its writes begin (between
    DCPWriter's steps), or ``while_writing``: inside DCPWriter.write_data."""

    def __init__(self, while_writing: bool = False) -> None:
        super().__init__()
        self.while_writing = while_writing
        self.holding, self.go_on = threading.Event(), threading.Event()

    def _hold(self) -> None:
        self.holding.set()
        assert self.go_on.wait(120), "the test never let the save go on"

    def finish_plan(self, plan):
        if not self.while_writing:
            self._hold()
        return super().finish_plan(plan)

    def resolve_data(self, item):
        if self.while_writing:
            self._hold()
        return super().resolve_data(item)


def test_a_ctrl_c_while_waiting_for_a_background_save_leaves_it_tracked(small_tmpfs) -> None:
    """Ctrl-C in wait(), or in a save_async waiting for the save before it: the checkpointer
    had forgotten the running save before waiting. The next wait() returned at once and the
    save's error (a full disk) was never raised; the next save_async ran beside it (on several
    ranks, both hung). The save stays tracked until it has ended."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(1 << 20))  # 4 MiB: more than the disk holds
    planner = HeldSavePlanner()
    ckpt = FSDPCheckpointer(small_tmpfs, model, save_planner=planner)
    failing = ckpt.save_async(1)
    assert planner.holding.wait(120)
    try:
        with pytest.raises(KeyboardInterrupt), once_blocked_in(FSDPCheckpointer.wait, ctrl_c):
            ckpt.wait()
        with pytest.raises(KeyboardInterrupt), once_blocked_in(FSDPCheckpointer._end_background_save, ctrl_c):
            ckpt.save_async(2)
        assert not failing.done()
    finally:
        planner.go_on.set()
    with pytest.raises(tensorferry.TensorferryIOError, match="No space left on device"):
        ckpt.wait()
    assert ckpt.latest_step() is None


def test_a_warning_made_an_error_in_retention_fails_no_committed_background_save(tmp_path) -> None:
    """Under ``python -W error``, a warning of keep_last's retention after a background save
    had committed (a damaged checkpoint beside it passed over) was raised as that save's error:
    the future failed and wait() raised, though the checkpoint was in place."""
    ckpt = FSDPCheckpointer(tmp_path, torch.nn.Linear(4, 4), keep_last=1)
    ckpt.save(1)
    (tmp_path / "step_1" / "tensorferry.json").write_text("{")  # damaged: passed over with a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", tensorferry.CheckpointSkippedWarning)
        assert ckpt.save_async(2).result(120).endswith("step_2")
        ckpt.wait()
    with pytest.warns(tensorferry.CheckpointSkippedWarning, match="step_1"):
        assert ckpt.latest_step() == 2


def save_failures(ckpt: FSDPCheckpointer, step: int) -> list[Exception]:
    """What ``save(step)`` raised, then ``save_async(step)`` and ``wait()``: an Exception each
    (torch's CheckpointException, a BaseException, fails the test as it passes through)."""
    failures = []
    for save_step in (ckpt.save, lambda step: (ckpt.save_async(step), ckpt.wait())):
        with pytest.raises(Exception) as caught:
            save_step(step)
        failures.append(caught.value)
    return failures


def test_checkpointer_failures_are_exceptions_naming_file_and_errno(small_tmpfs) -> None:
    """save, save_async and load raised torch's CheckpointException: a BaseException, which
    ``except Exception`` let through, with no errno or filename (the file, offset and errno of
    a full disk were only in its text). They raise the error itself, DCP's kept as its cause."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(1 << 20))  # 4 MiB: more than the disk holds
    for failed in save_failures(FSDPCheckpointer(small_tmpfs, model), 1):
        assert isinstance(failed, tensorferry.TensorferryIOError) and failed.errno == errno.ENOSPC, repr(failed)
        assert failed.filename.startswith(os.path.join(small_tmpfs, "step_1.tmp-")), failed.filename
        assert isinstance(failed.__cause__, CheckpointException)
    # An error of another kind (torch's planner missing the optimizer) is told in a TensorferryError.
    FSDPCheckpointer(small_tmpfs, torch.nn.Linear(4, 4)).save(2)
    tuned = torch.nn.Linear(4, 4)
    with pytest.raises(tensorferry.TensorferryError, match=r"step_2: rank 0: RuntimeError: .*optimizer") as caught:
        FSDPCheckpointer(small_tmpfs, tuned, torch.optim.SGD(tuned.parameters(), lr=0.1)).load(2)
    assert isinstance(caught.value.__cause__, CheckpointException)


def test_a_background_save_cannot_be_cancelled_through_its_future(tmp_path, caplog) -> None:
    """cancel() on save_async's future, the save still writing, cancelled the future: the
    save's completion then failed in its callback (InvalidStateError, logged by
    concurrent.futures), wait() raised CancelledError for a save that committed, and the
    next save did not wait for it. A running save cannot be stopped: cancel() is refused."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    writing, go_on = threading.Event(), threading.Event()

    class Held(DefaultSavePlanner):
        def resolve_data(self, item):
            writing.set()
            assert go_on.wait(60)
            return super().resolve_data(item)

    ckpt = FSDPCheckpointer(tmp_path, torch.nn.Linear(4, 4), save_planner=Held())
    future = ckpt.save_async(1)
    try:
        assert writing.wait(60)
        assert future.cancel() is False and not future.cancelled() and future.running() and not future.done()
    finally:
        go_on.set()
    assert future.result(60).endswith("step_1") and not future.cancel()
    ckpt.wait()
    assert not [r for r in caplog.records if r.name == "concurrent.futures"], caplog.text
    assert ckpt.latest_step() == 1


def test_checkpointer_passes_its_planners_to_dcp(tmp_path) -> None:
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _forget_torchs_cached_plans()
    ckpt = FSDPCheckpointer(tmp_path / "run", model, opt, save_planner=DefaultSavePlanner(enable_plan_caching=True))
    saved = {}
    for step in range(1, 4):  # the second and third saves reuse the first's plans
        train_step(model, opt, step)
        ckpt.save_async(step).result() if step == 2 else ckpt.save(step)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert SavePlanner._cached_final_save_plan, "torch cached the plans"
    for step, expected in saved.items():
        assert ckpt.load(step) == step
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items()), step

    # Weights saved without an optimizer: fine-tuning starts from them with a fresh one.
    FSDPCheckpointer(tmp_path / "pretrained", model).save(0)
    tuned = small_model()
    tuned_opt = torch.optim.AdamW(tuned.parameters(), lr=1e-3)
    with pytest.raises(tensorferry.TensorferryError, match="optimizer"):
        FSDPCheckpointer(tmp_path / "pretrained", tuned, tuned_opt).load()
    partial = FSDPCheckpointer(tmp_path / "pretrained", tuned, tuned_opt,
                               load_planner=DefaultLoadPlanner(allow_partial_load=True))
    assert partial.load() == 0
    assert all(torch.equal(v, saved[3][k]) for k, v in tuned.state_dict().items())
    train_step(tuned, tuned_opt, 4)  # the optimizer's state is usable


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int = 0) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


# --- real torch.distributed: gloo, FSDP2 -------------------------------------------------


def fsdp_model(world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = small_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, rendezvous: str, root: str, scenario: str,
            group_timeout: float | None = None) -> None:
    timeout = {} if group_timeout is None else {"timeout": timedelta(seconds=group_timeout)}
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, **timeout)
    try:
        globals()[f"scenario_{scenario}"](rank, world, root)
        dist.barrier()  # no rank tears its group down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    # A passing worker skips interpreter finalization: gloo's threads can still hold work
    # whose tensors reference Python objects, and releasing those while the interpreter
    # shuts down aborts the process now and then ("terminate called without an active
    # exception"; pytorch/pytorch#179291). A failing worker raises above, as before.
    os._exit(0)


def run(world: int, root: str, scenario: str, timeout: float | None = None,
        group_timeout: float | None = None) -> None:
    """Runs ``scenario_<scenario>`` on ``world`` ranks; with ``timeout``, ranks still
    running after that many seconds (hung in a collective) are killed and the test fails.
    ``group_timeout`` is the process group's (torch's default: 30 min), for a collective that
    a rank never joins to fail rather than hang."""
    # A rendezvous file, not a TCP port: a port found free can be taken before it is bound.
    # Its directory goes with the run: the workers leave the file behind (os._exit skips
    # the store's own cleanup).
    with tempfile.TemporaryDirectory(prefix="tensorferry-rdzv-") as directory:
        ranks = mp.spawn(_worker, args=(world, os.path.join(directory, "store"), root, scenario, group_timeout),
                         nprocs=world, join=False)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ranks.join(None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                for process in ranks.processes:
                    process.kill()
                    process.join()
                pytest.fail(f"scenario {scenario!r}: ranks still running after {timeout} s (hung)")


def scenario_resume(rank: int, world: int, root: str) -> None:
    """Train, save, train on (the reference), then load and train again: bit-identical,
    the LR schedule and the loop's own counters (extra state) included."""
    model = fsdp_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    progress = {"samples": torch.zeros((), dtype=torch.int64), "phase": "warmup"}
    ckpt = FSDPCheckpointer(root, model, opt, extra={"scheduler": scheduler, "progress": progress})

    def run_steps(steps: range) -> None:
        for step in steps:
            train_step(model, opt, step, rank)
            scheduler.step()
            progress["samples"] += 16
        progress["phase"] = f"after {steps.stop}"

    run_steps(range(3))
    ckpt.save(3)
    run_steps(range(3, 6))
    reference, reference_lr = full_params(model), opt.param_groups[0]["lr"]
    assert ckpt.load() == 3
    assert scheduler.last_epoch == 3 and opt.param_groups[0]["lr"] == 1e-2 * 0.5
    assert int(progress["samples"]) == 48 and progress["phase"] == "after 3"
    run_steps(range(3, 6))
    resumed = full_params(model)
    for k in reference:
        assert torch.equal(reference[k], resumed[k]), k
    assert opt.param_groups[0]["lr"] == reference_lr
    # The sharded save, gathered one tensor at a time, as one portable file.
    path = ckpt.save_consolidated(6)
    if rank == 0:
        from safetensors.torch import load_file
        consolidated = load_file(path)
        assert all(torch.equal(consolidated[k], resumed[k]) for k in resumed)


def scenario_async(rank: int, world: int, root: str) -> None:
    model = fsdp_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = FSDPCheckpointer(root, model, opt, keep_last=1)
    train_step(model, opt, 0, rank)
    saved = full_params(model)
    future = ckpt.save_async(1)
    for step in range(1, 4):  # training goes on while the checkpoint is written
        train_step(model, opt, step, rank)
    assert future.result().endswith("step_1")
    ckpt.load(1)
    for k, v in full_params(model).items():
        assert torch.equal(v, saved[k]), k


def scenario_save_sharded(rank: int, world: int, root: str) -> None:
    model = fsdp_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 0, rank)
    FSDPCheckpointer(root, model, opt).save(1)
    # The single-file save of a sharded state dict: refused, naming the way that works.
    stray = os.path.join(root, f"rank{rank}.safetensors")
    with pytest.raises(TypeError, match="is a DTensor.*FSDPCheckpointer"):
        save(model.state_dict(), stray)
    from torch.distributed._shard import sharded_tensor  # FSDP1's SHARDED_STATE_DICT holds these
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    legacy = sharded_tensor.zeros(ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)]), 4, 2)
    with pytest.raises(TypeError, match="w is a ShardedTensor.*FSDPCheckpointer"):
        save({"w": legacy}, stray)
    assert not os.path.exists(stray)
    expected = full_params(model)  # a collective: every rank takes part
    if rank == 0:
        torch.save(expected, os.path.join(root, "expected.pt"))


def scenario_load_sharded(rank: int, world: int, root: str) -> None:
    model = fsdp_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert FSDPCheckpointer(root, model, opt).load() == 1
    expected = torch.load(os.path.join(root, "expected.pt"))
    for k, v in full_params(model).items():
        assert torch.equal(v, expected[k]), k


def scenario_hf_distributed(rank: int, world: int, root: str) -> None:
    """torch's HuggingFaceStorageWriter, every rank writing its row shards (for test_hf)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    full = {"w": torch.arange(48.0).reshape(8, 6), "b": torch.arange(4, dtype=torch.int64)}
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(os.path.join(root, "hf"), save_distributed=True))
    if rank == 0:
        torch.save(full, os.path.join(root, "expected.pt"))


def scenario_hf_consolidated(rank: int, world: int, root: str) -> None:
    """torch's HuggingFaceStorageWriter with consolidation: row shards written by every
    rank, then merged into Hugging Face files (for test_hf)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    # Floating tensors only: torch's consolidation calls torch.finfo on every dtype.
    full = {"w": torch.arange(48.0).reshape(8, 6), "b": torch.arange(4.0, dtype=torch.float64),
            "e": torch.arange(12.0).reshape(6, 2).to(torch.bfloat16)}
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    writer = HuggingFaceStorageWriter(os.path.join(root, "hf"), save_distributed=True, enable_consolidation=True,
                                      fqn_to_index_mapping={"w": 1, "b": 1, "e": 2})
    dcp.save(state, storage_writer=writer)
    if rank == 0:
        torch.save(full, os.path.join(root, "expected.pt"))


def scenario_dcp_plain(rank: int, world: int, root: str) -> None:
    """dcp.save of a plain (replicated) state dict with a process group, then load."""
    state = {"w": torch.arange(100.0).reshape(10, 10), "step": 5}
    dcp.save(state, storage_writer=DCPWriter(os.path.join(root, "plain")))
    target = {"w": torch.zeros(10, 10), "step": 0}
    dcp.load(target, storage_reader=DCPReader(os.path.join(root, "plain")))
    assert torch.equal(target["w"], state["w"]) and target["step"] == 5
    # Each rank reads its own files ahead, by its rank in the load's group where torch passes it.
    sharded = os.path.join(root, "sharded")
    dcp.save({f"t{i}": torch.full((100,), float(i)) for i in range(8)}, storage_writer=DCPWriter(sharded))
    for given, expected in ((None, rank), (0, 0)):
        reader = DCPReader(sharded)
        metadata = reader.read_metadata()
        reader.set_up_storage_reader(metadata, rank == 0, **({} if given is None else {"rank": given}))
        assert reader._opened and all(name.startswith(f"rank{expected:05d}-") for name in reader._opened)
        reader.reset()
    # An FSDP2 state sharded over the ranks, written by torch's own writer, read back by DCPReader.
    model = fsdp_model(world)
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(os.path.join(root, "torchs")))
    expected = full_params(model)
    fresh = fsdp_model(world)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    loaded = {"model": fresh.state_dict()}
    dcp.load(loaded, storage_reader=DCPReader(os.path.join(root, "torchs")))
    fresh.load_state_dict(loaded["model"])
    assert all(torch.equal(v, expected[k]) for k, v in full_params(fresh).items())


def scenario_dcp_plan_caching(rank: int, world: int, root: str) -> None:
    """Row shards of every rank (DTensors), saved three times with cached plans."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(48.0).reshape(8, 6), mesh, [Shard(0)]),
             "b": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}
    _saves_with_cached_plans(root, state, lambda s: {k: v.full_tensor() for k, v in s.items()})
    if rank == 0:
        files = sorted(os.listdir(os.path.join(root, "step_2")))
        assert any(f.startswith("rank00001") for f in files), files


def scenario_dcp_async_in_a_process(rank: int, world: int, root: str) -> None:
    """dcp.async_save with torch's checkpointing process (AsyncCheckpointerType.PROCESS):
    the writer is pickled into a process of torch's that saves the staged state."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    # The workers end with os._exit, which skips multiprocessing's removal of its
    # temporary directories: theirs go under this test's own.
    tempfile.tempdir = os.environ["TMPDIR"] = os.path.join(root, f"tmp{rank}")
    os.makedirs(tempfile.tempdir)
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(48.0).reshape(8, 6), mesh, [Shard(0)]), "step": 7}
    future = dcp.async_save(state, storage_writer=DCPWriter(os.path.join(root, "step_7")),
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    state["w"].add_(100)  # training goes on: the save has its own snapshot
    future.result()
    back = {"w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)]), "step": 0}
    dcp.load(back, storage_reader=DCPReader(os.path.join(root, "step_7")))
    assert torch.equal(back["w"].full_tensor(), torch.arange(48.0).reshape(8, 6)) and back["step"] == 7


def scenario_consolidated_full_disk(rank: int, world: int, root: str) -> None:
    """Rank 0 cannot write the consolidated file: every rank raises, none hangs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)])  # 12 MiB, the disk 4 MiB
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.raises(OSError) as raised:
        FSDPCheckpointer(root, model).save_consolidated(1)
    assert raised.value.errno == errno.ENOSPC
    if rank == 0:
        assert os.listdir(root) == [], "no partial file is left behind"
    else:
        assert "rank 0 could not write" in str(raised.value)


@pytest.mark.slow
def scenario_async_save_by_a_subgroup(rank: int, world: int, root: str) -> None:
    """HSDP's pattern: one replica group saves, through a process group of its ranks
    that only they use. save_async made its own group as a collective of the whole
    world on those ranks alone, and the next group the world made hung on every rank."""
    savers = dist.new_group([0])  # made by every rank, as new_group requires
    if rank == 0:
        ckpt = FSDPCheckpointer(root, small_model(), process_group=savers)
        ckpt.save(1)
        assert ckpt.save_async(2).result().endswith("step_2")
        assert ckpt.save_async(3).result().endswith("step_3")  # its save group made once
    everyone = dist.new_group(list(range(world)))  # the training's next group
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    assert total.item() == world


@pytest.mark.slow
def test_async_saves_by_a_subgroup_leave_the_worlds_groups_in_step(tmp_path) -> None:
    run(2, str(tmp_path), "async_save_by_a_subgroup", timeout=120)
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2", "step_3"]


def scenario_dcp_without_collectives(rank: int, world: int, root: str) -> None:
    """dcp.save(..., use_collectives=False) (torch's rank-local save, experimental) was
    taken as a save with them: each rank planned alone as rank 0 and committed alone, one
    failed ("is held") or replaced another's, and the checkpoint held one rank's part."""
    path = os.path.join(root, "c")
    state = {f"w{rank}": torch.full((1000,), float(rank))}
    with pytest.raises(ValueError, match="not with use_collectives=False"):
        dcp.save(state, storage_writer=DCPWriter(path), use_collectives=False)
    dist.barrier()
    assert os.listdir(root) == []
    dcp.save(state, storage_writer=DCPWriter(path))
    back = {f"w{r}": torch.zeros(1000) for r in range(world)}
    dcp.load(back, storage_reader=DCPReader(path))
    assert all((back[f"w{r}"] == r).all() for r in range(world))


@pytest.mark.slow
def test_dcp_refuses_to_save_without_collectives_on_2_ranks(tmp_path) -> None:
    run(2, str(tmp_path), "dcp_without_collectives", timeout=300)


def test_consolidated_save_on_a_full_disk_fails_on_every_rank(small_tmpfs) -> None:
    run(2, small_tmpfs, "consolidated_full_disk")


def scenario_dcp_retry_after_full_disk(rank: int, world: int, root: str) -> None:
    """A DCP save that fills the disk fails on every rank; a retry that fits, by new
    writers, succeeds: whichever rank failed, the failed save's temporary is no obstacle."""
    path = os.path.join(root, "step_1")
    with pytest.raises(BaseException) as failed:  # torch's CheckpointException
        dcp.save({f"w{rank}": torch.full((768 << 10,), float(rank))}, storage_writer=DCPWriter(path))  # 3 MiB each
    assert "No space left on device" in str(failed.value), failed.value
    del failed  # the retry comes after the failure is handled, as in a training loop's
    dcp.save({f"w{rank}": torch.full((1024,), float(rank))}, storage_writer=DCPWriter(path))
    back = {f"w{rank}": torch.zeros(1024)}
    dcp.load(back, storage_reader=DCPReader(path))
    assert (back[f"w{rank}"] == rank).all()
    dist.barrier()
    assert sorted(os.listdir(root)) == ["step_1"]


def scenario_dcp_retry_while_the_failure_is_kept(rank: int, world: int, root: str) -> None:
    """Rank 1's write fills the disk; rank 0, the coordinator, wrote its part. A retry by
    new writers, dcp.save's and then dcp.async_save's, failed "step_1.tmp-dcp is held" for
    as long as the failure's error lived (kept here, as a log of errors keeps it): its
    traceback held the coordinator's writer and its lock on the temporary."""
    path = os.path.join(root, "step_1")
    errors: list[BaseException] = []

    def save(size: int, asynchronous: bool) -> None:
        state = {f"w{rank}": torch.full((size,), float(rank))}
        if asynchronous:
            dcp.async_save(state, storage_writer=DCPWriter(path, overwrite=True)).result()
        else:
            dcp.save(state, storage_writer=DCPWriter(path, overwrite=True))

    for asynchronous in (False, True):
        try:
            save((1 << 20) if rank == 1 else 1024, asynchronous)  # 4 MiB on rank 1: more than the disk holds
        except BaseException as exc:  # torch's CheckpointException, on every rank
            errors.append(exc)
        else:
            pytest.fail("the save that fills the disk succeeded")
        save(1024, asynchronous)
        back = {f"w{rank}": torch.zeros(1024)}
        dcp.load(back, storage_reader=DCPReader(path))
        assert (back[f"w{rank}"] == rank).all()
    dist.barrier()
    if rank == 0:
        from tensorferry.temporaries import wait_for_discards
        wait_for_discards()
        assert sorted(os.listdir(root)) == ["step_1"]


@pytest.mark.slow
def test_dcp_retry_by_new_writers_while_the_failure_is_kept_on_2_ranks(small_tmpfs) -> None:
    run(2, small_tmpfs, "dcp_retry_while_the_failure_is_kept", timeout=300)


def scenario_checkpointer_retry_after_another_ranks_write_failed(rank: int, world: int, root: str) -> None:
    """Rank 1's part of a step fills the disk; rank 0, the coordinator, wrote its own.
    The step saved again once there is room failed on rank 0 ("step_2.tmp-dcp is held")
    for as long as the first failure's error lived: its traceback held the writer, and
    with it the coordinator's lock on the temporary."""
    blob = {"x": torch.zeros(4)}
    ckpt = FSDPCheckpointer(root, torch.nn.Linear(4, 4), extra={f"blob{rank}": blob})
    errors: list[BaseException] = []  # kept, as a training loop's log of errors keeps them

    def save_async(step: int) -> None:
        ckpt.save_async(step)
        ckpt.wait()

    for save_step in (ckpt.save, save_async):
        blob["x"] = torch.zeros((1 << 20) if rank == 1 else 4)  # 4 MiB on rank 1: more than the disk holds
        with pytest.raises(tensorferry.TensorferryIOError, match="No space left on device") as failed:
            save_step(2)
        errors.append(failed.value)
        blob["x"] = torch.zeros(4)
        save_step(2)
        assert ckpt.load() == 2
    dist.barrier()
    if rank == 0:
        from tensorferry.temporaries import wait_for_discards
        wait_for_discards()
        assert os.listdir(root) == ["step_2"]


@pytest.mark.slow
def test_checkpointer_retry_after_another_ranks_write_failed_on_2_ranks(small_tmpfs) -> None:
    run(2, small_tmpfs, "checkpointer_retry_after_another_ranks_write_failed", timeout=300)


def scenario_failed_async_save_seen_on_one_rank(rank: int, world: int, root: str) -> None:
    """A background save fails on every rank, and only rank 0's caller looks at its
    future (logs the error there). The next save_async raised that error on rank 1 alone,
    which went on, while rank 0 started the save's collectives and waited in them for the
    group's timeout. Every rank now starts the next save; rank 1 is warned of the failure."""
    blob = {"x": torch.zeros((1 << 20) if rank == 1 else 4)}  # 4 MiB on rank 1: more than the disk holds
    ckpt = FSDPCheckpointer(root, torch.nn.Linear(4, 4), extra={f"blob{rank}": blob})
    failed = ckpt.save_async(1)
    if rank == 0:
        assert isinstance(failed.exception(), tensorferry.TensorferryIOError)
    blob["x"] = torch.zeros(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.save_async(2).result().endswith("step_2")
    told = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "step_1" in str(w.message)]
    assert len(told) == (0 if rank == 0 else 1), told
    ckpt.wait()  # rank 1's failure has been told, rank 0's had: neither raises it again


@pytest.mark.slow
def test_a_failed_async_save_seen_on_one_rank_holds_up_no_rank(small_tmpfs) -> None:
    run(2, small_tmpfs, "failed_async_save_seen_on_one_rank", timeout=300)


def scenario_ctrl_c_while_a_background_save_runs(rank: int, world: int, root: str) -> None:
    """Ctrl-C in wait() for a background save, then the emergency save of a Ctrl-C handler:
    the checkpointer had forgotten the running save, and the emergency save_async ran its
    collectives beside it, on the same group, from another thread: both hung until the
    group's timeout. The emergency save waits for the running one first."""
    model = fsdp_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    planner = HeldSavePlanner()
    ckpt = FSDPCheckpointer(root, model, opt, save_planner=planner)
    train_step(model, opt, 1, rank)
    saved = full_params(model)
    first = ckpt.save_async(1)
    assert planner.holding.wait(120)
    try:
        with pytest.raises(KeyboardInterrupt), once_blocked_in(FSDPCheckpointer.wait, ctrl_c):
            ckpt.wait()
        train_step(model, opt, 2, rank)
        with once_blocked_in(FSDPCheckpointer._end_background_save, planner.go_on.set):
            emergency = ckpt.save_async(2)
        assert first.done()
    finally:
        planner.go_on.set()
    assert first.result().endswith("step_1") and emergency.result(120).endswith("step_2")
    assert ckpt.load(1) == 1
    assert all(torch.equal(v, saved[k]) for k, v in full_params(model).items())


@pytest.mark.slow
def test_a_ctrl_c_while_a_background_save_runs_hangs_no_later_save_on_2_ranks(tmp_path) -> None:
    run(2, str(tmp_path), "ctrl_c_while_a_background_save_runs", timeout=300, group_timeout=120)


def scenario_checkpointer_raises_one_ranks_error_on_every_rank(rank: int, world: int, root: str) -> None:
    """Rank 1's part of a save fills the disk. save and save_async raised torch's
    CheckpointException on every rank, a BaseException with no errno or filename. Every rank
    now raises rank 1's TensorferryIOError: rank 1 its own, rank 0 one naming rank 1."""
    blob = {"x": torch.zeros((1 << 20) if rank == 1 else 4)}  # 4 MiB on rank 1: more than the disk holds
    for failed in save_failures(FSDPCheckpointer(root, torch.nn.Linear(4, 4), extra={f"blob{rank}": blob}), 1):
        assert isinstance(failed, tensorferry.TensorferryIOError) and failed.errno == errno.ENOSPC, repr(failed)
        assert os.path.basename(failed.filename).startswith("rank00001-"), failed.filename
        assert ("on rank 1" in str(failed)) == (rank == 0), failed
        assert isinstance(failed.__cause__, CheckpointException)


@pytest.mark.slow
def test_checkpointer_raises_one_ranks_error_on_every_rank_on_2_ranks(small_tmpfs) -> None:
    run(2, small_tmpfs, "checkpointer_raises_one_ranks_error_on_every_rank", timeout=300)


class _Loader:
    """A data loader's position, as Stateful extra state; broken, its state_dict() fails on rank 1."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position, self.broken = rank, 0, False

    def state_dict(self) -> dict[str, Any]:
        if self.broken and self.rank == 1:
            raise RuntimeError("rank 1 cannot snapshot the loader")
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def scenario_state_failing_on_one_rank(rank: int, world: int, root: str) -> None:
    """An extra's state_dict() raising on rank 1 alone: rank 1's save, save_async or load
    raised at once, while rank 0 waited in DCP's first collective until the group's timeout,
    then failed with a gloo error naming no checkpoint (or, for save, took rank 1's next save
    for the same one). Every rank now raises before DCP begins: rank 1 its own error, rank 0
    a TensorferryError naming rank 1's."""
    loader = _Loader(rank)
    ckpt = FSDPCheckpointer(root, torch.nn.Linear(4, 4), extra={"loader": loader})
    loader.position = 10
    ckpt.save(1)
    loader.broken = True
    for call, step, doing in ((ckpt.save, 2, "save"), (ckpt.save_async, 2, "save"), (ckpt.load, 1, "load")):
        told = "rank 1 cannot snapshot the loader"
        raised = RuntimeError if rank == 1 else tensorferry.TensorferryError
        match = told if rank == 1 else rf"rank 1 failed before the {doing} of .*step_{step} began: RuntimeError: {told}"
        with pytest.raises(raised, match=match):
            call(step)
    ckpt.wait()
    loader.broken, loader.position = False, 30
    ckpt.save(3)
    assert ckpt.load(1) == 1 and loader.position == 10, "load_state_dict of a Stateful extra"
    dist.barrier()
    if rank == 0:
        assert sorted(os.listdir(root)) == ["step_1", "step_3"]


def scenario_listing_failing_on_rank_0(rank: int, world: int, root: str) -> None:
    """Rank 0 lists the checkpoints for every rank (load's step); its listing failing with an
    errno reached the other ranks as a TensorferryError without one, unlike every other error
    told across ranks. Rank 0 raises its own error, the others a TensorferryIOError with its
    errno and the folder."""
    ckpt = FSDPCheckpointer(root, torch.nn.Linear(4, 4))
    ckpt.save(1)
    if rank == 0:  # root cannot be made unreadable to root: rank 0's listing fails as EACCES would
        def refused() -> int | None:
            raise PermissionError(errno.EACCES, "Permission denied", root)
        ckpt.latest_step = refused
    with pytest.raises(OSError, match="Permission denied") as info:
        ckpt.load()
    assert (info.value.errno, info.value.filename) == (errno.EACCES, root)
    if rank != 0:
        assert isinstance(info.value, tensorferry.TensorferryError) and "rank 0 could not list" in str(info.value)
    assert ckpt.load(1) == 1, "a step named is not listed"


@pytest.mark.slow
def test_a_listing_failing_on_rank_0_raises_its_errno_on_every_rank(tmp_path) -> None:
    run(2, str(tmp_path), "listing_failing_on_rank_0", timeout=300, group_timeout=60)


def scenario_dcp_failed_steps_leave_nothing_behind(rank: int, world: int, root: str) -> None:
    """A loop of plain dcp.save, each step to a path of its own: rank 1's part of a step fills
    the disk after rank 0, the coordinator, wrote its own. Rank 0's files stayed in
    "step_<n>.tmp-dcp", which only a save to that path again removed: each failed step took
    more of the full disk, until no step fit. The next step's save removes them, whether the
    failure's error is kept (holding the coordinator's writer) or dropped."""
    kept: list[BaseException] = []  # as a training loop's log of errors keeps them
    for step, keep in ((1, True), (3, False)):
        try:  # 4 MiB on rank 1, more than the disk holds; 1 MiB on rank 0
            dcp.save({f"w{rank}": torch.zeros((1 << 20) if rank == 1 else (256 << 10))},
                     storage_writer=DCPWriter(os.path.join(root, f"step_{step}")))
        except CheckpointException as exc:
            if keep:
                kept.append(exc)
        else:
            pytest.fail("the save that fills the disk succeeded")
        gc.collect()
        dcp.save({f"w{rank}": torch.zeros(1024)}, storage_writer=DCPWriter(os.path.join(root, f"step_{step + 1}")))
        dist.barrier()
        if rank == 0:
            assert sorted(os.listdir(root)) == [f"step_{s}" for s in range(2, step + 2, 2)]
        dist.barrier()


@pytest.mark.slow
def test_dcp_failed_steps_leave_nothing_behind_on_2_ranks(small_tmpfs) -> None:
    run(2, small_tmpfs, "dcp_failed_steps_leave_nothing_behind", timeout=300)


def scenario_dcp_writer_reused_for_async_saves(rank: int, world: int, root: str) -> None:
    """One DCPWriter per rank for a loop of dcp.async_save: a save that failed on another rank
    (of which torch tells the coordinator's writer nothing) leaves the writer free for a retry
    at once; a second save while the writer writes one is refused on every rank, and the
    first commits."""
    writer = DCPWriter(overwrite=True)

    def save(step: int, size: int, planner: Any = None) -> Any:
        return dcp.async_save({f"w{rank}": torch.full((size,), float(step))}, storage_writer=writer, planner=planner,
                              checkpoint_id=os.path.join(root, f"step_{step}"))

    with pytest.raises(CheckpointException, match="No space left on device"):
        save(1, (1 << 20) if rank == 1 else 1024).result(120)  # 4 MiB on rank 1: more than the disk holds
    save(1, 1024).result(120)
    planner = HeldSavePlanner(while_writing=True)
    first = save(2, 1024, planner)
    try:
        assert planner.holding.wait(120)
        with pytest.raises(RuntimeError, match=r"this DCPWriter is in a save to .*step_2 \(on thread"):
            save(3, 1024).result(120)
    finally:
        planner.go_on.set()
    first.result(120)
    for step in (1, 2):
        back = {f"w{rank}": torch.zeros(1024)}
        dcp.load(back, storage_reader=DCPReader(os.path.join(root, f"step_{step}")))
        assert (back[f"w{rank}"] == step).all()
    dist.barrier()
    if rank == 0:
        from tensorferry.temporaries import wait_for_discards
        wait_for_discards()
        assert sorted(os.listdir(root)) == ["step_1", "step_2"]


@pytest.mark.slow
def test_dcp_writer_reused_for_async_saves_on_2_ranks(small_tmpfs) -> None:
    run(2, small_tmpfs, "dcp_writer_reused_for_async_saves", timeout=300, group_timeout=120)


class _Rank1WritesAfterRank0(DCPWriter):
    """Rank 1 starts writing only once rank 0's write has ended, as a rank slower to open its
    files does (a larger part, a copy off a GPU): told by a barrier of ``after``, a group of its own."""

    def __init__(self, path: str, after: Any, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.after = after

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            dist.barrier(group=self.after)
            return super().write_data(plan, planner)
        try:
            return super().write_data(plan, planner)
        finally:
            dist.barrier(group=self.after)


def scenario_checkpointer_raises_rank_0s_full_disk_on_a_slower_rank(rank: int, world: int, root: str) -> None:
    """Rank 0's part fills the disk. Its failed write removed the save's whole temporary, while
    the other ranks were still to write theirs into it: rank 1 failed to open its file
    (ENOENT), and raised that as its own error, never the full disk. Rank 0 removes only its own
    files; every rank raises rank 0's ENOSPC, and the temporary goes once the save has failed."""
    after = dist.new_group(backend="gloo")

    class Checkpointer(FSDPCheckpointer):
        def _writer(self, step: int) -> DCPWriter:
            return _Rank1WritesAfterRank0(self.step_path(step), after, overwrite=True)

    blob = {"x": torch.zeros((1 << 20) if rank == 0 else 4)}  # 4 MiB on rank 0: more than the disk holds
    ckpt = Checkpointer(root, torch.nn.Linear(4, 4), extra={f"blob{rank}": blob})
    with pytest.raises(tensorferry.TensorferryIOError) as failed:
        ckpt.save(1)
    assert failed.value.errno == errno.ENOSPC, repr(failed.value)
    assert os.path.basename(failed.value.filename).startswith("rank00000-"), failed.value.filename
    dist.barrier()
    assert os.listdir(root) == []


@pytest.mark.slow
def test_checkpointer_raises_rank_0s_full_disk_on_a_slower_rank_on_2_ranks(small_tmpfs) -> None:
    run(2, small_tmpfs, "checkpointer_raises_rank_0s_full_disk_on_a_slower_rank", timeout=300)


def scenario_checkpointer_folder_rank_0_cannot_make(rank: int, world: int, root: str) -> None:
    """FSDPCheckpointer made its folder on rank 0 alone, and raised there alone: the other
    ranks went on, to fail in the first save's collectives ("Connection closed by peer"), or,
    where rank 0 caught its error, to wait there for the group's timeout. Every rank raises,
    naming the folder: rank 0 its own error, the others one naming rank 0's."""
    taken = os.path.join(root, "a_file")
    if rank == 0:
        Path(taken).write_text("not a folder")
    dist.barrier()
    with pytest.raises(OSError) as failed:
        FSDPCheckpointer(taken, torch.nn.Linear(4, 4))
    assert (failed.value.errno, failed.value.filename) == (errno.EEXIST, taken), repr(failed.value)
    if rank == 1:
        assert isinstance(failed.value, tensorferry.TensorferryError) and "rank 0 could not make" in str(failed.value)


@pytest.mark.slow
def test_checkpointer_folder_rank_0_cannot_make_fails_on_every_rank_on_2_ranks(tmp_path) -> None:
    run(2, str(tmp_path), "checkpointer_folder_rank_0_cannot_make", timeout=300, group_timeout=60)


def scenario_damaged_dcpwriter_steps(rank: int, world: int, root: str) -> None:
    """Steps that lost their manifest, lost their .metadata, or whose .metadata was damaged.
    The first was taken for a folder of torch's own writer, whose reader failed on it ("Unknown
    extension name='tensorferry-raw-bytes (... read it with ... DCPReader ...'", advising the
    reader in use); the second was said to be no DCPWriter folder ("use
    tensorferry.load_checkpoint"). FSDPCheckpointer.load raised a plain TensorferryError for
    all three ("rank 0: AssertionError: metadata is None", torch's, which keeps only the text
    of the reader's error). Each names what is missing or damaged; FSDPCheckpointer.load raises
    the reader's CorruptCheckpointError itself."""
    ckpt = FSDPCheckpointer(root, torch.nn.Linear(4, 4))
    for step in (1, 2, 3):
        ckpt.save(step)
    if rank == 0:
        os.unlink(os.path.join(root, "step_1", "tensorferry.json"))
        os.unlink(os.path.join(root, "step_2", ".metadata"))
        with open(os.path.join(root, "step_3", ".metadata"), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    dist.barrier()
    said = {1: r"step_1: its tensorferry\.json is missing: the folder was written by tensorferry's DCPWriter",
            2: r"step_2: its \.metadata, which the manifest lists, is missing",
            3: r"step_3/\.metadata does not match the size and checksum the manifest gives it"}
    for step, message in said.items():
        with pytest.raises(tensorferry.CorruptCheckpointError, match=message) as failed:
            ckpt.load(step)
        assert isinstance(failed.value.__cause__, CheckpointException)
        with pytest.raises(CheckpointException, match=message):  # torch's, with the reader's error in its text
            dcp.load({"model": torch.nn.Linear(4, 4).state_dict()}, storage_reader=DCPReader(ckpt.step_path(step)))


@pytest.mark.slow
def test_damaged_dcpwriter_steps_are_named_for_what_they_lack_on_2_ranks(tmp_path) -> None:
    run(2, str(tmp_path), "damaged_dcpwriter_steps", timeout=300)


@pytest.mark.slow
def test_state_failing_on_one_rank_fails_every_ranks_save_and_load_on_2_ranks(tmp_path) -> None:
    # A short group timeout: without the fix, rank 0 fails in DCP's collective rather than waiting 30 min.
    run(2, str(tmp_path), "state_failing_on_one_rank", timeout=300, group_timeout=60)


@pytest.mark.slow
def test_dcp_retry_after_a_full_disk_on_2_ranks(small_tmpfs) -> None:
    run(2, small_tmpfs, "dcp_retry_after_full_disk")


@pytest.mark.slow
def test_fsdp2_resume_is_bit_identical_on_2_ranks(tmp_path) -> None:
    run(2, str(tmp_path), "resume")
    assert tensorferry.verify_checkpoint(tmp_path / "step_3") == []
    files = sorted(os.listdir(tmp_path / "step_3"))
    assert any(f.startswith("rank00001") for f in files), "every rank writes its own shard files"


@pytest.mark.slow
def test_fsdp2_async_save_overlaps_training(tmp_path) -> None:
    run(2, str(tmp_path), "async")


@pytest.mark.slow
@pytest.mark.parametrize("save_world,load_world", [(2, 1), (1, 2), (2, 4)])
def test_resharding(tmp_path, save_world: int, load_world: int) -> None:
    run(save_world, str(tmp_path), "save_sharded")
    run(load_world, str(tmp_path), "load_sharded")



def fsdp1_model() -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    return FullyShardedDataParallel(small_model(), device_id=torch.device("cpu"), use_orig_params=True)


def fsdp1_full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def scenario_fsdp1(rank: int, world: int, root: str) -> None:
    """FSDP1 (``FullyShardedDataParallel``, as accelerate and transformers' Trainer still
    wrap models), whose sharded state dicts hold ShardedTensors: ``FSDPCheckpointer``
    resumes it bit-identically, and so does DCP called as FSDP1's own recipe calls it
    (``SHARDED_STATE_DICT``, ``optim_state_dict``) with our writer and reader."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    model = fsdp1_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = FSDPCheckpointer(os.path.join(root, "checkpointer"), model, opt)
    for step in range(2):
        train_step(model, opt, step, rank)
    ckpt.save(2)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
        assert type(state["model"]["0.weight"]).__name__ == "ShardedTensor"
        dcp.save(state, storage_writer=DCPWriter(os.path.join(root, "recipe")))
    for step in range(2, 4):
        train_step(model, opt, step, rank)
    reference = fsdp1_full_params(model)
    for way in ("checkpointer", "recipe"):
        if way == "checkpointer":
            assert ckpt.load() == 2
        else:
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
                dcp.load(state, storage_reader=DCPReader(os.path.join(root, "recipe")))
                model.load_state_dict(state["model"])
                opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, state["optim"]))
        for step in range(2, 4):
            train_step(model, opt, step, rank)
        for k, v in fsdp1_full_params(model).items():
            assert torch.equal(v, reference[k]), (way, k)


@pytest.mark.slow
def test_fsdp1_resume_is_bit_identical_on_2_ranks(tmp_path) -> None:
    run(2, str(tmp_path), "fsdp1")



def two_dimensional_model(kind: str) -> torch.nn.Module:
    """``small_model`` on a 2 x 2 mesh of the 4 ranks: HSDP (replicated across the first
    dimension, sharded across the second), or FSDP over tensor parallelism (torchtitan's
    2D: column- then row-wise Linear pairs on "tp", FSDP on "dp", which shards the "tp"
    shards again, as _StridedShard placements)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = small_model()
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = mesh["dp"]
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def scenario_two_dimensional(rank: int, world: int, root: str) -> None:
    """Resume bit-identical on 4 ranks for both meshes of :func:`two_dimensional_model`;
    the folder then loads whole without a process group (see the test)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: the strided shards gather in two steps
        for kind in ("hsdp", "fsdp_tp"):
            model = two_dimensional_model(kind)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            ckpt = FSDPCheckpointer(os.path.join(root, kind), model, opt)
            # Ranks of one tensor-parallel group see the same batch, as they must.
            batch_rank = rank if kind == "hsdp" else rank // 2
            for step in range(2):
                train_step(model, opt, step, batch_rank)
            ckpt.save(2)
            saved = full_params(model)
            for step in range(2, 4):
                train_step(model, opt, step, batch_rank)
            reference = full_params(model)
            assert ckpt.load() == 2
            for step in range(2, 4):
                train_step(model, opt, step, batch_rank)
            for k, v in full_params(model).items():
                assert torch.equal(v, reference[k]), (kind, k)
            if rank == 0:
                torch.save(saved, os.path.join(root, f"{kind}.pt"))


@pytest.mark.slow
def test_hsdp_and_fsdp_over_tensor_parallel_on_4_ranks(tmp_path) -> None:
    """Two 2D meshes as torchtitan runs them: every rank resumes bit-identically, and the
    folder loads whole in one process, by ``load_checkpoint`` and by ``dcp.load`` into a
    plain model (resharded from 4 ranks and two mesh dimensions to 1)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    try:
        run(4, str(tmp_path), "two_dimensional")
    except mp.ProcessRaisedException as exc:
        if "Cannot use ReduceOp.AVG with Gloo" in str(exc):  # torch 2.7's HSDP on gloo
            for left in glob.glob(os.path.join(tempfile.gettempdir(), "pytorch-errorfile-*.pickle")):
                os.unlink(left)  # what torch's spawn leaves of ranks it stopped after one failed
            pytest.skip("this torch's HSDP reduces with ReduceOp.AVG, which gloo lacks")
        raise
    for kind in ("hsdp", "fsdp_tp"):
        saved = torch.load(tmp_path / f"{kind}.pt")
        folder = tensorferry.latest_checkpoint(tmp_path / kind)
        flat = load_checkpoint(folder)
        assert all(torch.equal(flat[f"model.{k}"], v) for k, v in saved.items()), kind
        state = {"model": small_model().state_dict()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP without a process group
            dcp.load(state, storage_reader=DCPReader(folder), planner=DefaultLoadPlanner(allow_partial_load=True))
        assert all(torch.equal(state["model"][k], v) for k, v in saved.items()), kind

@pytest.mark.slow
def test_dcp_with_a_process_group(tmp_path) -> None:
    run(2, str(tmp_path), "dcp_plain")


@pytest.mark.slow
def test_dcp_saves_with_cached_plans_on_2_ranks(tmp_path) -> None:
    from torch.distributed.checkpoint.planner import SavePlanner
    if not hasattr(SavePlanner, "_cached_metadata"):
        pytest.skip("this torch keeps its cached plans otherwise (before 2.8)")
    run(2, str(tmp_path), "dcp_plan_caching")


@pytest.mark.slow
def test_dcp_async_save_in_torchs_checkpointing_process_on_2_ranks(tmp_path) -> None:
    run(2, str(tmp_path), "dcp_async_in_a_process")
    assert tensorferry.verify_checkpoint(tmp_path / "step_7") == []


def scenario_dcp_save_rows(rank: int, world: int, root: str) -> None:
    """``w`` saved in row shards, one chunk per rank (for the resharded loads below)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(48.0).reshape(8, 6), mesh, [Shard(0)])}
    dcp.save(state, storage_writer=DCPWriter(os.path.join(root, "c")))


def scenario_dcp_load_flipped_columns(rank: int, world: int, root: str) -> None:
    """Column shards of a checkpoint saved in row shards: each rank's box takes a part of
    every stored chunk, one of which has a flipped byte in rank 0's columns; rank 1 reads
    that chunk whole too, for its checksum, and both fail."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    expected = torch.arange(48.0).reshape(8, 6)
    for target in ("cpu", "other dtype"):
        dtype = torch.float32 if target == "cpu" else torch.float64
        back = {"w": distribute_tensor(torch.zeros(8, 6, dtype=dtype), mesh, [Shard(1)])}
        with pytest.raises(CheckpointException, match=r"rank00000.*checksum mismatch in tensor"):
            dcp.load(back, storage_reader=DCPReader(os.path.join(root, "c")))
        dcp.load(back, storage_reader=DCPReader(os.path.join(root, "c"), verify=False))  # the parts, unverified
        full = back["w"].full_tensor()
        assert not torch.equal(full[:4], expected[:4].to(dtype)) and torch.equal(full[4:], expected[4:].to(dtype))


@pytest.mark.slow
def test_a_flipped_data_byte_fails_a_dcp_load_onto_another_sharding_on_2_ranks(tmp_path) -> None:
    """A resharded DCP load read the parts of stored chunks unverified (checksums cover
    whole chunks): a flipped byte came back as data."""
    run(2, str(tmp_path), "dcp_save_rows")
    shard = next((tmp_path / "c").glob("rank00000-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    header_length = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8:8 + header_length])["w@0,0"]["data_offsets"][0]  # rows 0-3
    raw[8 + header_length + begin + 1] ^= 0x40  # in w[0, 0]
    shard.write_bytes(bytes(raw))
    run(2, str(tmp_path), "dcp_load_flipped_columns")


def test_torch_older_than_the_extra_allows_is_named_at_import() -> None:
    # torch 2.5 imported the adapter, then failed inside DCP saves (_StorageInfo has no
    # transform_descriptors before 2.7): the import says so instead.
    script = ("import torch; torch.__version__ = '2.6.0+cpu'\n"
              "try:\n    import tensorferry.adapters.pytorch\nexcept ImportError as exc:\n    print(exc)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120).stdout
    assert "needs torch 2.7 or later, not 2.6.0+cpu" in out


def test_a_url_is_refused_by_every_entry(tmp_path, monkeypatch) -> None:
    """Not a local folder named "gs:": DCP, FSDPCheckpointer, save and load. (The Lightning
    plugin opens URLs through fsspec, as Lightning does: gs:// asks for gcsfs here.)"""
    monkeypatch.chdir(tmp_path)
    url = "gs://bucket/run/step_1"
    actions = [lambda: dcp.save({"a": torch.ones(2)}, storage_writer=DCPWriter(url), no_dist=True),
               lambda: dcp.save({"a": torch.ones(2)}, checkpoint_id=url, storage_writer=DCPWriter(), no_dist=True),
               lambda: dcp.load({"a": torch.ones(2)}, storage_reader=DCPReader(url), no_dist=True),
               lambda: FSDPCheckpointer("gs://bucket/run", torch.nn.Linear(2, 2)),
               lambda: save({"a": torch.ones(2)}, url + ".safetensors"), lambda: load(url + ".safetensors")]
    for action in actions:
        with pytest.raises(ValueError, match="'gs://bucket/run.*' is a URL"):
            action()
    if importlib.util.find_spec("gcsfs") is None and importlib.util.find_spec("lightning") is not None:
        from tensorferry.adapters.pytorch import TensorferryCheckpointIO
        with pytest.raises(ImportError, match="gcsfs"):
            TensorferryCheckpointIO().save_checkpoint({"a": torch.ones(2)}, url + ".ckpt")
    assert not os.listdir(tmp_path)


def test_files_of_other_formats_are_named_for_what_they_are(tmp_path) -> None:
    """A .pt, .bin, .npy or .pkl handed to load (or its folder to load_checkpoint) is not
    "corrupt": the error says what the file is and how to read it."""
    import pickle

    from tensorferry.layouts import UnknownLayoutError, detect
    state = {"w": torch.ones(3)}
    torch.save(state, tmp_path / "zip.pt")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    np.save(tmp_path / "a.npy", np.ones(3))
    np.savez(tmp_path / "a.npz", a=np.ones(3))
    (tmp_path / "a.pkl").write_bytes(pickle.dumps({"a": 1}))
    (tmp_path / "a.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    (tmp_path / "a.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))
    import gzip
    import lzma
    save(state, tmp_path / "plain.safetensors")
    (tmp_path / "a.safetensors.gz").write_bytes(gzip.compress((tmp_path / "plain.safetensors").read_bytes()))
    (tmp_path / "a.safetensors.xz").write_bytes(lzma.compress((tmp_path / "plain.safetensors").read_bytes()))
    expected = {"zip.pt": "zip archive, as torch.save", "legacy.pt": "a pickle", "a.npy": "numpy .npy",
                "a.npz": "zip archive.*numpy.load for .npz", "a.pkl": "a pickle", "a.gguf": "GGUF", "a.h5": "HDF5",
                "a.safetensors.gz": "gzip-compressed: decompress it", "a.safetensors.xz": "xz-compressed"}
    for name, what in expected.items():
        for mmap in (False, True):
            with pytest.raises(tensorferry.CorruptCheckpointError,
                               match=f"{name}: not a safetensors file but .*{what}"):
                load(tmp_path / name, mmap=mmap)
    model = tmp_path / "model"
    model.mkdir()
    torch.save(state, model / "pytorch_model.bin")
    (model / "config.json").write_text("{}")
    with pytest.raises(CheckpointNotFoundError, match="holds pytorch_model.bin, not safetensors.*torch.load"):
        load_checkpoint(model)
    with pytest.raises(UnknownLayoutError, match="holds pytorch_model.bin"):
        detect(model)
