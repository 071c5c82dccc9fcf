"""torch_xla's split-tensor checkpoints ("xser": what NxD writes with ``use_xser=True``), read and written without
torch_xla.

Such a checkpoint file is a pickled object in which every tensor was replaced by a
``torch_xla.utils.serialization.TensorReference`` (holding only its index ``tid``); the tensors lie beside it, one
``torch.save`` file each: ``<file>.tensors/tensor_<tid>.pt``. Under expert parallelism NxD writes the tensors that
are not experts' only with ep rank 0 (``..._ep_rank_00_...`` files), and the other ep ranks' references point there.

:func:`load` rebuilds the object with its tensors. :func:`save` writes the format as torch_xla does (every tensor
split out, as NxD's are on its devices): the object file's references name torch_xla's class, so torch_xla (NxD on
Neuron) reads it back, and so does :func:`load`.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import types
from typing import Any

import torch

from meshpar._compat import tree_map_only

_XLA_MODULE, _XLA_CLASS = "torch_xla.utils.serialization", "TensorReference"


class TensorReference:
    """Stands in for torch_xla's class while unpickling and pickling (its state: ``tid``)."""

    tid: int

    def __init__(self, tid: int) -> None:
        self.tid = tid


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (_XLA_MODULE, _XLA_CLASS):
            return TensorReference
        return super().find_class(module, name)


class _Pickler(pickle._Pickler):
    """The standard (pure-Python) pickler, writing the stand-in class under torch_xla's module and name (the
    standard one refuses a class whose module cannot be imported)."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is not TensorReference:
            super().save_global(obj, name)
            return
        if self.proto >= 4:
            self.save(_XLA_MODULE)
            self.save(_XLA_CLASS)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{_XLA_MODULE}\n{_XLA_CLASS}\n".encode())
        self.memoize(obj)


# torch.load and torch.save take a pickle module: the standard one with torch_xla's class mapped to the stand-in
_PICKLE = types.SimpleNamespace(
    __name__="pickle", Unpickler=_Unpickler, Pickler=_Pickler, load=pickle.load, dumps=pickle.dumps
)


def tensors_folder(path: str | os.PathLike) -> str:
    return f"{os.fspath(path)}.tensors"


def is_xser_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the object file of a split-tensor checkpoint (its tensors' folder beside it)."""
    return os.path.isdir(tensors_folder(path))


def _tensor(path: str, tid: int, map_location: Any) -> torch.Tensor:
    file = os.path.join(tensors_folder(path), f"tensor_{tid}.pt")
    if not os.path.exists(file):  # not an expert's tensor on an ep rank other than 0: written by ep rank 0
        shared = os.path.join(tensors_folder(re.sub(r"ep_rank_\d{2}", "ep_rank_00", path)), f"tensor_{tid}.pt")
        if not os.path.exists(shared):
            raise FileNotFoundError(f"{path}: tensor {tid} is in neither {file} nor {shared}")
        file = shared
    return torch.load(file, map_location=map_location, weights_only=True)


def load(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """The object saved at ``path`` in the split-tensor format, every tensor read back."""
    path = os.fspath(path)
    structure = torch.load(path, map_location=map_location, pickle_module=_PICKLE, weights_only=False)
    return tree_map_only(TensorReference, lambda ref: _tensor(path, ref.tid, map_location), structure)


def save(data: Any, path: str | os.PathLike) -> None:
    """Write ``data`` at ``path`` in the split-tensor format: each tensor (on the CPU) to
    ``<path>.tensors/tensor_<tid>.pt``, numbered in the order a traversal of ``data`` meets them, and the object with
    a reference in its place to ``path``. Both are written beside the old ones first; the old object file goes
    before the old tensors folder is replaced, so that a save cut short leaves no object file rather than one whose
    references name another save's tensors."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"{path} is a folder (a checkpoint in the plain format?), where a split-tensor checkpoint's object file "
            "goes"
        )
    folder, staging = tensors_folder(path), f"{tensors_folder(path)}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    count = 0

    def split_out(tensor: torch.Tensor) -> TensorReference:
        nonlocal count
        torch.save(tensor.detach().cpu().clone(), os.path.join(staging, f"tensor_{count}.pt"))
        count += 1
        return TensorReference(count - 1)

    structure = tree_map_only(torch.Tensor, split_out, data)
    torch.save(structure, f"{path}.tmp", pickle_module=_PICKLE)
    if os.path.exists(path):
        os.remove(path)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(staging, folder)
    os.replace(f"{path}.tmp", path)
