"""OffloadStore against real files: round trips, ordering, prefetch, memory bounds, errors."""

import errno
import gc
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import numpy as np
import psutil
import pytest

import tensorferry
from tensorferry.offload import OffloadStore

from conftest import mounted

MiB = 1 << 20
SIZES = [0, 1, 4095, 4096, 12289, MiB + 3]


@pytest.fixture
def store(tmp_path, engine):
    with OffloadStore(tmp_path, engine, max_pool_bytes=8 * MiB) as store:
        yield store


def random_bytes(rng, n):
    return rng.integers(0, 256, n, dtype=np.uint8)


def swapped_back(store, key):
    out = np.empty(store.nbytes(key), np.uint8)
    assert store.swap_in(key, out).result() == out.nbytes
    return out


def test_swap_cycles_are_bit_exact(store):
    rng = np.random.default_rng(1)
    for _ in range(4):
        written = {f"k{n}": random_bytes(rng, n) for n in SIZES}
        futures = [store.swap_out(key, data) for key, data in written.items()]
        tensorferry.IOFuture.gather(futures).result()
        for key, data in written.items():
            assert store.nbytes(key) == data.nbytes
            np.testing.assert_array_equal(swapped_back(store, key), data)
    assert sorted(store.keys()) == sorted(written)
    stats = store.stats()
    assert stats["swaps_out"] == stats["swaps_in"] == 4 * len(SIZES)
    assert stats["bytes_out"] == stats["bytes_in"] == 4 * sum(SIZES)
    assert stats["files"] == len(SIZES) and stats["disk_bytes"] == sum(SIZES)


def test_typed_unaligned_and_buffer_protocol_objects(store):
    values = np.random.default_rng(2).standard_normal((33, 77)).astype(np.float32)
    store.swap_out("f32", values).result()
    back = np.zeros_like(values)
    store.swap_in("f32", back).result()
    np.testing.assert_array_equal(back, values)

    blob = bytes(range(256)) * 41 + b"tail"
    store.swap_out("bytes", memoryview(blob)[3:]).result()
    into = bytearray(len(blob) + 100)  # larger than needed: only the head is filled
    store.swap_in("bytes", into).result()
    assert into[:len(blob) - 3] == blob[3:] and into[len(blob) - 3:] == bytes(103)


def test_same_size_reuses_the_file_and_a_new_size_reallocates(store):
    rng = np.random.default_rng(3)
    store.swap_out("k", random_bytes(rng, 3 * 4096 + 5)).result()
    (name,) = os.listdir(store.path)
    inode = os.stat(os.path.join(store.path, name)).st_ino
    for _ in range(3):
        data = random_bytes(rng, 3 * 4096 + 5)
        store.swap_out("k", data).result()
        assert os.listdir(store.path) == [name]
        assert os.stat(os.path.join(store.path, name)).st_ino == inode
        np.testing.assert_array_equal(swapped_back(store, "k"), data)
    for n in (100, 5 * MiB + 1, 7):
        data = random_bytes(rng, n)
        store.swap_out("k", data).result()
        assert store.nbytes("k") == n == os.path.getsize(os.path.join(store.path, name))
        np.testing.assert_array_equal(swapped_back(store, "k"), data)
    assert store.stats()["files"] == 1


def test_swap_in_sees_a_write_still_in_flight(store):
    rng = np.random.default_rng(4)
    for _ in range(3):
        first, second = random_bytes(rng, 8 * MiB + 1), random_bytes(rng, 8 * MiB + 1)
        store.swap_out("k", first)
        store.swap_out("k", second)  # waits for the first, so the second lands last
        out = np.empty_like(second)
        store.swap_in("k", out).result()
        np.testing.assert_array_equal(out, second)


def test_a_write_after_swap_in_does_not_tear_the_read(store):
    rng = np.random.default_rng(5)
    old, new = random_bytes(rng, 8 * MiB), random_bytes(rng, 8 * MiB)
    store.swap_out("k", old).result()
    out = np.empty_like(old)
    read = store.swap_in("k", out)
    store.swap_out("k", new).result()
    read.result()
    np.testing.assert_array_equal(out, old)
    np.testing.assert_array_equal(swapped_back(store, "k"), new)


