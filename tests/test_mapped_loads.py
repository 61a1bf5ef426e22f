"""Loads with mmap=True: tensors over a private copy-on-write mapping of the files, with
real files (tensorferry's, transformers' save_pretrained, the safetensors package's), their
checksums verified, and failures raised."""

from __future__ import annotations

import errno
import gc
import json
import mmap
import os
import struct
import weakref
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensorferry  # noqa: E402
from tensorferry import CorruptCheckpointError, ShardReader, TensorferryIOError, layouts  # noqa: E402
from tensorferry.adapters import pytorch as tf_torch  # noqa: E402

DTYPES = [getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex64")
    if hasattr(torch, name)]  # float8_e8m0fnu since torch 2.7


def a_state() -> dict:
    torch.manual_seed(0)
    state = {f"t_{str(d).split('.')[-1]}": torch.randn(37, 5).to(d) for d in DTYPES}
    state.update(scalar=torch.tensor(2.5), empty=torch.empty(0, 3), big=torch.randn(3 << 20))  # 12 MiB
    state["tied"] = state["t_float32"]
    state["extra"] = {"step": 7, "array": np.arange(5, dtype=np.int32)}
    return state


def mapped_files() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bytes(a.reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.reshape(-1).view(torch.uint8).numpy())


def test_load_maps_the_file_copy_on_write(tmp_path: Path) -> None:
    state, path = a_state(), tmp_path / "w.safetensors"
    tf_torch.save(state, path)
    got = tf_torch.load(path, mmap=True)
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            assert same(got[name], tensor), name
    assert got["tied"] is got["t_float32"]
    assert got["extra"]["step"] == 7 and got["extra"]["array"].tolist() == list(range(5))
    # Private and writable: the tensors live in a mapping of the file, not in new memory.
    assert any(line.split()[1] == "rw-p" and line.endswith(str(path)) for line in mapped_files().splitlines())
    got["big"].add_(1)
    got["t_int64"][0, 0] = 99
    again = tf_torch.load(path)
    assert same(again["big"], state["big"]) and same(again["t_int64"], state["t_int64"])  # the file kept its bytes
    assert torch.equal(got["big"], state["big"] + 1)


def test_mapped_tensors_outlive_their_file_being_replaced_or_removed(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    tf_torch.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, path)
    got = tf_torch.load(path, mmap=True)
    tf_torch.save({"w": torch.zeros(1 << 20)}, path)  # atomic replace: the mapping keeps the old file
    assert torch.equal(got["w"], torch.arange(1 << 20, dtype=torch.float32))
    os.unlink(path)
    assert float(got["w"].sum()) == float(torch.arange(1 << 20, dtype=torch.float64).sum())


