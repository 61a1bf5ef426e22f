"""The TensorFlow adapter: make_dataset over real files, in real tf.data pipelines."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

from tensorferry.adapters.tensorflow import make_dataset, tfrecord_records  # noqa: E402


def payloads(n: int, seed: int = 0, size: int = 3000) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(0, size)), dtype=np.uint8).tobytes() for _ in range(n)]


@pytest.fixture
def whole_files(tmp_path):
    data = payloads(23)
    for i, d in enumerate(data):
        (tmp_path / f"f{i:03d}.bin").write_bytes(d)
    return tmp_path, data


@pytest.fixture
def tfrecords(tmp_path):
    data = payloads(40, seed=1)
    paths = []
    for shard in range(3):
        path = str(tmp_path / f"part-{shard}.tfrecord")
        with tf.io.TFRecordWriter(path) as w:
            for d in data[shard::3]:
                w.write(d)
        paths.append(path)
    ordered = [d for shard in range(3) for d in data[shard::3]]
    return paths, ordered


def test_whole_files_in_order_through_a_pipeline(whole_files) -> None:
    root, data = whole_files
    ds = make_dataset(str(root / "f*.bin"), reads_per_call=4)
    assert [x.numpy() for x in ds] == data
    lengths = ds.map(tf.strings.length).batch(5).prefetch(tf.data.AUTOTUNE)
    assert np.concatenate([b.numpy() for b in lengths]).tolist() == [len(d) for d in data]
    listed = make_dataset([root / "f000.bin", root / "f005.bin"])
    assert [x.numpy() for x in listed] == [data[0], data[5]]


def test_fixed_length_records(tmp_path) -> None:
    raw = np.random.default_rng(2).integers(0, 256, size=(50, 128), dtype=np.uint8)
    (tmp_path / "a.bin").write_bytes(raw[:20].tobytes())
    (tmp_path / "b.bin").write_bytes(raw[20:].tobytes())
    ds = make_dataset([str(tmp_path / "a.bin"), str(tmp_path / "b.bin")], record_bytes=128, reads_per_call=7)
    assert ds.element_spec.shape.as_list() == [128] and ds.element_spec.dtype == tf.uint8
    got = np.stack([x.numpy() for x in ds])
    np.testing.assert_array_equal(got, raw)
    batched = ds.map(lambda r: tf.cast(r, tf.float32) / 255.0).batch(16)
    assert sum(int(b.shape[0]) for b in batched) == 50
    (tmp_path / "c.bin").write_bytes(raw[:3].tobytes()[:-5])
    with pytest.raises(ValueError, match="truncated"):
        make_dataset(str(tmp_path / "c.bin"), record_bytes=128)


def test_tfrecord_matches_tensorflows_own_reader(tfrecords) -> None:
    paths, ordered = tfrecords
    ours = [x.numpy() for x in make_dataset(paths, tfrecord=True, reads_per_call=5)]
    stock = [x.numpy() for x in tf.data.TFRecordDataset(paths)]
    assert ours == stock == ordered
    shuffled = [x.numpy() for x in make_dataset(paths, tfrecord=True, shuffle=True, seed=1)]
    assert shuffled != ordered and sorted(shuffled) == sorted(ordered)
    first_file = [length - 4 for _, _, length in tfrecord_records(paths[0])]  # data + CRC footer
    assert first_file == [len(d) for d in ordered[:len(first_file)]] and len(first_file) == 14


def test_tfrecord_corruption_is_caught(tfrecords, tmp_path) -> None:
    paths, _ = tfrecords
    raw = bytearray(open(paths[1], "rb").read())
    first_length = int.from_bytes(raw[:8], "little")
    raw[12 + first_length // 2] ^= 0x01  # a data byte of the first record
    bad = tmp_path / "bad.tfrecord"
    bad.write_bytes(bytes(raw))
    with pytest.raises(tf.errors.OpError, match="bad data CRC"):
        list(make_dataset([str(bad)], tfrecord=True))
    (tmp_path / "short.tfrecord").write_bytes(open(paths[0], "rb").read()[:-3])
    with pytest.raises(ValueError, match="truncated record at offset .* past the end"):
        tfrecord_records(str(tmp_path / "short.tfrecord"))
    with pytest.raises(tf.errors.DataLossError, match="truncated record at offset .* past the end"):
        list(make_dataset([str(tmp_path / "short.tfrecord")], tfrecord=True))
    (tmp_path / "not.tfrecord").write_bytes(b"x" * 40)
    with pytest.raises(ValueError, match="length CRC"):
        tfrecord_records(str(tmp_path / "not.tfrecord"))
    with pytest.raises(tf.errors.DataLossError, match="length CRC at offset 0"):
        list(make_dataset([str(tmp_path / "not.tfrecord")], tfrecord=True))


def test_a_damaged_tfrecord_file_reads_as_tensorflows_reader_reads_it(tfrecords, tmp_path) -> None:
    """A file whose writer was killed mid-record, or with a length whose CRC is wrong, made
    make_dataset raise ValueError when called: no dataset, and ignore_errors() could not
    help. Now its records before the damage come, then DataLossError naming the file and
    offset, where TFRecordDataset raises it; ignore_errors() skips it and (as for
    TFRecordDataset) the rest of that file. A partial header at the end of a file ends it,
    with no error, as it does for TFRecordDataset."""
    paths, _ = tfrecords
    headers = [offset - 12 for _, offset, _ in tfrecord_records(paths[0])]
    cut = tmp_path / "cut.tfrecord"
    cut.write_bytes(open(paths[0], "rb").read()[:-7])
    raw = bytearray(open(paths[1], "rb").read())
    fifth = [offset - 12 for _, offset, _ in tfrecord_records(paths[1])][4]
    raw[fifth + 9] ^= 0x01
    bad_length = tmp_path / "bad-length.tfrecord"
    bad_length.write_bytes(bytes(raw))
    partial = tmp_path / "partial-header.tfrecord"
    partial.write_bytes(open(paths[2], "rb").read() + bytes(5))
    files = [paths[2], str(cut), str(partial), str(bad_length), paths[0]]

    def until_error(ds: tf.data.Dataset) -> tuple[list, type | None, str]:
        got = []
        try:
            for x in ds:
                got.append(x.numpy())
        except tf.errors.OpError as e:
            return got, type(e), e.message
        return got, None, ""

    stock = tf.data.TFRecordDataset(files)
    stock_before, error, _ = until_error(stock)
    stock_all = [x.numpy() for x in stock.ignore_errors()]
    assert error is tf.errors.DataLossError and len(stock_all) == 13 + 13 + 13 + 4 + 14
    for ds in (make_dataset(files, tfrecord=True), make_dataset(files, tfrecord=True, reads_per_call=3)):
        before, error, message = until_error(ds)
        assert (before, error) == (stock_before, tf.errors.DataLossError)
        assert f"{cut}: truncated record at offset {headers[-1]}" in message
        assert [x.numpy() for x in ds.ignore_errors()] == stock_all
    shuffled = make_dataset(files, tfrecord=True, shuffle=True, seed=2)
    assert sorted(x.numpy() for x in shuffled.ignore_errors()) == sorted(stock_all)
    with pytest.raises(tf.errors.DataLossError, match=f"{bad_length}: bad length CRC at offset {fifth}"):
        list(make_dataset(files[3:], tfrecord=True))
    with pytest.raises(tf.errors.DataLossError, match=f"{cut}: truncated record"):  # the batch that holds it
        list(make_dataset(files, tfrecord=True, batch_size=4))
    alone = [x.numpy() for x in make_dataset([str(partial)], tfrecord=True)]
    assert alone == [x.numpy() for x in tf.data.TFRecordDataset([str(partial)])] and len(alone) == 13


def test_tfrecord_crc_checked_while_copied_across_chunks(tmp_path) -> None:
    # Staged records are copied out 64 KiB at a time, each chunk summed from the cache:
    # sizes around chunk boundaries, and a flipped byte in a record's last chunk. Small
    # records after large ones: the framing scan reads one page after a record longer
    # than its window, then whole windows again.
    sizes = [65535, 65536, 65537, 3 * 65536 + 5, 200003, 10, 3000, 0, 70000, 5, 4090]
    rng = np.random.default_rng(11)
    records = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in sizes]
    path = tmp_path / "chunks.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as w:
        for r in records:
            w.write(r)
    ours = [x.numpy() for x in make_dataset([str(path)], tfrecord=True, reads_per_call=2)]
    assert ours == [x.numpy() for x in tf.data.TFRecordDataset([str(path)])] == records
    raw = bytearray(path.read_bytes())
    start = sum(16 + n for n in sizes[:3]) + 12  # the fourth record's data
    raw[start + sizes[3] - 2] ^= 0x40
    bad = tmp_path / "bad-late.tfrecord"
    bad.write_bytes(bytes(raw))
    with pytest.raises(tf.errors.DataLossError, match=rf"bad data CRC in the record at offset {start - 12}"):
        list(make_dataset([str(bad)], tfrecord=True))


def test_shuffle_is_deterministic_by_seed_and_complete(whole_files) -> None:
    root, data = whole_files
    pattern = str(root / "*.bin")
    a = [x.numpy() for x in make_dataset(pattern, shuffle=True, seed=7)]
    b = [x.numpy() for x in make_dataset(pattern, shuffle=True, seed=7)]
    c = [x.numpy() for x in make_dataset(pattern, shuffle=True, seed=8)]
    assert a == b and a != c and a != data
    assert sorted(a) == sorted(data)
    ds = make_dataset(pattern, shuffle=True, seed=7)
    epochs = [[x.numpy() for x in ds] for _ in range(3)]
    assert epochs[0] == a and epochs[1] != a and epochs[2] not in (a, epochs[1])  # a new order each epoch
    repeated = [x.numpy() for x in make_dataset(pattern, shuffle=True, seed=7).repeat(2)]
    assert repeated[:len(a)] == a and repeated[len(a):] != a and sorted(repeated[len(a):]) == sorted(data)
    unseeded = [x.numpy() for x in make_dataset(pattern, shuffle=True)]
    assert sorted(unseeded) == sorted(data)


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_shards_cover_every_item_once(whole_files, count: int) -> None:
    root, data = whole_files
    seen = []
    for index in range(count):
        seen += [x.numpy() for x in make_dataset(str(root / "*.bin"), shard=(index, count))]
    assert sorted(seen) == sorted(data) and len(seen) == len(data)


def test_tf_distribute_input_pipeline(tmp_path) -> None:
    raw = np.arange(64 * 16, dtype=np.uint8).reshape(64, 16)
    (tmp_path / "r.bin").write_bytes(raw.tobytes())
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    ds = make_dataset(str(tmp_path / "r.bin"), record_bytes=16).batch(8)
    rows = []
    for batch in strategy.experimental_distribute_dataset(ds):
        for local in strategy.experimental_local_results(batch):
            rows.append(local.numpy())
    np.testing.assert_array_equal(np.concatenate(rows), raw)


_WORKER = r"""
import json, sys
import tensorflow as tf
from tensorferry.adapters.tensorflow import make_dataset

