"""GDSDataset: a torch map-style Dataset over files and byte ranges, through real DataLoaders."""

from __future__ import annotations

import errno
import gc
import multiprocessing
import os
import warnings
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import tensorferry  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from tensorferry.adapters.pytorch import GDSDataset, GDSWorkerWarning  # noqa: E402
from tensorferry.adapters.pytorch import data as data_module  # noqa: E402

ITEM = 3000  # not a multiple of any block size, so partial blocks are read too


def _files(tmp_path: Path, n: int = 12, size: int = ITEM) -> tuple[list[str], list[bytes]]:
    rng = np.random.default_rng(0)
    paths, contents = [], []
    for i in range(n):
        blob = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        path = tmp_path / f"item-{i:03d}.bin"
        path.write_bytes(blob)
        paths.append(str(path))
        contents.append(blob)
    return paths, contents


class CountingDataset(GDSDataset):
    """Counts batched and single fetches, to see which one DataLoader uses."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batched_calls = 0
        self.single_calls = 0

    def __getitem__(self, index):
        self.single_calls += 1
        return super().__getitem__(index)

    def __getitems__(self, indices):
        self.batched_calls += 1
        return super().__getitems__(indices)


@pytest.fixture(autouse=True)
def workers_exited() -> Iterator[None]:
    """Waits for the DataLoader workers a test started to exit: each removes its own
    temporary directory (multiprocessing's ``pymp-*``) on its way out, which a worker
    still shutting down when the test ends has not yet done."""
    yield
    gc.collect()  # an abandoned iterator shuts its workers down
    for child in multiprocessing.active_children():
        child.join(timeout=30)


def _epoch(loader: DataLoader) -> list[bytes]:
    return [bytes(row.cpu().numpy()) for batch in loader for row in batch]


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_every_item_once_byte_exact(tmp_path: Path, workers: int) -> None:
    paths, contents = _files(tmp_path)
    dataset = GDSDataset(paths)
    loader = DataLoader(dataset, batch_size=5, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(1),
                        multiprocessing_context="fork" if workers else None)
    for _ in range(2):  # every epoch, not just the first
        got = _epoch(loader)
        assert sorted(got) == sorted(contents)
    first = next(iter(loader))
    assert first.dtype == torch.uint8 and first.shape == (5, ITEM)


def test_cpu_item_is_a_host_tensor_sharing_the_read_buffer(tmp_path: Path) -> None:
    paths, contents = _files(tmp_path, n=2)
    dataset = GDSDataset(paths, device="cpu")
    item = dataset[-1]
    assert item.device.type == "cpu" and item.dtype == torch.uint8
    assert bytes(item.numpy()) == contents[-1]
    assert len(dataset) == 2 and dataset.uses_gds is False


def test_dataloader_uses_batched_fetch(tmp_path: Path) -> None:
    paths, contents = _files(tmp_path, n=10)
    dataset = CountingDataset(paths)
    loader = DataLoader(dataset, batch_size=4, num_workers=0)
    assert [bytes(r.numpy()) for r in torch.cat(list(loader))] == contents
    assert dataset.batched_calls == 3  # 4 + 4 + 2
    assert dataset.single_calls == 0


def test_records_with_offsets(tmp_path: Path) -> None:
    paths, contents = _files(tmp_path, n=1, size=64 << 10)
    blob = contents[0]
    records = [(paths[0], offset, 1000) for offset in range(0, 60_000, 7000)]
    records.append((Path(paths[0]), 123, 0))  # an empty record, and a PathLike
    dataset = GDSDataset(records)
    got = [bytes(item.numpy()) for item in DataLoader(dataset, batch_size=None, num_workers=0)]
    assert got == [blob[o:o + n] for _, o, n in records]
    assert dataset.records[0] == (paths[0], 0, 1000)


def test_distributed_sampler_uneven_pads_but_misses_nothing(tmp_path: Path) -> None:
    paths, contents = _files(tmp_path, n=11)
    dataset = GDSDataset(paths)
    seen: list[bytes] = []
    for rank in range(2):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        seen += _epoch(DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=0))
    # 11 items over 2 ranks: DistributedSampler repeats one to fill 12 slots.
    assert set(seen) == set(contents) and len(seen) == 12


def test_distributed_sampler_even_split_exactly_once(tmp_path: Path) -> None:
    paths, contents = _files(tmp_path, n=12)
    dataset = GDSDataset(paths)
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=5)
        seen += _epoch(DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=0))
    assert sorted(seen) == sorted(contents)


def test_transform(tmp_path: Path) -> None:
    paths, contents = _files(tmp_path, n=4)
    dataset = GDSDataset(paths, transform=lambda t: t.float().sum())
    expected = [float(np.frombuffer(c, np.uint8).sum()) for c in contents]
    assert [float(x) for x in dataset.__getitems__(range(4))] == expected
    assert float(dataset[2]) == expected[2]


def test_workers_each_use_their_own_engine(tmp_path: Path) -> None:
    paths, _ = _files(tmp_path, n=8)
    tensorferry.default_engine()  # the parent has one before the fork

    def where_read(tensor: torch.Tensor) -> tuple[int, int]:
        # Runs just after the read, in the process that read it.
        return os.getpid(), tensorferry.engine._shared_engine_pid

    dataset = GDSDataset(paths, transform=where_read)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context="fork",
                        collate_fn=list)
    pairs = [pair for batch in loader for pair in batch]
    assert len(pairs) == 8
    worker_pids = {pid for pid, _ in pairs}
    assert os.getpid() not in worker_pids and len(worker_pids) == 2
    assert all(pid == engine_pid for pid, engine_pid in pairs)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_started_by_spawn_or_forkserver(tmp_path: Path, context: str) -> None:
    """The start methods that pickle the dataset (spawn: macOS's default, and the usual
    choice once CUDA is initialised), with persistent workers over two epochs."""
    paths, contents = _files(tmp_path)
    dataset = GDSDataset(paths)
    assert bytes(dataset[0].numpy()) == contents[0]  # used here first: its pool and engine stay here
    loader = DataLoader(dataset, batch_size=5, shuffle=True, num_workers=2, multiprocessing_context=context,
                        persistent_workers=True, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        assert sorted(_epoch(loader)) == sorted(contents)
    with tensorferry.Engine() as engine:
        explicit = DataLoader(GDSDataset(paths, engine=engine), batch_size=2, num_workers=1,
                              multiprocessing_context=context)
        with pytest.raises(TypeError, match="explicit engine"), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's own note on a worker it could not pickle
            next(iter(explicit))


def test_explicit_engine_refused_in_a_forked_worker(tmp_path: Path) -> None:
    paths, _ = _files(tmp_path, n=2)
    with tensorferry.Engine() as engine:
        dataset = GDSDataset(paths, engine=engine)
        assert bytes(dataset[0].numpy()) == Path(paths[0]).read_bytes()
        loader = DataLoader(dataset, batch_size=1, num_workers=1, multiprocessing_context="fork")
        with pytest.raises(RuntimeError, match="explicit engine"):
            next(iter(loader))


def test_missing_file_named_at_construction(tmp_path: Path) -> None:
    paths, _ = _files(tmp_path, n=2)
    missing = str(tmp_path / "nope.bin")
    with pytest.raises(FileNotFoundError) as info:
        GDSDataset(paths + [missing])
    assert info.value.filename == missing


def test_record_past_eof_raises_enodata_when_read(tmp_path: Path) -> None:
    paths, _ = _files(tmp_path, n=1)
    dataset = GDSDataset([(paths[0], 0, 100), (paths[0], ITEM - 10, 100)])  # constructing is fine
    assert dataset[0].shape == (100,)
    with pytest.raises(OSError) as info:
        dataset[1]
    assert info.value.errno == errno.ENODATA
    with pytest.raises(OSError) as info:
        next(iter(DataLoader(dataset, batch_size=2)))
    assert info.value.errno == errno.ENODATA


def test_bad_items_and_devices(tmp_path: Path) -> None:
    paths, _ = _files(tmp_path, n=1)
    with pytest.raises(TypeError):
        GDSDataset([(paths[0], 0)])
    with pytest.raises(ValueError, match="CPU or a CUDA device"):
        GDSDataset(paths, device="meta")
    with pytest.raises(IndexError):
        GDSDataset(paths)[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    paths, _ = _files(tmp_path, n=1)
    with pytest.raises(RuntimeError, match=r"needs CUDA.*torch.cuda.is_available\(\) is False"):
        GDSDataset(paths, device="cuda")


def test_cuda_device_in_workers_warns_and_returns_host_tensors(tmp_path: Path, capfd: pytest.CaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: pretend there is one (no GDS). The worker path never touches CUDA,
    # which is the point of it, so the pretence holds there.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(data_module, "_gds_usable", lambda *_: False)
    # The pretence must not reach CUDA's registration of the shared staging pool.
    monkeypatch.setattr(data_module, "staging_pool", tensorferry.PinnedPool)
    paths, contents = _files(tmp_path, n=6)
    dataset = GDSDataset(paths, device="cuda")
    assert dataset.device == torch.device("cuda", 0) and not dataset.uses_gds
    loader = DataLoader(dataset, batch_size=3, num_workers=2, multiprocessing_context="fork")
    with warnings.catch_warnings():
        # The workers inherit pytest's recording of warnings, which would keep theirs in
        # their own memory; have them written to the inherited stderr instead, every time.
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, *args, **kwargs: os.write(
            2, f"{category.__name__}: {message}\n".encode())
        got = _epoch(loader)
    assert sorted(got) == sorted(contents)
    err = capfd.readouterr().err
    assert err.count("GDSWorkerWarning") == 2  # once per worker process, not per batch
    assert "GPUDirect Storage is bypassed" in err and "num_workers=0" in err


def test_worker_warning_class_is_exported() -> None:
    assert issubclass(GDSWorkerWarning, UserWarning)


def requires_gds(test: Callable) -> Callable:
    usable = torch.cuda.is_available() and data_module._gds_usable()
    return pytest.mark.cuda(pytest.mark.skipif(not usable, reason="needs a CUDA device and kvikio with GDS "
                                               "(compat mode off)")(test))


@requires_cuda
def test_cuda_without_gds_copies_from_pinned_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_module, "_gds_usable", lambda *_: False)
    paths, contents = _files(tmp_path, n=6)
    dataset = GDSDataset(paths, device="cuda")
    for _ in range(3):  # later batches reuse buffers whose copies have ended
        got = _epoch(DataLoader(dataset, batch_size=4))
        assert got == contents
    assert dataset[0].device.type == "cuda"


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_hands_out_a_batch_of_equal_records_as_read(tmp_path: Path, workers: int) -> None:
    """Records of whole 4 KiB slots are read as rows of one [batch, length] tensor, and
    GDSDataset.collate hands that tensor out without a copy; other batches (a transform,
    unequal or unaligned lengths) are stacked by default_collate, as before."""
    rng = np.random.default_rng(4)
    blob = rng.integers(0, 256, 10 * 8192, dtype=np.uint8)
    (tmp_path / "records.bin").write_bytes(blob.tobytes())
    records = [(str(tmp_path / "records.bin"), i * 8192, 8192) for i in range(10)]
    dataset = GDSDataset(records)
    rows = dataset.__getitems__([3, 4, 5])
    batch = GDSDataset.collate(rows)
    assert batch.shape == (3, 8192) and batch.is_contiguous()
    assert batch.data_ptr() == rows[0].data_ptr()  # the read's own memory
    np.testing.assert_array_equal(batch.numpy(), blob.reshape(10, 8192)[3:6])
    loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=workers, collate_fn=GDSDataset.collate)
    for _ in range(2):
        batches = list(loader)
        assert [len(b) for b in batches] == [4, 4, 2]
        got = sorted(bytes(row.numpy()) for b in batches for row in b)
        assert got == sorted(bytes(r) for r in blob.reshape(10, 8192))
        batches[0].fill_(0)  # each batch is memory of its own: the next epoch is unaffected
    for other in (GDSDataset(records, transform=lambda t: t[:100]),
                  GDSDataset([(str(tmp_path / "records.bin"), i * 5000, 5000) for i in range(10)])):
        rows = other.__getitems__([0, 1, 2])
        batch = GDSDataset.collate(rows)
        assert batch.data_ptr() != rows[0].data_ptr()
        assert [bytes(r.numpy()) for r in batch] == [bytes(r.numpy()) for r in rows]
    assert GDSDataset.collate([{"a": torch.ones(2)}, {"a": torch.zeros(2)}])["a"].shape == (2, 2)


@requires_cuda
def test_cuda_batches_of_equal_records_copy_once_and_collate_in_place(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(data_module, "_gds_usable", lambda *_: False)
    blob = np.random.default_rng(5).integers(0, 256, 6 * 4096, dtype=np.uint8)
    (tmp_path / "records.bin").write_bytes(blob.tobytes())
    dataset = GDSDataset([(str(tmp_path / "records.bin"), i * 4096, 4096) for i in range(6)], device="cuda")
    for _ in range(3):  # later batches reuse buffers whose copies have ended
        batches = list(DataLoader(dataset, batch_size=4, collate_fn=GDSDataset.collate))
        assert [b.device.type for b in batches] == ["cuda", "cuda"] and [len(b) for b in batches] == [4, 2]
        np.testing.assert_array_equal(torch.cat(batches).cpu().numpy(), blob.reshape(6, 4096))


@requires_cuda
def test_cuda_dataset_in_spawned_workers(tmp_path: Path) -> None:
    """CUDA is up in the trainer (a forked worker could not use it): spawned workers get
    the dataset pickled and return host tensors, pinned for the copy to the device."""
    paths, contents = _files(tmp_path, n=8)
    dataset = GDSDataset(paths, device="cuda")
    assert dataset[0].device.type == "cuda"  # read here first: CUDA is initialised in this process
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="spawn", pin_memory=True,
                        persistent_workers=True)
    for _ in range(2):
        batches = list(loader)
        assert all(b.is_pinned() for b in batches)
        assert sorted(bytes(r.numpy()) for b in batches for r in b) == sorted(contents)


@requires_gds
def test_gds_reads_into_device_memory(tmp_path: Path) -> None:
    paths, contents = _files(tmp_path, n=6, size=2 << 20)
    records = [(paths[0], 4096, 1 << 20), (paths[1], 5, 1000)]
    dataset = GDSDataset(paths + records, device="cuda")
    assert dataset.uses_gds
    batch = dataset.__getitems__(range(len(dataset)))
    assert all(t.device.type == "cuda" for t in batch)
    expected = contents + [contents[0][4096:4096 + (1 << 20)], contents[1][5:1005]]
    assert [bytes(t.cpu().numpy()) for t in batch] == expected
    past_eof = GDSDataset([(paths[0], (2 << 20) - 10, 100)], device="cuda")
    with pytest.raises(OSError) as info:
        past_eof[0]
    assert info.value.errno == errno.ENODATA
    dataset.close()
