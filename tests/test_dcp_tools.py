"""DCPWriter checkpoints meet torch's own tools: nothing of tensorferry is pickled, torch's
readers stop with an error that says what the folder is, and the folder reads without
tensorferry from the safetensors files and the manifest."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

import tensorferry  # noqa: E402
from tensorferry import layouts  # noqa: E402
from tensorferry.adapters.pytorch import DCPReader, DCPWriter  # noqa: E402
from tensorferry.adapters.pytorch.dcp import StoredItem  # noqa: E402
from tensorferry.checkpoint import encode_manifest, write_durably  # noqa: E402

STATE = {"model": {"w": torch.randn(33, 7), "b": torch.arange(5, dtype=torch.int64),
                   "h": torch.randn(4, 4).to(torch.bfloat16)}, "step": 3, "note": "text"}


def save(path: Path, state: dict, writer: str = "tensorferry") -> None:
    storage = DCPWriter(path) if writer == "tensorferry" else dcp.FileSystemWriter(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.save(state, storage_writer=storage)


def fresh(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0, "note": ""}


def _load(state: dict, **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, **kw)


@pytest.fixture
def ours(tmp_path: Path) -> Path:
    save(tmp_path / "ckpt", STATE)
    return tmp_path / "ckpt"


def test_torchs_readers_say_it_is_a_tensorferry_checkpoint(ours: Path, tmp_path: Path) -> None:
    for attempt in (lambda: _load(fresh(STATE), storage_reader=dcp.FileSystemReader(str(ours))),
                    lambda: _load(fresh(STATE), checkpoint_id=str(ours)),
                    lambda: dcp_to_torch_save(str(ours), str(tmp_path / "out.pt"))):
        with pytest.raises(BaseException) as caught:  # DCP raises CheckpointException, a BaseException
            attempt()
        message = str(caught.value)
        assert "this is a tensorferry checkpoint" in message and "DCPReader" in message, message
        assert "AttributeError" not in message and "StoredItem" not in message
    loaded = fresh(STATE)
    _load(loaded, storage_reader=DCPReader(ours))
    assert all(torch.equal(loaded["model"][k], v) for k, v in STATE["model"].items())
    assert (loaded["step"], loaded["note"]) == (3, "text")
    info = layouts.describe(ours)  # listed from the manifest, .metadata not unpickled
    assert info["format"] == "torch-dcp" and info["complete"]
    rows = {t["name"]: (t["dtype"], t["shape"]) for t in info["tensors"]}
    assert rows == {"model.w": ("F32", [33, 7]), "model.b": ("I64", [5]), "model.h": ("BF16", [4, 4]),
                    "step": ("object", None), "note": ("object", None)}


READ_WITHOUT_TENSORFERRY = """
import json, pickle, sys
sys.modules["tensorferry"] = None  # any import of it fails
import torch
from safetensors import safe_open
folder = sys.argv[1]
with open(folder + "/.metadata", "rb") as f:
    metadata = pickle.load(f)
assert {type(s).__module__ for s in metadata.storage_data.values()} == {"torch.distributed.checkpoint.filesystem"}
manifest = json.load(open(folder + "/tensorferry.json"))
out = {}
for fqn, item in manifest["metadata"]["dcp_items"]["tensors"].items():
    full = None
    for file, key, offsets, sizes in item["chunks"]:
        with safe_open(folder + "/" + file, "pt") as f:
            chunk = f.get_tensor(key)
        full = torch.empty(item["shape"], dtype=chunk.dtype) if full is None else full
        full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = chunk
    out[fqn] = full
torch.save(out, sys.argv[2])
print(sorted(metadata.state_dict_metadata))
"""


def test_the_folder_reads_where_tensorferry_is_not_installed(ours: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", READ_WITHOUT_TENSORFERRY, str(ours), str(tmp_path / "out.pt")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "model.w" in result.stdout and "step" in result.stdout
    out = torch.load(tmp_path / "out.pt")
    assert set(out) == {"model.w", "model.b", "model.h"}
    assert all(torch.equal(out[f"model.{k}"], v) for k, v in STATE["model"].items())


@pytest.mark.parametrize("writer", ["tensorferry", "torch"])
def test_load_checkpoint_gives_the_tensors_by_name_whoever_wrote_the_folder(tmp_path: Path, writer: str) -> None:
    """As for torch's folders: the tensors by their flattened names, DCP's pickled objects
    left out. A DCPWriter folder gave ``step`` as a tensor of its pickle's bytes."""
    from tensorferry.adapters.pytorch import load, load_checkpoint

    save(tmp_path / "ckpt", STATE, writer)
    expected = {f"model.{k}": v for k, v in STATE["model"].items()}
    as_numpy = tensorferry.load_checkpoint(tmp_path / "ckpt")
    as_numpy["model.h"] = as_numpy["model.h"].view(np.int16)  # numpy has no bfloat16
    for loaded in (load_checkpoint(tmp_path / "ckpt"), load(tmp_path / "ckpt"),
                   *([load(tmp_path / "ckpt", mmap=True)] if writer == "tensorferry" else []),
                   {k: torch.from_numpy(v).view(expected[k].dtype) for k, v in as_numpy.items()}):
        assert set(loaded) == set(expected)
        assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_metadata_pickled_by_python_3_13_reads_everywhere(tmp_path: Path) -> None:
    """torch's FileSystemWriter pickles the checkpoint id, a Path, into .metadata; Python
    3.13 names its class pathlib._local.PosixPath, which the allowlist refused (every
    torch-written folder given a Path failed to load there) and no other Python has."""
    folder = tmp_path / "c"
    dcp.save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    data = pickle.dumps(pickle.loads((folder / ".metadata").read_bytes()), protocol=2)  # protocol 2: no frames
    as_313 = b"cpathlib._local\nPosixPath\n"
    data = data.replace(b"cpathlib\nPosixPath\n", as_313)
    assert as_313 in data
    (folder / ".metadata").write_bytes(data)
    into = {"w": torch.zeros(4)}
    dcp.load(into, storage_reader=DCPReader(folder), no_dist=True)
    assert torch.equal(into["w"], torch.arange(4.0))
    assert torch.equal(torch.as_tensor(tensorferry.load_checkpoint(folder)["w"]), torch.arange(4.0))


