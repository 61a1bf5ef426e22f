"""NVMe offload: OffloadedOptimizer (steps/s with the Adam state on NVMe vs in memory,
swap bandwidth vs fio) and stream_weights (a forward pass with the weights on NVMe vs in
memory), each with overlap efficiency = (compute time + I/O time) / wall time and the share
of the I/O hidden behind compute = (compute + I/O - wall) / I/O.

Each timed round runs right after a fio run of the same bytes (the disk here changes speed
from minute to minute): the optimizer's steps beside fio writing and reading the state,
the weights' I/O-alone forwards beside fio reading them. Figures are medians of the rounds,
I/O judged against the fio run beside it.

Adam's update is cheap next to reading and writing its state, so the optimizer is I/O
bound here whatever the overlap; the weight-streaming case sizes its batch so that each
layer's compute takes at least as long as reading its weights, the case the overlap target
is about.

    python benchmarks/bench_offload.py --dir /nvme/tmp --size 512M [--rounds 3] [--weights 1G]
        [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

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


def seconds_of(action: Callable[[], Any]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        action()
        return time.perf_counter() - start
    return run


def figures(case: str, nbytes: int, in_memory: float, wall: float, io: float, io_rounds: list[float],
            fio: list[float]) -> dict[str, Any]:
    """One row of the result file and the printout: a case's median times, the bandwidth
    of its I/O rounds (``nbytes`` each), and the median of their ratios to the fio run
    beside each; ``io`` is the I/O time that overlap is judged by."""
    row = {"case": case, "MiB moved": round(nbytes / 2**20), "in memory, s": round(in_memory, 3),
           "offloaded, s": round(wall, 3), "I/O GB/s": round(nbytes / statistics.median(io_rounds) / 1e9, 2),
           "x fio": round(statistics.median(f / t for f, t in zip(fio, io_rounds)), 2) if fio else None,
           "overlap efficiency": round((in_memory + io) / wall, 2),
           "best possible": round((in_memory + io) / max(in_memory, io), 2),
           "I/O hidden": f"{(in_memory + io - wall) / io:.0%}"}
    print(", ".join(f"{k} {v}" for k, v in row.items()))
    return row


def optimizer_case(directory: str, size: int, resident: int, rounds: int) -> dict[str, Any]:
    """Adam over ``size`` bytes of state, in memory and offloaded; the I/O is the state read
    and written once per step, timed as fio moves the same bytes beside each step."""
    params = model_params(size)
    in_memory = torch.optim.Adam(params, lr=1e-3)
    in_memory.step()  # creates the state
    compute = statistics.median(seconds_of(in_memory.step)() for _ in range(rounds))
    del in_memory
    params = model_params(size)
    with OffloadedOptimizer(torch.optim.Adam(params, lr=1e-3), directory, resident_bytes=resident) as opt:
        opt.step()
        before = opt.stats()
        opt.step()
        after = opt.stats()
        moved = (after["bytes_in"] - before["bytes_in"]) + (after["bytes_out"] - before["bytes_out"])
        walls, fio = bench.rounds_beside_fio(seconds_of(opt.step), directory, moved // 2, rounds, ("write", "read"))
        peak = opt.stats()["peak_resident_bytes"]
    print(f"optimizer state {size / 2**20:.0f} MiB, resident_bytes {resident / 2**20:.0f} MiB, "
          f"peak resident {peak / 2**20:.0f} MiB")
    wall = statistics.median(walls)
    # Swaps overlap Adam's compute: the step's I/O is judged at fio's time for the same bytes.
    io = statistics.median(fio) if fio else wall
    return figures("OffloadedOptimizer (Adam)", moved, compute, wall, io, walls, fio)


def stream_case(directory: str, weights_bytes: int, batch: int, rounds: int) -> dict[str, Any]:
    """A stack of 4096x4096 float32 Linear layers (64 MiB each) run with its weights on NVMe."""
    width = 4096
    layers = max(2, weights_bytes // (width * width * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    x = torch.randn(batch, width)
    resident = 3 * width * width * 4  # the running layer and two in flight
    moved = layers * width * width * 4
    with torch.no_grad():
        expected = model(x)  # also warms up the kernels and the memory
        compute = statistics.median(seconds_of(lambda: model(x))() for _ in range(rounds))
        with stream_weights(model, directory, resident_bytes=resident, prefetch=2) as streamed:
            got = model(x)  # the first pass learns the order of the layers
            wall = statistics.median(seconds_of(lambda: model(x))() for _ in range(rounds))
            # A one-row forward has next to no compute: its time is the weights' I/O.
            io_rounds, fio = bench.rounds_beside_fio(seconds_of(lambda: model(x[:1])), directory, moved, rounds)
            peak = streamed.peak_resident_bytes
    if not torch.equal(got, expected):
        raise AssertionError("streamed forward differs from the in-memory one")
    print(f"stream_weights: {layers} layers, {moved / 2**20:.0f} MiB of weights, batch {batch}, "
          f"peak resident {peak / 2**20:.0f} MiB")
    return figures(f"stream_weights, batch {batch}", moved, compute, wall, statistics.median(io_rounds), io_rounds,
                   fio)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--size", default="512M", help="bytes of optimizer state")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--resident", default=None, help="resident_bytes (default: size / 4)")
    parser.add_argument("--weights", default="1G", help="bytes of weights for the stream_weights case")
    parser.add_argument("--batch", type=int, default=512,
                        help="rows per forward in the stream_weights case (compute per layer grows with it)")
    bench.add_results_option(parser)
    args = parser.parse_args()
    started = time.time()
    size = parse_size(args.size)
    resident = parse_size(args.resident) if args.resident else size // 4
    if not bench.fio_available():
        print("fio not installed: no ceiling")
    rows = [optimizer_case(args.dir, size, resident, args.rounds),
            stream_case(args.dir, parse_size(args.weights), args.batch, args.rounds)]
    bench.save_run(args, "offload", ["python", *sys.argv], args.dir, started, rows=rows)


if __name__ == "__main__":
    with bench.freed_memory_kept():
        main()
