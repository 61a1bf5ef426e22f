"""Hostile and damaged input: names that lead out of a checkpoint, files that are not
files, malformed manifests and headers. Every outcome is the data or a typed error."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from typing import Any

import numpy as np
import pytest

import tensorferry
from tensorferry.errors import CorruptCheckpointError, TensorferryError
from tensorferry.schema import check_name, member_path, parse_json, read_small_file
from tensorferry.temporaries import temporary_name, wait_for_discards


@pytest.fixture
def checkpoint(tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    tensorferry.save_checkpoint(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                                       "b": np.ones(4, np.int64)}, {"step": 3})
    return path


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "..", ".", "", "x\0y", "n" * 256, 7, None])
def test_member_path_refuses_names_that_are_not_plain(tmp_path, name) -> None:
    with pytest.raises(CorruptCheckpointError, match=str(tmp_path)):
        member_path(tmp_path, name)
    with pytest.raises(CorruptCheckpointError):
        check_name("where", name)


def test_member_path_refuses_a_link_leading_out(tmp_path) -> None:
    inside = tmp_path / "ckpt"
    inside.mkdir()
    (tmp_path / "outside").write_bytes(b"secret")
    (inside / "shard").symlink_to(tmp_path / "outside")
    (inside / "real").write_bytes(b"x")
    (inside / "alias").symlink_to("real")
    with pytest.raises(CorruptCheckpointError, match="leading out"):
        member_path(inside, "shard")
    assert member_path(inside, "alias") == inside / "alias"
    assert member_path(inside, "n" * 255) == inside / ("n" * 255)


def test_read_small_file_opens_only_regular_files_of_bounded_size(tmp_path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CorruptCheckpointError, match="FIFO"):
        read_small_file(fifo)  # returns at once: the open does not wait for a writer
    with pytest.raises(CorruptCheckpointError, match="character device"):
        read_small_file("/dev/zero")
    with pytest.raises(CorruptCheckpointError, match="directory"):
        read_small_file(tmp_path)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 100)
    with pytest.raises(CorruptCheckpointError, match="100 bytes"):
        read_small_file(big, limit=99)
    assert read_small_file(big, limit=100) == b"x" * 100
    with pytest.raises(FileNotFoundError):
        read_small_file(tmp_path / "missing")


def test_parse_json_types_every_failure(tmp_path) -> None:
    for bad in [b"[" * 100_000 + b"]" * 100_000, b"{", b"\xff\xfe", b""]:
        with pytest.raises(CorruptCheckpointError, match="manifest"):
            parse_json(bad, "manifest", tmp_path / "m")
    assert parse_json(b'{"a": [1]}', "manifest", "m") == {"a": [1]}


def _edit_manifest(directory: str, edit) -> None:
    """Changes a manifest as a hostile writer would: the result is well-formed, with
    its checksum (if the format has one) made anew."""
    from tensorferry.checkpoint import MANIFEST, seal_manifest, unseal_manifest
    path = os.path.join(directory, MANIFEST)
    with open(path, "rb") as f:
        manifest = json.loads(unseal_manifest(f.read()))
    edit(manifest)
    with open(path, "wb") as f:
        f.write(seal_manifest(json.dumps(manifest, separators=(",", ":")).encode()))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/abs/outside.safetensors", "sub/x"])
def test_a_manifest_naming_a_file_outside_is_refused(checkpoint, tmp_path, name) -> None:
    outside = tmp_path / "outside.safetensors"
    with tensorferry.ShardWriter(outside) as w:
        w.add("a", np.zeros((2, 3), np.float32))

    def point_outside(manifest):
        (old,) = manifest["files"]
        manifest["files"][name] = manifest["files"].pop(old)
        for entry in manifest["tensors"].values():
            entry["file"] = name

    _edit_manifest(checkpoint, point_outside)
    with pytest.raises(CorruptCheckpointError, match="plain file"):
        tensorferry.load_checkpoint(checkpoint)
    with pytest.raises(CorruptCheckpointError, match="plain file"):
        tensorferry.verify_checkpoint(checkpoint)


def test_a_shard_linked_outside_is_refused(checkpoint, tmp_path) -> None:
    (shard,) = [n for n in os.listdir(checkpoint) if n.endswith(".safetensors")]
    moved = tmp_path / "moved.safetensors"
    os.rename(os.path.join(checkpoint, shard), moved)
    os.symlink(moved, os.path.join(checkpoint, shard))
    with pytest.raises(CorruptCheckpointError, match="leading out"):
        tensorferry.load_checkpoint(checkpoint)
    assert any("leading out" in p for p in tensorferry.verify_checkpoint(checkpoint))


def test_a_fifo_in_place_of_a_shard_or_manifest_fails_at_once(checkpoint) -> None:
    (shard,) = [n for n in os.listdir(checkpoint) if n.endswith(".safetensors")]
    os.unlink(os.path.join(checkpoint, shard))
    os.mkfifo(os.path.join(checkpoint, shard))
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            tensorferry.load_checkpoint(checkpoint)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "a FIFO in place of a shard hangs the load"
    assert isinstance(outcome[0], TensorferryError), outcome
    os.unlink(os.path.join(checkpoint, tensorferry.checkpoint.MANIFEST))
    os.mkfifo(os.path.join(checkpoint, tensorferry.checkpoint.MANIFEST))
    with pytest.raises(CorruptCheckpointError, match="FIFO"):
        tensorferry.read_manifest(checkpoint)


def test_a_manifest_linked_to_dev_zero_is_refused(checkpoint) -> None:
    manifest = os.path.join(checkpoint, tensorferry.checkpoint.MANIFEST)
    os.unlink(manifest)
    os.symlink("/dev/zero", manifest)
    with pytest.raises(CorruptCheckpointError, match="character device"):
        tensorferry.load_checkpoint(checkpoint)


def test_any_flipped_byte_of_a_manifest_is_detected(checkpoint) -> None:
    path = os.path.join(checkpoint, tensorferry.checkpoint.MANIFEST)
    with open(path, "rb") as f:
        original = f.read()
    for at in range(0, len(original), 7):
        damaged = bytearray(original)
        damaged[at] ^= 0x04
        with open(path, "wb") as f:
            f.write(damaged)
        with pytest.raises(CorruptCheckpointError):
            tensorferry.read_manifest(checkpoint)
    with open(path, "wb") as f:
        f.write(original)
    assert tensorferry.verify_checkpoint(checkpoint) == []


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["files"][next(iter(m["files"]))].update(size=str(m["files"][next(iter(m["files"]))]["size"])),
     "integer size"),
    (lambda m: m["files"].update({"x": 5}), "integer size"),
    (lambda m: m.update(files=[]), "files"),
    (lambda m: m.update(tensors={"a": []}), "not an object"),
    (lambda m: m["tensors"]["a"].update(shape=[1] * 65), "invalid shape"),
    (lambda m: m["tensors"]["a"].update(file="elsewhere"), "does not list"),
    (lambda m: m["tensors"]["a"].update(dtype="I32"), "disagree"),
    (lambda m: m["tensors"].update(c=dict(m["tensors"]["a"])), "does not hold"),
    (lambda m: m["tensors"].pop("b"), "does not list"),
    (lambda m: m.update(format_version="2"), "format_version"),
    (lambda m: m.update(metadata=[1]), "metadata"),
])
def test_a_malformed_manifest_is_refused_by_load_and_verify_alike(checkpoint, edit, message) -> None:
    _edit_manifest(checkpoint, edit)
    with pytest.raises(CorruptCheckpointError, match=message):
        tensorferry.load_checkpoint(checkpoint)
        problems = tensorferry.verify_checkpoint(checkpoint)
        raise CorruptCheckpointError("; ".join(problems))
    try:
        problems = tensorferry.verify_checkpoint(checkpoint)
    except CorruptCheckpointError as exc:
        problems = [str(exc)]
    assert problems and message in " ".join(problems)


torch = pytest.importorskip("torch")


def _rewrite_header(path: str, edit) -> None:
    """Edits a file's header JSON in place (same length), as damage would."""
    with open(path, "r+b") as f:
        (n,) = np.frombuffer(f.read(8), "<u8")
        header = f.read(int(n))
        changed = edit(header)
        assert len(changed) == len(header)
        f.seek(8)
        f.write(changed)