def slow_engine(backend):
    """An engine that reads or writes a few MiB over some milliseconds: 64 KiB at a time, one at once."""
    return tensorferry.Engine(backend=backend, block_size=64 << 10, queue_depth=1, threads=1)


def test_a_write_waits_for_a_prefetch_read_that_a_swap_in_waits_on(tmp_path, backend):
    """swap_in of a key being prefetched took the read off the key, then waited for it:
    a swap_out of the key from another thread saw no I/O on it and wrote the file under
    the read, which returned old and new bytes mixed (or a false checksum failure)."""
    old, new = np.full(16 * MiB, 1, np.uint8), np.full(16 * MiB, 2, np.uint8)
    waiting = tensorferry.IOFuture.wait.__code__
    # 4 KiB at a time: a read of some tenths of a second, for the reader to be seen waiting on.
    with tensorferry.Engine(backend=backend, block_size=4096, queue_depth=1, threads=1) as engine, \
            OffloadStore(tmp_path, engine, max_pool_bytes=16 * MiB) as store:
        for _ in range(10):
            store.swap_out("k", old).result()
            assert store.prefetch(["k"]) == 1
            read = store._slots["k"].staged.future
            out = np.zeros_like(old)
            outcome = []
            reader = threading.Thread(target=lambda: outcome.append(store.swap_in("k", out).exception()))
            reader.start()
            while not read.done() and sys._current_frames()[reader.ident].f_code is not waiting:
                pass  # until the reader waits for the prefetch read
            if read.done():  # it ended first (a busy machine): nothing to see this time
                reader.join()
                continue
            written = store.swap_out("k", new)
            assert read.done(), "swap_out started a write while the prefetch read of the key ran"
            reader.join()
            written.result()
            assert outcome == [None]
            assert np.unique(out).tolist() in ([1], [2])  # the old bytes, or the new ones, never a mix
            np.testing.assert_array_equal(swapped_back(store, "k"), new)
            break
        else:
            pytest.fail("the prefetch read ended before the reader waited for it, every time")


def test_concurrent_swaps_from_threads(store):
    errors = []

    def worker(t):
        try:
            rng = np.random.default_rng(100 + t)
            for cycle in range(8):
                key = f"t{t}-{cycle % 3}"
                data = random_bytes(rng, int(rng.integers(1, 300_000)))
                store.swap_out(key, data)
                if cycle % 2:
                    store.prefetch([key])
                out = np.empty_like(data)
                store.swap_in(key, out).result()
                np.testing.assert_array_equal(out, data)
        except BaseException as exc:  # noqa: BLE001 - reported from the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(store.keys()) == 12
    assert store.stats()["pool_bytes"] <= store.max_pool_bytes


def test_prefetch_hits_are_counted_and_exact(store):
    rng = np.random.default_rng(6)
    written = {f"k{i}": random_bytes(rng, n) for i, n in enumerate(SIZES)}
    for key, data in written.items():
        store.swap_out(key, data).result()
    assert store.prefetch(written) == len(written)
    assert store.prefetch(written) == 0  # already staged
    for key, data in written.items():
        np.testing.assert_array_equal(swapped_back(store, key), data)
    assert store.stats()["prefetch_hits"] == len(written)

    swapped_back(store, "k0")  # the staged copy was used up: this one reads the drive
    assert store.stats()["prefetch_hits"] == len(written)

    store.prefetch(["k5"])
    fresh = random_bytes(rng, SIZES[5])
    store.swap_out("k5", fresh).result()  # a new write makes the staged copy stale
    np.testing.assert_array_equal(swapped_back(store, "k5"), fresh)
    assert store.stats()["prefetch_hits"] == len(written)


def test_prefetch_of_a_key_being_written_is_skipped(store):
    data = random_bytes(np.random.default_rng(7), 16 * MiB)
    store.swap_out("k", data)
    started = store.prefetch(["k"])
    np.testing.assert_array_equal(swapped_back(store, "k"), data)
    assert store.stats()["prefetch_hits"] == started


