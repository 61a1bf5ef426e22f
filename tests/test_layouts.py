"""The layout registry: every layout recognised, listed, verified and read, on real files."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tensorferry
from tensorferry import layouts
from tensorferry.errors import CheckpointNotFoundError, CorruptCheckpointError

STATE = {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.ones(5, ml_dtypes.bfloat16),
         "step": np.array(7, np.int64), "mask": np.array([True, False])}


def cli(*args: object, expect: int = 0) -> dict:
    result = subprocess.run([sys.executable, "-m", "tensorferry.cli", *map(str, args), "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == expect, result.stderr
    return json.loads(result.stdout)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_each_layout_is_recognised_and_read(tmp_path: Path) -> None:
    import safetensors.numpy

    tensorferry.save_checkpoint(tmp_path / "ckpt", STATE, metadata={"lr": 0.1})
    single = tmp_path / "one.safetensors"
    safetensors.numpy.save_file(STATE, str(single), metadata={"format": "np"})
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors.numpy.save_file({"w": STATE["w"]}, str(hf / "model-00001-of-00002.safetensors"),
                                metadata={"format": "pt"})
    safetensors.numpy.save_file({k: v for k, v in STATE.items() if k != "w"},
                                str(hf / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {"w": "model-00001-of-00002.safetensors",
                  **{k: "model-00002-of-00002.safetensors" for k in STATE if k != "w"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1},
                                                                  "weight_map": weight_map}))
    expected = {tmp_path / "ckpt": "tensorferry", single: "safetensors", hf: "huggingface",
                hf / "model.safetensors.index.json": "huggingface"}
    for path, kind in expected.items():
        layout = layouts.detect(path)
        assert layout.kind == kind
        info = layouts.describe(path)
        assert info["complete"], info["problems"]
        assert {t["name"]: (t["dtype"], tuple(t["shape"])) for t in info["tensors"]} == {
            n: (tensorferry.shard.to_safetensors_dtype(a.dtype), a.shape) for n, a in STATE.items()}
        assert not layout.verify().problems
        with layout.open() as source:
            arrays = source.read()
            assert all(same(arrays[n], a) for n, a in STATE.items())
            part = source.read(["b"], out={"w": np.empty((4, 6), np.float32)})
            assert set(part) == {"b", "w"} and same(part["w"], STATE["w"])
            assert source.read_range("w", 8, 12).tobytes() == STATE["w"].tobytes()[8:20]
    assert layouts.describe(single)["metadata"] == {"format": "np"}
    assert layouts.describe(hf)["metadata"] == {"total_size": 1, "format": "pt"}


def test_a_folder_of_one_model_file_reads_as_that_file(tmp_path: Path) -> None:
    """A folder with one safetensors file and no index, as libraries name it
    (diffusers' diffusion_pytorch_model.safetensors, PEFT's adapter_model.safetensors),
    reads as that file; it was refused as a tensorferry checkpoint without its manifest.
    A folder whose one file is a part of one of tensorferry's layouts, or a rank's file of
    torch's distributed writer, is not taken for a model."""
    import safetensors.numpy

    for name in ("diffusion_pytorch_model.safetensors", "adapter_model.safetensors", "model.safetensors"):
        folder = tmp_path / name.split(".")[0]
        folder.mkdir()
        safetensors.numpy.save_file(STATE, str(folder / name))
        (folder / "config.json").write_text("{}")
        assert layouts.detect(folder).kind == "huggingface"
        assert all(same(tensorferry.load_checkpoint(folder)[n], a) for n, a in STATE.items())
        assert cli("verify", folder)["ok"]
    tensorferry.save_checkpoint(tmp_path / "ckpt", STATE)
    os.unlink(tmp_path / "ckpt" / tensorferry.checkpoint.MANIFEST)  # a damaged checkpoint, still
    with pytest.raises(CheckpointNotFoundError, match="not a complete checkpoint"):
        tensorferry.load_checkpoint(tmp_path / "ckpt")
    for part in ("rank00000-000.safetensors", "process-0.safetensors", "shard-00000-model-00001-of-00001.safetensors"):
        folder = tmp_path / part.split(".")[0]
        folder.mkdir()
        safetensors.numpy.save_file(STATE, str(folder / part))
        assert layouts.detect(folder).kind != "huggingface", part
    # Variants beside the file (diffusers' and transformers' fp16 copies): the file is the model.
    variants = tmp_path / "variants"
    variants.mkdir()
    safetensors.numpy.save_file(STATE, str(variants / "diffusion_pytorch_model.safetensors"))
    for variant in ("fp16", "bf16"):
        safetensors.numpy.save_file({"w": STATE["w"].astype(np.float16)},
                                    str(variants / f"diffusion_pytorch_model.{variant}.safetensors"))
    assert layouts.detect(variants).kind == "huggingface"
    assert all(same(tensorferry.load_checkpoint(variants)[n], a) for n, a in STATE.items())
    safetensors.numpy.save_file(STATE, str(variants / "other.safetensors"))  # two models: neither is taken
    assert layouts.detect(variants).kind != "huggingface"
    with pytest.raises(CheckpointNotFoundError, match="holds 4 safetensors files and no index naming them "
                                                      "\\(diffusion_pytorch_model.bf16.safetensors, .* and 1 more\\)"):
        tensorferry.load_checkpoint(variants)
    # A diffusers pipeline's folder given instead of one of its components: they are named.
    pipeline = tmp_path / "pipeline"
    for component in ("unet", "vae", "scheduler"):
        (pipeline / component).mkdir(parents=True)
        if component != "scheduler":
            safetensors.numpy.save_file(STATE, str(pipeline / component / "diffusion_pytorch_model.safetensors"))
    (pipeline / "model_index.json").write_text("{}")
    for read in (tensorferry.load_checkpoint, layouts.detect):
        with pytest.raises((CheckpointNotFoundError, layouts.UnknownLayoutError),
                           match="its folders unet, vae hold safetensors files: give one of them"):
            read(pipeline)