def test_a_single_file_header_is_covered_by_its_checksum(tmp_path) -> None:
    from tensorferry.adapters.pytorch import load, save
    path = str(tmp_path / "state.tf")
    save({"w": torch.tensor([1.0, 2.0]), "step": 5}, path)
    assert load(path)["step"] == 5
    cases = [lambda h: h.replace(b'"F32"', b'"I32"'),  # the flipped byte of issue 25: wrong data, silently
             lambda h: h.replace(b"tensorferry.structure", b"tensorferry.structurf"),
             lambda h: h.replace(b"tensorferry.checksums", b"tensorferry_checksums"),
             lambda h: h.replace(b"tensorferry.header_checksum", b"tensorferry_header_checksum"),
             lambda h: h[:-1] + b"x"]  # the padding
    with open(path, "rb") as f:
        original = f.read()
    for edit in cases:
        _rewrite_header(path, edit)
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            load(path)
        with open(path, "wb") as f:
            f.write(original)


def test_a_rewritten_files_header_is_damaged_unless_it_is_whole(tmp_path) -> None:
    """A file another tool rewrote with our keys carried over loads (test_pytorch); such a
    header is another writer's only while it is whole: one damaged since (a shape that
    no longer fits its offsets, a length prefix or file size changed) is still damaged."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tensorferry.adapters.pytorch import load, save
    path = str(tmp_path / "state.safetensors")
    save({"w": torch.ones(4, 4), "b": torch.ones(4)}, path)
    with safe_open(path, "pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys()}, path, metadata=f.metadata())
    with open(path, "rb") as f:
        original = f.read()
    with pytest.warns(tensorferry.RewrittenFileWarning):
        assert load(path)["w"].shape == (4, 4)
    (n,) = struct.unpack("<Q", original[:8])
    padding = n - len(original[8:8 + n].rstrip(b" "))  # a length short by it still holds the whole JSON
    assert padding > 0
    damaged = [original.replace(b'"shape":[4,4]', b'"shape":[4,5]'), original + b"\0" * 8,
               struct.pack("<Q", n - padding) + original[8:], struct.pack("<Q", n + 8) + original[8:]]
    for raw in damaged:
        with open(path, "wb") as f:
            f.write(raw)
        with pytest.raises(CorruptCheckpointError, match="does not match its checksum: it is damaged"):
            load(path)


def test_a_plain_safetensors_file_still_loads(tmp_path) -> None:
    from safetensors.torch import save_file

    from tensorferry.adapters.pytorch import load
    save_file({"w": torch.arange(3.0)}, str(tmp_path / "plain.safetensors"))
    assert torch.equal(load(tmp_path / "plain.safetensors")["w"], torch.arange(3.0))


def test_structure_depth_is_bounded_on_save_and_load(tmp_path) -> None:
    from tensorferry.adapters.pytorch import load, save
    from tensorferry.schema import MAX_STRUCTURE_DEPTH

    def nested(levels: int) -> dict:
        obj: dict = {"leaf": torch.ones(1)}
        for _ in range(levels - 2):
            obj = {"x": obj}
        return obj

    path = str(tmp_path / "deep.tf")
    save(nested(MAX_STRUCTURE_DEPTH), path)
    out = load(path)
    for _ in range(MAX_STRUCTURE_DEPTH - 2):
        out = out["x"]
    assert torch.equal(out["leaf"], torch.ones(1))
    with pytest.raises(ValueError, match="nests more than"):
        save(nested(MAX_STRUCTURE_DEPTH + 1), path)


# --- the overwrite protocol, killed at each of its steps -----------------------------

_KILL_AT_STEP = r"""
import os, shutil, sys
import numpy as np
import tensorferry
from tensorferry import checkpoint

root, step, atomic, target = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "exchange", sys.argv[4]
done = 0

def dies_after(fn):
    def step_then_maybe_die(*args, **kwargs):
        global done
        result = fn(*args, **kwargs)
        done += 1
        if done == step:
            os._exit(9)
        return result
    return step_then_maybe_die

if not atomic:
    checkpoint.exchange = lambda a, b: False  # as on a filesystem without RENAME_EXCHANGE
