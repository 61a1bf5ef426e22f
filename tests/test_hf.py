"""Hugging Face folders both ways, with real files: transformers' save_pretrained and
torch's HuggingFaceStorageWriter read by tensorferry; tensorferry's torch checkpoints
and files opened by transformers' from_pretrained. Models are built from configs:
nothing is downloaded."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tensorferry  # noqa: E402
from tensorferry import layouts  # noqa: E402
from tensorferry.adapters import pytorch as tf_torch  # noqa: E402


def tiny_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def saved_weights(model: torch.nn.Module) -> dict:
    """The state dict as save_pretrained stores it: a tied lm_head is left out."""
    tied = model.config.tie_word_embeddings
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


def same_tensors(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def cli(*args: object, expect: int = 0) -> dict:
    result = subprocess.run([sys.executable, "-m", "tensorferry.cli", *map(str, args), "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == expect, result.stderr
    return json.loads(result.stdout)


def test_tied_weights_load_into_a_models_own_state_dict(tmp_path: Path) -> None:
    """``load_checkpoint(folder, out=model.state_dict())`` for a model with tied weights
    (GPT-2, Llama 3.2 1B, Gemma): save_pretrained stores the embedding once and leaves
    lm_head.weight out, which was a KeyError; it is the embedding's own memory, filled by
    that read. A destination that is nobody's memory and absent is still an error."""
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    saved = transformers.GPT2LMHeadModel(config)
    saved.save_pretrained(tmp_path / "gpt2")
    fresh = transformers.GPT2LMHeadModel(config)
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()
    tf_torch.load_checkpoint(tmp_path / "gpt2", out=fresh.state_dict())
    assert same_tensors(fresh.state_dict(), saved.state_dict())
    tf_torch.save_checkpoint(tmp_path / "ours", saved_weights(saved))  # a tensorferry checkpoint, the same way
    fresh = transformers.GPT2LMHeadModel(config)
    tf_torch.load_checkpoint(tmp_path / "ours", out=fresh.state_dict())
    assert same_tensors(fresh.state_dict(), saved.state_dict())
    with pytest.raises(KeyError, match="holds no tensor.*'lm_head.weight'"):
        tf_torch.load_checkpoint(tmp_path / "gpt2", out={"lm_head.weight": torch.zeros_like(saved.lm_head.weight)})