def test_prefetch_memory_stays_under_the_bound(tmp_path, engine):
    bound = 3 * MiB
    rng = np.random.default_rng(8)
    with OffloadStore(tmp_path, engine, max_pool_bytes=bound) as store:
        written = {f"k{i}": random_bytes(rng, MiB) for i in range(5)}
        written["big"] = random_bytes(rng, 2 * MiB)
        for key, data in written.items():
            store.swap_out(key, data).result()

        assert store.prefetch([f"k{i}" for i in range(5)]) == 3  # stops at the bound, never waits
        assert store.stats()["pool_bytes"] == bound
        for i in range(5):
            np.testing.assert_array_equal(swapped_back(store, f"k{i}"), written[f"k{i}"])
            assert store.stats()["pool_bytes"] <= bound
        assert store.stats()["prefetch_hits"] == 3

        # Idle 1 MiB buffers make room for a 2 MiB one, and the other way round.
        for keys in (["big"], ["k0", "k1", "k2"], ["big", "k3"], ["k4"]):
            store.prefetch(keys)
            assert store.stats()["pool_bytes"] <= bound
            for key in keys:
                np.testing.assert_array_equal(swapped_back(store, key), written[key])
                assert store.stats()["pool_bytes"] <= bound
        assert store.prefetch(["big", "big"]) == 1
        store.delete("big")
        assert store.stats()["pool_bytes"] <= bound


def test_rss_stays_bounded_over_many_large_swaps(tmp_path, engine):
    data = random_bytes(np.random.default_rng(9), 64 * MiB)
    out = np.zeros_like(data)
    process = psutil.Process()
    with OffloadStore(tmp_path, engine, max_pool_bytes=64 * MiB) as store:
        store.swap_out("k", data).result()
        store.prefetch(["k"])
        store.swap_in("k", out).result()
        baseline = process.memory_info().rss
        for _ in range(6):
            store.swap_out("k", data).result()
            store.prefetch(["k"])
            store.swap_in("k", out).result()
            assert store.stats()["pool_bytes"] <= 64 * MiB
        growth = process.memory_info().rss - baseline
        assert store.stats()["prefetch_hits"] == 7
    np.testing.assert_array_equal(out, data)
    assert growth < 16 * MiB, f"RSS grew by {growth / MiB:.1f} MiB over 6 swaps of 64 MiB"


def test_a_finished_write_lets_go_of_the_callers_buffer(store):
    """The store keeps a key's last write future; once done() has said it finished, that
    future must not keep the caller's buffer alive (128 MiB of RSS, in the review's case)."""
    data = random_bytes(np.random.default_rng(13), 3 * MiB)
    expected = data.copy()
    buffer_alive = weakref.ref(data)
    future = store.swap_out("k", data)
    while not future.done():
        time.sleep(0.001)
    del data, future
    gc.collect()
    assert buffer_alive() is None, "the store's finished write future still holds the buffer"
    np.testing.assert_array_equal(swapped_back(store, "k"), expected)


def overwrite_within(store, new_bytes: bytes, at: int) -> str:
    """Changes bytes of the store's one file underneath it; returns the file's path."""
    (name,) = os.listdir(store.path)
    path = os.path.join(store.path, name)
    with open(path, "r+b") as file:
        file.seek(at)
        file.write(new_bytes)
    return path


def test_bytes_changed_underneath_the_store_fail_the_checksum(store):
    data = random_bytes(np.random.default_rng(14), MiB + 3)
    store.swap_out("k", data).result()
    path = overwrite_within(store, bytes(255 - b for b in data[5000:5008].tobytes()), 5000)
    out = np.zeros_like(data)
    read = store.swap_in("k", out)
    with pytest.raises(tensorferry.CorruptCheckpointError, match="checksum") as info:
        read.result()
    assert path in str(info.value) and "'k'" in str(info.value)
    assert isinstance(read.exception(), tensorferry.CorruptCheckpointError)  # the same answer again
    with pytest.raises(tensorferry.CorruptCheckpointError):
        tensorferry.IOFuture.gather([store.swap_in("k", out)]).result()

    assert store.prefetch(["k"]) == 1  # a prefetched key is checked as well
    with pytest.raises(tensorferry.CorruptCheckpointError, match="checksum"):
        store.swap_in("k", out).result()
    assert store.stats()["prefetch_hits"] == 1

    store.swap_out("k", data).result()  # written again, it reads back good
    store.prefetch(["k"])
    np.testing.assert_array_equal(swapped_back(store, "k"), data)
    np.testing.assert_array_equal(swapped_back(store, "k"), data)


