"""OffloadedOptimizer and stream_weights on a CUDA device, against real files.

Skipped without CUDA; benchmarks/gpu_check.sh runs them (``pytest -m cuda``)."""

from __future__ import annotations

import os
from typing import Callable

import pytest

torch = pytest.importorskip("torch")

from tensorferry.adapters.pytorch import OffloadedOptimizer, stream_weights  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")]

CUDA = torch.device("cuda")


def mlp(seed: int = 0, width: int = 512, depth: int = 6, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(64, width)]
    for _ in range(depth):
        layers += [torch.nn.GELU(), torch.nn.Linear(width, width)]
    layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, 10)]
    return torch.nn.Sequential(*layers).to(device=CUDA, dtype=dtype)


def train(model: torch.nn.Module, optimizer: Callable | torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator(device=CUDA).manual_seed(1)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g, device=CUDA, dtype=dtype)
        target = torch.randint(0, 10, (32,), generator=g, device=CUDA)
        loss = torch.nn.functional.cross_entropy(model(x).float(), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    different = [name for (name, x), y in zip(a.named_parameters(), b.parameters()) if not torch.equal(x, y)]
    assert not different, f"parameters differ: {different}"


def largest_bytes(model: torch.nn.Module) -> int:
    return max(p.numel() * p.element_size() for p in model.parameters())


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
    "adamw-amsgrad-single": lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True, foreach=False),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("prefetch", [0, 2])
def test_bit_identical_to_the_unwrapped_optimizer_on_the_device(tmp_path, name, prefetch):
    plain, offloaded = mlp(), mlp()
    held = max(prefetch + 2, 3)
    budget = held * (3 * largest_bytes(plain) + 2 * 4096)  # a chunk: about one layer's state
    reference = OPTIMIZERS[name](plain.parameters())
    wrapped = OffloadedOptimizer(OPTIMIZERS[name](offloaded.parameters()), tmp_path, resident_bytes=budget,
                                 prefetch=prefetch)
    train(plain, reference, 5)
    train(offloaded, wrapped, 5)
    torch.cuda.synchronize()
    assert_same_params(plain, offloaded)
    saved = wrapped.state_dict()["state"]
    for index, entries in reference.state_dict()["state"].items():
        for key, value in entries.items():
            assert saved[index][key].device == value.device, (index, key)
            assert torch.equal(saved[index][key], value), (index, key)
    assert not any(wrapped.optimizer.state.values()), "state left in memory between steps"
    assert 0 < wrapped.peak_resident_bytes <= budget
    wrapped.close()
    assert os.listdir(tmp_path) == []


def test_device_memory_for_state_stays_within_resident_bytes(tmp_path):
    model = mlp(width=2048, depth=16)  # 16 layers of 16 MiB: AdamW state 2 x 260 MiB
    state_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = 3 * (2 * largest_bytes(model) + 2 * 4096)
    assert budget * 4 < state_bytes
    optimizer = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), foreach=False), tmp_path,
                                   resident_bytes=budget)
    for _ in range(3):
        train(model, optimizer, 1)  # gradients made; the step below is measured without the forward
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        optimizer.step()
        torch.cuda.synchronize()
        # The single-tensor step makes temporaries of up to about two of a parameter's size,
        # as the unwrapped optimizer does; the state itself stays within the budget.
        assert torch.cuda.max_memory_allocated() - before <= budget + 2 * largest_bytes(model)
        assert torch.cuda.memory_allocated() - before < largest_bytes(model)  # no state stays on the device
    assert optimizer.peak_resident_bytes <= budget
    optimizer.close()


def test_master_weights_bf16_parameters_fp32_state(tmp_path):
    plain, offloaded = mlp(dtype=torch.bfloat16), mlp(dtype=torch.bfloat16)
    params = list(plain.parameters())
    masters = [p.detach().float().requires_grad_() for p in params]
    reference = torch.optim.AdamW(masters, lr=1e-3, fused=True)

    class Masters:  # the reference: fp32 masters stepped on the device, parameters set from them
        def zero_grad(self) -> None:
            for p in params:
                p.grad = None

        def step(self) -> None:
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
            reference.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)

    budget = 3 * (3 * 4 * largest_bytes(plain) // 2 + 3 * 4096)  # fp32 master + 2 states per bf16 element
    wrapped = OffloadedOptimizer(torch.optim.AdamW(offloaded.parameters(), lr=1e-3, fused=True), tmp_path,
                                 resident_bytes=budget, master_weights=True)
    train(plain, Masters(), 4)
    train(offloaded, wrapped, 4)
    torch.cuda.synchronize()
    assert_same_params(plain, offloaded)
    assert all(p.dtype == torch.bfloat16 for p in offloaded.parameters())
    saved = wrapped.state_dict()["state"]
    for index, m in enumerate(masters):
        assert saved[index]["master"].dtype == torch.float32 and torch.equal(saved[index]["master"], m)
        assert saved[index]["exp_avg"].dtype == torch.float32
        assert torch.equal(saved[index]["exp_avg"], reference.state[m]["exp_avg"])
    assert wrapped.peak_resident_bytes <= budget
    wrapped.close()


def big_model(layers: int = 6, width: int = 2048) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(CUDA)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_stream_weights_identical_outputs_and_device_memory_within_budget(tmp_path, prefetch):
    model = big_model()
    x = torch.randn(64, 2048, device=CUDA)
    layer = 2048 * 2048 * 4 + 2048 * 4 + 4096
    budget = (prefetch + 1) * layer
    with torch.no_grad():
        expected = model(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        model(x)
        activations = torch.cuda.max_memory_allocated() - start  # what a forward adds besides weights
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad(), stream_weights(model, tmp_path, resident_bytes=budget, prefetch=prefetch) as handle:
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= start - weights + 4096  # the weights left the device
        assert all(p.device.type == "cuda" and p.numel() == 0 for p in model.parameters())
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        first = model(x)
        second = model(x)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before <= budget + activations + 2 * first.nbytes
        assert handle.peak_resident_bytes <= budget
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert all(p.device.type == "cuda" and p.numel() > 0 for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert os.listdir(tmp_path) == []