def test_every_layout_refuses_a_destination_of_another_dtype_or_shape(tmp_path: Path) -> None:
    """``out=`` of the tensor's byte size but of another dtype or shape: a tensorferry
    checkpoint refused it, while a safetensors file, a Hugging Face folder and a layout
    read in chunks filled it with the bytes reinterpreted (F32 as int32, [4, 6] as
    [6, 4]). Every layout refuses it now, with the same message, and names itself where
    it holds no tensor of a name asked for (a Hugging Face folder said "this layout")."""
    import safetensors.numpy

    tensorferry.save_checkpoint(tmp_path / "ckpt", STATE)
    safetensors.numpy.save_file(STATE, str(tmp_path / "one.safetensors"))
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors.numpy.save_file(STATE, str(hf / "model-00001-of-00001.safetensors"))
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(STATE, "model-00001-of-00001.safetensors")}))
    chunks = tmp_path / "chunks"  # a rank's file of torch's distributed writer: read in chunks
    chunks.mkdir()
    safetensors.numpy.save_file(STATE, str(chunks / "shard-00001-model-00001-of-00001.safetensors"))
    wrong = {"w": [(np.zeros((4, 6), np.int32), "is F32, the destination int32"),
                   (np.zeros((6, 4), np.float32), r"has shape \(4, 6\), the destination \(6, 4\)")],
             "b": [(np.zeros(5, np.float16), "is BF16, the destination float16")]}
    for path, kind in ((tmp_path / "ckpt", "tensorferry"), (tmp_path / "one.safetensors", "safetensors"),
                       (hf, "huggingface"), (chunks, "huggingface-shards")):
        assert layouts.detect(path).kind == kind
        for name, cases in wrong.items():
            for destination, message in cases:
                with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: tensor '{name}' {message}$"):
                    tensorferry.load_checkpoint(path, out={name: destination})
                assert not destination.any(), (path, name)
        with pytest.raises(KeyError, match=f"{re.escape(str(path))} holds no tensor\\(s\\) 'wieght'"):
            tensorferry.load_checkpoint(path, names=["wieght"])
        right = np.zeros((4, 6), np.float32)
        assert tensorferry.load_checkpoint(path, out={"w": right})["w"] is right and same(right, STATE["w"])


