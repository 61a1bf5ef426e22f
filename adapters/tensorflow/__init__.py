"""TensorFlow adapter: tf.data datasets whose reads run in the core, in parallel, without the GIL.

Needs the ``[tensorflow]`` extra.
"""

try:
    import tensorflow  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tensorferry.adapters.tensorflow needs TensorFlow: "
                      "pip install 'tensorferry[tensorflow]'") from exc

from .data import _native_ops, make_dataset, tfrecord_records

# Registered at import, not at the first make_dataset: a process that runs these datasets'
# graphs without building them (a tf.data service worker) needs only import this module.
_native_ops()

__all__ = ["make_dataset", "tfrecord_records"]
