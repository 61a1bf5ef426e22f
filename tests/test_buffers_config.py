"""Pinned buffers, the pool, and settings."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import tensorferry
from tensorferry import ConfigError, IOConfig


def test_alloc_pinned_is_aligned_and_usable_from_numpy_and_torch() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tensorferry.PinnedMemoryWarning)
        buf = tensorferry.alloc_pinned(1 << 20)
    assert buf.dtype == np.uint8 and buf.nbytes == 1 << 20
    assert buf.ctypes.data % 4096 == 0
    buf[:] = 7
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(buf)
    t[0] = 9
    assert buf[0] == 9  # same memory


def run_without_memlock(script: str, **fields: object) -> None:
    """Runs ``script`` (formatted with ``fields`` and ``limit``, RLIMIT_MEMLOCK's soft limit)
    in a process that cannot lock memory past that limit; it must print "ok"."""
    import resource
    import shutil
    import subprocess
    import sys

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        pytest.skip("RLIMIT_MEMLOCK is unlimited here: every allocation locks")
    prefix = []
    if os.geteuid() == 0:  # root locks past the limit (CAP_IPC_LOCK): run without it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv to drop CAP_IPC_LOCK")
        prefix = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"]
    result = subprocess.run(prefix + [sys.executable, "-c", script.format(limit=soft, **fields)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_pinned_falls_back_with_one_warning_beyond_memlock() -> None:
    run_without_memlock("""
import warnings, tensorferry
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    a = tensorferry.alloc_pinned({limit} + (1 << 20))
    b = tensorferry.alloc_pinned({limit} + (1 << 20))
assert [w.category.__name__ for w in record] == ["PinnedMemoryWarning"], record
assert a.ctypes.data % 4096 == 0 and b.ctypes.data % 4096 == 0
a[-1] = 1
print("ok")
""")


def test_host_only_io_neither_locks_nor_warns_beyond_memlock(tmp_path) -> None:
    """Saves, loads and FileSource reads stage through pageable pools: a process that may
    not lock memory (a container's default ulimit -l) gets no PinnedMemoryWarning."""
    run_without_memlock("""
import warnings, numpy as np, tensorferry
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    state = {{"w": np.arange(({limit} + (8 << 20)) // 4, dtype=np.float32), "b": np.ones(3)}}
    tensorferry.save_checkpoint("{tmp_path}/ckpt", state)
    back = tensorferry.load_checkpoint("{tmp_path}/ckpt")
    assert all(np.array_equal(back[k], v) for k, v in state.items())
    shard = next(f for f in tensorferry.read_manifest("{tmp_path}/ckpt")["files"])
    source = tensorferry.FileSource([("{tmp_path}/ckpt/" + shard, 0, 1 << 20)] * 40)
    assert len(source.read_batch(range(40))) == 40
assert record == [], [str(w.message) for w in record]
print("ok")
""", tmp_path=tmp_path)


def test_pool_refuses_what_would_hand_one_buffer_to_two_users() -> None:
    """A buffer released twice was cached twice, and the next two acquires returned the
    same memory; a negative size gave a buffer of the wrong size (base[:-5])."""
    pool = tensorferry.PinnedPool(lock=False)
    buffer = pool.acquire(100)
    pool.release(buffer)
    with pytest.raises(ValueError, match="did not hand out, or has back already"):
        pool.release(buffer)
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(np.zeros(10, np.uint8))
    first, second = pool.acquire(100), pool.acquire(100)
    assert first.ctypes.data != second.ctypes.data and pool.cached_bytes == 0
    with pytest.raises(ValueError, match="-5 bytes"):
        pool.acquire(-5)


def test_pool_reuses_and_bounds() -> None:
    pool = tensorferry.PinnedPool(max_cached_bytes=1 << 20)
    a = pool.acquire(300_000)
    assert a.nbytes == 300_000
    address = a.ctypes.data
    pool.release(a)
    assert pool.cached_bytes == 512 << 10
    b = pool.acquire(400_000)  # same size class: the same memory comes back
    assert b.ctypes.data == address and pool.cached_bytes == 0
    c = pool.acquire(1 << 20)
    pool.release(b)
    pool.release(c)  # would exceed the bound: dropped
    assert pool.cached_bytes == 512 << 10
    pool.clear()
    assert pool.cached_bytes == 0


def test_exact_buffers_are_page_rounded_and_reused_at_that_size() -> None:
    pool = tensorferry.PinnedPool(lock=False)
    a = pool.acquire(12 << 20 | 5, exact=True)
    assert a.nbytes == 12 << 20 | 5 and a.base.nbytes == (12 << 20) + 4096, "not the 16 MiB size class"
    address = a.ctypes.data
    pool.release(a)
    assert pool.acquire(12 << 20, exact=True).ctypes.data != address, "another size: not this buffer"
    assert pool.acquire((12 << 20) + 1, exact=True).ctypes.data == address
    assert pool.acquire(300_000).base.nbytes == 512 << 10  # size classes otherwise


def test_config_defaults_and_validation() -> None:
    c = IOConfig()
    assert c.block_size == 1 << 20 and c.backend == "auto"
    assert IOConfig(block_size="4M").block_size == 4 << 20
    for bad in [dict(block_size="lots"), dict(block_size=100), dict(queue_depth=0), dict(threads="x"),
                dict(backend="aio"), dict(direct="maybe")]:
        with pytest.raises(ConfigError):
            IOConfig(**bad)
    with pytest.raises(ConfigError, match="unknown"):
        c.replace(blocksize=1)
    with pytest.raises(ConfigError):
        tensorferry.Engine(queue_depth=-1)


def test_config_refuses_counts_that_are_not_whole_numbers() -> None:
    """queue_depth=4.9 and threads=2.5 were cut to 4 and 2 by int(), unsaid, from keywords,
    the environment and DeepSpeed's section alike. A float is refused, even 4.0, as
    block_size refuses one; digits and numpy's integers are counts."""
    for name in ("queue_depth", "threads"):
        for bad in (4.9, 4.0, np.float64(4.0), True, "4.9"):
            with pytest.raises(ConfigError, match=f"{name}: expected an integer"):
                IOConfig(**{name: bad})
        assert getattr(IOConfig(**{name: np.int64(4)}), name) == getattr(IOConfig(**{name: " 4 "}), name) == 4
    with pytest.raises(ConfigError, match="block_size: cannot read 4096.0"):
        IOConfig(block_size=4096.0)
    with pytest.raises(ConfigError, match="queue_depth: expected an integer, got 8.5"):
        IOConfig.from_deepspeed({"aio": {"queue_depth": 8.5}})
    with pytest.raises(ConfigError, match="threads: expected an integer, got '2.5'"):
        IOConfig.from_env(environ={"TENSORFERRY_THREADS": "2.5"})


def test_config_from_environment() -> None:
    env = {"TENSORFERRY_BLOCK_SIZE": "2MiB", "TENSORFERRY_THREADS": "8", "TENSORFERRY_DIRECT": "0",
           "TENSORFERRY_BACKEND": "threads"}
    c = IOConfig.from_env(environ=env)
    assert (c.block_size, c.threads, c.direct, c.backend) == (2 << 20, 8, False, "threads")
    with pytest.raises(ConfigError):
        IOConfig.from_env(environ={"TENSORFERRY_QUEUE_DEPTH": "deep"})


def test_config_override_context(monkeypatch) -> None:
    monkeypatch.setenv("TENSORFERRY_THREADS", "2")
    assert tensorferry.default_config().threads == 2
    with tensorferry.config_override(threads=6, backend="threads"):
        with tensorferry.Engine() as e:
            assert e.config.threads == 6 and e.backend == "threads"
    assert tensorferry.default_config().threads == 2


def test_config_from_deepspeed() -> None:
    ds = {"aio": {"block_size": 1048576, "queue_depth": 16, "thread_count": 8, "single_submit": False,
                  "overlap_events": True, "use_gds": False}}
    c = IOConfig.from_deepspeed(ds)
    assert (c.block_size, c.queue_depth, c.threads, c.use_gds) == (1 << 20, 16, 8, False)
    assert IOConfig.from_deepspeed({"intra_op_parallelism": 3}).threads == 3
    assert IOConfig.from_deepspeed(c.to_deepspeed()) == c
    with pytest.raises(ConfigError, match="unknown"):
        IOConfig.from_deepspeed({"aio": {"blocksize": 1}})
    with pytest.raises(ConfigError):
        IOConfig.from_deepspeed({"aio": {"overlap_events": "sometimes"}})


def test_config_from_a_whole_deepspeed_config() -> None:
    """The whole config a DeepSpeed run holds (ds_config.json) was read as an aio section:
    without an "aio" section its other settings were "unknown DeepSpeed aio settings".
    It gives the defaults, as DeepSpeed reads it; its "aio" section is read as given
    alone, unknown keys in it still refused."""
    whole = {"train_batch_size": 32, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
             "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}
    assert IOConfig.from_deepspeed(whole) == IOConfig.from_deepspeed({**whole, "aio": None}) == IOConfig()
    with_aio = {**whole, "aio": {"block_size": 4 << 20, "queue_depth": 16, "intra_op_parallelism": 2}}
    assert IOConfig.from_deepspeed(with_aio) == IOConfig(block_size=4 << 20, queue_depth=16, threads=2)
    with pytest.raises(ConfigError, match="unknown DeepSpeed aio setting.*: blocksize"):
        IOConfig.from_deepspeed({**whole, "aio": {"blocksize": 1}})
    with pytest.raises(ConfigError, match=r"aio setting\(s\) queue_depth at the top of a whole DeepSpeed config"):
        IOConfig.from_deepspeed({**whole, "queue_depth": 16})  # DeepSpeed's own aio would not have it
    with pytest.raises(ConfigError, match="unknown DeepSpeed aio setting.*: train_batchsize"):
        IOConfig.from_deepspeed({"train_batchsize": 32, "queue_depth": 16})  # a bare section, as before


def test_import_needs_numpy_only() -> None:
    import subprocess
    import sys
    script = ("import sys, tensorferry\n"
              "heavy = {'xxhash', 'ml_dtypes', 'torch', 'jax', 'tensorflow', 'safetensors'}\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


class _ReadOnlyDLPackExport:
    """Writable memory whose DLPack export numpy imports read-only, as torch before 2.8
    exports CPU tensors (an unversioned capsule; seen with torch 2.7.1 and numpy 2.4),
    with torch's ``numpy()`` and ``detach()``."""

    def __init__(self, size: int) -> None:
        self._memory = np.zeros(size, np.uint8)
        self._exported = self._memory.view()
        self._exported.flags.writeable = False

    def __dlpack__(self, **kwargs):
        return self._exported.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._exported.__dlpack_device__()

    def detach(self) -> "_ReadOnlyDLPackExport":
        return self

    def numpy(self) -> np.ndarray:
        return self._memory


def test_reads_go_into_memory_whose_dlpack_export_says_read_only(tmp_path) -> None:
    from tensorferry.buffers import byte_view
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * 16)
    target = _ReadOnlyDLPackExport(4096)
    with tensorferry.Engine() as engine:
        engine.pread(target, path, offset=0).result()
    assert target.numpy().tobytes() == path.read_bytes()
    immutable = _ReadOnlyDLPackExport(16)  # a read-only export with no numpy(), as jax arrays
    immutable.numpy = None
    with pytest.raises(ValueError, match="read-only"):
        byte_view(immutable, writable=True)


def test_lazy_negations_and_conjugations_of_torch_are_refused(tmp_path) -> None:
    """A lazy negation's memory holds the values unnegated, and DLPack does not carry the
    bit: swap_out(torch._neg_view(t)) stored the values with the wrong sign. Every write
    and read path takes its bytes through byte_view, which refuses such a tensor."""
    torch = pytest.importorskip("torch")
    from tensorferry.buffers import byte_view
    values = torch.tensor([1.0, 2.0, 3.0])
    lazy = [torch._neg_view(values), torch._neg_view(values.to(torch.bfloat16)),
            torch.tensor([1 + 2j, 3 - 4j]).conj(), torch.tensor([1 + 2j]).conj().imag]
    for tensor in lazy:
        assert tensor.is_neg() or tensor.is_conj()
        for writable in (False, True):
            with pytest.raises(ValueError, match=r"resolve_neg\(\) / resolve_conj\(\)"):
                byte_view(tensor, writable=writable)
    with tensorferry.OffloadStore(tmp_path) as store:
        with pytest.raises(ValueError, match="lazy negation"):
            store.swap_out("k", torch._neg_view(values))
        assert "k" not in store
        store.swap_out("k", torch._neg_view(values).resolve_neg()).result()
        with pytest.raises(ValueError, match="lazy negation"):
            store.swap_in("k", torch._neg_view(torch.zeros(3)))
        back = torch.zeros(3)
        store.swap_in("k", back).result()
    assert torch.equal(back, -values)
