"""Reading torch_xla's split-tensor checkpoints ("xser": what NxD writes with ``use_xser=True``) without torch_xla.

Such a checkpoint file is a pickled object in which every tensor was replaced by a
``torch_xla.utils.serialization.TensorReference`` (holding only its index ``tid``); the tensors lie beside it, one
``torch.save`` file each: ``<file>.tensors/tensor_<tid>.pt``. Under expert parallelism NxD writes the tensors that
are not experts' only with ep rank 0 (``..._ep_rank_00_...`` files), and the other ep ranks' references point there.

:func:`load` rebuilds the object with its tensors. Writing this format is not provided: a pickle that names
torch_xla's class needs torch_xla to be written faithfully.
"""

from __future__ import annotations

import os
import pickle
import re
import types
from typing import Any

import torch

from meshpar._compat import tree_map_only

_XLA_MODULE, _XLA_CLASS = "torch_xla.utils.serialization", "TensorReference"


class TensorReference:
    """Stands in for torch_xla's class while unpickling (its state: ``tid``)."""

    tid: int


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (_XLA_MODULE, _XLA_CLASS):
            return TensorReference
        return super().find_class(module, name)


# torch.load takes a pickle module: the standard one with torch_xla's class mapped to the stand-in
_PICKLE = types.SimpleNamespace(__name__="pickle", Unpickler=_Unpickler, load=pickle.load, dumps=pickle.dumps)


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