paths = sys.argv[1:]
tf.random.set_seed(11)  # the workers' unseeded shuffles agree, as stock ones would
strategy = tf.distribute.MultiWorkerMirroredStrategy()
task = strategy.cluster_resolver.task_id


def rows_of(distributed) -> list:
    return [bytes(row).hex() for batch in distributed for local in strategy.experimental_local_results(batch)
            for row in local.numpy()]


ways = {
    "from_function": strategy.distribute_datasets_from_function(
        lambda ctx: make_dataset(paths, record_bytes=16, shard=(ctx.input_pipeline_id, ctx.num_input_pipelines))
        .batch(4)),
    "sharded, then distributed": strategy.experimental_distribute_dataset(
        make_dataset(paths, record_bytes=16, shard=(task, 2)).batch(4)),
    "auto-sharded": strategy.experimental_distribute_dataset(make_dataset(paths, record_bytes=16).batch(4)),
    "auto-sharded, shuffled": strategy.experimental_distribute_dataset(
        make_dataset(paths, record_bytes=16, shuffle=True, seed=5).batch(4)),
    "auto-sharded, shuffled after tf.random.set_seed": strategy.experimental_distribute_dataset(
        make_dataset(paths, record_bytes=16, shuffle=True).batch(4)),
}
print("ROWS" + json.dumps({way: rows_of(dataset) for way, dataset in ways.items()}))
"""


def test_two_workers_of_multi_worker_mirrored_strategy(tmp_path) -> None:
    """Two processes of MultiWorkerMirroredStrategy: every record reaches exactly one
    worker, whether the dataset is sharded per input pipeline, sharded by hand and then
    distributed (auto-sharding must not shard it again), or left to auto-sharding, which
    shards by data: shuffled too, given a seed or tf.random.set_seed."""
    import json

    from conftest import free_ports, run_processes

    raw = np.random.default_rng(3).integers(0, 256, (4, 40, 16), dtype=np.uint8)
    paths = []
    for i, rows in enumerate(raw):
        (tmp_path / f"f{i}.bin").write_bytes(rows.tobytes())
        paths.append(str(tmp_path / f"f{i}.bin"))
    workers = [f"localhost:{port}" for port in free_ports(2)]
    outputs = run_processes(_WORKER, [(paths, dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}))) for index in range(2)],
        timeout=180)
    results = [json.loads(next(line for line in out.splitlines() if line.startswith("ROWS"))[4:]) for out in outputs]
    every_row = sorted(bytes(row).hex() for rows in raw for row in rows)
    for way in results[0]:
        first, second = (r[way] for r in results)
        assert sorted(first + second) == every_row, way
        assert len(first) == len(second) == len(every_row) // 2, way


_SERVICE_WORKER = r"""
import sys
import tensorflow as tf
import tensorferry.adapters.tensorflow  # registers the native ops: all a worker needs of tensorferry

