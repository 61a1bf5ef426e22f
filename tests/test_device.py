"""Device memory: the engine's kvikio path and its refusals, the pinned pool's CUDA
registration, the staging of CUDA tensors through it, and CUDA checkpoints.

Tests marked ``cuda`` need a CUDA device (and some kvikio) and skip with the reason
elsewhere; ``pytest -m cuda`` runs them alone (benchmarks/gpu_check.sh does). The rest
run on the CPU: they test the dispatch around the CUDA calls, never a fake device as
proof that a device path works.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import gc
import os
import subprocess
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from conftest import requires_cuda  # noqa: E402

import tensorferry  # noqa: E402
from tensorferry import ConfigError, Engine, GDSUnavailableError, IOConfig, PinnedPool, TensorferryIOError  # noqa: E402
from tensorferry import gds  # noqa: E402
from tensorferry.adapters.pytorch import (DCPReader, DCPWriter, load, load_checkpoint, save,  # noqa: E402
                                          save_checkpoint, serialization, staging)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_kvikio = pytest.mark.skipif(gds.load_kvikio() is None, reason="needs kvikio: pip install "
                                  "'tensorferry[gds-cu13]' (or place its wheels in .whl/ for gpu_check.sh)")


class DeviceArray:
    """Host memory that claims to be device memory: only for the refusal paths, which
    must never touch the bytes."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    @property
    def __cuda_array_interface__(self) -> dict:
        a = self.array
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False),
                "strides": None if a.flags.c_contiguous else a.strides, "version": 3}


def device_array(nbytes: int) -> DeviceArray:
    return DeviceArray(np.zeros(nbytes, np.uint8))


class Dlpack:
    def __init__(self, kind: int) -> None:
        self.kind = kind

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be exported")

    def __dlpack_device__(self):
        return (self.kind, 0)


def stand_in_kvikio(compat: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(defaults=types.SimpleNamespace(is_compat_mode_preferred=lambda: compat))


@pytest.fixture
def no_kvikio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gds, "load_kvikio", lambda: None)


# --- telling device memory from host memory -----------------------------------------------

def test_device_buffers_are_told_from_host_buffers() -> None:
    assert not gds.is_device_buffer(np.zeros(3))
    assert not gds.is_device_buffer(torch.zeros(3))
    assert not gds.is_device_buffer(b"abc") and not gds.is_device_buffer(memoryview(bytearray(3)))
    assert gds.is_device_buffer(device_array(8))
    assert gds.is_device_buffer(Dlpack(gds.KDL_CUDA)) and gds.is_device_buffer(Dlpack(gds.KDL_CUDA_MANAGED))
    assert not gds.is_device_buffer(Dlpack(gds.KDL_CUDA_HOST)), "pinned host memory is host memory"
    with pytest.raises(TypeError, match="DLPack device type 10"):
        gds.is_device_buffer(Dlpack(10))  # ROCm