for name in ("write_durably", "fsync_dir", "exchange", "fsync_after_commit"):
    setattr(checkpoint, name, dies_after(getattr(checkpoint, name)))
os.rename = dies_after(os.rename)
shutil.rmtree = dies_after(shutil.rmtree)
tensorferry.save_checkpoint(os.path.join(root, target), {"x": np.full(1000, 2.0)}, overwrite=True)
"""

# An overwrite without RENAME_EXCHANGE that stops before and between its two renames, each
# time until the test writes a line: "ready" before, "between" once the old checkpoint is aside.
_PAUSED_BETWEEN_RENAMES = r"""
import os, sys
import numpy as np
import tensorferry
from tensorferry import checkpoint

checkpoint.exchange = lambda a, b: False  # as on a filesystem without RENAME_EXCHANGE
real_rename = os.rename

def paused_around_the_first(source, target, *args, **kwargs):
    if checkpoint.OLD_TAIL not in os.fspath(target):
        return real_rename(source, target, *args, **kwargs)
    print("ready", flush=True)
    sys.stdin.readline()
    real_rename(source, target, *args, **kwargs)
    print("between", os.fspath(target), flush=True)
    sys.stdin.readline()

os.rename = paused_around_the_first
tensorferry.save_checkpoint(sys.argv[1], {"x": np.full(1000, 2.0)}, overwrite=True)
"""


def _paused_overwrite(path: str) -> Any:
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", _PAUSED_BETWEEN_RENAMES, path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    return child


def test_a_clean_up_during_an_overwrite_killed_between_its_renames_keeps_the_old_checkpoint(
        tmp_path, monkeypatch) -> None:
    """The clean-up listed what to keep (nothing: step_1 was in place), then the overwrite set
    step_1 aside, unheld, and was killed before its second rename; the clean-up's scan then
    found step_1.tmp-old-* unheld and removed it: both copies of step_1 were lost."""
    from tensorferry import checkpoint as module
    from tensorferry.temporaries import stale_temporaries
    path = str(tmp_path / "step_1")
    tensorferry.save_checkpoint(path, {"x": np.full(1000, 1.0)})
    child = _paused_overwrite(path)
    real_recoverable = module.recoverable_checkpoints
    aside = []

    def overwrite_set_aside_then_killed(root):
        found = real_recoverable(root)
        if not aside:
            child.stdin.write("go\n")
            child.stdin.flush()
            word, aside_path = child.stdout.readline().split()
            assert word == "between"
            aside.append(aside_path)
            assert aside_path not in stale_temporaries(tmp_path), "the writer holds the old checkpoint set aside"
            child.kill()
            child.wait()
        return found

    monkeypatch.setattr(module, "recoverable_checkpoints", overwrite_set_aside_then_killed)
    module.remove_leftovers(tmp_path)  # as prune_checkpoints(remove_unfinished=True) and tensorferry clean do
    monkeypatch.undo()
    assert aside and os.path.isdir(aside[0]), "the old checkpoint was removed as a leftover"
    assert (tensorferry.load_checkpoint(path)["x"] == 1.0).all()


@pytest.mark.parametrize("rename", ["first", "second"])
def test_a_load_during_an_overwrite_without_exchange_reads_one_checkpoint_whole(
        tmp_path, monkeypatch, rename) -> None:
    """The overwrite's first rename (step_1 set aside) or its second (the new one in place, the
    old one removed) lands between the load's reading of the manifest and of the files: the
    load failed, naming step_1's files missing or step_1.tmp-old-* an unfinished checkpoint."""
    from tensorferry import checkpoint as module
    path = str(tmp_path / "step_1")
    tensorferry.save_checkpoint(path, {"x": np.full(1000, 1.0)})
    child = _paused_overwrite(path)

    def next_rename() -> None:
        child.stdin.write("go\n")
        child.stdin.flush()

    if rename == "second":
        next_rename()
        assert child.stdout.readline().startswith("between ")
    real_open_shard = module.open_shard
    renamed = []

    def renamed_first(*args, **kwargs):
        if not renamed:
            renamed.append(rename)
            next_rename()
            if rename == "first":
                assert child.stdout.readline().startswith("between ")
            else:
                assert child.wait() == 0
        return real_open_shard(*args, **kwargs)

    monkeypatch.setattr(module, "open_shard", renamed_first)
    try:
        loaded = tensorferry.load_checkpoint(path)["x"]
    finally:
        if child.poll() is None:
            next_rename()
        assert child.wait() == 0
    assert (loaded == (1.0 if rename == "first" else 2.0)).all()


# Names near NAME_MAX (255 bytes): their temporaries are named after their first bytes (cut
# inside a character here, at one's end in the second) and a hash of them.
_LONG_NAMES = ["step_1-" + "\u00e9" * 120, "step_1-" + "x" * 240]


