import json
import os

# Must precede the first import of jax in this process (another test module may
# have imported it already: then the device count check below skips).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from tensorferry.adapters.jax import (FerryCheckpointHandler, FerryRestore, FerrySave,  # noqa: E402
                                      load_pytree, save_pytree)
from tensorferry.checkpoint import read_manifest_file  # noqa: E402
from tensorferry.errors import CorruptCheckpointError  # noqa: E402



@pytest.fixture(autouse=True)
def _eight_devices():
    # Checked here, not at collection: initialising JAX's backend at collection would
    # make it multithreaded before other modules' tests fork.
    if jax.device_count() < 8:
        pytest.skip("needs 8 (virtual) devices: XLA_FLAGS was set after JAX started")

DTYPES = [getattr(jnp, name) for name in ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2fnuz",
                                          "float8_e8m0fnu", "complex64", "int32", "bool_")
          if hasattr(jnp, name)]  # e8m0: jax 0.5 on


def mesh(shape):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), ("x", "y"))


def make(dtype, shape=(16, 24), seed=0):
    values = np.random.default_rng(seed).standard_normal(shape) * 4
    if dtype == jnp.bool_:
        values = values > 0
    if dtype == getattr(jnp, "float8_e8m0fnu", None):
        # Powers of two, no sign: NaN for what it cannot hold, and NaN != NaN.
        values = np.abs(values) + 0.25
    return np.asarray(jnp.asarray(values).astype(dtype))


def state_on(mesh_2x4):
    s = NamedSharding(mesh_2x4, P("x", "y"))
    state = {f"w{i}": jax.device_put(make(dt, seed=i), s) for i, dt in enumerate(DTYPES)}
    state["rows"] = jax.device_put(make(jnp.float32, (8, 5), 9), NamedSharding(mesh_2x4, P("x")))
    state["replicated"] = jax.device_put(make(jnp.float32, (3, 4), 10), NamedSharding(mesh_2x4, P()))
    state["one_device"] = jax.device_put(make(jnp.float32, (3, 4), 11), jax.devices()[5])
    state["host"] = np.arange(10, dtype=np.int64)
    state["nested"] = [{"step": 7, "lr": 0.5}, (jnp.ones((2, 2), jnp.float32),)]
    return state


def abstract(state, sharding_for):
    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(x))
        return x
    return jax.tree_util.tree_map(one, state)


def assert_same(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        if isinstance(x, (int, float, str)):
            assert x == y
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            assert np.asarray(x).dtype == np.asarray(y).dtype


@pytest.fixture
def saved(tmp_path):
    state = state_on(mesh((2, 4)))
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    path = tmp_path / "ckpt"
    ckptr.save(path, args=FerrySave(state))
    return state, path


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mmap"])
@pytest.mark.parametrize("target", ["1x8", "8x1", "single", "2x4"])
def test_restore_onto_other_meshes(saved, target, mapped):
    state, path = saved
    if target == "single":
        sharding_for = lambda x: jax.sharding.SingleDeviceSharding(jax.devices()[3])  # noqa: E731
    else:
        m = mesh(tuple(int(d) for d in target.split("x")))

        def sharding_for(x):
            divides = x.ndim == 2 and x.shape[0] % m.shape["x"] == 0 and x.shape[1] % m.shape["y"] == 0
            return NamedSharding(m, P("x", "y") if divides else P())
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    restored = ckptr.restore(path, args=FerryRestore(abstract(state, sharding_for), mmap=mapped))
    assert_same(state, restored)
    for x, r in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)):
        if isinstance(x, jax.Array):
            assert r.sharding.is_equivalent_to(sharding_for(x), x.ndim)
    if mapped and target == "2x4":  # the saved sharding: each shard is a stored chunk, mapped
        assert _mapped_ranges(path / "process-0.safetensors")


def _mapped_ranges(path):
    with open("/proc/self/maps") as f:
        return [tuple(int(a, 16) for a in line.split()[0].split("-")) for line in f
                if line.rstrip().endswith(str(path))]


def test_a_mapped_restore_aliases_the_file_on_the_cpu(tmp_path):
    """Shards of page-aligned chunks become JAX arrays over the file's mapped pages (tiny
    ones JAX copies); they stay valid once the checkpoint is replaced."""
    m = mesh((2, 4))
    state = {"w": jax.device_put(make(jnp.float32, (1024, 1024)), NamedSharding(m, P("x", "y")))}
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    ckptr.save(tmp_path / "c", args=FerrySave(state))
    restored = ckptr.restore(tmp_path / "c", args=FerryRestore(abstract(state, lambda x: x.sharding), mmap=True))
    ranges = _mapped_ranges(tmp_path / "c" / "process-0.safetensors")
    assert all(any(lo <= s.data.unsafe_buffer_pointer() < hi for lo, hi in ranges)
               for s in restored["w"].addressable_shards)
    ckptr.save(tmp_path / "c", args=FerrySave({"w": jnp.zeros((1024, 1024))}), force=True)
    assert_same(state, restored)


def test_restore_without_target_and_metadata(saved, tmp_path):
    """Without a target, leaves come back as Orbax's StandardCheckpointHandler gives them
    back: jax.Arrays on the sharding they were saved with, numpy arrays and numbers as such."""
    state, path = saved
    handler = FerryCheckpointHandler()
    restored = ocp.Checkpointer(handler).restore(path)
    assert_same(state, restored)
    orbax_own = ocp.StandardCheckpointer()
    orbax_own.save(tmp_path / "orbax", state)
    orbax_own.wait_until_finished()
    theirs = orbax_own.restore(tmp_path / "orbax")
    for (keypath, ours), theirs_leaf in zip(*(jax.tree_util.tree_flatten_with_path(restored)[0],
                                              jax.tree_util.tree_leaves(theirs))):
        assert type(ours) is type(theirs_leaf), keypath
        if isinstance(ours, jax.Array):
            assert ours.sharding == theirs_leaf.sharding, keypath
    assert restored["w0"].sharding == state["w0"].sharding and restored["rows"].sharding.spec == P("x")
    assert restored["one_device"].sharding == state["one_device"].sharding  # on device 5, not the first
    meta = handler.metadata(path)
    assert meta["w2"].shape == (16, 24) and meta["w2"].dtype == jnp.bfloat16
    assert meta["one_device"].sharding == state["one_device"].sharding
    assert meta["w2"].sharding == state["w2"].sharding and meta["host"].sharding is None
    assert meta["nested"][0]["step"] == 7
    # The metadata, given shardings, is a restore target.
    m = mesh((4, 2))
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, P()))
        if isinstance(x, jax.ShapeDtypeStruct) else x, meta)
    target["nested"][1] = tuple(target["nested"][1])
    target["host"] = np.zeros(10, np.int64)  # a numpy target restores as numpy (JAX would make it int32)
    assert_same(jax.tree_util.tree_map(np.asarray, state),
                jax.tree_util.tree_map(np.asarray, ocp.Checkpointer(handler).restore(path, args=FerryRestore(target))))


