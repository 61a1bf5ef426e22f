"""The tensorferry command, run as a subprocess on real checkpoints made here."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import warnings
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tensorferry
from tensorferry import bench

SUBCOMMANDS = ["bench", "tune", "inspect", "verify", "convert", "interval"]


def run(*args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    """``tensorferry ARGS...`` as a subprocess, output captured."""
    return subprocess.run([sys.executable, "-m", "tensorferry.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def run_json(*args: object, expect: int = 0) -> dict:
    """``tensorferry ARGS... --json``: checks the exit status, returns the parsed output."""
    result = run(*args, "--json")
    assert result.returncode == expect, result.stderr
    return json.loads(result.stdout)


def make_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    state = {f"layer{i}.weight": rng.standard_normal((64, 96), dtype=np.float32) for i in range(5)}
    state["embed"] = rng.standard_normal((500, 32)).astype(ml_dtypes.bfloat16)
    state["step"] = np.array(1234, dtype=np.int64)
    state["mask"] = np.array([True, False, True])
    state["empty"] = np.zeros((0, 4), np.float16)
    return state


STATE = make_state()
METADATA = {"lr": 3e-4, "tags": ["a", "b"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tensorferry checkpoint of several shard files (tests copy it before damaging it)."""
    path = tmp_path_factory.mktemp("ckpt") / "step_100"
    tensorferry.save_checkpoint(path, STATE, metadata=METADATA, max_shard_bytes=40_000)
    assert len(tensorferry.read_manifest(path)["files"]) > 2
    return path


