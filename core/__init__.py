"""tensorferry: tensors between GPU memory, host memory and NVMe at the speed of the drive.

``import tensorferry`` needs numpy only; framework adapters live in
``tensorferry.adapters.{pytorch,tensorflow,jax}``.
"""

from .buffers import PinnedMemoryWarning, PinnedPool, alloc_pinned
from .config import IOConfig, config_override, default_config, parse_size
from .checkpoint import (PendingCheckpoint, latest_checkpoint, list_checkpoints, load_checkpoint,
                         prune_checkpoints, read_manifest, save_checkpoint, verify_checkpoint)
from .engine import DirectIOFallbackWarning, Engine, File, IOFuture, default_engine, io_uring_probe, open
from .shard import ShardInfo, ShardReader, ShardWriter, StreamReader, TensorInfo, gc_paused
from .data import FileSource
from .offload import OffloadStore
from .errors import (CheckpointNotFoundError, CheckpointSkippedWarning, ConfigError, CorruptCheckpointError,
                     DurabilityWarning, EngineClosedError, GDSUnavailableError, RetentionWarning, RewrittenFileWarning,
                     TensorferryError, TensorferryIOError)

__version__ = "0.1.0"

__all__ = [
    "CheckpointNotFoundError", "ConfigError", "CorruptCheckpointError", "DirectIOFallbackWarning",
    "Engine", "EngineClosedError", "File", "IOConfig", "IOFuture", "PinnedMemoryWarning", "PinnedPool",
    "TensorferryError", "TensorferryIOError", "alloc_pinned", "config_override", "default_config",
    "io_uring_probe", "open", "parse_size",
    "PendingCheckpoint", "ShardInfo", "ShardReader", "ShardWriter", "StreamReader", "TensorInfo", "default_engine",
    "latest_checkpoint", "list_checkpoints", "load_checkpoint", "prune_checkpoints", "read_manifest",
    "save_checkpoint", "verify_checkpoint", "FileSource", "OffloadStore", "GDSUnavailableError",
    "CheckpointSkippedWarning", "DurabilityWarning", "RetentionWarning", "RewrittenFileWarning", "gc_paused",
]
