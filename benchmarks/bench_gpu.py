"""GPU checkpoints and reads: tensorferry against its peers and fio, in one run.

    python benchmarks/bench_gpu.py --dir /nvme/tmp --size 8G --out gpu.json [--rounds 1] [--device cuda]

Figures (each with its peers and the fio ceiling measured in the same run):

- save from GPU: ``adapters.pytorch.save`` (one file) and ``save_checkpoint`` (a
  directory) against ``torch.save`` of the state moved to the CPU, DCP's
  ``FileSystemWriter`` and fio's write;
- load to GPU: ``adapters.pytorch.load(..., map_location="cuda")`` of the file and the
  directory against safetensors ``load_file(..., device="cuda")`` (fastsafetensors too,
  if installed) and fio's read;
- save_async stall: the host snapshot ``dcp.async_save`` takes through ``DCPWriter``
  against a plain ``.to("cpu", non_blocking=True)`` of the state into pinned memory;
- GDS against the pinned bounce, for the same transfers through the engine, and which
  one the defaults pick;
- ``GDSDataset``'s GPU paths (GDS where kvikio has it on, pinned copy always).

Writes are timed until durable (every contender fsyncs; DCP's writer does itself);
reads start from a dropped page cache and end when the data is in device memory
(``torch.cuda.synchronize``). tensorferry's staging pool is filled (and registered with
CUDA) before the first step, as a training run's second save finds it. ``--device cpu`` runs the
same steps with host tensors, to try the script where there is no GPU; its figures mean nothing
for a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

import tensorferry
from tensorferry import bench, parse_size
from tensorferry.adapters.pytorch import DCPWriter, GDSDataset, load, save, save_checkpoint
from tensorferry.adapters.pytorch import staging

TARGET_OF_FIO = 0.90
STALL_TARGET = 1.2


def make_state(nbytes: int, count: int, device: torch.device) -> dict[str, torch.Tensor]:
    """bf16 tensors adding up to ``nbytes``: ``count`` large ones, with a small bias after
    each (as a model's layers have), made on ``device``."""
    g = torch.Generator(device=device).manual_seed(0)
    large = max(4096, (nbytes - count * 8192) // count // 2 * 2)
    state = {}
    for i in range(count):
        state[f"layers.{i}.weight"] = torch.randn(large // 2, generator=g, device=device, dtype=torch.bfloat16)
        state[f"layers.{i}.bias"] = torch.randn(4096, generator=g, device=device, dtype=torch.bfloat16)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cold(path: str) -> None:
    bench.drop_cache(bench.files_under(path) if os.path.isdir(path) else [path])


def timed(action: Callable[[], Any]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def row(name: str, nbytes: int, seconds: list[float], **extra: Any) -> dict[str, Any]:
    median = statistics.median(seconds)
    return {"name": name, "nbytes": nbytes, "seconds": round(median, 4), "gbps": round(nbytes / median / 1e9, 3),
            "rounds": [round(s, 4) for s in seconds], **extra}


def judge(figure: str, ours: list[dict[str, Any]], peers: list[dict[str, Any]], ceiling: dict[str, Any] | None,
          target: str) -> dict[str, Any]:
    """A figure: our rows, the peers', the ceiling, and whether the target is met."""
    best = max(r["gbps"] for r in ours)
    result: dict[str, Any] = {"figure": figure, "target": target, "tensorferry": ours, "peers": peers,
                              "ceiling": ceiling, "best_tensorferry_gbps": best}
    result["ahead_of_peers"] = all(best > p["gbps"] for p in peers) if peers else None
    if ceiling is not None:
        result["ratio_to_ceiling"] = round(best / ceiling["gbps"], 3)
        result["met"] = bool(result["ratio_to_ceiling"] >= TARGET_OF_FIO and result["ahead_of_peers"] is not False)
    else:
        result["met"] = None
    return result


class Run:
    def __init__(self, directory: str, nbytes: int, count: int, rounds: int, device: torch.device,
                 log: Callable[[str], None]) -> None:
        self.dir, self.rounds, self.device, self.log = directory, rounds, device, log
        self.state = make_state(nbytes, count, device)
        self.nbytes = state_bytes(self.state)
        self.fio: dict[str, dict[str, Any]] = {}
        self.warm_pool()

    def warm_pool(self) -> None:
        """Fills the staging pool with registered buffers of the state's size class, as a
        training run's second save finds it (the first pays for mlock and
        cudaHostRegister once; every later save and load reuses the buffers)."""
        pool = staging.staging_pool()
        size = max(t.numel() * t.element_size() for t in self.state.values())
        held = [pool.acquire(size) for _ in range(max(1, min(8, (1 << 30) // pool.size_class(size))))]
        for buffer in held:
            pool.release(buffer)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def repeat(self, action: Callable[[], Any], before: Callable[[], Any] | None = None,
               after: Callable[[], Any] | None = None) -> list[float]:
        times = []
        for _ in range(self.rounds):
            if before is not None:
                before()
            times.append(timed(action))
            if after is not None:
                after()
        return times

    # ---- the ceiling ------------------------------------------------------------
    def ceiling(self) -> None:
        if bench.fio_available():
            self.log("fio")
            writes, reads = [], []
            for _ in range(self.rounds):
                writes.append(bench.run_fio(self.dir, "write", self.nbytes).seconds)
                reads.append(bench.run_fio(self.dir, "read", self.nbytes).seconds)
                bench.remove_fio_file(self.dir)
            self.fio = {"write": row("fio write (io_uring, O_DIRECT, 1 MiB x 32)", self.nbytes, writes),
                        "read": row("fio read (io_uring, O_DIRECT, 1 MiB x 32)", self.nbytes, reads)}

    # ---- save from GPU ----------------------------------------------------------
    def saves(self) -> dict[str, Any]:
        state, n = self.state, self.nbytes
        ours = []
        self.log("tensorferry save")
        file, directory = self.path("tf.safetensors"), self.path("tf_dir")
        ours.append(row("tensorferry save (one file)", n, self.repeat(
            lambda: save(state, file), after=lambda: bench.remove_path(file))))
        self.log("tensorferry save_checkpoint")
        ours.append(row("tensorferry save_checkpoint (directory)", n, self.repeat(
            lambda: save_checkpoint(directory, state), after=lambda: bench.remove_path(directory))))
        peers = []
        self.log("torch.save")

        def torch_save() -> None:
            torch.save({k: v.cpu() for k, v in state.items()}, self.path("torch.pt"))
            bench.fsync_tree(self.path("torch.pt"))

        peers.append(row("torch.save of the state moved to the CPU", n,
                         self.repeat(torch_save, after=lambda: bench.remove_path(self.path("torch.pt")))))
        self.log("DCP FileSystemWriter")
        peers.append(row("DCP FileSystemWriter", n, self.repeat(
            lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(self.path("dcp"))),
            after=lambda: bench.remove_path(self.path("dcp")))))
        return judge("save from GPU", ours, peers, self.fio.get("write"),
                     f">= {TARGET_OF_FIO} of fio's write, ahead of both peers")

    # ---- load to GPU ------------------------------------------------------------
    def loads(self) -> dict[str, Any]:
        n, device = self.nbytes, self.device
        file, directory = self.path("tf.safetensors"), self.path("tf_dir")
        save(self.state, file)
        save_checkpoint(directory, self.state)
        ours, peers = [], []
        failed_peers: dict[str, str] = {}
        try:
            def loaded(path: str, fn: Callable[[], Any]) -> list[float]:
                def action() -> None:
                    out = fn()
                    sync(device)
                    del out
                return self.repeat(action, before=lambda: cold(path))

            self.log("tensorferry load")
            ours.append(row("tensorferry load (one file)", n, loaded(file, lambda: load(file, map_location=device))))
            ours.append(row("tensorferry load (directory)", n,
                            loaded(directory, lambda: load(directory, map_location=device))))
            with tensorferry.Engine() as engine:
                path = "GDS" if device.type == "cuda" and engine.gds_mode == "gds" else "pinned bounce"
                ours.append(row(f"tensorferry load (one file, verify=False: {path})", n,
                                loaded(file, lambda: load(file, map_location=device, verify=False, engine=engine))))
            self.log("safetensors load_file")
            from safetensors.torch import load_file
            peers.append(row(f"safetensors load_file(device={str(device)!r})", n,
                             loaded(file, lambda: load_file(file, device=str(device)))))
            # fastsafetensors' GDS path where cuFile runs, as ours; else its own bounce (nogds).
            fast = fastsafetensors_loader(file, device, nogds=path != "GDS")
            if fast is not None:
                name = f"fastsafetensors ({'GDS' if path == 'GDS' else 'nogds'})"
                self.log(name)
                try:
                    peers.append(row(name, n, loaded(file, fast)))
                except Exception as exc:  # noqa: BLE001 - an optional peer's failure is recorded, not ours
                    failed_peers[name] = f"{type(exc).__name__}: {exc}"
                    self.log(f"{name} failed: {failed_peers[name]}")
        finally:
            bench.remove_path(file)
            bench.remove_path(directory)
        figure = judge("load to GPU", ours, peers, self.fio.get("read"),
                       f">= {TARGET_OF_FIO} of fio's read, ahead of every peer")
        if failed_peers:
            figure["failed_peers"] = failed_peers
        return figure

    # ---- save_async stall -------------------------------------------------------
    def stall(self) -> dict[str, Any]:
        state, device = self.state, self.device
        pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=device.type == "cuda") for k, v in state.items()}

        def plain() -> None:
            for k, v in state.items():
                pinned[k].copy_(v, non_blocking=True)
            sync(device)

        self.log("stall: plain copy into pinned memory")
        plain()  # warm
        baseline = row("state.to('cpu', non_blocking=True) into pinned memory", self.nbytes,
                       self.repeat(plain))
        pinned.clear()  # its pinned memory goes before the snapshots take theirs
        self.log("stall: DCPWriter.stage")
        staging.stage_state_dict(state)  # the pool fills (and registers) once; later saves reuse it
        snapshot = row("DCPWriter.stage (the host snapshot of dcp.async_save)", self.nbytes,
                       self.repeat(lambda: staging.stage_state_dict(state)))
        self.log("stall: dcp.async_save")
        futures = []

        def async_save() -> None:
            futures.append(dcp.async_save(state, storage_writer=DCPWriter(self.path(f"async{len(futures)}"))))

        def finish() -> None:
            futures[-1].result()
            bench.remove_path(self.path(f"async{len(futures) - 1}"))

        whole = row("dcp.async_save(..., storage_writer=DCPWriter) until it returns", self.nbytes,
                    self.repeat(async_save, after=finish))
        ratio = whole["seconds"] / baseline["seconds"]
        return {"figure": "save_async stall", "target": f"within {STALL_TARGET}x of the plain pinned copy",
                "tensorferry": [whole, snapshot], "peers": [baseline], "ceiling": None,
                "stall_ratio": round(ratio, 3), "met": bool(ratio <= STALL_TARGET)}

    # ---- GDS against the pinned bounce ------------------------------------------
    def gds_vs_bounce(self, nbytes: int) -> dict[str, Any]:
        device = self.device
        engine = tensorferry.Engine()
        mode = engine.gds_mode if device.type == "cuda" else "off"
        data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        back = torch.empty_like(data)
        path = self.path("gds.bin")
        rows = []
        try:
            pool = staging.staging_pool()

            def bounce_write() -> None:
                host, wait = staging.copy_to_host_async(data, pool) if device.type == "cuda" else (data.numpy(), None)
                if wait is not None:
                    wait()
                with tensorferry.open(path, "w") as f:
                    engine.write(host, f)
                    f.fsync()

            def bounce_read() -> None:
                host = staging.leased(pool, nbytes)
                with tensorferry.open(path, "r") as f:
                    engine.read(host, f)
                back.copy_(torch.from_numpy(host), non_blocking=True)
                sync(device)

            self.log("pinned bounce")
            rows.append(row("pinned bounce write (device -> pinned -> O_DIRECT)", nbytes, self.repeat(bounce_write)))
            rows.append(row("pinned bounce read (O_DIRECT -> pinned -> device)", nbytes,
                            self.repeat(bounce_read, before=lambda: cold(path))))
            if mode != "off":
                def gds_write() -> None:
                    with tensorferry.open(path, "w") as f:
                        engine.write(data, f)
                        f.fsync()

                def gds_read() -> None:
                    with tensorferry.open(path, "r") as f:
                        engine.read(back, f)

                self.log(f"kvikio ({mode})")
                rows.append(row(f"kvikio write ({mode})", nbytes, self.repeat(gds_write)))
                rows.append(row(f"kvikio read ({mode})", nbytes, self.repeat(gds_read, before=lambda: cold(path))))
                if not torch.equal(back, data):
                    raise AssertionError("kvikio read back other bytes than it wrote")
        finally:
            engine.close()
            bench.remove_path(path)
        return {"figure": "GDS vs pinned bounce", "gds_mode": mode, "rows": rows, "ceiling": self.fio,
                "defaults": {"Engine.pread/pwrite of device buffers": f"kvikio ({mode})" if mode != "off"
                             else "refused (no kvikio)",
                             "checkpoints (save/load, DCP, FSDP, Orbax)":
                                 "pinned bounce: checksums are computed over host bytes as they stream",
                             "adapters.pytorch.load(verify=False) to CUDA":
                                 "GDS" if mode == "gds" else "pinned bounce",
                             "GDSDataset": "GDS" if mode == "gds" else "pinned copy"}}

    # ---- GDSDataset ---------------------------------------------------------------
    def dataset(self, nbytes: int, file_bytes: int = 32 << 20, batch: int = 8) -> dict[str, Any]:
        count = max(batch, nbytes // file_bytes)
        folder = self.path("dataset")
        os.makedirs(folder, exist_ok=True)
        block = np.random.default_rng(0).integers(0, 255, file_bytes, dtype=np.uint8)
        paths = []
        for i in range(count):
            paths.append(os.path.join(folder, f"{i:05d}.bin"))
            with open(paths[-1], "wb") as f:
                f.write(block.tobytes())
        total = count * file_bytes
        rows = []
        try:
            data = GDSDataset(paths, device=self.device)
            paths_to_try = [("GDS", True)] if data.uses_gds else []
            paths_to_try.append(("pinned copy", False))
            for label, use in paths_to_try:
                data.uses_gds = use

                def epoch() -> None:
                    for start in range(0, count, batch):
                        data.__getitems__(list(range(start, min(count, start + batch))))
                    sync(self.device)

                self.log(f"GDSDataset {label}")
                rows.append(row(f"GDSDataset {label} ({file_bytes >> 20} MiB files, batches of {batch})", total,
                                self.repeat(epoch, before=lambda: cold(folder))))
            data.close()
        finally:
            bench.remove_path(folder)
        return {"figure": "GDSDataset GPU paths", "rows": rows, "ceiling": self.fio.get("read")}


def fastsafetensors_loader(path: str, device: torch.device, nogds: bool) -> Callable[[], Any] | None:
    """A load of ``path`` onto ``device`` with fastsafetensors, where it is installed."""
    try:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    except ImportError:
        return None

    if device.type == "cuda" and device.index is None:  # fastsafetensors wants "cuda:N"
        device = torch.device("cuda", torch.cuda.current_device())

    def run() -> dict[str, torch.Tensor]:
        loader = SafeTensorsFileLoader(SingleGroup(), device=str(device), nogds=nogds)
        try:
            loader.add_filenames({0: [path]})
            buffers = loader.copy_files_to_device()
            tensors = {k: buffers.get_tensor(k).clone() for k in buffers.key_to_rank_lidx}
            buffers.close()
            return tensors
        finally:
            loader.close()

    return run


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    kvikio = tensorferry.gds.load_kvikio()
    info["kvikio"] = getattr(kvikio, "__version__", None)
    with tensorferry.Engine() as engine:
        info["gds_mode"] = engine.gds_mode
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="where the files go (the drive to measure; default: a temporary directory)")
    parser.add_argument("--size", default="8G", help="bytes of bf16 state (default 8G)")
    parser.add_argument("--count", type=int, default=64, help="large tensors in the state (default 64)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of each step (median reported)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu, to try the script without a GPU")
    parser.add_argument("--out", required=True, help="the JSON record to write")
    parser.add_argument("--only", help="comma-separated steps: save,load,stall,gds,dataset (default all)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    nbytes = parse_size(args.size)
    steps = (args.only or "save,load,stall,gds,dataset").split(",")
    directory = args.dir or tempfile.mkdtemp(prefix="tensorferry-bench-gpu-")
    os.makedirs(directory, exist_ok=True)
    started = time.time()

    def log(step: str) -> None:
        print(f"[{time.time() - started:7.1f} s] {step}", file=sys.stderr, flush=True)

    record: dict[str, Any] = {"benchmark": "gpu", "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                              "settings": {"size": nbytes, "count": args.count, "rounds": args.rounds,
                                           "dir": directory},
                              "gpu": device_info(device), "machine": bench.machine_info(directory), "figures": []}
    run: Run | None = None

    def figure(step: str) -> Callable[[], dict[str, Any]]:
        return {"save": lambda: run.saves(), "load": lambda: run.loads(), "stall": lambda: run.stall(),
                "gds": lambda: run.gds_vs_bounce(min(run.nbytes, 4 << 30)),
                "dataset": lambda: run.dataset(min(run.nbytes, 2 << 30))}[step]

    def start() -> None:
        nonlocal run
        run = Run(directory, nbytes, args.count, args.rounds, device, log)
        record["settings"]["state_bytes"] = run.nbytes
        run.ceiling()
        record["fio"] = run.fio or None

    return record_figures(record, args.out, started, directory if args.dir is None else None, start,
                          {step: figure(step) for step in steps}, log)


def record_figures(record: dict[str, Any], out: str, started: float, scratch: str | None, start: Callable[[], None],
                   figures: dict[str, Callable[[], dict[str, Any]]], log: Callable[[str], None],
                   after_each: Callable[[], None] = lambda: None) -> int:
    """Runs each figure into ``record["figures"]`` (a failed one is recorded as its error,
    so that the others' figures survive), writes the record to ``out`` whatever happens,
    removes ``scratch`` if given; 1 if a figure failed."""
    try:
        start()
        for name, figure in figures.items():
            try:
                record["figures"].append(figure())
            except (KeyboardInterrupt, SystemExit):
                raise
            # BaseException: DCP's CheckpointException is one. Recorded: one failed step
            # must not lose the others' figures.
            except BaseException as exc:  # noqa: BLE001
                record["figures"].append({"figure": name, "error": f"{type(exc).__name__}: {exc}"})
                log(f"{name} failed: {type(exc).__name__}: {exc}")
            after_each()
    finally:
        record["seconds"] = round(time.time() - started, 1)
        with open(out, "w") as f:
            json.dump(record, f, indent=1)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 1 if any("error" in f for f in record["figures"]) else 0


if __name__ == "__main__":
    sys.exit(main())