@pytest.mark.parametrize("name", ["step_1", *_LONG_NAMES])
@pytest.mark.parametrize("protocol", ["exchange", "two renames"])
def test_an_overwrite_killed_at_any_step_leaves_a_complete_checkpoint(tmp_path, protocol, name) -> None:
    import subprocess
    import sys
    root = str(tmp_path)
    for step in range(1, 12):
        shutil_rm = [os.path.join(root, n) for n in os.listdir(root)]
        for path in shutil_rm:
            __import__("shutil").rmtree(path)
        tensorferry.save_checkpoint(os.path.join(root, name), {"x": np.full(1000, 1.0)})
        run = subprocess.run([sys.executable, "-c", _KILL_AT_STEP, root, str(step), protocol, name],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode in (0, 9), run.stderr
        latest = tensorferry.latest_checkpoint(root)
        assert latest is not None, f"killed after step {step}: no checkpoint found"
        value = tensorferry.load_checkpoint(os.path.join(root, name))["x"]
        assert value.shape == (1000,) and len(set(value.tolist())) == 1 and value[0] in (1.0, 2.0)
        assert tensorferry.verify_checkpoint(latest) == []
        tensorferry.prune_checkpoints(root, keep_last=1, remove_unfinished=True)
        again = tensorferry.load_checkpoint(tensorferry.latest_checkpoint(root))["x"]
        assert np.array_equal(again, value), f"killed after step {step}: pruning lost the checkpoint"
        tensorferry.save_checkpoint(os.path.join(root, name), {"x": np.full(1000, 3.0)}, overwrite=True)
        wait_for_discards()  # the replaced checkpoint is removed in the background
        assert os.listdir(root) == [name], f"killed after step {step}: leftovers {os.listdir(root)}"
        if run.returncode == 0:
            assert step > 3, "the protocol has at least four steps"
            return
    pytest.fail("the save was killed at every step tried: more steps than expected")


@pytest.mark.parametrize("letter", ["x", "\u00e9"])
def test_long_names_alike_in_their_first_bytes_share_no_temporaries(tmp_path, letter) -> None:
    """Temporaries of a name over 218 bytes were named after its first 218 bytes alone, so
    two such names in one folder shared them. B's overwrite, killed between its renames,
    left B as <first 218 bytes>.tmp-old-<token>: while A stood, B did not load ("no
    checkpoint") and was no checkpoint but a leftover of A's, and the next save to A, or a
    clean, removed it; with A gone, load_checkpoint(A) read B."""
    from tensorferry.checkpoint import OLD_REASON
    from tensorferry.errors import CheckpointNotFoundError
    from tensorferry.temporaries import aside_name
    common = "run-" + letter * (230 // len(letter.encode()))
    a, b, c = (str(tmp_path / f"{common}-{end}") for end in "abc")
    tensorferry.save_checkpoint(a, {"x": np.full(2, 1.0)})
    tensorferry.save_checkpoint(b, {"x": np.full(2, 2.0)})
    os.rename(b, aside_name(b, OLD_REASON))  # B's overwrite without an atomic exchange, killed between its renames
    assert len(tensorferry.list_checkpoints(tmp_path)) == 2
    assert tensorferry.load_checkpoint(b)["x"][0] == 2.0
    with pytest.raises(CheckpointNotFoundError):
        tensorferry.load_checkpoint(c)  # a name never saved
    tensorferry.save_checkpoint(a, {"x": np.full(2, 3.0)}, overwrite=True)
    tensorferry.prune_checkpoints(tmp_path, keep_last=5, remove_unfinished=True)
    wait_for_discards()
    assert tensorferry.load_checkpoint(b)["x"][0] == 2.0, "B's checkpoint went with A's clean-up"
    assert tensorferry.load_checkpoint(a)["x"][0] == 3.0
    os.rename(a, aside_name(a, OLD_REASON))  # A's turn, with B aside too: each is found under its own name
    assert tensorferry.load_checkpoint(a)["x"][0] == 3.0 and tensorferry.load_checkpoint(b)["x"][0] == 2.0
    tensorferry.save_checkpoint(b, {"x": np.full(2, 4.0)}, overwrite=True)
    wait_for_discards()
    assert tensorferry.load_checkpoint(a)["x"][0] == 3.0 and tensorferry.load_checkpoint(b)["x"][0] == 4.0
    assert len(os.listdir(tmp_path)) == 2


def test_temporary_names_of_ordinary_names_are_as_before_and_an_earlier_versions_long_ones_are_leftovers(
        tmp_path) -> None:
    """The hash in a long name's temporaries (above) leaves names of up to 218 bytes as they
    were, and what an earlier version left under a long name's first 218 bytes alone is still
    a temporary: not listed, and removed by a clean once the name holds its checkpoint."""
    from tensorferry.temporaries import NAME_MAX, temporary_stem
    for name in ("step_1", "x" * 218, "\u00e9" * 109):
        assert temporary_stem(name) == name and temporary_name(name, "0123abcd") == f"{name}.tmp-0123abcd"
    for name in ("x" * 219, "x" * 255, "\u00e9" * 127, "y" + "\u00e9" * 127):
        stem = temporary_stem(name)
        assert name.startswith(stem[:100]) and len(os.fsencode(temporary_name(name, "replaced-0123abcd"))) <= NAME_MAX
        assert temporary_stem(name[:-1] + "z") != stem
    name = "run-" + "x" * 240
    tensorferry.save_checkpoint(tmp_path / name, {"x": np.arange(3)})
    earlier = name[:218]
    shutil.copytree(tmp_path / name, tmp_path / f"{earlier}.tmp-0123456789ab")  # a killed save's
    shutil.copytree(tmp_path / name, tmp_path / f"{earlier}.tmp-old-0123abcd")  # an overwrite's, since re-saved
    assert tensorferry.list_checkpoints(tmp_path) == [str(tmp_path / name)]
    assert sorted(tensorferry.prune_checkpoints(tmp_path, keep_last=1, remove_unfinished=True)) == [
        str(tmp_path / f"{earlier}.tmp-0123456789ab"), str(tmp_path / f"{earlier}.tmp-old-0123abcd")]
    assert os.listdir(tmp_path) == [name]


def test_a_pruned_checkpoint_that_an_overwrite_had_left_aside_is_no_checkpoint(tmp_path) -> None:
    """An overwrite interrupted between its two renames leaves step_1 as
    step_1.tmp-old-<token>, the checkpoint still. Pruning it renames it to
    step_1.tmp-old-<token>.tmp-pruned-<token> and frees it in the background; where that
    was killed (or had not finished), the folder was read as step_1 again: listed, loaded,
    kept by clean and remove_unfinished as the checkpoint, and a new save to step_1 refused
    as "moved aside by an interrupted overwrite"."""
    from tensorferry.checkpoint import OLD_TAIL
    from tensorferry.errors import CheckpointNotFoundError
    from tensorferry.temporaries import aside_name

    def left_by_a_killed_prune(name: str) -> str:
        tensorferry.save_checkpoint(tmp_path / name, {"x": np.arange(3)})
        aside = temporary_name(str(tmp_path / name), OLD_TAIL + "0123abcd")
        os.rename(tmp_path / name, aside)  # the overwrite, killed between its renames
        assert tensorferry.list_checkpoints(tmp_path)[0] == aside, "the checkpoint, until pruned"
        pruned = aside_name(aside, "pruned")  # the prune's own rename (remove_checkpoints)
        os.rename(aside, pruned)
        return pruned

    tensorferry.save_checkpoint(tmp_path / "step_2", {"x": np.arange(4)})
    pruned = left_by_a_killed_prune("step_1")
    assert tensorferry.list_checkpoints(tmp_path) == [str(tmp_path / "step_2")]
    for path in (tmp_path / "step_1", pruned):
        with pytest.raises(CheckpointNotFoundError):
            tensorferry.load_checkpoint(path)
    assert tensorferry.prune_checkpoints(tmp_path, keep_last=5, remove_unfinished=True) == [pruned]
    pruned = left_by_a_killed_prune("step_1")
    tensorferry.save_checkpoint(tmp_path / "step_1", {"x": np.arange(5)})  # removes it, as any leftover of step_1
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]
    assert np.array_equal(tensorferry.load_checkpoint(tmp_path / "step_1")["x"], np.arange(5))


def test_a_damaged_sibling_is_skipped_with_a_warning(tmp_path) -> None:
    from tensorferry.errors import CheckpointSkippedWarning
    for step in (1, 2):
        tensorferry.save_checkpoint(tmp_path / f"step_{step}", {"x": np.arange(3)})
    with open(tmp_path / "step_2" / tensorferry.checkpoint.MANIFEST, "r+b") as f:
        f.write(b"[")
    with pytest.warns(CheckpointSkippedWarning, match="step_2"):
        assert tensorferry.latest_checkpoint(tmp_path) == str(tmp_path / "step_1")


def test_stale_temporaries_go_and_live_ones_stay(tmp_path) -> None:
    from tensorferry.adapters.pytorch import save
    from tensorferry.temporaries import hold, release
    target = tmp_path / "model.tf"
    stale = tmp_path / "model.tf.tmp-0000dead"
    stale.write_bytes(b"x" * 4096)  # what a killed save leaves: nobody holds it
    live = tmp_path / "model.tf.tmp-0000beef"
    live.write_bytes(b"y")
    lock = hold(str(live))  # as a save in progress holds its temporary
    other = tmp_path / "other.tf.tmp-0000dead"
    other.write_bytes(b"z")
    try:
        save({"w": torch.ones(2)}, target)
        assert not stale.exists() and live.exists() and other.exists()
        stale_dir = tmp_path / "step_5.tmp-0123456789ab"
        stale_dir.mkdir()
        (stale_dir / "shard-00000.safetensors").write_bytes(b"partial")
        tensorferry.save_checkpoint(tmp_path / "step_6", {"x": np.arange(3)})
        assert stale_dir.exists()  # another target's: left to prune
        tensorferry.save_checkpoint(tmp_path / "step_5", {"x": np.arange(3)})
        assert not stale_dir.exists()
        removed = tensorferry.prune_checkpoints(tmp_path, keep_last=2, remove_unfinished=True)
        assert removed == [str(other)] and live.exists()
    finally:
        release(lock)
    assert tensorferry.prune_checkpoints(tmp_path, keep_last=2, remove_unfinished=True) == [str(live)]


def test_names_near_name_max_save_overwrite_and_clean_up(tmp_path) -> None:
    from tensorferry.adapters.pytorch import load, save
    name = "model-" + "\u00e9" * 120 + ".pt"  # 249 bytes: torch.save writes it
    assert len(os.fsencode(name)) == 249
    target = tmp_path / name
    for value in (1.0, 2.0):  # the second replaces the first: its old name is set aside
        save({"w": torch.full((3,), value)}, target)
        wait_for_discards()
        assert os.listdir(tmp_path) == [name] and torch.equal(load(target)["w"], torch.full((3,), value))
    stale = temporary_name(str(target), "0000dead")  # what a killed save left
    assert len(os.fsencode(os.path.basename(stale))) <= 255
    open(stale, "wb").close()
    save({"w": torch.ones(3)}, target)
    wait_for_discards()
    assert os.listdir(tmp_path) == [name], "the next save removes what the killed one left"
    folder = tmp_path / ("step_7-" + "x" * 245)
    for _ in range(2):
        tensorferry.save_checkpoint(folder, {"x": np.arange(3)}, overwrite=True)
        wait_for_discards()
    assert sorted(os.listdir(tmp_path)) == sorted([name, folder.name])
    assert np.array_equal(tensorferry.load_checkpoint(folder)["x"], np.arange(3))


def test_a_failed_parent_fsync_after_commit_warns(tmp_path, monkeypatch) -> None:
    from tensorferry import shard
    from tensorferry.errors import DurabilityWarning, TensorferryIOError

    def failing_fsync(path: str) -> None:
        raise TensorferryIOError(5, "fsync of the directory failed", path)

    monkeypatch.setattr(shard, "fsync_dir", failing_fsync)
    with pytest.warns(DurabilityWarning, match="committed"):
        path = tensorferry.save_checkpoint(tmp_path / "c", {"x": np.arange(3)})
    assert tensorferry.verify_checkpoint(path) == []
    with pytest.raises(TensorferryIOError) as info:
        failing_fsync(str(tmp_path))
    assert info.value.filename == str(tmp_path)


def test_exchange_swaps_two_directories_in_one_step(tmp_path) -> None:
    from tensorferry.checkpoint import exchange
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "from_a").write_bytes(b"")
    (tmp_path / "b").mkdir()
    assert exchange(str(tmp_path / "a"), str(tmp_path / "b")), "ext4 and tmpfs have RENAME_EXCHANGE"
    assert os.listdir(tmp_path / "b") == ["from_a"] and os.listdir(tmp_path / "a") == []
    with pytest.raises(FileNotFoundError) as raised:
        exchange(str(tmp_path / "a"), str(tmp_path / "missing"))
    assert raised.value.filename == str(tmp_path / "missing"), "the error names the path that is not there"


