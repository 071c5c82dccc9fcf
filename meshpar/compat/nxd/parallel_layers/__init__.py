"""``neuronx_distributed.parallel_layers``: layers, ``parallel_state``, ``clip_grad_norm``, ``move_model_to_device``,
``save`` / ``load`` and the ``pad``, ``loss_functions`` and ``utils`` submodules."""

from meshpar import parallel_state
from meshpar.compat.nxd.parallel_layers import loss_functions, pad, utils
from meshpar.compat.nxd.parallel_layers.checkpointing import load, save
from meshpar.data import move_model_to_device
from meshpar.grad_clip import clip_grad_norm
from meshpar.tensor_parallel import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "ParallelEmbedding",
    "RowParallelLinear",
    "clip_grad_norm",
    "load",
    "loss_functions",
    "move_model_to_device",
    "pad",
    "parallel_state",
    "save",
    "utils",
]
