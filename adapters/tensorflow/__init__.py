"""TensorFlow adapter: tf.data datasets whose reads run in the core, in parallel, without the GIL.

Needs the ``[tensorflow]`` extra.
"""

try:
    import tensorflow  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tensorferry.adapters.tensorflow needs TensorFlow: "
                      "pip install 'tensorferry[tensorflow]'") from exc

from .data import make_dataset, tfrecord_records

__all__ = ["make_dataset", "tfrecord_records"]
