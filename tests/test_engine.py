"""The engine conformance suite: every case runs over every backend."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorferry
from tensorferry import Engine, EngineClosedError, IOFuture, TensorferryError, TensorferryIOError

from conftest import mounted

SIZES = [0, 1, 511, 4096, 4097, 64 << 10, (64 << 10) + 1, (3 << 20) + 12345]


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("offset", [0, 3, 4096, 8191])
def test_round_trip_sizes_and_offsets(engine: Engine, tmp_path, nbytes: int, offset: int) -> None:
    data = random_bytes(nbytes, seed=nbytes + offset)
    path = tmp_path / "f.bin"
    assert engine.write(data, path, offset=offset) == nbytes
    assert os.path.getsize(path) == (offset + nbytes if nbytes else 0)
    out = np.zeros(nbytes, np.uint8)
    assert engine.read(out, path, offset=offset) == nbytes
    np.testing.assert_array_equal(out, data)
    with open(path, "rb") as f:  # what an ordinary reader sees
        f.seek(offset)
        assert f.read() == data.tobytes()


@pytest.mark.parametrize("shift", [1, 7, 100])
def test_misaligned_memory_goes_through_staging(engine: Engine, tmp_path, shift: int) -> None:
    backing = random_bytes((1 << 20) + 200, seed=shift)
    data = backing[shift:shift + (1 << 20)]  # address not aligned for O_DIRECT
    path = tmp_path / "f.bin"
    with tensorferry.open(path, "w") as f:
        engine.write(data, f)
        assert f.direct
    out_backing = np.zeros((1 << 20) + 200, np.uint8)
    out = out_backing[shift:shift + (1 << 20)]
    engine.read(out, path)
    np.testing.assert_array_equal(out, data)


def test_memory_alignment_is_what_o_direct_takes(engine: Engine, tmp_path) -> None:
    # The filesystem's dio_mem_align: a power of two up to a page; memory at exactly that
    # phase (which the engine sends to the drive unbounced) round-trips intact.
    from tensorferry.shard import aligned_empty
    path = tmp_path / "f.bin"
    with tensorferry.open(path, "w") as f:
        align = f.memory_alignment
        if not f.direct:
            pytest.skip("no O_DIRECT here")
        assert 1 <= align <= 4096 and align & (align - 1) == 0, align
        data = aligned_empty(1 << 20, align % 4096)
        data[:] = random_bytes(1 << 20)
        engine.write(data, f)
    out = aligned_empty(1 << 20, align % 4096)
    engine.read(out, path)
    np.testing.assert_array_equal(out, data)
    with pytest.raises(EngineClosedError):
        f.memory_alignment


def test_many_requests_on_many_files_in_flight(engine: Engine, tmp_path) -> None:
    arrays = [random_bytes(100_000 + i * 4099, seed=i) for i in range(24)]
    futures = [engine.pwrite(a, tmp_path / f"{i}.bin") for i, a in enumerate(arrays)]
    assert [f.result() for f in futures] == [a.nbytes for a in arrays]
    outs = [np.empty_like(a) for a in arrays]
    futures = (engine.pread(o, tmp_path / f"{i}.bin") for i, o in enumerate(outs))  # any iterable
    assert tensorferry.IOFuture.gather(futures).result() == sum(a.nbytes for a in arrays)
    for a, o in zip(arrays, outs):
        np.testing.assert_array_equal(a, o)


def test_disjoint_ranges_of_one_file_concurrently(engine: Engine, tmp_path) -> None:
    data = random_bytes(2_000_003)
    path = tmp_path / "f.bin"
    with tensorferry.open(path, "w+") as f:
        cuts = [0, 1, 4095, 70_000, 700_001, 1_500_000, data.nbytes]
        futures = [engine.pwrite(data[a:b], f, offset=a) for a, b in zip(cuts, cuts[1:])]
        for fut in futures:
            fut.result()
        out = np.empty_like(data)
        futures = [engine.pread(out[a:b], f, offset=a) for a, b in zip(cuts, cuts[1:])]
        for fut in futures:
            fut.result()
    np.testing.assert_array_equal(out, data)


def test_buffer_kinds(engine: Engine, tmp_path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "f.bin"
    payload = bytes(range(256)) * 100
    engine.write(payload, path)  # bytes: read-only is fine for writing
    engine.write(memoryview(bytearray(payload)), path, offset=len(payload))
    target = bytearray(2 * len(payload))
    engine.read(target, path)
    assert bytes(target) == payload * 2
    tensor = torch.arange(10_000, dtype=torch.float32)
    engine.write(tensor, path)
    back = torch.empty_like(tensor)
    engine.read(back, path)  # zero-copy into the tensor's own memory
    assert torch.equal(back, tensor)
    with pytest.raises(ValueError, match="read-only"):
        engine.read(payload, path)


def test_fd_and_file_objects(engine: Engine, tmp_path) -> None:
    path = tmp_path / "f.bin"
    data = random_bytes(300_000)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT)
    try:
        engine.write(data, fd)
        out = np.empty_like(data)
        engine.read(out, fd)
        np.testing.assert_array_equal(out, data)
        os.fstat(fd)  # still open: the caller owns it
    finally:
        os.close(fd)


def test_future_interface(engine: Engine, tmp_path) -> None:
    data = random_bytes(1 << 20)
    fut = engine.pwrite(data, tmp_path / "f.bin")
    assert fut.wait(timeout=30)
    assert fut.done()
    assert fut.exception() is None
    assert fut.result(timeout=0) == data.nbytes


def test_backend_is_reported(backend: str) -> None:
    with Engine(backend=backend) as e:
        assert e.backend == backend


def test_auto_backend_picks_a_working_one() -> None:
    with Engine(backend="auto") as e:
        expected = "io_uring" if tensorferry.io_uring_probe()[0] else "threads"
        assert e.backend == expected


# --- errors: every failure is an exception naming file, offset and errno ---------------


def test_missing_directory(engine: Engine, tmp_path) -> None:
    path = tmp_path / "no" / "such" / "dir" / "f.bin"
    with pytest.raises(TensorferryIOError) as info:
        engine.write(b"x", path)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(path)
    assert isinstance(info.value, OSError)


def test_permission_denied(engine: Engine, tmp_path) -> None:
    path = tmp_path / "ro.bin"
    path.write_bytes(b"hello")
    os.chmod(path, 0o400)
    if os.geteuid() == 0:  # root ignores mode bits; a read-only bind of the file still refuses
        with mounted("tmpfs", "size=1m,mode=0755") as d:
            target = os.path.join(d, "f.bin")
            open(target, "wb").close()
            os.system(f"mount -o remount,ro {d}")
            with pytest.raises(TensorferryIOError) as info:
                engine.write(b"x", target)
            assert info.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
            assert info.value.filename == target
    else:
        with pytest.raises(TensorferryIOError) as info:
            engine.write(b"x", path)
        assert info.value.errno in (errno.EACCES, errno.EPERM)


def test_read_past_end_of_file(engine: Engine, tmp_path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(10_000))
    out = np.empty(20_000, np.uint8)
    with pytest.raises(TensorferryIOError) as info:
        engine.read(out, path, offset=0)
    err = info.value
    assert err.errno == errno.ENODATA
    assert err.filename == str(path)
    assert (err.offset, err.length) == (0, 20_000)  # the read asked for
    assert "read past end of file (10000 bytes read)" in str(err)


def test_a_read_past_the_end_is_reported_as_the_range_asked_for(backend: str, tmp_path) -> None:
    """Each range as the caller gave it, with what of it was read, from the block of the
    request that found the end or from one wholly past it. The offset and length were
    the block's remainder: a 5000-byte read of a 100-byte file in 4 KiB blocks said
    "at offset 100 (3996 bytes)"."""
    path = tmp_path / "truncated.bin"
    path.write_bytes(bytes(100))
    with tensorferry.Engine(backend=backend, block_size=4096, threads=2) as e:
        for size, offset, read in [(5000, 0, 100), (20_000, 0, 100), (3000, 1000, 0), (4096, 60, 40)]:
            with pytest.raises(TensorferryIOError) as info:
                e.read(np.empty(size, np.uint8), path, offset=offset)
            assert (info.value.errno, info.value.offset, info.value.length) == (errno.ENODATA, offset, size)
            assert str(info.value) == (f"[Errno 61] read past end of file ({read} bytes read): No data available "
                                       f"at offset {offset} ({size} bytes): '{path}'")
        with pytest.raises(TensorferryIOError) as info:  # one request of three parts: the second is named
            e.pread_many([(np.empty(50, np.uint8), 0), (np.empty(9000, np.uint8), 90), (np.empty(8, np.uint8), 500)],
                         path).result()
        assert (info.value.offset, info.value.length) == (90, 9000) and "(10 bytes read)" in str(info.value)


def test_pread_many_reads_every_part_as_one_request(engine: Engine, tmp_path) -> None:
    data = random_bytes((5 << 20) + 777, seed=3)
    path = tmp_path / "parts.bin"
    path.write_bytes(data.tobytes())
    base = np.empty(8 << 20, np.uint8)
    aligned = base[(-base.ctypes.data) % 4096:][:3 << 20]  # page-aligned: O_DIRECT straight in
    parts = [(aligned[:1 << 20], 4096), (np.empty(4097, np.uint8), 3), (bytearray(0), 99),
             (aligned[1 << 20:][:2 << 20], 3 << 20), (base[-1001:], len(data) - 1001)]
    with tensorferry.File(path, "r") as f:
        future = engine.pread_many(parts, f)
        assert future.result() == sum(len(b) for b, _ in parts)
    for buffer, offset in parts:
        np.testing.assert_array_equal(np.frombuffer(buffer, np.uint8), data[offset:offset + len(buffer)])


@pytest.mark.parametrize("queue_depth", [1, 2])
def test_many_small_reads_in_flight_aligned_and_bounced(backend: str, tmp_path, queue_depth: int) -> None:
    """Small tasks, several per block in flight (io_uring), a few bounced through the
    staging blocks, of which there are only queue_depth, and whole blocks among them."""
    data = random_bytes(8 << 20, seed=11)
    path = tmp_path / "small.bin"
    path.write_bytes(data.tobytes())
    rng = np.random.default_rng(0)
    base = np.empty(24 << 20, np.uint8)
    memory = base[(-base.ctypes.data) % 4096:]
    parts, at = [], 0
    for offset in rng.choice(len(data) // 4096 - 64, 600, replace=False) * 4096:
        size = int(rng.choice([4096, 8192, 512, 64 << 10]))
        shift = int(rng.choice([0, 0, 0, 1, 100]))  # a shifted buffer is bounced
        parts.append((memory[at + shift:at + shift + size], int(offset)))
        at += (size + shift + 4095) // 4096 * 4096
    with tensorferry.Engine(backend=backend, block_size=64 << 10, queue_depth=queue_depth, threads=2) as e, \
            tensorferry.File(path, "r") as f:
        assert e.pread_many(parts, f).result() == sum(len(b) for b, _ in parts)
    for buffer, offset in parts:
        np.testing.assert_array_equal(buffer, data[offset:offset + len(buffer)])


def test_pread_many_names_the_failing_part(engine: Engine, tmp_path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(10_000))
    with pytest.raises(TensorferryIOError) as info:
        engine.pread_many([(np.empty(100, np.uint8), 0), (np.empty(500, np.uint8), 9_800)], path).result()
    assert (info.value.errno, info.value.offset, info.value.length) == (errno.ENODATA, 9_800, 500)
    assert info.value.filename == str(path) and "(200 bytes read)" in str(info.value)
    with pytest.raises(ValueError, match="negative"):
        engine.pread_many([(np.empty(8, np.uint8), -1)], path)


def test_pread_files_reads_many_files_in_one_call(engine: Engine, tmp_path) -> None:
    """Each file's parts as pread_many reads them; a file that cannot be opened, a
    folder, or a read past a file's end is its own error, in its place, naming it."""
    files = {f"f{i}.bin": random_bytes(size, seed=i) for i, size in enumerate([4096, 130_000, 1 << 20, 7])}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data.tobytes())
    base = np.empty(4 << 20, np.uint8)
    aligned = base[(-base.ctypes.data) % 4096:]
    reads = [(tmp_path / "f0.bin", [(aligned[:4096], 0)]),
             (tmp_path / "absent.bin", [(np.empty(8, np.uint8), 0)]),
             (tmp_path / "f1.bin", [(np.empty(1000, np.uint8), 5), (aligned[8192:8192 + 126_976], 0)]),
             (tmp_path, [(np.empty(8, np.uint8), 0)]),
             (tmp_path / "f2.bin", [(aligned[1 << 20:2 << 20], 0)]),
             (tmp_path / "f3.bin", [(np.empty(8, np.uint8), 0)])]
    started = engine.pread_files(reads)
    assert isinstance(started[1], TensorferryIOError) and started[1].errno == errno.ENOENT
    assert started[1].filename == str(tmp_path / "absent.bin")
    assert isinstance(started[3], IsADirectoryError) and started[3].filename == str(tmp_path)
    for i in (0, 2, 4):
        assert started[i].result() == sum(len(b) for b, _ in reads[i][1])
        data = files[os.path.basename(reads[i][0])]
        for buffer, offset in reads[i][1]:
            np.testing.assert_array_equal(buffer, data[offset:offset + len(buffer)])
    with pytest.raises(TensorferryIOError) as info:  # 8 bytes asked of a 7-byte file
        started[5].result()
    assert info.value.errno == errno.ENODATA and info.value.filename == str(tmp_path / "f3.bin")
    with pytest.raises(ValueError, match="negative"):
        engine.pread_files([(tmp_path / "f0.bin", [(np.empty(8, np.uint8), -1)])])
    assert engine.pread_files([]) == []


