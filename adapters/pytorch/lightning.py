"""Lightning checkpoints through tensorferry: a ``CheckpointIO`` plugin, no pickle.

``Trainer(plugins=[TensorferryCheckpointIO()])`` writes each checkpoint Lightning
makes (``epoch=1-step=20.ckpt``, ``last.ckpt``) as one safetensors file through the
core (:func:`tensorferry.adapters.pytorch.save`): the tensors at drive speed, the
entries around them (loops, callbacks, optimizer param groups, hyper-parameters) as
JSON in its metadata. With ``asynchronous=True`` (or wrapped in Lightning's
``AsyncCheckpointIO``) it writes in a background thread. Checkpoints at a URL (``s3://``)
go through fsspec, as Lightning's own. Needs the ``[lightning]`` extra.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from copy import deepcopy
from typing import Any, Callable, Mapping

import numpy as np
import torch

try:
    import fsspec
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("TensorferryCheckpointIO needs Lightning: pip install 'tensorferry[lightning]'") from exc

from ...checkpoint import DEFAULT_SHARD_BYTES
from ...engine import Engine, absolute_local_path, is_url
from ...pools import SaveFuture, ThreadPool
from ...temporaries import wait_for_discards
from .serialization import MapLocation, _storage_key, load, save, save_checkpoint


class TensorferryCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves and loads through tensorferry.

    Args:
        engine: the :class:`tensorferry.Engine` to use (default: the shared one).
        verify: check every tensor's checksum on load.
        sharded: write each checkpoint as a directory of shard files written in parallel
            (:func:`tensorferry.adapters.pytorch.save_checkpoint`), for large models,
            instead of one file.
        max_shard_bytes: with ``sharded``, about this many bytes per shard file.
        asynchronous: return from ``save_checkpoint`` once the tensors are copied, and
            write in a background thread. Removals queue behind the saves before them
            (Lightning's ``AsyncCheckpointIO`` removes at once, so that a checkpoint still
            being written when ``save_top_k`` drops it is left behind); once one fails,
            nothing queued behind it runs (the removal of the checkpoint it was to replace,
            say), and the next save, removal, load or ``wait`` raises its error. A failure
            nobody received (the program ended without ``teardown``) is reported at exit.

    Everything in a Lightning checkpoint must be what
    :func:`tensorferry.adapters.pytorch.save` takes (tensors, numpy arrays, dicts with
    str or int keys, lists, tuples, numbers, strings, None); anything else (an object in
    the hyper-parameters, say) raises ``TypeError`` naming where it is. Lightning's
    ``LightningModule.load_from_checkpoint`` reads with ``torch.load`` directly: make the
    module with :meth:`load_from_checkpoint` instead, or resume with
    ``Trainer.fit(ckpt_path=...)``.
    """

    def __init__(self, *, engine: Engine | None = None, verify: bool = True, sharded: bool = False,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, asynchronous: bool = False) -> None:
        self.engine = engine
        self.verify = verify
        self.sharded = sharded
        self.max_shard_bytes = max_shard_bytes
        self.asynchronous = asynchronous
        self._writer: ThreadPool | None = None
        self._pending: list[concurrent.futures.Future] = []
        # The queued job that failed, until its error is raised: the jobs behind it are skipped.
        self._failed: concurrent.futures.Future | None = None

    def _later(self, work: Callable[..., None], *args: Any, saving_to: str | None = None) -> None:
        """Runs ``work`` now, or with ``asynchronous`` after everything queued before it.
        A write (``saving_to`` its path) that fails and whose error nobody receives is
        reported at exit."""
        if not self.asynchronous:
            work(*args)
            return
        if self._failed is not None:  # an earlier job failed: say so now, not at teardown
            self.wait()
        self._pending = [f for f in self._pending if not f.done()]
        if self._writer is None:
            self._writer = ThreadPool(max_workers=1, thread_name_prefix="tensorferry-ckpt")
        future = SaveFuture(saving_to) if saving_to is not None else concurrent.futures.Future()
        self._writer.submit(self._run_unless_failed, future, work, *args)
        self._pending.append(future)

    def _run_unless_failed(self, future: concurrent.futures.Future, work: Callable[..., None], *args: Any) -> None:
        # Behind a failed write, a removal would delete the checkpoint that write was to
        # replace (save_top_k=1), and a later write may fail the same way: skip them all.
        if self._failed is not None:
            future.set_result(None)
            return
        try:
            work(*args)
        except BaseException as exc:
            self._failed = future  # before it completes: wait() finds it once every queued job is done
            future.set_exception(exc)
        else:
            future.set_result(None)

    def wait(self) -> None:
        """Waits for the queued writes and removals; raises the first one's error."""
        # Forgotten only once done: a Ctrl-C during the wait left them untracked, and a load
        # that waits for them first read the checkpoint a queued write was still replacing.
        concurrent.futures.wait(self._pending)  # those queued behind a failure are skipped: soon done
        self._pending = []
        failed, self._failed = self._failed, None  # what is queued from now on runs
        if failed is not None:
            failed.result()  # raises its error
        wait_for_discards()  # replaced checkpoints, whose files are freed in the background

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Writes ``checkpoint`` to ``path``, atomically (a reader never sees half of it).
        A URL of another filesystem (``s3://``, ``gs://``) is written through fsspec, as
        Lightning's own ``CheckpointIO`` writes it: the same file, streamed, at the
        network's speed (``sharded`` needs a local or mounted filesystem)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r})")
        if self.asynchronous:
            checkpoint = _snapshot(checkpoint)
        remote = _remote(path)
        if remote is not None:
            if self.sharded:
                raise ValueError(f"{os.fspath(path)!r}: sharded checkpoints are directories written in parallel "
                                 "to a local or mounted filesystem; save to a URL without sharded=True")
            filesystem, inner = remote
            filesystem.makedirs(os.path.dirname(inner), exist_ok=True)
            self._later(self._write_remote, checkpoint, filesystem, inner, saving_to=os.fspath(path))
            return
        # Made before returning: ModelCheckpoint(save_last="link") links last.ckpt to
        # the checkpoint as soon as this returns, and a link needs its folder.
        path = _local_path(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._later(self._write, checkpoint, path, _link_at(path), saving_to=path)

    def _write(self, checkpoint: dict[str, Any], path: str, link_when_queued: tuple | None) -> None:
        def superseded() -> bool:
            # ModelCheckpoint(save_last="link") links last.ckpt to a newer checkpoint as soon as the
            # save of an older last.ckpt is queued; the link is what Lightning (and the sync mode) ends
            # with. Asked just before the rename: only a link made between the two can still be lost.
            link_now = _link_at(path)
            return link_now is not None and link_now != link_when_queued

        if self.sharded:
            save_checkpoint(path, checkpoint, engine=self.engine, max_shard_bytes=self.max_shard_bytes,
                            overwrite=True, superseded=superseded)
        else:
            save(checkpoint, path, engine=self.engine, superseded=superseded)

    def _write_remote(self, checkpoint: dict[str, Any], filesystem: Any, path: str) -> None:
        # In a transaction, as Lightning writes: the file appears once it is whole.
        with filesystem.transaction, filesystem.open(path, "wb") as stream:
            save(checkpoint, stream, engine=self.engine)

    def load_checkpoint(self, path: str | os.PathLike, map_location: MapLocation = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Reads a checkpoint back as it was saved; ``map_location`` as ``torch.load``
        takes it. ``weights_only`` changes nothing: nothing is unpickled, ever."""
        self.wait()
        remote = _remote(path)
        if remote is not None:
            filesystem, inner = remote
            if not filesystem.exists(inner):
                raise FileNotFoundError(f"Checkpoint file not found: {os.fspath(path)}")
            with filesystem.open(inner, "rb") as stream:
                return load(stream, map_location, verify=self.verify)
        local = _local_path(path)
        if not os.path.exists(local):
            raise FileNotFoundError(f"Checkpoint file not found: {os.fspath(path)}")
        return load(local, map_location, engine=self.engine, verify=self.verify)

    def load_from_checkpoint(self, cls: type, path: str | os.PathLike, map_location: MapLocation = None,
                             strict: bool | None = None, **kwargs: Any) -> Any:
        """``cls.load_from_checkpoint(path, ...)`` for a checkpoint this plugin wrote
        (Lightning's own reads with ``torch.load``): a ``LightningModule`` (or
        ``LightningDataModule``) subclass made from the saved hyper-parameters, ``kwargs``
        overriding them, with its state loaded, on the device its tensors were loaded to.

        Example::

            model = TensorferryCheckpointIO().load_from_checkpoint(MyModel, "ckpts/last.ckpt")
        """
        import lightning.pytorch as pl
        from lightning.pytorch.core.saving import _load_state  # what load_from_checkpoint does after torch.load

        if not issubclass(cls, (pl.LightningModule, pl.LightningDataModule)):
            raise TypeError(f"{cls.__name__} is neither a LightningModule nor a LightningDataModule")
        checkpoint = self.load_checkpoint(path, map_location)
        checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(kwargs)
        if issubclass(cls, pl.LightningDataModule):
            return _load_state(cls, checkpoint, **kwargs)
        if strict is None and not hasattr(pl.LightningModule, "strict_loading"):
            strict = True  # Lightning before 2.2 takes no None (the module's strict_loading came later)
        model = _load_state(cls, checkpoint, strict=strict, **kwargs)
        tensors = [t for t in checkpoint["state_dict"].values() if isinstance(t, torch.Tensor)]
        return model.to(tensors[0].device) if tensors else model

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Deletes a checkpoint this plugin wrote (a file, or a directory with ``sharded``)."""
        remote = _remote(path)
        self._later(_remove, *(remote or (None, _local_path(path))))


def _remote(path: str | os.PathLike) -> tuple[Any, str] | None:
    """(fsspec filesystem, path in it) for a URL of a filesystem other than the local one,
    opened as Lightning opens it; None for a local path."""
    text = os.fspath(path)
    if not is_url(text) or fsspec.utils.get_protocol(text) == "file":
        return None
    return fsspec.core.url_to_fs(text)


def _local_path(path: str | os.PathLike) -> str:
    """A local path as Lightning's ``TorchCheckpointIO`` (fsspec) takes it: ``~`` expanded,
    a ``file://`` URL as its path, made absolute as the kernel resolves it (``missing/../c``
    is ``c``, without ``missing`` existing)."""
    text = os.fspath(path)
    if is_url(text):  # file://, which _remote leaves to the engine
        text = fsspec.core.url_to_fs(text)[1]
    return absolute_local_path(os.path.expanduser(text))


def _link_at(path: str) -> tuple | None:
    """What tells the symbolic link at ``path`` from any other made there later; None
    where ``path`` is no link."""
    try:
        stat = os.lstat(path)
        return (stat.st_dev, stat.st_ino, stat.st_ctime_ns, os.readlink(path)) if os.path.islink(path) else None
    except FileNotFoundError:
        return None


def _remove(filesystem: Any | None, path: str) -> None:
    """Removes ``path`` from ``filesystem`` (fsspec's), or from the local one if None."""
    if filesystem is not None:
        if filesystem.exists(path):
            filesystem.rm(path, recursive=True)
    elif os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _snapshot(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of every tensor and numpy array, taken now (training goes on while it is
    written; dicts, lists and tuples are rebuilt around the copies, and everything else
    :func:`save` takes is immutable); tensors that share memory (tied weights), and an
    array found twice, share their copy too."""
    from lightning_utilities.core.apply_func import apply_to_collection

    copies: dict[Any, torch.Tensor | np.ndarray] = {}

    def copy(value: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        # Keyed as save() tells them apart: tensors by their memory, arrays by identity.
        key = _storage_key(value) if isinstance(value, torch.Tensor) else ("object", id(value))
        if key not in copies:
            copies[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value.copy()
        return copies[key]

    snapshot = apply_to_collection(checkpoint, (torch.Tensor, np.ndarray), copy)
    _keep_state_dict_metadata(checkpoint, snapshot)
    return snapshot


def _keep_state_dict_metadata(original: Any, rebuilt: Any) -> None:
    """Puts back the ``_metadata`` of each state dict in ``original`` on its copy in
    ``rebuilt``: apply_to_collection rebuilds a mapping without its attributes, and
    ``load_state_dict`` hands each module its saved version from there (torch.load keeps it)."""
    if isinstance(original, Mapping) and isinstance(rebuilt, Mapping):
        if hasattr(original, "_metadata"):
            rebuilt._metadata = deepcopy(original._metadata)  # type: ignore[attr-defined]
        for key, value in original.items():
            _keep_state_dict_metadata(value, rebuilt.get(key))
    elif isinstance(original, (list, tuple)) and isinstance(rebuilt, (list, tuple)):
        for value, copied in zip(original, rebuilt):
            _keep_state_dict_metadata(value, copied)


__all__ = ["TensorferryCheckpointIO"]