@pytest.mark.parametrize("protocol", ["exchange", "two renames"])
def test_an_overwrite_whose_target_is_pruned_meanwhile_commits_into_the_free_name(
        tmp_path, monkeypatch, protocol) -> None:
    """step_1 was pruned between the commit's check and the exchange: the save failed with a
    FileNotFoundError naming its own temporary, which existed, and removed its complete checkpoint."""
    from tensorferry import checkpoint as module
    for step in (1, 2):
        tensorferry.save_checkpoint(tmp_path / f"step_{step}", {"x": np.full(100, float(step))})
    real_exchange = module.exchange

    def pruned_first(a: str, b: str) -> bool:
        assert tensorferry.prune_checkpoints(tmp_path, keep_last=1) == [str(tmp_path / "step_1")]
        return real_exchange(a, b) if protocol == "exchange" else False

    monkeypatch.setattr(module, "exchange", pruned_first)
    tensorferry.save_checkpoint(tmp_path / "step_1", {"x": np.full(100, 3.0)}, overwrite=True)
    wait_for_discards()
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]
    assert (tensorferry.load_checkpoint(tmp_path / "step_1")["x"] == 3.0).all()


def test_an_overwrite_that_another_save_beats_between_its_renames_says_so(tmp_path, monkeypatch) -> None:
    """Without RENAME_EXCHANGE, another save committed into step_1 while this overwrite had
    the old checkpoint aside: its second rename failed with a bare "Directory not empty"."""
    from tensorferry import checkpoint as module
    path = tmp_path / "step_1"
    tensorferry.save_checkpoint(path, {"x": np.full(100, 1.0)})
    monkeypatch.setattr(module, "exchange", lambda a, b: False)
    real_rename = os.rename
    beaten = []

    def another_save_between(source, target, *args, **kwargs):
        real_rename(source, target, *args, **kwargs)
        if module.OLD_TAIL in os.fspath(target) and not beaten:
            beaten.append(target)
            tensorferry.save_checkpoint(path, {"x": np.full(100, 3.0)}, overwrite=True)

    monkeypatch.setattr(os, "rename", another_save_between)
    with pytest.raises(FileExistsError, match="another save replaced the checkpoint") as raised:
        tensorferry.save_checkpoint(path, {"x": np.full(100, 2.0)}, overwrite=True)
    monkeypatch.undo()
    assert raised.value.filename == str(path)
    wait_for_discards()
    assert os.listdir(tmp_path) == ["step_1"], "the old checkpoint set aside went, as the dropped save's temporary"
    assert (tensorferry.load_checkpoint(path)["x"] == 3.0).all()