def test_missing_file_for_reading(engine: Engine, tmp_path) -> None:
    with pytest.raises(TensorferryIOError) as info:
        engine.read(bytearray(4), tmp_path / "absent.bin")
    assert info.value.errno == errno.ENOENT


def test_buffer_too_small(engine: Engine, tmp_path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(100))
    with pytest.raises(ValueError, match="buffer too small"):
        engine.read(bytearray(10), path, nbytes=100)
    with pytest.raises(ValueError, match="buffer too small"):
        engine.write(bytes(10), path, nbytes=11)


def test_disk_full(engine: Engine, small_tmpfs: str) -> None:
    path = os.path.join(small_tmpfs, "big.bin")
    with pytest.raises(TensorferryIOError) as info:
        engine.write(random_bytes(8 << 20), path)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == path
    # As another process gets it (a DataLoader worker's, another rank's through DCP): the
    # same message, not one with its offset said twice.
    import pickle
    copy = pickle.loads(pickle.dumps(info.value))
    assert (str(copy), copy.errno, copy.filename, copy.offset, copy.length) == \
        (str(info.value), errno.ENOSPC, path, info.value.offset, info.value.length)
    assert info.value.length and str(copy).count(" at offset ") == 1


def test_every_error_crosses_processes_as_it_was() -> None:
    # DCP pickles a rank's failure to the others, and copies it: each class must rebuild.
    import copy
    import pickle

    from tensorferry import errors
    raised = [errors.CheckpointNotFoundError("no complete checkpoint in /ckpt", "/ckpt"),
              errors.TensorferryIOError(errno.EIO, "read failed", "/f", 4096, 512),
              errors.CorruptCheckpointError("bad header"), errors.ConfigError("queue_depth"),
              errors.GDSUnavailableError("no kvikio"), errors.EngineClosedError("closed"),
              errors.TensorferryError("any")]
    for error in raised:
        error.__notes__ = ["while saving step 7"]  # what add_note (3.11) makes
        error.rank = 1
        for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
            assert type(again) is type(error) and str(again) == str(error)
            assert getattr(again, "filename", None) == getattr(error, "filename", None)
            assert (again.__notes__, again.rank) == (["while saving step 7"], 1)


