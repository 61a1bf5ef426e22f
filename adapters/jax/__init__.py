"""JAX adapter: an Orbax checkpoint handler whose I/O runs in the core, and
cross-framework loading of safetensors files into JAX arrays.

Needs the ``[jax]`` extra (jax, orbax-checkpoint).

A consolidated file written by :func:`save_pytree` is a plain safetensors file:
torch reads it with ``tensorferry.adapters.pytorch.load(path)`` (or
``safetensors.torch.load_file``), and :func:`load_pytree` reads files written by
``tensorferry.adapters.pytorch.save`` / ``FSDPCheckpointer.save_consolidated``.
"""

try:
    import jax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tensorferry.adapters.jax needs JAX and Orbax: pip install 'tensorferry[jax]'") from exc
try:
    import orbax.checkpoint._src.futures.future  # noqa: F401
except ImportError as exc:
    from importlib.metadata import version
    raise ImportError(f"tensorferry.adapters.jax needs orbax-checkpoint 0.11.1 or later, not "
                      f"{version('orbax-checkpoint')}: pip install 'tensorferry[jax]'") from exc

from .handler import FerryCheckpointHandler, FerryRestore, FerrySave, load_pytree, save_pytree

__all__ = ["FerryCheckpointHandler", "FerryRestore", "FerrySave", "load_pytree", "save_pytree"]