@pytest.fixture
def damaged(checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of the checkpoint, free to damage."""
    return Path(shutil.copytree(checkpoint, tmp_path / "step_100"))


def test_every_subcommand_has_help() -> None:
    for command in SUBCOMMANDS:
        result = run(command, "--help")
        assert result.returncode == 0, result.stderr
        assert f"usage: tensorferry {command}" in result.stdout
        assert "--json" in result.stdout and "--quiet" in result.stdout
    result = run("--help")
    assert result.returncode == 0 and all(c in result.stdout for c in SUBCOMMANDS)


@pytest.mark.parametrize("args,message", [
    ([], "required"),
    (["frobnicate"], "invalid choice"),
    (["interval", "--model-gb", "-1", "--samples-per-sec", "1"], "positive"),
    (["interval", "--model-gb", "1", "--samples-per-sec", "1", "--bandwidth-gbps", "fast"], "expected a number"),
    (["bench", "/no/such/dir"], "no such directory"),
    (["tune", "/tmp", "--size", "lots"], "byte count"),
    (["inspect", "/no/such/ckpt"], "no such file"),
    (["verify", "{empty}"], "not a checkpoint"),
    # An empty list of backends: tune failed with a traceback, bench measured no engine and said all was well.
    (["tune", "{empty}", "--backends", ""], "names no backend"),
    (["bench", "{empty}", "--backends", ","], "names no backend"),
    # More arrays than --size holds: minutes of empty arrays, then a ZeroDivisionError.
    (["bench", "{empty}", "--size", "1M", "--count", "262145"], "at most 262,144 arrays"),
])
def test_bad_usage_exits_2_with_a_message_on_stderr(tmp_path: Path, args: list[str], message: str) -> None:
    result = run(*(a.replace("{empty}", str(tmp_path)) for a in args))
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_inspect_tensorferry_checkpoint(checkpoint: Path) -> None:
    info = run_json("inspect", checkpoint)
    assert info["format"] == "tensorferry" and info["complete"] and info["problems"] == []
    assert info["metadata"] == METADATA
    tensors = {t["name"]: t for t in info["tensors"]}
    assert set(tensors) == set(STATE)
    for name, array in STATE.items():
        assert tensors[name]["shape"] == list(array.shape)
        assert tensors[name]["nbytes"] == array.nbytes
    assert tensors["embed"]["dtype"] == "BF16" and tensors["mask"]["dtype"] == "BOOL"
    assert {f["name"] for f in info["files"]} == {t["file"] for t in info["tensors"]}
    assert info["total_bytes"] == sum(a.nbytes for a in STATE.values())
    text = run("inspect", checkpoint, "--limit", "2")
    assert text.returncode == 0 and "complete: yes" in text.stdout and "more (--limit 0" in text.stdout


def test_inspect_plain_safetensors_file(tmp_path: Path) -> None:
    import safetensors.numpy

    path = tmp_path / "model.safetensors"
    arrays = {"a": np.arange(12, dtype=np.int32).reshape(3, 4), "b": np.ones(5, np.float64)}
    safetensors.numpy.save_file(arrays, str(path), metadata={"format": "np"})
    info = run_json("inspect", path)
    assert info["format"] == "safetensors" and info["complete"] and not info["checksummed"]
    assert info["metadata"] == {"format": "np"}
    assert {t["name"]: (t["dtype"], t["shape"]) for t in info["tensors"]} == {"a": ("I32", [3, 4]), "b": ("F64", [5])}


def test_inspect_reports_incomplete_checkpoints(damaged: Path) -> None:
    victim = sorted(p for p in damaged.iterdir() if p.suffix == ".safetensors")[0]
    victim.unlink()
    info = run_json("inspect", damaged, expect=1)
    assert not info["complete"] and any(victim.name in p for p in info["problems"])
    (damaged / "tensorferry.json").unlink()  # now like a save that never committed
    info = run_json("inspect", damaged, expect=1)
    assert info["format"] == "safetensors-dir" and not info["complete"]


def test_inspect_torch_dcp_directory(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    state = {"w": torch.randn(10, 20), "nested": {"b": torch.ones(7, dtype=torch.bfloat16)}, "step": 3}
    with warnings.catch_warnings():  # DCP warns that it saves as a single process
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=2))
    info = run_json("inspect", path)
    assert info["format"] == "torch-dcp" and info["complete"] and info["ranks"] == [0]
    tensors = {t["name"]: t for t in info["tensors"]}
    # Every layout names dtypes as safetensors does.
    assert (tensors["w"]["dtype"], tensors["w"]["shape"], tensors["w"]["nbytes"]) == ("F32", [10, 20], 800)
    assert tensors["nested.b"]["dtype"] == "BF16" and tensors["step"]["dtype"] == "object"
    assert {f["name"] for f in info["files"]} == {p.name for p in path.glob("*.distcp")}
    # DCP keeps no checksums: verify checks that every file is there and long enough.
    victim = sorted(path.glob("*.distcp"))[0]
    os.truncate(victim, 10)
    result = run_json("verify", path, expect=1)
    assert result["bad_files"] == [victim.name]
    (path / ".metadata").unlink()
    info = run_json("inspect", path, expect=1)
    assert not info["complete"] and ".metadata" in info["problems"][0]


def test_inspect_orbax_without_orbax_says_so(tmp_path: Path) -> None:
    try:
        import orbax.checkpoint  # noqa: F401
        pytest.skip("orbax is installed here")
    except ImportError:
        pass
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "_METADATA").write_text("{}")
    (tmp_path / "_CHECKPOINT_METADATA").write_text("{}")
    result = run("inspect", tmp_path)
    assert result.returncode == 2 and "unsupported: install orbax-checkpoint" in result.stderr
    assert "Traceback" not in result.stderr


def test_verify_sound_checkpoint(checkpoint: Path) -> None:
    result = run_json("verify", checkpoint)
    assert result["ok"] and result["bad_files"] == [] and result["problems"] == []
    assert result["bytes"] == sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    text = run("verify", checkpoint)
    assert text.returncode == 0 and "OK" in text.stdout and text.stderr == ""


@pytest.mark.parametrize("where", ["data", "header"])
def test_verify_catches_a_flipped_byte(damaged: Path, where: str) -> None:
    victim = max(damaged.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        offset = victim.stat().st_size - 5 if where == "data" else 40
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    result = run("verify", damaged, "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["bad_files"] == [victim.name]
    assert victim.name in result.stderr


def test_verify_catches_a_missing_file(damaged: Path) -> None:
    victim = sorted(damaged.glob("*.safetensors"))[-1]
    victim.unlink()
    result = run("verify", damaged)
    assert result.returncode == 1
    assert "FAILED" in result.stdout and victim.name in result.stdout and victim.name in result.stderr


def test_verify_of_a_damaged_single_file_names_it_once(tmp_path: Path) -> None:
    """A single file whose header cannot be read: its problem line read
    "g.safetensors: /path/g.safetensors: header length ...", the name twice; then
    "/path/g.safetensors: header length ...", which no bad file's name starts, so that
    bad_files was empty and stderr said "verify: /path/g.safetensors: /path/g.safetensors: ..."."""
    bad = tmp_path / "g.safetensors"
    bad.write_bytes((200 << 20).to_bytes(8, "little") + b"{}")
    result = run("verify", bad, "--json")
    assert result.returncode == 1 and json.loads(result.stdout)["problems"] == [
        "g.safetensors: header length 209715200 exceeds the 104857600-byte cap"]
    assert json.loads(result.stdout)["bad_files"] == ["g.safetensors"]
    assert result.stderr.strip() == f"tensorferry verify: {bad}: bad file(s): g.safetensors"


def _bf16_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_convert_to_safetensors_and_back(checkpoint: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import safetensors.torch

    single = tmp_path / "model.safetensors"
    result = run_json("convert", checkpoint, single, "--to", "safetensors")
    assert result["tensors"] == len(STATE) and result["bytes"] == sum(a.nbytes for a in STATE.values())
    loaded = safetensors.torch.load_file(str(single))  # any safetensors reader opens it
    assert set(loaded) == set(STATE)
    for name, array in STATE.items():
        tensor = loaded[name]
        if array.dtype == ml_dtypes.bfloat16:
            assert tensor.dtype == torch.bfloat16
            assert _bf16_equal(tensor.view(torch.int16).numpy(), array)
        else:
            np.testing.assert_array_equal(tensor.numpy(), array)
    assert run_json("verify", single)["ok"]  # tensorferry's checksums travel with the file

    back = tmp_path / "back"
    run_json("convert", single, back, "--to", "tensorferry", "--shard-size", "1M")
    assert tensorferry.read_manifest(back)["metadata"] == METADATA
    restored = tensorferry.load_checkpoint(back)
    for name, array in STATE.items():
        assert restored[name].dtype == array.dtype
        assert _bf16_equal(restored[name], array) if array.dtype == ml_dtypes.bfloat16 else \
            np.array_equal(restored[name], array)


def test_convert_plain_safetensors_into_a_sharded_checkpoint(tmp_path: Path) -> None:
    import safetensors.numpy

    arrays = {f"t{i}": np.full((256, 1024), i, np.float32) for i in range(6)}  # 1 MiB each
    source = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file(arrays, str(source), metadata={"format": "np"})
    run_json("convert", source, tmp_path / "ckpt", "--to", "tensorferry", "--shard-size", "2M")
    manifest = tensorferry.read_manifest(tmp_path / "ckpt")
    assert len(manifest["files"]) == 3 and manifest["metadata"] == {"format": "np"}
    restored = tensorferry.load_checkpoint(tmp_path / "ckpt")
    assert all(np.array_equal(restored[n], a) for n, a in arrays.items())


@pytest.mark.parametrize("writer", ["tensorferry", "torch"])
def test_convert_dcp_checkpoints_to_one_safetensors_file(tmp_path: Path, writer: str) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from tensorferry.adapters.pytorch import DCPWriter
    state = {"model": {"w": torch.randn(33, 7), "b": torch.arange(5, dtype=torch.int64),
                       "h": torch.randn(4, 4).to(torch.bfloat16)}, "step": 3}
    storage = DCPWriter(tmp_path / "dcp") if writer == "tensorferry" else dcp.FileSystemWriter(str(tmp_path / "dcp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=storage)
    result = run("convert", tmp_path / "dcp", tmp_path / "model.safetensors", "--to", "safetensors")
    assert result.returncode == 0, result.stderr
    assert "left out 1 item" in result.stderr  # the step, pickled by DCP, is left out
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert set(loaded) == {"model.w", "model.b", "model.h"}
    for name in ("w", "b", "h"):
        assert torch.equal(loaded[f"model.{name}"], state["model"][name])


def test_convert_selects_a_models_weights_for_transformers(tmp_path: Path) -> None:
    """An FSDPCheckpointer step holds {"model": ..., "optimizer": ...}: ``--select model.``
    writes the weights alone, as the module names them, with safetensors.torch's
    ``{"format": "pt"}`` (transformers 4.x refuses a file without it), and transformers
    loads the folder with nothing missing or unexpected."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    from tensorferry.adapters.pytorch import DCPWriter
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                 storage_writer=DCPWriter(tmp_path / "step_1"))
    result = run("convert", tmp_path / "step_1", tmp_path / "hf" / "model.safetensors", "--to", "safetensors",
                 "--select", "model.")
    assert result.returncode == 2 and "no such directory" in result.stderr
    (tmp_path / "hf").mkdir()
    result = run("convert", tmp_path / "step_1", tmp_path / "hf" / "model.safetensors", "--to", "safetensors",
                 "--select", "model.")
    assert result.returncode == 0, result.stderr
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt" and set(f.keys()) == set(model.state_dict())
    config.save_pretrained(tmp_path / "hf")
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    result = run("convert", tmp_path / "step_1", tmp_path / "none.safetensors", "--to", "safetensors",
                 "--select", "ema.")
    assert result.returncode == 2 and "starts with 'ema.' (they start with model., optim.)" in result.stderr