def test_use_after_close(backend: str, tmp_path) -> None:
    e = Engine(backend=backend)
    e.close()
    e.close()  # idempotent
    with pytest.raises(EngineClosedError):
        e.write(b"x", tmp_path / "f.bin")
    f = tensorferry.open(tmp_path / "g.bin", "w")
    f.close()
    with Engine(backend=backend) as e2, pytest.raises(EngineClosedError):
        e2.write(b"x", f)


def test_pending_io_finishes_before_close(backend: str, tmp_path) -> None:
    data = random_bytes(4 << 20)
    e = Engine(backend=backend, block_size=64 << 10)
    futures = [e.pwrite(data, tmp_path / f"{i}.bin") for i in range(4)]
    e.close()
    assert all(f.done() for f in futures)
    assert all(os.path.getsize(tmp_path / f"{i}.bin") == data.nbytes for i in range(4))


def test_device_buffer_is_refused_clearly(engine: Engine, tmp_path) -> None:
    class FakeDeviceArray:  # what a CUDA tensor reports through DLPack
        def __dlpack__(self, stream=None):
            raise AssertionError("must not be exported")

        def __dlpack_device__(self):
            return (2, 0)

    # Without kvikio, the error names the extra that brings it (tests/test_device.py has the rest).
    with pytest.raises(tensorferry.GDSUnavailableError, match=r"tensorferry\[gds-cu13\]"):
        engine.write(FakeDeviceArray(), tmp_path / "f.bin")


def test_gil_is_released_during_io(backend: str, tmp_path) -> None:
    data = random_bytes(64 << 20)
    path = tmp_path / "big.bin"
    # Tiny blocks and one worker make the write long enough to observe.
    with Engine(backend=backend, block_size=4096, queue_depth=1, threads=1, direct=False) as e:
        ticks = 0
        stop = threading.Event()

        def count() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1

        counter = threading.Thread(target=count)
        counter.start()
        try:
            start = time.monotonic()
            e.write(data, path)
            elapsed = time.monotonic() - start
        finally:
            stop.set()
            counter.join()
    assert elapsed > 0
    # The counting thread ran while the main thread waited in result().
    assert ticks > 1000


# --- O_DIRECT on other filesystems ---------------------------------------------------


