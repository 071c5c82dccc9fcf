"""Every rank's copy of a dense module made equal before it is sharded, as torch's DDP does at construction.

Each rank of a job builds the model itself, usually from a config with random initialisation. Unless every rank
seeded its generator alike, the copies differ, and sharding them would stitch one layer together from several
different models (a tensor-parallel weight from rank 0's model and rank 1's, say): a wrong model that trains without
an error. :func:`make_replicas_equal` broadcasts every parameter and buffer from the first rank of each group the
module is replicated over, so the result no longer depends on how each rank was seeded, and logs which tensors this
rank had to take from its peer (a warning: their initial values were not what this rank built).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from meshpar._compat import DTensor, local_tensor
from meshpar._dp_checks import is_expert_parallel
from meshpar.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)


def _unique_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """name -> tensor for every parameter and buffer, each (tied ones too) once; a DTensor by its local shard. And
    the names of the expert-parallel ones."""
    seen: set[int] = set()
    tensors, experts = {}, set()
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]:
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[name] = local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
            if is_expert_parallel(tensor):
                experts.add(name)
    return tensors, experts


@torch.no_grad()
def _broadcast_coalesced(tensors: dict[str, torch.Tensor], group: dist.ProcessGroup, device: torch.device) -> list[str]:
    """Broadcast ``tensors`` from the group's first rank, one flat message per dtype (sent from ``device``: NCCL
    needs the GPU, whatever device the module was built on); the names whose values changed here."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name, tensor in tensors.items():
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(name)
    changed = []
    for (dtype, _), names in sorted(by_kind.items(), key=lambda item: str(item[0])):
        mine = torch.cat([tensors[n].detach().reshape(-1) for n in names])
        # gloo has no bool collectives: send bools as bytes
        flat = (mine.to(torch.uint8) if dtype == torch.bool else mine).to(device, copy=True)
        dist.broadcast(flat, group=group, group_src=0)
        flat = flat.to(mine.device, dtype)
        offset = 0
        for name in names:
            tensor = tensors[name]
            received = flat[offset : offset + tensor.numel()].view(tensor.shape)
            offset += tensor.numel()
            if not torch.equal(received, tensor.detach()):
                changed.append(name)
                tensor.detach().copy_(received)
    return changed


def make_replicas_equal(module: nn.Module, dims: ParallelDims, over: Sequence[str] = ("tp", "dp")) -> None:
    """Make this rank's ``module`` equal to the first rank's of each group along ``over`` (mesh dims whose ranks
    hold the same module: ``("tp", "dp", "pp")`` for a whole dense model every rank built, ``("tp", "dp")`` for one
    dense pipeline stage, ``("dp",)`` for a tp-sharded chunk, whose dp replicas hold the same shards; sharded
    parameters go by their local shards, so never name a dim they are sharded over; expert-parallel ones, whose dp
    ranks hold different experts, are made equal over the expert-data-parallel group where ``over`` says dp). Call
    it on every rank of the job; a module on ``meta`` has nothing to make equal."""
    tensors, expert_names = _unique_tensors(module)
    if not tensors or any(t.is_meta for t in tensors.values()):
        return
    changed: list[str] = []
    sizes = {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "cp": dims.cp}
    # expert-parallel tensors (different experts on the dp ranks of an ep group) are replicated over edp only
    experts = {name: t for name, t in tensors.items() if name in expert_names}
    dense = {name: t for name, t in tensors.items() if name not in expert_names}
    # cp never shards a weight: whatever is replicated over dp is replicated over cp too (each cp rank runs a part of
    # the same sequences with the same weights)
    for dim in [*over, *(["cp"] if "dp" in over and "cp" not in over else [])]:
        if sizes[dim] > 1:
            mesh = getattr(dims, f"{dim}_mesh")
            changed += _broadcast_coalesced(dense if dim == "dp" else tensors, mesh.get_group(), dims.device)
        if dim == "dp" and experts and dims.dp // dims.ep > 1:
            changed += _broadcast_coalesced(experts, dims.edp_mesh.get_group(), dims.device)
    if changed:
        names = sorted(set(changed))
        logger.warning(
            "rank %d built %d tensor(s) with other initial values than its replicas' first rank (%s%s); that rank's "
            "values were taken, as DDP does. Seed every rank alike (torch.manual_seed) to build equal models",
            dist.get_rank(),
            len(names),
            ", ".join(names[:5]),
            " ..." if len(names) > 5 else "",
        )
