"""The host side of OffloadedOptimizer's and stream_weights' CUDA path, run on the CPU.

The CUDA path moves data with asynchronous copies ordered by events (``_CopyStreams``) and
stages it in pinned memory. No GPU runs here, so these tests give the real code a CPU
stand-in with the same contract and the same hazards: an upload's data is there only once
the current stream has been made to wait for it (``use``), a download's only once its
event has fired, and an event reports itself done only after a few ``query`` calls (or on
``synchronize``). Code that read a device copy too early, wrote host memory to the drive
before the copy back was done, or freed device memory before the device was done with it
would give different bits or break the budget here. The CUDA calls themselves are tested in
tests/test_offload_cuda.py, on a CUDA machine.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

from tensorferry.adapters.pytorch import OffloadedOptimizer, offload, stream_weights  # noqa: E402
from tensorferry.shard import aligned_empty  # noqa: E402
from test_pytorch_offload import (ELEMENTWISE, FP32Masters, OPTIMIZERS, assert_same_params, big_model,  # noqa: E402
                                  embedding_model, mlp, train, train_embedding)


class LateEvent:
    """Done on the ``late``-th query, or when synchronized; ``action`` runs as it becomes done."""

    def __init__(self, action: Callable[[], None] | None = None, late: int = 2) -> None:
        self.action, self.late, self.queries, self.done = action, late, 0, False

    def query(self) -> bool:
        self.queries += 1
        if self.queries >= self.late:
            self.synchronize()
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.done = True
            if self.action is not None:
                self.action()


class CopyStreamsOnCPU:
    """``_CopyStreams``' contract, with the copies made when the events say they are done."""

    def __init__(self) -> None:
        self.uploads = self.downloads = 0
        self.in_flight: list[LateEvent] = []  # downloads, in the order of their stream

    def upload_async(self, host: torch.Tensor) -> tuple[torch.Tensor, LateEvent]:
        self.uploads += 1
        copy = torch.full_like(host, 0xAB) if host.dtype == torch.uint8 else torch.full_like(host, float("nan"))
        return copy, LateEvent(lambda: copy.copy_(host))

    def use(self, copy: torch.Tensor, ready: LateEvent) -> torch.Tensor:
        ready.synchronize()  # the current stream waits for the upload
        return copy

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return self.use(*self.upload_async(host))

    def mark(self) -> LateEvent:
        return LateEvent(late=5)  # the device lags well behind the host

    def to_host(self, pairs: Any) -> LateEvent:
        self.downloads += 1
        pairs = [(source.clone(), target) for source, target in pairs]  # what the device holds now

        def land() -> None:
            # One stream runs its copies in order: those queued before this one are done too.
            if done in self.in_flight:
                index = self.in_flight.index(done)
                earlier, self.in_flight[:] = self.in_flight[:index], self.in_flight[index + 1:]
                for event in earlier:
                    event.synchronize()
            for source, target in pairs:
                target.copy_(source)
        done = LateEvent(land)
        self.in_flight.append(done)
        return done


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], CopyStreamsOnCPU]:
    """Gives an OffloadedOptimizer or StreamedWeights the CUDA path's staging, on the CPU."""
    monkeypatch.setattr(offload, "_pinned_empty", lambda nbytes: torch.from_numpy(aligned_empty(nbytes)))

    def stage(owner: Any) -> CopyStreamsOnCPU:
        owner._streams = CopyStreamsOnCPU()
        return owner._streams
    return stage


@pytest.mark.parametrize("name", ["adamw", "adamw-amsgrad", "sgd-momentum"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_optimizer_through_device_copies_is_bit_identical(tmp_path, staged, name, prefetch):
    plain, offloaded = mlp(), mlp()
    largest = max(p.numel() * p.element_size() for p in plain.parameters())
    budget = max(prefetch + 2, 3) * (3 * largest + 2 * 4096)
    reference = OPTIMIZERS[name](plain.parameters())
    wrapped = OffloadedOptimizer(OPTIMIZERS[name](offloaded.parameters()), tmp_path, resident_bytes=budget,
                                 prefetch=prefetch)
    streams = staged(wrapped)
    train(plain, reference, 5)
    train(offloaded, wrapped, 5)
    assert_same_params(plain, offloaded)
    assert streams.uploads > 0 and streams.downloads > 0
    assert not any(wrapped.optimizer.state.values())
    assert wrapped.peak_resident_bytes <= budget
    saved = wrapped.state_dict()["state"]
    for index, entries in reference.state_dict()["state"].items():
        for key, value in entries.items():
            assert torch.equal(saved[index][key], value), (index, key)
    wrapped.close()
    assert os.listdir(tmp_path) == []


def test_master_weights_through_device_copies(tmp_path, staged):
    plain, offloaded = embedding_model().bfloat16(), embedding_model().bfloat16()
    reference = FP32Masters(list(plain.parameters()), ELEMENTWISE["adamw"])
    budget = 3 * (2000 * 64 * 4)
    wrapped = OffloadedOptimizer(ELEMENTWISE["adamw"](offloaded.parameters()), tmp_path, resident_bytes=budget,
                                 master_weights=True)
    staged(wrapped)
    train_embedding(plain, reference, 3)
    train_embedding(offloaded, wrapped, 3)
    assert_same_params(plain, offloaded)
    wrapped.close()


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_stream_weights_through_device_copies(tmp_path, staged, prefetch):
    model = big_model()
    x = torch.randn(4, 2048)
    layer = 2048 * 2048 * 4 + 8192
    budget = (max(prefetch, 1) + 1) * layer
    with torch.no_grad():
        expected = model(x)
        with stream_weights(model, tmp_path, resident_bytes=budget, prefetch=prefetch) as handle:
            streams = staged(handle)
            outputs = [model(x) for _ in range(3)]
            assert handle.peak_resident_bytes <= budget  # layers the device may still run stay charged
    assert all(torch.equal(out, expected) for out in outputs)
    assert streams.uploads >= 3 * len(list(model.parameters()))
    with torch.no_grad():
        assert torch.equal(model(x), expected)
