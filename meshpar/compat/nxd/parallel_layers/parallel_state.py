"""``neuronx_distributed.parallel_layers.parallel_state``: NxD's ``initialize_model_parallel`` signature and getters
over meshpar's one mesh (every getter of :mod:`meshpar.parallel_state`, plus NxD's replica-group lists, world group,
context / expert sizes and rank messages).

Expert parallelism is NxD's: ``expert_model_parallel_size`` ep splits each data-parallel group into expert-data-
parallel groups of dp / ep ranks, ep fastest (the ranks of an ep group are neighbouring dp ranks at the same tp and pp
coordinates; NxD's ``[PP, DP_exp, EP, TP]``, meshpar's own expert mesh). Context parallelism is NxD's too: ``cp``
ranks of one (dp, pp, tp) position split each sequence into contiguous pieces (``utils.batch_utils.
get_batch_on_this_context_parallel_rank``), the data-parallel groups exclude them, and attention meets over the ring
of :func:`get_context_model_parallel_src_tgt_pairs` (``kernels.ring_attention_kernel``). Context and expert
parallelism together are refused: NxD averages every grad over cp, experts' too, which is wrong where an ep group
spans cp ranks. NxD's Neuron-only options (``lnc_size`` > 1, ``mesh_only``) are refused. Rank layout: meshpar's
mesh is Megatron's (tp fastest, then cp, then pp, then dp); NxD orders dp before pp (``[PP, DP, CP, TP]``), so which
global ranks share a dp, ep or pp group differs from NxD's for pp > 1 and dp > 1 (sizes, ranks within groups and
results do not).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from meshpar.compat.nxd._groups import group_among
from meshpar.compat.nxd.parallel_layers import _topology
from meshpar.compat.nxd.parallel_layers._topology import *  # noqa: F403 - NxD's layouts and helper groups
from meshpar.parallel_dims import get_parallel
from meshpar.parallel_state import *  # noqa: F403 - NxD's module holds every getter
from meshpar.parallel_state import destroy_model_parallel, model_parallel_is_initialized
from meshpar.parallel_state import initialize_model_parallel as _initialize_mesh


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    skip_collective_init: bool = False,
    lnc_size: int = 1,
    mesh_only: bool = False,
) -> None:
    """NxD's entry point: data parallelism takes the rest of the world, expert parallelism is carved out of it."""
    if context_parallel_size > 1 and expert_model_parallel_size > 1:
        raise NotImplementedError(
            f"initialize_model_parallel(context_parallel_size={context_parallel_size}, expert_model_parallel_size="
            f"{expert_model_parallel_size}): the NxD view does not run context and expert parallelism together "
            "(NxD's trainer averages every grad over cp, experts' too, which is wrong where an ep group spans cp "
            "ranks); use one of them, or meshpar's own on an HF model: parallelize(model, {'context_parallel_size': "
            "..., 'expert_parallel_size': ...})"
        )
    if lnc_size != 1 or mesh_only or skip_collective_init:
        raise NotImplementedError(
            "initialize_model_parallel: lnc_size, mesh_only and skip_collective_init are Neuron-runtime options "
            "meshpar does not have (use their defaults)"
        )
    _initialize_mesh(
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        context_parallel_size=context_parallel_size,
    )


def _replica_groups(dim: str) -> list[list[int]]:
    return get_parallel().group_ranks(dim)


def get_tensor_model_parallel_replica_groups() -> list[list[int]]:
    return _replica_groups("tp")


def get_pipeline_model_parallel_replica_groups() -> list[list[int]]:
    return _replica_groups("pp")


def get_data_parallel_replica_groups() -> list[list[int]]:
    return _replica_groups("dp")


def get_world_group(as_list: bool = False) -> Any:
    return [list(range(dist.get_world_size()))] if as_list else dist.group.WORLD


def get_data_parallel_src_rank() -> int:
    """Global rank of dp rank 0 in this rank's data-parallel group."""
    return dist.get_process_group_ranks(get_parallel().dp_mesh.get_group())[0]


