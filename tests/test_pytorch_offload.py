"""OffloadedOptimizer and stream_weights on the CPU, against real files."""

from __future__ import annotations

import copy
import ctypes
import errno
import os
import subprocess
import sys
from typing import Callable

import pytest

torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

from conftest import mounted  # noqa: E402
from tensorferry import CorruptCheckpointError, TensorferryIOError  # noqa: E402
from tensorferry.adapters.pytorch import OffloadedOptimizer, stream_weights  # noqa: E402


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.LayerNorm(256), torch.nn.Linear(256, 10), torch.nn.Linear(10, 10),
                               torch.nn.Linear(10, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 10))


def transformer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), num_layers=2)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        if isinstance(model, torch.nn.TransformerEncoder):
            loss = model(torch.randn(4, 6, 32, generator=g)).square().mean()
        else:
            loss = torch.nn.functional.cross_entropy(model(torch.randn(16, 32, generator=g)),
                                                     torch.randint(0, 10, (16,), generator=g))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


def state_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def small_budget(model: torch.nn.Module) -> int:
    """Three chunks, each about the state of the largest parameter (3 tensors with amsgrad)."""
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    return 3 * (3 * largest + 2 * 4096)


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-4),
}


@pytest.mark.parametrize("make_model", [mlp, transformer], ids=["mlp", "transformer"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("prefetch", [0, 2])
def test_bit_identical_training(tmp_path, make_model, name, prefetch):
    plain, offloaded = make_model(), make_model()
    # Each chunk holds about one of the largest parameters' state (3 tensors with amsgrad),
    # so a step runs in several chunks.
    largest = max(p.numel() * p.element_size() for p in plain.parameters())
    held = max(prefetch + 2, 3)
    budget = held * (3 * largest + 2 * 4096)
    assert budget // held < 2 * state_bytes(plain)
    reference = OPTIMIZERS[name](plain.parameters())
    wrapped = OffloadedOptimizer(OPTIMIZERS[name](offloaded.parameters()), tmp_path,
                                 resident_bytes=budget, prefetch=prefetch)
    train(plain, reference, 6)
    train(offloaded, wrapped, 6)
    assert_same_params(plain, offloaded)
    assert not any(wrapped.optimizer.state.values()), "state left in memory between steps"
    stats = wrapped.stats()
    assert stats["files"] > 0 and stats["bytes_in"] > 0
    assert 0 < wrapped.peak_resident_bytes <= budget
    wrapped.close()
    assert os.listdir(tmp_path) == []


def test_param_groups_and_scheduler(tmp_path):
    plain, offloaded = mlp(), mlp()

    def groups(m):
        return [{"params": list(m[0].parameters()), "lr": 1e-3},
                {"params": list(m[2].parameters()) + list(m[3].parameters())}]

    reference = torch.optim.AdamW(groups(plain), lr=1e-2)
    wrapped = OffloadedOptimizer(torch.optim.AdamW(groups(offloaded), lr=1e-2), tmp_path,
                                 resident_bytes=small_budget(plain))
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (reference, wrapped)]
    for _ in range(2):
        train(plain, reference, 2)
        train(offloaded, wrapped, 2)
        for s in schedulers:
            s.step()
    reference.add_param_group({"params": list(plain[4].parameters())})
    wrapped.add_param_group({"params": list(offloaded[4].parameters())})
    train(plain, reference, 3)
    train(offloaded, wrapped, 3)
    assert_same_params(plain, offloaded)
    assert wrapped.param_groups[0]["lr"] == reference.param_groups[0]["lr"]


def test_mixed_precision_training_with_a_grad_scaler(tmp_path):
    """autocast, GradScaler (unscale_, clipping, a step skipped for an inf, the scale
    backing off): the wrapped optimizer's steps and the scaler's decisions are the
    plain optimizer's, bit for bit."""
    plain, offloaded = mlp(), mlp()
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    wrapped = OffloadedOptimizer(torch.optim.AdamW(offloaded.parameters(), lr=1e-2), tmp_path,
                                 resident_bytes=small_budget(plain))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**16) for _ in range(2)]
    torch.manual_seed(1)
    for step in range(6):
        x = torch.randn(16, plain[0].in_features)
        for model, optimizer, scaler in ((plain, reference, scalers[0]), (offloaded, wrapped, scalers[1])):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step == 2:
                next(model.parameters()).grad[0].fill_(float("inf"))
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    assert_same_params(plain, offloaded)
    assert scalers[0].get_scale() == scalers[1].get_scale() < 2.0**16  # the inf step backed it off
    first = next(offloaded.parameters())
    assert int(wrapped.state[first]["step"]) == int(reference.state[next(plain.parameters())]["step"]) == 5