config = tf.data.experimental.service.WorkerConfig(dispatcher_address=sys.argv[1])
worker = tf.data.experimental.service.WorkerServer(config)
worker.join()
"""


def test_a_tf_data_service_worker_in_another_process(tmp_path) -> None:
    """tf.data service: the dataset's graph, native reads included, runs in a worker
    process that built no dataset; importing the adapter registers the ops it needs
    (before, the worker failed with "Op type not registered 'TensorferryStartReads'")."""
    import subprocess
    import sys

    raw = np.random.default_rng(8).integers(0, 256, (64, 1024), dtype=np.uint8)
    (tmp_path / "r.rec").write_bytes(raw.tobytes())
    dispatcher = tf.data.experimental.service.DispatchServer()
    worker = subprocess.Popen([sys.executable, "-c", _SERVICE_WORKER, dispatcher.target.split("://")[1]],
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    try:
        ds = make_dataset(str(tmp_path / "r.rec"), record_bytes=1024, batch_size=8).apply(
            tf.data.experimental.service.distribute(processing_mode="parallel_epochs", service=dispatcher.target))
        got = np.concatenate([batch.numpy() for batch in ds])
    finally:
        worker.kill()
        worker.wait()
    np.testing.assert_array_equal(got, raw)


def test_batches_are_made_by_the_reads(whole_files, tfrecords, tmp_path) -> None:
    """batch_size: each batch is one call's reads, as .batch() would make it."""
    raw = np.random.default_rng(6).integers(0, 256, size=(50, 4096), dtype=np.uint8)
    (tmp_path / "r.rec").write_bytes(raw.tobytes())
    ds = make_dataset(str(tmp_path / "r.rec"), record_bytes=4096, batch_size=16)
    assert ds.element_spec.shape.as_list() == [None, 4096] and ds.element_spec.dtype == tf.uint8
    batches = [b.numpy() for b in ds]
    assert [len(b) for b in batches] == [16, 16, 16, 2]
    np.testing.assert_array_equal(np.concatenate(batches), raw)
    exact = make_dataset(str(tmp_path / "r.rec"), record_bytes=4096, batch_size=16, drop_remainder=True)
    assert exact.element_spec.shape.as_list() == [16, 4096]
    np.testing.assert_array_equal(np.concatenate([b.numpy() for b in exact]), raw[:48])
    shuffled = make_dataset(str(tmp_path / "r.rec"), record_bytes=4096, batch_size=7, shuffle=True, seed=3,
                            shard=(1, 2))
    rows = np.concatenate([b.numpy() for b in shuffled])
    assert sorted(r.tobytes() for r in rows) == sorted(r.tobytes() for r in raw[1::2])
    assert [r.tobytes() for r in rows] != [r.tobytes() for r in raw[1::2]]
    exact = make_dataset(str(tmp_path / "r.rec"), record_bytes=4096, batch_size=16, drop_remainder=True,
                         shuffle=True, seed=3)
    assert exact.element_spec.shape.as_list() == [16, 4096]
    dropped = [{r.tobytes() for r in raw} - {r.tobytes() for b in exact for r in b.numpy()} for _ in range(4)]
    assert all(len(d) == 2 for d in dropped) and len({frozenset(d) for d in dropped}) > 1  # not always the same
    root, data = whole_files
    strings = make_dataset(str(root / "f*.bin"), batch_size=5)
    assert strings.element_spec.shape.as_list() == [None]
    assert [x for b in strings for x in b.numpy().tolist()] == data
    paths, ordered = tfrecords
    assert [x for b in make_dataset(paths, tfrecord=True, batch_size=6) for x in b.numpy().tolist()] == ordered
    with pytest.raises(ValueError, match="not both"):
        make_dataset(str(tmp_path / "r.rec"), record_bytes=4096, batch_size=4, reads_per_call=4)
    with pytest.raises(ValueError, match="batch_size must be positive"):
        make_dataset(str(tmp_path / "r.rec"), record_bytes=4096, batch_size=0)


@pytest.mark.parametrize("options", [{}, {"shuffle": True}, {"shard": (1, 3)}, {"batch_size": 6},
                                     {"batch_size": 6, "drop_remainder": True},
                                     {"batch_size": 4, "shuffle": True, "shard": (0, 2)}])
def test_the_item_count_is_known(whole_files, tfrecords, tmp_path, options: dict) -> None:
    """len(dataset) and cardinality() give what iterating yields, whole files, records and
    TFRecord alike, so that take/repeat/Keras know an epoch's length."""
    root, _ = whole_files
    (tmp_path / "r.rec").write_bytes(bytes(range(256)) * 10)
    paths, _ = tfrecords
    for ds in (make_dataset(str(root / "f*.bin"), **options),
               make_dataset(str(tmp_path / "r.rec"), record_bytes=64, **options),
               make_dataset(paths, tfrecord=True, **options)):
        count = sum(1 for _ in ds)
        assert len(ds) == ds.cardinality().numpy() == count > 0
        assert ds.repeat(3).cardinality().numpy() == 3 * count and len(ds.skip(1)) == count - 1


def test_keras_fit_knows_each_epochs_steps(tmp_path) -> None:
    """A Keras model trained on parsed fixed-length records: every epoch runs all its
    batches, and Keras, knowing their number, does not warn that the input ran out."""
    import warnings

    keras = pytest.importorskip("keras")
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1000, 8)).astype(np.float32)
    rows = np.concatenate([x, (x.sum(1, keepdims=True) > 0).astype(np.float32)], axis=1)
    (tmp_path / "train.bin").write_bytes(rows.tobytes())

    def parse(batch: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        values = tf.bitcast(tf.reshape(batch, [-1, 9, 4]), tf.float32)
        return values[:, :8], values[:, 8]

    ds = make_dataset(str(tmp_path / "train.bin"), record_bytes=36, batch_size=64, shuffle=True, seed=1).map(parse)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="binary_crossentropy")
    steps = []
    counter = keras.callbacks.LambdaCallback(on_epoch_begin=lambda *_, **__: steps.append(0),
                                             on_train_batch_end=lambda *_, **__: steps.__setitem__(-1, steps[-1] + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(ds, epochs=3, verbose=0, callbacks=[counter])
    assert steps == [16, 16, 16]
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="matches no files"):
        make_dataset(str(tmp_path / "*.nothing"))
    with pytest.raises(FileNotFoundError) as info:
        make_dataset([str(tmp_path / "absent.bin")])
    assert info.value.filename == str(tmp_path / "absent.bin")
    with pytest.raises(IsADirectoryError, match="glob pattern") as info:  # a folder of data: its files are meant
        make_dataset(str(tmp_path))
    assert info.value.filename == str(tmp_path)
    with pytest.raises(ValueError, match="not both"):
        make_dataset(str(tmp_path), record_bytes=4, tfrecord=True)
    (tmp_path / "r.bin").write_bytes(bytes(64))
    for bad in ((2, 2), (-1, 2)):
        with pytest.raises(ValueError, match="0 <= index < count"):
            make_dataset(str(tmp_path / "r.bin"), record_bytes=4, shard=bad)
    for compression in ("GZIP", "ZLIB"):  # TFRecordWriter's options: named, with the reader that takes them
        path = str(tmp_path / f"compressed.{compression}")
        with tf.io.TFRecordWriter(path, options=compression) as writer:
            writer.write(b"x" * 1000)
        with pytest.raises(tf.errors.DataLossError,
                           match=f"starts as a {compression} stream.*compression_type='{compression}'"):
            list(make_dataset(path, tfrecord=True))


def test_a_path_that_is_not_a_readable_file_gets_its_own_error(tmp_path) -> None:
    """Every failure to stat a path was FileNotFoundError(ENOENT), and so was a FIFO or a
    device (os.path.isfile): os.stat's error now comes with its errno and the path, and a
    file that is not regular is named as such."""
    import errno

    (tmp_path / "plain.bin").write_bytes(b"x")
    too_long, through_a_file = str(tmp_path / ("x" * 300)), str(tmp_path / "plain.bin" / "child")
    for path, error, code in ((too_long, OSError, errno.ENAMETOOLONG),
                              (through_a_file, NotADirectoryError, errno.ENOTDIR),
                              (str(tmp_path / "absent.bin"), FileNotFoundError, errno.ENOENT)):
        with pytest.raises(error) as info:
            make_dataset([path])
        assert (info.value.errno, info.value.filename) == (code, path)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    for path in (fifo, os.devnull):
        with pytest.raises(ValueError, match="not a regular file") as info:
            make_dataset([path], tfrecord=True)
        assert repr(path) in str(info.value)


def test_bad_arguments_are_refused_by_name(tmp_path) -> None:
    """reads_per_call=0 raised ZeroDivisionError, -2 and num_parallel_reads=0 TensorFlow's
    errors about shapes and num_parallel_calls; drop_remainder without batch_size was
    ignored."""
    (tmp_path / "r.bin").write_bytes(bytes(64))
    path = str(tmp_path / "r.bin")
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"reads_per_call must be at least 1, got {bad}"):
            make_dataset(path, record_bytes=4, reads_per_call=bad)
        with pytest.raises(ValueError, match=f"num_parallel_reads must be tf.data.AUTOTUNE or at least 1, got {bad}"):
            make_dataset(path, record_bytes=4, num_parallel_reads=bad)
    with pytest.raises(ValueError, match="drop_remainder .* give batch_size"):
        make_dataset(path, record_bytes=4, reads_per_call=5, drop_remainder=True)
    assert len(make_dataset(path, record_bytes=4, num_parallel_reads=1)) == 16


