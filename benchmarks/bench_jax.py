"""JAX checkpoints: FerryCheckpointHandler against Orbax's StandardCheckpointHandler and
fio, in one run.

Saves are timed until durable (an fsync of every file written is part of each save; an
async save counts until ``wait_until_finished`` returns); restores start from a dropped
page cache and land in arrays with the given shardings.

    python benchmarks/bench_jax.py --dir /nvme/tmp --size 2G [--devices 8] [--repeat 2] [--json]
        [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from tensorferry import bench, parse_size  # no framework: safe before XLA_FLAGS is set


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="directory on the drive to measure")
    parser.add_argument("--size", default="2G", help="bytes of state (default 2G)")
    parser.add_argument("--devices", type=int, default=1,
                        help="virtual CPU devices; with more than one, half the arrays are sharded over them")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; the best of each contender is reported")
    parser.add_argument("--json", action="store_true")
    bench.add_results_option(parser)
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.devices > 1:  # must be set before jax starts
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.devices}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from tensorferry.adapters.jax import FerryCheckpointHandler, FerryRestore, FerrySave  # noqa: E402


def make_state(nbytes: int) -> dict[str, jax.Array]:
    """float32 and bfloat16 arrays of 1 to 64 MiB adding up to ``nbytes``; with several
    devices every other array is sharded over all of them by rows."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("x",))
    sizes = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    rng = np.random.default_rng(0)
    state, total, i = {}, 0, 0
    while total < nbytes:
        dtype = jnp.float32 if i % 2 else jnp.bfloat16
        rows = max(len(devices), min(sizes[i % len(sizes)], nbytes - total) // (1024 * jnp.dtype(dtype).itemsize))
        rows -= rows % len(devices)
        host = rng.standard_normal((rows, 1024), dtype=np.float32).astype(dtype)
        spec = PartitionSpec("x") if len(devices) > 1 and i % 2 == 0 else PartitionSpec()
        state[f"layer{i:03d}"] = jax.device_put(host, NamedSharding(mesh, spec))
        total += host.nbytes
        i += 1
    return state


def abstract(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


def fsync_tree(path: str) -> None:
    for f in bench.files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def block(tree: object) -> None:
    jax.block_until_ready(tree)


def round_of(directory: str, state: dict[str, jax.Array], turn: int) -> list[bench.Measurement]:
    """fio and each checkpointer's save and restore, in an order rotated by ``turn``."""
    nbytes = sum(v.nbytes for v in state.values())
    target = abstract(state)
    results: list[bench.Measurement] = []

    def checkpointer_rows(name: str, make, save_args, restore_args) -> None:
        path = os.path.join(directory, "ckpt")
        shutil.rmtree(path, ignore_errors=True)
        checkpointer = make()

        def save() -> None:
            checkpointer.save(path, args=save_args(state))
            if hasattr(checkpointer, "wait_until_finished"):  # an async save counts until it is on disk
                checkpointer.wait_until_finished()
            fsync_tree(path)

        results.append(bench.timed(name, "write", nbytes, save))
        bench.drop_cache(bench.files_under(path))
        restored: dict = {}
        results.append(bench.timed(name, "read", nbytes,
                                   lambda: block(restored.setdefault("r", checkpointer.restore(
                                       path, args=restore_args(target))))))
        for k, v in state.items():  # a benchmark of wrong answers is worth nothing
            if not np.array_equal(np.asarray(restored["r"][k]), np.asarray(v)):
                raise AssertionError(f"{name}: {k} restored wrong")
        restored.clear()
        checkpointer.close()
        shutil.rmtree(path)

    contenders = [
        lambda: results.extend(bench.fio_rows(directory, nbytes)),
        lambda: checkpointer_rows("tensorferry FerryCheckpointHandler", lambda: ocp.Checkpointer(
            FerryCheckpointHandler()), FerrySave, FerryRestore),
        lambda: checkpointer_rows("tensorferry FerryCheckpointHandler, async", lambda: ocp.AsyncCheckpointer(
            FerryCheckpointHandler()), FerrySave, FerryRestore),
        lambda: checkpointer_rows("Orbax StandardCheckpointHandler", lambda: ocp.Checkpointer(
            ocp.StandardCheckpointHandler()), ocp.args.StandardSave, ocp.args.StandardRestore),
        lambda: checkpointer_rows("Orbax StandardCheckpointHandler, async", lambda: ocp.AsyncCheckpointer(
            ocp.StandardCheckpointHandler()), ocp.args.StandardSave, ocp.args.StandardRestore),
    ]
    for contender in bench.in_turn(contenders, turn):
        contender()
    return results


def main() -> int:
    args = ARGS
    os.makedirs(args.dir, exist_ok=True)
    started = time.time()
    state = make_state(parse_size(args.size))
    results: list[bench.Measurement] = []
    for turn in range(args.repeat):
        results += round_of(args.dir, state, turn)
    bench.save_run(args, "jax", ["python", *sys.argv], args.dir, started, measurements=results)
    print(bench.report(bench.best_of(results), args.json))
    return 0


if __name__ == "__main__":
    with bench.freed_memory_kept():
        sys.exit(main())
