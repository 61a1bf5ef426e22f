"""NVMe offload on a GPU: stream_weights and OffloadedOptimizer against the same work in GPU memory, and fio.

    python benchmarks/bench_gpu_offload.py --out FILE.json [--dir /nvme/tmp] [--size 8G] [--quick] [--device cuda]

Figures (each with the fio ceiling measured in the same run):

- ``stream_weights``: a transformers Llama built from a config (random bf16 weights,
  nothing downloaded) of ``size / 2`` bytes of weights, streamed with a budget of a third
  of them. Measured: a forward of one token (next to no compute: the time to read and
  copy the weights, "I/O alone"), a forward of a batch sized so that its compute on the
  GPU takes longer than that I/O (the case the overlap target is about), and greedy
  ``generate`` (tokens/s), each against the model fully in GPU memory. I/O hidden =
  (compute + I/O - wall) / I/O; NVMe bandwidth used = weights / I/O alone, against a fio
  read of the same bytes run just before each I/O-alone round (median of the rounds'
  ratios). Targets: >= 80% hidden, >= 0.85 of fio.
- ``OffloadedOptimizer``: AdamW on fp32 parameters with ``size`` bytes of state, steps/s
  with the state on NVMe (``resident_bytes`` = size / 4) against the same AdamW with its
  state in GPU memory; swap bandwidth (bytes read and written per step over the step's
  time) against fio writing and reading the same bytes just before each step (median of
  the rounds' ratios). Target: >= 0.85 of fio.

Every timed section ends with ``torch.cuda.synchronize``. ``--quick`` shrinks the model
and state (a minute's run); ``--device cpu`` runs the same steps on the CPU, to try the
script where there is no GPU (its figures then mean nothing for a GPU).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from bench_gpu import device_info, record_figures, row, sync
from tensorferry import bench, parse_size
from tensorferry.adapters.pytorch import OffloadedOptimizer, stream_weights

HIDDEN_TARGET = 0.80
OF_FIO_TARGET = 0.85


def timed_result(action: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds ``action`` takes, its queued device work included, and what it returned."""
    sync(device)
    start = time.perf_counter()
    result = action()
    sync(device)
    return time.perf_counter() - start, result


def timed(action: Callable[[], Any], device: torch.device) -> float:
    return timed_result(action, device)[0]


def timed_rounds(action: Callable[[], Any], device: torch.device, rounds: int) -> tuple[list[float], Any]:
    """Seconds of each of ``rounds`` runs of ``action``, and what the last returned."""
    times, result = [], None
    for _ in range(rounds):
        seconds, result = timed_result(action, device)
        times.append(seconds)
    return times, result


