"""PyTorch adapter: DCP storage, FSDP checkpointing, torch.save-like save/load, NVMe offload,
a GDS-backed Dataset, a Lightning CheckpointIO plugin.

Needs the ``[torch]`` extra. Everything here only turns tensors into byte buffers
and back; the I/O is the core's (kvikio's on GDSDataset's GDS path).
"""

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tensorferry.adapters.pytorch needs PyTorch: pip install 'tensorferry[torch]'") from exc
if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 7):
    # DCPWriter's .metadata needs DCP's transform_descriptors, and DCP saves failed without them.
    raise ImportError(f"tensorferry.adapters.pytorch needs torch 2.7 or later, not {torch.__version__}: "
                      "pip install 'tensorferry[torch]'")

from .checkpointer import FSDPCheckpointer
from .data import GDSDataset, GDSWorkerWarning
from .dcp import DCPReader, DCPWriter
from .offload import OffloadedOptimizer, StreamedWeights, stream_weights
from .serialization import load, load_checkpoint, save, save_checkpoint

__all__ = ["DCPReader", "DCPWriter", "FSDPCheckpointer", "GDSDataset", "GDSWorkerWarning", "OffloadedOptimizer",
           "StreamedWeights", "TensorferryCheckpointIO", "load", "load_checkpoint", "save", "save_checkpoint",
           "stream_weights"]


def __getattr__(name: str):
    # Imported on first use: Lightning is an extra of its own, and heavy to import.
    if name == "TensorferryCheckpointIO":
        from .lightning import TensorferryCheckpointIO
        return TensorferryCheckpointIO
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
