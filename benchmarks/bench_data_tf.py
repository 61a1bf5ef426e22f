"""tf.data readers: make_dataset against TFRecordDataset and list_files + read_file, and fio.

The page cache is dropped before each reader; bytes/s over a full pass. The data: 64
whole files, one file of 1 MiB records, 8 TFRecord files of 1 MiB records, and the same
bytes again as 128 KiB files (small images, say), and the records file again as 4 KiB
records in batches of 256, in order and shuffled. Items are drained one by one in Python, except the 128 KiB
files' and the 4 KiB records': there that would time Python, so they are drained in the
graph (a reduce over their lengths).

    python benchmarks/bench_data_tf.py --dir /nvme/tmp --size 2G [--repeat 2] [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tensorferry import bench, parse_size  # noqa: E402
from tensorferry.adapters.tensorflow import make_dataset  # noqa: E402

SMALL_FILE = 128 << 10


def drain(ds: tf.data.Dataset) -> int:
    total = 0
    for x in ds:
        total += int(tf.size(x)) if x.dtype != tf.string else int(tf.strings.length(x))
    return total


def drain_in_graph(ds: tf.data.Dataset) -> int:
    string = ds.element_spec.dtype == tf.string
    lengths = ds.map(lambda x: tf.cast(tf.reduce_sum(tf.strings.length(x)) if string else tf.size(x), tf.int64))
    return int(lengths.reduce(tf.constant(0, tf.int64), lambda total, n: total + n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--size", default="2G")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; the best of each reader is reported")
    parser.add_argument("--json", action="store_true")
    bench.add_results_option(parser)
    args = parser.parse_args(argv)
    started = time.time()
    nbytes = parse_size(args.size)
    root = os.path.join(args.dir, "tf-bench")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 256, size=nbytes // 64, dtype=np.uint8).tobytes()
    files = []
    for i in range(64):  # 64 whole files
        path = os.path.join(root, f"f{i:03d}.bin")
        with open(path, "wb") as f:
            f.write(chunk)
        files.append(path)
    small = []
    for i in range(nbytes // SMALL_FILE):  # the same bytes as small files
        path = os.path.join(root, f"s{i:05d}.bin")
        with open(path, "wb") as f:
            f.write(chunk[:SMALL_FILE])
        small.append(path)
    records = os.path.join(root, "records.bin")  # one file of 1 MiB fixed records
    with open(records, "wb") as f:
        for _ in range(nbytes // (1 << 20)):
            f.write(chunk[: 1 << 20])
    tfrecords = []
    for i in range(8):  # TFRecord files of 1 MiB records
        path = os.path.join(root, f"part-{i}.tfrecord")
        with tf.io.TFRecordWriter(path) as w:
            for _ in range(nbytes // (1 << 20) // 8):
                w.write(chunk[: 1 << 20])
        tfrecords.append(path)
    bench.drop_cache(bench.files_under(root))

    auto = tf.data.AUTOTUNE
    readers = [
        ("make_dataset, 64 files", lambda: make_dataset(files)),
        ("list_files.map(read_file), 64 files",
         lambda: tf.data.Dataset.list_files(files, shuffle=False).map(tf.io.read_file, num_parallel_calls=auto)),
        ("make_dataset, 1 MiB records", lambda: make_dataset(records, record_bytes=1 << 20)),
        ("FixedLengthRecordDataset, 1 MiB records",
         lambda: tf.data.FixedLengthRecordDataset(records, 1 << 20, buffer_size=16 << 20)),
        ("make_dataset, TFRecord", lambda: make_dataset(tfrecords, tfrecord=True)),
        ("TFRecordDataset(num_parallel_reads=AUTOTUNE)",
         lambda: tf.data.TFRecordDataset(tfrecords, num_parallel_reads=auto)),
    ]
    in_graph = [
        ("make_dataset, 128 KiB files (drained in the graph)", lambda: make_dataset(small)),
        ("list_files.map(read_file), 128 KiB files (drained in the graph)",
         lambda: tf.data.Dataset.list_files(small, shuffle=False).map(tf.io.read_file, num_parallel_calls=auto)),
        # Token blocks, say: per item, tf.data's own cost outweighs reading 4 KiB.
        ("make_dataset(batch_size=256), 4 KiB records (drained in the graph)",
         lambda: make_dataset(records, record_bytes=4096, batch_size=256)),
        ("make_dataset.batch(256), 4 KiB records (drained in the graph)",
         lambda: make_dataset(records, record_bytes=4096).batch(256)),
        ("FixedLengthRecordDataset.map(decode_raw).batch(256), 4 KiB records (drained in the graph)",
         lambda: tf.data.FixedLengthRecordDataset(records, 4096, buffer_size=16 << 20).map(
             lambda s: tf.io.decode_raw(s, tf.uint8), num_parallel_calls=auto).batch(256)),
        # Shuffled: ours draws a new order of the whole file each epoch (random 4 KiB
        # reads); the stock reader reads in order and shuffles within a window.
        ("make_dataset(batch_size=256, shuffle=True), 4 KiB records (drained in the graph)",
         lambda: make_dataset(records, record_bytes=4096, batch_size=256, shuffle=True, seed=0)),
        ("FixedLengthRecordDataset.map(decode_raw).shuffle(65536).batch(256), 4 KiB records, "
         "a 256 MiB window (drained in the graph)",
         lambda: tf.data.FixedLengthRecordDataset(records, 4096, buffer_size=16 << 20).map(
             lambda s: tf.io.decode_raw(s, tf.uint8), num_parallel_calls=auto).shuffle(65536, seed=0).batch(256)),
    ]
    runs = {name: lambda make=make: drain(make()) for name, make in readers}
    runs.update({name: lambda make=make: drain_in_graph(make()) for name, make in in_graph})
    results = bench.reader_rounds(root, [*files, records, *tfrecords, *small], nbytes, runs, args.repeat,
                                  rounds=True)
    shutil.rmtree(root)
    bench.save_run(args, "data_tf", ["python", *sys.argv], args.dir, started, measurements=results)
    print(bench.report(bench.best_of(results), args.json))
    return 0


if __name__ == "__main__":
    with bench.freed_memory_kept():
        sys.exit(main())