class TorchLikeBf16:
    """What a CUDA bf16 torch tensor shows: DLPack says CUDA, __cuda_array_interface__
    raises (no typestr for bf16), data_ptr/nbytes/is_contiguous describe it."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.nbytes = array, array.nbytes

    def __dlpack_device__(self):
        return (gds.KDL_CUDA, 0)

    @property
    def __cuda_array_interface__(self):
        raise KeyError("torch.bfloat16")

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def is_contiguous(self) -> bool:
        return self.array.flags.c_contiguous


def test_device_tensors_without_an_interface_for_their_dtype_are_still_device_memory() -> None:
    a = np.zeros(64, np.uint16)
    bf16 = TorchLikeBf16(a)
    assert gds.is_device_buffer(bf16)
    assert gds.device_nbytes(bf16) == (a.ctypes.data, 128)
    with pytest.raises(ValueError, match="not contiguous"):
        gds.device_nbytes(TorchLikeBf16(np.zeros((4, 4), np.uint16)[:, ::2]))


def test_device_buffer_size_and_layout_come_from_its_interface() -> None:
    a = np.zeros((4, 6), np.float32)
    assert gds.device_nbytes(DeviceArray(a)) == (a.ctypes.data, 96)
    with pytest.raises(ValueError, match="not C-contiguous"):
        gds.device_nbytes(DeviceArray(a[:, ::2]))
    with pytest.raises(TypeError, match="__cuda_array_interface__"):
        gds.device_nbytes(Dlpack(gds.KDL_CUDA))


# --- use_gds: taken, or refused ------------------------------------------------------------

def test_use_gds_modes() -> None:
    assert gds.resolve_mode(False, lambda: stand_in_kvikio(False)) == "off"
    assert gds.resolve_mode(None, lambda: None) == "off"
    assert gds.resolve_mode(None, lambda: stand_in_kvikio(False)) == "gds"
    assert gds.resolve_mode(None, lambda: stand_in_kvikio(True)) == "compat"
    assert gds.resolve_mode(True, lambda: stand_in_kvikio(False)) == "gds"
    with pytest.raises(GDSUnavailableError, match=r"tensorferry\[gds-cu13\].*tensorferry\[gds-cu12\]"):
        gds.resolve_mode(True, lambda: None)
    with pytest.raises(ConfigError, match="compatibility mode"):
        gds.resolve_mode(True, lambda: stand_in_kvikio(True))


def test_use_gds_setting_parses_auto_true_false() -> None:
    assert IOConfig().use_gds is None
    assert IOConfig.from_env(environ={"TENSORFERRY_USE_GDS": "auto"}).use_gds is None
    assert IOConfig.from_env(environ={"TENSORFERRY_USE_GDS": "1"}).use_gds is True
    assert IOConfig(use_gds="off").use_gds is False
    with pytest.raises(ConfigError, match="use_gds"):
        IOConfig(use_gds="maybe")
    for value in (None, True, False):
        config = IOConfig(use_gds=value)
        assert IOConfig.from_deepspeed(config.to_deepspeed()) == config


def test_required_gds_refuses_to_start_without_kvikio(no_kvikio: None) -> None:
    with pytest.raises(GDSUnavailableError, match="use_gds=True needs kvikio"):
        Engine(use_gds=True)
    deepspeed = IOConfig.from_deepspeed({"aio": {"block_size": 1 << 20, "use_gds": True}})
    with pytest.raises(GDSUnavailableError, match=r"gds-cu13"):
        Engine(deepspeed)  # DeepSpeed's use_gds is honoured, never ignored


def test_device_buffers_without_kvikio_name_the_extra(no_kvikio: None, tmp_path) -> None:
    with Engine() as engine:
        assert engine.gds_mode == "off"
        for buffer in (device_array(4096), Dlpack(gds.KDL_CUDA)):
            with pytest.raises(GDSUnavailableError, match=r"pip install 'tensorferry\[gds-cu13\]'"):
                engine.write(buffer, tmp_path / "f.bin")
            with pytest.raises(GDSUnavailableError, match=r"gds-cu12"):
                engine.pread(buffer, tmp_path / "f.bin")
    assert not (tmp_path / "f.bin").exists()


def test_device_buffers_refused_when_gds_is_off(tmp_path) -> None:
    with Engine(use_gds=False) as engine:
        assert engine.gds_mode == "off"
        with pytest.raises(GDSUnavailableError, match="use_gds=False"):
            engine.write(device_array(4096), tmp_path / "f.bin")
        assert engine.write(np.ones(4096, np.uint8), tmp_path / "f.bin") == 4096  # host I/O goes on


def test_gds_mode_is_probed_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(gds, "load_kvikio", lambda: calls.append(1))
    with Engine() as engine:
        assert calls == [], "an engine for host I/O does not import kvikio"
        assert engine.gds_mode == "off" and calls == [1]


# --- a kvikio request as the engine's future sees it ---------------------------------------

class KvikioFuture:
    """kvikio.IOFuture's interface (done, get once) over a thread's result."""

    def __init__(self, work) -> None:
        self._future = concurrent.futures.ThreadPoolExecutor(1).submit(work)

    def done(self) -> bool:
        return self._future.done()

    def get(self) -> int:
        return self._future.result()


def test_kvikio_requests_report_errors_with_file_and_offset() -> None:
    ok = tensorferry.IOFuture([gds.CuFileRequest(lambda: KvikioFuture(lambda: 4096), 4096, 8192, "kvikio pread")],
                              paths=["/x"])
    assert ok.result(timeout=10) == 4096
    short = tensorferry.IOFuture([gds.CuFileRequest(lambda: KvikioFuture(lambda: 100), 4096, 0, "kvikio pread")],
                                 paths=["/x"])
    with pytest.raises(TensorferryIOError) as info:
        short.result()
    assert info.value.errno == errno.ENODATA and info.value.filename == "/x" and "100 of 4096" in str(info.value)

    def cufile_error():
        raise RuntimeError("cuFile error: CU_FILE_DRIVER_NOT_INITIALIZED")

    failed = tensorferry.IOFuture([gds.CuFileRequest(lambda: KvikioFuture(cufile_error), 4096, 512, "kvikio pwrite")],
                                  paths=["/y"])
    with pytest.raises(TensorferryIOError, match="CU_FILE_DRIVER_NOT_INITIALIZED") as info:
        failed.result()
    assert (info.value.errno, info.value.offset, info.value.filename) == (errno.EIO, 512, "/y")
    refused = tensorferry.IOFuture([gds.CuFileRequest(cufile_error, 10, 0, "kvikio pwrite")], paths=["/z"])

    def past_the_end():  # kvikio 26.10's compatibility mode, as an H200 run raised it
        raise RuntimeError("KvikIO failure at: posix_io.hpp:173: POSIX error on pread: EOF: Input/output error")

    eof = tensorferry.IOFuture([gds.CuFileRequest(lambda: KvikioFuture(past_the_end), 4096, 0, "kvikio pread")],
                               paths=["/e"])
    with pytest.raises(TensorferryIOError) as info:
        eof.result()
    assert info.value.errno == errno.ENODATA, "a read past the end is a short read, as on the host path"
    assert refused.done() and isinstance(refused.exception(), TensorferryIOError)


class RecordingKvikio:
    """kvikio's surface as the engine uses it (CuFile by path and flags; pread/pwrite of
    (buffer, size, file_offset) returning a future), moving bytes with os.pread/pwrite
    between the file and the host memory behind a :class:`DeviceArray`. It proves the
    engine's dispatch (which file, offset, size, handle reuse, closing), not a device path."""

    def __init__(self) -> None:
        self.defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: True)
        self.opened: list[tuple[str, str]] = []
        self.closed = 0
        outer = self

        class CuFile:
            def __init__(self, path: str, flags: str) -> None:
                outer.opened.append((os.path.basename(path), flags))
                self.fd = os.open(path, os.O_RDWR if "+" in flags else os.O_RDONLY)

            def pwrite(self, buf, size, file_offset):
                view = over(buf)[:size]
                return KvikioFuture(lambda: os.pwrite(self.fd, view, file_offset))

            def pread(self, buf, size, file_offset):
                view = over(buf)[:size]
                return KvikioFuture(lambda: os.preadv(self.fd, [view], file_offset))

            def close(self) -> None:
                os.close(self.fd)
                outer.closed += 1

        def over(buf) -> np.ndarray:
            interface = buf.__cuda_array_interface__
            assert interface["typestr"] == "|u1" and interface["strides"] is None, "kvikio is given plain bytes"
            (count,), (address, _) = interface["shape"], interface["data"]
            return np.ctypeslib.as_array((ctypes.c_uint8 * count).from_address(address))

        self.CuFile = CuFile