def test_a_failed_io_uring_enter_fails_its_requests_not_the_engine(tmp_path) -> None:
    import errno

    from tensorferry import _native
    from tensorferry.errors import TensorferryIOError
    if not tensorferry.engine.io_uring_probe()[0]:
        pytest.skip("io_uring is not available here")
    path = str(tmp_path / "data")
    data = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8)
    data.tofile(path)
    out = np.empty_like(data)
    with tensorferry.Engine(backend="io_uring", direct=False) as engine:
        engine.read(out, path, 0)
        for transient in (errno.EINTR, errno.EAGAIN, errno.EBUSY, errno.ENOMEM):
            _native._inject_uring_enter_failures(3, transient)
            out[:] = 0
            engine.read(out, path, 0)
            assert np.array_equal(out, data), errno.errorcode[transient]
        # The injected failure goes to the next io_uring_enter of any ring, which may be
        # the idle wait a ring enters after the last read completed: then the read
        # passes. Tried until one read carries it.
        failures = []
        for _ in range(50):
            _native._inject_uring_enter_failures(1, errno.EIO)
            try:
                engine.read(out, path, 0)
            except TensorferryIOError as exc:
                failures.append(exc)
            out[:] = 0
            engine.read(out, path, 0)  # the engine still works: the failure was the request's
            assert np.array_equal(out, data)
            if failures:
                break
        _native._inject_uring_enter_failures(0, 0)
        assert failures and failures[0].errno == errno.EIO and failures[0].filename == path