def test_a_peft_adapter_folder_loads(tmp_path: Path) -> None:
    """PEFT's save_pretrained writes adapter_model.safetensors and adapter_config.json: the
    folder loads as the adapter's weights, as PEFT itself reads them back."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # PEFT starts B at zero: give the test something to compare
    model.save_pretrained(tmp_path / "lora")
    from safetensors.torch import load_file
    expected = load_file(str(tmp_path / "lora" / "adapter_model.safetensors"))
    assert expected and same_tensors(tf_torch.load_checkpoint(tmp_path / "lora"), expected)
    assert same_tensors(tf_torch.load(tmp_path / "lora"), expected)
    ours = peft.get_peft_model_state_dict(model)
    assert same_tensors(tf_torch.load_checkpoint(tmp_path / "lora"), {k: v.contiguous() for k, v in ours.items()})


def as_hub_cache(folder: Path, cache: Path, repo: str = "models--org--tiny", revision: str = "0" * 40) -> Path:
    """``folder`` laid out as huggingface_hub keeps a download in its cache: each file once
    in ``blobs/<sha256>``, and ``snapshots/<revision>/<name>`` a relative link to it (what
    ``snapshot_download`` and ``from_pretrained`` hand back). The files are moved."""
    import hashlib
    import os

    blobs, snapshot = cache / repo / "blobs", cache / repo / "snapshots" / revision
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (cache / repo / "refs").mkdir()
    (cache / repo / "refs" / "main").write_text(revision)
    for file in sorted(folder.iterdir()):
        blob = blobs / hashlib.sha256(file.read_bytes()).hexdigest()
        os.replace(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_a_hugging_face_cache_snapshot_loads(tmp_path: Path) -> None:
    """What ``snapshot_download`` returns (every file a link to ``../../blobs/<hash>``) is
    the commonest Hugging Face folder on disk; the index's links were refused as "leading
    out of the checkpoint". Links into the same repository's blobs are followed; links
    anywhere else still are not. A tensorferry checkpoint kept on the Hub loads from there
    too."""
    from huggingface_hub import scan_cache_dir

    model = tiny_llama()
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    tf_torch.save_checkpoint(tmp_path / "ours", model.state_dict())
    cache = tmp_path / "hub"
    snapshot = as_hub_cache(tmp_path / "hf", cache)
    ours = as_hub_cache(tmp_path / "ours", cache, "models--org--ours")
    assert {r.repo_id for r in scan_cache_dir(cache).repos} == {"org/tiny", "org/ours"}  # the client's own view
    expected = saved_weights(model)
    assert same_tensors(tf_torch.load_checkpoint(snapshot), expected)
    assert same_tensors(tf_torch.load(snapshot), expected)
    assert same_tensors(tf_torch.load_checkpoint(snapshot, mmap=True), expected)
    assert same_tensors(tf_torch.load_checkpoint(ours), model.state_dict())
    assert tensorferry.verify_checkpoint(ours) == []
    assert cli("verify", snapshot)["ok"] and cli("inspect", snapshot)["complete"]
    assert same_tensors(transformers.AutoModelForCausalLM.from_pretrained(snapshot).state_dict(), expected)
    with pytest.raises(tensorferry.CheckpointNotFoundError, match=f"give its snapshot {snapshot}"):
        tf_torch.load_checkpoint(snapshot.parent.parent)  # the repository, not a snapshot of it

    shard = next(p for p in snapshot.iterdir() if p.name.endswith(".safetensors"))
    for elsewhere in (tmp_path / "elsewhere.safetensors", cache / "models--org--ours" / "blobs" / "x"):
        elsewhere.write_bytes(shard.resolve().read_bytes())
        shard.unlink()
        shard.symlink_to(elsewhere)  # out of the cache, or into another repository's blobs
        with pytest.raises(tensorferry.CorruptCheckpointError, match="leading out of the checkpoint"):
            tf_torch.load_checkpoint(snapshot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_save_pretrained_folders_load(tmp_path: Path, dtype: torch.dtype) -> None:
    model = tiny_llama(dtype)
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    expected = saved_weights(model)
    loaded = tf_torch.load(tmp_path / "hf")
    assert same_tensors(loaded, expected)
    assert same_tensors(tf_torch.load(tmp_path / "hf" / "model.safetensors.index.json"), expected)
    arrays = tensorferry.load_checkpoint(tmp_path / "hf", ["model.norm.weight"])  # the core's loader too
    assert arrays["model.norm.weight"].tobytes() == expected["model.norm.weight"].view(torch.uint8).numpy().tobytes()

    info = cli("inspect", tmp_path / "hf")
    assert info["format"] == "huggingface" and info["complete"] and len(info["tensors"]) == len(expected)
    assert info["metadata"]["format"] == "pt" and info["metadata"]["total_size"] > 0
    verified = cli("verify", tmp_path / "hf")
    assert verified["ok"] and verified["files"] == len(list((tmp_path / "hf").glob("*.safetensors")))
    cli("convert", tmp_path / "hf", tmp_path / "ckpt", "--to", "tensorferry", "--shard-size", "1M")
    assert same_tensors(tf_torch.load_checkpoint(tmp_path / "ckpt"), expected)
    assert tensorferry.read_manifest(tmp_path / "ckpt")["metadata"] == {"format": "pt"}


def test_out_of_another_dtype_or_shape_is_refused_in_a_hf_folder_as_in_a_checkpoint(tmp_path: Path) -> None:
    """``load_checkpoint(folder, out=...)`` checked only byte counts in a save_pretrained
    folder: a bf16 model's weights read into an fp16 model came back reinterpreted, and a
    [96, 64] weight into a [64, 96] tensor. Refused there now as in a tensorferry
    checkpoint of the same weights, with the same message, before anything is read."""
    model = tiny_llama(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    tf_torch.save_checkpoint(tmp_path / "ours", saved_weights(model))
    gate = "model.layers.0.mlp.gate_proj.weight"
    for path in (tmp_path / "hf", tmp_path / "ours"):
        fp16 = {k: torch.zeros_like(v, dtype=torch.float16) for k, v in saved_weights(model).items()}
        first = next(iter(fp16))
        with pytest.raises(ValueError, match=f"^{path}: tensor '{first}' is BF16, the destination float16$"):
            tf_torch.load_checkpoint(path, out=fp16)
        transposed = torch.zeros(64, 96, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=f"^{path}: tensor '{gate}' has shape \\(96, 64\\), "
                                             "the destination \\(64, 96\\)$"):
            tf_torch.load_checkpoint(path, out={gate: transposed})
        assert not any(t.any() for t in fp16.values()) and not transposed.any()
        right = {k: torch.zeros_like(v) for k, v in saved_weights(model).items()}
        tf_torch.load_checkpoint(path, out=right)
        assert same_tensors(right, saved_weights(model))


def test_errors_of_a_load_from_a_hf_folder_name_the_folder_and_the_entry(tmp_path: Path) -> None:
    """A name the folder lacks was a bare "this layout holds no tensor(s) ..."; an ``out=``
    tensor that cannot be read into (not contiguous) did not say which entry it was."""
    model = tiny_llama()
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    folder = tmp_path / "hf"
    with pytest.raises(KeyError, match=f"{folder} holds no tensor\\(s\\) 'model.norm.wieght'; "
                                       "closest held: 'model.norm.weight'"):
        tf_torch.load_checkpoint(folder, names=["model.norm.wieght"])
    gate = "model.layers.0.mlp.gate_proj.weight"
    with pytest.raises(ValueError, match=f"^{folder}: out\\['{gate}'\\]: can read in place only into a "
                                         "contiguous CPU tensor, got one on cpu \\(not contiguous\\)$"):
        tf_torch.load_checkpoint(folder, out={gate: torch.empty(64, 96).t()})


def test_a_stale_copy_of_a_tensor_in_another_shard_is_left_for_the_index_s(tmp_path: Path) -> None:
    """A shard holding a copy of a tensor the index places in another shard (left by an
    earlier save into the folder, say): the folder was refused with the false "<the
    index's file>: holds no tensor ...", since only the last file's copy of each name was
    kept. The copy in the file the index names is read, with a warning naming the other."""
    from safetensors.torch import load_file, save_file

    model = tiny_llama()
    folder = tmp_path / "hf"
    model.save_pretrained(folder, max_shard_size="100KB")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    name = next(n for n, f in weight_map.items() if f == files[0])
    last = load_file(str(folder / files[-1]))
    save_file({**last, name: torch.full_like(model.state_dict()[name], 7.0)}, str(folder / files[-1]),
              metadata={"format": "pt"})
    for read in (tf_torch.load_checkpoint, tf_torch.load):
        with pytest.warns(UserWarning, match=f"{folder}: 1 tensor\\(s\\) also held by another file than the "
                                             f"index places them in \\('{name}' in {files[-1]}\\)"):
            assert same_tensors(read(folder), saved_weights(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert layouts.describe(folder)["complete"] and not layouts.detect(folder).verify().problems


def test_a_damaged_hf_folder_is_reported(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    victim = sorted((tmp_path / "hf").glob("*.safetensors"))[1]
    victim.unlink()
    info = cli("inspect", tmp_path / "hf", expect=1)
    assert not info["complete"] and any(victim.name in p for p in info["problems"])
    assert cli("verify", tmp_path / "hf", expect=1)["bad_files"] == [victim.name]
    with pytest.raises(tensorferry.CorruptCheckpointError, match=victim.name):
        tf_torch.load(tmp_path / "hf")


def test_torchs_huggingface_storage_writer_folders_load(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    import torch.distributed.checkpoint as dcp

    state = {f"layer{i}.weight": torch.randn(8, 4) for i in range(6)}
    state["embed"] = torch.randn(16, 4).to(torch.bfloat16)
    mapping = {name: 1 + i % 2 for i, name in enumerate(state)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(tmp_path / "hf"), fqn_to_index_mapping=mapping))
    assert layouts.detect(tmp_path / "hf").kind == "huggingface"
    assert same_tensors(tf_torch.load(tmp_path / "hf"), state)
    assert cli("verify", tmp_path / "hf")["ok"]



def test_torchs_consolidated_huggingface_writer_folders_load_2_ranks(tmp_path: Path) -> None:
    """HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True) on 2
    gloo ranks: the consolidated files and their index are what loads."""
    from test_pytorch import run

    run(2, str(tmp_path), "hf_consolidated")
    expected = torch.load(tmp_path / "expected.pt")
    folder = tmp_path / "hf"
    assert layouts.detect(folder).kind == "huggingface"
    assert same_tensors(tf_torch.load(folder), expected)
    assert same_tensors(tf_torch.load_checkpoint(folder), expected)
    assert cli("verify", folder)["ok"]
    info = cli("inspect", folder)
    assert info["complete"] and {t["name"] for t in info["tensors"]} == {"w", "b", "e"}


def test_torchs_distributed_huggingface_writer_folders_load_2_ranks(tmp_path: Path) -> None:
    """HuggingFaceStorageWriter(save_distributed=True) on 2 gloo ranks, row-sharded
    DTensors: each rank's file holds its chunks, their offsets in the header; no index."""
    from test_pytorch import run

    run(2, str(tmp_path), "hf_distributed")
    expected = torch.load(tmp_path / "expected.pt")
    folder = tmp_path / "hf"
    assert layouts.detect(folder).kind == "huggingface-shards"
    assert len(list(folder.glob("shard-*.safetensors"))) == 2
    assert same_tensors(tf_torch.load(folder), expected)
    info = cli("inspect", folder)
    assert info["complete"] and {t["name"]: t["shards"] for t in info["tensors"]} == {"w": 2, "b": 2}
    cli("convert", folder, tmp_path / "one.safetensors", "--to", "safetensors")
    from safetensors.torch import load_file
    assert same_tensors(load_file(str(tmp_path / "one.safetensors")), expected)


