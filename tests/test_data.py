"""FileSource against real files: order, read-ahead, batches, shuffle, shard, records, errors."""

import errno
import os
import shutil
import tempfile

import numpy as np
import pytest

import tensorferry
from tensorferry.data import FileSource

SIZES = [0, 1, 4095, 4096, 4097, 100_003, (1 << 20) + 5] + [1000 + 37 * i for i in range(13)]


def write_files(directory, sizes, seed=0):
    rng = np.random.default_rng(seed)
    paths, contents = [], []
    for i, n in enumerate(sizes):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        path = os.path.join(directory, f"item{i:03d}.bin")
        data.tofile(path)
        paths.append(path)
        contents.append(data)
    return paths, contents


@pytest.fixture
def files(tmp_path):
    return write_files(tmp_path, SIZES)


def test_iteration_yields_every_item_in_order(files, engine):
    paths, contents = files
    source = FileSource(paths, engine=engine, window=4)
    assert len(source) == len(paths)
    got = list(source)
    assert len(got) == len(contents)
    for array, expected in zip(got, contents):
        assert array.dtype == np.uint8 and array.ndim == 1
        np.testing.assert_array_equal(array, expected)
    assert len({array.ctypes.data for array in got if array.nbytes}) == sum(1 for n in SIZES if n)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_reads_stay_in_flight_ahead(files, engine, window):
    paths, contents = files
    iterator = iter(FileSource(paths, engine=engine, window=window))
    np.testing.assert_array_equal(next(iterator), contents[0])
    assert iterator.in_flight == window
    # Reads already started hold their files open; the ones after them open files now gone.
    for path in paths:
        os.unlink(path)
    for i in range(1, window + 1):
        np.testing.assert_array_equal(next(iterator), contents[i])
    with pytest.raises(OSError) as info:
        next(iterator)
    assert info.value.errno == errno.ENOENT and paths[window + 1] in str(info.value)
    iterator.close()
    assert iterator.in_flight == 0
    with pytest.raises(StopIteration):
        next(iterator)


def test_in_flight_never_exceeds_the_window(files, engine):
    paths, _ = files
    iterator = iter(FileSource(paths, engine=engine, window=5))
    for taken in range(1, len(paths) + 1):
        next(iterator)
        assert iterator.in_flight == min(5, len(paths) - taken)
    with pytest.raises(StopIteration):
        next(iterator)


def test_read_batch_and_getitem(files, engine):
    paths, contents = files
    source = FileSource(paths, engine=engine)
    indices = [6, 0, 6, -1, 2, 5]
    batch = source.read_batch(indices)
    for array, i in zip(batch, indices):
        np.testing.assert_array_equal(array, contents[i])
    assert batch[0].ctypes.data != batch[2].ctypes.data  # the same item twice: two buffers
    np.testing.assert_array_equal(source[-2], contents[-2])
    np.testing.assert_array_equal(source[np.int64(3)], contents[3])
    assert source.read_batch([]) == []
    with pytest.raises(IndexError):
        source[len(paths)]


def test_shuffle_is_a_deterministic_permutation(files, engine):
    paths, contents = files
    source = FileSource(paths, engine=engine, window=4)
    first, again, other = source.shuffle(7), source.shuffle(7), source.shuffle(8)
    assert first.records == again.records
    assert first.records != other.records != source.records
    assert sorted(first.records) == sorted(source.records)
    by_path = dict(zip(paths, contents))
    for (path, _, _), array in zip(first.records, first):
        np.testing.assert_array_equal(array, by_path[path])


def test_a_source_pickles_as_its_items_for_another_process(files, engine):
    import pickle
    paths, contents = files
    source = FileSource(paths, window=3).shard(1, 2)  # derived sources too
    copy = pickle.loads(pickle.dumps(source))
    assert copy.records == source.records and copy.window == 3
    for array, expected in zip(copy, contents[1::2]):
        np.testing.assert_array_equal(array, expected)
        copy.release(array)  # its own pool
    with pytest.raises(TypeError, match="explicit engine"):
        pickle.dumps(FileSource(paths, engine=engine))


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_shards_cover_every_item_exactly_once(files, engine, count):
    paths, contents = files
    source = FileSource(paths, engine=engine).shuffle(3)
    seen = []
    for index in range(count):
        shard = source.shard(index, count)
        for (path, _, _), array in zip(shard.records, shard):
            np.testing.assert_array_equal(array, contents[paths.index(path)])
            seen.append(path)
    assert sorted(seen) == sorted(paths)
    with pytest.raises(ValueError):
        source.shard(count, count)


def test_records_with_offsets(tmp_path, engine):
    (path,), (data,) = write_files(tmp_path, [3 << 20])
    records = [(path, 0, 10), (path, 1, 4095), (path, 4096, 8192), (path, 12_345, 1 << 20),
               (path, (3 << 20) - 7, 7), (path, 500, 0), (path, 0, 3 << 20)]
    source = FileSource(records + [path], engine=engine, window=3)
    got = list(source)
    for (_, offset, length), array in zip(records, got):
        np.testing.assert_array_equal(array, data[offset:offset + length])
    np.testing.assert_array_equal(got[-1], data)
    assert source.records[-1] == (path, 0, 3 << 20)