def test_engine_dispatches_device_buffers_to_kvikio_handles(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    kvikio = RecordingKvikio()
    monkeypatch.setattr(gds, "load_kvikio", lambda: kvikio)
    (tmp_path / "keep.bin").write_bytes(b"k" * 100)
    data = np.arange(8192, dtype=np.uint8)
    with Engine() as engine:
        assert engine.gds_mode == "compat"
        assert engine.write(DeviceArray(data), tmp_path / "keep.bin", 4096) == 8192
        assert engine.write(DeviceArray(data), tmp_path / "keep.bin", 0, nbytes=16) == 16
        back = np.zeros(8192, np.uint8)
        with tensorferry.open(tmp_path / "keep.bin", "r") as f:
            assert engine.read(DeviceArray(back), f, 4096) == 8192
        assert np.array_equal(back, data)
        with pytest.raises(TensorferryIOError) as info:
            engine.read(DeviceArray(np.zeros(1 << 16, np.uint8)), tmp_path / "keep.bin")
        assert info.value.errno == errno.ENODATA and info.value.filename.endswith("keep.bin")
        fd = os.open(tmp_path / "keep.bin", os.O_RDONLY)
        try:
            with pytest.raises(TypeError, match="by path"):
                engine.read(DeviceArray(back), fd)
        finally:
            os.close(fd)
        with pytest.raises(ValueError, match="buffer too small"):
            engine.write(DeviceArray(data), tmp_path / "keep.bin", nbytes=8193)
        half = np.arange(100, 164, dtype=np.uint16)  # a bf16 tensor's 128 bytes, say
        assert engine.write(TorchLikeBf16(half), tmp_path / "keep.bin", 4096 + 8192) == 128
    assert kvikio.opened == [("keep.bin", "r+"), ("keep.bin", "r")], "one handle per file and direction"
    assert kvikio.closed == 2, "the engine's close closes its handles"
    content = (tmp_path / "keep.bin").read_bytes()
    assert content[16:100] == b"k" * 84, "a path is opened for writing without truncation"
    assert content[:16] == bytes(range(16)) and content[4096:4096 + 8192] == data.tobytes()
    assert content[4096 + 8192:] == half.tobytes()


# --- the pinned pool, registered with CUDA -------------------------------------------------

class Registrations:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.calls = 0

    def __call__(self, address: int, nbytes: int):
        assert address not in self.live, "registered twice"
        self.live[address] = nbytes
        self.calls += 1
        return lambda: self.live.pop(address)


def test_pool_registers_each_buffer_once_and_unregisters_what_it_drops() -> None:
    registrations = Registrations()
    pool = PinnedPool(max_cached_bytes=8192, register=registrations)
    a = pool.acquire(5000)  # an 8 KiB size class
    assert list(registrations.live.values()) == [8192] and pool.registered
    pool.release(a)
    b = pool.acquire(6000)
    assert b.ctypes.data == a.ctypes.data and registrations.calls == 1, "reused, not registered again"
    c = pool.acquire(100)
    pool.release(b)
    pool.release(c)  # over the cap: dropped, and unregistered before it can be freed
    assert list(registrations.live.values()) == [8192]
    pool.clear()
    assert registrations.live == {}


def test_pool_registration_can_start_later_but_with_one_runtime_only() -> None:
    pool = PinnedPool()
    idle, kept = pool.acquire(4096), pool.acquire(4096)
    pool.release(idle)
    registrations = Registrations()
    pool.register_with(registrations)
    pool.register_with(registrations)  # the same runtime again: nothing to do
    assert len(registrations.live) == 1
    pool.release(kept)  # made before registration, registered when it joins the pool
    assert len(registrations.live) == 2
    with pytest.raises(ConfigError, match="another device runtime"):
        pool.register_with(Registrations())
    pool.clear()
    assert registrations.live == {}


def test_leased_buffers_wait_for_copies_into_them_before_going_back() -> None:
    class Copy:
        done = False

        def synchronize(self) -> None:
            self.done = True

    pool, copy = PinnedPool(), Copy()
    host = staging.leased(pool, 4096, [copy])
    del host
    gc.collect()
    assert copy.done and pool.cached_bytes == 4096


def test_leased_buffers_return_to_the_pool_when_the_last_view_goes() -> None:
    pool = PinnedPool()
    host = staging.leased(pool, 10000)
    tensor = torch.from_numpy(host[100:]).view(torch.int32)
    address = host.ctypes.data
    del host
    gc.collect()
    assert pool.cached_bytes == 0, "a tensor over the memory still uses it"
    del tensor
    gc.collect()
    assert pool.cached_bytes == 16384 and pool.acquire(10000).ctypes.data == address


# --- staging: tensors made, copied and handed out in the writer's order --------------------

def test_device_to_host_keeps_a_window_of_copies_ahead() -> None:
    made: list[int] = []

    def tensor(i: int):
        def make() -> torch.Tensor:
            made.append(i)
            return torch.full((1 << 18,), i, dtype=torch.int32)  # 1 MiB
        return make

    stager = staging.DeviceToHost([tensor(i) for i in range(5)], window=2 << 20)
    first = stager.source(0)()
    assert made == [0, 1], "the window (2 MiB) holds the tensor taken and one ahead"
    assert (first.view(np.int32) == 0).all()
    assert (stager.take(3).view(np.int32) == 3).all(), "out of order: started at once"
    assert (stager.take(1).view(np.int32) == 1).all() and made[:3] == [0, 1, 3]
    # The window moves past 3, taken out of order: it is not made again (parallel file
    # writers of a DCP rank take tensors this way).
    assert [int(stager.take(i).view(np.int32)[0]) for i in (2, 4)] == [2, 4]
    assert sorted(made) == [0, 1, 2, 3, 4]
    with pytest.raises(KeyError, match="taken"):
        stager.take(3)
    one_at_a_time = staging.DeviceToHost([tensor(i) for i in range(3)], window=0)
    made.clear()
    one_at_a_time.take(0)
    assert made == [0]


def test_device_to_host_copies_through_the_given_copy_function() -> None:
    pool = PinnedPool()
    copied = []

    def copy(t: torch.Tensor, p: PinnedPool):
        copied.append(t)
        host = staging.leased(p, t.numel() * t.element_size())
        host[:] = t.reshape(-1).view(torch.uint8).numpy()
        return host, lambda: None

    meta = torch.empty(3, device="meta")  # any non-CPU tensor goes to ``copy``
    stager = staging.DeviceToHost([meta], pool=pool, copy=lambda t, p: copy(torch.zeros(3), p))
    assert stager.take(0).nbytes == 12 and len(copied) == 1


def test_stage_state_dict_snapshots_every_tensor() -> None:
    state = {"model": {"w": torch.arange(6.0)}, "step": 3, "opt": [torch.ones(2, dtype=torch.bfloat16)]}
    staged = staging.stage_state_dict(state)
    state["model"]["w"].add_(100)
    assert staged["step"] == 3 and torch.equal(staged["model"]["w"], torch.arange(6.0))
    assert staged["opt"][0].dtype == torch.bfloat16


DTENSOR_SNAPSHOT = """
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from tensorferry.adapters.pytorch import staging
d = distribute_tensor(torch.arange(12.).reshape(3, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
w = staging.stage_state_dict({"a": {"w": d}})["a"]["w"]
d.to_local().add_(100)
assert isinstance(w, DTensor) and w.placements == d.placements and w.device_mesh == d.device_mesh
assert torch.equal(w.full_tensor(), torch.arange(12.).reshape(3, 4))
dist.destroy_process_group()
"""


def test_stage_state_dict_keeps_dtensors_sharded() -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", DTENSOR_SNAPSHOT, str(port)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_dcp_async_save_snapshots_through_the_writer(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import AsyncStager

    writer = DCPWriter(tmp_path / "c")
    assert isinstance(writer, AsyncStager), "dcp.async_save stages through DCPWriter.stage"
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    future = dcp.async_save(state, storage_writer=writer)
    state["w"].zero_()  # training goes on: the save holds its own snapshot
    future.result()
    into = {"w": torch.empty(1 << 16)}
    dcp.load(into, storage_reader=DCPReader(tmp_path / "c"))
    assert torch.equal(into["w"], torch.arange(1 << 16, dtype=torch.float32))


def test_packaging_names_both_cuda_majors() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    extras = project["project"]["optional-dependencies"]
    assert any(r.startswith("kvikio-cu12") for r in extras["gds-cu12"])
    assert any(r.startswith("kvikio-cu13") for r in extras["gds-cu13"])
    assert "cuda" in " ".join(project["tool"]["pytest"]["ini_options"]["markers"])


# --- on a CUDA device ----------------------------------------------------------------------

def cuda_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {"embed": torch.randn(1000, 257, device="cuda", generator=g).to(torch.bfloat16),
            "w": torch.randn(3 << 20, device="cuda", generator=g),
            "ids": torch.arange(77, device="cuda"),
            "mask": torch.rand(5, 5, device="cuda", generator=g) > 0.5,
            "strided": torch.randn(64, 64, device="cuda", generator=g).t(),
            "host": torch.ones(3), "np": np.arange(4)}


def cuda_tensors() -> dict:
    return {k: v for k, v in cuda_state().items() if isinstance(v, torch.Tensor) and v.is_cuda}


def dcp_loaded(reader: DCPReader, like: dict) -> dict:
    """``dcp.load`` into new tensors like those of ``like``."""
    import torch.distributed.checkpoint as dcp

    into = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load(into, storage_reader=reader)
    return into


def assert_same(a: dict, b: dict) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert b[k].device == v.device and torch.equal(b[k], v), k
        else:
            assert np.array_equal(b[k], v), k


@requires_cuda
@pytest.mark.parametrize("as_directory", [False, True])
def test_cuda_state_round_trips(tmp_path, as_directory: bool) -> None:
    state = cuda_state()
    if as_directory:
        save_checkpoint(tmp_path / "ckpt", state, max_shard_bytes=4 << 20)
        assert tensorferry.verify_checkpoint(tmp_path / "ckpt") == []
        loaded = load(tmp_path / "ckpt", map_location="cuda")
    else:
        save(state, tmp_path / "s.safetensors")
        loaded = load(tmp_path / "s.safetensors", map_location="cuda")
    state["host"] = state["host"].cuda()  # map_location moves every tensor
    assert isinstance(loaded["np"], np.ndarray), "numpy arrays stay on the host"
    assert_same(state, loaded)
    where = tmp_path / ("ckpt" if as_directory else "s.safetensors")
    for torch_load_form in (lambda storage, loc: storage.cuda(0), {"cpu": "cuda:0"}):  # as torch.load takes them
        assert_same(state, load(where, map_location=torch_load_form))


@requires_cuda
def test_cuda_load_without_checksums_takes_gds_where_it_runs(tmp_path) -> None:
    state = cuda_tensors()
    state["strided"] = state["strided"].contiguous()
    save(state, tmp_path / "s.safetensors")
    with Engine() as engine:  # GDS where gds_mode is "gds", the pinned bounce otherwise
        loaded = load(tmp_path / "s.safetensors", map_location="cuda", verify=False, engine=engine)
    assert_same(state, loaded)


@requires_cuda
def test_cuda_loads_in_place_and_checksums_catch_corruption(tmp_path) -> None:
    state = cuda_tensors()
    save_checkpoint(tmp_path / "ckpt", state)
    out = {k: torch.empty_like(v).contiguous() for k, v in state.items()}
    loaded = load_checkpoint(tmp_path / "ckpt", out=out)
    for k, v in state.items():
        assert loaded[k] is out[k] and torch.equal(out[k], v)
    save(state, tmp_path / "s.safetensors")
    with open(tmp_path / "s.safetensors", "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 8)
    with pytest.raises(tensorferry.CorruptCheckpointError, match="checksum"):
        load(tmp_path / "s.safetensors", map_location="cuda")


@requires_cuda
def test_staging_pool_is_registered_with_cuda() -> None:
    pool = staging.staging_pool()
    assert pool.registered
    host = staging.leased(pool, 1 << 20)
    assert torch.from_numpy(host).is_pinned(), "CUDA sees the pool's memory as page-locked"
    t = torch.arange(1 << 18, device="cuda", dtype=torch.int32)
    copy, wait = staging.copy_to_host_async(t, pool)
    wait()
    assert np.array_equal(copy.view(np.int32), np.arange(1 << 18, dtype=np.int32))


@requires_cuda
def test_dcp_of_cuda_tensors_with_async_save(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    state = cuda_tensors()
    future = dcp.async_save(state, storage_writer=DCPWriter(tmp_path / "c"))
    expected = {k: v.clone() for k, v in state.items()}
    for v in state.values():
        v.zero_()
    future.result()
    assert_same(expected, dcp_loaded(DCPReader(tmp_path / "c"), state))


@requires_cuda
def test_complex_and_e8m0_cuda_tensors_round_trip(tmp_path) -> None:
    # No __cuda_array_interface__ typestr for either: the device path goes by bytes.
    state = {"c64": torch.randn(17, 3, dtype=torch.complex64, device="cuda"),
             "e8m0": torch.randint(0, 255, (64,), dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)}
    save(state, tmp_path / "s.safetensors")
    save_checkpoint(tmp_path / "ckpt", state)
    for loaded in (load(tmp_path / "s.safetensors", map_location="cuda"), load_checkpoint(tmp_path / "ckpt")):
        for k, v in state.items():
            assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
            assert torch.equal(loaded[k].to("cuda").view(torch.uint8), v.view(torch.uint8)), k


@requires_cuda
def test_dcp_reader_loads_torchs_own_folders_into_cuda_tensors(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    state = cuda_tensors()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "torchs")))
    assert_same(state, dcp_loaded(DCPReader(tmp_path / "torchs"), state))


@requires_cuda
def test_checkpointer_of_a_cuda_model_with_extra_state(tmp_path) -> None:
    """A CUDA model, its AdamW, a CUDA GradScaler, a scheduler and a CUDA counter, through
    save_async and load: all back on the GPU as saved."""
    from tensorferry.adapters.pytorch import FSDPCheckpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    progress = {"samples": torch.zeros((), dtype=torch.int64, device="cuda")}

    def train_step() -> None:
        loss = model(torch.randn(16, 64, device="cuda")).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scheduler.step()
        progress["samples"] += 16

    ckpt = FSDPCheckpointer(tmp_path, model, opt, extra={"scheduler": scheduler, "scaler": scaler,
                                                         "progress": progress})
    for _ in range(3):
        train_step()
    ckpt.save_async(3).result()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = {k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
    lr, scale = opt.param_groups[0]["lr"], scaler.get_scale()
    for _ in range(2):
        train_step()
    assert ckpt.load() == 3
    assert_same(expected, model.state_dict())
    restored_opt = opt.state[opt.param_groups[0]["params"][0]]
    assert all(torch.equal(restored_opt[k].to(v.device), v) for k, v in expected_opt.items())
    assert restored_opt["exp_avg"].is_cuda
    assert opt.param_groups[0]["lr"] == lr and scaler.get_scale() == scale and scheduler.last_epoch == 3
    assert progress["samples"].is_cuda and int(progress["samples"]) == 48


@requires_cuda
@needs_kvikio
def test_engine_reads_and_writes_device_memory_through_kvikio(tmp_path) -> None:
    with Engine() as engine:
        assert engine.gds_mode in ("gds", "compat")
        data = torch.randint(0, 255, (8 << 20,), dtype=torch.uint8, device="cuda")
        assert engine.write(data, tmp_path / "d.bin", 4096) == 8 << 20
        back = torch.zeros_like(data)
        assert engine.read(back, tmp_path / "d.bin", 4096) == 8 << 20
        assert torch.equal(back, data)
        with pytest.raises(TensorferryIOError) as info:
            engine.read(torch.zeros(16 << 20, dtype=torch.uint8, device="cuda"), tmp_path / "d.bin")
        assert info.value.errno == errno.ENODATA
        with tensorferry.open(tmp_path / "d.bin", "r") as f:
            host = np.empty(8 << 20, np.uint8)
            engine.read(host, f, 4096)
        assert np.array_equal(host, data.cpu().numpy())
        bf16 = torch.randn(4096, device="cuda").to(torch.bfloat16)  # no __cuda_array_interface__ for bf16
        assert engine.write(bf16, tmp_path / "h.bin") == 8192
        back16 = torch.empty_like(bf16)
        engine.read(back16, tmp_path / "h.bin")
        assert torch.equal(back16, bf16)


JAX_ON_A_GPU = r"""
import sys
import jax, jax.numpy as jnp
import orbax.checkpoint as ocp
from tensorferry.adapters.jax import FerryCheckpointHandler, FerryRestore, FerrySave

gpus = [d for d in jax.devices() if d.platform == "gpu"]
if not gpus:
    print(f"needs JAX with a GPU (devices: {jax.devices()})")
    sys.exit(77)
state = {"w": jax.device_put(jnp.arange(1 << 20, dtype=jnp.bfloat16), gpus[0]),
         "b": jax.device_put(jnp.ones((33, 7), jnp.float32), gpus[0]), "step": 5,
         "rng": jax.device_put(jax.random.key(3), gpus[0])}
with ocp.CheckpointManager(sys.argv[1], item_handlers={"state": FerryCheckpointHandler()}) as manager:
    manager.save(1, args=ocp.args.Composite(state=FerrySave(state)))
    manager.wait_until_finished()
    target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                                    if isinstance(a, jax.Array) else a, state)
    restored = manager.restore(1, args=ocp.args.Composite(state=FerryRestore(target)))["state"]
assert restored["step"] == 5
for k in ("w", "b"):
    assert restored[k].devices() == {gpus[0]} and bool((restored[k] == state[k]).all()), k
assert restored["rng"].dtype == state["rng"].dtype and restored["rng"].devices() == {gpus[0]}
assert bool((jax.random.key_data(restored["rng"]) == jax.random.key_data(state["rng"])).all())
"""


@requires_cuda
def test_jax_arrays_on_a_gpu_round_trip_through_orbax(tmp_path) -> None:
    pytest.importorskip("jax")
    pytest.importorskip("orbax.checkpoint")
    # A process of its own: the JAX tests of this session pin JAX to 8 virtual CPU devices
    # (JAX_PLATFORMS=cpu) as they are imported, and JAX keeps its first backend.
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # leave torch its memory
    child = subprocess.run([sys.executable, "-c", JAX_ON_A_GPU, str(tmp_path / "ckpt")], env=env,
                           capture_output=True, text=True, timeout=300)
    if child.returncode == 77:
        pytest.skip(child.stdout.strip())
    assert child.returncode == 0, child.stdout + child.stderr


def test_a_forked_child_does_not_register_with_the_parents_runtime() -> None:
    registrations = Registrations()
    pool = PinnedPool(register=registrations)
    pool.release(pool.acquire(4096))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: no CUDA context of its own
        ok = not pool.registered
        buffer = pool.acquire(1 << 16)
        pool.release(buffer)
        pool.clear()
        ok = ok and len(registrations.live) == 1  # the parent's copy, untouched by the child
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    os.close(read)
    os.close(write)
    assert pool.registered and len(registrations.live) == 1
    pool.clear()


def test_device_tensors_are_saved_through_deferred_copies_in_write_order(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path) -> None:
    # Off-CPU tensors (meta here: no data, so no device) take save's device path; only the
    # copy itself is replaced, by one that makes each tensor's bytes from its shape.
    copied: list[tuple[int, ...]] = []

    def copy(t: torch.Tensor, pool: PinnedPool):
        copied.append(tuple(t.shape))
        host = staging.leased(pool, t.numel() * t.element_size())
        host[:] = t.shape[0] % 251
        return host, lambda: None

    monkeypatch.setattr(staging, "copy_to_host_async", copy)
    monkeypatch.setattr(serialization, "_check_has_data", lambda tensor, where: None)  # meta stands in here
    state = {"small16": torch.empty(300, 2, dtype=torch.bfloat16, device="meta"),
             "big32": torch.empty(70000, dtype=torch.float32, device="meta"),
             "host": torch.arange(5), "n": np.arange(3), "step": 7,
             "mid64": torch.empty(1000, dtype=torch.float64, device="meta")}
    save(state, tmp_path / "s.safetensors")
    assert copied == [(1000,), (70000,), (300, 2)], "copied in the order the writer writes: 8-byte items first"
    loaded = load(tmp_path / "s.safetensors")
    for name in ("small16", "big32", "mid64"):
        raw = loaded[name].reshape(-1).view(torch.uint8)
        assert loaded[name].shape == state[name].shape and bool((raw == state[name].shape[0] % 251).all())
    assert torch.equal(loaded["host"], torch.arange(5)) and loaded["step"] == 7
    copied.clear()
    save_checkpoint(tmp_path / "ckpt", state, max_shard_bytes=4096)  # several files, written concurrently
    assert sorted(copied) == sorted([(1000,), (70000,), (300, 2)])
    assert tensorferry.verify_checkpoint(tmp_path / "ckpt") == []
    assert bool((load(tmp_path / "ckpt")["big32"].view(torch.uint8) == 70000 % 251).all())


def test_dcp_writer_copies_device_items_through_the_stager(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    copied = []

    def copy(t: torch.Tensor, pool: PinnedPool):
        copied.append(tuple(t.shape))
        host = staging.leased(pool, t.numel() * t.element_size())
        host[:] = 7
        return host, lambda: None

    monkeypatch.setattr(staging, "copy_to_host_async", copy)
    state = {"w": torch.empty(64, 64, dtype=torch.bfloat16, device="meta"), "b": torch.ones(3)}
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "c", files_per_rank=2))
    assert copied == [(64, 64)]
    into = {"w": torch.zeros(64, 64, dtype=torch.bfloat16), "b": torch.zeros(3)}
    dcp.load(into, storage_reader=DCPReader(tmp_path / "c"))
    assert bool((into["w"].view(torch.uint8) == 7).all()) and torch.equal(into["b"], torch.ones(3))