def test_a_mapped_load_verifies_checksums(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    tf_torch.save({"a": torch.zeros(1000), "b": torch.ones(1000)}, path)
    with ShardReader(path) as reader:
        offset = reader.data_start + reader.info("b").begin + 10
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\x7f")
    with pytest.raises(CorruptCheckpointError, match="'b'"):
        tf_torch.load(path, mmap=True)
    unverified = tf_torch.load(path, mmap=True, verify=False)
    assert unverified["b"].view(torch.uint8)[10] == 0x7F


def test_a_file_truncated_under_a_reader_raises(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    tf_torch.save({"a": torch.zeros(1 << 20), "b": torch.ones(1 << 20)}, path)
    with ShardReader(path) as reader:
        os.truncate(path, reader.data_start + 4096)  # after the header was checked against the size
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            reader.map_many()
        # Truncated once mapped: the pages past the end cannot be read in, which would be a
        # SIGBUS when touched; populating them raises instead, naming file, offset and errno.
        with open(path, "r+b") as f:
            f.truncate(reader.size)
            mapping = mmap.mmap(f.fileno(), reader.size, flags=mmap.MAP_PRIVATE)
            f.truncate(reader.data_start + 4096)
        whole = np.frombuffer(mapping, np.uint8)
        begin = (reader.data_start + (1 << 20)) // 4096 * 4096
        with pytest.raises(TensorferryIOError) as caught:
            reader._populate(whole, begin, reader.size)
    assert caught.value.errno == errno.EFAULT and caught.value.filename == str(path)
    assert f"at offset {begin}" in str(caught.value)


def test_load_checkpoint_maps_every_file_and_subsets(tmp_path: Path) -> None:
    state = {f"layer{i}": torch.randn(64, 1024) for i in range(8)}  # 256 KiB each
    tf_torch.save_checkpoint(tmp_path / "ckpt", state, max_shard_bytes=600 << 10)
    assert len(tensorferry.read_manifest(tmp_path / "ckpt")["files"]) > 2
    got = tf_torch.load_checkpoint(tmp_path / "ckpt", mmap=True)
    assert all(same(got[k], v) for k, v in state.items())
    part = tf_torch.load_checkpoint(tmp_path / "ckpt", names=["layer5", "layer1"], mmap=True)
    assert list(part) == ["layer5", "layer1"] and same(part["layer5"], state["layer5"])
    arrays = tensorferry.load_checkpoint(tmp_path / "ckpt", ["layer3"], mmap=True)  # the core's loader
    assert arrays["layer3"].tobytes() == state["layer3"].numpy().tobytes()


def test_mapped_loads_of_files_other_tools_wrote(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not config.tie_word_embeddings}
    got = tf_torch.load_checkpoint(tmp_path / "hf", mmap=True)
    assert set(got) == set(expected) and all(same(got[k], expected[k]) for k in expected)
    fresh = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    fresh.load_state_dict(got, strict=False)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(fresh(ids).logits, model(ids).logits)
    # The safetensors package orders tensors by alignment, but other writers pack them back
    # to back: a float32 tensor at an odd offset cannot be mapped for torch, so it is copied.
    values = np.linspace(0, 1, 1000, dtype=np.float32)
    header = json.dumps({"odd": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "f": {"dtype": "F32", "shape": [1000], "data_offsets": [3, 4003]}}).encode()
    header += b" " * (-len(header) % 8)
    (tmp_path / "packed.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\1\2"
                                                  + values.tobytes())
    got = tf_torch.load(tmp_path / "packed.safetensors", mmap=True)
    assert got["odd"].tolist() == [0, 1, 2] and np.array_equal(got["f"].numpy(), values)
    assert got["f"].data_ptr() % 4 == 0


def test_tensors_at_odd_offsets_load_aligned_every_way(tmp_path: Path) -> None:
    """Tensors packed back to back by another writer, at offsets their item size does not
    divide: reads keep the file's phase (O_DIRECT needs it), so every path copies those
    out, and none hands back an array numpy calls unaligned (ARM faults on some)."""
    import io

    import tensorferry
    from tensorferry.shard import ShardReader

    floats, doubles = np.linspace(0, 1, 1000, dtype=np.float32), np.arange(5, dtype=np.float64)
    header = json.dumps({"odd": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "f": {"dtype": "F32", "shape": [1000], "data_offsets": [3, 4003]},
                         "d": {"dtype": "F64", "shape": [5], "data_offsets": [4003, 4043]}}).encode()
    header += b" " * (-len(header) % 8)
    packed = struct.pack("<Q", len(header)) + header + b"\0\1\2" + floats.tobytes() + doubles.tobytes()
    path = tmp_path / "packed.safetensors"
    path.write_bytes(packed)
    with ShardReader(path) as reader:
        boxes = {n: reader.read_box(n, [0], [len(v)]).result() for n, v in (("f", floats), ("d", doubles))}
        loads = {"read_many": reader.read_many(), "map_many": reader.map_many(), "read_box": boxes}
    loads["core load_checkpoint"] = tensorferry.load_checkpoint(path)
    for how, kwargs in (("load", {}), ("load(mmap=True)", {"mmap": True})):
        loads[how] = {k: v.numpy() for k, v in tf_torch.load(path, **kwargs).items()}
    loads["load(BytesIO)"] = {k: v.numpy() for k, v in tf_torch.load(io.BytesIO(packed)).items()}
    for how, arrays in loads.items():
        assert np.array_equal(arrays["f"], floats) and np.array_equal(arrays["d"], doubles), how
        assert all(a.flags.aligned for a in arrays.values()), how


def test_mapped_loads_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    tf_torch.save_checkpoint(tmp_path / "ckpt", {"a": torch.zeros(4)})
    with pytest.raises(ValueError, match="out="):
        tf_torch.load_checkpoint(tmp_path / "ckpt", out={"a": torch.empty(4)}, mmap=True)
    with layouts.open_layout(tmp_path / "ckpt") as source, pytest.raises(ValueError, match="out="):
        source.read(out={"a": np.empty(4, np.float32)}, mmap=True)
    with pytest.raises(ValueError, match="host memory"):
        tf_torch.load(tmp_path / "ckpt", "cuda:0", mmap=True)
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    dcp.save({"a": torch.zeros(4)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    with pytest.raises(ValueError, match="cannot map"):
        tf_torch.load_checkpoint(tmp_path / "dcp", mmap=True)
    assert torch.equal(tf_torch.load_checkpoint(tmp_path / "dcp")["a"], torch.zeros(4))


@pytest.mark.parametrize("mapped", [False, True])
def test_a_loaded_state_is_freed_when_dropped_without_the_collector(tmp_path: Path, mapped: bool) -> None:
    """Nothing a load returns sits in a reference cycle: dropping the state frees its memory
    (and a mapped load's mapping) at once, not at the collector's next full pass."""
    path = tmp_path / "w.safetensors"
    tf_torch.save({"model": {"w": torch.ones(1 << 20), "b": torch.zeros(3)}, "step": 3}, path)
    tf_torch.save_checkpoint(tmp_path / "ckpt", {"model": {"w": torch.ones(1 << 20)}})
    gc.collect()
    gc.disable()
    try:
        for load in (lambda: tf_torch.load(path, mmap=mapped),
                     lambda: tf_torch.load_checkpoint(tmp_path / "ckpt", mmap=mapped)):
            state = load()
            alive = weakref.ref(state["model"]["w"])
            view = state["model"]["w"].reshape(-1)[::2]
            del state, view
            assert alive() is None
        assert str(path) not in mapped_files()
    finally:
        gc.enable()


def test_map_many_across_slices_with_subsets(tmp_path: Path) -> None:
    """Tensors that straddle the helper's 32 MiB slices, more slices than its look-ahead,
    and subsets that skip some: every byte where it belongs."""
    from tensorferry import ShardWriter
    from tensorferry.shard import MAPPED_AHEAD, MAPPED_SLICE
    sizes = [3 << 20, 37 << 20, 5, 31 << 20, 1 << 20] * 4  # 288 MiB in 20 tensors
    assert sum(sizes) > (MAPPED_AHEAD + 1) * MAPPED_SLICE
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.integers(0, 255, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    with ShardWriter(tmp_path / "big.safetensors") as writer:
        for name, a in arrays.items():
            writer.add(name, a)
    with ShardReader(tmp_path / "big.safetensors") as reader:
        for wanted in (None, ["t17", "t1", "t2"], ["t19"]):
            got = reader.map_many(wanted)
            assert list(got) == (wanted or list(arrays))
            for name, a in got.items():
                assert np.array_equal(a, arrays[name]), name
        # As a JAX restore asks: started in a window, finished out of file order.
        mapped = reader.start_whole(["t3", "t19", "t0", "t2"], mapped=True)
        assert "t2" in mapped and "t5" not in mapped
        finish = {name: mapped.start(name) for name in ("t19", "t3")}
        assert np.array_equal(finish["t19"](), arrays["t19"]) and np.array_equal(finish["t3"](), arrays["t3"])
        assert np.array_equal(mapped.start("t0")(), arrays["t0"])
