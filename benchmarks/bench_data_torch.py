"""GDSDataset + DataLoader vs a plain Dataset doing open().read(), bytes/s, against fio.

The data is ``--size`` bytes as 64 files, again as one file read as 1 MiB records and
as 64 KiB records (small items, such as tokenized sequences or thumbnails, in batches of
128), and again as 128 KiB files (images, say; in batches of 128); the page cache is
dropped before each reader. Batches are lists of the items (``collate_fn=list``), except
in the "stacked" cases, where records come as one ``[batch, length]`` tensor, as a
training loop takes them: ``GDSDataset.collate`` against torch's ``default_collate``.

    python benchmarks/bench_data_torch.py --dir /nvme/tmp --size 2G [--workers 0] [--batch 8] [--repeat 2]
        [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset

from tensorferry import bench, parse_size
from tensorferry.adapters.pytorch import GDSDataset

FILES = 64
RECORD = 1 << 20
SMALL_RECORD = 64 << 10
SMALL_BATCH = 128
SMALL_FILE = 128 << 10


class OpenReadDataset(Dataset):
    """What users write without tensorferry: one buffered read per item, a whole file or
    a ``(file, offset, length)`` record."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        item = self.items[index]
        path, offset, length = (item, 0, -1) if isinstance(item, str) else item
        with open(path, "rb") as f:
            f.seek(offset)
            return torch.frombuffer(bytearray(f.read(length)), dtype=torch.uint8)


def drain(loader: DataLoader) -> int:
    return sum(batch.numel() if isinstance(batch, torch.Tensor) else sum(t.numel() for t in batch)
               for batch in loader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="a directory on the drive to measure (default: a temp dir)")
    parser.add_argument("--size", default="512M")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1, help="rounds; the best of each reader is reported")
    parser.add_argument("--json", action="store_true")
    bench.add_results_option(parser)
    args = parser.parse_args()
    started = time.time()
    total = parse_size(args.size)
    per_file = total // FILES
    nbytes = per_file * FILES
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        paths = []
        for i in range(FILES):
            path = os.path.join(directory, f"item-{i:03d}.bin")
            with open(path, "wb") as f:
                f.write(bench.aligned_random(per_file, seed=i).tobytes())
            paths.append(path)
        records_file = os.path.join(directory, "records.bin")
        with open(records_file, "wb") as f:
            for path in paths:
                with open(path, "rb") as src:
                    shutil.copyfileobj(src, f)
        small_files = []
        with open(records_file, "rb") as src:
            for i in range(nbytes // SMALL_FILE):
                small_files.append(os.path.join(directory, f"small-{i:05d}.bin"))
                with open(small_files[-1], "wb") as f:
                    f.write(src.read(SMALL_FILE))
        records = [(records_file, offset, RECORD) for offset in range(0, nbytes - RECORD + 1, RECORD)]
        small = [(records_file, offset, SMALL_RECORD) for offset in range(0, nbytes - SMALL_RECORD + 1, SMALL_RECORD)]
        stacked = f"64 KiB records, batches of {SMALL_BATCH} stacked"
        cases = {  # dataset, batch size[, collate_fn]
            f"GDSDataset, {FILES} files": (GDSDataset(paths), args.batch),
            f"open().read(), {FILES} files": (OpenReadDataset(paths), args.batch),
            "GDSDataset, 1 MiB records": (GDSDataset(records), args.batch),
            "open().read(), 1 MiB records": (OpenReadDataset(records), args.batch),
            f"GDSDataset, 64 KiB records, batches of {SMALL_BATCH}": (GDSDataset(small), SMALL_BATCH),
            f"open().read(), 64 KiB records, batches of {SMALL_BATCH}": (OpenReadDataset(small), SMALL_BATCH),
            f"GDSDataset, 128 KiB files, batches of {SMALL_BATCH}": (GDSDataset(small_files), SMALL_BATCH),
            f"open().read(), 128 KiB files, batches of {SMALL_BATCH}": (OpenReadDataset(small_files), SMALL_BATCH),
            "GDSDataset, 1 MiB records stacked (GDSDataset.collate)":
                (GDSDataset(records), args.batch, GDSDataset.collate),
            "GDSDataset, 1 MiB records stacked (default_collate)": (GDSDataset(records), args.batch, None),
            "open().read(), 1 MiB records stacked (default_collate)": (OpenReadDataset(records), args.batch, None),
            f"GDSDataset, {stacked} (GDSDataset.collate)": (GDSDataset(small), SMALL_BATCH, GDSDataset.collate),
            f"open().read(), {stacked} (default_collate)": (OpenReadDataset(small), SMALL_BATCH, None),
        }
        loaders = {name: DataLoader(case[0], batch_size=case[1], num_workers=args.workers,
                                    collate_fn=case[2] if len(case) > 2 else list)
                   for name, case in cases.items()}
        results = bench.reader_rounds(directory, [*paths, records_file, *small_files], nbytes,
                                      {name: lambda loader=loader: drain(loader) for name, loader in loaders.items()},
                                      args.repeat, rounds=True)
        bench.save_run(args, "data_torch", ["python", *sys.argv], directory, started, measurements=results)
        print(f"{nbytes / 2**20:.0f} MiB, batch {args.batch}, workers {args.workers}")
        print(bench.report(bench.best_of(results), args.json))


if __name__ == "__main__":
    with bench.freed_memory_kept():
        main()