def test_a_checkpoint_of_an_older_dcpwriter_still_loads(ours: Path) -> None:
    """Before issue 20, .metadata held tensorferry's StoredItem and the manifest no item list."""
    with open(ours / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    manifest = tensorferry.read_manifest(ours)
    items = manifest["metadata"].pop("dcp_items")
    places = {(fqn, None): (file, key) for fqn, (file, key) in items["objects"].items()}
    for fqn, entry in items["tensors"].items():
        places.update(((fqn, tuple(o)), (file, key)) for file, key, o, _ in entry["chunks"])
    metadata.storage_data = {i: StoredItem(*places[(i.fqn, None if i.offset is None else tuple(i.offset))])
                             for i in metadata.storage_data}
    write_durably(str(ours / ".metadata"), pickle.dumps(metadata))
    shards = []
    for name in manifest["files"]:
        with tensorferry.ShardReader(ours / name, verify=False) as reader:
            shards.append(reader.shard_info())
    write_durably(str(ours / "tensorferry.json"), encode_manifest(shards, manifest["metadata"]))
    loaded = fresh(STATE)
    _load(loaded, storage_reader=DCPReader(ours))
    assert all(torch.equal(loaded["model"][k], v) for k, v in STATE["model"].items())
    with layouts.open_layout(ours) as source:  # the layout reads it too (torch unpickles .metadata)
        assert torch.equal(torch.from_numpy(source.read(["model.w"])["model.w"]), STATE["model"]["w"])


@pytest.mark.parametrize("writer", ["tensorferry", "torch"])
def test_convert_reads_dcp_in_batches_not_once_per_tensor(tmp_path: Path, writer: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """2,000 tensors: the source is set up once and read in a few batches, so the work grows
    with the tensors, not with their square (it unpickled .metadata once per tensor)."""
    state = {f"layer{i}.weight": torch.full((16,), float(i)) for i in range(2000)}
    save(tmp_path / "dcp", state, writer)
    unpickled, loads = [], []
    real_pickle_load, real_dcp_load = layouts.dcp.pickle.load, dcp.load
    monkeypatch.setattr(layouts.dcp.pickle, "load", lambda f: unpickled.append(1) or real_pickle_load(f))
    monkeypatch.setattr(dcp, "load", lambda *a, **kw: loads.append(1) or real_dcp_load(*a, **kw))
    from tensorferry.cli import main
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "out.safetensors"), "--to", "safetensors",
                 "-q"]) == 0
    assert len(unpickled) <= (0 if writer == "tensorferry" else 2)  # ours needs no pickle at all
    assert len(loads) == (0 if writer == "tensorferry" else 1)  # 2,000 x 64 bytes: one batch
    from safetensors.torch import load_file
    out = load_file(str(tmp_path / "out.safetensors"))
    assert len(out) == 2000 and all(torch.equal(out[n], t) for n, t in state.items())


