"""make_dataset: whole files, fixed-length records or TFRecord records as a tf.data.Dataset.

Byte ranges flow through tf.data (so shuffle, shard, batch, prefetch and tf.distribute
work as usual); two maps of the core's native ops (``native/tf_ops.cpp``) read them,
without Python or the GIL: one starts the reads of a batch through the core's engine
and returns at once with a ticket per item, the other waits for a ticket's read and
hands out its item. A large item's memory is read straight from the drive and becomes
its string; smaller ones are read, neighbours together, into reused staging and copied
out once.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import itertools
import json
import operator
import os
import secrets
import warnings
from typing import Iterable, Sequence

import numpy as np
import tensorflow as tf

from ... import _native
from ...config import IOConfig, default_config
from ...data import readable_size
from ...engine import Engine, local_path, resolve_backend
from ...pools import ThreadPool

# Items under this size are taken a batch per op call: a call costs more than the copy
# made when the batch is split (100,000 records of 200 bytes: 12.6 s singly, 7.7 s batched).
SMALL_ITEM_BYTES = 256 << 10
MAX_SCANS = 32  # TFRecord files whose framing is scanned at once
WHOLE_FILE = -1  # an item's length for the native ops: the rest of its file, as long as it is when read
# A TFRecord item's length for the native ops: the damaged record at its offset, whose read
# fails with DataLossError naming the file and offset, where TFRecordDataset raises it.
DAMAGED = -2
_dataset_keys = itertools.count()  # one prefetcher per dataset, shared by its two ops


def _expand(files: str | bytes | os.PathLike | Iterable[str | bytes | os.PathLike]) -> list[str]:
    if tf.is_symbolic_tensor(files):
        raise TypeError(
            "make_dataset needs the file names when it is made, not a symbolic tensor (as "
            "Dataset.interleave(lambda f: make_dataset(f, ...)) gives it): it plans every read then, from "
            "the files' sizes and framing. Pass the list of files, make_dataset(files, ...): it reads them "
            "as one dataset, num_parallel_reads batches of reads ahead, in the files' order or shuffled "
            "across all of them (shuffle=True)")
    # A bytes path is one path, as TFRecordDataset takes it (not a sequence of byte values).
    if isinstance(files, (str, bytes, os.PathLike)):
        pattern = local_path(os.fsdecode(files))
        # A file named with [, * or ? is that file (as TFRecordDataset takes it), not a pattern matching nothing.
        literal = not glob.has_magic(pattern) or os.path.exists(pattern)
        paths = [pattern] if literal else sorted(glob.glob(pattern))
        if not paths:
            raise ValueError(f"the pattern {pattern!r} matches no files")
        return paths
    return [local_path(os.fsdecode(f)) for f in files]


def tfrecord_records(path: str) -> list[tuple[str, int, int]]:
    """The ``(path, offset, length)`` of every record of a TFRecord file, framing checked
    by the core (in C++: a Python loop over headers took 10 s for 100,000 small records).

    Each range covers the record's data and its CRC footer. A record cut short or a
    length whose CRC is wrong raises ValueError naming the file and offset; a partial
    header at the end of the file ends it, as ``TFRecordDataset`` reads it.
    """
    offsets, lengths, damage = _tfrecord_ranges(path)
    if damage is not None:
        raise ValueError(damage[1])
    return [(path, offset, length) for offset, length in zip(offsets, lengths)]


def _tfrecord_ranges(path: str) -> tuple[list[int], list[int], tuple[int, str] | None]:
    """The offsets and lengths of a TFRecord file's records up to the first damaged one,
    and that one's (offset, why), or None."""
    # As bytes: a name need not be UTF-8 (os.listdir gives such a name surrogate-escaped).
    return _native.tfrecord_ranges(os.fsencode(path))