_RESTORE_ON_TWO_DEVICES = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, numpy as np, orbax.checkpoint as ocp
from tensorferry.adapters.jax import FerryCheckpointHandler
restored = ocp.Checkpointer(FerryCheckpointHandler()).restore(sys.argv[1])
w0 = restored["w0"]
assert w0.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0]), w0.sharding
assert restored["one_device"].sharding == w0.sharding  # saved on device 5, which this run lacks
assert isinstance(restored["host"], np.ndarray)
print(np.asarray(w0).tobytes().hex(), flush=True)
"""


def test_restore_without_target_lacking_the_saved_devices(saved):
    """Saved on 8 devices, restored without a target where there are 2: on the first."""
    import subprocess
    import sys
    state, path = saved
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", _RESTORE_ON_TWO_DEVICES, str(path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == np.asarray(state["w0"]).tobytes().hex()


def _deep(depth):  # as JSON text: json.dumps itself recurses
    return '{"list":[' * depth + '{"leaf":"[\'w0\']"}' + "]}" * depth


@pytest.mark.parametrize("structure, message", [
    (_deep(500), "nested too deeply|nests more than"),  # refused before a walk could reach the recursion limit
    ({"leaf": "['nowhere']"}, "unreadable tree structure"),
    ({"leaf": ["['w0']"]}, "unreadable tree structure"),
    ({"dict": [["w0", {"leaf": "['w0']"}, 3]]}, "unreadable tree structure"),
    ({"node": "X", "children": {"a": 1}}, "unreadable tree structure"),
    ({"set": []}, "unreadable tree structure"),
    ([], "unreadable tree structure"),
], ids=["deep", "missing-leaf", "list-leaf", "bad-pair", "bad-children", "unknown-kind", "not-a-node"])
def test_a_hostile_tree_structure_is_refused(saved, structure, message):
    """The index is sealed again by the hostile writer: its checksum matches."""
    from tensorferry.checkpoint import seal_manifest, unseal_manifest
    _, path = saved
    index = path / "process-0.json"
    document = json.loads(unseal_manifest(index.read_bytes()))
    document["metadata"]["structure"] = "@structure@"
    text = json.dumps(document, separators=(",", ":"))
    text = text.replace('"@structure@"', structure if isinstance(structure, str) else json.dumps(structure))
    index.write_bytes(seal_manifest(text.encode()))
    handler = FerryCheckpointHandler()
    for action in (lambda: ocp.Checkpointer(handler).restore(path), lambda: handler.metadata(path)):
        with pytest.raises(CorruptCheckpointError, match=message):
            action()


def test_only_replica_zero_written_and_partial_reads(saved):
    state, path = saved
    import json
    index = json.loads((path / "process-0.json").read_text())
    chunks = index["metadata"]["leaves"]["['replicated']"]["chunks"]
    assert len(chunks) == 1  # replicated over 8 devices, stored once
    assert len(index["metadata"]["leaves"]["['w0']"]["chunks"]) == 8
    assert len(index["metadata"]["leaves"]["['rows']"]["chunks"]) == 2


def test_checkpoint_manager_async(tmp_path):
    m = mesh((2, 4))
    s = NamedSharding(m, P("x", "y"))
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    states = {}
    with ocp.CheckpointManager(tmp_path / "run", options=options,
                               item_handlers={"state": FerryCheckpointHandler()}) as mngr:
        w = jax.device_put(make(jnp.float32, (64, 64)), s)
        for step in range(4):
            w = w * 2 + step  # compute overlapping the previous async save
            state = {"w": w, "step": step}
            states[step] = state
            mngr.save(step, args=ocp.args.Composite(state=FerrySave(state)))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 3]
        assert mngr.latest_step() == 3
        target = abstract(states[3], lambda x: NamedSharding(mesh((8, 1)), P("x", "y")))
        restored = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(state=FerryRestore(target)))
        assert_same(states[3], restored["state"])


def test_checkpoint_manager_with_orbax_handlers_beside_ours(tmp_path):
    """A step of several items, as training loops save them: the state through our
    handler, metadata and a small host tree through Orbax's own handlers."""
    s = NamedSharding(mesh((2, 4)), P("x", "y"))
    handlers = {"state": FerryCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                "extra": ocp.StandardCheckpointHandler()}
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    states = {}
    with ocp.CheckpointManager(tmp_path / "run", options=options, item_handlers=handlers) as mngr:
        for step in range(3):
            states[step] = {"w": jax.device_put(make(jnp.float32, (16, 24), seed=step), s), "step": step}
            mngr.save(step, args=ocp.args.Composite(state=FerrySave(states[step]),
                                                    meta=ocp.args.JsonSave({"step": step, "lr": 0.1}),
                                                    extra=ocp.args.StandardSave({"seen": np.arange(3) * step})))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
        restored = mngr.restore(2, args=ocp.args.Composite(
            state=FerryRestore(abstract(states[2], lambda x: NamedSharding(mesh((8, 1)), P("x")))),
            meta=ocp.args.JsonRestore(), extra=ocp.args.StandardRestore()))
        assert_same(states[2], restored["state"])
        assert restored["meta"] == {"step": 2, "lr": 0.1}
        np.testing.assert_array_equal(restored["extra"]["seen"], np.arange(3) * 2)
    # a new manager (a restarted job) with the same handlers restores every item without args
    with ocp.CheckpointManager(tmp_path / "run", item_handlers=handlers) as mngr:
        again = mngr.restore(mngr.latest_step())
        np.testing.assert_array_equal(np.asarray(again["state"]["w"]), np.asarray(states[2]["w"]))
        assert again["meta"]["step"] == 2


def test_numbers_restore_as_the_target_asks(tmp_path):
    """A tree saved with Python numbers (step=5) restored into jax.eval_shape's abstract
    tree comes back with arrays there, as the target's types (a jitted step that took an
    array would otherwise be traced again for an int); into numbers, as numbers."""
    def init(key):
        return {"w": jax.random.normal(key, (16, 8)), "step": 0, "lr": 0.1}

    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    ckptr.save(tmp_path / "c", args=FerrySave({**init(jax.random.PRNGKey(0)), "step": 5, "note": "run-1"}))
    sharding = NamedSharding(mesh((2, 4)), P())
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                                      jax.eval_shape(init, jax.random.PRNGKey(1)))
    restored = ckptr.restore(tmp_path / "c", args=FerryRestore({**abstract, "note": ""}))
    assert isinstance(restored["step"], jax.Array) and restored["step"].dtype == jnp.int32
    assert int(restored["step"]) == 5 and restored["step"].sharding == sharding
    assert restored["lr"].dtype == jnp.float32 and float(restored["lr"]) == pytest.approx(0.1)
    assert restored["note"] == "run-1"
    plain = ckptr.restore(tmp_path / "c", args=FerryRestore({**abstract, "step": 0, "lr": 0.0, "note": ""}))
    assert type(plain["step"]) is int and plain["step"] == 5 and type(plain["lr"]) is float
    with pytest.raises(ValueError, match="saved as the number 5, the target has shape"):
        ckptr.restore(tmp_path / "c", args=FerryRestore({**abstract, "step": jax.ShapeDtypeStruct((2,), jnp.int32),
                                                         "note": ""}))


def test_a_step_of_orbaxs_own_format_is_named_and_migrates(tmp_path):
    """Steps saved by Orbax's StandardCheckpointHandler, then a switch to ours: the
    restore names the format and what to do, and doing it works."""
    state = {"w": jnp.arange(16.0), "step": 3}
    target = {"w": jax.ShapeDtypeStruct((16,), jnp.float32), "step": 0}
    with ocp.CheckpointManager(tmp_path / "run", item_handlers={"state": ocp.StandardCheckpointHandler()}) as mngr:
        mngr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        mngr.wait_until_finished()
        old = mngr.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    with ocp.CheckpointManager(tmp_path / "run", item_handlers={"state": FerryCheckpointHandler()}) as mngr:
        with pytest.raises(FileNotFoundError, match="Orbax's own format.*StandardCheckpointHandler"):
            mngr.restore(3, args=ocp.args.Composite(state=FerryRestore(target)))
        mngr.save(4, args=ocp.args.Composite(state=FerrySave(old)))
        mngr.wait_until_finished()
        assert_same(state, mngr.restore(4, args=ocp.args.Composite(state=FerryRestore(target)))["state"])


def test_typed_prng_keys(tmp_path):
    """jax.random.key arrays (what Flax NNX and current JAX keep in a train state) have a
    dtype numpy does not know: their key data is stored, and they come back as keys of
    the same implementation, on the target's sharding."""
    m = mesh((2, 4))
    split = jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(m, P("x")))
    state = {"rng": jax.random.key(1), "rbg": jax.random.key(2, impl="rbg"), "split": split,
             "raw": jax.random.PRNGKey(3), "w": jnp.ones(4)}
    ckptr = ocp.AsyncCheckpointer(FerryCheckpointHandler())
    ckptr.save(tmp_path / "c", args=FerrySave(state))
    ckptr.wait_until_finished()
    target = abstract(state, lambda x: x.sharding)
    target["split"] = jax.ShapeDtypeStruct((8,), split.dtype, sharding=NamedSharding(m, P("y")))  # resharded
    restored = ckptr.restore(tmp_path / "c", args=FerryRestore(target))
    for name in ("rng", "rbg", "split"):
        assert restored[name].dtype == state[name].dtype, name
        np.testing.assert_array_equal(jax.random.key_data(restored[name]), jax.random.key_data(state[name]))
    assert restored["split"].sharding.spec == P("y")
    assert float(jax.random.uniform(restored["rbg"])) == float(jax.random.uniform(state["rbg"]))
    np.testing.assert_array_equal(restored["raw"], state["raw"])  # old-style keys: plain uint32 arrays
    assert FerryCheckpointHandler().metadata(tmp_path / "c")["split"].dtype == split.dtype
    assert ckptr.restore(tmp_path / "c")["rng"].dtype == state["rng"].dtype  # no target: keys still
    # The usual Orbax target makes keys into their key data's shape and dtype: keys come
    # back, as from Orbax's own restore; a target of another plain dtype asks for the data.
    usual = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"rng": state["rng"]})
    assert usual["rng"].dtype == jnp.uint32
    ours = ckptr.restore(tmp_path / "c", args=FerryRestore({**target, **usual}))["rng"]
    orbax_own = ocp.StandardCheckpointer()
    orbax_own.save(tmp_path / "orbax", {"rng": state["rng"]})
    orbax_own.wait_until_finished()
    assert ours.dtype == orbax_own.restore(tmp_path / "orbax", usual)["rng"].dtype == state["rng"].dtype
    plain = {**target, "rng": jax.ShapeDtypeStruct((2,), jnp.int32)}
    np.testing.assert_array_equal(ckptr.restore(tmp_path / "c", args=FerryRestore(plain))["rng"],
                                  jax.random.key_data(state["rng"]))
    other_impl = {**target, "rbg": jax.ShapeDtypeStruct((), state["rng"].dtype)}
    with pytest.raises(ValueError, match="saved as key<rbg> keys"):
        ckptr.restore(tmp_path / "c", args=FerryRestore(other_impl))
    ckptr.close()
    with pytest.raises(TypeError, match=r"\['rng'\] is a typed PRNG key array"):
        save_pytree(tmp_path / "plain.safetensors", {"rng": state["rng"]})
    assert not (tmp_path / "plain.safetensors").exists()