def test_a_bytes_path_and_an_empty_list_as_tensorflow_takes_them(tfrecords) -> None:
    """A bytes path was taken for a list of byte values, and an empty list refused, where
    TFRecordDataset reads the file and makes an empty dataset."""
    paths, ordered = tfrecords
    assert [x.numpy() for x in make_dataset(os.fsencode(paths[0]), tfrecord=True)] == ordered[:14]
    assert [x.numpy() for x in make_dataset([os.fsencode(p) for p in paths], tfrecord=True)] == ordered
    specs = [({}, tf.TensorSpec([], tf.string)), ({"tfrecord": True, "shuffle": True}, tf.TensorSpec([], tf.string)),
             ({"record_bytes": 8}, tf.TensorSpec([8], tf.uint8)),
             ({"record_bytes": 8, "batch_size": 4, "drop_remainder": True}, tf.TensorSpec([4, 8], tf.uint8))]
    for kwargs, spec in specs:
        empty = make_dataset([], **kwargs)
        assert empty.element_spec == spec and len(empty) == 0 and list(empty.repeat(2)) == []


def test_one_read_per_call_path(whole_files, tmp_path) -> None:
    root, data = whole_files
    assert [x.numpy() for x in make_dataset(str(root / "f*.bin"), reads_per_call=1)] == data
    edges = [b"ab\x00c", b"ab\x00c\x00\x00", b"\x00", b"", b"\x00" * 5000 + b"z"]  # NULs inside and at the end
    for i, d in enumerate(edges):
        (tmp_path / f"e{i}.bin").write_bytes(d)
    assert [x.numpy() for x in make_dataset(str(tmp_path / "e*.bin"), reads_per_call=1)] == edges
    raw = np.arange(40 * 8, dtype=np.uint8).reshape(40, 8)
    (tmp_path / "r.rec").write_bytes(raw.tobytes())
    ds = make_dataset(str(tmp_path / "r.rec"), record_bytes=8, reads_per_call=1)
    assert ds.element_spec.shape.as_list() == [8]
    np.testing.assert_array_equal(np.stack([x.numpy() for x in ds]), raw)


def test_large_and_unaligned_items_read_straight_into_tensorflow_strings(tmp_path) -> None:
    # Files larger than a call's batch (one per call, 2 MiB-aligned strings) and of
    # sizes and offsets that are not multiples of the 4 KiB block (the aligned
    # envelope is read, then moved), through O_DIRECT.
    rng = np.random.default_rng(5)
    sizes = [(9 << 20) + 123, (4 << 20) - 1, 4097, 1]
    data = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in sizes]
    for i, d in enumerate(data):
        (tmp_path / f"big{i}.bin").write_bytes(d)
    assert [x.numpy() for x in make_dataset(str(tmp_path / "big*.bin"))] == data
    records = b"".join(data)[: 777 * 5000]
    (tmp_path / "odd.rec").write_bytes(records)
    rows = np.frombuffer(records, np.uint8).reshape(777, 5000)
    in_order = np.stack([x.numpy() for x in make_dataset(str(tmp_path / "odd.rec"), record_bytes=5000)])
    np.testing.assert_array_equal(in_order, rows)
    shuffled = [x.numpy() for x in make_dataset(str(tmp_path / "odd.rec"), record_bytes=5000, shuffle=True, seed=3)]
    assert sorted(r.tobytes() for r in shuffled) == sorted(r.tobytes() for r in rows)
    # Records large enough to be taken one at a time (not a batch per call).
    big_rows = np.frombuffer(b"".join(data)[: 11 * 300_001], np.uint8).reshape(11, 300_001)
    (tmp_path / "big.rec").write_bytes(big_rows.tobytes())
    got = np.stack([x.numpy() for x in make_dataset(str(tmp_path / "big.rec"), record_bytes=300_001)])
    np.testing.assert_array_equal(got, big_rows)


