"""Materialise a module built on the ``meta`` device after (pp: while) it is sharded.

``with torch.device("meta"): model = Model(config)`` costs no memory; :func:`meshpar.recipe.apply_recipe` shards it
on meta and then allocates only each rank's shards (pp: only its stages), so no rank ever holds the dense model.
Weights are initialised by the caller's ``init`` (HF models: :func:`meshpar.hf.init.init_hf_weights`, the model's own
``_init_weights``, which also recomputes non-persistent buffers such as rotary frequencies) on the local shards, then
made identical wherever they must be: every parameter across its dp replicas, TP-replicated ones across tp too.
Load real weights afterwards (``checkpoint.load`` / ``from_parallelized``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from meshpar._compat import DTensor, Shard, local_tensor
from meshpar.parallel_dims import ParallelDims


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _tp_sharded(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements)


@torch.no_grad()
def make_replicas_agree(model: nn.Module, dims: ParallelDims) -> None:
    """Broadcast every local parameter from dp rank 0 of its dp group, and TP-replicated ones from tp rank 0, so
    that random initialisation done independently on each rank cannot leave replicas apart."""
    for param in model.parameters():
        local = local_tensor(param)
        if dims.tp > 1 and not _tp_sharded(param):
            dist.broadcast(local, group=dims.tp_mesh.get_group(), group_src=0)
        if dims.dp > 1:
            dist.broadcast(local, group=dims.dp_mesh.get_group(), group_src=0)


def materialize_sharded(model: nn.Module, dims: ParallelDims, init: Callable[[nn.Module], None]) -> None:
    """``to_empty`` on this rank's device, keeping parameters that were tied on meta tied, then ``init`` and make
    the replicas agree."""
    tied: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            tied.setdefault(id(param), []).append((module, name))
    model.to_empty(device=dims.device)
    for owners in tied.values():  # to_empty may swap DTensor parameters per owner: point them at one again
        first_module, first_name = owners[0]
        for module, name in owners[1:]:
            setattr(module, name, getattr(first_module, first_name))
    init(model)
    make_replicas_agree(model, dims)
