"""make_dataset: whole files, fixed-length records or TFRecord records as a tf.data.Dataset.

Indices flow through tf.data (so shuffle, shard, batch, prefetch and tf.distribute
work as usual); a parallel map turns each batch of indices into bytes with one call
to the core's :class:`tensorferry.FileSource`, whose reads run concurrently with the
GIL released (unlike ``Dataset.from_generator``, which reads one item at a time).
"""

from __future__ import annotations

import glob
import os
import struct
from typing import Iterable, Sequence

import numpy as np
import tensorflow as tf

from ...data import FileSource
from ...engine import Engine, default_engine

_TFRECORD_HEADER = 12  # u64 length + masked crc32c of the length
_TFRECORD_FOOTER = 4   # masked crc32c of the data


def _masked_crc32c(data: bytes | np.ndarray) -> int:
    try:
        import google_crc32c
    except ImportError:
        raise ImportError("TFRecord CRCs need google-crc32c: pip install 'tensorferry[tensorflow]'") from None
    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


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
        num_parallel_reads: parallel calls of the read map (each reads ``reads_per_call``
            items concurrently; by default as many as make about 16 MiB, at most 64,
            so that buffers stay few enough to be reused from the pool).
        shard: ``(index, count)``: keep every count-th item starting at index, for
            data-parallel workers (tf.distribute's auto-sharding works too).
    """
    if tfrecord and record_bytes is not None:
        raise ValueError("give record_bytes or tfrecord=True, not both")
    if record_bytes is not None and record_bytes <= 0:
        raise ValueError(f"record_bytes must be positive, got {record_bytes}")
    paths = _expand(files)
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(2, "no such file", p)
    if tfrecord:
        items: list = [r for p in paths for r in tfrecord_records(p, engine)]
    elif record_bytes is not None:
        items = []
        for p in paths:
            size = os.path.getsize(p)
            if size % record_bytes:
                raise ValueError(f"{p}: {size} bytes is not a whole number of {record_bytes}-byte records "
                                 "(truncated?)")
            items += [(p, offset, record_bytes) for offset in range(0, size, record_bytes)]
    else:
        items = paths
    source = FileSource(items, engine=engine)
    if reads_per_call is None:
        average = sum(length for _, _, length in source.records) // max(1, len(source))
        reads_per_call = max(1, min(64, (16 << 20) // max(1, average)))

    def read(indices: tf.Tensor) -> tf.Tensor:
        arrays = source.read_batch(int(i) for i in indices.numpy())
        try:
            if record_bytes is not None:
                return tf.constant(np.stack(arrays) if arrays else np.empty((0, record_bytes), np.uint8))
            if tfrecord:
                return tf.constant([_tfrecord_data(source, int(i), a) for i, a in zip(indices.numpy(), arrays)],
                                   dtype=tf.string)
            return _string_tensor(arrays)
        finally:
            for a in arrays:
                source.release(a)  # copied into the tensor: the pool can reuse it

    out_type = tf.uint8 if record_bytes is not None else tf.string
    dataset = tf.data.Dataset.range(len(source))
    if shard is not None:
        index, count = shard
        dataset = dataset.shard(count, index)
    if shuffle:
        dataset = dataset.shuffle(len(source), seed=seed, reshuffle_each_iteration=True)
    shape = [record_bytes] if record_bytes is not None else []
    if reads_per_call == 1:
        # Large items: one per call, and no batch/unbatch, which would copy each again.
        return dataset.map(lambda i: tf.ensure_shape(tf.py_function(read, [tf.reshape(i, [1])], Tout=out_type)[0],
                                                     shape),
                           num_parallel_calls=num_parallel_reads, deterministic=True)
    dataset = dataset.batch(reads_per_call).map(lambda i: tf.py_function(read, [i], Tout=out_type),
                                                num_parallel_calls=num_parallel_reads, deterministic=True)
    return dataset.map(lambda x: tf.ensure_shape(x, [None, *shape])).unbatch()


def _string_tensor(arrays: list[np.ndarray]) -> tf.Tensor:
    """A ``tf.string`` vector of the buffers' bytes. A single buffer is viewed as one
    numpy fixed-width bytes item, which TF copies straight into its string: one copy and
    one fresh allocation instead of two (through ``bytes``), and on this kind of machine
    fresh memory costs more than the copy. That view drops trailing NUL bytes, so a
    buffer ending in one goes through ``bytes``."""
    if len(arrays) == 1 and arrays[0].nbytes and arrays[0][-1] != 0:
        return tf.constant(arrays[0].view(f"S{arrays[0].nbytes}"), dtype=tf.string)
    return tf.constant([a.tobytes() for a in arrays], dtype=tf.string)


def _tfrecord_data(source: FileSource, index: int, raw: np.ndarray) -> bytes:
    data, footer = raw[:-_TFRECORD_FOOTER], raw[-_TFRECORD_FOOTER:]
    if _masked_crc32c(data) != struct.unpack("<I", footer.tobytes())[0]:
        path, offset, _ = source.records[index]
        raise ValueError(f"{path}: bad data CRC in the record at offset {offset - _TFRECORD_HEADER}")
    return data.tobytes()