def test_items_of_64_to_512_kib_read_into_their_own_strings(tmp_path) -> None:
    """Whole files and TFRecord records of that size are read into their strings' own
    memory (CRCs checked there), aligned or not, beside smaller and larger ones."""
    rng = np.random.default_rng(9)
    sizes = [64 << 10, 100_000, (300 << 10) + 7, (512 << 10) - 1, 512 << 10, 5000]
    data = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in sizes]
    for i, d in enumerate(data):
        (tmp_path / f"img{i}.bin").write_bytes(d)
    assert [x.numpy() for x in make_dataset(str(tmp_path / "img*.bin"))] == data
    path = str(tmp_path / "mid.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        for d in data:
            w.write(d)
    assert [x.numpy() for x in make_dataset(path, tfrecord=True)] == data
    assert [x.numpy() for x in make_dataset(path, tfrecord=True)] == [
        x.numpy() for x in tf.data.TFRecordDataset(path)]
    with open(path, "r+b") as f:  # a flipped byte inside the 100 000-byte record
        f.seek((64 << 10) + 16 + 12 + 50_000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(tf.errors.DataLossError, match="bad data CRC"):
        list(make_dataset(path, tfrecord=True))


class _DLPackCapsule:
    """TensorFlow's DLPack capsule where tensors have no ``__dlpack__`` (before 2.16)."""

    def __init__(self, tensor: tf.Tensor) -> None:
        self._capsule = tf.experimental.dlpack.to_dlpack(tensor)

    def __dlpack__(self, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def _address(tensor: tf.Tensor) -> int:
    """Where a CPU tensor's bytes are, without a copy."""
    return np.from_dlpack(tensor if hasattr(tensor, "__dlpack__") else _DLPackCapsule(tensor)).ctypes.data


@pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "buffered"])
def test_large_records_become_tensors_uncopied_and_outlive_their_dataset(tmp_path, direct: bool) -> None:
    """Records taken one at a time are read into slots that become the tensors (no copy
    out of staging): every tensor keeps its bytes while later reads run, after its
    dataset is gone, and while another epoch reuses the slots of tensors freed."""
    import gc

    from tensorferry import Engine

    rows = np.random.default_rng(7).integers(0, 256, (24, 256 << 10), dtype=np.uint8)
    (tmp_path / "big.rec").write_bytes(rows.tobytes())
    odd = np.random.default_rng(8).integers(0, 256, (9, 300_001), dtype=np.uint8)
    (tmp_path / "odd.rec").write_bytes(odd.tobytes())
    with Engine(direct=direct) as engine:
        kept = list(make_dataset(str(tmp_path / "big.rec"), record_bytes=256 << 10, shuffle=True, seed=1,
                                 engine=engine))
        assert all(_address(x) % 4096 == 0 for x in kept), "the slots themselves"
        gc.collect()
        for _ in range(2):  # more epochs, their tensors dropped as they come: slots go round
            for x in make_dataset(str(tmp_path / "big.rec"), record_bytes=256 << 10, engine=engine):
                del x
        # Records whose aligned envelope outgrows a slot (O_DIRECT) are copied out of staging.
        odd_rows = np.stack([x.numpy() for x in make_dataset(str(tmp_path / "odd.rec"), record_bytes=300_001,
                                                              engine=engine)])
    assert sorted(x.numpy().tobytes() for x in kept) == sorted(r.tobytes() for r in rows)
    np.testing.assert_array_equal(odd_rows, odd)


@pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "buffered"])
def test_batches_of_whole_page_records_are_read_into_their_tensors(tmp_path, direct: bool) -> None:
    """With batch_size, records of whole pages are read in order into one slot that
    becomes the batch's tensor (no copy): batches drawn from two files, shuffled or
    not, keep their bytes after later reads and after their dataset is gone; records
    of other sizes are copied into their batches."""
    import gc

    from tensorferry import Engine

    rows = np.random.default_rng(12).integers(0, 256, (70, 8192), dtype=np.uint8)
    (tmp_path / "a.rec").write_bytes(rows[:30].tobytes())
    (tmp_path / "b.rec").write_bytes(rows[30:].tobytes())
    files = [str(tmp_path / "a.rec"), str(tmp_path / "b.rec")]
    odd = np.random.default_rng(13).integers(0, 256, (20, 100), dtype=np.uint8)
    (tmp_path / "odd.rec").write_bytes(odd.tobytes())
    with Engine(direct=direct) as engine:
        in_order = list(make_dataset(files, record_bytes=8192, batch_size=16, engine=engine))
        shuffled = list(make_dataset(files, record_bytes=8192, batch_size=16, shuffle=True, seed=4, engine=engine))
        assert all(_address(b) % 4096 == 0 for b in in_order + shuffled), "the slots themselves"
        gc.collect()
        for _ in range(2):  # more epochs, their batches dropped as they come: slots go round
            for b in make_dataset(files, record_bytes=8192, batch_size=16, engine=engine):
                del b
        odd_batches = [b.numpy() for b in make_dataset(str(tmp_path / "odd.rec"), record_bytes=100, batch_size=6,
                                                       engine=engine)]
    assert [len(b) for b in in_order] == [16, 16, 16, 16, 6]
    np.testing.assert_array_equal(np.concatenate([b.numpy() for b in in_order]), rows)
    assert sorted(r.tobytes() for b in shuffled for r in b.numpy()) == sorted(r.tobytes() for r in rows)
    np.testing.assert_array_equal(np.concatenate(odd_batches), odd)


def test_io_errors_during_iteration_name_the_file_offset_and_errno(tmp_path) -> None:
    path = tmp_path / "gone.bin"
    path.write_bytes(b"x" * 10000)
    ds = make_dataset(str(path))
    os.unlink(path)
    with pytest.raises(tf.errors.NotFoundError, match=rf"{path}: open: .*errno 2"):
        list(ds)
    path.write_bytes(b"y" * (64 * 100))
    ds = make_dataset(str(path), record_bytes=64)
    os.truncate(path, 64 * 50)
    past_the_end = rf"{path}: read past end of file \(\d+ bytes read\) at offset \d+ \(\d+ bytes\): .*errno 61"
    with pytest.raises(tf.errors.DataLossError, match=past_the_end):
        list(ds)


def _reference_masked_crc32c(data: bytes) -> int:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 768 + 13, 100003])
def test_native_crc_matches_a_bitwise_reference(size: int) -> None:
    # Sizes around the three-stream blocks (3 x 256 and 3 x 8192 bytes) and the 8-byte steps.
    from tensorferry import _native
    data = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8)
    assert _native.masked_crc32c(data.ctypes.data, size) == _reference_masked_crc32c(data.tobytes())


def test_native_crc_matches_tensorflows_framing(tfrecords) -> None:
    from tensorferry import _native
    paths, ordered = tfrecords
    raw = open(paths[0], "rb").read()
    length = int.from_bytes(raw[:8], "little")
    data = np.frombuffer(raw[12:12 + length], np.uint8)
    header = np.frombuffer(raw[:8], np.uint8)
    assert _native.masked_crc32c(header.ctypes.data, 8) == int.from_bytes(raw[8:12], "little")
    data_crc = int.from_bytes(raw[12 + length:16 + length], "little")
    assert _native.masked_crc32c(data.ctypes.data, data.nbytes) == data_crc
    assert data.tobytes() == ordered[0]


def test_epochs_partial_passes_and_datasets_side_by_side(tmp_path) -> None:
    # Reads start ahead of the items handed out (tickets): a pass left half-way, a
    # second epoch and two datasets read in turn must each still get their own items.
    raw = np.random.default_rng(9).integers(0, 256, size=(300, 3000), dtype=np.uint8)
    (tmp_path / "r.bin").write_bytes(raw.tobytes())
    ds = make_dataset(str(tmp_path / "r.bin"), record_bytes=3000, reads_per_call=16, num_parallel_reads=8)
    for _, row in zip(range(5), ds):  # abandoned with reads of later batches in flight
        pass
    np.testing.assert_array_equal(row.numpy(), raw[4])
    for _ in range(2):
        np.testing.assert_array_equal(np.stack([x.numpy() for x in ds]), raw)
    strings = make_dataset([str(tmp_path / "r.bin")] * 2)
    both = zip(iter(ds), iter(strings))
    first, whole = next(both)
    np.testing.assert_array_equal(first.numpy(), raw[0])
    assert whole.numpy() == raw.tobytes()