def test_direct_io_on_dev_shm(engine: Engine) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("/dev/shm is absent")
    path = f"/dev/shm/tensorferry-test-{os.getpid()}.bin"
    try:
        data = random_bytes(1_000_001)
        with tensorferry.open(path, "w") as f:
            engine.write(data, f)
            assert f.direct, "tmpfs on this kernel accepts O_DIRECT"
        out = np.empty_like(data)
        engine.read(out, path)
        np.testing.assert_array_equal(out, data)
    finally:
        os.unlink(path)


def test_direct_io_on_a_mounted_tmpfs(engine: Engine) -> None:
    with mounted("tmpfs", "size=16m") as d:
        data = random_bytes(3_000_000)
        path = os.path.join(d, "f.bin")
        engine.write(data, path, offset=5)
        out = np.empty_like(data)
        engine.read(out, path, offset=5)
        np.testing.assert_array_equal(out, data)


def test_filesystem_without_direct_io_falls_back_with_one_warning(engine: Engine) -> None:
    with mounted("ramfs") as d:  # ramfs has no O_DIRECT
        path = os.path.join(d, "f.bin")
        tensorferry.engine._warned_filesystems.clear()  # mount numbers are reused
        with pytest.warns(tensorferry.DirectIOFallbackWarning) as record:
            f = tensorferry.open(path, "w+")
            g = tensorferry.open(os.path.join(d, "g.bin"), "w+")
        assert len(record) == 1
        assert not f.direct
        data = random_bytes(500_000)
        engine.write(data, f)
        out = np.empty_like(data)
        engine.read(out, f)
        np.testing.assert_array_equal(out, data)
        f.close()
        g.close()


def test_buffered_mode_when_direct_is_off(backend: str, tmp_path) -> None:
    with Engine(backend=backend, direct=False) as e:
        data = random_bytes(200_000)
        e.write(data, tmp_path / "f.bin")
        with tensorferry.open(tmp_path / "f.bin", "r", direct=False) as f:
            assert not f.direct
            out = np.empty_like(data)
            e.read(out, f)
        np.testing.assert_array_equal(out, data)


def test_engines_across_fork(tmp_path) -> None:
    """A forked child (a DataLoader worker, say) gets a working default engine."""
    parent_engine = tensorferry.default_engine()
    parent_engine.write(b"parent", tmp_path / "p.bin")
    pid = os.fork()
    if pid == 0:  # the child reports through its exit status only
        code = 1
        try:
            child_engine = tensorferry.default_engine()
            assert child_engine is not parent_engine
            child_engine.write(b"child", tmp_path / "c.bin")
            try:
                parent_engine.write(b"x", tmp_path / "x.bin")
            except EngineClosedError:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "c.bin").read_bytes() == b"child"
    assert tensorferry.default_engine() is parent_engine  # the parent's is untouched


def test_exit_with_io_in_flight_does_not_abort(tmp_path) -> None:
    """A ring thread that drops the last reference to a file while the interpreter
    finalizes must not touch Python (it used to abort the process, now and then)."""
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(8 << 20))
    script = ("import numpy as np, tensorferry\n"
              "engine = tensorferry.Engine(block_size=1 << 12)\n"
              f"file = tensorferry.open({str(data)!r}, 'r')\n"
              "buffers = [np.empty(8 << 20, np.uint8) for _ in range(4)]\n"
              "futures = [engine.pread(b, file, 0) for b in buffers]\n"
              "del file  # the requests in flight now hold the file's last references\n"
              "futures[-1].result()\n")
    for _ in range(20):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr


def test_completed_future() -> None:
    f = tensorferry.IOFuture.completed(42)
    assert f.done() and f.result() == 42 and f.exception() is None


def test_the_shared_engine_is_released_at_exit(tmp_path) -> None:
    """It kept its last request; left to the interpreter's teardown, nanobind found the
    native engine and request alive and reported them as leaked. Not closed: whoever
    still holds it (a save finishing in a later exit handler) can use it. A forked
    child that exits normally does not touch the parent's engine."""
    script = f"""
import atexit, os, weakref
import numpy as np
import tensorferry
from tensorferry.engine import default_engine
path = {str(tmp_path / "f.bin")!r}
engine = default_engine()
engine.pwrite(np.ones(4096, np.uint8), path).result()
pid = os.fork()
if pid == 0:
    atexit._run_exitfuncs()
    os._exit(0 if default_engine() is not engine and not engine.closed else 3)
assert os.waitpid(pid, 0)[1] == 0
assert not engine.closed
engine.pread(np.empty(4096, np.uint8), path).result()
held_by_a_later_handler = default_engine()
atexit._run_exitfuncs()
held_by_a_later_handler.pwrite(np.ones(4096, np.uint8), path).result()  # still usable
assert default_engine() is not engine  # a new one
alive = weakref.ref(engine)
del engine, held_by_a_later_handler
print("released" if alive() is None else "alive")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "released"
    assert "leaked" not in result.stderr


def test_a_cancelled_request_skips_what_it_has_not_issued(backend: str, tmp_path) -> None:
    """IOFuture.cancel: blocks not yet handed to the kernel are skipped and result()
    raises ECANCELED naming the file and the request's range; the engine goes on; a
    finished read cancelled keeps its result (before, it was marked failed as cancelled)."""
    data = random_bytes(64 << 20)
    path = tmp_path / "f.bin"
    with Engine(backend=backend, block_size=64 << 10, queue_depth=2, threads=1) as e:
        e.write(data, path)
        out = np.zeros(len(data), np.uint8)
        future = e.pread(out, path)
        future.cancel()
        with pytest.raises(TensorferryIOError, match="cancelled") as info:
            future.result()
        assert info.value.errno == errno.ECANCELED and info.value.filename == str(path)
        assert not np.array_equal(out, data), "1024 blocks through one worker were all read before the cancel"
        again = np.zeros(len(data), np.uint8)
        finished = e.pread(again, path)
        assert finished.result() == len(data) and np.array_equal(again, data)
        finished.cancel()  # too late: a finished read keeps its outcome
        assert finished.exception() is None and finished.result() == len(data)
        write = e.pwrite(data, path, offset=1 << 20)
        write.cancel()
        where = rf"at offset {1 << 20} \({len(data)} bytes\)"  # of the request (it said offset 0, no length)
        with pytest.raises(TensorferryIOError, match=f"cancelled.* {where}") as info:
            write.result()
        assert (info.value.offset, info.value.length) == (1 << 20, len(data))


# --- opening files, ranges, staging, waiting ------------------------------------------


# Swaps two names (argv[1], argv[2]) in one atomic step, again and again, until killed.
_SWAP_FOREVER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2])
while True:
    libc.renameat2(-100, a, -100, b, 2)  # AT_FDCWD, RENAME_EXCHANGE
"""


