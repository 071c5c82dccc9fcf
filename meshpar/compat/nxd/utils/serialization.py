"""``neuronx_distributed.utils.serialization``: NxD's split of a nested Python object into its tensors and a
tensor-free skeleton (what its pipeline sends between stages), its base64 pickling helpers and its loss lookup by
``output_loss_value_spec``.

Lists, tuples (named tuples too), sets and dicts are rebuilt with each tensor replaced by a :class:`TensorMeta`
stub; any other object is kept as it is (the same object); a tensor met twice gets one stub.
"""

from __future__ import annotations

import base64
import collections
import pickle
from enum import Enum
from typing import Any, NamedTuple

import torch

_ATOMS = (bool, str, bytes, bytearray, int, float, Enum, type(None))


def compress_to_string(obj: Any) -> str:
    """``obj`` pickled and base64-encoded."""
    return base64.b64encode(pickle.dumps(obj)).decode("utf-8")


def uncompress_from_string(serialized_data_string: str) -> Any:
    return pickle.loads(base64.b64decode(serialized_data_string.encode("utf-8")))


def is_instance_namedtuple(iterable: Any) -> bool:
    return isinstance(iterable, tuple) and hasattr(iterable, "_fields")


def find_loss_from_output_and_spec(output_val: Any, spec_val: Any) -> torch.Tensor | None:
    """The loss tensor ``spec_val`` marks in ``output_val``: ``True`` marks the value itself, a tuple / list / dict
    of the output's shape marks one of its items, ``False`` / ``None`` none. Shapes that do not match, a spec that
    marks nothing and a marked value that is not a tensor are refused."""
    if spec_val is False or spec_val is None:
        return None
    if spec_val is True:
        if not isinstance(output_val, torch.Tensor):
            raise RuntimeError(f"Loss spec must specify a tensor value but got {output_val}")
        return output_val
    if isinstance(spec_val, (tuple, list)):
        if not isinstance(output_val, (tuple, list)) or len(output_val) != len(spec_val):
            raise RuntimeError(f"Output value {output_val} must match the loss specification {spec_val}")
        pairs = zip(output_val, spec_val, strict=True)
    elif isinstance(spec_val, dict):
        if not isinstance(output_val, dict) or set(output_val) != set(spec_val):
            raise RuntimeError(f"Output value {output_val} must match the keys of the loss specification {spec_val}")
        pairs = ((output_val[key], spec) for key, spec in spec_val.items())
    else:
        raise RuntimeError(f"Unsupported type {type(spec_val)} in loss specification")
    for value, spec in pairs:
        loss = find_loss_from_output_and_spec(value, spec)
        if loss is not None:
            return loss
    raise RuntimeError(f"Did not find loss value in specification {spec_val}")


class TensorMeta(NamedTuple):
    """A tensor's place in the tensor list and what the receiver needs to rebuild it."""

    tensor_index: int
    dtype: torch.dtype
    shape: torch.Size
    requires_grad: bool
    device: torch.device


def _rebuild(obj: Any, items: list[Any]) -> Any:
    return obj.__class__(*items) if is_instance_namedtuple(obj) else obj.__class__(items)


def _empty_like_dict(obj: dict) -> dict:
    if isinstance(obj, collections.defaultdict):
        return collections.defaultdict(obj.default_factory)
    return type(obj)()


class SerializationManager:
    """``serialize(obj)`` -> ``(skeleton, tensors, stubs)``; ``deserialize(skeleton, tensors)`` -> the object."""

    def serialize(self, obj: Any, return_stub_list: bool = True) -> tuple[Any, ...]:
        tensors: list[torch.Tensor] = []
        stubs: list[TensorMeta] = []
        try:
            skeleton = self._strip(obj, {}, tensors, stubs)
        except RecursionError as error:
            raise RuntimeError(f"{type(obj).__name__} is nested too deeply to serialize") from error
        return (skeleton, tensors, stubs) if return_stub_list else (skeleton, tensors)

    def deserialize(self, stubbed_obj: Any, tensors: list[torch.Tensor]) -> Any:
        return self._traverse(stubbed_obj, lambda stub: tensors[stub.tensor_index])

    def extract_stubs(self, stubbed_obj: Any) -> list[TensorMeta]:
        stubs: list[TensorMeta] = []

        def keep(stub: TensorMeta) -> TensorMeta:
            stubs.append(stub)
            return stub

        self._traverse(stubbed_obj, keep)
        return stubs

    def _traverse(self, obj: Any, on_stub: Any) -> Any:
        if isinstance(obj, TensorMeta):
            return on_stub(obj)
        if isinstance(obj, _ATOMS):
            return obj
        if isinstance(obj, (list, tuple, set)) and not isinstance(obj, torch.Size):
            return _rebuild(obj, [self._traverse(item, on_stub) for item in obj])
        if isinstance(obj, dict):
            out = _empty_like_dict(obj)
            for key, value in obj.items():
                out[self._traverse(key, on_stub)] = self._traverse(value, on_stub)
            return out
        return obj

    def _strip(self, obj: Any, memo: dict[int, Any], tensors: list[torch.Tensor], stubs: list[TensorMeta]) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        if isinstance(obj, _ATOMS):
            return obj
        if isinstance(obj, torch.Tensor):
            stub = TensorMeta(len(tensors), obj.dtype, obj.size(), obj.requires_grad, obj.device)
            tensors.append(obj)
            stubs.append(stub)
            out: Any = stub
        elif isinstance(obj, (list, tuple, set)) and not isinstance(obj, torch.Size):
            out = _rebuild(obj, [self._strip(item, memo, tensors, stubs) for item in obj])
        elif isinstance(obj, dict):
            out = _empty_like_dict(obj)
            for key, value in obj.items():
                out[self._strip(key, memo, tensors, stubs)] = self._strip(value, memo, tensors, stubs)
        else:
            out = obj  # any other object travels as it is
        memo[id(obj)] = out
        return out


__all__ = [
    "SerializationManager",
    "TensorMeta",
    "compress_to_string",
    "find_loss_from_output_and_spec",
    "is_instance_namedtuple",
    "uncompress_from_string",
]
