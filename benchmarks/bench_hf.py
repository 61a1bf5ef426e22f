"""Loading a Hugging Face folder (safetensors shards and model.safetensors.index.json):
tensorferry's ``adapters.pytorch.load(folder)`` against safetensors' ``load_file`` over
the same shards, every byte touched, and fio, from a dropped page cache.

The shards are written by ``safetensors.torch.save_file`` (as ``save_pretrained``
writes them: no tensorferry checksums), so tensorferry's load reads without hashing;
``tensorferry load + hash`` hashes every tensor too, as ``safetensors load_file +
hash`` must to read every byte of its memory map.

    python benchmarks/bench_hf.py --dir /nvme/tmp --size 1G --shards 4 [--repeat 3] [--json] [--results DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch
from safetensors.torch import load_file, save_file

from tensorferry import bench, parse_size
from tensorferry.adapters.pytorch import load
from tensorferry.adapters.pytorch.tensors import host_bytes
from tensorferry.shard import digest


def make_folder(directory: str, nbytes: int, shards: int) -> list[str]:
    """A Hugging Face folder of ``shards`` files: bf16 and fp32 tensors of 64 KiB to 64 MiB."""
    g = torch.Generator().manual_seed(0)
    sizes = [64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    state, total, i = {}, 0, 0
    while total < nbytes:
        dtype = torch.float32 if i % 2 else torch.bfloat16
        n = max(1, min(sizes[i % len(sizes)], nbytes - total) // dtype.itemsize)
        state[f"model.layers.{i}.weight"] = torch.randn(n, generator=g).to(dtype)
        total += n * dtype.itemsize
        i += 1
    names = list(state)
    files, weight_map = [], {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[s::shards]}
        save_file(part, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        files.append(os.path.join(directory, file))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    bench.fsync_tree(directory)
    return files


def hash_all(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        digest(host_bytes(t))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="a directory on the drive to measure")
    parser.add_argument("--size", type=parse_size, default=parse_size("1G"))
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    bench.add_results_option(parser)
    args = parser.parse_args()
    started = time.time()
    folder = os.path.join(os.path.abspath(args.dir), "bench-hf")
    os.makedirs(folder)
    try:
        files = make_folder(folder, args.size, args.shards)
        nbytes = sum(os.path.getsize(f) for f in files)
        readers = {
            "safetensors load_file + hash": lambda: [hash_all(load_file(f)) for f in files],
            "tensorferry load": lambda: load(folder),
            "tensorferry load + hash": lambda: hash_all(load(folder)),
        }
        rounds = bench.reader_rounds(folder, files, nbytes, readers, args.repeat, rounds=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    results = bench.best_of(rounds)
    print(bench.report(results, as_json=args.json))
    bench.save_run(args, "hf", ["python", *sys.argv], os.path.abspath(args.dir), started, measurements=rounds)
    return 0


if __name__ == "__main__":
    with bench.freed_memory_kept():
        sys.exit(main())