def test_a_name_replaced_while_it_is_opened_never_mixes_two_files(tmp_path) -> None:
    """A File's buffered and O_DIRECT descriptors are one file: the path was opened twice,
    and a rename over it in between (as checkpoint writers replace files) gave one read
    the edges of one file and the middle of another."""
    name, other = tmp_path / "name.bin", tmp_path / "other.bin"
    name.write_bytes(b"\x11" * 16384)
    other.write_bytes(b"\x22" * 16384)
    swapper = subprocess.Popen([sys.executable, "-c", _SWAP_FOREVER, str(name), str(other)])
    try:
        out = np.zeros(3 * 4096, np.uint8)
        deadline = time.monotonic() + 5
        with Engine(backend="threads", threads=1) as e:
            while time.monotonic() < deadline:
                with tensorferry.open(name, "r", direct=True) as f:
                    if not f.direct:
                        pytest.skip("no O_DIRECT here")
                    e.read(out, f, offset=100)  # the head buffered, the middle direct, the tail buffered
                assert len(np.unique(out)) == 1, f"one read returned bytes of two files: {np.unique(out)}"
    finally:
        swapper.kill()
        swapper.wait()


# Takes a read lease on argv[1], ``on_asked`` run when the kernel asks for it back (an open for writing).
_TAKE_A_LEASE = """
import fcntl, os, select, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
asked = []
signal.signal(signal.SIGIO, {on_asked})
try:
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
except OSError as exc:
    print(exc, flush=True)
    sys.exit()
print("leased", flush=True)
"""
# Lets go of the lease as soon as the kernel asks.
_HOLD_A_LEASE = _TAKE_A_LEASE.format(on_asked="lambda *_: fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)") + \
    "time.sleep(60)\n"


def test_a_file_another_process_holds_a_lease_on_opens(backend: str, tmp_path) -> None:
    """Leases (Samba's oplocks, an NFS server's delegations) are broken by an open, which
    waits for the holder to let go; the non-blocking open (which keeps FIFOs from blocking
    it) failed at once with EAGAIN instead."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(8192))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_A_LEASE, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        said = holder.stdout.readline().strip()
        if said != "leased":
            pytest.skip(f"no lease here: {said}")
        with Engine(backend=backend) as e, tensorferry.open(path, "r+") as f:  # breaks the read lease
            assert e.write(b"leased", f, offset=4096) == 6
    finally:
        holder.kill()
        holder.wait()
    assert path.read_bytes()[4096:4102] == b"leased"


def test_a_pipe_or_socket_is_refused_as_a_file(engine: Engine) -> None:
    """Positional I/O needs a regular file or a block device: io_uring wrote a pipe
    whatever the offset asked, and its reads of an empty pipe waited for a writer."""
    r, w = os.pipe()
    a, b = socket.socketpair()
    try:
        for fd in (w, a.fileno()):
            with pytest.raises(TensorferryIOError, match="not of a regular file or block device") as info:
                engine.write(b"hello", fd, offset=12345)
            assert info.value.errno == errno.EINVAL and info.value.filename == f"<fd {fd}>"
        with pytest.raises(TensorferryIOError, match="a pipe or FIFO"):
            engine.pread(bytearray(4), r, offset=777)
        with pytest.raises(TensorferryIOError, match="a socket"):
            tensorferry.File.from_fd(b.fileno(), "peer")
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 100)  # nothing went down the pipe
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


@pytest.mark.parametrize("flags", [0, os.O_DIRECT], ids=["buffered", "direct"])
def test_a_descriptor_closed_and_its_number_reused_keeps_its_writes(backend: str, tmp_path, flags: int) -> None:
    """Writes through a raw descriptor used the caller's number itself: closed with writes
    queued and the number reused by another open, the writes went into that other file,
    and every future reported success."""
    mine, other = tmp_path / "mine.bin", tmp_path / "other.bin"
    other.write_bytes(b"\x55" * (32 << 20))
    data = random_bytes(32 << 20)
    fd = os.open(mine, os.O_CREAT | os.O_RDWR | flags)
    victim = os.open(other, os.O_RDWR)
    # 8192 blocks through one worker: most are still queued when the number is reused.
    with Engine(backend=backend, block_size=4096, queue_depth=1, threads=1) as e:
        try:
            future = e.pwrite(data, fd)
            os.dup2(victim, fd)  # closes fd, and its number now leads to the other file
            assert not future.done(), "the write was over before its descriptor was closed"
            assert future.result() == len(data)
        finally:
            os.close(fd)
            os.close(victim)
    assert other.read_bytes() == b"\x55" * (32 << 20)
    assert mine.read_bytes() == data.tobytes()


def test_a_write_through_an_append_descriptor_is_refused(engine: Engine, tmp_path) -> None:
    """Linux puts a pwrite through an O_APPEND descriptor at the end of the file whatever
    its offset: a write asked at offset 0 landed after the existing bytes. Reads are fine."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"A" * 8192)
    fd = os.open(path, os.O_RDWR | os.O_APPEND)
    try:
        with pytest.raises(TensorferryIOError, match="O_APPEND") as info:
            engine.pwrite(b"BBBB", fd, offset=0)
        assert info.value.errno == errno.EINVAL and info.value.filename == f"<fd {fd}>"
        out = bytearray(4)
        assert engine.read(out, fd, offset=8188) == 4 and out == b"AAAA"
        with pytest.raises(TensorferryIOError, match="read past end") as info:
            engine.read(bytearray(4), fd, offset=8190)
        assert info.value.filename == f"<fd {fd}>"  # named as the caller gave it, not by our duplicate
    finally:
        os.close(fd)
    assert path.read_bytes() == b"A" * 8192