def _prefetcher_key(ds: tf.data.Dataset) -> int:
    """The key of the prefetcher that the native ops of ``ds`` share (their ``key`` attr)."""
    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())
    return next(node.attr["key"].i for function in graph.library.function for node in function.node_def
                if node.op == "TensorferryStartReads")


def test_reads_started_ahead_and_never_taken_are_let_go(tmp_path) -> None:
    """An iterator stopped early (``take(k).repeat()``, a loop left by ``break``) leaves the
    reads it started ahead untaken: they were held as long as the dataset, more each epoch
    (3.2 GiB after 100 epochs of 1 MiB files). The prefetcher holds the reads of its newest
    2 * num_parallel_reads + 4 calls at most; an iterator paused meanwhile reads again those
    of its items that were let go."""
    from tensorferry.adapters.tensorflow.data import _held_reads

    raw = np.random.default_rng(13).integers(0, 256, size=(64, 4096), dtype=np.uint8)
    (tmp_path / "r.bin").write_bytes(raw.tobytes())
    ds = make_dataset(str(tmp_path / "r.bin"), record_bytes=4096, reads_per_call=2, num_parallel_reads=3)
    key = _prefetcher_key(ds)
    paused = iter(ds)
    np.testing.assert_array_equal(next(paused).numpy(), raw[0])
    held_most = (2 * 3 + 4) * 2  # the calls kept, of 2 items each
    repeated = iter(ds.take(2).repeat())
    for _ in range(100):  # each epoch leaves the reads of about 3 calls behind
        next(repeated)
        next(repeated)
    assert _held_reads(key) <= held_most
    for _ in range(30):
        for _ in ds:
            break
    assert _held_reads(key) <= held_most
    np.testing.assert_array_equal(np.stack([x.numpy() for x in paused]), raw[1:])


def _resume_cases(root) -> dict[str, tuple[list[str], dict]]:
    """Datasets of each kind of item, as (files, make_dataset's keywords): small items
    taken a batch per call, records of 256 KiB taken one by one into slots, TFRecord."""
    rng = np.random.default_rng(11)
    for i, d in enumerate(payloads(23, seed=4)):
        (root / f"f{i:03d}.bin").write_bytes(d)
    (root / "small.rec").write_bytes(rng.integers(0, 256, 60 * 64, dtype=np.uint8).tobytes())
    (root / "large.rec").write_bytes(rng.integers(0, 256, 12 << 18, dtype=np.uint8).tobytes())
    with tf.io.TFRecordWriter(str(root / "r.tfrecord")) as writer:
        for d in payloads(30, seed=5):
            writer.write(d)
    files = sorted(str(p) for p in root.glob("f*.bin"))
    return {"files": (files, dict(shuffle=True, seed=5, reads_per_call=4)),
            "records": ([str(root / "small.rec")], dict(record_bytes=64, reads_per_call=7, shard=(1, 2))),
            "large records": ([str(root / "large.rec")], dict(record_bytes=256 << 10, shuffle=True, seed=1)),
            "tfrecord": ([str(root / "r.tfrecord")], dict(tfrecord=True, reads_per_call=3)),
            "batches": ([str(root / "small.rec")], dict(record_bytes=64, batch_size=8, shuffle=True, seed=2))}


def _item(x) -> list[bytes]:
    """An element's items: itself, or a batch's rows."""
    value = x.numpy()
    if isinstance(value, bytes):
        return [value]
    return [row.tobytes() for row in value] if value.ndim == 2 else [value.tobytes()]


def _items(iterator) -> list[bytes]:
    return [item for x in iterator for item in _item(x)]


@pytest.mark.parametrize("case", ["files", "records", "large records", "tfrecord", "batches"])
def test_an_iterators_checkpoint_resumes_mid_epoch(tmp_path, case: str) -> None:
    """tf.train.Checkpoint of an iterator taken mid-epoch holds tickets of reads started
    ahead: restored into a new dataset, or into a second iterator of the same one while
    the first still holds them, each gives exactly the items that were left."""
    files, kwargs = _resume_cases(tmp_path)[case]
    ds = make_dataset(files, **kwargs)
    epoch = sorted(_items(ds))  # shuffled datasets: another order each epoch
    iterator = iter(ds)
    taken = [item for _ in range(5) for item in _item(next(iterator))]
    saved = tf.train.Checkpoint(iterator=iterator).save(str(tmp_path / "ckpt" / "it"))
    again = iter(ds)  # the same prefetcher: it takes the first iterator's pending reads
    tf.train.Checkpoint(iterator=again).restore(saved).assert_consumed()
    rest = _items(again)
    assert _items(iterator) == rest
    assert sorted(taken + rest) == epoch
    fresh = iter(make_dataset(files, **kwargs))
    tf.train.Checkpoint(iterator=fresh).restore(saved).assert_consumed()
    assert _items(fresh) == rest


_RESUMED = """
import hashlib, json, sys
import tensorflow as tf
from tensorferry.adapters.tensorflow import make_dataset
cases = json.loads(sys.argv[1])
rest = {}
for case, (files, kwargs, saved) in cases.items():
    iterator = iter(make_dataset(files, **kwargs))
    tf.train.Checkpoint(iterator=iterator).restore(saved).assert_consumed()
    rest[case] = [hashlib.sha256(x.numpy() if x.dtype == tf.string else x.numpy().tobytes()).hexdigest()
                  for x in iterator]  # an element's bytes (a batch's rows joined)
print("REST" + json.dumps(rest))
"""


def test_an_iterators_checkpoint_resumes_in_another_process(tmp_path) -> None:
    """The usual resume: the checkpoint's tickets were started by a process that is
    gone; the one that restores it reads those items itself."""
    import hashlib
    import json

    from conftest import run_processes

    cases, expected = {}, {}
    for case, (files, kwargs) in _resume_cases(tmp_path).items():
        iterator = iter(make_dataset(files, **kwargs))
        for _ in range(5):
            next(iterator)
        saved = tf.train.Checkpoint(iterator=iterator).save(str(tmp_path / case / "it"))
        expected[case] = [hashlib.sha256(b"".join(_item(x))).hexdigest() for x in iterator]
        cases[case] = (files, {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}, saved)
    [out] = run_processes(_RESUMED, [([json.dumps(cases)], dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))], timeout=180)
    assert json.loads(next(line for line in out.splitlines() if line.startswith("REST"))[4:]) == expected


def test_a_url_is_refused() -> None:
    for files in ("gs://bucket/*.tfrecord", ["gs://bucket/a.tfrecord"]):
        with pytest.raises(ValueError, match="is a URL"):
            make_dataset(files, tfrecord=True)