@pytest.mark.slow
def test_an_fsdp2_checkpoint_of_two_ranks_reads_whole(tmp_path: Path) -> None:
    """Each parameter of a 2-rank FSDP2 save lies in chunks in two ranks' files: the
    layout assembles each from its chunks, as convert and load see it. ``load_checkpoint``
    of the folder gave the chunks apart (``model.w@0,0``), and AdamW's 0-d ``step``
    tensors failed to read ("float32 is read-only")."""
    from test_pytorch import run

    from tensorferry.adapters.pytorch import load_checkpoint

    run(2, str(tmp_path), "save_sharded")
    expected = torch.load(tmp_path / "expected.pt")
    folder = next(p for p in tmp_path.iterdir() if p.is_dir())
    layout = layouts.detect(folder)
    assert layout.kind == "torch-dcp" and not layout.verify().problems
    with layout.open() as source:
        names = {k: next(n for n in source.tensors if n.endswith(f"model.{k}") or n == k) for k in expected}
        assert any(len(source.tensors[n].chunks) == 2 for n in names.values())
        arrays = source.read()
    steps = [n for n in arrays if n.endswith(".step")]
    assert steps and all(arrays[n].shape == () and arrays[n] == 1 for n in steps)  # one AdamW step
    for k, v in expected.items():
        assert arrays[names[k]].tobytes() == v.numpy().tobytes(), k
    for loaded in (load_checkpoint(folder), tensorferry.load_checkpoint(folder)):
        assert set(loaded) == set(arrays)  # whole tensors by name: no chunk apart, no pickled object's bytes
        assert all(np.asarray(loaded[n]).tobytes() == a.tobytes() for n, a in arrays.items())


def _flip_pickled_class_name(folder: Path) -> Path:
    """One bit of the first item's pickle in torch's data file: "OrderedDict" -> "OrdereeDict"."""
    victim = folder / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[data.index(b"OrderedDict") + 6] ^= 0x01
    victim.write_bytes(bytes(data))
    return victim


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorferry.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_a_damaged_pickle_in_torchs_folder_is_a_corrupt_checkpoint_naming_its_file(tmp_path: Path) -> None:
    """torch's CheckpointException (a BaseException) came through load_checkpoint as it was,
    convert died with a 67-line traceback, and verify, which checked sizes alone, said OK."""
    folder = tmp_path / "dcp"
    save(folder, {"a": torch.randn(64, 32), "b": torch.arange(10)}, "torch")
    victim = _flip_pickled_class_name(folder)
    with pytest.raises(tensorferry.CorruptCheckpointError) as caught:
        tensorferry.load_checkpoint(folder)
    assert str(folder) in str(caught.value) and victim.name in str(caught.value)
    assert isinstance(caught.value.__cause__, pickle.UnpicklingError)  # torch's own, kept
    verified = cli("verify", folder, "--json")
    assert verified.returncode == 1 and json.loads(verified.stdout)["bad_files"] == [victim.name]
    converted = cli("convert", folder, tmp_path / "out.safetensors", "--to", "safetensors")
    assert converted.returncode == 2 and "Traceback" not in converted.stderr
    assert victim.name in converted.stderr and not (tmp_path / "out.safetensors").exists()


def test_a_torch_folder_that_loads_passes_verify(tmp_path: Path) -> None:
    folder = tmp_path / "dcp"
    save(folder, {"a": torch.randn(64, 32), "b": torch.arange(10)}, "torch")
    found = layouts.detect(folder).verify()
    assert found.problems == [] and "every tensor loads" in found.checked


def test_an_interruption_or_a_failed_read_inside_dcp_load_is_not_damage(tmp_path: Path) -> None:
    """dcp.load wraps whatever its reader raised, KeyboardInterrupt too, in its
    CheckpointException: each is given back as it was, not as a damaged checkpoint."""
    folder = tmp_path / "dcp"
    save(folder, {"a": torch.randn(8)}, "torch")
    with layouts.open_layout(folder) as source:
        (folder / "__0_0.distcp").rename(tmp_path / "moved")  # gone after the checks at open
        with pytest.raises(FileNotFoundError) as caught:
            source.read()
        assert not isinstance(caught.value, tensorferry.CorruptCheckpointError)
    (tmp_path / "moved").rename(folder / "__0_0.distcp")
    with layouts.open_layout(folder) as source:
        def interrupted(*args: object, **kwargs: object) -> None:  # Ctrl-C cannot be timed into a read: raised here
            raise KeyboardInterrupt

        source._reader.read_data = interrupted
        with pytest.raises(KeyboardInterrupt):
            source.read()


def test_a_dcpwriter_folder_without_its_manifest_says_so(ours: Path) -> None:
    """Without tensorferry.json the folder looked like torch's: verify said OK, and convert
    and DCPReader died in torch's reader, whose advice named the commands that failed."""
    (ours / "tensorferry.json").unlink()
    with pytest.raises(tensorferry.CorruptCheckpointError, match=r"its tensorferry.json is missing: the folder was "
                                                                 r"written by tensorferry's DCPWriter.*DCPReader"):
        tensorferry.load_checkpoint(ours)
    with pytest.raises(BaseException, match="tensorferry.json is missing"):  # through torch: its CheckpointException
        _load(fresh(STATE), storage_reader=DCPReader(ours))
    verified = cli("verify", ours, "--json")
    assert verified.returncode == 1 and json.loads(verified.stdout)["bad_files"] == ["tensorferry.json"]
    converted = cli("convert", ours, ours.parent / "out.safetensors", "--to", "safetensors")
    assert converted.returncode == 2 and "tensorferry.json is missing" in converted.stderr
    assert "Traceback" not in converted.stderr and "Unknown extension" not in converted.stderr
    assert cli("inspect", ours).returncode == 1