def test_resident_memory_within_budget(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])  # 64 MiB of params
    budget = 26 << 20  # Adam's state is 128 MiB; each 4 MiB weight has 8 MiB
    wrapped = OffloadedOptimizer(torch.optim.Adam(model.parameters()), tmp_path, resident_bytes=budget)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    process = psutil.Process()
    before = process.memory_info().rss
    for _ in range(3):
        wrapped.step()
    # The allocator may keep the step's freed temporaries; hand them back before measuring.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    grown = process.memory_info().rss - before
    assert wrapped.peak_resident_bytes <= budget
    # Loose: the allocator keeps freed pages, but the state (128 MiB) must not be resident.
    assert grown < budget + (48 << 20), grown
    assert wrapped.stats()["disk_bytes"] >= 2 * state_bytes(model)
    wrapped.close()


def test_budget_too_small_is_refused_before_stepping(tmp_path):
    model = mlp()
    wrapped = OffloadedOptimizer(torch.optim.Adam(model.parameters()), tmp_path, resident_bytes=1 << 20)
    train(model, wrapped, 1)
    wrapped.resident_bytes = 4096
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="too small"):
        train(model, wrapped, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_state_dict_round_trip(tmp_path):
    plain, offloaded = mlp(), mlp()
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2, amsgrad=True)
    wrapped = OffloadedOptimizer(torch.optim.AdamW(offloaded.parameters(), lr=1e-2, amsgrad=True), tmp_path,
                                 resident_bytes=small_budget(plain))
    train(plain, reference, 3)
    train(offloaded, wrapped, 3)
    saved, expected = wrapped.state_dict(), reference.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    assert saved["state"].keys() == expected["state"].keys()
    for index, entries in expected["state"].items():
        for key, value in entries.items():
            assert torch.equal(saved["state"][index][key], value), (index, key)
    assert not any(wrapped.optimizer.state.values())

    # Into a fresh wrapper and into a plain optimizer: both continue bit-identically.
    resumed, resumed_plain = copy.deepcopy(offloaded), copy.deepcopy(offloaded)
    fresh = OffloadedOptimizer(torch.optim.AdamW(resumed.parameters(), lr=1e-2, amsgrad=True), tmp_path,
                               resident_bytes=small_budget(plain))
    fresh.load_state_dict(saved)
    assert not any(fresh.optimizer.state.values())
    bare = torch.optim.AdamW(resumed_plain.parameters(), lr=1e-2, amsgrad=True)
    bare.load_state_dict(saved)
    for model, optimizer in ((plain, reference), (resumed, fresh), (resumed_plain, bare)):
        train(model, optimizer, 2)
    assert_same_params(plain, resumed)
    assert_same_params(plain, resumed_plain)


def test_wrapping_an_optimizer_with_state_offloads_it(tmp_path):
    plain, offloaded = mlp(), mlp()
    reference = torch.optim.Adam(plain.parameters())
    inner = torch.optim.Adam(offloaded.parameters())
    train(plain, reference, 2)
    train(offloaded, inner, 2)
    wrapped = OffloadedOptimizer(inner, tmp_path, resident_bytes=small_budget(plain))
    assert not any(inner.state.values())
    train(plain, reference, 2)
    train(offloaded, wrapped, 2)
    assert_same_params(plain, offloaded)


