"""GDSDataset + DataLoader vs a plain Dataset doing open().read(), bytes/s, against fio.

The data is ``--size`` bytes as 64 files; the page cache is dropped before each reader.

    python benchmarks/bench_data_torch.py --dir /nvme/tmp --size 512M [--workers 0] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch.utils.data import DataLoader, Dataset

from tensorferry import bench, parse_size
from tensorferry.adapters.pytorch import GDSDataset

FILES = 64


class OpenReadDataset(Dataset):
    """What users write without tensorferry: one buffered read per item."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.paths[index], "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


def drain(loader: DataLoader) -> int:
    return sum(t.numel() for batch in loader for t in batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="a directory on the drive to measure (default: a temp dir)")
    parser.add_argument("--size", default="512M")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    total = parse_size(args.size)
    per_file = total // FILES
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        paths = []
        for i in range(FILES):
            path = os.path.join(directory, f"item-{i:03d}.bin")
            with open(path, "wb") as f:
                f.write(bench.aligned_random(per_file, seed=i).tobytes())
            paths.append(path)
        nbytes = per_file * FILES
        # List collation: no stacking copy, so the readers alone are timed.
        readers = {
            "GDSDataset": GDSDataset(paths),
            "open().read()": OpenReadDataset(paths),
        }
        results = []
        for name, dataset in readers.items():
            loader = DataLoader(dataset, batch_size=args.batch, num_workers=args.workers, collate_fn=list)
            bench.drop_cache(paths)
            measurement = bench.timed(name, "read", nbytes, lambda: drain(loader))
            results.append(measurement)
        if bench.fio_available():
            bench.run_fio(directory, "write", nbytes)
            results.append(bench.run_fio(directory, "read", nbytes))
            bench.remove_fio_file(directory)
        fio = next((m for m in results if m.name == "fio"), None)
        print(f"{nbytes / 2**20:.0f} MiB as {FILES} files, batch {args.batch}, workers {args.workers}")
        for m in results:
            ratio = f"  {m.gbps / fio.gbps:.2f} of fio" if fio is not None else ""
            print(f"{m.name:>14}: {m.gbps:6.2f} GB/s  cpu {m.cpu_per_gb:5.2f} s/GB{ratio}")


if __name__ == "__main__":
    main()