@pytest.mark.parametrize("bad", [np.zeros(3, np.complex128), jnp.zeros(4, jnp.int4)], ids=["complex128", "int4"])
def test_dtypes_without_a_safetensors_name_are_refused_naming_the_leaf(tmp_path, bad):
    tree = {"ok": jnp.ones(2), "opt": {"mu": bad}}
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    with pytest.raises(TypeError, match=r"\['opt'\]\['mu'\]: dtype \w+ has no safetensors equivalent"):
        ckptr.save(tmp_path / "c", args=FerrySave(tree))
    assert not (tmp_path / "c").exists()
    with pytest.raises(TypeError, match=r"\['opt'\]\['mu'\]: dtype"):
        save_pytree(tmp_path / "p.safetensors", tree)
    assert not (tmp_path / "p.safetensors").exists()


_REFUSED_SAVE_THEN_EXIT = r"""
import sys
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tensorferry import shard
from tensorferry.adapters.jax import FerryCheckpointHandler, FerrySave

shard.MAX_HEADER_BYTES = 8192
bad = {"int4": {"x": jnp.zeros(4, jnp.int4)}, "complex128": {"x": np.zeros(4, np.complex128)},
       "header": {f"w{i}": np.ones(2, np.float32) for i in range(200)}}[sys.argv[2]]
mngr = ocp.CheckpointManager(sys.argv[1], item_names=("state",), item_handlers={"state": FerryCheckpointHandler()})
try:
    mngr.save(0, args=ocp.args.Composite(state=FerrySave(bad)))
except (TypeError, ValueError) as exc:
    print("REFUSED", type(exc).__name__, exc, flush=True)
"""


@pytest.mark.parametrize("bad", ["int4", "complex128", "header"])
def test_a_program_ending_on_a_refused_async_save_exits(tmp_path, bad):
    """A save through an async CheckpointManager that the handler refuses raised from the
    save call, but a program that then ended hung at exit for 300 s: Orbax had started
    threads creating the step's and the item's directories, whose futures the refusal
    dropped; the first failed as the interpreter shut down, and the second, which the
    interpreter joins, waited its coordination timeout for the first's signal. A race
    (whether the first thread finished before the interpreter shut down): before the fix,
    about half the runs hung."""
    import subprocess
    import sys
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    done = subprocess.run([sys.executable, "-c", _REFUSED_SAVE_THEN_EXIT, str(tmp_path / "run"), bad], env=env,
                          capture_output=True, text=True, timeout=120)  # a guard against the hang, not a timing
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("REFUSED"), done.stdout + done.stderr[-2000:]
    assert ("no safetensors equivalent" if bad != "header" else "more than the 8192") in done.stdout


def test_flax_train_states(tmp_path):
    """What Flax users hand Orbax: a Linen TrainState with optax's Adam state (custom
    pytree nodes, namedtuples, an int32 count) and an NNX model's state (Variables, and
    the typed PRNG keys of its Rngs), each restored into its abstract form."""
    optax = pytest.importorskip("optax")
    nn = pytest.importorskip("flax.linen")
    from flax import nnx
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))

    model = MLP()
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), jnp.ones((1, 8))),
                                          tx=optax.adam(1e-3))
    state = state.apply_gradients(grads=jax.tree_util.tree_map(jnp.ones_like, state.params))
    with ocp.CheckpointManager(tmp_path / "linen", item_handlers={"state": FerryCheckpointHandler()},
                               options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True)) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=FerrySave(state)))
        mngr.wait_until_finished()
        restored = mngr.restore(1, args=ocp.args.Composite(state=FerryRestore(abstract(state, lambda x: x.sharding))))
        restored = restored["state"]
    assert type(restored) is train_state.TrainState and int(restored.step) == 1
    assert_same(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored))
    assert type(restored.opt_state[0]) is type(state.opt_state[0])  # optax's ScaleByAdamState

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(8, 4, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    net = Net(nnx.Rngs(0))
    graph, saved = nnx.split(net)
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    ckptr.save(tmp_path / "nnx", args=FerrySave(saved))
    abstract_state = nnx.state(nnx.eval_shape(lambda: Net(nnx.Rngs(1))))
    back = nnx.merge(graph, ckptr.restore(tmp_path / "nnx", args=FerryRestore(abstract_state)))
    x = jnp.ones((2, 8))
    np.testing.assert_array_equal(back(x), net(x))  # same weights, same dropout keys: the same mask


def test_async_checkpointer(tmp_path):
    state = {"a": jax.device_put(make(jnp.bfloat16, (32, 8)), NamedSharding(mesh((2, 4)), P(None, "y")))}
    ckptr = ocp.AsyncCheckpointer(FerryCheckpointHandler())
    ckptr.save(tmp_path / "c", args=FerrySave(state))
    ckptr.wait_until_finished()
    restored = ckptr.restore(tmp_path / "c", args=FerryRestore(
        abstract(state, lambda x: NamedSharding(mesh((8, 1)), P("x")))))
    assert_same(state, restored)
    ckptr.close()


def test_torch_to_jax_and_back(tmp_path):
    torch = pytest.importorskip("torch")
    from tensorferry.adapters import pytorch as tfpt
    sd = {"layer.weight": torch.randn(4, 3), "layer.bias": torch.arange(3, dtype=torch.int32),
          "emb": torch.randn(5, 2).to(torch.bfloat16)}
    tfpt.save(sd, tmp_path / "model.safetensors")
    arrays = load_pytree(tmp_path / "model.safetensors")
    assert set(arrays) == set(sd)
    for name, t in sd.items():
        assert isinstance(arrays[name], jax.Array)
        np.testing.assert_array_equal(np.asarray(arrays[name].astype(jnp.float32)), t.float().numpy())
    assert arrays["emb"].dtype == jnp.bfloat16
    assert arrays["emb"].devices() == {jax.local_devices()[0]}
    on_third = load_pytree(tmp_path / "model.safetensors", device=jax.devices()[3])
    assert on_third["emb"].devices() == {jax.devices()[3]}
    np.testing.assert_array_equal(np.asarray(on_third["layer.bias"]), sd["layer.bias"].numpy())
    # JAX -> torch: a consolidated file is plain safetensors.
    save_pytree(tmp_path / "jax.safetensors", {"w": arrays["layer.weight"], "b": arrays["emb"]})
    back = tfpt.load(tmp_path / "jax.safetensors")
    assert torch.equal(back["['w']"], sd["layer.weight"])
    assert torch.equal(back["['b']"], sd["emb"])


def test_load_pytree_of_a_checkpoint_directory_and_a_hugging_face_folder(tmp_path):
    torch = pytest.importorskip("torch")
    from tensorferry.adapters import pytorch as tfpt
    sd = {f"layer{i}.weight": torch.randn(64, 256) for i in range(6)} | {"emb": torch.randn(8, 4).to(torch.bfloat16)}
    tfpt.save_checkpoint(tmp_path / "ckpt", sd, max_shard_bytes=100 << 10)
    import tensorferry
    assert len(tensorferry.read_manifest(tmp_path / "ckpt")["files"]) > 2
    from safetensors.torch import save_file
    (tmp_path / "hf").mkdir()
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"))
    for folder in ("ckpt", "hf"):
        arrays = load_pytree(tmp_path / folder)
        assert set(arrays) == set(sd)
        for name, t in sd.items():
            assert isinstance(arrays[name], jax.Array)
            assert arrays[name].dtype == (jnp.bfloat16 if t.dtype == torch.bfloat16 else jnp.float32)
            np.testing.assert_array_equal(np.asarray(arrays[name].astype(jnp.float32)), t.float().numpy())


def test_a_target_without_a_sharding_gets_the_saved_one(tmp_path):
    """A ShapeDtypeStruct that names no sharding: its array came back on the first device,
    where Orbax's own restore gives it the sharding it was saved with."""
    m = mesh((2, 4))
    state = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(m, P("x", "y"))),
             "keys": jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(m, P("x"))),
             "host": np.arange(3.0)}
    target = abstract(state, lambda x: None)
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    ours, theirs = restored_by_us_and_by_orbax(ckptr, tmp_path, state, target)
    for name in ("w", "keys"):
        assert ours[name].sharding == theirs[name].sharding == state[name].sharding, name
        assert ours[name].dtype == state[name].dtype
    np.testing.assert_array_equal(ours["w"], state["w"])
    np.testing.assert_array_equal(ours["host"], state["host"])


def test_typed_prng_keys_saved_under_jax_before_0_5(tmp_path, monkeypatch):
    """This adapter under JAX before 0.5 stored a key implementation's tag ("fry"),
    as ``key_impl`` gave it there: such checkpoints restore as keys of that implementation."""
    from tensorferry.adapters.jax import handler
    tags = {"threefry2x32": "fry", "rbg": "rbg", "unsafe_rbg": "urbg"}
    monkeypatch.setattr(handler, "_prng_impl_name", lambda keys: tags[jax.random.key_impl(keys)])
    state = {impl: jax.random.key(5, impl=impl) for impl in tags}
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    ckptr.save(tmp_path / "c", args=FerrySave(state))
    leaves = read_manifest_file(next((tmp_path / "c").glob("process-*.json")))["metadata"]["leaves"]
    assert {rec["prng_impl"] for rec in leaves.values()} == {"fry", "rbg", "urbg"}  # as those releases wrote
    restored = ckptr.restore(tmp_path / "c", args=FerryRestore(abstract(state, lambda x: x.sharding)))
    for impl, keys in state.items():
        assert restored[impl].dtype == keys.dtype, impl
        assert float(jax.random.uniform(restored[impl])) == float(jax.random.uniform(keys))
    assert ckptr.restore(tmp_path / "c")["unsafe_rbg"].dtype == state["unsafe_rbg"].dtype