def test_a_file_named_with_glob_characters_is_that_file(tmp_path) -> None:
    """A path naming an existing file is read as that file, as TFRecordDataset takes it,
    even with [, * or ? in its name (refused before as a pattern that matched nothing); a
    pattern that names no file is still a pattern."""
    data = payloads(4, seed=12)
    for name, d in zip(["part[1].bin", "star*.bin", "what?.bin", "part1.bin"], data):
        (tmp_path / name).write_bytes(d)
    for name, d in zip(["part[1].bin", "star*.bin", "what?.bin"], data):
        assert [x.numpy() for x in make_dataset(str(tmp_path / name))] == [d]
    assert [x.numpy() for x in make_dataset(str(tmp_path / "part[0-9].bin"))] == [data[3]]
    path = str(tmp_path / "records[0].tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for d in data:
            writer.write(d)
    assert [x.numpy() for x in make_dataset(path, tfrecord=True)] == [x.numpy() for x in tf.data.TFRecordDataset(path)]


def test_whole_files_are_read_as_they_are_when_read(tmp_path) -> None:
    """A whole file is read at its size at the time, as tf.io.read_file reads it: one that
    grew or shrank after make_dataset gives its new bytes, however it is read (staged,
    into its own memory, a batch at a time). It was cut to its old size, or failed."""
    rng = np.random.default_rng(13)
    paths = [str(tmp_path / f"f{i}.bin") for i in range(3)]
    for path in paths:
        open(path, "wb").write(b"short")
    datasets = [make_dataset(paths), make_dataset(paths, batch_size=2), make_dataset(paths, shuffle=True, seed=1)]
    for sizes in ([5, 5, 5], [70_000, 3000, (5 << 20) + 3], [1, 0, 100_000]):
        contents = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
        for path, content in zip(paths, contents):
            open(path, "wb").write(content)
        assert [tf.io.read_file(p).numpy() for p in paths] == contents
        for ds in datasets:
            got = [x for e in ds for x in (e.numpy().tolist() if e.shape.rank else [e.numpy()])]
            assert sorted(got) == sorted(contents)


_MANY_FILES = r"""
import glob, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from tensorferry.adapters.tensorflow import make_dataset
paths = sorted(glob.glob(sys.argv[2]))
expected = sorted(open(p, "rb").read() for p in paths)
for kwargs in ({}, {"shuffle": True, "seed": 0}, {"batch_size": 128}):
    elements = [e.numpy() for e in make_dataset(sys.argv[2], **kwargs)]
    got = [x for e in elements for x in (e.tolist() if kwargs.get("batch_size") else [e])]
    assert sorted(got) == expected, kwargs
print("READ", len(paths))
"""


def test_thousands_of_small_files_within_the_descriptor_limit(tmp_path) -> None:
    """4000 small whole files at the usual soft limit of 1024 descriptors: reads of many
    calls are in flight, each file open (twice, with O_DIRECT) until its read ends, and
    they hit EMFILE; the open descriptors are now kept within the limit."""
    from conftest import run_processes

    rng = np.random.default_rng(14)
    for i in range(4000):
        (tmp_path / f"f{i:04d}.bin").write_bytes(rng.integers(0, 256, int(rng.integers(50, 2000)), np.uint8).tobytes())
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    [out] = run_processes(_MANY_FILES, [(["1024", str(tmp_path / "*.bin")], env)], timeout=300)
    assert "READ 4000" in out


_CROWDED = r"""
import glob, os, resource, sys
import tensorflow as tf
from tensorferry.adapters.tensorflow import make_dataset
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
paths = sorted(glob.glob(sys.argv[1]))
expected = [open(p, "rb").read() for p in paths]
held = [open(os.devnull) for _ in range(256 - int(sys.argv[2]) - len(os.listdir("/proc/self/fd")))]
assert [x.numpy() for x in tf.data.Dataset.from_tensor_slices(paths).map(tf.io.read_file)] == expected
assert [x.numpy() for x in make_dataset(paths)] == expected
assert [x for b in make_dataset(paths, batch_size=64) for x in b.numpy().tolist()] == expected
side_by_side = tf.data.Dataset.zip((make_dataset(paths), make_dataset(paths, shuffle=True, seed=1)))
pairs = [(a.numpy(), b.numpy()) for a, b in side_by_side]
assert [a for a, _ in pairs] == expected and sorted(b for _, b in pairs) == sorted(expected)
print("READ", len(paths))
"""


def test_reads_when_the_process_holds_nearly_every_descriptor(tmp_path) -> None:
    """With all but 8 of 256 descriptors held elsewhere in the process, reads failed with
    EMFILE (an UnknownError) where tf.io.read_file's did not: the budget of open files was
    half the limit, whatever else was open, and the ops' io_uring engine took 8. A call
    that runs out now waits for older reads to close their files and tries again with
    fewer, down to one file without O_DIRECT, the engine reading with threads."""
    from conftest import run_processes

    rng = np.random.default_rng(18)
    for i in range(300):
        (tmp_path / f"f{i:03d}.bin").write_bytes(rng.integers(0, 256, int(rng.integers(50, 9000)), np.uint8).tobytes())
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    [out] = run_processes(_CROWDED, [([str(tmp_path / "*.bin"), "8"], env)], timeout=300)
    assert "READ 300" in out


def test_a_whole_file_replaced_by_a_directory_fails_as_read_file_does(tmp_path) -> None:
    """Its read's EISDIR was an UnknownError; tf.io.read_file reports FailedPrecondition."""
    path = tmp_path / "was_a_file"
    path.write_bytes(b"x" * 100)
    ds = make_dataset(str(path))
    path.unlink()
    path.mkdir()
    with pytest.raises(tf.errors.FailedPreconditionError):
        tf.io.read_file(str(path))
    with pytest.raises(tf.errors.FailedPreconditionError, match=rf"{path}: .*errno 21"):
        list(ds)


def test_tf_data_service_distributed_epoch_hands_out_every_item_once(whole_files, tmp_path) -> None:
    """processing_mode="distributed_epoch": the dispatcher splits the dataset's calls
    among two workers, and every item comes once, as from FixedLengthRecordDataset. In
    order, the count asserted on each worker failed; shuffled, every worker read the
    whole epoch (each item twice). Shuffled without a seed, each worker's copy of the
    dataset drew its own permutations."""
    service = tf.data.experimental.service
    dispatcher = service.DispatchServer()
    address = dispatcher.target.split("://")[1]
    workers = [service.WorkerServer(service.WorkerConfig(dispatcher_address=address)) for _ in range(2)]
    rows = np.random.default_rng(15).integers(0, 256, (100, 64), dtype=np.uint8)
    (tmp_path / "r.rec").write_bytes(rows.tobytes())
    big = np.random.default_rng(16).integers(0, 256, (9, 256 << 10), dtype=np.uint8)
    (tmp_path / "big.rec").write_bytes(big.tobytes())
    root, data = whole_files
    cases = [(make_dataset(str(tmp_path / "r.rec"), record_bytes=64, reads_per_call=7, **shuffled), rows)
             for shuffled in ({}, {"shuffle": True, "seed": 3})]
    cases += [(make_dataset(str(tmp_path / "r.rec"), record_bytes=64, batch_size=8, shuffle=True, seed=4), rows),
              (make_dataset(str(tmp_path / "r.rec"), record_bytes=64, reads_per_call=2, shuffle=True), rows),
              (make_dataset(str(tmp_path / "big.rec"), record_bytes=256 << 10, shuffle=True, seed=5), big),
              (make_dataset(str(root / "*.bin"), reads_per_call=4, shuffle=True, seed=6), data)]
    try:
        for ds, expected in cases:
            got = [x for e in ds.apply(service.distribute("distributed_epoch", dispatcher.target))
                   for x in (_item(e) if e.dtype == tf.uint8 else [e.numpy()])]
            expected = [r.tobytes() for r in expected] if isinstance(expected, np.ndarray) else expected
            assert sorted(got) == sorted(expected)
    finally:
        for worker in workers:
            worker._stop()
        dispatcher._stop()


def test_an_unseeded_shuffle_is_alike_on_every_tf_data_service_worker(tmp_path) -> None:
    """Shuffled without a seed, the dataset takes one when it is made, into its graph, so
    that the copies of it that tf.data service workers make shuffle alike: sharded by data
    (ShardingPolicy.DATA), each of two workers keeps every other item of the same order.
    Each copy drew its own permutations, and items repeated and went missing. Datasets
    made apart still shuffle apart."""
    from conftest import free_ports

    service = tf.data.experimental.service
    addresses = [f"localhost:{port}" for port in free_ports(2)]
    dispatcher = service.DispatchServer(service.DispatcherConfig(worker_addresses=addresses))
    workers = [service.WorkerServer(service.WorkerConfig(dispatcher.target.split("://")[1], worker_address=address,
                                                         port=int(address.split(":")[1]))) for address in addresses]
    rows = np.random.default_rng(17).integers(0, 256, (100, 64), dtype=np.uint8)
    (tmp_path / "r.rec").write_bytes(rows.tobytes())
    ds = make_dataset(str(tmp_path / "r.rec"), record_bytes=64, reads_per_call=7, shuffle=True)
    try:
        sharded = ds.apply(service.distribute(service.ShardingPolicy.DATA, dispatcher.target))
        assert sorted(x.numpy().tobytes() for x in sharded) == sorted(r.tobytes() for r in rows)
    finally:
        for worker in workers:
            worker._stop()
        dispatcher._stop()
    apart = [make_dataset(str(tmp_path / "r.rec"), record_bytes=64, shuffle=True) for _ in range(2)]
    assert [x.numpy().tobytes() for x in apart[0]] != [x.numpy().tobytes() for x in apart[1]]


def test_an_unseeded_shuffle_in_a_cluster_warns(tmp_path, monkeypatch) -> None:
    """Workers that each make the dataset draw their own seeds: where TF_CONFIG names
    several, an unseeded shuffle that tf.distribute may shard by data warns."""
    import json

    (tmp_path / "r.rec").write_bytes(bytes(640))
    path = str(tmp_path / "r.rec")
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:1"]},
                                                "task": {"type": "chief", "index": 0}}))
    with pytest.warns(UserWarning, match="2 workers"):
        make_dataset(path, record_bytes=64, shuffle=True)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_dataset(path, record_bytes=64, shuffle=True, seed=1)
        make_dataset(path, record_bytes=64, shuffle=True, shard=(0, 2))
        monkeypatch.delenv("TF_CONFIG")
        make_dataset(path, record_bytes=64, shuffle=True)