def test_verify_false_checks_nothing(tmp_path, engine):
    data = np.zeros(8192, np.uint8)
    with OffloadStore(tmp_path, engine, verify=False) as store:
        store.swap_out("k", data).result()
        overwrite_within(store, b"\xff", 100)
        out = np.empty_like(data)
        assert store.swap_in("k", out).result() == data.nbytes
    assert out[100] == 0xFF and out.sum() == 0xFF


def test_delete(store):
    rng = np.random.default_rng(10)
    store.swap_out("a", random_bytes(rng, 5000)).result()
    store.swap_out("b", random_bytes(rng, 7000))
    store.prefetch(["a"])
    store.delete("a")
    store.delete("b")  # waits for its write
    assert "a" not in store and store.keys() == []
    assert os.listdir(store.path) == []
    stats = store.stats()
    assert stats["files"] == 0 and stats["disk_bytes"] == 0
    assert stats["pool_bytes"] <= store.max_pool_bytes
    with pytest.raises(KeyError):
        store.delete("a")
    with pytest.raises(KeyError):
        store.swap_in("a", np.empty(5000, np.uint8))
    store.swap_out("a", np.arange(10, dtype=np.uint8)).result()  # the name can be used again
    np.testing.assert_array_equal(swapped_back(store, "a"), np.arange(10, dtype=np.uint8))


def test_usage_errors(store):
    store.swap_out("k", np.ones(4096 + 1, np.uint8)).result()
    with pytest.raises(ValueError, match="too small"):
        store.swap_in("k", np.empty(4096, np.uint8))
    with pytest.raises(ValueError):
        store.swap_in("k", bytes(8192))  # read-only
    for call in (lambda: store.swap_in("nope", np.empty(10, np.uint8)), lambda: store.nbytes("nope"),
                 lambda: store.prefetch(["k", "nope"]), lambda: store.delete("nope")):
        with pytest.raises(KeyError):
            call()
    assert store.stats()["pool_bytes"] == 0  # the failed prefetch started nothing
    with pytest.raises(TypeError):
        store.prefetch("k")