def test_convert_refusals(checkpoint: Path, tmp_path: Path) -> None:
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(b"")
    result = run("convert", dcp_dir, tmp_path / "x.safetensors", "--to", "safetensors")
    without_torch = importlib.util.find_spec("torch") is None  # DCP's metadata is torch's pickle
    assert result.returncode == 2 and ("needs torch" if without_torch else "DCP metadata") in result.stderr
    result = run("convert", checkpoint, tmp_path / "y", "--to", "tensorferry")
    assert result.returncode == 2 and "already a tensorferry checkpoint" in result.stderr
    pickled = tmp_path / "model.pt"  # a zip archive, as torch.save writes
    with zipfile.ZipFile(pickled, "w") as archive:
        archive.writestr("model/data.pkl", b"")
    result = run("convert", pickled, tmp_path / "z.safetensors", "--to", "safetensors")
    assert result.returncode == 2 and "zip archive" in result.stderr and "already" not in result.stderr
    target = tmp_path / "out.safetensors"
    target.write_bytes(b"old")
    result = run("convert", checkpoint, target, "--to", "safetensors")
    assert result.returncode == 2 and "--overwrite" in result.stderr and target.read_bytes() == b"old"
    assert run("convert", checkpoint, target, "--to", "safetensors", "--overwrite").returncode == 0
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    result = run("convert", target, precious, "--to", "tensorferry", "--overwrite")
    assert result.returncode == 2 and (precious / "notes.txt").exists()
    assert not list(tmp_path.glob("*.tmp-*")), "no temporary files are left behind"