def _pipeline_ranks() -> list[int]:
    return dist.get_process_group_ranks(get_parallel().pp_mesh.get_group())


def get_pipeline_model_parallel_next_rank() -> int:
    dims = get_parallel()
    return _pipeline_ranks()[(dims.pp_rank + 1) % dims.pp]


def get_pipeline_model_parallel_prev_rank() -> int:
    dims = get_parallel()
    return _pipeline_ranks()[(dims.pp_rank - 1) % dims.pp]


def get_context_model_parallel_size() -> int:
    return get_parallel().cp


def get_context_model_parallel_rank() -> int:
    return get_parallel().cp_rank


def get_expert_model_parallel_size() -> int:
    return get_parallel().ep


def get_expert_model_parallel_rank() -> int:
    return get_parallel().ep_rank


def get_expert_data_parallel_size() -> int:
    """The dp ranks holding the same experts: all of dp without expert parallelism."""
    dims = get_parallel()
    return dims.dp // dims.ep


def get_expert_data_parallel_rank() -> int:
    return get_parallel().edp_mesh.get_local_rank()


def get_expert_data_parallel_group(as_list: bool = False) -> Any:
    dims = get_parallel()
    return dims.group_ranks("edp") if as_list else dims.edp_mesh.get_group()


def is_global_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def gather_python_object(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``obj`` in ``group``, in group-rank order."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def arrange_kv_groups(
    num_tensor_model_parallel_groups: int = 1,
    tensor_model_parallel_size: int = 1,
    kv_shared_group_size: int = 1,
    sequential_ranks_in_group: bool = False,
    hardware_type: Any = None,
) -> list[list[int]]:
    """The groups of global ranks holding the same key/value heads when they are replicated
    ``kv_shared_group_size`` times in each tp group of consecutive ranks. NxD's two layouts: a head on adjacent
    ranks (``hardware_type`` Trn2, or ``sequential_ranks_in_group``: blocks of consecutive ranks), or, by default
    (Trn1), the heads cycled so that each group takes every ``tp / kv_shared_group_size``-th rank
    (:func:`initialize_kv_group` picks the platform's)."""
    from meshpar.compat.nxd.utils.utils import hardware

    size, m = tensor_model_parallel_size, kv_shared_group_size
    if size % m != 0:
        raise ValueError(f"kv_shared_group_size {m} must divide the tp size {size}")
    adjacent = sequential_ranks_in_group or hardware_type == hardware.TRN2
    groups = []
    for base in range(0, num_tensor_model_parallel_groups * size, size):
        if adjacent:
            groups += [list(range(base + k * m, base + (k + 1) * m)) for k in range(size // m)]
        else:
            groups += [list(range(base + j, base + size, size // m)) for j in range(size // m)]
    return groups


class _SizedGroups:
    """Groups of one size made for the current parallel state (the kv-shared and the token-shuffle groups): made
    once by every rank (their process groups by :func:`~meshpar.compat.nxd._groups.group_among`), one size for all
    layers, read back by the getters; a new parallel state needs them made again."""

    def __init__(self, what: str, made_by: str) -> None:
        self.what, self.made_by = what, made_by
        self._made: tuple[Any, int, list[list[int]]] | None = None  # (the ParallelDims, size, every group's ranks)

    def made_with(self, size: int) -> bool:
        """Whether they are made for this state already (refused at another size)."""
        if self._made is None or self._made[0] is not get_parallel():
            return False
        if self._made[1] != size:
            raise ValueError(f"a {self.what} group of size {self._made[1]} exists; one size for all layers")
        return True

    def make(self, size: int, rank_lists: list[list[int]]) -> None:
        group_among(rank_lists)
        self._made = (get_parallel(), size, rank_lists)

    def _state(self) -> tuple[Any, int, list[list[int]]]:
        if self._made is None or self._made[0] is not get_parallel():
            raise RuntimeError(f"the {self.what} group is not initialized ({self.made_by})")
        return self._made

    def size(self) -> int:
        return self._state()[1]

    def rank_lists(self) -> list[list[int]]:
        return self._state()[2]

    def group(self) -> dist.ProcessGroup | None:
        return group_among(self.rank_lists())

    def destroy(self) -> None:
        self._made = None


_KV = _SizedGroups("kv-shared", "initialize_kv_group, or a GQAQKVColumnParallelLinear")


def initialize_kv_group(kv_shared_group_size: int = 1, sequential_ranks_in_group: bool = False) -> None:
    """Make the kv-shared groups (every rank must call it: process groups are collective); one size per state.
    They follow the platform's replica layout, as NxD's do (:func:`arrange_kv_groups` with
    :func:`~meshpar.compat.nxd.utils.utils.platform_hardware`): blocks of adjacent tp ranks (Trn2, the default off
    Neuron, or ``sequential_ranks_in_group``), or every ``tp / kv_shared_group_size``-th rank (Trn1)."""
    from meshpar.compat.nxd.utils.utils import platform_hardware

    if _KV.made_with(kv_shared_group_size):
        return
    dims = get_parallel()
    if dims.tp % kv_shared_group_size != 0:
        raise ValueError(f"kv_shared_group_size {kv_shared_group_size} must divide tp={dims.tp}")
    size = kv_shared_group_size
    local = arrange_kv_groups(1, dims.tp, size, sequential_ranks_in_group, platform_hardware())
    _KV.make(size, [[ranks[i] for i in group] for ranks in dims.group_ranks("tp") for group in local])


def get_kv_shared_group(as_list: bool = False) -> Any:
    return _KV.rank_lists() if as_list else _KV.group()


def get_kv_shared_replica_groups() -> list[list[int]]:
    return _KV.rank_lists()


def get_kv_shared_group_size() -> int:
    return _KV.size()


def destroy_kv_group() -> None:
    _KV.destroy()


_TOKEN_SHUFFLE = _SizedGroups("token shuffle", "initialize_token_shuffle_group")


def initialize_token_shuffle_group(token_shuffle_group_size: int = 1) -> None:
    """The groups MoE layers shuffle tokens within (``MoE(token_shuffle_group_size=...)``): blocks of
    ``token_shuffle_group_size`` consecutive data-parallel ranks of each dp group (1: no shuffling). One size for all
    layers; every rank must call it (the groups are made once)."""
    if _TOKEN_SHUFFLE.made_with(token_shuffle_group_size):
        return
    dims = get_parallel()
    if token_shuffle_group_size < 1 or dims.dp % token_shuffle_group_size != 0:
        raise ValueError(
            f"token_shuffle_group_size {token_shuffle_group_size} must be a divisor of the data parallel size {dims.dp}"
        )
    size = token_shuffle_group_size
    _TOKEN_SHUFFLE.make(
        size, [ranks[i : i + size] for ranks in dims.group_ranks("dp") for i in range(0, dims.dp, size)]
    )


def get_token_shuffle_group(as_list: bool = False) -> Any:
    """This rank's token shuffle group (``as_list``: every group's ranks)."""
    return _TOKEN_SHUFFLE.rank_lists() if as_list else _TOKEN_SHUFFLE.group()


def get_token_shuffle_replica_groups() -> list[list[int]]:
    return _TOKEN_SHUFFLE.rank_lists()


def get_token_shuffle_group_size() -> int:
    return _TOKEN_SHUFFLE.size()


def destroy_token_shuffle_group() -> None:
    _TOKEN_SHUFFLE.destroy()


def get_rank_info_str() -> str:
    if not model_parallel_is_initialized():
        return "model_parallel_uninitialized"
    dims = get_parallel()
    return f"DP_{dims.dp_rank}_TP_{dims.tp_rank}_PP_{dims.pp_rank}"


def rmsg(msg: str) -> str:
    """``msg`` prefixed with this rank's place in the mesh (NxD's log helper; -1 without a parallel state)."""
    pp = tp = dp = cp = -1
    if model_parallel_is_initialized():
        dims = get_parallel()
        pp, tp, dp, cp = dims.pp_rank, dims.tp_rank, dims.dp_rank, dims.cp_rank
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"[rank_{rank}_pp{pp}_tp{tp}_dp{dp}_cp{cp}] {msg}"


def rmsg_ep(msg: str) -> str:
    dims = get_parallel()
    return f"[pp{dims.pp_rank}|ep{dims.ep_rank}|tp{dims.tp_rank}|dp{dims.dp_rank}] {msg}"


# -- one-rank groups (context and expert parallelism at size 1), the context- and expert-parallel groups -----------
def _singletons() -> list[list[int]]:
    return [[rank] for rank in range(dist.get_world_size())]


def _own_group() -> dist.ProcessGroup:
    """This rank alone: the context-parallel group at size 1, and the expert-parallel one without expert parallelism
    (every rank makes every one-rank group, as c10d requires, the first time any of these getters runs on all ranks;
    the same groups after that)."""
    return group_among(_singletons())


def get_context_model_parallel_group(as_list: bool = False) -> Any:
    dims = get_parallel()
    if as_list:
        return dims.group_ranks("cp")
    return dims.cp_mesh.get_group() if dims.cp > 1 else _own_group()


def get_context_model_parallel_replica_groups() -> list[list[int]]:
    return get_parallel().group_ranks("cp")


def get_context_model_parallel_src_tgt_pairs() -> list[list[int]]:
    """The ring of this rank's context-parallel group as ``[source, target]`` global-rank pairs, each rank sending
    to the next (what NxD hands to its ring attention, ``kernels.ring_attention_kernel.nki_ring_attn_func``, which
    checks it); at context-parallel size 1 the ring of this rank alone."""
    dims = get_parallel()  # refused before initialize_model_parallel, as NxD's
    if dims.cp == 1:
        return [[dist.get_rank() if dist.is_initialized() else 0] * 2]
    ring = dist.get_process_group_ranks(dims.cp_mesh.get_group())
    return [[source, ring[(i + 1) % len(ring)]] for i, source in enumerate(ring)]


def get_expert_model_parallel_group(as_list: bool = False) -> Any:
    dims = get_parallel()
    if as_list:
        return dims.group_ranks("ep")
    return dims.ep_mesh.get_group() if dims.ep_mesh is not None else _own_group()


def get_expert_model_parallel_replica_groups() -> list[list[int]]:
    return get_parallel().group_ranks("ep")


def get_expert_data_parallel_replica_groups() -> list[list[int]]:
    return get_parallel().group_ranks("edp")


def get_zero1_sharding_groups() -> list[list[int]]:
    """The groups ZeRO-1 shards the dense parameters' optimizer state over: the data-parallel groups, which exclude
    the context-parallel ranks (their grads are averaged over cp first); expert weights' state is sharded over the
    expert-data-parallel groups."""
    dims = get_parallel()
    if dims.cp == 1:
        return get_data_parallel_replica_groups()
    # the mesh is (dp, pp, cp, tp): one group per (pp, tp) position, over its dp x cp ranks
    return [sorted(ranks) for ranks in dims.mesh.mesh.permute(1, 3, 0, 2).reshape(dims.pp * dims.tp, -1).tolist()]


def get_expert_parallel_rank_from_global_rank(rank: int, expert_parallel_group: Any = None) -> int:
    """A global rank's place in its expert-parallel group (``expert_parallel_group``: a process group or the list of
    replica groups; default: this state's ep groups)."""
    if not 0 <= rank < dist.get_world_size():
        raise ValueError(f"rank {rank} is not in the world of {dist.get_world_size()}")
    if isinstance(expert_parallel_group, dist.ProcessGroup):
        groups = [dist.get_process_group_ranks(expert_parallel_group)]
    else:
        groups = expert_parallel_group if expert_parallel_group is not None else get_parallel().group_ranks("ep")
    for ranks in groups:
        if rank in ranks:
            return list(ranks).index(rank)
    raise ValueError(f"rank {rank} is in none of the expert-parallel groups {groups}")


def get_experts_for_expert_parallel_rank(
    expert_parallel_rank: int,
    total_number_of_experts: int,
    expert_model_parallel_size: int,
    expert_distribution: list[list[int]] | None = None,
) -> list[int]:
    """The experts expert-parallel rank ``expert_parallel_rank`` holds: its contiguous share, or its entry of
    ``expert_distribution`` (which must cover every expert)."""
    if total_number_of_experts % expert_model_parallel_size != 0:
        raise ValueError(f"{total_number_of_experts} experts do not divide over {expert_model_parallel_size} ranks")
    if not 0 <= expert_parallel_rank < expert_model_parallel_size:
        raise ValueError(f"expert_parallel_rank {expert_parallel_rank} >= {expert_model_parallel_size}")
    if expert_distribution:
        if len(expert_distribution) != expert_model_parallel_size:
            raise ValueError("expert_distribution needs one list per expert-parallel rank")
        if {e for experts in expert_distribution for e in experts} != set(range(total_number_of_experts)):
            raise ValueError(f"expert_distribution must cover the experts 0..{total_number_of_experts - 1}")
        return list(expert_distribution[expert_parallel_rank])
    per_rank = total_number_of_experts // expert_model_parallel_size
    return list(range(expert_parallel_rank * per_rank, (expert_parallel_rank + 1) * per_rank))


def get_aot_mode() -> bool:
    """NxD's ahead-of-time (inference compilation) mode: never on here."""
    return False


def _pipeline_neighbour_groups(step: int) -> list[list[int]]:
    dims = get_parallel()
    return [[ranks[i], ranks[(i + step) % dims.pp]] for ranks in dims.group_ranks("pp") for i in range(dims.pp)]


def get_next_rank_replica_groups() -> list[list[int]]:
    """Each pipeline rank with the next one (a ring)."""
    return _pipeline_neighbour_groups(1)


def get_prev_rank_replica_groups() -> list[list[int]]:
    """Each pipeline rank with the previous one (a ring)."""
    return _pipeline_neighbour_groups(-1)


def __getattr__(name: str) -> Any:
    """NxD's module global ``PP_GROUP_PG_GLOO``: this rank's gloo pipeline group once ``initialize_pp_gloo_groups``
    ran under the current parallel state, ``None`` before (read at each access, so it follows the state)."""
    if name == "PP_GROUP_PG_GLOO":
        try:
            return _topology.get_pp_gloo_group()
        except RuntimeError:
            return None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    *_topology.__all__,
    "arrange_kv_groups",
    "destroy_kv_group",
    "destroy_model_parallel",
    "get_kv_shared_group",
    "get_kv_shared_group_size",
    "get_kv_shared_replica_groups",
    "initialize_kv_group",
    "gather_python_object",
    "get_context_model_parallel_rank",
    "get_context_model_parallel_size",
    "get_data_parallel_replica_groups",
    "get_data_parallel_src_rank",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_size",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_size",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_replica_groups",
    "get_rank_info_str",
    "get_tensor_model_parallel_replica_groups",
    "get_world_group",
    "initialize_model_parallel",
    "is_global_rank_zero",
    "model_parallel_is_initialized",
    "rmsg",
    "rmsg_ep",
    "get_aot_mode",
    "get_context_model_parallel_group",
    "get_context_model_parallel_replica_groups",
    "get_context_model_parallel_src_tgt_pairs",
    "get_expert_data_parallel_replica_groups",
    "get_expert_model_parallel_group",
    "get_expert_model_parallel_replica_groups",
    "get_expert_parallel_rank_from_global_rank",
    "get_experts_for_expert_parallel_rank",
    "get_next_rank_replica_groups",
    "get_prev_rank_replica_groups",
    "get_zero1_sharding_groups",
    "initialize_token_shuffle_group",
    "get_token_shuffle_group",
    "get_token_shuffle_replica_groups",
    "get_token_shuffle_group_size",
    "destroy_token_shuffle_group",
]
