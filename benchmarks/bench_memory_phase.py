"""Raw engine writes and reads of one file from memory at three phases within a page:
page-aligned, aligned only to the drive's DMA alignment (what O_DIRECT accepts, from
statx), and 64 bytes past a page (a torch tensor's, which the engine bounces through
its staging). Interleaved rounds; GB/s and CPU-s/GB per phase and direction.

The writer sends a large array to the drive from its own memory only when page-aligned
(``_Streamer._writable_in_place``); readers read straight into memory at the DMA
alignment (``ShardReader._direct_into``). This measures both choices.

    python benchmarks/bench_memory_phase.py --dir /nvme/tmp --size 1G [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

from tensorferry import Engine, File, bench, parse_size
from tensorferry.shard import ALIGNMENT, aligned_empty


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--size", type=parse_size, default=1 << 30)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "memory-phase.bin")
    with File(path, "w") as probe:
        if not probe.direct:
            raise SystemExit(f"{args.dir}: no O_DIRECT here, so memory alignment does not matter")
        dma = probe.memory_alignment
    phases = {"page-aligned": 0, f"{dma} B (DMA alignment)": dma % ALIGNMENT, "64 B past a page": 64}
    buffers = {label: aligned_empty(args.size, phase) for label, phase in phases.items()}
    for buffer in buffers.values():
        buffer[:] = 7  # faulted in before any timing
    engine = Engine()
    rows: dict[tuple[str, str], list[bench.Measurement]] = {}
    try:
        for _ in range(args.repeat):
            for label, buffer in buffers.items():
                file = File(path, "w")
                file.reserve(args.size)

                def write() -> None:
                    engine.pwrite(buffer, file, 0).result()
                    file.fsync()

                rows.setdefault((label, "write"), []).append(bench.timed(label, "write", args.size, write))
                file.close()
                bench.drop_cache([path])
                with File(path, "r") as file:
                    rows.setdefault((label, "read"), []).append(
                        bench.timed(label, "read", args.size, lambda: engine.pread(buffer, file, 0).result()))
    finally:
        engine.close()
        os.remove(path)
    print(f"{args.size / 2**30:g} GiB, {args.repeat} interleaved rounds, medians (ranges); "
          f"O_DIRECT memory alignment here: {dma} B")
    print(f"{'memory':28s} {'op':5s} {'GB/s':>18s} {'CPU-s/GB':>20s}")
    for (label, op), ms in rows.items():
        speeds, cpus = [m.gbps for m in ms], [m.cpu_per_gb for m in ms]
        print(f"{label:28s} {op:5s} {statistics.median(speeds):5.2f} ({min(speeds):.2f}-{max(speeds):.2f})"
              f" {statistics.median(cpus):7.3f} ({min(cpus):.3f}-{max(cpus):.3f})")


if __name__ == "__main__":
    main()