def test_convert_streams_one_tensor_at_a_time(tmp_path: Path) -> None:
    # 16 tensors of 8 MiB: holding the state whole would add 128 MiB to the peak RSS.
    state = {f"w{i}": np.full(2 << 20, i, np.float32) for i in range(16)}
    tensorferry.save_checkpoint(tmp_path / "big", state)
    del state
    script = ("import resource, sys\nfrom tensorferry.cli import main\ncode = main(sys.argv[1:])\n"
              "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr)\nsys.exit(code)")

    def peak(*args: str) -> int:
        result = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        return int(result.stderr.split()[-1])

    baseline = peak("interval", "--model-gb", "1", "--samples-per-sec", "1", "--bandwidth-gbps", "1", "-q")
    converting = peak("convert", tmp_path / "big", tmp_path / "big.safetensors", "--to", "safetensors", "-q")
    assert converting - baseline < 64 << 20
    assert os.path.getsize(tmp_path / "big.safetensors") > 128 << 20


def test_tune_small_finds_a_valid_config(tmp_path: Path) -> None:
    target = tmp_path / "drive"
    target.mkdir()
    out = tmp_path / "tuned.json"
    result = run_json("tune", target, "--size", "4M", "--max-seconds", "20", "-o", out)
    assert json.loads(out.read_text()) == result
    config = tensorferry.IOConfig(**result["io_config"])
    assert config.backend in ("io_uring", "threads")
    from_ds = tensorferry.IOConfig.from_deepspeed(result["deepspeed"])
    assert (from_ds.block_size, from_ds.queue_depth, from_ds.threads) == \
        (config.block_size, config.queue_depth, config.threads)
    assert result["trials"] and all(t["score"] > 0 for t in result["trials"])
    assert result["best"]["write_gbps"] > 0 and result["best"]["read_gbps"] > 0
    if bench.fio_available():
        assert result["fio"]["write_gbps"] > 0 and result["ratio_to_fio"] > 0
    assert list(target.iterdir()) == [], "tune cleans up after itself"
    with tensorferry.Engine(config) as engine:  # the result works as an engine's settings
        engine.write(np.ones(1 << 16, np.uint8), target / "check.bin")


def test_tune_prints_its_result_even_where_the_output_file_cannot_be_written(tmp_path: Path) -> None:
    """tune -o where no file can be written (a folder's name): the file was written
    before the result was printed, so the error left nothing of a search that can take
    minutes. -o into a missing folder is refused before the search."""
    target = tmp_path / "drive"
    target.mkdir()
    result = run("tune", target, "--size", "1M", "--max-seconds", "1", "--backends", "threads", "-q",
                 "-o", tmp_path / "missing" / "tuned.json")
    assert result.returncode == 2 and "no such directory" in result.stderr and result.stdout == ""
    result = run("tune", target, "--size", "1M", "--max-seconds", "1", "--backends", "threads", "-q", "-o", target)
    assert result.returncode == 2 and "Is a directory" in result.stderr
    assert "best setting for" in result.stdout and "backend threads" in result.stdout


def test_bench_small_reports_every_contender(tmp_path: Path) -> None:
    result = run_json("bench", tmp_path, "--size", "4M", "--count", "4", "--backends", "threads")
    names = {r["name"] for r in result["results"]}
    assert {"tensorferry threads", "tensorferry save", "tensorferry load", "safetensors save_file"} <= names
    assert {r["op"] for r in result["results"]} == {"write", "read", "hash"}
    if bench.fio_available():
        assert "fio" in names and all(r["ratio_to_fio"] is not None for r in result["results"] if r["op"] != "hash")
    if bench.torch_available():
        assert {"torch.save", "DCP FileSystemReader"} <= {n.split(",")[0] for n in names}
    assert list(tmp_path.iterdir()) == [], "bench cleans up after itself"