def test_from_pretrained_opens_what_tensorferry_writes(tmp_path: Path) -> None:
    model = tiny_llama()
    expected = model.state_dict()
    folder = tmp_path / "ckpt"
    tf_torch.save_checkpoint(folder, model.state_dict(), max_shard_bytes=100_000)
    model.config.save_pretrained(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in folder.glob("*.safetensors")}
    assert len(index["weight_map"]) > 1 and cli("verify", folder)["ok"]
    from safetensors import safe_open
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            assert f.metadata()["format"] == "pt"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert same_tensors(reloaded.state_dict(), expected)
    # torch's own reader of Hugging Face folders (torchtitan's way in), without tensorferry
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    through_dcp = {k: torch.zeros_like(v) for k, v in expected.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(through_dcp, storage_reader=HuggingFaceStorageReader(str(folder)))
    assert same_tensors(through_dcp, expected)

    single = tmp_path / "single"
    single.mkdir()
    tf_torch.save(model.state_dict(), single / "model.safetensors")
    model.config.save_pretrained(single)
    assert same_tensors(transformers.AutoModelForCausalLM.from_pretrained(single).state_dict(), expected)
    assert layouts.detect(single).kind == "huggingface"  # a lone model.safetensors, no index
    assert same_tensors(tf_torch.load(single), saved_weights(model))


def test_an_edited_index_of_a_tensorferry_checkpoint_is_refused(tmp_path: Path) -> None:
    state = saved_weights(tiny_llama())
    folder = tmp_path / "ckpt"
    tf_torch.save_checkpoint(folder, state, max_shard_bytes=100_000)
    index_path = folder / "model.safetensors.index.json"
    assert same_tensors(tf_torch.load_checkpoint(index_path), state)  # read as an index, checked
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.norm.weight"]  # a tensor left out: still a well-formed index
    index_path.write_text(json.dumps(index))
    with pytest.raises(tensorferry.CorruptCheckpointError, match="does not match the size and checksum"):
        tf_torch.load_checkpoint(index_path)
    assert not cli("verify", index_path, expect=1)["ok"]


def test_convert_keeps_a_files_own_metadata_keys_where_they_were(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from safetensors import safe_open

    save_file({"w": torch.ones(3)}, str(tmp_path / "a.safetensors"), metadata={"format": "pt", "note": "x"})
    cli("convert", tmp_path / "a.safetensors", tmp_path / "ckpt", "--to", "tensorferry")
    assert tensorferry.read_manifest(tmp_path / "ckpt")["metadata"] == {"format": "pt", "note": "x"}
    cli("convert", tmp_path / "ckpt", tmp_path / "b.safetensors", "--to", "safetensors")
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as f:
        metadata = f.metadata()
    own = {k: v for k, v in metadata.items() if not k.startswith("tensorferry.")}  # besides the checksums
    assert own == {"format": "pt", "note": "x"}
