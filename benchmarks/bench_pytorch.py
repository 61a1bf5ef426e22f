"""PyTorch checkpoints: tensorferry against torch.save, DCP's FileSystemWriter/Reader,
safetensors and fio, in one run.

Writes are timed until durable; reads start from a dropped page cache.

    python benchmarks/bench_pytorch.py --dir /nvme/tmp --size 2G [--repeat 2] [--json] [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from tensorferry import bench, parse_size
from tensorferry.shard import digest
from tensorferry.adapters.pytorch import DCPReader, DCPWriter, FSDPCheckpointer, load, save


def make_state(nbytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 and bf16 tensors of mixed sizes (64 KiB to 64 MiB) adding up to ``nbytes``."""
    g = torch.Generator().manual_seed(seed)
    sizes = [64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    state, total, i = {}, 0, 0
    while total < nbytes:
        size = min(sizes[i % len(sizes)], nbytes - total)
        dtype = torch.float32 if i % 2 else torch.bfloat16
        n = max(1, size // dtype.itemsize)
        state[f"layers.{i}.weight"] = torch.randn(n, generator=g).to(dtype)
        total += n * dtype.itemsize
        i += 1
    return state


def fsync_tree(path: str) -> None:
    for f in bench.files_under(path) if os.path.isdir(path) else [path]:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def empty_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Destinations already in memory, as a model's parameters are when a checkpoint is restored.
    return {k: torch.ones_like(v) for k, v in state.items()}


def single_process(directory: str, state: dict[str, torch.Tensor], turn: int = 0) -> list[bench.Measurement]:
    """fio and every contender's save and load, in an order rotated by ``turn``."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    results: list[bench.Measurement] = []

    def writer_and_reader(name: str, write, read, target: str) -> None:
        shutil.rmtree(target, ignore_errors=True) if os.path.isdir(target) else None
        results.append(bench.timed(name, "write", nbytes, write))
        bench.drop_cache(bench.files_under(target) if os.path.isdir(target) else [target])
        results.append(bench.timed(name, "read", nbytes, read))
        shutil.rmtree(target) if os.path.isdir(target) else os.unlink(target)

    def tensorferry_save() -> None:
        f = os.path.join(directory, "tf.safetensors")
        writer_and_reader("tensorferry save/load", lambda: save(state, f), lambda: load(f), f)

    def fsdp_checkpointer() -> None:  # its model (a copy of the state) goes when it returns
        model = torch.nn.Module()  # the state as a model's parameters (loaded in place)
        for i, tensor in enumerate(state.values()):
            model.register_parameter(f"p{i}", torch.nn.Parameter(tensor.clone(), requires_grad=False))
        checkpointer = FSDPCheckpointer(os.path.join(directory, "tf-fsdp"), model)
        writer_and_reader("tensorferry FSDPCheckpointer save/load", lambda: checkpointer.save(1),
                          lambda: checkpointer.load(1), checkpointer.checkpoint_dir)

    def dcp_writer(name: str, make_writer, make_reader) -> None:
        d = os.path.join(directory, "dcp")
        dest = empty_like(state)
        writer_and_reader(name, lambda: dcp.save(state, storage_writer=make_writer(d)),
                          lambda: dcp.load(dest, storage_reader=make_reader(d)), d)

    def torch_save() -> None:
        f = os.path.join(directory, "torch.pt")

        def write() -> None:
            torch.save(state, f)
            fsync_tree(f)

        writer_and_reader("torch.save/load", write, lambda: torch.load(f, map_location="cpu"), f)

    def safetensors_save() -> None:
        try:
            from safetensors.torch import load_file, save_file
        except ImportError:
            return
        f = os.path.join(directory, "peer.safetensors")

        def write() -> None:
            save_file(state, f)
            fsync_tree(f)

        def read() -> None:
            for t in load_file(f).values():  # touch every byte: the file may be mapped lazily
                digest(t.reshape(-1).view(torch.uint8).numpy())

        writer_and_reader("safetensors save_file/load_file", write, read, f)

    contenders = [
        lambda: results.extend(bench.fio_rows(directory, nbytes)), tensorferry_save, fsdp_checkpointer,
        lambda: dcp_writer("tensorferry DCPWriter/Reader", DCPWriter, DCPReader),
        *(lambda threads=threads: dcp_writer(
            f"DCP FileSystemWriter x{threads}",
            lambda d: dcp.FileSystemWriter(d, thread_count=threads, sync_files=True), dcp.FileSystemReader)
          for threads in (1, 4)),
        torch_save, safetensors_save,
    ]
    for contender in bench.in_turn(contenders, turn):
        contender()
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, directory: str, nbytes: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = {f"rank{rank}.{k}": v for k, v in make_state(nbytes // world, seed=rank).items()}
    for name, make_writer in [("tensorferry DCPWriter, 2 ranks", lambda p: DCPWriter(p)),
                              ("DCP FileSystemWriter x4, 2 ranks",
                               lambda p: dcp.FileSystemWriter(p, thread_count=4, sync_files=True))]:
        path = os.path.join(directory, "dist")
        dist.barrier()
        start, cpu0 = time.perf_counter(), time.process_time()
        dcp.save(state, storage_writer=make_writer(path))
        cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
        dist.barrier()
        seconds = time.perf_counter() - start
        dist.all_reduce(cpu)  # both ranks' CPU, as one process's would count both halves' work
        if rank == 0:
            queue.put(bench.Measurement(name, "write", nbytes, seconds, float(cpu)))
            shutil.rmtree(path)
        dist.barrier()
    dist.destroy_process_group()


def two_ranks(directory: str, nbytes: int) -> list[bench.Measurement]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(2, _free_port(), directory, nbytes, queue), nprocs=2, join=True)
    results = []
    while not queue.empty():
        results.append(queue.get())
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--size", default="2G")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; the best of each contender is reported")
    parser.add_argument("--json", action="store_true")
    bench.add_results_option(parser)
    args = parser.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    started = time.time()
    nbytes = parse_size(args.size)
    state = make_state(nbytes)
    results = []
    for turn in range(args.repeat):
        results += single_process(args.dir, state, turn)
    del state
    for turn in range(args.repeat):  # with fio runs of their own, to compare with
        for contender in bench.in_turn([lambda: bench.fio_rows(args.dir, nbytes),
                                        lambda: two_ranks(args.dir, nbytes)], turn):
            results += contender()
    bench.save_run(args, "pytorch", ["python", *sys.argv], args.dir, started, measurements=results)
    print(bench.report(bench.best_of(results), args.json))
    return 0


if __name__ == "__main__":
    with bench.freed_memory_kept():
        sys.exit(main())