def test_bytes_after_the_last_tensor_are_refused_in_a_file_as_in_a_folder(tmp_path: Path) -> None:
    """A safetensors file that goes on after its last tensor (appended to, written over a
    longer file): a folder holding it was refused, the file given alone was read. Both
    are refused, as safetensors refuses the file; what safetensors and tensorferry write
    (safetensors' header padding, our 4096-byte one, tensors of odd sizes last) still loads."""
    import safetensors.numpy

    odd = {**STATE, "tail": np.arange(3, dtype=np.uint8)}  # 3 bytes: ends the data off any alignment
    ours = tmp_path / "ours.safetensors"
    with tensorferry.ShardWriter(ours) as writer:
        for name, array in odd.items():
            writer.add(name, array)
    theirs = tmp_path / "hf" / "model.safetensors"
    theirs.parent.mkdir()
    safetensors.numpy.save_file(odd, str(theirs))
    for path in (ours, theirs, theirs.parent):
        assert all(same(tensorferry.load_checkpoint(path)[n], a) for n, a in odd.items())
        assert layouts.describe(path)["complete"] and not layouts.detect(path).verify().problems
    assert all(same(safetensors.numpy.load_file(str(ours))[n], a) for n, a in odd.items())

    for path in (ours, theirs):
        with open(path, "ab") as f:
            f.write(bytes(8))
    with pytest.raises(Exception, match="file not fully covered"):
        safetensors.numpy.load_file(str(theirs))
    for path, file in ((ours, ours), (theirs, theirs), (theirs.parent, theirs)):
        with pytest.raises(CorruptCheckpointError, match=f"{file}: the file goes on 8 bytes after its last tensor"):
            tensorferry.load_checkpoint(path)
        with pytest.raises(CorruptCheckpointError, match="8 bytes after its last tensor"):
            layouts.open_layout(path)
        assert not layouts.describe(path)["complete"]
        assert any("8 bytes after its last tensor" in p for p in layouts.detect(path).verify().problems)


def test_a_header_naming_a_tensor_twice_is_refused(tmp_path: Path) -> None:
    """JSON keeps the last of two entries of one name: the file was read with the first
    entry's bytes unnoticed. safetensors refuses it (the bytes the first entry covers are
    no tensor's there); tensorferry names the tensor. A tensor named like a field of an
    entry ("data_offsets", which counting the fields meets) is no duplicate."""
    import safetensors.numpy

    data = np.arange(4, dtype=np.float32).tobytes() + np.full(4, 9, np.float32).tobytes()
    header = (b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
              b'"a":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}}')
    header += b" " * (-len(header) % 8)
    path = tmp_path / "hf" / "model.safetensors"
    path.parent.mkdir()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    with pytest.raises(Exception, match="invalid offset"):
        safetensors.numpy.load_file(str(path))
    for given in (path, path.parent):
        with pytest.raises(CorruptCheckpointError, match=f"{path}: the header names tensor 'a' twice"):
            tensorferry.load_checkpoint(given)
    safetensors.numpy.save_file({"data_offsets": STATE["w"], "dtype": STATE["b"]}, str(path))
    loaded = tensorferry.load_checkpoint(path)
    assert same(loaded["data_offsets"], STATE["w"]) and same(loaded["dtype"], STATE["b"])


