"""benchmarks/bench_peers.py: a real (tiny) run writes a result file that the report
renders with the ratio to the best peer and the skipped peers with their reason."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tensorferry import bench

pytest.importorskip("torch")  # bench_peers measures torch's state dicts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tiny_run_measures_every_contender_and_the_report_renders_it(tmp_path, capsys) -> None:
    peers, report = _module("bench_peers"), _module("report")
    work, results = tmp_path / "work", tmp_path / "results"
    assert peers.main(["--dir", str(work), "--size", "4M", "--counts", "4,64", "--repeat", "1",
                       "--results", str(results)]) == 0
    assert os.listdir(work) == [], "every contender removes what it wrote"
    (path,) = results.iterdir()
    document = json.loads(path.read_text())
    names = {(m["name"], m["op"]) for m in document["measurements"]}
    for ours in ("tensorferry save/load", "tensorferry save_checkpoint/load_checkpoint",
                 "tensorferry DCPWriter/DCPReader", "tensorferry DCPWriter/DCPReader, as FSDPCheckpointer calls DCP",
                 "reference: torch DCP alone, a storage layer that moves no bytes",
                 "reference: torch DCP alone, as FSDPCheckpointer calls DCP"):
        for label in ("4 arrays", "64 arrays"):
            assert {(f"{ours} [{label}]", "write"), (f"{ours} [{label}]", "read")} <= names
    mapped_loads = ["tensorferry load(mmap=True)"]
    if importlib.util.find_spec("jax") is not None:  # a peer only where installed, like the others
        mapped_loads.append("tensorferry FerryCheckpointHandler (JAX), restore with mmap=True")
    for mapped in mapped_loads:
        assert {(f"{mapped} [4 arrays]", "read"), (f"{mapped} [64 arrays]", "read")} <= names
    assert ("tensorferry Engine, defaults [1 MiB blocks, depth 32]", "read") in names
    assert all(m["seconds"] > 0 and m["cpu_seconds"] >= 0 for m in document["measurements"])
    assert isinstance(document.get("skipped"), dict)  # optional peers: absent ones say why

    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(results), "--out", str(out), "--readme", "", "--plot", ""]) == 0
    page = out.read_text()
    assert "### peers" in page and "| x best peer |" in page
    for peer, why in document["skipped"].items():
        assert f"Skipped {peer}: " in page


def test_ratio_to_the_best_peer_leaves_out_fio_and_ours() -> None:
    report = _module("report")
    rows = [{"contender": "fio", "op": "read", "gbps": 9.0},
            {"contender": "tensorferry load", "op": "read", "gbps": 8.0},
            {"contender": "safetensors", "op": "read", "gbps": 2.0},
            {"contender": "Run:ai model streamer", "op": "read", "gbps": 4.0},
            {"contender": "reference: torch DCP alone, a storage layer that moves no bytes", "op": "read",
             "gbps": 20.0},
            {"contender": "torch.save", "op": "write", "gbps": 1.0}]
    assert report.best_peers(rows) == {"read": 4.0, "write": 1.0}


def test_touch_reads_every_page(tmp_path) -> None:
    import ctypes
    import mmap

    import torch

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    bench.drop_cache([str(path)])
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        mapped.madvise(mmap.MADV_RANDOM)  # no read-ahead: a page is in only if it was touched
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        resident = (ctypes.c_ubyte * (len(mapped) // 4096))()

        def pages_in() -> int:
            assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(mapped)), resident) == 0
            return sum(b & 1 for b in resident)

        assert pages_in() < len(resident)
        tensor = torch.frombuffer(mapped, dtype=torch.uint8)
        _module("bench_peers").touch([tensor])
        assert pages_in() == len(resident), "every page of the mapping was read in"
        del tensor


@pytest.fixture(scope="module")
def json_run(tmp_path_factory) -> dict:
    """A tiny ``--json --results`` run in its own process (its stdout as a file descriptor
    sees, native output and loggers included), beside a later-stamped result of another run."""
    import shutil
    import subprocess
    import sys

    base = tmp_path_factory.mktemp("peers")
    results = base / "results"
    results.mkdir()
    committed = os.path.join(ROOT, "benchmarks", "results")
    newest = sorted(name for name in os.listdir(committed) if name.endswith("-peers.json"))[-1]
    later = results / "20991231T000000Z-peers.json"
    shutil.copy(os.path.join(committed, newest), later)
    before = later.read_bytes()
    script = os.path.join(ROOT, "benchmarks", "bench_peers.py")
    run = subprocess.run([sys.executable, script, "--dir", str(base / "work"), "--size", "1M", "--counts", "2",
                          "--no-raw", "--repeat", "1", "--json", "--results", str(results)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return {"run": run, "results": results, "later": later, "later_before": before}


def test_json_output_is_the_json_alone(json_run) -> None:
    rows = json.loads(json_run["run"].stdout)  # DeepSpeed logged on stdout before it
    assert any(r["name"].startswith("tensorferry save/load") for r in rows)


def test_the_skipped_peers_go_into_this_runs_result_file(json_run) -> None:
    assert json_run["later"].read_bytes() == json_run["later_before"], "another run's file is left alone"
    (this_run,) = [p for p in json_run["results"].iterdir() if p != json_run["later"]]
    assert isinstance(json.loads(this_run.read_text()).get("skipped"), dict)


@pytest.mark.parametrize("bad", [["--size", "abc"], ["--size", "0"], ["--counts", "x"], ["--counts", "0"],
                                 ["--repeat", "0"]])
def test_bad_arguments_are_refused_before_anything_is_made(tmp_path, capsys, bad: list[str]) -> None:
    directory = tmp_path / "work"
    with pytest.raises(SystemExit) as exited:
        _module("bench_peers").main(["--dir", str(directory), "--size", "1M", "--counts", "1", "--no-raw", *bad])
    assert exited.value.code == 2 and f"error: argument {bad[0]}" in capsys.readouterr().err
    assert not directory.exists()
