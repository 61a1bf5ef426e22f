"""NVMe offload: OffloadedOptimizer (steps/s with the Adam state on NVMe vs in memory,
swap bandwidth vs fio) and stream_weights (a forward pass with the weights on NVMe vs in
memory), each with overlap efficiency = (compute time + I/O time) / wall time and the share
of the I/O hidden behind compute = (compute + I/O - wall) / I/O, I/O timed at fio's speed.

Adam's update is cheap next to reading and writing its state, so the optimizer is I/O
bound here whatever the overlap; the weight-streaming case sizes its batch so that each
layer's compute takes at least as long as reading its weights, the case the overlap target
is about.

    python benchmarks/bench_offload.py --dir /nvme/tmp --size 512M [--steps 3] [--weights 1G]
        [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from tensorferry import bench, parse_size
from tensorferry.adapters.pytorch import OffloadedOptimizer, stream_weights


def model_params(state_bytes: int) -> list[torch.nn.Parameter]:
    """float32 parameters of 16 MiB each whose Adam state (2 tensors) adds up to ``state_bytes``."""
    count = max(1, state_bytes // (2 * (16 << 20)))
    params = [torch.nn.Parameter(torch.randn(4 << 20)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def timed_steps(optimizer: torch.optim.Optimizer, steps: int) -> float:
    """The fastest of ``steps`` steps, after one that creates the state (the CPU is shared
    with other machines, so the best step is the one least disturbed)."""
    optimizer.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return min(times)


def figures(case: str, nbytes: int, in_memory: float, offloaded: float, io: float, fio_gbps: float | None,
            io_gbps: float) -> dict[str, Any]:
    """One row of the result file: a case's times (best of its rounds) and what they make."""
    return {"case": case, "MiB moved": round(nbytes / 2**20), "in memory, s": round(in_memory, 3),
            "offloaded, s": round(offloaded, 3), "I/O GB/s": round(io_gbps, 2),
            "x fio": round(io_gbps / fio_gbps, 2) if fio_gbps else None,
            "overlap efficiency": round((in_memory + io) / offloaded, 2),
            "best possible": round((in_memory + io) / max(in_memory, io), 2),
            "I/O hidden": f"{(in_memory + io - offloaded) / io:.0%}"}


def stream_case(directory: str, weights_bytes: int, fio_read_gbps: float | None, batch: int,
                rounds: int = 3) -> dict[str, Any]:
    """A stack of 4096x4096 float32 Linear layers (64 MiB each) run with its weights on NVMe."""
    width = 4096
    layers = max(2, weights_bytes // (width * width * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    x = torch.randn(batch, width)
    resident = 3 * width * width * 4  # the running layer and two in flight
    one_row = x[:1]
    compute, wall, io = [], [], []
    with torch.no_grad():
        expected = model(x)  # also warms up the kernels and the memory
        with stream_weights(model, directory, resident_bytes=resident, prefetch=2) as streamed:
            model(x)  # the first pass learns the order of the layers
            for _ in range(rounds):  # the CPU is shared with other machines: best of a few
                start = time.perf_counter()
                got = model(x)
                wall.append(time.perf_counter() - start)
                start = time.perf_counter()
                model(one_row)  # next to no compute: the time to read the weights
                io.append(time.perf_counter() - start)
            peak = streamed.peak_resident_bytes
        for _ in range(rounds):
            start = time.perf_counter()
            model(x)
            compute.append(time.perf_counter() - start)
    compute, wall, io = min(compute), min(wall), min(io)
    if not torch.equal(got, expected):
        raise AssertionError("streamed forward differs from the in-memory one")
    moved = layers * width * width * 4
    print(f"stream_weights: {layers} layers, {moved / 2**20:.0f} MiB of weights, batch {batch}, "
          f"peak resident {peak / 2**20:.0f} MiB")
    print(f"  in memory {compute:.3f} s/forward, streamed {wall:.3f} s/forward "
          f"({moved / wall / 1e9:.2f} GB/s of weights)")
    print(f"  reading the weights alone (a one-row forward) {io:.3f} s ({moved / io / 1e9:.2f} GB/s"
          + (f", {moved / io / 1e9 / fio_read_gbps:.2f} of fio's read)" if fio_read_gbps else ")"))
    print(f"  overlap efficiency (compute + I/O) / wall = {(compute + io) / wall:.2f} "
          f"(best possible {(compute + io) / max(compute, io):.2f}); I/O hidden {(compute + io - wall) / io:.0%}")
    # I/O alone is the one-row forward's time; fio's read is its ceiling.
    return figures(f"stream_weights, batch {batch}", moved, compute, wall, io, fio_read_gbps, moved / io / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--size", default="512M", help="bytes of optimizer state")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--resident", default=None, help="resident_bytes (default: size / 4)")
    parser.add_argument("--weights", default="1G", help="bytes of weights for the stream_weights case")
    parser.add_argument("--batch", type=int, default=512,
                        help="rows per forward in the stream_weights case (compute per layer grows with it)")
    bench.add_results_option(parser)
    args = parser.parse_args()
    started = time.time()
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
    fio_gbps = io_time = None
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
        read = None
    rows = [] if io_time is None else [
        figures("OffloadedOptimizer (Adam), I/O at fio's speed", round(io_per_step), in_memory, offloaded, io_time,
                fio_gbps, swap_gbps)]
    rows.append(stream_case(args.dir, parse_size(args.weights), read.gbps if read else None, args.batch))
    bench.save_run(args, "offload", sys.argv, args.dir, started, rows=rows)

if __name__ == "__main__":
    with bench.freed_memory_kept():
        main()