def big_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(12):  # 12 x 16 MiB = 192 MiB of weights
        layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def test_stream_weights(tmp_path):
    model = big_model()
    x = torch.randn(4, 2048)
    layer = 2048 * 2048 * 4 + 8192
    budget = 3 * layer
    with torch.no_grad():
        expected = model(x)
    originals = {name: p.detach().clone() for name, p in model.named_parameters()}
    materialised = []

    def count(module, *args):
        materialised.append(sum(p.numel() * p.element_size() for p in model.parameters()))

    with torch.no_grad(), stream_weights(model, tmp_path, resident_bytes=budget, prefetch=1) as handle:
        assert all(p.numel() == 0 for p in model.parameters())
        probes = [m.register_forward_pre_hook(count) for m in model if isinstance(m, torch.nn.Linear)]
        first = model(x)
        second = model(x)
        for probe in probes:
            probe.remove()
        assert handle.store.stats()["bytes_in"] > 0
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert max(materialised) <= budget and handle.peak_resident_bytes <= budget
    assert handle.peak_resident_bytes > layer  # the next layer was prefetched
    for name, p in model.named_parameters():
        assert torch.equal(p, originals[name]), name
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert os.listdir(tmp_path) == []
    with torch.no_grad():
        assert torch.equal(model(x), expected)


class Scaled(torch.nn.Module):
    """A module with a weight of its own around a child that has weights too."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(32))
        self.inner = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def test_stream_weights_tied_and_nested(tmp_path):
    torch.manual_seed(0)
    embed = torch.nn.Embedding(100, 32)
    head = torch.nn.Linear(32, 100, bias=False)
    head.weight = embed.weight
    model = torch.nn.Sequential(embed, Scaled(), torch.nn.LayerNorm(32), Scaled(), head)
    tokens = torch.randint(0, 100, (2, 5))
    with torch.no_grad():
        expected = model(tokens)
        handle = stream_weights(model, tmp_path, resident_bytes=1 << 20)
        got = model(tokens)
        handle.remove()
    assert torch.equal(got, expected)
    assert model[4].weight is model[0].weight


class ReturnsWeight(torch.nn.Module):
    """A layer whose output is a view of its own weight: the caller keeps the memory."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, n))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.weight, self.weight[0]


def test_stream_weights_reuses_memory_only_when_nothing_holds_it(tmp_path):
    torch.manual_seed(0)
    first, second = ReturnsWeight(512), torch.nn.Linear(512, 512)  # the same size: regions could be swapped
    x = torch.randn(3, 512)
    with torch.no_grad():
        row = first.weight[0].clone()
        expected = second(first(x)[0])
        with stream_weights(torch.nn.ModuleList([first, second]), tmp_path, resident_bytes=4 << 20) as handle:
            kept = []
            for _ in range(3):
                y, view = first(x)
                kept.append(view)
                assert torch.equal(second(y), expected)
            assert handle.peak_resident_bytes <= 4 << 20
    for view in kept:  # later layers' reads did not land in memory a caller still holds
        assert torch.equal(view, row)


def test_stream_weights_needs_no_grad(tmp_path):
    model = mlp()
    with stream_weights(model, tmp_path, resident_bytes=1 << 20):
        with pytest.raises(RuntimeError, match="inference"):
            model(torch.randn(2, 32))