def test_bench_prints_its_results_before_the_plot_and_refuses_a_plot_into_a_missing_folder(tmp_path: Path) -> None:
    """The plot was drawn before the results were printed: a plot path that could not be
    written lost a run of minutes, and printed nothing."""
    pytest.importorskip("matplotlib")
    drive = tmp_path / "drive"
    drive.mkdir()
    result = run("bench", drive, "--size", "1M", "--count", "4", "--backends", "threads", "-q",
                 "--plot", tmp_path / "missing" / "bench.png")
    assert result.returncode == 2 and "no such directory" in result.stderr and result.stdout == ""
    taken = tmp_path / "taken.png"
    taken.mkdir()  # a folder's name: no file can be written there
    result = run("bench", drive, "--size", "1M", "--count", "4", "--backends", "threads", "-q", "--plot", taken)
    assert result.returncode == 2 and "Is a directory" in result.stderr
    assert "checkpoint of 4 arrays" in result.stdout and "tensorferry threads" in result.stdout


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed here")
    except ImportError:
        pass
    for command in ("bench", "tune"):
        result = run(command, tmp_path, "--plot", tmp_path / "x.png")
        assert result.returncode == 2 and "tensorferry[plot]" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_interval_matches_the_hand_computed_case() -> None:
    # 140 GB at 10 GB/s saves in 14 s; 0.5 h at 100 samples/s is 180,000 samples, and
    # 20 x 14 s = 280 s (28,000 samples) keeps saving under 5%: the rework bound wins.
    plan = run_json("interval", "--model-gb", "140", "--samples-per-sec", "100", "--bandwidth-gbps", "10")
    assert plan["checkpoint_seconds"] == pytest.approx(14)
    assert plan["min_interval_samples"] == pytest.approx(28_000)
    assert plan["interval_samples"] == pytest.approx(180_000)
    assert plan["interval_seconds"] == pytest.approx(1800)
    assert plan["overhead"] == pytest.approx(14 / 1800)
    assert plan["rework_bound_met"]
    # At 0.5 GB/s a save takes 280 s; under 5% needs 5,600 s (560,000 samples) between saves.
    result = run("interval", "--model-gb", "140", "--samples-per-sec", "100", "--bandwidth-gbps", "0.5", "--json")
    plan = json.loads(result.stdout)
    assert result.returncode == 0 and plan["interval_samples"] == pytest.approx(560_000)
    assert not plan["rework_bound_met"] and plan["bandwidth_needed_gbps"] == pytest.approx(140 / 90)
    assert "warning" in result.stderr
    text = run("interval", "--model-gb", "140", "--samples-per-sec", "100", "--bandwidth-gbps", "10")
    assert "checkpoint every 180,000 samples" in text.stdout


def test_interval_measures_bandwidth_with_auto(tmp_path: Path) -> None:
    plan = run_json("interval", "--model-gb", "1", "--samples-per-sec", "10", "--dir", tmp_path,
                    "--probe-size", "8M")
    assert plan["bandwidth_gbps"] > 0 and plan["measured"]["directory"] == str(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_progress_bar_only_on_a_terminal(checkpoint: Path) -> None:
    pytest.importorskip("tqdm")
    controller, terminal = pty.openpty()
    # A terminal 100 columns wide: tqdm draws nothing on one of zero columns.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        proc = subprocess.Popen([sys.executable, "-m", "tensorferry.cli", "verify", str(checkpoint)],
                                stdout=subprocess.PIPE, stderr=terminal)
        os.close(terminal)
        seen = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the child has exited and the terminal is drained
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(timeout=60) == 0
        proc.stdout.close()
    finally:
        os.close(controller)
    assert b"%|" in seen, seen  # tqdm's bar
    for quiet in ([], ["--quiet"]):  # stderr not a terminal, or --quiet: no bar
        result = run("verify", checkpoint, *quiet)
        assert result.returncode == 0 and result.stderr == ""


