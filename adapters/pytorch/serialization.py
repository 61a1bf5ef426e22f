"""A drop-in for torch.save/torch.load of state dicts, without pickle.

Tensors go into one safetensors file at drive speed; the structure around them
(nested dicts with str or int keys, lists, tuples, numbers, strings, None) goes
into the file's metadata as JSON. Any safetensors reader can open the file.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ...engine import Engine
from ...errors import CorruptCheckpointError
from ...shard import ShardReader, ShardWriter
from .tensors import byte_source, from_array, safetensors_dtype

STRUCTURE_KEY = "tensorferry.structure"
_SCALARS = (bool, int, float, str, type(None))


def save(obj: Any, path: str | os.PathLike, *, metadata: dict[str, str] | None = None,
         engine: Engine | None = None) -> None:
    """Saves a state dict (or any nesting of dicts, lists, tuples, tensors and scalars).

    The file replaces ``path`` atomically once it is complete and durable. A tensor
    that appears several times (tied weights) is stored once.
    """
    path = os.fspath(path)
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}

    def encode(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                key = where or "tensor"
                while key in tensors:
                    key += "'"
                seen[id(value)] = key
                tensors[key] = value
            return {"tensor": seen[id(value)]}
        if isinstance(value, dict):
            items = []
            for k, v in value.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"{where or 'the object'}: key {k!r} is {type(k).__name__}; only str and int "
                                    "keys can be saved without pickle")
                items.append([k, encode(v, f"{where}.{k}" if where else str(k))])
            return {"dict": items}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [encode(v, f"{where}.{i}" if where else str(i)) for i, v in enumerate(value)]}
        if isinstance(value, float) and value != value:
            return {"float": "nan"}
        if isinstance(value, float) and value in (float("inf"), float("-inf")):
            return {"float": "inf" if value > 0 else "-inf"}
        if isinstance(value, _SCALARS):
            return {"value": value}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        raise TypeError(f"{where or 'the object'}: cannot save a {type(value).__name__} without pickle")

    structure = encode(obj, "")
    meta = dict(metadata or {})
    meta[STRUCTURE_KEY] = json.dumps(structure, separators=(",", ":"))
    with ShardWriter(path, engine, metadata=meta, atomic=True) as writer:
        for key, t in tensors.items():
            writer.add(key, safetensors_dtype(t.dtype), tuple(t.shape), byte_source(t))


def load(path: str | os.PathLike, map_location: str | torch.device | None = None, *,
         engine: Engine | None = None, verify: bool = True) -> Any:
    """Loads what :func:`save` wrote (no pickle). A plain safetensors file loads as a
    flat dict of tensors. ``map_location`` moves tensors to a device."""
    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise TypeError("map_location must be a device or a device name")
    with ShardReader(path, engine, verify=verify) as reader:
        arrays = reader.read_many()
        dtypes = {name: reader.info(name).dtype for name in reader.keys()}
        structure_text = reader.metadata.get(STRUCTURE_KEY)
    tensors = {name: from_array(a, dtypes[name]) for name, a in arrays.items()}
    if map_location is not None and torch.device(map_location).type != "cpu":
        tensors = {name: t.to(map_location) for name, t in tensors.items()}
    if structure_text is None:
        return tensors
    try:
        structure = json.loads(structure_text)
    except ValueError:
        raise CorruptCheckpointError(f"{path}: the saved structure is not valid JSON") from None

    def decode(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise CorruptCheckpointError(f"{path}: unreadable structure node {node!r}")
        (kind, value), = node.items()
        if kind == "tensor":
            if value not in tensors:
                raise CorruptCheckpointError(f"{path}: the structure names a missing tensor {value!r}")
            return tensors[value]
        if kind == "dict":
            return {k: decode(v) for k, v in value}
        if kind == "list":
            return [decode(v) for v in value]
        if kind == "tuple":
            return tuple(decode(v) for v in value)
        if kind == "float":
            return float(value)
        if kind == "value":
            return value
        if kind == "dtype":
            dtype = getattr(torch, str(value), None)
            if not isinstance(dtype, torch.dtype):
                raise CorruptCheckpointError(f"{path}: unknown dtype {value!r}")
            return dtype
        raise CorruptCheckpointError(f"{path}: unknown structure node {kind!r}")

    return decode(structure)