def test_missing_or_unusable_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        OffloadStore(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        OffloadStore(tmp_path / "file")
    with mounted("tmpfs", "ro,size=1m") as readonly:
        with pytest.raises(OSError, match="cannot create") as info:
            OffloadStore(readonly)
    assert info.value.errno == errno.EROFS


def test_use_after_close(tmp_path, engine):
    store = OffloadStore(tmp_path, engine)
    store.swap_out("k", np.ones(100, np.uint8))
    store.close()
    store.close()
    assert store.closed and not engine.closed  # a caller's engine stays theirs
    for call in (lambda: store.swap_out("k", b"x"), lambda: store.swap_in("k", bytearray(100)),
                 lambda: store.prefetch(["k"]), lambda: store.delete("k"), lambda: store.keys(),
                 lambda: "k" in store, lambda: store.nbytes("k"), lambda: store.stats()):
        with pytest.raises(tensorferry.EngineClosedError):
            call()


def test_files_live_in_a_private_directory_that_goes_away(tmp_path):
    with OffloadStore(tmp_path) as store:
        assert os.path.dirname(store.path) == str(tmp_path)
        assert os.path.basename(store.path).startswith(f"tensorferry-offload-{os.getpid()}-")
        store.swap_out("k", np.ones(10_000, np.uint8)).result()
        with OffloadStore(tmp_path) as other:
            assert other.path != store.path and "k" not in other
    assert os.listdir(tmp_path) == []

    forgotten = OffloadStore(tmp_path)
    forgotten.swap_out("k", np.ones(10_000, np.uint8)).result()
    del forgotten
    gc.collect()
    assert os.listdir(tmp_path) == []


# Run in a process of its own, which forks: a fork of pytest's process would run pytest's
# own exit handlers in the child.
FORKED_CHILD_EXITS = """
import os, sys
import numpy as np
from tensorferry.offload import OffloadStore
from tensorferry.temporaries import remove_if_stale

store = OffloadStore(sys.argv[1])
data = np.arange(100_000, dtype=np.uint32)
store.swap_out("k", data).result()
child = os.fork()
if child == 0:
    sys.exit(0)  # a normal exit, as a DataLoader worker's: exit handlers and finalizers run
assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
assert os.path.isdir(store.path), "the child's exit removed the parent's store"
assert not remove_if_stale(store.path), "the child's exit let go of the parent's lock"
back = np.zeros_like(data)
store.swap_in("k", back).result()
assert (back == data).all()
store.close()
assert not os.path.exists(store.path)
"""


def test_a_forked_child_exiting_leaves_the_parents_store(tmp_path):
    run = subprocess.run([sys.executable, "-c", FORKED_CHILD_EXITS, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert os.listdir(tmp_path) == []


def test_a_forked_child_is_refused_the_store_and_leaves_the_parents_files(tmp_path, backend):
    """A write in flight at a fork fails in the child (ECANCELED): a child that only asked
    `key in store` took it for a failed write and removed the key's file, the parent's.
    A child's swap_out truncated or removed the parent's file before it was refused. Now
    every call in the child but close() is refused, naming the store's process."""
    rng = np.random.default_rng(13)
    kept, pending_data = random_bytes(rng, MiB + 5), random_bytes(rng, 16 * MiB)
    with slow_engine(backend) as engine, OffloadStore(tmp_path, engine) as store:
        store.swap_out("kept", kept).result()
        pending = store.swap_out("pending", pending_data)  # most likely in flight at the fork
        calls = [lambda: "kept" in store, store.keys, store.stats, lambda: store.nbytes("pending"),
                 lambda: store.prefetch(["kept"]), lambda: store.swap_in("kept", np.empty(2 * MiB, np.uint8)),
                 lambda: store.swap_out("kept", b"other size"), lambda: store.swap_out("kept", kept),
                 lambda: store.delete("kept")]
        pid = os.fork()
        if pid == 0:  # the child reports through its exit status only
            code = 1
            try:
                signal.alarm(30)  # a hang ends the child, not the test run
                for number, call in enumerate(calls):
                    try:
                        call()
                        code = 10 + number  # not refused
                        break
                    except tensorferry.EngineClosedError as exc:
                        if f"process {os.getppid()}" not in str(exc):
                            code = 40 + number
                            break
                else:
                    store.close()
                    code = 0
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        pending.result()
        assert sorted(store.keys()) == ["kept", "pending"]
        np.testing.assert_array_equal(swapped_back(store, "kept"), kept)
        np.testing.assert_array_equal(swapped_back(store, "pending"), pending_data)


def test_a_swap_out_refused_before_any_io_keeps_what_the_key_held(tmp_path, backend):
    """With the store's engine closed, swap_out raised and the key's earlier data was gone:
    its file was truncated (a new size) or removed (both sizes) before the refusal."""
    data = random_bytes(np.random.default_rng(14), MiB + 5)
    engine = tensorferry.Engine(backend=backend)
    with OffloadStore(tmp_path, engine) as store:
        store.swap_out("k", data).result()
        engine.close()  # a shared engine that another part of the program closed, say
        for other in (data, data[:100]):
            with pytest.raises(tensorferry.EngineClosedError):
                store.swap_out("k", other)
        assert store.keys() == ["k"] and store.nbytes("k") == data.nbytes
        (name,) = os.listdir(store.path)
        np.testing.assert_array_equal(np.fromfile(os.path.join(store.path, name), np.uint8), data)


CTRL_C_DURING_A_PREFETCHED_SWAP_IN = """
import os, signal, sys, threading
import numpy as np, tensorferry
from tensorferry.offload import OffloadStore

MiB = 1 << 20
with tensorferry.Engine(backend=sys.argv[2], block_size=64 << 10, queue_depth=1, threads=1) as engine, \
        OffloadStore(sys.argv[1], engine, max_pool_bytes=64 * MiB) as store:
    data = np.random.default_rng(0).integers(0, 256, 48 * MiB, dtype=np.uint8)
    store.swap_out("k", data).result()
    store.swap_out("j", data).result()
    assert store.prefetch(["k"]) == 1
    read = store._slots["k"].staged.future
    main, waiting = threading.get_ident(), tensorferry.IOFuture.wait.__code__
    def interrupt():  # once swap_in waits for the prefetch read
        while not read.done() and sys._current_frames()[main].f_code is not waiting:
            pass
        os.kill(os.getpid(), signal.SIGINT)
    sender = threading.Thread(target=interrupt)
    out = np.empty_like(data)
    try:
        sender.start()
        store.swap_in("k", out).result()
        print("no KeyboardInterrupt")
    except KeyboardInterrupt:
        print("interrupted while", "done" if read.done() else "pending")
    sender.join()
    read.wait()
    store.swap_in("k", out).result()  # from the prefetch, which is kept
    print(bool((out == data).all()), store.stats()["prefetch_hits"], store.prefetch(["j"]))
"""


def test_ctrl_c_during_a_prefetched_swap_in_keeps_the_prefetch(tmp_path, backend):
    """Ctrl-C while swap_in waited for a prefetch read lost its pinned buffer for good: the
    store's prefetch memory stayed charged, and later prefetches started nothing."""
    run = subprocess.run([sys.executable, "-c", CTRL_C_DURING_A_PREFETCHED_SWAP_IN, str(tmp_path), backend],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    interrupted, after = run.stdout.split("\n")[:2]
    assert interrupted.startswith("interrupted while") and after == "True 1 1", run.stdout


CTRL_C_DURING_CLOSE = """
import os, signal, sys, threading
import numpy as np, tensorferry
from tensorferry.offload import OffloadStore

with tensorferry.config_override(backend=sys.argv[2], block_size=64 << 10, queue_depth=1, threads=1):
    store = OffloadStore(sys.argv[1])  # with an engine of its own, slow
future = store.swap_out("k", np.ones(64 << 20, np.uint8))
main, waiting = threading.get_ident(), tensorferry.IOFuture.wait.__code__
def interrupt():  # once close() waits for the write
    while not future.done() and sys._current_frames()[main].f_code is not waiting:
        pass
    os.kill(os.getpid(), signal.SIGINT)
sender = threading.Thread(target=interrupt)
try:
    sender.start()
    store.close()
    print("no KeyboardInterrupt")
except KeyboardInterrupt:
    print("interrupted while", "done" if future.done() else "pending")
sender.join()
store.close()
print(store.closed, future.done(), os.path.exists(store.path), store._engine.closed)
"""


def test_ctrl_c_during_close_leaves_the_rest_to_a_later_close(tmp_path, backend):
    """Ctrl-C while close() waited for the I/O left the store marked closed, and a second
    close() returned at once: the store's folder, engine threads and pool stayed."""
    run = subprocess.run([sys.executable, "-c", CTRL_C_DURING_CLOSE, str(tmp_path), backend],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    interrupted, after = run.stdout.split("\n")[:2]
    assert interrupted.startswith("interrupted while") and after == "True True False True", run.stdout
    assert os.listdir(tmp_path) == []


MANY_REQUESTS_AT_A_LOW_DESCRIPTOR_LIMIT = """
import resource, sys
import numpy as np, tensorferry
from tensorferry.offload import OffloadStore

resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
with tensorferry.Engine(backend=sys.argv[2], block_size=64 << 10, queue_depth=1, threads=1) as engine, \
        OffloadStore(sys.argv[1], engine, max_pool_bytes=64 << 20) as store:
    written = [np.full(256 << 10, i, np.uint8) for i in range(100)]
    futures = [store.swap_out(f"k{i}", data) for i, data in enumerate(written)]  # none waited for yet
    assert sum(f.result() for f in futures) == 100 * (256 << 10)
    started = store.prefetch([f"k{i}" for i in range(100)])
    back = [np.empty(256 << 10, np.uint8) for _ in written]
    reads = [store.swap_in(f"k{i}", out) for i, out in enumerate(back)]
    for read in reads:
        read.result()
    assert all((a == b).all() for a, b in zip(back, written))
    print(0 < started < 100, store.stats()["prefetch_hits"] == started)
"""


def test_many_requests_in_flight_stay_under_the_descriptor_limit(tmp_path, backend):
    """Each request in flight holds its file open (two descriptors), and the store started
    as many as it was asked: 100 swap_outs not yet waited for, at a limit of 64
    descriptors, failed with EMFILE (at 1024, a model of some thousand tensors did)."""
    run = subprocess.run([sys.executable, "-c", MANY_REQUESTS_AT_A_LOW_DESCRIPTOR_LIMIT, str(tmp_path), backend],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[0] == "True True", run.stdout


def test_works_on_dev_shm(engine):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    directory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        data = random_bytes(np.random.default_rng(11), 2 * MiB + 5)
        with OffloadStore(directory, engine) as store:
            store.swap_out("k", data).result()
            store.prefetch(["k"])
            np.testing.assert_array_equal(swapped_back(store, "k"), data)
            assert store.stats()["prefetch_hits"] == 1
        assert os.listdir(directory) == []
    finally:
        os.rmdir(directory)


def test_disk_full_raises_enospc_and_forgets_the_key(engine):
    rng = np.random.default_rng(12)
    with mounted("tmpfs", "size=8m") as small, OffloadStore(small, engine) as store:
        kept = random_bytes(rng, 3 * MiB)
        store.swap_out("kept", kept).result()
        with pytest.raises(OSError) as info:
            store.swap_out("big", random_bytes(rng, 6 * MiB)).result()
        assert info.value.errno == errno.ENOSPC
        assert "big" not in store and store.keys() == ["kept"]
        with pytest.raises(KeyError):
            store.swap_in("big", np.empty(6 * MiB, np.uint8))

        # Growing an existing key past the free space loses that key, never half of it.
        with pytest.raises(OSError) as info:
            store.swap_out("kept", random_bytes(rng, 9 * MiB)).result()
        assert info.value.errno == errno.ENOSPC
        assert "kept" not in store and store.stats()["disk_bytes"] == 0

        # The space came back: the store goes on working.
        data = random_bytes(rng, 6 * MiB)
        store.swap_out("big", data).result()
        np.testing.assert_array_equal(swapped_back(store, "big"), data)

        # A write that fails in flight (a small, buffered one on a full drive) fails its future.
        with open(os.path.join(small, "filler"), "wb", buffering=0) as filler:
            with pytest.raises(OSError):
                while True:
                    filler.write(bytes(4096))
        pending = store.swap_out("tiny", b"x" * 100)
        with pytest.raises(OSError) as info:
            pending.result()
        assert info.value.errno == errno.ENOSPC
        with pytest.raises(KeyError, match="failed"):
            store.swap_in("tiny", bytearray(100))
        assert "tiny" not in store and store.keys() == ["big"]


def test_a_failed_swap_out_raises_the_writes_error_not_the_clean_ups(engine):
    """On a filesystem gone read-only the key's file cannot be made, nor removed: the
    clean-up's bare OSError (EROFS, no file named) replaced the engine's error."""
    with mounted("tmpfs", "size=8m") as small, OffloadStore(small, engine) as store:
        subprocess.run(["mount", "-o", "remount,ro", small], check=True)
        try:
            with pytest.raises(tensorferry.TensorferryIOError) as info:
                store.swap_out("k", np.ones(4096, np.uint8))
        finally:
            subprocess.run(["mount", "-o", "remount,rw", small], check=True)
        assert info.value.errno == errno.EROFS
        assert os.path.dirname(info.value.filename) == store.path
        assert "k" not in store and store.keys() == []