def test_importing_the_cli_stays_light() -> None:
    script = ("import sys, tensorferry.cli\nheavy = {'tqdm', 'torch', 'matplotlib', 'safetensors'}\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# What killed saves and prunes leave, one of each name tensorferry gives its temporaries:
# a file's atomic write, a checkpoint's, DCP's fixed token, a replaced file set aside, a
# pruned checkpoint, and a pruned old checkpoint an interrupted overwrite had set aside.
LEFTOVERS = {"model.safetensors.tmp-0123abcd": "file", "step_5.tmp-0123456789ab": "dir", "step_6.tmp-dcp": "dir",
             "model.safetensors.tmp-replaced-0123abcd": "file", "step_1.tmp-pruned-0123abcd": "dir",
             "step_2.tmp-old-0123abcd.tmp-pruned-4567cdef": "dir"}
# The user's own, ".tmp-" in their names all the same; a date is no token either: the
# tokens made have a letter among their hex digits (temporary_token).
USERS = {"report.tmp-final.txt": "file", "photos.tmp-2024": "dir", "model.safetensors.tmp-backup": "file",
         "backup.tmp-20240315": "dir", "run.tmp-202403151200": "file"}


def make_entries(root: Path, entries: dict[str, str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, kind in entries.items():
        if kind == "dir":
            (root / name).mkdir(parents=True)
            (root / name / "data.bin").write_bytes(b"x" * 100)
        else:
            (root / name).write_bytes(b"x" * 100)


def test_clean_removes_only_the_names_tensorferry_gives(tmp_path: Path) -> None:
    """clean removed every unheld entry with ".tmp-" in its name: a user's
    report.tmp-final.txt, and the folder photos.tmp-2024 with all in it."""
    make_entries(tmp_path, {**LEFTOVERS, **USERS})
    listed = run_json("clean", tmp_path, "--dry-run")["removed"]
    assert listed == sorted(str(tmp_path / name) for name in LEFTOVERS)
    assert sorted(os.listdir(tmp_path)) == sorted([*LEFTOVERS, *USERS]), "a dry run removes nothing"
    assert run_json("clean", tmp_path)["removed"] == listed
    assert sorted(os.listdir(tmp_path)) == sorted(USERS)
    assert (tmp_path / "photos.tmp-2024" / "data.bin").read_bytes() == b"x" * 100


def test_clean_searches_the_folders_under_root_but_not_checkpoints_or_links(tmp_path: Path) -> None:
    """clean ROOT looked at ROOT's own entries only: a killed save's ckpt/run1/step_5.tmp-...
    stayed, though the help says "under ROOT"."""
    root = tmp_path / "ckpt"
    make_entries(root / "run1", {"step_5.tmp-0123456789ab": "dir"})
    make_entries(root / "run2" / "deeper", {"model.safetensors.tmp-0123abcd": "file"})
    tensorferry.save_checkpoint(root / "run1" / "step_4", {"x": np.arange(3)})
    make_entries(root / "run1" / "step_4", {"inside.tmp-0123abcd": "file"})  # a checkpoint is not searched
    make_entries(tmp_path / "elsewhere", {"other.tmp-0123abcd": "file"})
    (root / "link").symlink_to(tmp_path / "elsewhere")  # nor is a link followed
    removed = run_json("clean", root)["removed"]
    assert removed == [str(root / "run1" / "step_5.tmp-0123456789ab"),
                       str(root / "run2" / "deeper" / "model.safetensors.tmp-0123abcd")]
    assert (root / "run1" / "step_4" / "inside.tmp-0123abcd").exists()
    assert (tmp_path / "elsewhere" / "other.tmp-0123abcd").exists()
    assert tensorferry.list_checkpoints(root / "run1") == [str(root / "run1" / "step_4")]


def test_clean_names_what_it_cannot_list_and_stays_on_its_filesystem(tmp_path: Path) -> None:
    """clean of a ROOT it could not list said "0 leftovers", exit 0, as did a folder under it it
    could not list (said nothing of it); and it searched filesystems mounted under ROOT."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv, to take root's right to read every folder away")
    root = tmp_path / "ckpt"
    make_entries(root / "locked", {"step_2.tmp-0123456789ab": "dir"})
    make_entries(root / "open", {"step_3.tmp-0123456789ab": "dir"})
    (root / "mnt").mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(root / "mnt")], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        make_entries(root / "mnt", {"step_4.tmp-0123456789ab": "dir"})
        # As root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: folder permissions apply.
        as_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m",
                   "tensorferry.cli", "clean", "--dry-run", "--json"]
        (root / "locked").chmod(0)
        result = subprocess.run([*as_user, str(root)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 1, result.stderr
        assert json.loads(result.stdout) == {"path": str(root), "dry_run": True, "not_searched": [str(root / "locked")],
                                             "removed": [str(root / "open" / "step_3.tmp-0123456789ab")]}
        (root / "locked").chmod(0o755)
        root.chmod(0)
        result = subprocess.run([*as_user, str(root)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and "Permission denied" in result.stderr
    finally:
        root.chmod(0o755)
        (root / "locked").chmod(0o755)
        subprocess.run(["umount", "-l", str(root / "mnt")], capture_output=True)


def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path: Path) -> None:
    """tensorferry inspect ... | head -1 printed "error: [Errno 32] Broken pipe" and
    exited 2, as for bad usage; it now says nothing and exits 141, as a shell reports a
    command that SIGPIPE ended."""
    many = tmp_path / "many.safetensors"
    with tensorferry.ShardWriter(many) as writer:  # about 1 MB of listing: more than a pipe holds
        for i in range(20_000):
            writer.add(f"t{i:05d}", np.zeros(1, np.float32))
    proc = subprocess.Popen([sys.executable, "-m", "tensorferry.cli", "inspect", "--limit", "0", str(many)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(str(many).encode())
    proc.stdout.close()  # as head does once it has its line
    stderr = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141 and stderr == b""


def test_verify_json_says_what_was_checked_not_the_outcome(damaged: Path) -> None:
    """A corrupt checkpoint's verify --json said "ok": false beside "checked": "every checksum matches"."""
    sound = run_json("verify", damaged)
    assert sound["ok"] and sound["checked"] == "the checksum of every file against the manifest"
    victim = max(damaged.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    failed = run_json("verify", damaged, expect=1)
    assert not failed["ok"] and failed["checked"] == sound["checked"]


def test_convert_into_an_empty_folder(checkpoint: Path, tmp_path: Path) -> None:
    """convert --to tensorferry refused an empty folder made for it, even with
    --overwrite, where save_checkpoint takes one."""
    source = tmp_path / "one.safetensors"
    assert run("convert", checkpoint, source, "--to", "safetensors").returncode == 0
    for overwrite in ([], ["--overwrite"]):
        dst = tmp_path / f"out{len(overwrite)}"
        dst.mkdir()
        result = run("convert", source, dst, "--to", "tensorferry", *overwrite)
        assert result.returncode == 0, result.stderr
        assert set(tensorferry.load_checkpoint(dst)) == set(STATE)


def test_interval_json_is_json_where_the_arithmetic_overflows() -> None:
    """interval --json printed Infinity and NaN, which no JSON parser but Python's takes."""
    result = run("interval", "--model-gb", "1e300", "--samples-per-sec", "1", "--bandwidth-gbps", "1e-300", "--json")
    assert result.returncode == 0, result.stderr

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    plan = json.loads(result.stdout, parse_constant=refuse)
    assert plan["checkpoint_seconds"] is None and plan["overhead"] is None and plan["rework_samples"] == 1800
    assert "overflow: checkpoint_seconds" in result.stderr


def test_python_m_tensorferry_runs_the_command() -> None:
    result = subprocess.run([sys.executable, "-m", "tensorferry", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("tensorferry ")


def dcpwriter_folder(path: Path) -> Path:
    """A step as FSDPCheckpointer saves it: DCPWriter's shards, .metadata and tensorferry.json."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from tensorferry.adapters.pytorch import DCPWriter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves as a single process
        dcp.save({"model": {"w": torch.randn(10, 6), "b": torch.arange(4)}, "step": 5}, storage_writer=DCPWriter(path))
    return path


def flip(path: Path, offset: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))


def test_verify_of_a_dcpwriter_folder_with_a_damaged_manifest_is_a_finding(tmp_path: Path) -> None:
    """As for a plain checkpoint: status 1 naming tensorferry.json. It exited 2, "error",
    with no --json document."""
    folder = dcpwriter_folder(tmp_path / "step_5")
    flip(folder / "tensorferry.json", (folder / "tensorferry.json").read_bytes().index(b'"files"') + 2, 0x20)
    found = run_json("verify", folder, expect=1)
    assert found["bad_files"] == ["tensorferry.json"] and not found["ok"]


def test_a_dcpwriter_folder_copied_without_hidden_files_blames_its_metadata(tmp_path: Path) -> None:
    """``cp step/* copy/`` leaves .metadata behind: inspect said "complete: yes", and verify
    named the sound shards as the bad files; a damaged .metadata was named by none."""
    folder = dcpwriter_folder(tmp_path / "step_5")
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in folder.iterdir():
        if not path.name.startswith("."):
            shutil.copy(path, copy / path.name)
    info = run_json("inspect", copy, expect=1)
    assert not info["complete"] and info["problems"] == [".metadata: missing"]
    assert run_json("verify", copy, expect=1)["bad_files"] == [".metadata"]
    flip(folder / ".metadata", (folder / ".metadata").stat().st_size // 3, 0x04)
    assert run_json("verify", folder, expect=1)["bad_files"] == [".metadata"]


def test_a_command_run_with_stdout_closed_does_its_work(checkpoint: Path) -> None:
    """Started with stdout closed (a cron job's >&-), Python has no sys.stdout: the flush
    after the command failed, "internal error", status 2."""
    result = subprocess.run(["bash", "-c", '"$0" -m tensorferry.cli verify "$1" >&-', sys.executable, str(checkpoint)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == ""


def test_convert_carries_the_pytorch_adapters_structure_both_ways(tmp_path: Path) -> None:
    """adapters.pytorch keeps its structure (the nesting, and the values saved beside the
    tensors) as JSON text in a file and as an object in a manifest: convert passed it on
    as it was, so that a converted file loaded as a flat dict without ``step`` and a
    converted checkpoint failed to load ("unreadable structure node")."""
    torch = pytest.importorskip("torch")
    from tensorferry.adapters.pytorch import load, load_checkpoint, save, save_checkpoint

    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(4)}, "step": 7}
    save(state, tmp_path / "s.safetensors")
    save_checkpoint(tmp_path / "ck", state)
    for src, dst, to in ((tmp_path / "s.safetensors", tmp_path / "s_ck", "tensorferry"),
                         (tmp_path / "ck", tmp_path / "ck.safetensors", "safetensors"),
                         (tmp_path / "s_ck", tmp_path / "again.safetensors", "safetensors")):
        result = run("convert", src, dst, "--to", to)
        assert result.returncode == 0 and result.stderr == "", result.stderr
    for loaded in (load_checkpoint(tmp_path / "s_ck"), load(tmp_path / "ck.safetensors"),
                   load(tmp_path / "again.safetensors")):
        assert set(loaded) == {"model", "step"} and loaded["step"] == 7
        assert set(loaded["model"]) == {"w", "b"}
        assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    # --select writes other names than the structure's: it is left out, and said
    for src, dst, to in ((tmp_path / "ck", tmp_path / "w.safetensors", "safetensors"),
                         (tmp_path / "s.safetensors", tmp_path / "w_ck", "tensorferry")):
        result = run("convert", src, dst, "--to", to, "--select", "model.")
        assert result.returncode == 0 and "left out tensorferry.structure" in result.stderr
        loaded = load(dst) if to == "safetensors" else load_checkpoint(dst)
        assert set(loaded) == {"w", "b"} and torch.equal(loaded["w"], state["model"]["w"])


def test_messages_name_each_thing_once(tmp_path: Path) -> None:
    """"[Errno 2] /x: no such file or directory: '/x'", a missing shard of a Hugging Face
    folder listed twice (once as missing, once as the engine's failed open), "1 tensors"."""
    import safetensors.numpy

    result = run("verify", tmp_path / "nothing")
    assert result.returncode == 2
    assert result.stderr.strip() == f"tensorferry verify: error: {tmp_path / 'nothing'}: no such file or directory"
    hf = tmp_path / "hf"
    hf.mkdir()
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for i, name in enumerate(files):
        safetensors.numpy.save_file({f"t{i}": np.ones(3, np.float32)}, str(hf / name), metadata={"format": "pt"})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"t0": files[0], "t1": files[1]}}))
    (hf / files[1]).unlink()
    found = run_json("verify", hf, expect=1)
    assert found["bad_files"] == [files[1]] and found["problems"] == [f"{files[1]}: missing"]
    result = run("convert", hf / files[0], tmp_path / "one", "--to", "tensorferry")
    assert result.returncode == 0 and ": 1 tensor," in result.stdout


def test_clean_dry_run_lists_what_clean_removes_not_an_interrupted_overwrites_checkpoint(tmp_path: Path) -> None:
    """The dry run and clean itself decide alike (checkpoint.leftovers, remove_leftovers): the
    old checkpoint an overwrite killed between its two renames set aside is the checkpoint,
    never a leftover, and only a killed save's temporary goes."""
    from tensorferry.checkpoint import OLD_REASON, leftovers
    from tensorferry.temporaries import aside_name
    tensorferry.save_checkpoint(tmp_path / "step_1", {"x": np.arange(3)})
    aside = aside_name(str(tmp_path / "step_1"), OLD_REASON)
    os.rename(tmp_path / "step_1", aside)  # the overwrite, killed after its first rename
    make_entries(tmp_path, {"step_2.tmp-0123456789ab": "dir"})
    killed = [str(tmp_path / "step_2.tmp-0123456789ab")]
    assert leftovers(tmp_path) == killed
    assert run_json("clean", tmp_path, "--dry-run")["removed"] == killed
    assert run_json("clean", tmp_path)["removed"] == killed
    assert tensorferry.load_checkpoint(tmp_path / "step_1")["x"].tolist() == [0, 1, 2]