def fio(directory: str, nbytes: int) -> dict[str, dict[str, Any]] | None:
    if not bench.fio_available():
        return None
    try:
        write = bench.run_fio(directory, "write", nbytes)
        read = bench.run_fio(directory, "read", nbytes)
    finally:
        bench.remove_fio_file(directory)
    return {"write": row("fio write (io_uring, O_DIRECT, 1 MiB x 32)", nbytes, [write.seconds]),
            "read": row("fio read (io_uring, O_DIRECT, 1 MiB x 32)", nbytes, [read.seconds])}


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def llama(nbytes: int, quick: bool, device: torch.device) -> torch.nn.Module:
    """A Llama (Llama-2-7B's layer shape, or a small one with ``quick``) with random bf16
    weights adding up to about ``nbytes``."""
    import transformers

    hidden, vocab = (512, 8000) if quick else (4096, 32000)
    intermediate = hidden * 11 // 4
    per_layer = (4 * hidden * hidden + 3 * hidden * intermediate) * 2
    layers = max(2, (nbytes - 2 * vocab * hidden * 2) // per_layer)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 128,
                                      num_key_value_heads=hidden // 128, max_position_embeddings=4096)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            return transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


def stream_figure(directory: str, nbytes: int, quick: bool, device: torch.device, rounds: int,
                  log: Callable[[str], None]) -> dict[str, Any]:
    model = llama(nbytes, quick, device)
    weights = weights_bytes(model)
    budget = weights // 3
    sizing = fio(directory, weights)  # the batch below is sized from this read; the figure's fio comes later
    log(f"stream_weights: {len(model.model.layers)} layers, {weights / 2**30:.2f} GiB of weights, "
        f"budget {budget / 2**30:.2f} GiB")

    def forward(tokens: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The model's forward, with logits for the last position only (those of every
        position would be the largest tensor of the forward)."""
        return lambda: model.lm_head(model.model(tokens).last_hidden_state[:, -1:])

    g = torch.Generator(device=device).manual_seed(0)
    vocab = model.config.vocab_size
    seq = 128 if quick else 1024
    # Sized from fio's read (or a guess of 2 GB/s without fio) so that compute exceeds I/O.
    io_guess = weights / (sizing["read"]["gbps"] * 1e9 if sizing else 2e9)
    with torch.no_grad():
        probe = torch.randint(0, vocab, (1, seq), generator=g, device=device)
        forward(probe)()  # warms up the kernels
        per_sequence = min(timed(forward(probe), device) for _ in range(2))
        batch = max(1, min(32 if quick else 256, math.ceil(1.5 * io_guess / per_sequence)))
        tokens = torch.randint(0, vocab, (batch, seq), generator=g, device=device)
        one = tokens[:1, :1]
        expected = forward(tokens)()
        compute = [timed(forward(tokens), device) for _ in range(rounds)]
        prompt = tokens[:1, :32]
        options = {"max_new_tokens": 2 if quick else 4, "do_sample": False, "pad_token_id": 0}
        model.generate(prompt, **options)
        generated, expected_text = timed_rounds(lambda: model.generate(prompt, **options), device, rounds)
        new_tokens = options["max_new_tokens"]
        with stream_weights(model, directory, resident_bytes=budget, prefetch=2) as handle:
            forward(one)()  # the first forward learns the order of the layers
            io, fio_reads = bench.rounds_beside_fio(lambda: timed(forward(one), device), directory, weights, rounds)
            wall, got = timed_rounds(forward(tokens), device, rounds)
            streamed_gen, got_text = timed_rounds(lambda: model.generate(prompt, **options), device, rounds)
            peak = handle.peak_resident_bytes
    if not torch.equal(got, expected) or not torch.equal(got_text, expected_text):
        raise AssertionError("the streamed model's outputs differ from the model's in GPU memory")
    c, i, w = statistics.median(compute), statistics.median(io), statistics.median(wall)
    hidden = (c + i - w) / i
    hideable = min(c, i) / i  # compute shorter than the I/O can hide only that much of it
    ours = [row(f"streamed forward, batch {batch}x{seq}", weights, wall),
            row("I/O alone: streamed forward of one token", weights, io),
            row(f"streamed generate, {new_tokens} tokens", weights * new_tokens, streamed_gen,
                tokens_per_s=round(new_tokens / statistics.median(streamed_gen), 3))]
    peers = [row(f"forward in GPU memory, batch {batch}x{seq}", weights, compute),
             row(f"generate in GPU memory, {new_tokens} tokens", weights * new_tokens, generated,
                 tokens_per_s=round(new_tokens / statistics.median(generated), 3))]
    result: dict[str, Any] = {
        "figure": "stream_weights", "target": f">= {HIDDEN_TARGET:.0%} of the I/O hidden when compute >= I/O "
                                            f"(of the hideable share when less); NVMe bandwidth >= {OF_FIO_TARGET} "
                                            f"of fio read",
        "tensorferry": ours, "peers": peers, "ceiling": None,
        "weights_bytes": weights, "resident_bytes": budget, "peak_resident_bytes": peak,
        "compute_s": round(c, 4), "io_s": round(i, 4), "wall_s": round(w, 4), "compute_over_io": round(c / i, 3),
        "io_hidden": round(hidden, 3), "io_hideable": round(hideable, 3),
        "tokens_per_s": {"streamed": ours[2]["tokens_per_s"], "in_gpu_memory": peers[1]["tokens_per_s"]}}
    if fio_reads:
        result["ceiling"] = row("fio read (io_uring, O_DIRECT, 1 MiB x 32), in turn with the I/O-alone rounds",
                                weights, fio_reads)
        # Bandwidths of the same bytes: fio's seconds over ours, round by round.
        result["ratio_to_ceiling"] = round(statistics.median(f / t for f, t in zip(fio_reads, io)), 3)
        result["met"] = bool(hidden >= HIDDEN_TARGET * hideable and result["ratio_to_ceiling"] >= OF_FIO_TARGET)
    else:
        result["met"] = None
    log(f"stream_weights: compute {c:.3f} s, I/O {i:.3f} s, wall {w:.3f} s, hidden {hidden:.0%}")
    return result


def optimizer_figure(directory: str, nbytes: int, device: torch.device, rounds: int,
                     log: Callable[[str], None]) -> dict[str, Any]:
    """AdamW (2 fp32 state tensors per element) with ``nbytes`` of state over 64 Mi-element tensors."""
    elements = nbytes // 8
    size = min(elements, 64 << 20)
    count = max(1, elements // size)

    def params() -> list[torch.nn.Parameter]:
        g = torch.Generator(device=device).manual_seed(0)
        made = [torch.nn.Parameter(torch.randn(size, generator=g, device=device)) for _ in range(count)]
        for p in made:
            p.grad = torch.randn(size, generator=g, device=device)
        return made

    def steps(optimizer: torch.optim.Optimizer) -> list[float]:
        optimizer.step()  # creates the state
        return [timed(optimizer.step, device) for _ in range(rounds)]

    state = count * size * 8
    plain_params = params()
    in_memory = steps(torch.optim.AdamW(plain_params, lr=1e-3))
    del plain_params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log(f"OffloadedOptimizer: AdamW in GPU memory {statistics.median(in_memory):.3f} s/step")
    resident = state // 4
    with OffloadedOptimizer(torch.optim.AdamW(params(), lr=1e-3), directory, resident_bytes=resident) as opt:
        opt.step()
        before = opt.stats()
        opt.step()
        after = opt.stats()
        moved = after["bytes_in"] - before["bytes_in"] + after["bytes_out"] - before["bytes_out"]
        # Each step reads and writes the state once: fio writing and reading the same bytes
        # beside each step is its ceiling.
        offloaded, fio_mix = bench.rounds_beside_fio(lambda: timed(opt.step, device), directory, moved // 2, rounds,
                                                     ("write", "read"))
        peak = opt.stats()["peak_resident_bytes"]
    wall = statistics.median(offloaded)
    ours = [row("OffloadedOptimizer step (read + write of the state)", int(moved), offloaded,
                steps_per_s=round(1 / wall, 3))]
    peers = [row("AdamW step, state in GPU memory", int(moved), in_memory,
                 steps_per_s=round(1 / statistics.median(in_memory), 3))]
    result: dict[str, Any] = {
        "figure": "OffloadedOptimizer", "target": f"swap bandwidth >= {OF_FIO_TARGET} of fio's same read/write mix",
        "tensorferry": ours, "peers": peers, "state_bytes": state, "resident_bytes": resident,
        "peak_resident_bytes": peak,
        "steps_per_s": {"offloaded": ours[0]["steps_per_s"], "in_gpu_memory": peers[0]["steps_per_s"]}}
    if fio_mix:
        result["ceiling"] = {"mix": row("fio, the same bytes written and read, in turn with the steps", int(moved),
                                        fio_mix)}
        result["ratio_to_ceiling"] = round(statistics.median(f / t for f, t in zip(fio_mix, offloaded)), 3)
        compute, fio_seconds = statistics.median(in_memory), statistics.median(fio_mix)
        result["io_hidden"] = round((compute + fio_seconds - wall) / fio_seconds, 3)
        result["met"] = bool(result["ratio_to_ceiling"] >= OF_FIO_TARGET)
    else:
        result["ceiling"], result["met"] = None, None
    log(f"OffloadedOptimizer: {wall:.3f} s/step, {moved / wall / 1e9:.2f} GB/s swapped")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON record to write")
    parser.add_argument("--dir", help="where the files go (the drive to measure; default: a temporary directory)")
    parser.add_argument("--size", default="8G", help="bytes of optimizer state; the Llama has half as many of weights")
    parser.add_argument("--quick", action="store_true", help="a small model and 1 GiB of state at most")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds of each step (median reported)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu, to try the script without a GPU")
    parser.add_argument("--only", help="comma-separated figures: stream,optimizer (default both)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_offload: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    nbytes = parse_size(args.size)
    if args.quick:
        nbytes = min(nbytes, 1 << 30)
    directory = args.dir or tempfile.mkdtemp(prefix="tensorferry-bench-gpu-offload-")
    os.makedirs(directory, exist_ok=True)
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:7.1f} s] {message}", file=sys.stderr, flush=True)

    record: dict[str, Any] = {
        "benchmark": "gpu_offload", "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "settings": {"size": nbytes, "quick": args.quick, "rounds": args.rounds, "dir": directory},
        "gpu": device_info(device), "machine": bench.machine_info(directory), "figures": []}
    figures = {"stream": lambda: stream_figure(directory, nbytes // 2, args.quick, device, args.rounds, log),
               "optimizer": lambda: optimizer_figure(directory, nbytes, device, args.rounds, log)}
    names = (args.only or "stream,optimizer").split(",")
    return record_figures(record, args.out, started, directory if args.dir is None else None, lambda: None,
                          {name: figures[name] for name in names}, log,
                          after_each=torch.cuda.empty_cache if device.type == "cuda" else lambda: None)

if __name__ == "__main__":
    sys.exit(main())