@pytest.mark.parametrize("direct", [False, True])
def test_a_write_to_a_file_open_read_only_says_so(engine: Engine, tmp_path, direct: bool) -> None:
    """A write to a file opened "r" (or through a descriptor opened O_RDONLY) failed with
    "fallocate before the write: EBADF", which did not say what was wrong."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(16384))
    fd = os.open(path, os.O_RDONLY)
    try:
        with tensorferry.open(path, "r", direct=direct) as f:
            for target, name in ((f, str(path)), (fd, f"<fd {fd}>")):
                with pytest.raises(TensorferryIOError, match="write to a file open read-only") as info:
                    engine.write(random_bytes(12288), target, offset=100)
                assert info.value.errno == errno.EBADF and info.value.filename == name
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(16384)


# Asked for the lease back, says so, and lets go once told to on stdin, or on its own after 20 s.
_HOLD_A_LEASE_UNTIL_TOLD = _TAKE_A_LEASE.format(on_asked="lambda *_: asked.append(True)") + """
while not asked:
    time.sleep(0.01)
print("asked", flush=True)
told = select.select([sys.stdin], [], [], 20)[0]
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
print("let go when told" if told else "let go untold", flush=True)
time.sleep(60)
"""


def test_an_open_waiting_for_a_lease_lets_other_threads_run(tmp_path) -> None:
    """An open waits for a lease holder to let go (up to 45 s), as it does for a slow NFS or
    FUSE server: it held the GIL meanwhile, and no other Python thread ran."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(4096))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_A_LEASE_UNTIL_TOLD, str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        said = holder.stdout.readline().strip()
        if said != "leased":
            pytest.skip(f"no lease here: {said}")
        opened = []
        opener = threading.Thread(target=lambda: opened.append(tensorferry.open(path, "r+", direct=False)))
        opener.start()
        assert holder.stdout.readline().strip() == "asked"  # the open now waits for the lease
        holder.stdin.write("let go\n")  # which only a thread that runs meanwhile can say
        holder.stdin.flush()
        opener.join()
        assert holder.stdout.readline().strip() == "let go when told"
        opened[0].close()
    finally:
        holder.kill()
        holder.wait()


def test_bounced_blocks_of_a_block_size_off_the_page(backend: str, tmp_path) -> None:
    """The staging blocks of a ring start a page apart: at multiples of a block size that is
    not, all but the first were misaligned, and O_DIRECT refused them (EINVAL)."""
    data = random_bytes((8 << 20) + 1)[1:]  # memory one byte past alignment: bounced
    path = tmp_path / "f.bin"
    with Engine(backend=backend, block_size=(1 << 20) + 1, queue_depth=4, threads=1) as e:
        with tensorferry.open(path, "w") as f:
            if not f.direct:
                pytest.skip("no O_DIRECT here")
            e.write(data, f)
        out = np.zeros(len(data) + 1, np.uint8)[1:]
        e.read(out, path)
    np.testing.assert_array_equal(out, data)


def test_staging_memory_that_cannot_be_had_fails_the_request_not_the_engine(tmp_path) -> None:
    """A ring's staging slab (up to queue_depth blocks) is mapped at the first bounced block;
    when that failed, the request never finished and close() waited for it forever."""
    if not tensorferry.io_uring_probe()[0]:
        pytest.skip("io_uring is not usable here")
    path = str(tmp_path / "f.bin")
    script = f"""
import errno, resource
import numpy as np
import tensorferry
from tensorferry.shard import aligned_empty
size = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
path = {path!r}
unaligned = np.ones((1 << 20) + 1, np.uint8)[1:]  # bounced, through a staging block of 1 GiB: past the limit
with tensorferry.Engine(backend="io_uring", threads=1, block_size=1 << 30, queue_depth=64) as engine:
    try:
        engine.pwrite(unaligned, path).result(timeout=20)
        raise SystemExit("the write did not fail")
    except tensorferry.TensorferryIOError as exc:
        assert (exc.errno, exc.filename, exc.offset, exc.length) == (errno.ENOMEM, path, 0, 1 << 20), exc
    aligned = aligned_empty(1 << 20)
    aligned[:] = 7
    assert engine.write(aligned, path) == 1 << 20  # the engine goes on
print("closed")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "closed", result.stderr



def test_a_small_misaligned_read_stages_only_the_memory_it_uses(backend: str, tmp_path) -> None:
    """One 64 KiB O_DIRECT read into memory unaligned for O_DIRECT mapped and zero-filled the
    whole staging area: block_size x queue_depth on io_uring (16 MiB blocks: 512 MiB; 1 GiB
    blocks: the process was killed), block_size per thread on threads. Measured in a
    subprocess, by the growth of its resident memory."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    script = f"""
import numpy as np, tensorferry
def resident():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) << 10
out = np.ones((64 << 10) + 1, np.uint8)[1:]  # touched already, one byte off alignment: bounced
with tensorferry.Engine(backend={backend!r}, threads=1, block_size=128 << 20, queue_depth=4) as engine:
    with tensorferry.open({str(path)!r}) as f:
        assert f.direct
        before = resident()
        assert engine.read(out, f) == 64 << 10
        print((resident() - before) >> 20)
assert (out == np.fromfile({str(path)!r}, np.uint8, 64 << 10)).all()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) < 16, f"resident memory grew by {result.stdout.strip()} MiB"  # was 128 or 512


