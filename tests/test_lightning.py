"""TensorferryCheckpointIO under a real Lightning Trainer on the CPU: train, resume from
last.ckpt, and get the parameters of a run that was never interrupted, bit for bit."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from tensorferry.adapters.pytorch import TensorferryCheckpointIO  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.01, note: str = "tiny") -> None:
        super().__init__()
        self.save_hyperparameters()  # the hyper-parameters travel in the checkpoint
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def training_step(self, batch, _):
        x, y = batch
        self.seen += 1
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)}

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(64, 8, generator=generator)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=16)


def train(root: Path, epochs: int, plugin, resume: Path | str | None = None, strategy: str = "auto",
          devices: int = 1, save_last: bool | str = True, checkpoints: str | None = None) -> Tiny:
    pl.seed_everything(0, workers=True)
    model = Tiny()
    trainer = pl.Trainer(max_epochs=epochs, default_root_dir=root, accelerator="cpu", devices=devices,
                         strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, plugins=[plugin], deterministic=True,
                         callbacks=[ModelCheckpoint(dirpath=checkpoints or root / "ckpts", save_last=save_last,
                                                    save_top_k=1)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
        trainer.fit(model, ckpt_path=resume)
    return model


@pytest.mark.parametrize("wrap", ["plain", "asynchronous", "lightning-async"])
def test_resume_from_last_ckpt_is_bit_identical(tmp_path: Path, wrap: str) -> None:
    def plugin():
        if wrap == "lightning-async":
            return AsyncCheckpointIO(TensorferryCheckpointIO())
        return TensorferryCheckpointIO(asynchronous=wrap == "asynchronous")

    try:
        straight = train(tmp_path / "straight", 4, plugin())
    except FileNotFoundError as exc:
        if wrap == "lightning-async" and str(exc.filename).endswith(".ckpt"):
            # Lightning 2.1's ModelCheckpoint links last.ckpt to a checkpoint that its own
            # AsyncCheckpointIO has not yet written (our plugin's asynchronous=True passes).
            pytest.skip("this Lightning's AsyncCheckpointIO and save_last race in Lightning's own code")
        raise
    train(tmp_path / "interrupted", 2, plugin())
    last = tmp_path / "interrupted" / "ckpts" / "last.ckpt"
    assert last.is_file()
    from safetensors import safe_open
    with safe_open(str(last), "pt") as f:  # a safetensors file: no pickle anywhere
        assert "state_dict.net.0.weight" in f.keys()
    resumed = train(tmp_path / "interrupted", 4, plugin(), resume=last)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert int(resumed.seen) == int(straight.seen) == 16
    # save_top_k=1: the older checkpoints were removed through the plugin. Lightning's
    # AsyncCheckpointIO removes at once, and misses a file still being written (any plugin's).
    left = {p.name for p in (tmp_path / "interrupted" / "ckpts").iterdir()}
    if wrap == "lightning-async":
        assert {"epoch=3-step=16.ckpt", "last.ckpt"} <= left
    else:
        assert left == {"epoch=3-step=16.ckpt", "last.ckpt"}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["plain", "asynchronous"])
def test_checkpoints_at_a_url_go_through_fsspec(tmp_path: Path, asynchronous: bool) -> None:
    """A ModelCheckpoint dirpath on another filesystem (fsspec's memory:// here; s3:// or
    gs:// for users) is written, read and pruned through fsspec, as Lightning's own
    CheckpointIO does, in the same safetensors format; it was refused as a URL. A sharded
    checkpoint, a folder written in parallel, still needs a local or mounted filesystem."""
    import fsspec
    from safetensors.torch import load as load_safetensors

    remote = f"memory://tensorferry-lightning-{asynchronous}/ckpts"
    memory = fsspec.filesystem("memory")
    straight = train(tmp_path / "straight", 4, TensorferryCheckpointIO(asynchronous=asynchronous))
    train(tmp_path / "interrupted", 2, TensorferryCheckpointIO(asynchronous=asynchronous), checkpoints=remote)
    assert "state_dict.net.0.weight" in load_safetensors(memory.cat(f"{remote}/last.ckpt"))
    resumed = train(tmp_path / "interrupted", 4, TensorferryCheckpointIO(asynchronous=asynchronous),
                    resume=f"{remote}/last.ckpt", checkpoints=remote)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert sorted(p.rsplit("/", 1)[-1] for p in memory.ls(remote, detail=False)) == ["epoch=3-step=16.ckpt",
                                                                                    "last.ckpt"]
    memory.rm(remote.split("/ckpts")[0], recursive=True)
    with pytest.raises(ValueError, match="sharded checkpoints are directories"):
        TensorferryCheckpointIO(sharded=True).save_checkpoint({"w": torch.ones(2)}, f"{remote}/x.ckpt")
    with pytest.raises(FileNotFoundError, match="memory://nowhere/x.ckpt"):
        TensorferryCheckpointIO().load_checkpoint("memory://nowhere/x.ckpt")


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "folder"])
def test_last_ckpt_as_a_link_to_a_checkpoint_written_in_the_background(tmp_path: Path, sharded: bool) -> None:
    """ModelCheckpoint(save_last="link") links last.ckpt to the newest checkpoint as soon
    as the plugin returns, before the first write has made the folder."""
    def plugin():
        return TensorferryCheckpointIO(asynchronous=True, sharded=sharded)

    straight = train(tmp_path / "straight", 4, plugin(), save_last="link")
    train(tmp_path / "interrupted", 2, plugin(), save_last="link")
    last = tmp_path / "interrupted" / "ckpts" / "last.ckpt"
    assert last.is_symlink() and last.resolve().name == "epoch=1-step=8.ckpt"
    resumed = train(tmp_path / "interrupted", 4, plugin(), resume=last, save_last="link")
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert {p.name for p in (tmp_path / "interrupted" / "ckpts").iterdir()} == {"epoch=3-step=16.ckpt", "last.ckpt"}


@pytest.mark.slow
def test_two_processes_of_ddp_spawn_save_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's ddp_spawn pickles the plugin into each process; rank 0 writes (in the
    background), both resume from it and end where an uninterrupted run ends. Rank 0 also
    hands its weights back to the main process through the plugin (a save in a worker, a
    load in the main process)."""
    # That hand-back goes through a directory of tempfile.mkdtemp() that Lightning leaves.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))

    def run(root: Path, epochs: int, resume: Path | None = None) -> Tiny:
        return train(root, epochs, TensorferryCheckpointIO(asynchronous=True), resume, "ddp_spawn", 2)

    straight = run(tmp_path / "straight", 3)
    run(tmp_path / "interrupted", 2)
    last = tmp_path / "interrupted" / "ckpts" / "last.ckpt"
    assert TensorferryCheckpointIO().load_checkpoint(last)["global_step"] == 4  # 2 epochs of 2 batches a rank
    resumed = run(tmp_path / "interrupted", 3, last)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert {p.name for p in (tmp_path / "interrupted" / "ckpts").iterdir()} == {"epoch=2-step=6.ckpt", "last.ckpt"}


def test_the_checkpoint_reads_back_as_lightning_wrote_it(tmp_path: Path) -> None:
    train(tmp_path, 1, TensorferryCheckpointIO())
    io = TensorferryCheckpointIO()
    checkpoint = io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    assert checkpoint["epoch"] == 0 and checkpoint["global_step"] == 4
    assert checkpoint["hyper_parameters"] == {"hidden": 16, "lr": 0.01, "note": "tiny"}
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert checkpoint["lr_schedulers"][0]["step_size"] == 3
    assert any(k.startswith("ModelCheckpoint") for k in checkpoint["callbacks"])
    assert "fit_loop" in checkpoint["loops"]
    # map_location as torch.load takes it: a device, or the callable Lightning passes.
    moved = io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt", map_location=lambda storage, loc: storage)
    assert torch.equal(moved["state_dict"]["net.0.weight"], checkpoint["state_dict"]["net.0.weight"])
    assert io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt", map_location="cpu")["global_step"] == 4
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")


def test_sharded_checkpoints_and_their_removal(tmp_path: Path) -> None:
    io = TensorferryCheckpointIO(sharded=True, max_shard_bytes=1 << 20)
    state = {"state_dict": {f"w{i}": torch.randn(256, 1024) for i in range(3)}, "epoch": 2, "loops": {"a": None}}
    io.save_checkpoint(state, tmp_path / "run" / "last.ckpt")
    assert len(list((tmp_path / "run" / "last.ckpt").glob("*.safetensors"))) == 3
    back = io.load_checkpoint(tmp_path / "run" / "last.ckpt")
    assert back["epoch"] == 2 and back["loops"] == {"a": None}
    assert all(torch.equal(back["state_dict"][k], v) for k, v in state["state_dict"].items())
    io.remove_checkpoint(tmp_path / "run" / "last.ckpt")
    assert not (tmp_path / "run" / "last.ckpt").exists()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(state, tmp_path / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(TypeError, match="object"):
        TensorferryCheckpointIO().save_checkpoint({"hyper_parameters": {"bad": object()}}, tmp_path / "y.ckpt")
    background = TensorferryCheckpointIO(asynchronous=True)
    background.save_checkpoint({"hyper_parameters": {"bad": object()}}, tmp_path / "z.ckpt")
    with pytest.raises(TypeError, match="object"):  # a failed background write is raised, not lost
        background.teardown()
    assert not (tmp_path / "z.ckpt").exists()


@pytest.mark.parametrize("sharded", [False, True])
def test_a_module_is_made_from_a_checkpoint_as_load_from_checkpoint_does(tmp_path: Path, sharded: bool) -> None:
    plugin = TensorferryCheckpointIO(sharded=sharded)
    trained = train(tmp_path, 2, plugin)
    last = tmp_path / "ckpts" / "last.ckpt"
    model = plugin.load_from_checkpoint(Tiny, last)
    assert isinstance(model, Tiny) and model.hparams.hidden == 16 and model.hparams.note == "tiny"
    for (name, a), (_, b) in zip(trained.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    changed = plugin.load_from_checkpoint(Tiny, last, note="changed")  # keyword arguments override
    assert changed.hparams.note == "changed" and torch.equal(changed.net[0].weight, trained.net[0].weight)
    with pytest.raises(RuntimeError, match="size mismatch"):  # the saved weights do not fit this shape
        plugin.load_from_checkpoint(Tiny, last, hidden=32)
    with pytest.raises(TypeError, match="neither"):
        plugin.load_from_checkpoint(torch.nn.Linear, last)