def test_an_index_naming_a_file_outside_its_folder_is_refused(tmp_path: Path) -> None:
    import safetensors.numpy

    safetensors.numpy.save_file({"w": STATE["w"]}, str(tmp_path / "outside.safetensors"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(CorruptCheckpointError):
        layouts.open_layout(hf)
    assert cli("verify", hf, expect=1)["ok"] is False


def test_nothing_there_or_nothing_known(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        layouts.detect(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(layouts.UnknownLayoutError, match="not a checkpoint"):
        layouts.detect(tmp_path)


def test_a_new_layout_is_one_class(tmp_path: Path) -> None:
    class NpzFile(layouts.Layout):
        kind, title = "npz", "numpy .npz file"

        @classmethod
        def recognise(cls, path: str) -> bool:
            return path.endswith(".npz")

        def open(self, *, verify: bool = True, engine=None) -> layouts.TensorSource:
            arrays = dict(np.load(self.path))

            class Source(layouts.TensorSource):
                def _read(self, names, out):
                    return {n: arrays[n] for n in names}

            return Source({n: layouts.tensor_entry(n, tensorferry.shard.to_safetensors_dtype(a.dtype), a.shape)
                           for n, a in arrays.items()})

    np.savez(tmp_path / "x.npz", w=STATE["w"])
    layouts.register(NpzFile, before=layouts.SafetensorsFile)
    try:
        with layouts.open_layout(tmp_path / "x.npz") as source:
            assert same(source.read()["w"], STATE["w"])
    finally:
        layouts.LAYOUTS.remove(NpzFile)


@pytest.fixture(scope="module")
def orbax_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A step of an Orbax CheckpointManager with three items: one of tensorferry's handler
    (a jax array sharded over two devices, a numpy array, a scalar) and one of Orbax's own
    (a numpy array, a bf16 jax array sharded over two devices, a number, an int4 array),
    and one of Orbax's ArrayCheckpointHandler (not read)."""
    pytest.importorskip("orbax.checkpoint")  # the step is made in a subprocess
    root = tmp_path_factory.mktemp("orbax")
    script = f"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tensorferry.adapters.jax import FerryCheckpointHandler, FerrySave
mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
w = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(mesh, P("x")))
state = {{"params": {{"w": w, "b": np.arange(3, dtype=np.int32)}}, "step": 5}}
with ocp.CheckpointManager({str(root)!r}, item_names=("state", "extra", "array"),
                           item_handlers={{"state": FerryCheckpointHandler(),
                                           "extra": ocp.StandardCheckpointHandler(),
                                           "array": ocp.ArrayCheckpointHandler()}}) as manager:
    h = jax.device_put(np.arange(6, dtype=np.float32).reshape(2, 3).astype(jax.numpy.bfloat16),
                       NamedSharding(mesh, P("x")))
    i4 = jax.device_put(np.arange(4, dtype=np.int8).astype(jax.numpy.int4))  # jax 0.4 computes no int4
    extra = {{"x": np.ones(2, np.float32), "h": h, "n": 7, "i4": i4}}
    manager.save(3, args=ocp.args.Composite(state=FerrySave(state), extra=ocp.args.StandardSave(extra),
                                            array=ocp.args.ArraySave(np.arange(5.0))))
    manager.wait_until_finished()
"""
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    return root / "3"


def test_orbax_step_with_tensorferry_items(orbax_step: Path, tmp_path: Path) -> None:
    pytest.importorskip("orbax.checkpoint")
    info = cli("inspect", orbax_step)
    assert info["format"] == "orbax" and info["complete"]
    tensors = {t["name"]: t for t in info["tensors"]}
    assert (tensors["state/['params']['w']"]["dtype"], tensors["state/['params']['w']"]["shape"]) == ("F32", [8, 4])
    assert tensors["state/['params']['b']"]["nbytes"] == 12 and tensors["state/['step']"]["dtype"] == "object"
    # Orbax's own item, listed through orbax-checkpoint: numbers are 0-d arrays there.
    assert {n: (t["dtype"], t["shape"]) for n, t in tensors.items() if n.startswith("extra/")} == {
        "extra/['x']": ("F32", [2]), "extra/['h']": ("BF16", [2, 3]), "extra/['n']": ("I64", []),
        "extra/['i4']": ("object", [4])}
    item = cli("inspect", orbax_step / "state")  # the item directory alone
    assert item["format"] == "orbax" and item["complete"] and len(item["tensors"]) == 3
    verified = cli("verify", orbax_step)
    assert verified["ok"] and "1 item(s) of Orbax's own handlers read whole through Orbax" in verified["checked"]
    assert "1 item(s) of other Orbax handlers not checked" in verified["checked"]
    # The files Orbax read of its own item are counted (a step of Orbax's items alone said "OK: 0 files, 0 B").
    extra = [f for f in info["files"] if f["name"].startswith("extra/")]
    assert extra and verified["files"] > len(extra) and verified["bytes"] > sum(f["size"] for f in extra)
    own = cli("verify", orbax_step / "extra")  # Orbax's item alone: every one of its files
    assert own["ok"] and own["files"] == len(extra) and own["bytes"] == sum(f["size"] for f in extra)
    assert not any(name.startswith("array/") for name in tensors)

    # Both items convert: Orbax's own restored through orbax-checkpoint, whole.
    cli("convert", orbax_step, tmp_path / "state.safetensors", "--to", "safetensors")
    pytest.importorskip("torch", reason="the converted file is read through safetensors.torch (bf16)")
    from safetensors.torch import load_file
    loaded = {n: t.float().numpy() for n, t in load_file(str(tmp_path / "state.safetensors")).items()}
    assert set(loaded) == {"state/['params']['w']", "state/['params']['b']", "extra/['x']", "extra/['h']",
                           "extra/['n']"}
    assert same(loaded["state/['params']['w']"], np.arange(32, dtype=np.float32).reshape(8, 4))
    assert same(loaded["extra/['h']"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert same(loaded["extra/['x']"], np.ones(2, np.float32)) and loaded["extra/['n']"] == 7
    arrays = tensorferry.load_checkpoint(orbax_step, names=["extra/['h']", "state/['params']['b']"])
    assert arrays["extra/['h']"].dtype == ml_dtypes.bfloat16
    for name, wrong in (("state/['params']['w']", np.zeros((8, 4), np.int32)), ("extra/['h']", np.zeros(6, np.int16))):
        with pytest.raises(ValueError, match=f"^{orbax_step}: tensor {re.escape(repr(name))} "):  # not filled
            tensorferry.load_checkpoint(orbax_step, out={name: wrong})
    assert same(arrays["state/['params']['b']"], np.arange(3, dtype=np.int32))

    shard = next((orbax_step / "state").glob("process-0.safetensors"))
    damaged = tmp_path / "damaged"
    shutil.copytree(orbax_step, damaged)
    with open(damaged / "state" / shard.name, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    result = cli("verify", damaged, expect=1)
    assert result["bad_files"] == [f"state/{shard.name}"]

    # The CheckpointManager's directory given instead of a step: the step to give, named, not
    # a step Orbax is still writing (its time of day was read as its step).
    in_the_making = orbax_step.parent / f"{int(orbax_step.name) + 1}.orbax-checkpoint-tmp-1764000000"
    shutil.copytree(orbax_step, in_the_making)
    try:
        for read in (layouts.detect, tensorferry.load_checkpoint):
            with pytest.raises((layouts.UnknownLayoutError, CheckpointNotFoundError),
                               match=f"Orbax CheckpointManager with 1 step.*the latest being {orbax_step}\\b"):
                read(orbax_step.parent)
    finally:
        shutil.rmtree(in_the_making)

    # Orbax's item without its data: Orbax's own error, raised as ours and naming the item.
    for data in (damaged / "extra").glob("**/d/*"):
        data.unlink()
    with pytest.raises(CorruptCheckpointError, match="extra: Orbax could not read it"):
        tensorferry.load_checkpoint(damaged, names=["extra/['x']"])
    result = cli("verify", damaged, expect=1)
    assert any(problem.startswith(f"{damaged}/extra: Orbax could not read it") for problem in result["problems"])


def test_verify_reports_a_tensorferry_item_lacking_a_process_index(orbax_step: Path, tmp_path: Path) -> None:
    """An item whose process-0.json records two processes, without process-1.json (a step
    copied in part): the JAX restore refuses it, and verify reported it OK."""
    from tensorferry.checkpoint import encode_manifest, read_manifest_file
    from tensorferry.shard import ShardReader
    step = tmp_path / "3"
    shutil.copytree(orbax_step, step)
    index = read_manifest_file(step / "state" / "process-0.json")
    index["metadata"]["process_count"] = 2  # as process 0 of two writes it
    with ShardReader(step / "state" / "process-0.safetensors") as reader:
        (step / "state" / "process-0.json").write_bytes(encode_manifest([reader.shard_info()], index["metadata"]))
    incomplete = f"{step / 'state'}: the step is incomplete, it lacks 'process-1.json' (its indexes record 2 processes"
    for target in (step, step / "state"):
        result = cli("verify", target, expect=1)
        assert not result["ok"] and any(p.startswith(incomplete) for p in result["problems"]), result
        info = cli("inspect", target, expect=1)  # as for any incomplete checkpoint
        assert not info["complete"] and any(p.startswith(incomplete) for p in info["problems"]), info
    with pytest.raises(CorruptCheckpointError, match=re.escape(incomplete)):
        tensorferry.load_checkpoint(step, names=["state/['params']['b']"])


def test_an_orbax_pytree_with_strings_and_numbers(tmp_path: Path) -> None:
    """PyTreeCheckpointer's own save (the item is the step): arrays and numbers are read,
    a string is listed as an object and left out, not passed to Orbax as an array."""
    ocp = pytest.importorskip("orbax.checkpoint")
    import jax.numpy as jnp

    ocp.PyTreeCheckpointer().save(tmp_path / "step", {"w": jnp.arange(3.0), "name": "run-7", "lr": 2.5})
    info = cli("inspect", tmp_path / "step")
    assert {t["name"]: t["dtype"] for t in info["tensors"]} == {"['w']": "F32", "['name']": "object", "['lr']": "F64"}
    arrays = tensorferry.load_checkpoint(tmp_path / "step")
    assert set(arrays) == {"['w']", "['lr']"} and same(arrays["['w']"], np.arange(3.0, dtype=np.float32))
    assert arrays["['lr']"].shape == () and arrays["['lr']"] == 2.5


def test_the_latest_step_of_an_orbax_run_is_named_by_number(tmp_path: Path) -> None:
    for step in ("checkpoint_9", "checkpoint_10", "checkpoint_2", "notes"):
        (tmp_path / step).mkdir()
        if step != "notes":
            (tmp_path / step / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(layouts.UnknownLayoutError, match=f"with 3 step.*latest being {tmp_path}/checkpoint_10$"):
        layouts.detect(tmp_path)


def test_convert_of_a_checkpoint_without_tensors_is_an_error(tmp_path: Path) -> None:
    """Not an empty file reported as written: DCP's pickled objects are all it holds."""
    pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"step": 3, "name": "run"}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    result = subprocess.run([sys.executable, "-m", "tensorferry.cli", "convert", str(tmp_path / "dcp"),
                             str(tmp_path / "out.safetensors"), "--to", "safetensors"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "holds no tensor to convert (2 items" in result.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_torch_dcp_from_torchs_writer_reads_without_a_process_group(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(10, 20), "h": torch.randn(3).to(torch.bfloat16), "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    layout = layouts.detect(tmp_path / "dcp")
    assert layout.kind == "torch-dcp" and not layout.verify().problems
    with layout.open() as source:
        assert source.skipped == 1 and set(source.tensors) == {"w", "h"}
        arrays = source.read()
        assert source.read_range("w", 4, 8).tobytes() == state["w"].numpy().tobytes()[4:12]
    assert np.array_equal(arrays["w"], state["w"].numpy())
    assert arrays["h"].view(np.int16).tobytes() == state["h"].view(torch.int16).numpy().tobytes()
    wrong = np.zeros(3, np.float16)  # bf16's byte size, not its dtype
    with pytest.raises(ValueError, match=f"^{tmp_path / 'dcp'}: tensor 'h' is BF16, the destination float16$"):
        tensorferry.load_checkpoint(tmp_path / "dcp", out={"h": wrong})
    assert not wrong.any()


def test_an_unreadable_checkpoint_is_described_not_raised(tmp_path: Path) -> None:
    tensorferry.save_checkpoint(tmp_path / "ckpt", STATE)
    (tmp_path / "ckpt" / "tensorferry.json").write_text("{not json")
    info = layouts.describe(tmp_path / "ckpt")
    assert not info["complete"] and "not valid JSON" in info["problems"][0]
    with pytest.raises(CorruptCheckpointError):
        layouts.open_layout(tmp_path / "ckpt")
