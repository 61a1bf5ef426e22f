"""make_dataset: whole files, fixed-length records or TFRecord records as a tf.data.Dataset.

Byte ranges flow through tf.data (so shuffle, shard, batch, prefetch and tf.distribute
work as usual) and a parallel map reads them with the core's native ops
(``native/tf_ops.cpp``): asynchronous TensorFlow kernels that submit the reads to the
core's engine and fill TensorFlow's own tensors, straight from the drive where the
memory allows, without Python or the GIL on the way.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import struct
from typing import Iterable, Sequence

import numpy as np
import tensorflow as tf

from ... import _native
from ...data import records_of
from ...engine import Engine, default_engine

_TFRECORD_HEADER = 12  # u64 length + masked crc32c of the length
_TFRECORD_FOOTER = 4   # masked crc32c of the data


def _masked_crc32c(data: bytes | bytearray) -> int:
    view = np.frombuffer(data, np.uint8)
    return _native.masked_crc32c(view.ctypes.data, view.nbytes)


def _expand(files: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        pattern = os.fspath(files)
        paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not paths:
            raise ValueError(f"the pattern {pattern!r} matches no files")
        return paths
    paths = [os.fspath(f) for f in files]
    if not paths:
        raise ValueError("no files given")
    return paths


def tfrecord_records(path: str, engine: Engine | None = None) -> list[tuple[str, int, int]]:
    """The ``(path, offset, length)`` of every record of a TFRecord file, framing checked.

    Each range covers the record's data and its CRC footer. A truncated file or a
    length whose CRC is wrong raises ValueError naming the file and offset.
    """
    engine = engine or default_engine()
    size = os.path.getsize(path)
    header = bytearray(_TFRECORD_HEADER)
    records, offset = [], 0
    while offset < size:
        if offset + _TFRECORD_HEADER > size:
            raise ValueError(f"{path}: truncated record header at offset {offset}")
        engine.read(header, path, offset)
        length, length_crc = struct.unpack("<QI", header)
        if _masked_crc32c(header[:8]) != length_crc:
            raise ValueError(f"{path}: bad length CRC at offset {offset}: not a TFRecord file, or corrupt")
        end = offset + _TFRECORD_HEADER + length + _TFRECORD_FOOTER
        if end > size:
            raise ValueError(f"{path}: record at offset {offset} ({length} bytes) runs past the end of the file")
        records.append((path, offset + _TFRECORD_HEADER, length + _TFRECORD_FOOTER))
        offset = end
    return records


def make_dataset(files: str | os.PathLike | Sequence[str | os.PathLike], *, record_bytes: int | None = None,
                 tfrecord: bool = False, shuffle: bool = False, seed: int | None = None,
                 num_parallel_reads: int = tf.data.AUTOTUNE, shard: tuple[int, int] | None = None,
                 reads_per_call: int | None = None, engine: Engine | None = None) -> tf.data.Dataset:
    """A dataset of whole files (``tf.string``), fixed-length records (``uint8[record_bytes]``)
    or TFRecord records (``tf.string``, CRCs checked).

    Args:
        files: a list of paths or a glob pattern (matched and sorted now).
        record_bytes: split every file into records of this many bytes (the file size
            must be a multiple of it).
        tfrecord: read the files as TFRecord files.
        shuffle: shuffle the items each epoch (``seed`` makes the order repeatable);
            otherwise the order is the files' order, then offsets.
        num_parallel_reads: calls of the read op that may run at once. AUTOTUNE (the
            default) asks for enough to keep 64 MiB of reads in flight; TensorFlow runs
            at most as many as its inter-op pool has threads (by default, the cores).
        shard: ``(index, count)``: keep every count-th item starting at index, for
            data-parallel workers (tf.distribute's auto-sharding works too).
        reads_per_call: items one call reads at once. By default, items of 8 MiB or
            more go one per call, and smaller ones in batches of about 8 MiB (at most
            256 items), split again after the read. An op of TensorFlow's C API cannot
            finish after its call returns (the asynchronous variant's done callback dies
            with the call), so each call holds a thread of a pool as small as the core
            count until its reads end:
            the batch, not the number of calls, is what keeps the drive's queue deep.
            Splitting the batch copies each item once more, which items of 8 MiB and
            more are spared.
        engine: whose settings (backend, block size, queue depth, threads, O_DIRECT)
            the reads use; the ops run their own engine with them.
    """
    if tfrecord and record_bytes is not None:
        raise ValueError("give record_bytes or tfrecord=True, not both")
    if record_bytes is not None and record_bytes <= 0:
        raise ValueError(f"record_bytes must be positive, got {record_bytes}")
    paths = _expand(files)
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(2, "no such file", p)
    engine = engine or default_engine()
    if tfrecord:
        records = [r for p in paths for r in tfrecord_records(p, engine)]
    elif record_bytes is not None:
        records = []
        for p in paths:
            size = os.path.getsize(p)
            if size % record_bytes:
                raise ValueError(f"{p}: {size} bytes is not a whole number of {record_bytes}-byte records "
                                 "(truncated?)")
            records += [(p, offset, record_bytes) for offset in range(0, size, record_bytes)]
    else:
        records = records_of(paths)
    average = sum(length for _, _, length in records) // max(1, len(records))
    if reads_per_call is None:
        reads_per_call = max(1, min(256, (8 << 20) // max(1, average)))
    if num_parallel_reads == tf.data.AUTOTUNE:
        num_parallel_reads = max(2, min(128, (64 << 20) // max(1, average * reads_per_call)))

    columns = ([p for p, _, _ in records], [o for _, o, _ in records], [n for _, _, n in records])
    dataset = tf.data.Dataset.from_tensor_slices(tuple(tf.constant(c, dtype) for c, dtype in
                                                       zip(columns, (tf.string, tf.int64, tf.int64))))
    if shard is not None:
        index, count = shard
        dataset = dataset.shard(count, index)
    if shuffle:
        dataset = dataset.shuffle(len(records), seed=seed, reshuffle_each_iteration=True)
    read = _read_op(engine, record_bytes, tfrecord)
    if reads_per_call > 1:
        dataset = dataset.batch(reads_per_call)
    dataset = dataset.map(read, num_parallel_calls=num_parallel_reads, deterministic=True)
    return dataset.unbatch() if reads_per_call > 1 else dataset


def _read_op(engine: Engine, record_bytes: int | None, tfrecord: bool):
    """The native read op for these items, with the engine's settings, as a map function
    of (paths, offsets, lengths) of any shape."""
    config = engine.config
    settings = dict(backend=engine.backend, block_size=config.block_size, queue_depth=config.queue_depth,
                    threads=config.threads, direct=config.direct)
    ops = _native_ops()
    if record_bytes is not None:
        records = functools.partial(ops.tensorferry_read_records, record_bytes=record_bytes, **settings)

        def read(paths, offsets, lengths):
            out = records(paths, offsets)
            return tf.ensure_shape(out, [*paths.shape, record_bytes])
        return read
    strings = functools.partial(ops.tensorferry_read_strings, tfrecord=tfrecord, **settings)
    return lambda paths, offsets, lengths: tf.ensure_shape(strings(paths, offsets, lengths), paths.shape)


@functools.lru_cache(maxsize=None)
def _native_ops():
    """The op library built with the native core (``_tf_ops.so``), loaded into TensorFlow.

    It uses TensorFlow's C API without linking to TensorFlow (the build must not need
    it), so libtensorflow_framework's symbols are made global for it first."""
    flags = [f for f in tf.sysconfig.get_link_flags() if f.startswith("-l:")]
    framework = flags[0][3:] if flags else "libtensorflow_framework.so.2"
    ctypes.CDLL(os.path.join(tf.sysconfig.get_lib(), framework), mode=ctypes.RTLD_GLOBAL)
    return tf.load_op_library(os.path.join(os.path.dirname(_native.__file__), "_tf_ops.so"))
