"""PyTorch adapter: DCP storage, FSDP checkpointing, torch.save-like save/load, NVMe offload.

Needs the ``[torch]`` extra. Everything here only turns tensors into byte buffers
and back; the I/O is the core's.
"""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tensorferry.adapters.pytorch needs PyTorch: pip install 'tensorferry[torch]'") from exc

from .checkpointer import FSDPCheckpointer
from .dcp import DCPReader, DCPWriter
from .offload import OffloadedOptimizer, StreamedWeights, stream_weights
from .serialization import load, save

__all__ = ["DCPReader", "DCPWriter", "FSDPCheckpointer", "OffloadedOptimizer", "StreamedWeights", "load",
           "save", "stream_weights"]