def test_close_gives_back_the_descriptors_and_the_staging_memory(backend: str, tmp_path) -> None:
    """A closed io_uring engine kept its ring and eventfd (8 descriptors an engine at the
    default 4 rings) and its staging memory until it was garbage collected. Measured in a
    subprocess, with the engine still referenced after close()."""
    script = f"""
import os
import numpy as np, tensorferry
def resident():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) << 10
def descriptors():
    return len(os.listdir("/proc/self/fd"))
data = np.ones((32 << 20) + 1, np.uint8)[1:]  # touched already, one byte off alignment: bounced
before = descriptors()
engine = tensorferry.Engine(backend={backend!r}, block_size=32 << 20, threads=4, queue_depth=4)
engine.write(data, {str(tmp_path / "f.bin")!r})
engine.read(data, {str(tmp_path / "f.bin")!r})
in_use = resident()
engine.close()
print(descriptors() - before, (in_use - resident()) >> 20)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    left, freed = map(int, result.stdout.split())
    assert left == 0, f"{left} descriptors left open by the closed engine"
    assert freed >= 24, f"close() gave back {freed} MiB of the 32 MiB of staging used"


@pytest.mark.parametrize("timeout", [float("inf"), 1e10, threading.TIMEOUT_MAX])
def test_a_timeout_past_what_the_clock_holds_waits_without_limit(backend: str, tmp_path, timeout: float) -> None:
    """Seconds beyond what the clock holds overflowed when made nanoseconds: result(inf)
    raised TimeoutError at once on a future not yet done."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(8 << 20))
    with Engine(backend=backend, threads=1, queue_depth=1) as e:
        futures = [e.pread(np.empty(8 << 20, np.uint8), path) for _ in range(20)]
        gathered = IOFuture.gather(futures[-3:])
        assert futures[-1].result(timeout=timeout) == 8 << 20
        assert futures[-2].wait(timeout=timeout) and futures[-2].exception(timeout=timeout) is None
        assert gathered.result(timeout=timeout) == 3 * (8 << 20)


def test_ctrl_c_interrupts_a_wait_not_the_io(backend: str, tmp_path) -> None:
    """SIGINT during result() on a long request raised KeyboardInterrupt only once the I/O
    was over (2.3 s late for 2.4 GB). Now it interrupts the wait; the I/O goes on and a
    later result() has it whole."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(8 << 20))
    script = f"""
import os, signal, sys, threading
import numpy as np, tensorferry
with tensorferry.Engine(backend={backend!r}, threads=1, queue_depth=1) as engine:
    buffer = np.empty(8 << 20, np.uint8)
    future = engine.pread_many([(buffer, 0)] * 300, {str(path)!r})  # one request of 2.4 GB
    main, waiting = threading.get_ident(), tensorferry.IOFuture.wait.__code__
    def interrupt():  # once the I/O runs and the main thread waits for it
        while future._requests[0].bytes_done == 0 or sys._current_frames()[main].f_code is not waiting:
            pass
        os.kill(os.getpid(), signal.SIGINT)
    sender = threading.Thread(target=interrupt)
    try:
        sender.start()
        future.result()
        print("no KeyboardInterrupt")
    except KeyboardInterrupt:
        print("interrupted while", "done" if future.done() else "pending")
    sender.join()
    print(future.result() == 300 * (8 << 20))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["interrupted while pending", "True"], result.stdout


def test_a_future_in_flight_at_fork_fails_in_the_child(backend: str, tmp_path) -> None:
    """The child of a fork has none of the parent's I/O threads: waiting there on a future
    whose I/O was in flight at the fork blocked forever (done() stayed False). Now it is
    done, and result() raises an error saying the I/O belongs to the parent."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(8 << 20))
    with Engine(backend=backend, threads=1, queue_depth=1) as e:
        futures = [e.pread(np.empty(8 << 20, np.uint8), path) for _ in range(20)]
        pid = os.fork()
        if pid == 0:  # the child reports through its exit status only
            code = 1
            try:
                signal.alarm(30)  # a hang ends the child, not the test run
                last = futures[-1]
                assert last.done() and last.wait()
                try:
                    last.result()
                except TensorferryError as exc:
                    code = 0 if "parent process" in str(exc) and str(path) in str(exc) else 2
            finally:
                os._exit(code)
        assert futures[-1].result() == 8 << 20  # the parent's I/O is untouched
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0

@pytest.mark.parametrize("offset", [2**64 - 10, 2**63 - 50, 2**63])
def test_ranges_ending_past_the_largest_file_offset_are_refused(engine: Engine, tmp_path, offset: int) -> None:
    """offset + nbytes wrapped around 2**64 in the native engine, which then made no task
    and reported the request done, nothing written or read."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(8192))
    buffer = np.ones(100, np.uint8)
    message = rf"offset {offset} \+ 100 bytes ends past 2\*\*63-1"
    with pytest.raises(ValueError, match=message):
        engine.write(buffer, path, offset=offset)
    with pytest.raises(ValueError, match=message):
        engine.read(buffer, path, offset=offset)
    with pytest.raises(ValueError, match=message):
        engine.pread_many([(buffer, 0), (buffer, offset)], path)
    with pytest.raises(ValueError, match=message):
        engine.pread_files([(path, [(buffer, offset)])])
    with tensorferry.open(path, "r+") as f, pytest.raises(TensorferryIOError, match="past 2\\*\\*63-1") as info:
        engine._native.submit(f._native, True, buffer.ctypes.data, 100, offset)  # the native check
    assert info.value.errno == errno.EINVAL and info.value.filename == str(path)
    assert path.read_bytes() == bytes(8192) and (buffer == 1).all()


def test_a_direct_write_past_the_end_leaves_the_gap_a_hole(backend: str, small_tmpfs: str) -> None:
    """A direct write reserves (fallocate) the range it writes, not everything from the
    file's end: 8 KiB at 1 GiB failed on a 4 MiB filesystem, and the error named
    fallocate's range, not the write's."""
    path = os.path.join(small_tmpfs, "sparse.bin")
    with Engine(backend=backend) as e:
        with tensorferry.open(path, "w", direct=True) as f:
            if not f.direct:
                pytest.skip("no O_DIRECT here")
            assert e.write(random_bytes(8192), f, offset=1 << 30) == 8192
        st = os.stat(path)
        assert st.st_size == (1 << 30) + 8192 and st.st_blocks * 512 < 1 << 20
        full = os.path.join(small_tmpfs, "full.bin")
        with pytest.raises(TensorferryIOError) as info:
            e.write(random_bytes(8 << 20), full, offset=1 << 20)
    err = info.value
    assert (err.errno, err.filename, err.offset, err.length) == (errno.ENOSPC, full, 1 << 20, 8 << 20)