def test_missing_directory(tmp_path):
    missing = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        OffloadedOptimizer(torch.optim.Adam(mlp().parameters()), missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        stream_weights(mlp(), missing)


def test_read_only_directory():
    with mounted("tmpfs", "ro,size=1m") as readonly:
        with pytest.raises(OSError, match="cannot create") as info:
            OffloadedOptimizer(torch.optim.Adam(mlp().parameters()), readonly)
        assert info.value.errno in (errno.EROFS, errno.EACCES)
        model = mlp()
        with pytest.raises(OSError, match="cannot create"):
            stream_weights(model, readonly)
        assert all(p.numel() for p in model.parameters())


def test_full_directory():
    torch.manual_seed(0)
    with mounted("tmpfs", "size=4m") as small:
        plain = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 10))  # Adam: 8 MiB
        offloaded = copy.deepcopy(plain)
        reference = torch.optim.Adam(plain.parameters())
        wrapped = OffloadedOptimizer(torch.optim.Adam(offloaded.parameters()), small, resident_bytes=64 << 20)
        for model, optimizer in ((plain, reference), (offloaded, wrapped)):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
        reference.step()
        with pytest.raises(TensorferryIOError, match="could not offload") as info:
            wrapped.step()
        assert info.value.errno == errno.ENOSPC
        assert "parameters" in str(info.value) and "stays in memory" in str(info.value)
        # Named as the first failed write: its file in the store (not the store's folder), offset, length.
        failure = info.value.__cause__
        assert os.path.dirname(info.value.filename) == wrapped.store.path
        assert (info.value.filename, info.value.offset, info.value.length) == \
            (failure.filename, failure.offset, failure.length)
        # The step was applied everywhere and the state that did not fit stayed in memory.
        assert_same_params(plain, offloaded)
        assert any(wrapped.optimizer.state.values())
        saved = wrapped.state_dict()
        for index, entries in reference.state_dict()["state"].items():
            for key, value in entries.items():
                assert torch.equal(saved["state"][index][key], value)
        wrapped.close()
        assert os.listdir(small) == []

        big = torch.nn.Linear(2048, 1024)  # 8 MiB of weights
        weight = big.weight.detach().clone()
        with pytest.raises(TensorferryIOError) as info:
            stream_weights(big, small)
        assert info.value.errno == errno.ENOSPC
        assert torch.equal(big.weight, weight)
        assert os.listdir(small) == []


MANY_PARAMETERS_AT_A_LOW_DESCRIPTOR_LIMIT = """
import copy, resource, sys
import torch, tensorferry
from tensorferry.adapters.pytorch import OffloadedOptimizer

resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
torch.manual_seed(0)
plain = torch.nn.Sequential(*[torch.nn.LayerNorm(256) for _ in range(200)])  # 400 small parameters
offloaded = copy.deepcopy(plain)
reference = torch.optim.AdamW(plain.parameters())
with tensorferry.Engine(backend=sys.argv[2], block_size=4096, queue_depth=1, threads=1) as engine:
    wrapped = OffloadedOptimizer(torch.optim.AdamW(offloaded.parameters()), sys.argv[1], engine=engine)
    x = torch.randn(4, 256)
    for step in range(2):
        for model, optimizer in ((plain, reference), (offloaded, wrapped)):
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    print(all(torch.equal(a, b) for a, b in zip(plain.parameters(), offloaded.parameters())),
          wrapped.store.stats()["files"])
    wrapped.close()
"""


def test_many_small_parameters_at_a_low_descriptor_limit(tmp_path, backend):
    """A chunk's state is written (and read) all at once, and each write in flight held its
    file open: a model of many small parameters failed its step with EMFILE at the usual
    limit of 1024 descriptors (here, 400 parameters at 128)."""
    run = subprocess.run([sys.executable, "-c", MANY_PARAMETERS_AT_A_LOW_DESCRIPTOR_LIMIT, str(tmp_path), backend],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "400"], run.stdout


def damage_every_file(folder: str) -> None:
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "r+b") as file:
            first = file.read(1)
            file.seek(0)
            file.write(bytes([first[0] ^ 0xFF]))


