"""apex.transformer / neuronx-distributed ``parallel_state`` API as thin views of meshpar's one mesh.

Nothing here holds state of its own: every getter reads :func:`meshpar.get_parallel`. Rank layout is Megatron's
(tp fastest-varying, then pp, then dp); see :mod:`meshpar.parallel_dims`.
"""

from __future__ import annotations

import torch.distributed as dist

from meshpar.parallel_dims import destroy_parallel, get_parallel, init_parallel, is_initialized

GroupOrRanks = dist.ProcessGroup | list[list[int]]


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    *,
    seed: int = 1234,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> None:
    """apex/NxD entry point; data parallelism takes the rest of the world (ep and cp are Megatron-Core's keywords:
    ep is carved out of dp, cp is a mesh dim of its own)."""
    init_parallel(
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        dp=-1,
        virtual_pipeline_size=virtual_pipeline_model_parallel_size,
        seed=seed,
        ep=expert_model_parallel_size,
        cp=context_parallel_size,
    )


def model_parallel_is_initialized() -> bool:
    return is_initialized()


def destroy_model_parallel() -> None:
    destroy_parallel()


def _group(dim: str, as_list: bool) -> GroupOrRanks:
    dims = get_parallel()
    if as_list:
        return dims.group_ranks(dim)
    return getattr(dims, f"{dim}_mesh").get_group()


def get_tensor_model_parallel_size() -> int:
    return get_parallel().tp


def get_tensor_model_parallel_world_size() -> int:
    """apex / Megatron name of :func:`get_tensor_model_parallel_size`."""
    return get_parallel().tp


def get_tensor_parallel_size() -> int:
    """The name the NxD developer guide uses for :func:`get_tensor_model_parallel_size`."""
    return get_parallel().tp


def get_tensor_model_parallel_rank() -> int:
    return get_parallel().tp_rank


def get_tensor_model_parallel_group(as_list: bool = False) -> GroupOrRanks:
    return _group("tp", as_list)


def get_pipeline_model_parallel_size() -> int:
    return get_parallel().pp


def get_pipeline_model_parallel_world_size() -> int:
    """apex / Megatron name of :func:`get_pipeline_model_parallel_size`."""
    return get_parallel().pp


def get_pipeline_model_parallel_rank() -> int:
    return get_parallel().pp_rank


def get_pipeline_model_parallel_group(as_list: bool = False) -> GroupOrRanks:
    return _group("pp", as_list)


def get_data_parallel_size() -> int:
    return get_parallel().dp


def get_data_parallel_world_size() -> int:
    """apex / Megatron (and the NxD guide's data loader) name of :func:`get_data_parallel_size`."""
    return get_parallel().dp


def get_data_parallel_rank() -> int:
    return get_parallel().dp_rank


def get_data_parallel_group(as_list: bool = False) -> GroupOrRanks:
    return _group("dp", as_list)


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return get_parallel().virtual_pipeline_size


def is_pipeline_first_stage() -> bool:
    """This rank holds the first pipeline stage (apex's view adds its virtual-chunk rule on top)."""
    return get_parallel().pp_rank == 0


def is_pipeline_last_stage() -> bool:
    """This rank holds the last pipeline stage."""
    dims = get_parallel()
    return dims.pp_rank == dims.pp - 1


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tp rank 0 in this rank's tp group (apex's ``broadcast_data`` source)."""
    dims = get_parallel()
    return dist.get_rank() - dims.tp_rank


# -- expert parallelism (Megatron-Core's names): ep carved out of dp, see meshpar.parallel_dims ------------------------
def get_expert_model_parallel_world_size() -> int:
    return get_parallel().ep


def get_expert_model_parallel_rank() -> int:
    return get_parallel().ep_rank


def get_expert_model_parallel_group() -> dist.ProcessGroup | None:
    """This rank's ep group (the dp x cp ranks its experts are spread over); ``None`` without expert parallelism."""
    mesh = get_parallel().ep_mesh
    return mesh.get_group() if mesh is not None else None


def get_expert_data_parallel_world_size() -> int:
    dims = get_parallel()
    return dims.dp * dims.cp // dims.ep


def get_expert_data_parallel_rank() -> int:
    return get_parallel().edp_mesh.get_local_rank()


def get_expert_data_parallel_group() -> dist.ProcessGroup:
    """The dp ranks holding the same experts, over which expert grads are reduced (all of dp when ep == 1)."""
    return get_parallel().edp_mesh.get_group()


def get_expert_tensor_parallel_world_size() -> int:
    """Experts are split over tp inside each ep rank (Megatron-Core's default ``expert_tensor_parallel_size`` = tp).
    A model parallelized with ``expert_tensor_parallel_size: 1`` keeps its experts whole on every tp rank instead: a
    setting of that model's plan (``model.plan``), not of the mesh, which this reads."""
    return get_parallel().tp


# -- context parallelism (Megatron-Core's names) --------------------------------------------------------------------
def get_context_parallel_world_size() -> int:
    return get_parallel().cp


def get_context_parallel_rank() -> int:
    return get_parallel().cp_rank


def get_context_parallel_group(as_list: bool = False) -> GroupOrRanks:
    return _group("cp", as_list)


def get_data_parallel_group_with_context_parallel() -> dist.ProcessGroup:
    """dp and cp together: the ranks a dense weight's grads are reduced over (Megatron-Core's
    ``get_data_parallel_group(with_context_parallel=True)``)."""
    return get_parallel().grad_mesh.get_group()