def make_dataset(files: str | bytes | os.PathLike | Sequence[str | bytes | os.PathLike], *,
                 record_bytes: int | None = None,
                 tfrecord: bool = False, shuffle: bool = False, seed: int | None = None,
                 num_parallel_reads: int = tf.data.AUTOTUNE, shard: tuple[int, int] | None = None,
                 reads_per_call: int | None = None, batch_size: int | None = None, drop_remainder: bool = False,
                 engine: Engine | None = None) -> tf.data.Dataset:
    """A dataset of whole files (``tf.string``), fixed-length records (``uint8[record_bytes]``)
    or TFRecord records (``tf.string``, CRCs checked). Its length is known: ``len(dataset)``,
    and Keras's steps per epoch.

    A whole file is read as it is at each read, as ``tf.io.read_file`` reads it: one that
    grew or shrank since the dataset was made gives its new bytes. Records and TFRecord
    records are those the files held when it was made (a file cut short since then fails
    with ``DataLossError`` naming it). A path that is missing, a directory or not a regular
    file raises ``FileNotFoundError``, ``IsADirectoryError`` or ``ValueError`` naming it
    when the dataset is made (``TFRecordDataset`` raises once it reaches the file).

    A TFRecord file that is damaged (a record cut short, as when its writer was killed
    mid-record, or a length whose CRC is wrong) gives its records before the damage, then
    an item that fails with ``DataLossError`` naming the file and offset, where
    ``TFRecordDataset`` raises it: ``ignore_errors()`` skips it and, as for
    ``TFRecordDataset``, the rest of that file; ``len(dataset)`` counts it. Shuffled, it
    fails where the shuffle puts it; with ``batch_size``, the batch that holds it fails;
    sharded, one shard holds it. A partial header at the end of a file ends the file, with
    no error, as for ``TFRecordDataset``. A record whose data CRC is wrong fails when read,
    and with it the records read in the same call (``reads_per_call``).

    Args:
        files: a list of paths or a glob pattern (matched and sorted now); a path that
            names an existing file is that file, whatever characters it holds. An empty
            list makes an empty dataset.
        record_bytes: split every file into records of this many bytes (the file size
            must be a multiple of it).
        tfrecord: read the files as TFRecord files.
        shuffle: shuffle the items each epoch (``seed`` makes the order repeatable);
            otherwise the order is the files' order, then offsets. Without a seed, one
            is taken now into the dataset's graph, ``tf.random.set_seed``'s as a stock
            shuffle takes it or else a random one, so that every copy of the graph (a
            tf.data service worker's) shuffles alike. Worker processes that each make
            the dataset (``MultiWorkerMirroredStrategy``) shuffle alike only given a seed
            or ``tf.random.set_seed``: without, each its own way, and where tf.distribute
            shards by data, items repeat and go missing, as with ``Dataset.shuffle``
            (it warns where ``TF_CONFIG`` names several workers). An iterator's checkpoint
            saved once the epoch's last reads have started (the last ``num_parallel_reads``
            calls) restores that epoch exactly, and the later epochs of a ``repeat`` in
            another order, as a stock ``shuffle().prefetch()`` saved past its last draw
            does: keeping the seeds' state alive to the epoch's end cost 40% more CPU per
            shuffled item.
        num_parallel_reads: batches of reads started ahead of the items handed out.
            AUTOTUNE (the default) starts enough to keep about 64 MiB in flight. Those
            of an iterator stopped early (``take(k).repeat()``, a loop left by ``break``)
            are let go once about twice as many batches have started since.
        shard: ``(index, count)``: keep every count-th item starting at index, for
            data-parallel workers; the reads are of those items alone. With
            ``tf.distribute``, build the dataset in
            ``strategy.distribute_datasets_from_function(lambda ctx: make_dataset(...,
            shard=(ctx.input_pipeline_id, ctx.num_input_pipelines)))``. A sharded dataset
            turns tf.distribute's auto-sharding off (it would shard it again). Without
            ``shard``, ``experimental_distribute_dataset`` still hands each worker its own
            items (shuffled: given a seed, see ``shuffle``), but through auto-sharding's
            data policy: every worker reads every item and drops the others' (no
            file-level sharding of custom reads).
        reads_per_call: items whose reads one call starts together (neighbouring
            ranges of a file merge into one read). By default about 8 MiB, at most 256
            items, at least one.
        batch_size: hand out batches of this many items (``uint8[batch, record_bytes]``
            or ``tf.string[batch]``), one call's reads each, as ``.batch(batch_size)``
            would make them but without handing out each item first: per item,
            tf.data costs tens of microseconds, more than reading 4 KiB. Excludes
            ``reads_per_call``.
        drop_remainder: with ``batch_size`` (only), drop a last batch that is short (then
            the batch dimension is static, as ``.batch(..., drop_remainder=True)`` makes it).
        engine: whose settings (backend, block size, queue depth, threads, O_DIRECT)
            the reads use; the ops run their own engine with them.
    """
    record_bytes, batch_size, reads_per_call = (
        None if value is None else _whole_number(name, value)
        for name, value in (("record_bytes", record_bytes), ("batch_size", batch_size),
                            ("reads_per_call", reads_per_call)))
    num_parallel_reads = _whole_number("num_parallel_reads", num_parallel_reads)
    if tfrecord and record_bytes is not None:
        raise ValueError("give record_bytes or tfrecord=True, not both")
    if record_bytes is not None and record_bytes <= 0:
        raise ValueError(f"record_bytes must be positive, got {record_bytes}")
    if batch_size is not None and reads_per_call is not None:
        raise ValueError("give batch_size or reads_per_call, not both: a batch is one call's reads")
    if batch_size is not None and batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if reads_per_call is not None and reads_per_call < 1:
        raise ValueError(f"reads_per_call must be at least 1, got {reads_per_call}")
    if num_parallel_reads != tf.data.AUTOTUNE and num_parallel_reads < 1:
        raise ValueError(f"num_parallel_reads must be tf.data.AUTOTUNE or at least 1, got {num_parallel_reads}")
    if drop_remainder and batch_size is None:
        raise ValueError("drop_remainder drops a short last batch of batch_size: give batch_size too "
                         "(or .batch(n, drop_remainder=True) on the dataset)")
    paths = _expand(files)
    sizes = [readable_size(p, "give a glob pattern of its files (such as DIR/*) or a list of files") for p in paths]
    # Settings only: the ops run engines of their own. The shared engine's rings and threads
    # would sit idle, and its descriptors were the last a process at its limit had.
    config = engine.config if engine else default_config()
    backend = engine.backend if engine else resolve_backend(config.backend)
    if shuffle and seed is None:
        seed = _seed_of_unseeded_shuffle(sharded=shard is not None)
    if tfrecord:
        # A file's framing is a chain of small reads (each header gives the next offset),
        # one per record when the cache is cold: files are scanned at once (the scan
        # releases the GIL). 8 files of 256 records, cold: 0.20-0.27 s one by one.
        with ThreadPool(max_workers=max(1, min(MAX_SCANS, len(paths)))) as pool:
            scans = list(pool.map(_tfrecord_ranges, paths))
        # A damaged record is an item too, which fails when read: the records before it
        # come first, as from TFRecordDataset, which skips the rest of the file after it.
        ranges = [(offsets, lengths) if damage is None else (offsets + [damage[0]], lengths + [DAMAGED])
                  for offsets, lengths, damage in scans]
    elif record_bytes is not None:
        ranges = []
        for p, size in zip(paths, sizes):
            if size % record_bytes:
                raise ValueError(f"{p}: {size} bytes is not a whole number of {record_bytes}-byte records "
                                 "(truncated?)")
            ranges.append((np.arange(0, size, record_bytes), np.full(size // record_bytes, record_bytes)))
    else:
        ranges = [([0], [size]) for size in sizes]  # each file whole
    # Items are columns of file numbers (indices into paths), offsets and lengths, made by
    # numpy: as a list of (path, offset, length) tuples, the 262,144 records of 1 GiB of 4 KiB
    # records took 0.15-0.3 s of CPU to make, a third of what reading them costs. No files: no items.
    ranges.append(([], []))
    file_numbers = np.concatenate([np.full(len(offsets), i, np.int32) for i, (offsets, _) in enumerate(ranges)])
    offsets = np.concatenate([np.asarray(offsets, np.int64) for offsets, _ in ranges])
    lengths = np.concatenate([np.asarray(lengths, np.int64) for _, lengths in ranges])
    if shard is not None:
        index, count = shard
        if not 0 <= index < count:
            raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {shard}")
        file_numbers, offsets, lengths = file_numbers[index::count], offsets[index::count], lengths[index::count]
    average = int(np.maximum(lengths, 0).sum()) // max(1, len(lengths))
    damaged = bool((lengths == DAMAGED).any())
    if batch_size is not None:
        reads_per_call = batch_size
    elif reads_per_call is None:
        reads_per_call = max(1, min(256, (8 << 20) // max(1, average)))
    if num_parallel_reads == tf.data.AUTOTUNE:
        num_parallel_reads = max(2, min(64, (64 << 20) // max(1, average * reads_per_call)))

    if not tfrecord and record_bytes is None:  # the sizes above only plan the calls
        lengths = np.full_like(lengths, WHOLE_FILE)
    columns = (tf.constant(file_numbers, tf.int32), tf.constant(offsets, tf.int64), tf.constant(lengths, tf.int64))
    dataset = _calls(columns, reads_per_call, shuffle, seed, drop_remainder)
    if shard is not None:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        dataset = dataset.with_options(options)
    start, take = _read_ops(backend, config, paths, record_bytes, tfrecord, batch_size, num_parallel_reads)
    # Starting reads returns at once, so the start map runs num_parallel_reads batches
    # ahead of the take map, which waits for the reads. Small items are taken a batch
    # per call (an op call costs more than splitting the batch copies); larger ones one
    # at a time, as splitting a batch would copy each once more.
    started = dataset.map(start, num_parallel_calls=num_parallel_reads, deterministic=True)
    if batch_size is not None:  # a batch per call: tf.data counts them as it counts the calls
        return started.map(take, num_parallel_calls=2, deterministic=True)
    # A damaged record's item fails alone: taken in a batch, it failed the items beside it,
    # and ignore_errors() dropped them.
    if average < SMALL_ITEM_BYTES and not damaged:
        items = _claimed_full(started.map(take, num_parallel_calls=2, deterministic=True), reads_per_call).unbatch()
    else:
        items = _claimed_full(started, reads_per_call).unbatch().map(take, num_parallel_calls=2, deterministic=True)
    # The count, which tf.data cannot infer through unbatch, gives len(dataset), Keras its
    # steps per epoch (no "ran out of data" warning at each epoch's end) and take/skip/repeat
    # their cardinality.
    return items.take(len(lengths))


def _calls(columns: tuple[tf.Tensor, ...], size: int, shuffle: bool, seed: int | None,
           drop_remainder: bool) -> tf.data.Dataset:
    """The items' (file numbers, offsets, lengths) in groups of ``size``, one group per
    start call, each group made whole by slicing or gathering the columns: made item by
    item and batched, 4 KiB records in batches of 256 cost 0.86-0.87 CPU-s/GB in order
    (0.56-0.60 so), and drawn one by one by ``Dataset.shuffle``, 2.7-2.8 (1.6-1.7 so).

    The calls are numbered by ``Dataset.range``, which the tf.data service splits among its
    workers (``processing_mode="distributed_epoch"``): each reads the calls it is handed.
    Shuffled, an epoch's order is one permutation of the positions, drawn call by call
    (``index_shuffle``) from the epoch's seed, so that workers handed different calls of
    one epoch agree on what each holds."""
    n = int(columns[0].shape[0])
    shape = [size] if drop_remainder else [None]
    calls = tf.data.Dataset.range(_call_count(n, size, drop_remainder))
    if shuffle:
        calls = tf.data.Dataset.zip((calls, _epoch_seeds(seed)))
    last = tf.constant(max(n - 1, 0), tf.int64)

    @tf.autograph.experimental.do_not_convert  # plain ops: nothing to convert
    def group(call: tf.Tensor, epoch_seed: tf.Tensor | None = None) -> tuple[tf.Tensor, ...]:
        begin = call * size
        if epoch_seed is None:
            return tuple(tf.ensure_shape(c[begin:tf.minimum(begin + size, n)], shape) for c in columns)
        positions = tf.random.experimental.index_shuffle(tf.range(begin, tf.minimum(begin + size, n)), epoch_seed, last)
        return tuple(tf.ensure_shape(tf.gather(c, positions), shape) for c in columns)

    return calls.map(group)


def _call_count(n: int, size: int, drop_remainder: bool) -> int:
    """How many groups of ``size`` the ``n`` items make (start calls, or batches)."""
    return n // size if drop_remainder else -(-n // size)


def _epoch_seeds(seed: int | None) -> tf.data.Dataset:
    """The seed of an epoch (an iteration) for each of its calls, a new one each epoch:
    the first pair of numbers that the iteration draws. Without a dataset made per epoch
    (by a flat_map), which instantiates its function every epoch (about 60 ms) and whose
    calls the tf.data service cannot split."""
    draws = tf.data.Dataset.random(seed, rerandomize_each_iteration=True).batch(2, drop_remainder=True)

    @tf.autograph.experimental.do_not_convert
    def keep_first(state: tuple[tf.Tensor, tf.Tensor], draw: tf.Tensor) -> tuple[tuple[tf.Tensor, ...], tf.Tensor]:
        first, kept = state
        kept = tf.where(first, draw, kept)
        return (tf.constant(False), kept), kept

    return draws.scan((tf.constant(True), tf.zeros([2], tf.int64)), keep_first)


def _seed_of_unseeded_shuffle(sharded: bool) -> int:
    """``tf.random.set_seed``'s op seed, as ``Dataset.shuffle`` would take it, or else a
    random one: either way a number in the graph, not the (0, 0) that has each copy of
    the graph draw its own."""
    global_seed, op_seed = tf.compat.v1.get_seed(None)
    if global_seed is not None:
        return op_seed
    workers = _cluster_workers()
    if workers > 1 and not sharded:
        warnings.warn(f"make_dataset(shuffle=True) without a seed, in a cluster of {workers} workers (TF_CONFIG): each "
                      "worker process that makes it shuffles its own way, so where tf.distribute shards it by data "
                      "(experimental_distribute_dataset) items repeat and go missing. Give seed=, call "
                      "tf.random.set_seed first, or give shard=(index, count).", stacklevel=3)
    return secrets.randbits(31)


def _cluster_workers() -> int:
    """The chief and workers that TF_CONFIG names (tf.distribute's multi-worker strategies read it)."""
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
        return sum(len(cluster.get(job, ())) for job in ("chief", "worker"))
    except (ValueError, AttributeError, TypeError):
        return 0


def _claimed_full(calls: tf.data.Dataset, size: int) -> tf.data.Dataset:
    """``calls`` claiming ``size`` items each, the last one too, which may hold fewer:
    unbatched, tf.data counts ``size`` items a call, which ``take`` of the true count
    then states. Unlike ``assert_cardinality``, that does not check the count: a tf.data
    service worker handed only some of the calls (``distributed_epoch``) hands out their
    items, where an asserted count failed."""

    @tf.autograph.experimental.do_not_convert
    def claim(*columns: tf.Tensor) -> tf.Tensor | tuple[tf.Tensor, ...]:
        for column in columns:
            column.set_shape([size, *column.shape[1:]])
        return columns if len(columns) > 1 else columns[0]

    return calls.map(claim)


def _whole_number(name: str, value: object) -> int:
    """``value`` as an int (a NumPy or eager TensorFlow integer too), or TypeError naming the argument."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


def _read_ops(backend: str, config: IOConfig, files: list[str], record_bytes: int | None, tfrecord: bool,
              batch_size: int | None, read_ahead: int):
    """The native start and take ops of one dataset, as map functions: start takes a
    batch of (file numbers in ``files``, offsets, lengths) and returns a ticket for
    each with its range, take turns tickets (one, or a batch) into their items. Both
    name the same prefetcher (``key``), which runs reads with those settings
    and holds those of about twice ``read_ahead`` start calls (the start map's
    parallelism) until taken, letting go of older ones that no take claimed."""
    attrs = dict(key=next(_dataset_keys), backend=backend, block_size=config.block_size,
                 queue_depth=config.queue_depth, threads=config.threads, direct=config.direct,
                 tfrecord=tfrecord, record_bytes=record_bytes or 0, batch_size=batch_size or 0, read_ahead=read_ahead)
    ops = _native_ops()

    @tf.autograph.experimental.do_not_convert  # plain op calls: nothing to convert
    def start(file_numbers: tf.Tensor, offsets: tf.Tensor, lengths: tf.Tensor) -> tuple[tf.Tensor, ...]:
        # As bytes: a name need not be UTF-8.
        paths = tf.gather(tf.constant([os.fsencode(f) for f in files], tf.string), file_numbers)
        tickets = tf.ensure_shape(ops.tensorferry_start_reads(paths, offsets, lengths, **attrs), file_numbers.shape)
        return tickets, paths, offsets, lengths

    @tf.autograph.experimental.do_not_convert
    def take(tickets: tf.Tensor, paths: tf.Tensor, offsets: tf.Tensor, lengths: tf.Tensor) -> tf.Tensor:
        # The ranges go along with the tickets: a checkpoint of the iterator holds the
        # tickets between the maps, which a restoring process has not started.
        if record_bytes is not None:
            return tf.ensure_shape(ops.tensorferry_take_record(tickets, paths, offsets, lengths, **attrs),
                                   [*tickets.shape, record_bytes])
        return tf.ensure_shape(ops.tensorferry_take_string(tickets, paths, offsets, lengths, **attrs), tickets.shape)

    return start, take


def _held_reads(key: int) -> int:
    """The items whose reads the prefetcher of the dataset ``key`` (its ops' attr) holds for a take."""
    return int(_native_ops().tensorferry_held_reads(key=key))


@functools.lru_cache(maxsize=None)
def _native_ops():
    """The op library built with the native core (``_tf_ops.so``), loaded into TensorFlow.

    It uses TensorFlow's C API without linking to TensorFlow (the build must not need
    it). TensorFlow loads its framework library with RTLD_GLOBAL, which resolves those
    symbols; should a build not, the library is made global here first."""
    if not hasattr(ctypes.CDLL(None), "TF_NewKernelBuilder"):
        flags = [f for f in tf.sysconfig.get_link_flags() if f.startswith("-l:")]
        framework = flags[0][3:] if flags else "libtensorflow_framework.so.2"
        ctypes.CDLL(os.path.join(tf.sysconfig.get_lib(), framework), mode=ctypes.RTLD_GLOBAL)
    return tf.load_op_library(os.path.join(os.path.dirname(_native.__file__), "_tf_ops.so"))