def test_a_tfrecord_file_whose_name_is_not_utf8(tmp_path) -> None:
    """The framing scan took its path as a strict UTF-8 str: a name os.listdir gives
    surrogate-escaped could not be listed. It goes as bytes, and errors still name it."""
    data = payloads(10, seed=2)
    name = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"caf\xe9.tfrecord"))
    with tf.io.TFRecordWriter(os.fsencode(name)) as w:
        for d in data:
            w.write(d)
    assert [length - 4 for _, _, length in tfrecord_records(name)] == [len(d) for d in data]
    assert [x.numpy() for x in make_dataset([name], tfrecord=True)] == data
    bad = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"bad\xff.tfrecord"))
    with open(bad, "wb") as f:
        f.write(b"x" * 40)
    with pytest.raises(ValueError, match="length CRC") as info:
        tfrecord_records(bad)
    assert bad in str(info.value)
    with pytest.raises(tf.errors.DataLossError, match="length CRC") as info:
        list(make_dataset([bad], tfrecord=True))
    assert os.fsencode(bad).decode("utf-8", "backslashreplace") in info.value.message


def test_errors_of_a_file_whose_name_is_not_utf8_are_tensorflow_errors(tmp_path) -> None:
    """TensorFlow decodes an op's message as strict UTF-8: one naming a file whose name is
    not valid UTF-8 was a UnicodeDecodeError, which ``except tf.errors.DataLossError`` does
    not catch. Such bytes are written \\xNN, as Python's backslashreplace writes them; a
    valid UTF-8 name stays as it is."""
    records = tmp_path / "records"
    with tf.io.TFRecordWriter(str(records)) as w:
        w.write(b"hello" * 10)
    raw = bytearray(records.read_bytes())
    raw[14] ^= 1  # a data byte of the first record
    bad = os.path.join(os.fsencode(tmp_path), b"bad\xff\xe2\x82.tfrecord")
    with open(bad, "wb") as f:
        f.write(raw)
    shown = bad.decode("utf-8", "backslashreplace")
    assert shown.endswith("bad\\xff\\xe2\\x82.tfrecord")
    with pytest.raises(tf.errors.DataLossError, match="bad data CRC") as info:
        list(make_dataset(bad, tfrecord=True))
    assert shown in info.value.message
    for name in (b"gone\xff.bin", "gon\u00e9.bin".encode()):
        path = os.path.join(os.fsencode(tmp_path), name)
        with open(path, "wb") as f:
            f.write(b"x" * 100)
        ds = make_dataset(path)
        os.unlink(path)
        with pytest.raises(tf.errors.NotFoundError) as info:
            list(ds)
        assert path.decode("utf-8", "backslashreplace") + ": open" in info.value.message


def test_arguments_of_the_wrong_kind_are_refused_by_name(tmp_path) -> None:
    """record_bytes=2.5 failed inside numpy ("expected a sequence of integers ..., got
    '8.0'"), and the usual TFRecordDataset idiom, interleave(lambda f: make_dataset(f)),
    with an unrelated OperatorNotAllowedInGraphError: make_dataset plans its reads when it
    is made, so it needs the names then, and says so."""
    path = str(tmp_path / "r.bin")
    open(path, "wb").write(bytes(64))
    for name in ("record_bytes", "batch_size", "reads_per_call", "num_parallel_reads"):
        with pytest.raises(TypeError, match=rf"^{name} must be an integer, got 2\.5 \(float\)$"):
            make_dataset(path, **{"record_bytes": 4, name: 2.5})
    assert len(make_dataset(path, record_bytes=np.int64(4), batch_size=np.int32(2))) == 8
    files = tf.data.Dataset.from_tensor_slices([path])
    with pytest.raises(TypeError, match=r"not a symbolic tensor .* Pass the list of files, make_dataset\(files"):
        files.interleave(lambda f: make_dataset(f, record_bytes=4))