@pytest.mark.parametrize("backend", ["threads", "io_uring"])
def test_closed_files_hold_no_descriptors_once_their_io_is_done(tmp_path, backend) -> None:
    """A finished request lets go of its file: load, delete, save on a nearly full disk
    must not find the deleted checkpoint's space still pinned by open descriptors."""
    from tensorferry.adapters.pytorch import load, save

    def open_under(directory) -> list[str]:
        names = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(str(directory)):
                names.append(target)
        return names

    with tensorferry.Engine(backend=backend) as engine:
        path = tensorferry.save_checkpoint(tmp_path / "c", {"x": np.ones(1 << 18)}, engine=engine)
        tensorferry.load_checkpoint(path, engine=engine)
        save({"w": torch.ones(1000)}, tmp_path / "f.tf", engine=engine)
        load(tmp_path / "f.tf", engine=engine)
        tensorferry.verify_checkpoint(path, engine=engine)
        assert open_under(tmp_path) == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_failed_dcp_save_leaves_nothing_behind(tmp_path, monkeypatch) -> None:
    import errno

    import torch.distributed.checkpoint as dcp

    from tensorferry.adapters.pytorch import DCPWriter
    from tensorferry.adapters.pytorch import dcp as ferry_dcp
    real_add_item = ferry_dcp._add_item

    def disk_full_at_b(writer, key, *args):
        if key.startswith("b"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)", writer.path)
        return real_add_item(writer, key, *args)

    state = {"a": torch.ones(1000), "b": torch.zeros(1000), "c": torch.arange(10)}
    writer = DCPWriter(tmp_path / "ckpt", files_per_rank=3)
    monkeypatch.setattr(ferry_dcp, "_add_item", disk_full_at_b)
    with pytest.raises(BaseException) as failed:  # torch wraps it in a CheckpointException
        dcp.save(state, storage_writer=writer)
    assert "No space left" in str(failed.value) + repr(getattr(failed.value, "failures", ""))
    assert os.listdir(tmp_path) == [], "the coordinator removed the save's temporary"
    monkeypatch.setattr(ferry_dcp, "_add_item", real_add_item)
    dcp.save(state, storage_writer=writer)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_destination_of_another_dtype_of_the_same_size_is_refused(checkpoint) -> None:
    for wrong in (torch.zeros((2, 3), dtype=torch.int32), np.zeros((2, 3), np.int32)):
        with pytest.raises(ValueError, match="F32"):
            tensorferry.load_checkpoint(checkpoint, out={"a": wrong})
        assert not wrong.any()
    right = torch.zeros((2, 3), dtype=torch.float32)
    tensorferry.load_checkpoint(checkpoint, out={"a": right})
    assert torch.equal(right, torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_a_load_racing_an_overwrite_reads_the_new_checkpoint(checkpoint, monkeypatch) -> None:
    """The overwrite lands between the load's reading of the manifest and of the files
    it lists (made to happen there, every time, by running it from open_shard)."""
    from tensorferry import checkpoint as module
    real_open_shard = module.open_shard
    raced = []

    def overwritten_first(*args, **kwargs):
        if not raced:
            raced.append(True)
            tensorferry.save_checkpoint(checkpoint, {"a": np.full((2, 3), 7, np.float32)}, overwrite=True)
        return real_open_shard(*args, **kwargs)

    monkeypatch.setattr(module, "open_shard", overwritten_first)
    loaded = tensorferry.load_checkpoint(checkpoint)
    assert raced and list(loaded) == ["a"] and (loaded["a"] == 7).all()


def test_a_load_without_verification_never_mixes_two_saves(tmp_path, monkeypatch) -> None:
    """The overwrite lands after the load opened the first of two shard files and before
    the second: unverified, the second file's header went unchecked against the manifest,
    and the load returned "a" of one save and "b" of the next."""
    from tensorferry import checkpoint as module
    path = tmp_path / "step_1"

    def save(value: float, **kwargs) -> None:
        tensorferry.save_checkpoint(path, {"a": np.full(4096, value), "b": np.full(4096, value)},
                                    max_shard_bytes=32 << 10, **kwargs)

    save(1.0)
    assert len([n for n in os.listdir(path) if n.endswith(".safetensors")]) == 2
    real_open_shard = module.open_shard
    opened = []

    def overwritten_after_the_first(*args, **kwargs):
        reader = real_open_shard(*args, **kwargs)
        opened.append(reader.path)
        if len(opened) == 1:
            save(2.0, overwrite=True)
        return reader

    monkeypatch.setattr(module, "open_shard", overwritten_after_the_first)
    loaded = tensorferry.load_checkpoint(path, verify=False)
    assert (loaded["a"] == 2.0).all() and (loaded["b"] == 2.0).all()
    assert len(opened) > 2, "the overwrite landed between the two files, and the load read the new ones"


def test_a_killed_offload_store_is_reclaimed_by_the_next(tmp_path) -> None:
    import subprocess
    import sys
    script = ("import os, sys, numpy as np, tensorferry\n"
              "store = tensorferry.OffloadStore(sys.argv[1])\n"
              "store.swap_out('x', np.ones(1 << 16)).result()\n"
              "os._exit(9)\n")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 9, run.stderr
    (dead,) = os.listdir(tmp_path)
    with tensorferry.OffloadStore(tmp_path) as live:
        assert os.listdir(tmp_path) == [os.path.basename(live.path)], "the dead store's swap files remain"
        with tensorferry.OffloadStore(tmp_path) as other:  # a live store is never taken for a dead one
            assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (live.path, other.path))
    assert os.listdir(tmp_path) == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_checkpoints_metadata_is_covered_by_the_manifest(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    from tensorferry.adapters.pytorch import DCPReader, DCPWriter
    state = {"a": torch.arange(10.0), "step": 3}
    dcp.save(state, storage_writer=DCPWriter(tmp_path / "ckpt"))
    manifest = tensorferry.read_manifest(tmp_path / "ckpt")
    assert set(manifest["other_files"]) == {".metadata"}
    metadata = tmp_path / "ckpt" / ".metadata"
    raw = bytearray(metadata.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    metadata.write_bytes(bytes(raw))
    assert any(p.startswith(".metadata:") for p in tensorferry.verify_checkpoint(tmp_path / "ckpt"))
    target = {"a": torch.zeros(10), "step": 0}
    with pytest.raises(BaseException, match="damaged"):
        dcp.load(target, storage_reader=DCPReader(tmp_path / "ckpt"))


def test_the_cli_cleans_leftovers_and_keeps_what_is_held(tmp_path, capsys) -> None:
    from tensorferry.cli import main
    from tensorferry.temporaries import hold, release
    tensorferry.save_checkpoint(tmp_path / "step_1", {"x": np.arange(3)})
    (tmp_path / "step_2.tmp-00000000dead").mkdir()
    (tmp_path / "model.tf.tmp-0000dead").write_bytes(b"x")
    (tmp_path / "model.tf.tmp-0000beef").write_bytes(b"y")
    lock = hold(str(tmp_path / "model.tf.tmp-0000beef"))
    try:
        assert main(["clean", "--dry-run", str(tmp_path)]) == 0
        assert "would remove 2 leftovers" in capsys.readouterr().out
        assert len(os.listdir(tmp_path)) == 4
        assert main(["clean", str(tmp_path)]) == 0
        assert sorted(os.listdir(tmp_path)) == ["model.tf.tmp-0000beef", "step_1"]
    finally:
        release(lock)
    assert main(["clean", str(tmp_path)]) == 0
    assert os.listdir(tmp_path) == ["step_1"]


def test_a_disk_full_at_the_manifest_keeps_the_previous_checkpoint(small_tmpfs) -> None:
    """ENOSPC after the reservation: the shard file fits exactly, its manifest does not."""
    import errno
    root = small_tmpfs
    target = os.path.join(root, "step_1")
    tensorferry.save_checkpoint(target, {"w": np.full(1000, 1.0, np.float32)})
    new = {"w": np.full(100_000, 2.0, np.float32)}  # a 4096 + 400000-byte shard: 99 pages
    page = os.statvfs(root).f_frsize
    shard_pages = -(-(4096 + 400_000) // page)
    free = os.statvfs(root).f_bavail * page
    with open(os.path.join(root, "filler"), "wb") as f:
        f.write(b"\0" * (free - shard_pages * page))
    with pytest.raises(OSError) as info:
        tensorferry.save_checkpoint(target, new, overwrite=True)
    assert info.value.errno == errno.ENOSPC and "tensorferry.json" in str(info.value), info.value
    assert sorted(os.listdir(root)) == ["filler", "step_1"]
    assert (tensorferry.load_checkpoint(target)["w"] == 1.0).all()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_save_on_a_full_disk_keeps_the_previous_checkpoint(small_tmpfs) -> None:
    """A full disk as the shard files are written (their space is reserved first): the
    save fails naming the file and errno, and the checkpoint it was to replace stays."""
    import errno

    import torch.distributed.checkpoint as dcp

    from tensorferry.adapters.pytorch import DCPReader, DCPWriter
    target = os.path.join(small_tmpfs, "step")
    dcp.save({"w": torch.ones(1000)}, storage_writer=DCPWriter(target))
    with pytest.raises(BaseException) as failed:  # torch wraps it in a CheckpointException
        dcp.save({"w": torch.full((2_000_000,), 2.0)}, storage_writer=DCPWriter(target, overwrite=True))
    errors = [failed.value, *(e for e, _ in getattr(failed.value, "failures", {}).values())]
    assert any(isinstance(e, OSError) and e.errno == errno.ENOSPC and "rank00000-000" in str(e) for e in errors), errors
    assert sorted(os.listdir(small_tmpfs)) == ["step"], "the failed save's temporary is gone"
    kept = {"w": torch.zeros(1000)}
    dcp.load(kept, storage_reader=DCPReader(target))
    assert (kept["w"] == 1.0).all()
    # A retry that fits, by a new writer, while the failure's exception still holds the
    # old writer: nothing of the failed save stands in its way.
    dcp.save({"w": torch.full((1000,), 3.0)}, storage_writer=DCPWriter(target, overwrite=True))
    dcp.load(kept, storage_reader=DCPReader(target))
    wait_for_discards()  # the replaced checkpoint is removed in the background
    assert (kept["w"] == 3.0).all() and sorted(os.listdir(small_tmpfs)) == ["step"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_torch_dcp_folder_naming_a_file_outside_is_refused(tmp_path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from tensorferry import layouts
    dcp.save({"a": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ckpt")))
    path = tmp_path / "ckpt" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    for index, stored in list(metadata.storage_data.items()):
        metadata.storage_data[index] = type(stored)("../outside.distcp", stored.offset, stored.length)
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CorruptCheckpointError, match="plain file"):
        layouts.open_layout(str(tmp_path / "ckpt")).read()


class _RunsCode:
    """What a hostile writer pickles: unpickling it calls ``os.mkdir(marker)``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("writer", ["tensorferry", "torch"])
def test_dcp_metadata_that_would_run_code_is_refused_unrun(tmp_path, writer: str) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from tensorferry import layouts
    from tensorferry.adapters.pytorch import DCPReader, DCPWriter
    from tensorferry.checkpoint import encode_manifest, write_durably
    ckpt = tmp_path / "ckpt"
    storage = DCPWriter(ckpt) if writer == "tensorferry" else dcp.FileSystemWriter(str(ckpt))
    dcp.save({"a": torch.arange(4.0)}, storage_writer=storage)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    marker = tmp_path / "ran"
    metadata.planner_data = _RunsCode(str(marker))  # anywhere in the tree
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    if writer == "tensorferry":  # sealed again, as the hostile writer would: the checksum matches
        manifest = tensorferry.read_manifest(ckpt)
        shards = []
        for name in manifest["files"]:
            with tensorferry.ShardReader(ckpt / name, verify=False) as reader:
                shards.append(reader.shard_info())
        write_durably(str(ckpt / "tensorferry.json"), encode_manifest(shards, manifest["metadata"]))
        with pytest.raises(CorruptCheckpointError, match="posix.mkdir, which DCP metadata does not hold"):
            DCPReader(ckpt).read_metadata()
        with layouts.open_layout(str(ckpt)) as source:  # the manifest's item list: .metadata is not read
            assert source.read()["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    else:
        with pytest.raises(CorruptCheckpointError, match="posix.mkdir, which DCP metadata does not hold"):
            with layouts.open_layout(str(ckpt)) as source:
                source.read()
        with pytest.raises(CorruptCheckpointError, match="posix.mkdir, which DCP metadata does not hold"):
            DCPReader(ckpt).read_metadata()  # torch's folder, handed to torch's reader: not its unpickling
    assert not marker.exists()


def test_dcp_metadata_may_name_only_data_classes() -> None:
    import pickle
    from collections import OrderedDict

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from tensorferry.layouts.dcp import unpickle_dcp_metadata
    fine = OrderedDict(index=MetadataIndex("a", torch.Size([0, 2])), dtype=torch.bfloat16, layout=torch.strided)
    assert unpickle_dcp_metadata(pickle.dumps(fine), ".metadata") == fine
    for hostile in (FileSystemWriter, os.system, pickle.loads):  # a writer acts when made
        with pytest.raises(CorruptCheckpointError, match="which DCP metadata does not hold"):
            unpickle_dcp_metadata(pickle.dumps(hostile), ".metadata")


def test_a_load_to_cuda_checks_the_manifest_against_the_header_first(checkpoint, monkeypatch) -> None:
    """The CUDA path of adapters.pytorch.load_checkpoint, up to the copy to the device
    (no GPU here: that copy, read_to_device, is refused if reached)."""
    from tensorferry.adapters.pytorch import serialization

    def not_reached(*args, **kwargs):
        raise AssertionError("read_to_device was reached with a manifest the header contradicts")

    monkeypatch.setattr(serialization, "read_to_device", not_reached)
    _edit_manifest(checkpoint, lambda m: m["tensors"]["a"].update(dtype="I32"))
    with pytest.raises(CorruptCheckpointError, match="disagree"):
        serialization._load_directory_to_device(checkpoint, None, None, torch.device("cuda", 0), None, True)


@pytest.mark.parametrize("node", [{"tensor": "nope"}, {"dict": [[True, {"value": 1}]]}, {"npscalar": "w"},
                                  {"ordered_dict": {"items": [["w", {"tensor": "w"}]], "_metadata": []}},
                                  {"size": ["2"]}])
def test_a_checkpoint_whose_saved_structure_is_hostile_is_refused(tmp_path, node) -> None:
    """The structure a manifest holds, rewritten with the manifest sealed anew: refused
    naming the checkpoint, before any object is rebuilt from it."""
    from tensorferry.adapters.pytorch import load_checkpoint, save_checkpoint
    from tensorferry.schema import STRUCTURE_KEY
    path = str(tmp_path / "ckpt")
    save_checkpoint(path, {"w": torch.arange(6.0), "step": 7})
    _edit_manifest(path, lambda m: m["metadata"].__setitem__(STRUCTURE_KEY, {"dict": [["w", node]]}))
    with pytest.raises(CorruptCheckpointError, match="ckpt"):
        load_checkpoint(path)