@pytest.mark.parametrize("verify", [False, True], ids=["unverified", "verified"])
def test_reads_only_needed_bytes(tmp_path, monkeypatch, verify):
    from tensorferry.shard import ShardReader
    # Saved in row blocks, restored in column blocks: each device needs an 8x8 corner of
    # each 8x64 chunk. Unverified, read as 8 runs of one row piece rather than the whole
    # chunk; verified, each chunk is read whole once (its checksum covers all of it), and
    # every device's corner copied out of it.
    x = jax.device_put(make(jnp.float32, (16, 64)), NamedSharding(mesh((2, 4)), P("x", None)))
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    ckptr.save(tmp_path / "c", args=FerrySave({"x": x}))
    read = []
    original = ShardReader.pread

    def counting(self, name, out, start=0):
        read.append(np.asarray(out).nbytes)
        return original(self, name, out, start)

    monkeypatch.setattr(ShardReader, "pread", counting)
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh((1, 8)), P(None, "y")))}
    restored = ocp.Checkpointer(FerryCheckpointHandler(verify=verify)).restore(tmp_path / "c",
                                                                                args=FerryRestore(target))
    np.testing.assert_array_equal(np.asarray(restored["x"]), np.asarray(x))
    assert sum(read) == x.nbytes  # every byte read once
    assert read == [x.nbytes // 2] * 2 if verify else max(read) < x.nbytes // 2


def test_async_save_returns_before_io(tmp_path, monkeypatch):
    import threading
    import time
    gate = threading.Event()
    original = FerryCheckpointHandler._write

    def held(self, *args):
        gate.wait(10)
        original(self, *args)

    monkeypatch.setattr(FerryCheckpointHandler, "_write", held)
    host = np.arange(6, dtype=np.int32)
    state = {"a": jnp.arange(1 << 16, dtype=jnp.float32).reshape(256, 256), "h": host}
    saved = {"a": np.asarray(state["a"]).copy(), "h": host.copy()}
    ckptr = ocp.AsyncCheckpointer(FerryCheckpointHandler())
    t0 = time.perf_counter()
    ckptr.save(tmp_path / "c", args=FerrySave(state))
    assert time.perf_counter() - t0 < 5
    assert not (tmp_path / "c").exists()  # not committed while the write is held
    # While the write is held: the numpy array is changed (the save copied it), and the
    # jax array is donated to a step whose output would reuse its buffer (the save holds
    # a view of it, so XLA must not), then freed, and new arrays take memory.
    host[:] = -1
    stepped = jax.jit(lambda a: a * 0 - 1, donate_argnums=0)(state.pop("a"))
    churn = [jnp.full((256, 256), 9.0) + i for i in range(20)]
    jax.block_until_ready((stepped, churn))
    gate.set()
    ckptr.wait_until_finished()
    assert (tmp_path / "c" / "process-0.json").exists()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restored = ckptr.restore(tmp_path / "c", args=FerryRestore(
        {"a": jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=device), "h": np.zeros(6, np.int32)}))
    assert_same(saved, restored)
    ckptr.close()


_KILLED_SAVE = r"""
import os, sys, time
import jax.numpy as jnp
import orbax.checkpoint as ocp
from tensorferry.adapters.jax import handler as h

options = ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True)
mngr = ocp.CheckpointManager(sys.argv[1], options=options, item_handlers={"state": h.FerryCheckpointHandler()})
mngr.save(0, args=ocp.args.Composite(state=h.FerrySave({"w": jnp.zeros(1000), "step": 0})))
mngr.wait_until_finished()

def stuck(*args):  # the shard file of step 1 is written; its index never will be
    print("WRITING", flush=True)
    time.sleep(120)

h.encode_manifest = stuck
mngr.save(1, args=ocp.args.Composite(state=h.FerrySave({"w": jnp.ones(1000), "step": 1})))
time.sleep(120)
"""


def test_killed_save_leaves_previous_step(tmp_path):
    import signal
    import subprocess
    import sys
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(tmp_path / "run")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "WRITING"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    with ocp.CheckpointManager(tmp_path / "run", item_handlers={"state": FerryCheckpointHandler()}) as mngr:
        leftovers = [p.name for p in (tmp_path / "run").iterdir()]
        assert any(n.startswith("1") and "tmp" in n for n in leftovers), leftovers  # killed mid-save
        assert mngr.latest_step() == 0
        target = {"w": jax.ShapeDtypeStruct((1000,), jnp.float32,
                                            sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])), "step": 0}
        restored = mngr.restore(0, args=ocp.args.Composite(state=FerryRestore(target)))
        assert restored["state"]["step"] == 0
        np.testing.assert_array_equal(np.asarray(restored["state"]["w"]), np.zeros(1000, np.float32))


_TWO_PROCESSES = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
path, pid, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tensorferry.adapters.jax import FerryCheckpointHandler, FerryRestore, FerrySave

assert jax.device_count() == 8 and jax.local_device_count() == 4
full = np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
saved_on = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
x = jax.make_array_from_callback(full.shape, NamedSharding(saved_on, P("x", "y")), lambda i: full[i])
ckptr = ocp.Checkpointer(FerryCheckpointHandler())
ckptr.save(path, args=FerrySave({"x": x, "step": 3}))
restored_on = Mesh(np.array(jax.devices()).reshape(8, 1)[::-1], ("x", "y"))  # other devices per box
target = {"x": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=NamedSharding(restored_on, P(None, "x"))),
          "step": 0}
restored = ckptr.restore(path, args=FerryRestore(target))
assert restored["step"] == 3
for shard in restored["x"].addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
as_saved = ckptr.restore(path)["x"]  # no target: the global array on the mesh it was saved on
assert as_saved.sharding == x.sharding
for shard in as_saved.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
with ocp.CheckpointManager(path + "-steps", item_handlers={"state": FerryCheckpointHandler()},
                          options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)) as mngr:
    for step in range(3):  # Orbax's multi-host protocol: each process's async save, then process 0 commits
        mngr.save(step, args=ocp.args.Composite(state=FerrySave({"x": x * step, "step": step})))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 2], mngr.all_steps()
    latest = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(state=FerryRestore(target)))["state"]
    assert latest["step"] == 2
    for shard in latest["x"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), 2 * full[shard.index])
print("OK", sorted(os.listdir(path)), flush=True)
"""


@pytest.mark.slow
def test_two_processes(tmp_path):
    from conftest import free_ports, run_processes

    (port,) = free_ports(1)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    try:
        outputs = run_processes(_TWO_PROCESSES, [([str(tmp_path / "c"), str(i), str(port)], env) for i in range(2)],
                                timeout=60)
    except AssertionError as exc:  # Orbax's save synchronises the processes through JAX
        if "Multiprocess computations aren't implemented on the CPU backend" in str(exc):
            pytest.skip("this JAX has no computations across processes on the CPU (later ones have)")
        raise
    assert "process-0.safetensors" in outputs[0] and "process-1.json" in outputs[0]



_PROCESS_LOCAL = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
path, pid, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tensorferry.adapters.jax import FerryCheckpointHandler, FerryRestore, FerrySave, handler
from tensorferry.errors import CorruptCheckpointError

everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("p",)), P())
replicated = jax.make_array_from_callback((3,), everywhere, lambda i: np.arange(3, dtype=np.float32))
process_0 = Mesh(np.array([d for d in jax.devices() if d.process_index == 0]), ("s",))
local = {"rng": jax.random.key_data(jax.random.fold_in(jax.random.key(0), pid)),
         "seen": jnp.full((3,), float(pid)),
         "key": jax.random.key(0),  # the same on every process, yet each process's own
         "local_mesh": jax.device_put(np.arange(8.0), NamedSharding(Mesh(np.array(jax.local_devices()), ("l",)),
                                                                     P("l"))),
         "stage": jax.make_array_from_callback((8,), NamedSharding(process_0, P("s")), lambda i: np.zeros(8)[i],
                                               dtype=np.float32)}
ckptr = ocp.Checkpointer(FerryCheckpointHandler())
for name, value in local.items():
    where = "the devices of process 0" if name == "stage" and pid == 1 else "this process's devices"
    with pytest.raises(ValueError, match=rf"^\['{name}'\]: a jax.Array on {where} alone .* in a job of 2 processes"):
        ckptr.save(f"{path}/{name}", args=FerrySave({"replicated": replicated, name: value}))

# A global array replicated over every process's devices is saved, and so is the remedy the error names.
rows = NamedSharding(Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("p", "d")), P("p"))
per_process = jax.make_array_from_process_local_data(rows, np.asarray(local["seen"])[None])
ckptr.save(f"{path}/global", args=FerrySave({"replicated": replicated, "per_process": per_process}))
target = {"replicated": jax.ShapeDtypeStruct((3,), np.float32, sharding=everywhere),
          "per_process": jax.ShapeDtypeStruct((2, 3), np.float32, sharding=rows)}
restored = ckptr.restore(f"{path}/global", args=FerryRestore(target))
np.testing.assert_array_equal(np.asarray(restored["replicated"].addressable_data(0)), np.arange(3))
for shard in restored["per_process"].addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), [[pid] * 3])

# As a save before the refusal wrote it: each process's own under one chunk name.
refuse, handler._refuse_process_local = handler._refuse_process_local, lambda name, value: None
ckptr.save(f"{path}/old", args=FerrySave({"replicated": replicated, "seen": local["seen"]}))
handler._refuse_process_local = refuse
both = {"replicated": target["replicated"], "seen": jax.ShapeDtypeStruct((3,), np.float32)}
for args in [(), (FerryRestore(both),)]:  # without a target, and with one
    with pytest.raises(CorruptCheckpointError, match=r"leaf \['seen'\] has its box at offsets \[0\] of size \[3\] "
                                                     r"saved twice.*process-0.*process-1"):
        ckptr.restore(f"{path}/old", *args)
partial = ckptr.restore(f"{path}/old", args=FerryRestore({"replicated": both["replicated"]}, partial_restore=True))
np.testing.assert_array_equal(np.asarray(partial["replicated"].addressable_data(0)), np.arange(3))
print("OK", flush=True)
"""