def test_state_and_weights_damaged_on_the_drive_are_detected(tmp_path):
    model = mlp()
    optimizer = OffloadedOptimizer(torch.optim.Adam(model.parameters()), tmp_path, resident_bytes=1 << 20)
    train(model, optimizer, 1)
    damage_every_file(optimizer.store.path)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        train(model, optimizer, 1)
    optimizer.close()
    unchecked = OffloadedOptimizer(torch.optim.Adam(mlp().parameters()), tmp_path, verify=False)
    assert not unchecked.store.verify
    unchecked.close()

    model = mlp()
    streamed = stream_weights(model, tmp_path, resident_bytes=1 << 20)
    damage_every_file(streamed.store.path)
    with torch.no_grad(), pytest.raises(CorruptCheckpointError, match="checksum"):
        model(torch.randn(2, 32))
    with pytest.raises(CorruptCheckpointError):
        streamed.remove()  # the weights cannot be read back either; the store goes all the same
    assert streamed.store.closed and os.listdir(tmp_path) == []
    with stream_weights(mlp(), tmp_path, verify=False) as streamed:
        assert not streamed.store.verify


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    return optimizer.state_dict()["state"]


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for index, entries in a.items():
        assert entries.keys() == b[index].keys()
        for key, value in entries.items():
            assert torch.equal(value, b[index][key]), (index, key)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_state_dict_helpers_neither_step_nor_change_anything(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from tensorferry.adapters.pytorch import FSDPCheckpointer

    plain, offloaded = mlp(), mlp()
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    wrapped = OffloadedOptimizer(torch.optim.AdamW(offloaded.parameters(), lr=1e-2), tmp_path,
                                 resident_bytes=small_budget(plain))
    checkpointer = FSDPCheckpointer(tmp_path / "ckpt", offloaded, wrapped)
    train(plain, reference, 2)
    train(offloaded, wrapped, 2)
    wrapped.zero_grad()  # no gradients: torch's helpers step an optimizer whose state looks empty
    checkpointer.save(2)
    model_state, optim_state = get_state_dict(offloaded, wrapped)
    set_state_dict(offloaded, wrapped, model_state_dict=model_state, optim_state_dict=optim_state)
    assert all(float(entries["step"]) == 2 for entries in optimizer_state(wrapped).values())
    assert_same_params(plain, offloaded)
    assert_same_state(optimizer_state(reference), optimizer_state(wrapped))
    train(plain, reference, 2)
    train(offloaded, wrapped, 2)
    wrapped.zero_grad()
    checkpointer.save(4)
    assert_same_params(plain, offloaded)
    assert_same_state(optimizer_state(reference), optimizer_state(wrapped))

    # The checkpoint of step 2 resumes as step 2: two more steps give step 4 exactly.
    resumed = mlp(seed=5)
    fresh = OffloadedOptimizer(torch.optim.AdamW(resumed.parameters(), lr=1e-2), tmp_path,
                               resident_bytes=small_budget(plain))
    assert FSDPCheckpointer(tmp_path / "ckpt", resumed, fresh).load(2) == 2
    assert all(float(entries["step"]) == 2 for entries in optimizer_state(fresh).values())
    train(resumed, fresh, 2)
    assert_same_params(plain, resumed)
    assert_same_state(optimizer_state(reference), optimizer_state(fresh))
    # What torch's helpers look at: the state, as on a plain optimizer.
    assert len(fresh.state) == len(reference.state)
    assert list(fresh.state[resumed[0].weight]) == list(reference.state[plain[0].weight])
    assert torch.equal(fresh.state[resumed[0].weight]["exp_avg"], reference.state[plain[0].weight]["exp_avg"])
    for o in (wrapped, fresh):
        o.close()


def test_hooks_run_once_per_step_and_schedulers_see_the_step(tmp_path):
    import warnings
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    model = mlp()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    wrapped = OffloadedOptimizer(inner, tmp_path, resident_bytes=small_budget(model))
    calls: list[tuple[str, torch.optim.Optimizer]] = []

    def record(name):
        return lambda optimizer, args, kwargs: calls.append((name, optimizer))

    handles = [wrapped.register_step_pre_hook(record("pre")), wrapped.register_step_post_hook(record("post")),
               inner.register_step_pre_hook(record("inner-pre")),
               inner.register_step_post_hook(record("inner-post")),
               register_optimizer_step_pre_hook(record("global-pre")),
               register_optimizer_step_post_hook(record("global-post"))]
    try:
        # A parameter group added now is measured on a twin optimizer: no hooks for that.
        wrapped.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]})
        scheduler = torch.optim.lr_scheduler.StepLR(wrapped, 1, 0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
            for _ in range(2):
                train(model, wrapped, 1)
                scheduler.step()
        assert len(list(wrapped._chunks(wrapped._params()))) > 1  # several chunks per step
    finally:
        for handle in handles:
            handle.remove()
    assert [name for name, _ in calls] == ["global-pre", "pre", "inner-pre", "inner-post", "post", "global-post"] * 2
    assert all(o is (inner if name.startswith("inner") else wrapped) for name, o in calls)
    assert wrapped.param_groups[0]["lr"] == 1e-2 / 4
    wrapped.close()


def embedding_model(seed: int = 0) -> torch.nn.Module:
    """An embedding (2000 x 64, 500 KiB) far larger than the rest, a vocabulary-sized matrix."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(2000, 64), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 2000))


def train_embedding(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 2000, (8, 5), generator=g)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


ELEMENTWISE = {**OPTIMIZERS,
               "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
               "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
               "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=1e-3),
               "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True)}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_large_parameters_step_in_slices(tmp_path, name):
    plain, offloaded = embedding_model(), embedding_model()
    reference = ELEMENTWISE[name](plain.parameters())
    largest = 2000 * 64 * 4
    budget = 3 * largest // 2  # a chunk holds half of one state tensor of the embedding
    wrapped = OffloadedOptimizer(ELEMENTWISE[name](offloaded.parameters()), tmp_path, resident_bytes=budget)
    assert len(wrapped._params()) > len(list(offloaded.parameters()))  # sliced
    train_embedding(plain, reference, 3)
    train_embedding(offloaded, wrapped, 3)
    assert_same_params(plain, offloaded)
    assert wrapped.peak_resident_bytes <= budget
    saved = wrapped.state_dict()
    assert_same_state(reference.state_dict()["state"], saved["state"])
    assert torch.equal(wrapped.state[offloaded[0].weight][next(iter(reference.state[plain[0].weight]))],
                       next(iter(reference.state[plain[0].weight].values())))

    # Loaded into a fresh wrapper, the state is cut into slices again and training goes on alike.
    resumed = embedding_model(seed=3)
    resumed.load_state_dict(offloaded.state_dict())
    fresh = OffloadedOptimizer(ELEMENTWISE[name](resumed.parameters()), tmp_path, resident_bytes=budget)
    fresh.load_state_dict(saved)
    train_embedding(plain, reference, 2)
    train_embedding(resumed, fresh, 2)
    assert_same_params(plain, resumed)
    assert fresh.peak_resident_bytes <= budget or name == "adagrad"  # load itself holds the whole state
    for o in (wrapped, fresh):
        o.close()


def test_budget_is_checked_when_the_optimizer_is_built(tmp_path):
    model = embedding_model()
    # AdamW with amsgrad keeps 3 tensors per element; 4 KiB chunks cannot hold one slice.
    with pytest.raises(ValueError, match="too small"):
        OffloadedOptimizer(torch.optim.AdamW(model.parameters(), amsgrad=True), tmp_path, resident_bytes=3 << 12)
    assert list(tmp_path.iterdir()) == []
    # A budget smaller than the embedding's state, but holding slices, trains from step 1 on.
    wrapped = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), amsgrad=True), tmp_path,
                                 resident_bytes=3 * (200 << 10))
    train_embedding(model, wrapped, 2)
    assert wrapped.peak_resident_bytes <= 3 * (200 << 10)
    wrapped.close()


class FP32Masters:
    """The reference for ``master_weights``: a plain optimizer stepping fp32 copies of bf16
    parameters from the gradients cast to fp32, the parameters then set to the copies."""

    def __init__(self, params: list[torch.nn.Parameter], make: Callable) -> None:
        self.params = params
        self.masters = [p.detach().float().requires_grad_() for p in params]
        self.optimizer = make(self.masters)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)


@pytest.mark.parametrize("name", ["adamw", "adam-foreach", "sgd-momentum"])
def test_master_weights_keep_fp32_state_for_bf16_parameters(tmp_path, name):
    plain, offloaded = embedding_model().bfloat16(), embedding_model().bfloat16()
    reference = FP32Masters(list(plain.parameters()), ELEMENTWISE[name])
    budget = 3 * (2000 * 64 * 4)  # the embedding's master and state (12 bytes per element) in slices
    wrapped = OffloadedOptimizer(ELEMENTWISE[name](offloaded.parameters()), tmp_path, resident_bytes=budget,
                                 master_weights=True)
    assert len(wrapped._params()) > len(list(offloaded.parameters()))  # the embedding is stepped in slices
    train_embedding(plain, reference, 3)
    train_embedding(offloaded, wrapped, 3)
    assert_same_params(plain, offloaded)
    assert wrapped.peak_resident_bytes <= budget
    saved = wrapped.state_dict()
    for index, (p, m) in enumerate(zip(plain.parameters(), reference.masters)):
        assert saved["state"][index]["master"].dtype == torch.float32
        assert torch.equal(saved["state"][index]["master"], m)
        for entry, value in reference.optimizer.state[m].items():
            assert torch.equal(saved["state"][index][entry], value), entry  # fp32, not cast to bf16

    # Resumed from the state dict: the masters and their state come back fp32, training goes on alike.
    resumed = embedding_model(seed=3).bfloat16()
    resumed.load_state_dict(offloaded.state_dict())
    fresh = OffloadedOptimizer(ELEMENTWISE[name](resumed.parameters()), tmp_path, resident_bytes=budget,
                               master_weights=True)
    fresh.load_state_dict(saved)
    train_embedding(plain, reference, 2)
    train_embedding(resumed, fresh, 2)
    assert_same_params(plain, resumed)
    for o in (wrapped, fresh):
        o.close()


def test_parameters_must_be_on_one_cpu_or_cuda_device(tmp_path):
    on_meta = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="CPU or a CUDA device"):
        OffloadedOptimizer(torch.optim.AdamW(on_meta.parameters()), tmp_path)
    with pytest.raises(ValueError, match="CPU or a CUDA device"):
        stream_weights(on_meta, tmp_path)
    mixed = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, device="meta"))]
    with pytest.raises(ValueError, match="one device"):
        OffloadedOptimizer(torch.optim.AdamW(mixed), tmp_path)
    wrapped = OffloadedOptimizer(torch.optim.AdamW(mlp().parameters()), tmp_path)
    with pytest.raises(ValueError, match="CPU or a CUDA device"):
        wrapped.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, device="meta"))]})
    wrapped.close()
    assert os.listdir(tmp_path) == []


ON_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")])


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_stream_weights_generate_of_a_transformers_model(tmp_path, device):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    prompt = torch.randint(0, 128, (2, 6)).to(device)
    options = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    layer = 64 * 128 * 4  # an MLP projection, the largest weight but the embedding and head
    budget = 2 * 128 * 64 * 4 + 4 * layer
    assert budget < sum(p.numel() * p.element_size() for p in model.parameters()) / 2
    with torch.no_grad():
        expected = model.generate(prompt, **options)
        with stream_weights(model, tmp_path, resident_bytes=budget, prefetch=2) as handle:
            got = model.generate(prompt, **options)
            assert handle.peak_resident_bytes <= budget
            assert all(p.device == prompt.device and p.numel() == 0 for p in model.parameters())
    assert torch.equal(got, expected)


def test_master_weights_resume_from_a_plain_bf16_optimizer(tmp_path):
    model = embedding_model().bfloat16()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_embedding(model, plain, 2)  # bf16 state
    wrapped = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path,
                                 resident_bytes=3 * (2000 * 64 * 4), master_weights=True)
    wrapped.load_state_dict(plain.state_dict())
    train_embedding(model, wrapped, 2)  # the masters start from the parameters, the state as fp32
    state = wrapped.state_dict()["state"][0]
    assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["master"].bfloat16(), model[0].weight.detach())
    wrapped.close()