def test_record_past_the_end_raises_the_engine_error(tmp_path, engine):
    (path,), (data,) = write_files(tmp_path, [10_000])
    source = FileSource([(path, 0, 100), (path, 9_000, 2_000), (path, 200, 50)], engine=engine)
    with pytest.raises(tensorferry.TensorferryIOError) as info:
        source[1]
    assert info.value.errno == errno.ENODATA
    iterator = iter(source)
    np.testing.assert_array_equal(next(iterator), data[:100])
    with pytest.raises(tensorferry.TensorferryIOError):
        next(iterator)
    np.testing.assert_array_equal(next(iterator), data[200:250])  # goes on past a failed item
    with pytest.raises(tensorferry.TensorferryIOError):
        source.read_batch([0, 1, 2])


def test_construction_errors(tmp_path):
    missing = str(tmp_path / "missing.bin")
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        FileSource([missing])
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        FileSource([(missing, 0, 10)])
    with pytest.raises(IsADirectoryError):
        FileSource([tmp_path])
    # A FIFO or a device read whole: its st_size (0) is not its length, and it came back as
    # an empty item without a word. A range of one is the reader's to ask for.
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    for special in (fifo, os.devnull):
        with pytest.raises(ValueError, match="not a regular file") as info:
            FileSource([special])
        assert repr(special) in str(info.value)
    assert FileSource([(os.devnull, 0, 0)]).records == ((os.devnull, 0, 0),)
    (path,), _ = write_files(tmp_path, [100])
    with pytest.raises(ValueError):
        FileSource([(path, -1, 10)])
    with pytest.raises(TypeError):
        FileSource([(path, 10)])
    with pytest.raises(ValueError):
        FileSource([path], window=0)


def test_release_recycles_buffers(files, engine):
    paths, contents = files
    pool = tensorferry.PinnedPool()
    source = FileSource(paths, engine=engine, pool=pool)
    for array, expected in zip(source, contents):
        np.testing.assert_array_equal(array, expected)
        source.release(array)
    assert pool.cached_bytes > 0
    array = source[1]
    source.release(array)
    with pytest.raises(ValueError):
        source.release(array)
    with pytest.raises(ValueError):
        source.release(np.zeros(10, np.uint8))
    # Derived sources share the pool and what it lent.
    shuffled = source.shuffle(1)
    array = shuffled[0]
    source.release(array)


def test_a_batch_shares_one_buffer_given_back_with_its_last_array(tmp_path, engine):
    """read_batch reads its items into one pool buffer (aligned slots, one request per
    file): it goes back to the pool when every array of the batch has been released,
    and lives on while any of them is referenced."""
    paths, contents = write_files(tmp_path, [5000, 4096, 1, 0, 70_000])
    pool = tensorferry.PinnedPool()
    source = FileSource([*paths, (paths[4], 3, 60_000)], engine=engine, pool=pool)
    batch = source.read_batch([4, 0, 5, 2, 3, 0])
    expected = [contents[4], contents[0], contents[4][3:60_003], contents[2], contents[3], contents[0]]
    for array, want in zip(batch, expected):
        np.testing.assert_array_equal(array, want)
        assert array.ctypes.data % 4096 == 0  # O_DIRECT's alignment, each in its own slot
    assert len({a.base.ctypes.data for a in batch}) == 1, "one buffer"
    assert batch[1].ctypes.data != batch[5].ctypes.data
    for array in batch[:-1]:
        source.release(array)
    assert pool.cached_bytes == 0, "back only with the last array"
    with pytest.raises(ValueError):
        source.release(batch[0])
    source.release(batch[-1])
    assert pool.cached_bytes > 0
    # Never released: the arrays keep their buffer, whatever reads come after.
    kept = source.read_batch([0, 4])
    again = source.read_batch([0, 4])
    del again
    np.testing.assert_array_equal(kept[0], contents[0])
    np.testing.assert_array_equal(kept[1], contents[4])


def test_a_failed_batch_raises_once_its_reads_are_done_and_keeps_nothing(tmp_path, engine):
    (first, second), (data, _) = write_files(tmp_path, [10_000, 100])
    pool = tensorferry.PinnedPool()
    source = FileSource([(first, 0, 100), (second, 50, 100), (first, 200, 50)], engine=engine, pool=pool)
    with pytest.raises(tensorferry.TensorferryIOError, match=os.path.basename(second)) as info:
        source.read_batch([0, 1, 2])
    assert info.value.errno == errno.ENODATA
    assert pool.cached_bytes > 0, "the batch's buffer went back to the pool"
    np.testing.assert_array_equal(source.read_batch([2])[0], data[200:250])


def test_closing_an_iterator_early_returns_its_buffers(files, engine):
    paths, _ = files
    pool = tensorferry.PinnedPool()
    with iter(FileSource(paths, engine=engine, pool=pool, window=6)) as iterator:
        next(iterator)
        assert iterator.in_flight == 6
    assert iterator.in_flight == 0 and pool.cached_bytes > 0


def test_default_engine_and_dev_shm():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    directory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        paths, contents = write_files(directory, SIZES[:8], seed=5)
        source = FileSource(paths).shuffle(2)
        expected = [contents[i] for i in np.random.default_rng(2).permutation(8)]
        for array, data in zip(source, expected, strict=True):
            np.testing.assert_array_equal(array, data)
    finally:
        shutil.rmtree(directory)