@pytest.mark.slow
def test_process_local_arrays_are_refused_by_the_save_and_by_the_restore(tmp_path):
    """Each process's own array (a key folded with the process index, ``jnp.full(3, pid)``)
    was saved by every process under one chunk name, and restored everywhere as process
    0's, silently: the save now refuses it on every process, naming the leaf, as Orbax
    refuses a "host local" array, and a restore of a step saved so refuses the leaf."""
    from conftest import free_ports, run_processes

    (port,) = free_ports(1)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    outputs = run_processes(_PROCESS_LOCAL, [([str(tmp_path), str(i), str(port)], env) for i in range(2)], timeout=90)
    assert all("OK" in out for out in outputs)


_STEP_OF_TWO_PROCESSES = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
path, pid, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tensorferry.adapters.jax import FerryCheckpointHandler, FerryRestore, FerrySave
from tensorferry.errors import CorruptCheckpointError

full = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
rows = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
with ocp.CheckpointManager(path, item_handlers={"state": FerryCheckpointHandler()}) as mngr:
    if mode == "save":
        x = jax.make_array_from_callback(full.shape, rows, lambda i: full[i])
        mngr.save(0, args=ocp.args.Composite(state=FerrySave({"x": x, "step": 1})))
        mngr.wait_until_finished()
    else:  # every process refuses the step alike: none goes on into Orbax's barrier to wait for the other
        columns = NamedSharding(rows.mesh, P(None, "x"))
        target = {"x": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=columns), "step": 0}
        for target in [target, None]:
            with pytest.raises(CorruptCheckpointError, match=r"state: the step is incomplete, it lacks "
                                                             r"'process-1.json' \(its indexes record 2 processes"):
                mngr.restore(0, args=ocp.args.Composite(state=FerryRestore(target)))
print("OK", flush=True)
"""


@pytest.mark.slow
def test_a_step_lacking_a_process_index_is_refused_naming_it(tmp_path):
    """A step copied without one process's process-N.json failed on a box the missing
    chunks left uncovered ("the saved chunks of ... do not cover the box"), in a job of
    two processes on one of them while the other waited in Orbax's barrier, and a partial
    restore or the metadata succeeded without a word: each now refuses the step on every
    process, naming the missing index."""
    from conftest import free_ports, run_processes

    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    run = str(tmp_path / "run")
    for mode in ("save", "restore"):
        (port,) = free_ports(1)
        try:
            outputs = run_processes(_STEP_OF_TWO_PROCESSES, [([run, str(i), str(port), mode], env) for i in range(2)],
                                    timeout=90)
        except AssertionError as exc:  # as in test_two_processes
            if "Multiprocess computations aren't implemented on the CPU backend" in str(exc):
                pytest.skip("this JAX has no computations across processes on the CPU (later ones have)")
            raise
        assert all("OK" in out for out in outputs)
        if mode == "save":
            (tmp_path / "run" / "0" / "state" / "process-1.json").unlink()
    incomplete = r"state: the step is incomplete, it lacks 'process-1.json' \(its indexes record 2 processes"
    everywhere = NamedSharding(mesh((1, 8)), P())
    target = {"x": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=everywhere), "step": 0}
    with ocp.CheckpointManager(run, item_handlers={"state": FerryCheckpointHandler()}) as mngr:
        for args in [FerryRestore(target), FerryRestore(), FerryRestore({"step": 0}, partial_restore=True)]:
            with pytest.raises(CorruptCheckpointError, match=incomplete):
                mngr.restore(0, args=ocp.args.Composite(state=args))
    with pytest.raises(CorruptCheckpointError, match=incomplete):
        FerryCheckpointHandler().metadata(tmp_path / "run" / "0" / "state")
    (tmp_path / "run" / "0" / "state" / "process-0.json").rename(tmp_path / "run" / "0" / "state" / "process-1.json")
    with pytest.raises(CorruptCheckpointError, match=r"process-1.json is the index of process 0"):
        FerryCheckpointHandler().metadata(tmp_path / "run" / "0" / "state")


_SAVED_BY_ONE_PROCESS = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tensorferry.adapters.jax import FerryCheckpointHandler, FerrySave

full = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
on_four = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
state = {"w": jax.make_array_from_callback(full.shape, on_four, lambda i: full[i]),
         "keys": jax.device_put(jax.random.split(jax.random.key(1), 4), on_four),
         "replicated": jax.make_array_from_callback(full.shape, NamedSharding(on_four.mesh, P()), lambda i: full[i]),
         "one": jax.device_put(full[0], jax.devices()[0])}
ocp.Checkpointer(FerryCheckpointHandler()).save(sys.argv[1], args=FerrySave(state))
"""

_NO_SHARD_ON_A_PROCESS = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
path, pid, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tensorferry.adapters.jax import FerryCheckpointHandler, FerryRestore, FerrySave, handler

full = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
key_data = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(1), 4)))


def check(array, expected, holds):
    assert len(array.addressable_shards) == (len(array.sharding.addressable_devices) if holds else 0)
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])


# Pipeline stages: restored onto the devices of one process, from a step saved over both.
stages = [Mesh(np.array([d for d in jax.devices() if d.process_index == p]), ("s",)) for p in (0, 1)]
everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
ckptr = ocp.Checkpointer(FerryCheckpointHandler())
ckptr.save(f"{path}/both", args=FerrySave({
    "w": jax.make_array_from_callback(full.shape, everywhere, lambda i: full[i]),
    "v": jax.make_array_from_callback(full.shape, everywhere, lambda i: full[i] + 100),
    "r": jax.make_array_from_callback(full.shape, everywhere, lambda i: full[i] + 200), "step": 3}))
# JAX asks a replicated sharding's callback for the data even where this process holds no shard.
replicated = NamedSharding(stages[1], P())
target = {"w": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=NamedSharding(stages[0], P("s"))),
          "v": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=NamedSharding(stages[1], P(None, "s"))),
          "r": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=replicated),
          "step": jax.ShapeDtypeStruct((), np.int32, sharding=replicated)}
restored = ckptr.restore(f"{path}/both", args=FerryRestore(target))
for name, expected, holder in [("w", full, 0), ("v", full + 100, 1), ("r", full + 200, 1), ("step", np.array(3), 1)]:
    assert (restored[name].shape, restored[name].dtype) == (expected.shape, target[name].dtype), name
    assert restored[name].sharding == target[name].sharding, name
    check(restored[name], expected, holds=pid == holder)

# Saved by one process (devices 0-3, process 0's here), restored without a target by two:
# on the saved mesh, one global array of which process 1 holds nothing, as the metadata says.
as_saved = ckptr.restore(f"{path}/one")
saved_on = NamedSharding(Mesh(np.array([d for d in jax.devices() if d.id in range(4)]), ("x",)), P("x"))
assert as_saved["w"].sharding == saved_on and as_saved["w"].dtype == np.float32
check(as_saved["w"], full, holds=pid == 0)
assert as_saved["replicated"].sharding == NamedSharding(saved_on.mesh, P())
check(as_saved["replicated"], full, holds=pid == 0)
assert jax.dtypes.issubdtype(as_saved["keys"].dtype, jax.dtypes.prng_key) and as_saved["keys"].shape == (4,)
check(jax.random.key_data(as_saved["keys"]), key_data, holds=pid == 0)
assert FerryCheckpointHandler().metadata(f"{path}/one")["w"].sharding == saved_on
# A single device's array comes back whole on every process: on its device, or the process's first.
assert as_saved["one"].sharding.device_set == {jax.local_devices()[0]}
np.testing.assert_array_equal(np.asarray(as_saved["one"]), full[0])

