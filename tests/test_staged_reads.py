"""Reads into caller memory that O_DIRECT cannot fill (a torch tensor's, 64 bytes past a
page): staged through pooled buffers in large pieces, hashed, copied, corruption caught."""

from __future__ import annotations

import numpy as np
import pytest

from tensorferry import CorruptCheckpointError, ShardReader, ShardWriter
from tensorferry.shard import ALIGNMENT, _pool, _ReadAhead, _StagedReads

# Odd sizes, so that tensors start at every phase of a page in the file.
SIZES = [1, 3000, 4096, 4097, 65_536 + 77, 300_001, 1 << 20, 0, 2_500_000]


def at_phase(nbytes: int, phase: int) -> np.ndarray:
    """A writable uint8 array whose address is ``phase`` bytes past a page boundary."""
    base = np.empty(nbytes + 2 * ALIGNMENT, np.uint8)
    start = (phase - base.ctypes.data) % ALIGNMENT
    return base[start:start + nbytes]


@pytest.fixture
def stored(tmp_path) -> tuple[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    arrays = {f"t{i}": rng.integers(0, 256, size=n, dtype=np.uint8) for i, n in enumerate(SIZES)}
    path = str(tmp_path / "s.safetensors")
    with ShardWriter(path) as w:
        for name, a in arrays.items():
            w.add(name, a)
    return path, arrays


@pytest.mark.parametrize("piece", [ALIGNMENT, 64 << 10, _StagedReads.PIECE])
@pytest.mark.parametrize("phase", [64, 1, 513])
def test_misaligned_destinations_get_every_byte(stored, monkeypatch, piece: int, phase: int) -> None:
    # Small pieces split large tensors over several pieces and several slots' turns.
    monkeypatch.setattr(_StagedReads, "PIECE", piece)
    path, arrays = stored
    out = {name: at_phase(a.nbytes, phase) for name, a in arrays.items()}
    with ShardReader(path) as r:
        assert r._file.direct  # else nothing is staged: buffered reads go straight in
        assert not any(r._direct_into(v, r.data_start + r.info(n).begin) for n, v in out.items() if v.nbytes > 4096)
        got = r.read_many([], out)
    for name, a in arrays.items():
        assert got[name] is out[name]
        np.testing.assert_array_equal(out[name], a)


def test_aligned_and_misaligned_destinations_together(stored) -> None:
    path, arrays = stored
    with ShardReader(path) as r:
        phases = {name: (r.data_start + r.info(name).begin) % ALIGNMENT for name in arrays}
        out = {name: at_phase(a.nbytes, phases[name] if i % 2 else phases[name] + 64)
               for i, (name, a) in enumerate(arrays.items())}
        r.read_many(["t0"], out)
    for name, a in arrays.items():
        np.testing.assert_array_equal(out[name], a)


@pytest.mark.parametrize("piece", [ALIGNMENT, _StagedReads.PIECE])
@pytest.mark.parametrize("victim", ["t2", "t8"])  # within one piece; over several
def test_corrupt_byte_in_a_staged_read_is_caught(stored, monkeypatch, piece: int, victim: str) -> None:
    monkeypatch.setattr(_StagedReads, "PIECE", piece)
    path, arrays = stored
    with ShardReader(path) as r:
        at = r.data_start + r.info(victim).begin + r.info(victim).nbytes - 1
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = {name: at_phase(a.nbytes, 64) for name, a in arrays.items()}
    with ShardReader(path) as r, pytest.raises(CorruptCheckpointError, match=f"tensor '{victim}'"):
        r.read_many([], out)
    with ShardReader(path, verify=False) as r:  # without verification the bytes come as stored
        r.read_many([], out)
    assert out[victim][-1] == byte[0] ^ 0xFF


def test_small_read_buffers_share_slabs_at_the_right_phase(stored) -> None:
    path, arrays = stored
    with ShardReader(path) as r:
        taken = []
        for _ in range(40):  # more than one slab's worth
            for name, a in arrays.items():
                if 0 < a.nbytes < 1 << 20:
                    buffer = r.buffer_for(name, 0, a.nbytes)
                    assert buffer.ctypes.data % ALIGNMENT == (r.data_start + r.info(name).begin) % ALIGNMENT
                    taken.append((buffer.ctypes.data, buffer.nbytes))
        spans = sorted(taken)
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # no two overlap
        assert len({id(b.base) for b in [r.buffer_for("t1", 0, 3000) for _ in range(3)]}) == 1
        boxes = {name: r.read_box(name, [0], [a.size]).result() for name, a in arrays.items()}
    for name, a in arrays.items():
        np.testing.assert_array_equal(boxes[name], a)


@pytest.mark.parametrize("nbytes", [0, 1, 15, 16, 63, 64, 65, 4096 + 77, 300_001])
@pytest.mark.parametrize("dest_phase", [0, 1, 15, 64])
def test_copy_out_copies_every_byte_at_any_alignment(nbytes: int, dest_phase: int) -> None:
    from tensorferry.shard import _copy_out
    source = np.random.default_rng(nbytes).integers(0, 256, size=nbytes + 3, dtype=np.uint8)[3:]
    canvas = np.full(nbytes + 3 * ALIGNMENT, 0xAB, np.uint8)
    start = ALIGNMENT + (dest_phase - canvas.ctypes.data) % ALIGNMENT  # guard bytes on both sides
    _copy_out(canvas[start:start + nbytes], source)
    np.testing.assert_array_equal(canvas[start:start + nbytes], source)
    assert (canvas[:start] == 0xAB).all() and (canvas[start + nbytes:] == 0xAB).all()
    with pytest.raises(ValueError, match="bytes into"):
        _copy_out(canvas[:nbytes + 1], source)


def _copied_bytes(monkeypatch) -> list[int]:
    """Counts the bytes the writer copies through its ring (the rest goes from the
    arrays' own memory)."""
    from tensorferry import shard
    copied = [0]
    original = shard._copy_out

    def counting(dest, source) -> None:
        copied[0] += np.asarray(source).nbytes
        original(dest, source)

    monkeypatch.setattr(shard, "_copy_out", counting)
    return copied


def test_only_page_aligned_large_arrays_are_written_from_their_own_memory(tmp_path, monkeypatch) -> None:
    # Page-aligned memory goes to the drive as it is. Memory at the device's DMA alignment
    # (512 bytes on most disks) would pass O_DIRECT too, but writes from it were slower
    # and dearer than the ring's copy on the disk measured, so it is copied, as is a
    # torch tensor's 64 bytes past a page.
    from tensorferry import File, config_override
    path = str(tmp_path / "s.safetensors")
    with File(path, "w") as probe:
        if not probe.direct:
            pytest.skip("needs O_DIRECT here")
    rng = np.random.default_rng(3)
    nbytes = 4 << 20
    for phase, copied_expected in ((0, False), (512, True), (64, True)):
        source = at_phase(nbytes, phase)
        source[:] = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        copied = _copied_bytes(monkeypatch)
        with ShardWriter(path, buffer_size=1 << 20) as w:
            w.add("big", source)
        assert (copied[0] >= nbytes) == copied_expected, (phase, copied[0])
        with ShardReader(path) as r:
            np.testing.assert_array_equal(r.read("big"), source)
    # Without O_DIRECT the kernel copies whatever it is given: no copy of ours before.
    copied = _copied_bytes(monkeypatch)
    with config_override(direct=False), ShardWriter(path, buffer_size=1 << 20) as w:
        w.add("big", source)
    assert copied[0] == 0
    with ShardReader(path) as r:
        np.testing.assert_array_equal(r.read("big"), source)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("phase", [0, 1, 64, 512, 4096 - 100, 1000])
def test_large_arrays_after_an_odd_sized_one_are_written_intact(tmp_path, phase: int, direct: bool) -> None:
    # The large array starts at a file offset off every alignment: whether it goes from its
    # own memory (part buffered, part O_DIRECT; or all buffered, without O_DIRECT) or
    # through the ring, every byte lands.
    from tensorferry import config_override
    rng = np.random.default_rng(phase)
    small = rng.integers(0, 256, size=4096 + 100, dtype=np.uint8)
    big = at_phase(3 << 20, phase)
    big[:] = rng.integers(0, 256, size=big.nbytes, dtype=np.uint8)
    path = str(tmp_path / "s.safetensors")
    with config_override(direct=direct), ShardWriter(path, buffer_size=1 << 20) as w:
        w.add("small", small)
        w.add("big", big)
    with ShardReader(path) as r:
        got = r.read_many()
    np.testing.assert_array_equal(got["small"], small)
    np.testing.assert_array_equal(got["big"], big)


def _leases() -> int:
    return len(_pool._leased)


@pytest.mark.parametrize("piece", [ALIGNMENT, 64 << 10, _ReadAhead.PIECE])
@pytest.mark.parametrize("ahead", [1, 300_000, 1 << 30])
@pytest.mark.parametrize("phase", [64, 0])
def test_tensors_read_ahead_get_every_byte(stored, monkeypatch, piece: int, ahead: int, phase: int) -> None:
    """A read started before its destinations are known (a DCP load's, while torch plans):
    the tensors lying wholly in it come from its buffers, across the ends of its pieces,
    into aligned and misaligned memory alike; the rest are read as before."""
    monkeypatch.setattr(_ReadAhead, "PIECE", piece)
    path, arrays = stored
    leases = _leases()
    with ShardReader(path) as r:
        r.read_ahead(ahead)
        ends = {n: r.data_start + r.info(n).end for n in arrays}
        phases = {n: (r.data_start + r.info(n).begin + phase) % ALIGNMENT for n in arrays}
        out = {name: at_phase(a.nbytes, phases[name]) for name, a in arrays.items()}
        covered = {n for n in arrays if r._ahead.covers(ends[n] - arrays[n].nbytes, ends[n])}
        assert covered == {n for n in arrays if arrays[n].nbytes and ends[n] <= r.data_start + ahead}
        got = r.read_many([], out)
        assert r._ahead is None  # taken by the read, its buffers given back
    for name, a in arrays.items():
        assert got[name] is out[name]
        np.testing.assert_array_equal(out[name], a)
    assert _leases() == leases


def test_damage_in_what_was_read_ahead_is_caught(stored, monkeypatch) -> None:
    monkeypatch.setattr(_ReadAhead, "PIECE", 64 << 10)
    path, arrays = stored
    with ShardReader(path) as r:
        at = r.data_start + r.info("t5").begin + 1000
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    leases = _leases()
    with ShardReader(path) as r:
        r.read_ahead(1 << 30)
        with pytest.raises(CorruptCheckpointError, match="'t5'"):
            r.read_many([], {name: at_phase(a.nbytes, 64) for name, a in arrays.items()})
    assert _leases() == leases


def test_what_no_read_takes_is_given_back(stored) -> None:
    """Read ahead for a plan that wants little of it, or nothing: the pieces it needs
    nothing from are cancelled, and every buffer goes back to the pool."""
    path, arrays = stored
    leases = _leases()
    with ShardReader(path) as r:
        r.read_ahead(1 << 30)
        out = {"t8": at_phase(arrays["t8"].nbytes, 64)}
        r.read_many(["t1"], out)  # t1 into new memory: not from the read-ahead
        np.testing.assert_array_equal(out["t8"], arrays["t8"])
    with ShardReader(path) as r:
        r.read_ahead(1 << 30)  # and never read
    assert _leases() == leases


@pytest.mark.parametrize("into", ["new memory", "out"])
def test_whole_boxes_come_from_what_was_read_ahead(stored, into: str) -> None:
    """A box read of a whole tensor (a DCP load's into a CUDA target, through pinned
    memory, or into another dtype) is copied from the read-ahead, verified, not read
    again: the file rewritten after the read-ahead landed does not show."""
    path, arrays = stored
    leases = _leases()
    with ShardReader(path) as r:
        r.read_ahead(1 << 30)
        for number in range(len(r._ahead._pieces)):
            r._ahead.piece(number)[0].result()
        with open(path, "r+b") as f:  # same size and header, other data
            f.seek(r.data_start)
            f.write(bytes(r.size - r.data_start))
        for name, a in arrays.items():
            out = None if into == "new memory" else at_phase(a.nbytes, 64)
            box = r.read_box(name, [0], [a.nbytes], out=out).result()
            assert out is None or box is out
            np.testing.assert_array_equal(box, a)
        r.end_read_ahead()
        assert r._ahead is None
    assert _leases() == leases


def test_an_interrupted_read_ahead_gives_its_buffers_back(stored, monkeypatch) -> None:
    from tensorferry.engine import Engine
    path, _ = stored
    monkeypatch.setattr(_ReadAhead, "PIECE", ALIGNMENT)
    pread, calls = Engine.pread, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return pread(self, *args, **kwargs)

    leases = _leases()
    with ShardReader(path) as r:
        monkeypatch.setattr(Engine, "pread", interrupted)
        with pytest.raises(KeyboardInterrupt):
            r.read_ahead(1 << 20)
    assert _leases() == leases