def test_a_gathered_future_waits_one_timeout_in_all() -> None:
    """IOFuture.wait(timeout) gave each part the whole timeout: a future of n parts could
    wait n times as long."""
    class FinishesAfterAWhile:  # what wait() sees of a native request
        nbytes = 1

        def wait(self, timeout: float) -> bool:
            time.sleep(min(timeout, 0.3))
            return timeout >= 0.3

        def done(self) -> bool:
            return False

    future = tensorferry.IOFuture.gather(tensorferry.IOFuture([FinishesAfterAWhile()]) for _ in range(3))
    assert not future.wait(timeout=0.5)  # 0.3 s for the first part leaves the second less than 0.3
    assert future.wait(timeout=2)


def test_dropping_an_engine_unclosed_lets_other_threads_run_while_it_waits(tmp_path) -> None:
    """An engine dropped without close() waits for its queued I/O: that waited with the
    GIL held (the native destructor), and no other thread ran until it was done."""
    e = Engine(backend="threads", block_size=4096, queue_depth=1, threads=1, direct=False)
    future = e.pwrite(random_bytes(64 << 20), tmp_path / "f.bin")  # 16384 blocks through one worker
    state = {"dropping": False, "seen": False, "stop": False}

    def watch() -> None:
        while not state["stop"] and not state["seen"]:
            state["seen"] = state["dropping"] and not future.done()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert not future.done()
        state["dropping"] = True
        del e
        assert future.done() and future.result() == 64 << 20
    finally:
        state["stop"] = True
        watcher.join()
    assert state["seen"], "no other thread ran while the dropped engine waited for its I/O"


def test_a_name_that_is_not_utf8_opens_and_errors_name_it(engine: Engine, tmp_path) -> None:
    """A name is bytes (os.listdir gives one that is not UTF-8 surrogate-escaped, as every
    os function takes it): the native File refused such a str with a TypeError naming no file."""
    name = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"caf\xe9.bin"))
    data = random_bytes(100_000)
    assert engine.write(data, name) == data.nbytes
    assert os.fsdecode(b"caf\xe9.bin") in os.listdir(tmp_path)
    out = np.zeros_like(data)
    engine.read(out, name)
    np.testing.assert_array_equal(out, data)
    with tensorferry.open(name, "r") as f:
        assert f.size == data.nbytes and f.path == name
        out[:] = 0
        engine.read(out, f)
        np.testing.assert_array_equal(out, data)
    (future,) = engine.pread_files([(name, [(out, 0)])])
    assert future.result() == data.nbytes
    missing = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"absent\xff.bin"))
    with pytest.raises(TensorferryIOError) as info:
        engine.read(out, missing)
    assert info.value.errno == errno.ENOENT and info.value.filename == missing
    (error,) = engine.pread_files([(missing, [(out, 0)])])
    assert isinstance(error, TensorferryIOError) and error.filename == missing
    with pytest.raises(TensorferryIOError) as info:
        engine.read(np.empty(200_000, np.uint8), name)  # past the end: a request's error
    assert info.value.errno == errno.ENODATA and info.value.filename == name
    with pytest.raises(ValueError, match="NUL"):
        tensorferry.open(str(tmp_path / "a\0b"), "w")


def _require_io_uring() -> None:
    usable, why = tensorferry.io_uring_probe()
    if not usable:
        pytest.skip(f"io_uring is not usable here: {why}")


def test_a_ring_refusing_its_share_fails_the_request_not_the_submission(tmp_path) -> None:
    """With several rings, a later ring that refused its share (broken) raised out of pread
    after ring 0 had taken its own: no future to wait on while ring 0 still filled the buffer.
    The refused share now fails the request, which ends once ring 0's share is done."""
    from tensorferry import _native
    _require_io_uring()
    path = str(tmp_path / "data")
    data = random_bytes(4 << 20)
    data.tofile(path)
    small = np.zeros(4096, np.uint8)
    with tensorferry.Engine(backend="io_uring", threads=2, queue_depth=2, block_size=64 << 10,
                            direct=False) as e:
        e.read(small, path)  # submission 0: ring 0, which then sleeps in io_uring_enter
        time.sleep(0.2)
        try:
            _native._inject_uring_enter_failures(17, errno.EIO)  # past the 16 a ring survives
            with pytest.raises(TensorferryIOError):
                e.read(small, path)  # submission 1: ring 1, which breaks
            time.sleep(0.3)
        finally:
            _native._inject_uring_enter_failures(0, 0)
        out = np.zeros_like(data)
        future = e.pread(out, path)  # blocks alternate between ring 0 and the broken ring 1
        with pytest.raises(TensorferryIOError) as info:
            future.result(timeout=60)
        assert info.value.errno == errno.EBADF and info.value.filename == path
        np.testing.assert_array_equal(out[:64 << 10], data[:64 << 10])  # ring 0's first block


def test_eagain_completions_back_off_and_fail_after_a_bound(tmp_path) -> None:
    """io_uring completions of -EAGAIN were resubmitted at once, forever: a few are still
    retried, but a task that keeps getting them fails with EAGAIN."""
    from tensorferry import _native
    _require_io_uring()
    path = str(tmp_path / "data")
    data = random_bytes(4096)
    data.tofile(path)
    out = np.zeros_like(data)
    with tensorferry.Engine(backend="io_uring", threads=1, direct=False) as e:
        try:
            _native._inject_uring_results(5, -errno.EAGAIN)
            e.read(out, path)
            np.testing.assert_array_equal(out, data)
            _native._inject_uring_results(5000, -errno.EAGAIN)
            with pytest.raises(TensorferryIOError) as info:
                e.pread(out, path).result(timeout=60)
            assert info.value.errno == errno.EAGAIN and info.value.filename == path
        finally:
            _native._inject_uring_results(0, 0)
        e.read(out, path)  # the engine still works


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_character_device_is_refused_as_a_file(engine: Engine, device: str) -> None:
    """Positional I/O cannot serve a character device (a terminal is a stream, and io_uring
    ignores the offset): opened by path, one is refused as a FIFO is, naming it."""
    if not os.path.exists(device):
        pytest.skip(f"no {device}")
    with pytest.raises(TensorferryIOError, match="a character device") as info:
        engine.read(np.zeros(4096, np.uint8), device, offset=8192)
    assert info.value.errno == errno.EINVAL and info.value.filename == device
    with pytest.raises(TensorferryIOError, match="a character device"):
        tensorferry.open(device, "r+")
