"""One home for I/O settings: defaults, environment overrides and DeepSpeed's "aio" section."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import operator
import os
import re
from typing import Any, Iterator, Mapping

from .errors import ConfigError

BACKENDS = ("auto", "io_uring", "threads")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_size(value: int | str, name: str = "size") -> int:
    """Reads a byte count such as ``1048576``, ``"1M"``, ``"512KiB"`` or ``"2G"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a byte count, got {value!r}")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", str(value).lower())
    if not match:
        raise ConfigError(f"{name}: cannot read {value!r} as a byte count (examples: 4096, 1M, 2GiB)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def size_arg(text: str) -> int:
    """An argparse ``type=`` for a byte count of at least 1 MiB (``"64M"``): a bad one is
    a usage error, refused before any work starts."""
    try:
        value = parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1 << 20:
        raise argparse.ArgumentTypeError(f"{text}: at least 1M, please")
    return value


def count_arg(text: str) -> int:
    """An argparse ``type=`` for a whole number of at least 1 (rounds, arrays)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def counts_arg(text: str) -> list[int]:
    """An argparse ``type=`` for comma-separated counts (``"64,4096"``), each as :func:`count_arg`."""
    return [count_arg(part.strip()) for part in text.split(",")]


def _parse_count(value: Any, name: str) -> int:
    """Reads a count: an integer (numpy's too) or its digits (``"8"``). A float is refused,
    even ``8.0``, as :func:`parse_size` refuses one (``int()`` made 4.9 into 4 unsaid); a
    bool too."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    try:
        return int(value) if isinstance(value, str) else operator.index(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None


def _parse_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{name}: expected a boolean, got {value!r}")


@dataclasses.dataclass(frozen=True)
class IOConfig:
    """Settings of an :class:`Engine`.

    Args:
        block_size: requests larger than this are split into blocks of this size.
        queue_depth: blocks' bytes kept in flight at once (io_uring backend); requests
            smaller than a block, up to four per block.
        threads: worker threads (threads backend).
        direct: use O_DIRECT for the aligned middle of each request where the
            filesystem allows it.
        backend: ``"auto"`` (io_uring if this kernel and sandbox allow it, else
            threads), ``"io_uring"`` or ``"threads"``.
        use_gds: how device (CUDA) buffers are read and written: ``None`` (auto,
            ``"auto"`` in the environment) through kvikio if it is installed, with
            GPUDirect Storage where cuFile can and kvikio's compatibility mode
            otherwise; ``True`` requires GPUDirect Storage (the engine refuses to start
            without it); ``False`` refuses device buffers. ``Engine.gds_mode`` says
            which path runs (``tensorferry.gds``).

    Every field can be overridden by an environment variable ``TENSORFERRY_<FIELD>``
    (``TENSORFERRY_BLOCK_SIZE=4M``); :func:`IOConfig.from_env` reads them.
    """

    block_size: int = 1 << 20
    queue_depth: int = 32
    threads: int = 4
    direct: bool = True
    backend: str = "auto"
    use_gds: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", parse_size(self.block_size, "block_size"))
        object.__setattr__(self, "direct", _parse_bool(self.direct, "direct"))
        if self.use_gds is not None and str(self.use_gds).strip().lower() != "auto":
            object.__setattr__(self, "use_gds", _parse_bool(self.use_gds, "use_gds"))
        else:
            object.__setattr__(self, "use_gds", None)
        for name in ("queue_depth", "threads"):
            object.__setattr__(self, name, _parse_count(getattr(self, name), name))
        if not 4096 <= self.block_size <= 1 << 30:
            raise ConfigError(f"block_size: {self.block_size} is outside 4 KiB .. 1 GiB")
        if not 1 <= self.queue_depth <= 4096:
            raise ConfigError(f"queue_depth: {self.queue_depth} is outside 1 .. 4096")
        if not 1 <= self.threads <= 1024:
            raise ConfigError(f"threads: {self.threads} is outside 1 .. 1024")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")

    def replace(self, **changes: Any) -> "IOConfig":
        """A copy with some fields changed; unknown names raise :class:`ConfigError`."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, base: "IOConfig | None" = None, environ: Mapping[str, str] | None = None) -> "IOConfig":
        """``base`` (or the defaults) with ``TENSORFERRY_*`` environment variables applied."""
        environ = os.environ if environ is None else environ
        changes = {}
        for field in dataclasses.fields(cls):
            key = f"TENSORFERRY_{field.name.upper()}"
            if key in environ:
                changes[field.name] = environ[key]
        return (base or cls()).replace(**changes)

    @classmethod
    def from_deepspeed(cls, config: Mapping[str, Any]) -> "IOConfig":
        """Reads DeepSpeed's ``"aio"`` section, given alone or in the whole DeepSpeed config.

        ``block_size``, ``queue_depth``, ``thread_count`` (or ``intra_op_parallelism``)
        and ``use_gds`` carry over (``use_gds: true`` makes the engine require GPUDirect
        Storage, refusing to start where it cannot run). ``single_submit`` and ``overlap_events`` are
        accepted and have no counterpart: submission here is always batched and
        always overlapped. A whole config (one with ``"train_batch_size"``,
        ``"zero_optimization"`` or another of DeepSpeed's top-level settings) without an
        ``"aio"`` section gives the defaults, as DeepSpeed reads it.
        """
        section = _deepspeed_aio_section(config)
        unknown = set(section) - _DEEPSPEED_AIO_KEYS
        if unknown:
            raise ConfigError(f"unknown DeepSpeed aio setting(s): {', '.join(sorted(unknown))}")
        changes: dict[str, Any] = {}
        if "block_size" in section:
            changes["block_size"] = section["block_size"]
        if "queue_depth" in section:
            changes["queue_depth"] = section["queue_depth"]
        threads = section.get("intra_op_parallelism", section.get("thread_count"))
        if threads is not None:
            changes["threads"] = threads
        if "use_gds" in section:
            changes["use_gds"] = section["use_gds"]
        for flag in ("single_submit", "overlap_events"):
            if flag in section:
                _parse_bool(section[flag], flag)
        return cls().replace(**changes)

    def to_deepspeed(self) -> dict[str, Any]:
        """This configuration as a DeepSpeed ``"aio"`` section."""
        return {"aio": {"block_size": self.block_size, "queue_depth": self.queue_depth,
                        "intra_op_parallelism": self.threads, "single_submit": False,
                        "overlap_events": True, "use_gds": self.use_gds}}


_DEEPSPEED_AIO_KEYS = frozenset({"block_size", "queue_depth", "thread_count", "intra_op_parallelism",
                                  "single_submit", "overlap_events", "use_gds"})
# DeepSpeed's own top-level settings (deepspeed/runtime/constants.py and its sections'):
# a dict with one of them is a whole config, whose other keys are none of the aio section's.
_DEEPSPEED_TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "fp16", "bf16", "bfloat16", "amp", "torch_autocast", "zero_optimization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "gradient_clipping", "prescale_gradients", "gradient_predivide_factor",
    "communication_data_type", "seq_parallel_communication_data_type", "steps_per_print", "wall_clock_breakdown",
    "memory_breakdown", "dump_state", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb",
    "csv_monitor", "comms_logger", "checkpoint", "data_types", "sparse_attention", "pipeline", "elasticity",
    "compression_training", "data_efficiency", "curriculum_learning", "autotuning", "nebula", "hybrid_engine",
    "weight_quantization", "compile", "dataloader_drop_last", "disable_allgather",
})


def _deepspeed_aio_section(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``"aio"`` section of a whole DeepSpeed config (empty where it has none, or a
    null one, as DeepSpeed takes it), or ``config`` itself where it is a bare section."""
    if "aio" not in config and not set(config) & _DEEPSPEED_TOP_LEVEL_KEYS:
        return config
    stray = sorted(set(config) & _DEEPSPEED_AIO_KEYS)
    if stray:  # DeepSpeed reads them only inside "aio": taken here, this engine would differ from its
        raise ConfigError(f"aio setting(s) {', '.join(stray)} at the top of a whole DeepSpeed config: "
                          "they belong in its \"aio\" section")
    return config.get("aio") or {}


_default: IOConfig | None = None


def default_config() -> IOConfig:
    """The configuration engines get when none is given: defaults plus environment."""
    return _default if _default is not None else IOConfig.from_env()


@contextlib.contextmanager
def config_override(**changes: Any) -> Iterator[IOConfig]:
    """Within the block, :func:`default_config` has these fields changed (for tests)."""
    global _default
    previous = _default
    _default = default_config().replace(**changes)
    try:
        yield _default
    finally:
        _default = previous