handler._CALLBACK_TAKES_DTYPE = False  # as under JAX before 0.5.3, which cannot make the array
with pytest.raises(ValueError, match=r"^\['(r|w)'\]: this process holds no device of the target's sharding"):
    FerryCheckpointHandler().restore(f"{path}/both", args=FerryRestore(target))  # no barrier after it
print("OK", flush=True)
"""


@pytest.mark.slow
def test_restore_where_a_process_holds_no_shard_of_an_array(tmp_path):
    """A restore onto a sharding that leaves a process without devices (pipeline stages;
    a step saved by one process, restored without a target by two) raised on that
    process ("If the Array has no addressable shards, `dtype` must be provided"), and the
    other waited in Orbax's barrier: that process now reads nothing and gets the array
    of which it holds no shard."""
    import subprocess
    import sys
    from conftest import free_ports, run_processes

    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    saved = subprocess.run([sys.executable, "-c", _SAVED_BY_ONE_PROCESS, str(tmp_path / "one")], env=env,
                           capture_output=True, text=True, timeout=120)
    assert saved.returncode == 0, saved.stderr[-2000:]
    (port,) = free_ports(1)
    outputs = run_processes(_NO_SHARD_ON_A_PROCESS, [([str(tmp_path), str(i), str(port)], env) for i in range(2)],
                            timeout=90)
    assert all("OK" in out for out in outputs)

def test_restore_reads_ahead_within_a_window(tmp_path, monkeypatch):
    from tensorferry.adapters.jax import handler
    # Many small leaves: each leaf's reads start while earlier leaves are still being
    # finished, but never more than the window's bytes ahead.
    state = {f"w{i:02d}": jax.device_put(make(jnp.float32, (64, 64), seed=i)) for i in range(24)}
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    ckptr.save(tmp_path / "c", args=FerrySave(state))
    leaf_bytes = 64 * 64 * 4
    # A leaf in flight holds its boxes and its one chunk, read whole to verify the parts the boxes take.
    monkeypatch.setattr(handler, "RESTORE_WINDOW", 6 * leaf_bytes)
    events = []
    original = handler._Checkpoint.start_box

    def logged(self, name, offsets, sizes):
        events.append(1)
        finish = original(self, name, offsets, sizes)

        def finished():
            events.append(-1)
            return finish()
        return finished

    monkeypatch.setattr(handler._Checkpoint, "start_box", logged)
    target = abstract(state, lambda x: NamedSharding(mesh((2, 4)), P("x", "y")))
    restored = ckptr.restore(tmp_path / "c", args=FerryRestore(target))
    assert_same(state, restored)
    boxes_per_leaf = 8  # one per device of the 2x4 mesh
    ahead = max(np.cumsum(events)) / boxes_per_leaf
    assert 3 <= ahead <= 4, ahead


def test_leaves_saved_as_restored_are_read_with_their_neighbours(tmp_path, monkeypatch):
    from tensorferry.shard import ShardReader
    # The sharding they were saved with: each leaf is a whole stored chunk, and the
    # chunks lying next to each other in the file come in a few large requests.
    state = {f"w{i:02d}": jax.device_put(make(jnp.float32, (32, 32), seed=i)) for i in range(40)}
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    ckptr.save(tmp_path / "c", args=FerrySave(state))
    runs = []
    original = ShardReader._start_run

    def counting(self, names, populate):
        runs.append(len(names))
        return original(self, names, populate)

    monkeypatch.setattr(ShardReader, "_start_run", counting)
    restored = ckptr.restore(tmp_path / "c", args=FerryRestore(abstract(state, lambda x: x.sharding)))
    assert_same(state, restored)
    assert runs == [40]
    runs.clear()
    as_saved = ckptr.restore(tmp_path / "c")  # no target: the saved sharding, read the same way
    assert runs == [40] and all(isinstance(v, jax.Array) for v in as_saved.values())


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mmap"])
@pytest.mark.parametrize("restore_as", ["saved sharding", "host arrays"])
def test_a_flipped_data_byte_fails_the_restore(saved, restore_as, mapped):
    from tensorferry.shard import ShardReader
    state, path = saved
    shard_file = path / "process-0.safetensors"
    with ShardReader(shard_file) as reader:
        victim = next(n for n in reader.keys() if n.startswith("['rows']"))
        at = reader.data_start + reader.info(victim).begin + 3
    raw = bytearray(shard_file.read_bytes())
    raw[at] ^= 0x10
    shard_file.write_bytes(bytes(raw))
    handler = FerryCheckpointHandler()
    target = abstract(state, lambda x: x.sharding) if restore_as == "saved sharding" else None
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in tensor .*rows"):
        ocp.Checkpointer(handler).restore(path, args=FerryRestore(target, mmap=mapped))
    unchecked = ocp.Checkpointer(FerryCheckpointHandler(verify=False)).restore(
        path, args=FerryRestore(target, mmap=mapped))
    assert not np.array_equal(np.asarray(unchecked["rows"]), np.asarray(state["rows"]))


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mmap"])
@pytest.mark.parametrize("target", ["inside one chunk", "across chunks"])
def test_a_flipped_data_byte_fails_a_restore_onto_another_sharding(tmp_path, target, mapped):
    """A restore whose boxes take parts of stored chunks read only those parts, which no
    checksum covers: a flipped byte came back silently as data. Each chunk such a box
    takes from is now read whole and verified."""
    from tensorferry.shard import ShardReader
    x = jax.device_put(make(jnp.float32, (16, 64)), NamedSharding(mesh((2, 1)), P("x")))  # two 8x64 chunks
    path = tmp_path / "c"
    ocp.Checkpointer(FerryCheckpointHandler()).save(path, args=FerrySave({"x": x}))
    shard_file = path / "process-0.safetensors"
    with ShardReader(shard_file) as reader:
        at = reader.data_start + reader.info("['x']@8,0").begin + 3
    raw = bytearray(shard_file.read_bytes())
    raw[at] ^= 0x10
    shard_file.write_bytes(bytes(raw))
    sharding = (NamedSharding(mesh((2, 4)), P("x", "y")) if target == "inside one chunk"  # 8x16 boxes
                else NamedSharding(mesh((1, 8)), P(None, "y")))  # 16x8 boxes, a part of each chunk
    abstract_x = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
    with pytest.raises(CorruptCheckpointError, match=r"process-0.safetensors: checksum mismatch in tensor "
                                                     r"\"\['x'\]@8,0\""):
        ocp.Checkpointer(FerryCheckpointHandler()).restore(path, args=FerryRestore(abstract_x, mmap=mapped))
    unchecked = ocp.Checkpointer(FerryCheckpointHandler(verify=False)).restore(
        path, args=FerryRestore(abstract_x, mmap=mapped))
    assert not np.array_equal(np.asarray(unchecked["x"]), np.asarray(x))


def _nested(depth, leaf):
    for _ in range(depth):
        leaf = {"a": leaf}
    return leaf


def test_a_tree_a_restore_would_refuse_is_refused_by_the_save(tmp_path):
    """The limits a restore applies to what it reads (schema.MAX_STRUCTURE_DEPTH,
    MAX_TENSOR_NAME_CHARS) are checked before anything is written, naming the leaf: the
    save used to commit a step that no restore could read. At the limits, it restores."""
    from tensorferry.schema import MAX_STRUCTURE_DEPTH, MAX_TENSOR_NAME_CHARS
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    deepest = _nested(MAX_STRUCTURE_DEPTH - 1, jnp.ones(2))  # the leaf is the 200th node down
    longest = {"k" * (MAX_TENSOR_NAME_CHARS - len("['']@0")): jnp.ones(2)}  # stored as "['kk..k']@0"
    for name, tree in (("deepest", deepest), ("longest", longest)):
        ckptr.save(tmp_path / name, args=FerrySave(tree))
        assert_same(tree, ckptr.restore(tmp_path / name))
    with pytest.raises(ValueError, match=rf"\['a'\]\['a'\].*: the tree nests more than {MAX_STRUCTURE_DEPTH} levels"):
        ckptr.save(tmp_path / "deeper", args=FerrySave(_nested(MAX_STRUCTURE_DEPTH, jnp.ones(2))))
    with pytest.raises(ValueError, match=rf"\['kkk.*: stored as a name of {MAX_TENSOR_NAME_CHARS + 1} characters"):
        ckptr.save(tmp_path / "longer", args=FerrySave({"k" + next(iter(longest)): jnp.ones(2)}))
    assert not (tmp_path / "deeper").exists() and not (tmp_path / "longer").exists()
    # Through a CheckpointManager: refused by save(), the step never committed. (Not an
    # async one: when a handler's async_save raises, Orbax's thread creating the step's
    # directory may wait out its 300 s timeout before the interpreter can exit.)
    with ocp.CheckpointManager(tmp_path / "run", item_handlers={"state": FerryCheckpointHandler()},
                               options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)) as mngr:
        with pytest.raises(ValueError, match="nests more than"):
            mngr.save(1, args=ocp.args.Composite(state=FerrySave({"w": _nested(MAX_STRUCTURE_DEPTH, 0.5)})))
        assert mngr.all_steps() == []


def test_a_shard_header_or_index_over_the_readers_caps_is_refused(tmp_path, monkeypatch):
    """The caps a reader puts on a shard file's header (shard.MAX_HEADER_BYTES) and on an
    index (schema.MAX_SMALL_FILE_BYTES), made small here: the save refuses before writing
    the file over its cap, and the step is not committed."""
    from tensorferry import shard
    from tensorferry.adapters.jax import handler
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    many = {f"w{i}": np.ones(2, np.float32) for i in range(200)}  # a header of 20 KB
    monkeypatch.setattr(shard, "MAX_HEADER_BYTES", 8192)
    with pytest.raises(ValueError, match="header of .* bytes, more than the 8192 a reader accepts"):
        ckptr.save(tmp_path / "many", args=FerrySave(many))
    monkeypatch.undo()
    monkeypatch.setattr(handler, "MAX_SMALL_FILE_BYTES", 8192)
    with pytest.raises(ValueError, match="index of .* bytes, more than the 8192 a reader accepts"):
        ckptr.save(tmp_path / "note", args=FerrySave({"w": jnp.ones(2), "note": "x" * 10_000}))
    assert not (tmp_path / "many").exists() and not (tmp_path / "note").exists()


def test_explicit_mesh_axes_are_kept_without_a_target(tmp_path, monkeypatch):
    """A mesh of Explicit axes (jax.make_mesh's default in current JAX) comes back with
    them, as Orbax restores it: on Auto axes the array could not meet the live state in
    one computation. Indexes written before axis types were recorded, and a JAX without
    them, restore on Auto axes as before."""
    from tensorferry.checkpoint import seal_manifest, unseal_manifest
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None:
        pytest.skip("this JAX has no mesh axis types")
    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"), axis_types=(axis_type.Explicit,) * 2)
    x = jax.device_put(make(jnp.float32, (8, 8)), NamedSharding(m, P("x", "y")))
    handler = FerryCheckpointHandler()
    ocp.Checkpointer(handler).save(tmp_path / "c", args=FerrySave({"x": x}))
    restored = ocp.Checkpointer(handler).restore(tmp_path / "c")["x"]
    assert restored.sharding == x.sharding and (restored + x).sharding == x.sharding
    assert handler.metadata(tmp_path / "c")["x"].sharding == x.sharding
    index = tmp_path / "c" / "process-0.json"
    document = json.loads(unseal_manifest(index.read_bytes()))
    del document["metadata"]["leaves"]["['x']"]["sharding"]["axis_types"]  # as earlier releases wrote it
    index.write_bytes(seal_manifest(json.dumps(document, separators=(",", ":")).encode()))
    old = ocp.Checkpointer(handler).restore(tmp_path / "c")["x"]
    assert old.sharding.mesh.axis_types == (axis_type.Auto,) * 2 and old.sharding.spec == P("x", "y")
    np.testing.assert_array_equal(np.asarray(old), np.asarray(x))
    ocp.Checkpointer(handler).save(tmp_path / "c", args=FerrySave({"x": x}), force=True)
    monkeypatch.delattr(jax.sharding, "AxisType")  # as before JAX 0.6
    assert ocp.Checkpointer(handler).restore(tmp_path / "c")["x"].sharding.mesh.axis_types == (axis_type.Auto,) * 2


def test_leaves_match_by_key_names_across_container_kinds(tmp_path):
    """As Orbax matches leaves: a dict's key and a dataclass's field of the same name are
    the same place, so a dict checkpoint (what a restore without a target gives back)
    restores into a flax.struct dataclass or TrainState target, and the reverse."""
    struct = pytest.importorskip("flax.struct")
    optax = pytest.importorskip("optax")
    from flax.training import train_state

    @struct.dataclass
    class State:
        params: dict
        step: jax.Array

    as_object = State(params={"w": jnp.arange(3.0)}, step=jnp.array(4))
    as_dict = {"params": {"w": jnp.arange(3.0)}, "step": jnp.array(4)}
    with ocp.CheckpointManager(tmp_path / "run", item_handlers={"state": FerryCheckpointHandler()}) as mngr:
        for step, (saved, target) in enumerate(((as_dict, as_object), (as_object, as_dict))):
            mngr.save(step, args=ocp.args.Composite(state=FerrySave(saved)))
            mngr.wait_until_finished()
            restored = mngr.restore(step, args=ocp.args.Composite(state=FerryRestore(
                abstract(target, lambda x: x.sharding))))["state"]
            assert type(restored) is type(target)
            assert_same(target, restored)
        # A TrainState restored without a target (dicts for it and optax's namedtuples),
        # saved again, then restored into the TrainState.
        state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.arange(3.0)}, tx=optax.adam(0.1))
        mngr.save(2, args=ocp.args.Composite(state=FerrySave(state)))
        mngr.wait_until_finished()
        mngr.save(3, args=ocp.args.Composite(state=FerrySave(mngr.restore(2)["state"])))
        mngr.wait_until_finished()
        restored = mngr.restore(3, args=ocp.args.Composite(state=FerryRestore(
            abstract(state, lambda x: x.sharding))))["state"]
        assert type(restored) is train_state.TrainState
        assert_same(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored))


def test_a_target_without_some_saved_leaves_is_refused_unless_partial(tmp_path):
    """As Orbax's StandardRestore: a target lacking saved leaves (an optimizer state
    forgotten) is an error naming them; partial_restore=True restores the target's alone."""
    saved = {"params": {"w": jnp.ones(3)}, "opt_state": {"mu": jnp.zeros(3), "nu": jnp.zeros(3)}, "step": 7}
    target = {"params": {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}, "step": 0}
    with ocp.CheckpointManager(tmp_path / "run", item_handlers={"state": FerryCheckpointHandler()}) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=FerrySave(saved)))
        mngr.wait_until_finished()
        with pytest.raises(ValueError, match=r"""the target lacks 2 saved leaves: "\['opt_state'\]\['mu'\]", """
                                             r""""\['opt_state'\]\['nu'\]".*partial_restore=True"""):
            mngr.restore(1, args=ocp.args.Composite(state=FerryRestore(target)))
        partial = mngr.restore(1, args=ocp.args.Composite(state=FerryRestore(target, partial_restore=True)))
        assert_same({"params": saved["params"], "step": 7}, partial["state"])


