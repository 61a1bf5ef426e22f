"""Checkpoints through file objects, in memory: ``save`` into and ``load`` from an
``io.BytesIO``, and ``load`` from a pipe-like stream with neither seek nor tell (read
through ``readinto``, as a socket or an HTTP body is), against ``torch.save``/``torch.load``
and safetensors' ``save``/``load`` (bytes) on the same state, in interleaved rounds.

No drive is involved, so there is no fio row: what is compared is each contender's own
CPU per GB, the copies and fresh memory it pays. Every load is timed until one byte of
each page it returned has been read; memory as large as the step is touched and freed
before each timed step, the same for everyone.

    python benchmarks/bench_streams.py --size 1G [--repeat 3] [--json] [--results DIR]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from tensorferry import bench, parse_size
from tensorferry.adapters.pytorch import load, save

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_peers import make_state, touch  # noqa: E402

SHAPES = {"64 tensors": 64, "4096 tensors": 4096}


class Pipe(io.RawIOBase):
    """A stream over bytes that can only be read in order (``readinto``), as a pipe's or a
    socket's: no seek, no tell, so a loader cannot learn its length up front."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.at = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self.data) - self.at)
        buffer[:n] = self.data[self.at:self.at + n]
        self.at += n
        return n


Contender = tuple[str, Callable[[], Any], Callable[[Any], Any], bool]


def contenders(state: dict[str, torch.Tensor]) -> list[Contender]:
    """(name, save (returns what holds the bytes), load from that, whether the save is
    timed: the pipe's is the BytesIO save again) for each contender."""
    def saved(write: Callable[[io.BytesIO], None]) -> io.BytesIO:
        stream = io.BytesIO()
        write(stream)
        return stream

    def from_start(stream: io.BytesIO) -> io.BytesIO:
        stream.seek(0)
        return stream

    rows = [
        ("tensorferry save/load, io.BytesIO", lambda: saved(lambda s: save(state, s)),
         lambda s: load(from_start(s)).values(), True),
        ("tensorferry load from a pipe (no seek)", lambda: saved(lambda s: save(state, s)),
         lambda s: load(io.BufferedReader(Pipe(s.getbuffer()))).values(), False),
        ("torch.save/torch.load, io.BytesIO", lambda: saved(lambda s: torch.save(state, s)),
         lambda s: torch.load(from_start(s)).values(), True),
    ]
    try:
        import safetensors.torch as st
    except ImportError:
        return rows
    return rows + [("safetensors save/load (bytes)", lambda: st.save(state), lambda b: st.load(b).values(), True)]


def stream_rounds(nbytes: int, repeat: int, progress: Callable[[str], None]) -> list[bench.Measurement]:
    rows: list[bench.Measurement] = []
    for label, count in SHAPES.items():
        state = make_state(nbytes, count)
        size = sum(t.nbytes for t in state.values())

        def run(name: str, write: Callable[[], Any], read: Callable[[Any], Any], timed_write: bool,
                label: str = label, size: int = size) -> None:
            held: list[Any] = []
            if timed_write:
                rows.append(bench.timed(f"{name} [{label}]", "write", size, lambda: held.append(write()), progress))
            else:
                held.append(write())
            rows.append(bench.timed(f"{name} [{label}]", "read", size, lambda: touch(read(held[0])), progress))

        runs = [lambda c=c: run(*c) for c in contenders(state)]
        for turn in range(repeat):
            progress(f"{label}: round {turn + 1} of {repeat}")
            for step in bench.in_turn(runs, turn):
                step()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1G", help="bytes of tensors per state (default 1G)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="only recorded: nothing is written")
    parser.add_argument("--json", action="store_true")
    bench.add_results_option(parser)
    args = parser.parse_args(argv)
    started = time.time()
    rounds = stream_rounds(parse_size(args.size), args.repeat, lambda step: print(step, file=sys.stderr))
    print(bench.report(bench.best_of(rounds), as_json=args.json))
    bench.save_run(args, "streams", ["python", *sys.argv], os.path.abspath(args.dir), started, measurements=rounds)
    return 0


if __name__ == "__main__":
    with bench.freed_memory_kept():
        sys.exit(main())
