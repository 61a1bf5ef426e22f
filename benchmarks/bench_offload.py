"""OffloadedOptimizer: steps/s with the Adam state on NVMe vs in memory, swap bandwidth vs fio,
and overlap efficiency = (compute time + I/O time) / wall time.

    python benchmarks/bench_offload.py --dir /nvme/tmp --size 512M [--steps 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from tensorferry import bench, parse_size
from tensorferry.adapters.pytorch import OffloadedOptimizer


def model_params(state_bytes: int) -> list[torch.nn.Parameter]:
    """float32 parameters of 16 MiB each whose Adam state (2 tensors) adds up to ``state_bytes``."""
    count = max(1, state_bytes // (2 * (16 << 20)))
    params = [torch.nn.Parameter(torch.randn(4 << 20)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def timed_steps(optimizer: torch.optim.Optimizer, steps: int) -> float:
    optimizer.step()  # the first step creates the state
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--size", default="512M", help="bytes of optimizer state")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--resident", default=None, help="resident_bytes (default: size / 4)")
    args = parser.parse_args()
    size = parse_size(args.size)
    resident = parse_size(args.resident) if args.resident else size // 4

    params = model_params(size)
    in_memory = timed_steps(torch.optim.Adam(params, lr=1e-3), args.steps)

    params = model_params(size)
    with OffloadedOptimizer(torch.optim.Adam(params, lr=1e-3), args.dir, resident_bytes=resident) as opt:
        opt.step()
        before = opt.stats()
        offloaded = timed_steps(opt, args.steps)
        after = opt.stats()
    moved = (after["bytes_in"] - before["bytes_in"]) + (after["bytes_out"] - before["bytes_out"])
    io_per_step = moved / (args.steps + 1)

    print(f"optimizer state {size / 2**20:.0f} MiB, resident_bytes {resident / 2**20:.0f} MiB, "
          f"peak resident {after['peak_resident_bytes'] / 2**20:.0f} MiB")
    print(f"in memory: {1 / in_memory:.2f} steps/s ({in_memory * 1e3:.0f} ms/step)")
    print(f"offloaded: {1 / offloaded:.2f} steps/s ({offloaded * 1e3:.0f} ms/step), "
          f"{io_per_step / 2**20:.0f} MiB moved per step")
    swap_gbps = io_per_step / offloaded / 1e9
    print(f"swap bandwidth (read + write, over wall time): {swap_gbps:.2f} GB/s")
    if bench.fio_available():
        write = bench.run_fio(args.dir, "write", size // 2)
        read = bench.run_fio(args.dir, "read", size // 2)
        bench.remove_fio_file(args.dir)
        # Each step reads and writes the whole state: fio's time for the same bytes is the ceiling.
        io_time = io_per_step / 2 / (write.gbps * 1e9) + io_per_step / 2 / (read.gbps * 1e9)
        fio_gbps = io_per_step / io_time / 1e9
        print(f"fio: write {write.gbps:.2f} GB/s, read {read.gbps:.2f} GB/s, same mix {fio_gbps:.2f} GB/s; "
              f"swap / fio = {swap_gbps / fio_gbps:.2f}")
        print(f"overlap efficiency (compute {in_memory:.3f} s + I/O at fio speed {io_time:.3f} s) / wall "
              f"{offloaded:.3f} s = {(in_memory + io_time) / offloaded:.2f} "
              f"(best possible {(in_memory + io_time) / max(in_memory, io_time):.2f})")
    else:
        print("fio not installed: no ceiling, no overlap figure")


if __name__ == "__main__":
    main()