def restored_by_us_and_by_orbax(ckptr, tmp_path, saved, target):
    """``saved`` restored into ``target`` through ``ckptr`` and through Orbax's own StandardCheckpointer."""
    ckptr.save(tmp_path / "c", args=FerrySave(saved))
    ours = ckptr.restore(tmp_path / "c", args=FerryRestore(target))
    orbax_own = ocp.StandardCheckpointer()
    orbax_own.save(tmp_path / "orbax", saved)
    orbax_own.wait_until_finished()
    return ours, orbax_own.restore(tmp_path / "orbax", target)


def test_arrays_restore_as_python_numbers_where_the_target_has_them(tmp_path):
    """A 0-d array (jax's or numpy's) restored into a Python number comes back as a number
    of the target's type, as Orbax's StandardCheckpointHandler returns it; a larger
    array into a number is an error."""
    saved = {"step": jnp.array(5), "lr": np.float32(0.5), "scale": jnp.array(1.5), "v": jnp.arange(3)}
    target = {"step": 0, "lr": 0.0, "scale": 0, "v": jax.ShapeDtypeStruct((3,), jnp.int32)}
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    ours, theirs = restored_by_us_and_by_orbax(ckptr, tmp_path, saved, target)
    for name in ("step", "lr", "scale"):
        assert type(ours[name]) is type(theirs[name]) is type(target[name]) and ours[name] == theirs[name], name
    with pytest.raises(ValueError, match=r"\['v'\]: saved with shape \(3,\), the target is the number 0"):
        ckptr.restore(tmp_path / "c", args=FerryRestore({**target, "v": 0}))


def test_numbers_restore_as_python_numbers_of_the_targets_type(tmp_path):
    """A Python number saved as a leaf (step=3) restored into a Python number of another
    type (a target of 1.0) came back as saved, an int, where Orbax's StandardCheckpointer
    casts it to the target's type, as it casts a 0-d array; a number that type cannot
    hold is an error naming the leaf."""
    saved = {"step": 3, "lr": 2.5, "flag": True, "count": 4}
    target = {"step": 1.0, "lr": 0, "flag": 0.0, "count": False}
    ckptr = ocp.Checkpointer(FerryCheckpointHandler())
    ours, theirs = restored_by_us_and_by_orbax(ckptr, tmp_path, saved, target)
    for name in saved:
        assert type(ours[name]) is type(theirs[name]) is type(target[name]) and ours[name] == theirs[name], name
    assert ours == {"step": 3.0, "lr": 2, "flag": 1.0, "count": True}
    ckptr.save(tmp_path / "nan", args=FerrySave({"loss": float("nan"), "best": jnp.array(float("inf"))}))
    for leaf in ("loss", "best"):
        with pytest.raises(ValueError, match=rf"\['{leaf}'\]: saved as .*, which the target's int cannot hold"):
            ckptr.restore(tmp_path / "nan", args=FerryRestore({"loss": 0.0, "best": 0.0, leaf: 0}))


