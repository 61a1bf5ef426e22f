"""What a background save does to the training beside it: ``FSDPCheckpointer.save_async``
of 4096 x 256 KiB while a loop makes reference cycles (each holding a small tensor, if
asked), with 400,000 live objects for the collector to walk. Prints, per round, the
save's time, the longest and median step, and how much the process grew during the save
(cycles the collector did not free). The first round also allocates the staging memory.

    python benchmarks/bench_background_gc.py --dir DIR --cycles 20 --tensor-kib 64
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import time
import warnings

import torch

from tensorferry.adapters.pytorch import FSDPCheckpointer


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="where the checkpoints go (removed between rounds)")
    parser.add_argument("--cycles", type=int, default=20, help="reference cycles made per step")
    parser.add_argument("--tensor-kib", type=int, default=64, help="a tensor of this size in each cycle (0: none)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
    live = [[i] for i in range(400_000)]  # what every full collection walks
    model = torch.nn.Module()
    for i in range(4096):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(65536)))

    def step() -> None:
        for _ in range(args.cycles):
            cycle: list = []
            cycle.append(cycle)
            if args.tensor_kib:
                cycle.append(torch.empty(args.tensor_kib * 256))

    for number in range(args.rounds):
        shutil.rmtree(args.dir, ignore_errors=True)
        checkpointer = FSDPCheckpointer(args.dir, model)
        gc.collect()
        base = peak = rss_mib()
        start = time.perf_counter()
        future = checkpointer.save_async(number)
        steps, paused = [], 0
        while not future.done():
            paused += not gc.isenabled()
            began = time.perf_counter()
            step()
            steps.append(time.perf_counter() - began)
            peak = max(peak, rss_mib())
        future.result()
        print(f"round {number + 1}: save {time.perf_counter() - start:.2f} s, {len(steps)} steps, longest "
              f"{max(steps) * 1e3:.0f} ms, median {statistics.median(steps) * 1e3:.2f} ms; the process grew "
              f"{peak - base:.0f} MiB during the save; the collector was off in {paused} steps", flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    del live
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
