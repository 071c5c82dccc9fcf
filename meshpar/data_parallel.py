"""Plain data parallelism: average gradients over ``mesh["dp"]`` after backward.

The minimal DDP-style step for models whose parameters are DTensors on the tp mesh (their local shards are what each
dp replica owns). ZeRO-1 and FSDP2 are separate options.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from meshpar._compat import DeviceMesh, local_tensor
from meshpar.grad_sync import grad_buffer, pack_grads, unpack_grads
from meshpar.parallel_dims import get_parallel


def allreduce_gradients(
    parameters: Iterable[torch.nn.Parameter],
    dp_mesh: DeviceMesh | None = None,
    *,
    reduce_dtype: torch.dtype | None = None,
) -> None:
    """Average the grads of ``parameters`` over the dp group, flattened into one bucket per dtype
    (``reduce_dtype=torch.float32`` reduces bf16/fp16 grads in fp32).

    A parameter may have a grad on some dp ranks and none on others (an expert no token of this rank's batch was
    routed to): it counts as zeros where missing, and every rank ends with the same averaged grad, or with ``None``
    where no rank had one (as the dense step on the whole batch): one "has a grad" flag per parameter rides in the
    same all-reduce (:func:`meshpar.grad_sync.pack_grads`)."""
    mesh = dp_mesh if dp_mesh is not None else get_parallel().dp_mesh
    if mesh.size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for param in dict.fromkeys(p for p in parameters if p.requires_grad):
        by_dtype.setdefault(local_tensor(param).dtype, []).append(param)
    for bucket in by_dtype.values():
        local = local_tensor(bucket[0])
        flat = grad_buffer([local_tensor(p).numel() for p in bucket], reduce_dtype or local.dtype, local.device)
        missing = pack_grads(bucket, flat)
        dist.all_reduce(flat, group=mesh.get_group())
        flat /= mesh.size()
        unpack_grads(bucket, flat, missing)


def apply_fsdp(
    model: torch.nn.Module,
    dp_mesh: DeviceMesh | None = None,
    *,
    block_cls: type | tuple[type, ...] | None = None,
    reshard_after_forward: bool = True,
    mp_policy: object | None = None,
) -> torch.nn.Module:
    """FSDP2 ``fully_shard`` over ``mesh["dp"]`` (per block, then the root), on top of tensor parallelism.

    Apply after TP (and activation checkpointing): parameters that are DTensors on the tp mesh become 2-D
    ``(dp, tp)`` DTensors, sharded over dp between steps and gathered for each block's forward and backward.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = dp_mesh if dp_mesh is not None else get_parallel().dp_mesh
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if block_cls is not None:
        for module in model.modules():
            if isinstance(module, block_cls):
                fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_activation_checkpointing(
    model: torch.nn.Module,
    block_cls: type | tuple[type, ...],
    *,
    replay_tp_rng: bool = True,
    compile_blocks: bool = False,
) -> torch.nn.Module:
    """Recompute every ``block_cls`` module in backward, replaying the tensor-parallel RNG state (dropout masks in
    sharded regions come out the same). Apply after TP, before FSDP.

    ``compile_blocks`` compiles each block's forward with ``torch.compile`` and checkpoints *around* the compiled
    graph, so the recompute in backward runs the compiled graph too. The other order (checkpoint inside a compiled
    block, torchtitan's) does not compile in torch 2.13 once DTensor parameters enter the checkpointed region: AOT
    autograd saves the ``DeviceMesh`` among the tensors for backward and fails, so dynamo falls back to eager. With the
    checkpoint outside, its RNG handling stays in eager code: the default generator (which Inductor draws its dropout
    seeds from) and the TP tracker are restored before the recompute, so dropout masks replay exactly.

    ``replay_tp_rng=False`` uses torch's plain non-reentrant checkpoint (no tracker replay)."""
    from meshpar.random import activation_checkpoint

    for module in model.modules():
        if isinstance(module, block_cls) and not getattr(module, "_meshpar_checkpointed", False):
            forward = torch.compile(module.forward) if compile_blocks else module.forward

            def checkpointed(*args: object, _forward=forward, **kwargs: object) -> object:  # noqa: ANN001
                if replay_tp_rng:
                    return activation_checkpoint(_forward, *args, **kwargs)
                return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)

            module.forward = checkpointed
            module._meshpar_checkpointed = True
    return model
