"""The PyTorch adapter on real architectures: transformers models built from small configs
(nothing is downloaded) and torch's own nn.TransformerEncoder."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tensorferry  # noqa: E402
from tensorferry.adapters.pytorch import (OffloadedOptimizer, load, load_checkpoint, save,  # noqa: E402
                                          save_checkpoint, stream_weights)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOKENS = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))


def llama() -> tuple[torch.nn.Module, dict[str, Any]]:
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config), {"input_ids": TOKENS, "labels": TOKENS}


def gpt2() -> tuple[torch.nn.Module, dict[str, Any]]:
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config), {"input_ids": TOKENS, "labels": TOKENS}


def bart() -> tuple[torch.nn.Module, dict[str, Any]]:
    config = transformers.BartConfig(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
                                     attention_dropout=0.0, activation_dropout=0.0)
    return transformers.BartForConditionalGeneration(config), {"input_ids": TOKENS, "labels": TOKENS}


def clip_vision() -> tuple[torch.nn.Module, dict[str, Any]]:
    config = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    return transformers.CLIPVisionModel(config), {"pixel_values": pixels}


def transformer_encoder() -> tuple[torch.nn.Module, torch.Tensor]:
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2), torch.randn(2, 5, 32)


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, Any]]] = {
    "llama": llama, "gpt2": gpt2, "bart": bart, "clip-vision": clip_vision, "transformer-encoder": transformer_encoder}


def build(name: str) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    return MODELS[name]()


def run(model: torch.nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def first_output(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state


def loss_of(output: Any) -> torch.Tensor:
    if getattr(output, "loss", None) is not None:
        return output.loss
    return first_output(output).square().mean()


def streaming_bytes(module: torch.nn.Module, held: dict[int, int] | None = None) -> int:
    """The most weight bytes a forward holds at once: a module's own weights (a whole
    MultiheadAttention / TransformerEncoderLayer's), with those of the modules around it,
    each weight rounded up to pages."""
    whole = isinstance(module, (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer))
    held = {**(held or {}), **{id(p): -(-p.numel() * p.element_size() // 4096) * 4096
                               for p in module.parameters(recurse=whole)}}
    if whole:
        return sum(held.values())
    return max([sum(held.values())] + [streaming_bytes(child, held) for child in module.children()])


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("factor", [1, 2, 3])
def test_stream_weights_on_real_architectures(tmp_path, name, prefetch, factor):
    model, inputs = build(name)
    model.eval()
    if factor == 1:
        with pytest.raises(ValueError, match="too small"):
            stream_weights(model, tmp_path, resident_bytes=streaming_bytes(model) - 1)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        expected = first_output(run(model, inputs))
        with stream_weights(model, tmp_path, resident_bytes=factor * streaming_bytes(model),
                            prefetch=prefetch) as streamed:
            outputs = [first_output(run(model, inputs)) for _ in range(2)]
            assert all(p.numel() == 0 for p in model.parameters())
    for out in outputs:
        assert torch.equal(out, expected)
    assert streamed.peak_resident_bytes <= factor * streaming_bytes(model)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_stream_weights_refuses_a_module_it_cannot_stream(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.jit.script(torch.nn.Linear(4, 4)))
    with pytest.raises(TypeError, match=r"cannot stream 1 \(RecursiveScriptModule\)"):
        stream_weights(model, tmp_path, resident_bytes=1 << 20)
    assert all(p.numel() == 16 or p.numel() == 4 for p in model.parameters())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", list(MODELS))
def test_offloaded_optimizer_on_real_architectures(tmp_path, name):
    plain, inputs = build(name)
    offloaded = copy.deepcopy(plain)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    largest = max(p.numel() * p.element_size() for p in plain.parameters())
    wrapped = OffloadedOptimizer(torch.optim.AdamW(offloaded.parameters(), lr=1e-3), tmp_path,
                                 resident_bytes=3 * (2 * largest + 2 * 4096), prefetch=1)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + step)) for o in (reference, wrapped)]
    for model, optimizer, scheduler in zip((plain, offloaded), (reference, wrapped), schedulers):
        model.train()
        for _ in range(3):
            loss_of(run(model, inputs)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    for (n, a), b in zip(plain.named_parameters(), offloaded.parameters()):
        assert torch.equal(a, b), n
    assert wrapped.peak_resident_bytes <= wrapped.resident_bytes
    wrapped.close()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tied_embeddings_are_stored_once_and_load_tied(tmp_path, name):
    model, _ = build(name)
    state = model.state_dict()
    tied = [k for k in state if k.endswith("embed_tokens.weight") or k.endswith("wte.weight")] + ["lm_head.weight"]
    assert state[tied[0]].data_ptr() == state[tied[1]].data_ptr()
    save(state, tmp_path / "model.safetensors")
    save_checkpoint(tmp_path / "model", state)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert len(f.keys()) == len(state) - 1
    assert len(tensorferry.read_manifest(tmp_path / "model")["tensors"]) == len(state) - 1
    for back in (load(tmp_path / "model.safetensors"), load_checkpoint(tmp_path / "model")):
        assert back[tied[0]] is back[tied[1]]
        fresh, _ = build(name)
        fresh.load_state_dict(back)
        assert fresh.lm_head.weight is fresh.get_input_embeddings().weight
        for k, v in state.items():
            assert torch.equal(back[k], v), k