def test_inspect_json_of_non_finite_numbers_is_valid_json(tmp_path):
    """`tensorferry inspect --json` printed a NaN number leaf as a bare NaN, which strict
    JSON parsers refuse; such numbers are listed as adapters.pytorch.save's structure
    writes them, {"float": "nan" | "inf" | "-inf"}."""
    from tensorferry import layouts
    ocp.Checkpointer(FerryCheckpointHandler()).save(tmp_path / "c", args=FerrySave(
        {"w": jnp.ones(2), "loss": float("nan"), "best": float("inf"), "worst": -float("inf"), "lr": 0.5}))
    info = json.loads(json.dumps(layouts.describe(tmp_path / "c"), allow_nan=False))
    leaves = {t["name"]: t for t in info["tensors"]}
    assert [leaves[n].get("float") for n in ("['loss']", "['best']", "['worst']")] == ["nan", "inf", "-inf"]
    assert leaves["['lr']"]["value"] == 0.5 and "value" not in leaves["['loss']"]


def test_a_directory_with_glob_characters(tmp_path):
    """A run's directory named like a sweep's (``sweep[lr=3e-4]``) restores: the indexes
    were looked for with the directory as a glob pattern."""
    with ocp.CheckpointManager(tmp_path / "sweep[lr=3e-4]", item_handlers={"state": FerryCheckpointHandler()}) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=FerrySave({"w": jnp.arange(3.0)})))
        mngr.wait_until_finished()
        restored = mngr.restore(1, args=ocp.args.Composite(state=FerryRestore(
            {"w": jax.ShapeDtypeStruct((3,), jnp.float32)})))
        np.testing.assert_array_equal(np.asarray(restored["state"]["w"]), np.arange(3.0, dtype=np.float32))


def _strict_json(data: bytes) -> dict:
    """``data`` parsed as JSON the way jq or JavaScript parse it: NaN and Infinity are no JSON."""
    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")
    return json.loads(data, parse_constant=refuse)


def test_non_finite_numbers_are_stored_as_valid_json(tmp_path):
    """A NaN or infinite number leaf (a loss) went into the index as a bare NaN or Infinity,
    which is not JSON: jq, JavaScript and strict parsers refused the file. It is stored as
    {"kind": "float", "value": "nan" | "inf" | "-inf"} and restores as the number; indexes
    written before, with the bare tokens, still restore; a float record of another value is
    refused as damaged."""
    from tensorferry.checkpoint import seal_manifest, unseal_manifest
    saved = {"w": jnp.ones(2), "loss": float("nan"), "best": float("inf"), "worst": -float("inf"), "lr": 0.5}
    numbers = ("loss", "best", "worst", "lr")

    def assert_numbers(restored):
        assert [type(restored[n]) for n in numbers] == [float] * 4
        assert np.isnan(restored["loss"]) and restored["best"] == float("inf") and restored["worst"] == -float("inf")
        assert restored["lr"] == 0.5

    handler = FerryCheckpointHandler()
    with ocp.CheckpointManager(tmp_path / "run", item_handlers={"state": handler}) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=FerrySave(saved)))
        mngr.wait_until_finished()
        index = tmp_path / "run" / "1" / "state" / "process-0.json"
        leaves = _strict_json(index.read_bytes())["metadata"]["leaves"]
        assert [leaves[f"['{n}']"] for n in ("loss", "best", "worst")] == [
            {"kind": "float", "value": v} for v in ("nan", "inf", "-inf")]
        assert_numbers(mngr.restore(1)["state"])
        assert_numbers(mngr.restore(1, args=ocp.args.Composite(state=FerryRestore(
            {**saved, "w": jax.ShapeDtypeStruct((2,), jnp.float32), "loss": 0.0, "best": 0.0, "worst": 0.0})))["state"])
        assert_numbers(handler.metadata(index.parent))
        document = json.loads(unseal_manifest(index.read_bytes()))
        for n in ("loss", "best", "worst"):  # as earlier releases wrote them: json.dumps' bare tokens
            document["metadata"]["leaves"][f"['{n}']"] = {"kind": "scalar", "value": saved[n]}
        index.write_bytes(seal_manifest(json.dumps(document, separators=(",", ":")).encode()))
        assert b"NaN" in index.read_bytes()
        assert_numbers(mngr.restore(1)["state"])
        document["metadata"]["leaves"]["['loss']"] = {"kind": "float", "value": "1.5"}
        index.write_bytes(seal_manifest(json.dumps(document, separators=(",", ":")).encode()))
        with pytest.raises(CorruptCheckpointError, match=r"a leaf record is malformed .*'1\.5'"):
            mngr.restore(1)


def test_numpy_scalar_targets_get_numpy_scalars(tmp_path):
    """A target leaf that is a numpy scalar (np.float32(0)) got a 0-d np.ndarray back where
    the leaf was saved as an array (a numpy scalar, a 0-d jax.Array); it now gets a numpy
    scalar of the target's dtype, as it did where the leaf was saved as a Python number.
    (Orbax's StandardCheckpointHandler refuses such a target: "Unsupported type".)"""
    saved = {"a": np.float32(1.5), "b": jnp.float32(2.0), "c": jnp.array(3, jnp.int32), "d": 4.0,
             "e": np.arange(3, dtype=np.int64)}
    target = {"a": np.float32(0), "b": np.float16(0), "c": np.int64(0), "d": np.float64(0),
              "e": np.zeros(3, np.int64)}
    with ocp.CheckpointManager(tmp_path / "run", item_handlers={"state": FerryCheckpointHandler()}) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=FerrySave(saved)))
        mngr.wait_until_finished()
        restored = mngr.restore(1, args=ocp.args.Composite(state=FerryRestore(target)))["state"]
    for name, value in target.items():
        assert type(restored[name]) is type(value), name
        np.testing.assert_array_equal(restored[name], np.asarray(saved[name]).astype(value.dtype))


def test_dict_keys_and_list_indices_are_not_confused(tmp_path):
    """A dict {"0": x} and a list [x] hold their leaves at different key paths
    (['p']['0'] and ['p'][0]): restored into a target of the other kind, a clear error names
    the leaf asked for and the saved ones, never another leaf. Without a target each comes
    back with its own key types; so do a dict's bool keys, which a restore refused as an
    unreadable structure (JSON's true is no integer)."""
    a, b = jnp.array([1.0]), jnp.array([2.0])
    spec = jax.ShapeDtypeStruct((1,), jnp.float32)
    trees = [{"p": {"0": a, "1": b}}, {"p": [a, b]}, {"p": {0: a, 1: b}}, {"p": {False: a, True: b}}]
    other_kind = {0: ([spec, spec], "['p'][0]", "['p']['0']"), 1: ({"0": spec, "1": spec}, "['p']['0']", "['p'][0]")}
    with ocp.CheckpointManager(tmp_path / "run", item_handlers={"state": FerryCheckpointHandler()}) as mngr:
        for step, tree in enumerate(trees):
            mngr.save(step, args=ocp.args.Composite(state=FerrySave(tree)))
            mngr.wait_until_finished()
            assert_same(tree, mngr.restore(step)["state"])
            if step in other_kind:
                target, asked, held = other_kind[step]
                with pytest.raises(KeyError) as refused:
                    mngr.restore(step, args=ocp.args.Composite(state=FerryRestore({"p": target})))
                assert f'holds no leaf "{asked}"; closest held: "{held}"' in refused.value.args[0]


def test_a_header_or_index_over_the_caps_fails_the_async_save_call(tmp_path, monkeypatch):
    """The caps on a shard header (shard.MAX_HEADER_BYTES) and an index
    (schema.MAX_SMALL_FILE_BYTES), made small here, were checked in Orbax's commit thread,
    so an async save returned and the error came at wait_until_finished. They are checked
    as the tree is staged: the save call raises, no step is committed, the next save runs."""
    from tensorferry import shard
    from tensorferry.adapters.jax import handler
    many = {f"w{i}": np.ones(2, np.float32) for i in range(200)}  # a header of 20 KB
    monkeypatch.setattr(shard, "MAX_HEADER_BYTES", 8192)
    checkpointer = ocp.AsyncCheckpointer(FerryCheckpointHandler())
    with pytest.raises(ValueError, match="header of .* bytes, more than the 8192 a reader accepts"):
        checkpointer.save(tmp_path / "many", args=FerrySave(many))
    checkpointer.wait_until_finished()
    checkpointer.close()
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    with ocp.CheckpointManager(tmp_path / "run", options=options,
                               item_handlers={"state": FerryCheckpointHandler()}) as mngr:
        with pytest.raises(ValueError, match="header of .* bytes, more than the 8192 a reader accepts"):
            mngr.save(1, args=ocp.args.Composite(state=FerrySave(many)))
        monkeypatch.undo()
        monkeypatch.setattr(handler, "MAX_SMALL_FILE_BYTES", 8192)
        with pytest.raises(ValueError, match="index of at least .* bytes, more than the 8192 a reader accepts"):
            mngr.save(2, args=ocp.args.Composite(state=FerrySave({"w": jnp.ones(2), "note": "x" * 10_000})))
        mngr.save(3, args=ocp.args.Composite(state=FerrySave({"w": jnp.ones(2)})))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [3]
    assert not (tmp_path / "many").exists()
