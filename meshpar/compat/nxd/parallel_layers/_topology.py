"""NxD's replica-group layouts and the helper groups beside them, for ``parallel_layers.parallel_state``.

NxD lays its ranks out as ``[pp, dp, cp, tp]`` (dense weights) and ``[pp, dp_exp, ep, tp]`` (experts), tp fastest,
and picks one of two layouts (``PG_Group_Logic``) from the Trainium generation, the logical-core size and tp:
``LOGIC1`` cuts the grid into rings of consecutive ranks, ``LOGIC2`` (Trn2 nodes of 64 ranks in four rows of 16, at
tp 64, or tp 32 with two cores per logical core) pairs a node's first row with its last and its second with its third
so that every tp ring closes between neighbours. The functions below compute those lists as NxD does, for code that
inspects or checks them. They are data only: the view's process groups are meshpar's mesh (Megatron's order, tp
fastest, then cp, pp, dp), on machines with no Trainium ring to follow.

The helper groups (``create_pg_with_ranks``, ``initialize_pp_gloo_groups``, ``get_tcp_store``) are built over that
mesh: one set per parallel state, made by every rank together as torch.distributed requires.
"""

from __future__ import annotations

import os
from collections import namedtuple
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from meshpar._compat import default_store
from meshpar.compat.nxd._groups import group_among, groups_over
from meshpar.parallel_dims import ParallelDims, get_parallel

ParallelGroups = namedtuple(
    "ParallelGroups", ["tp_groups", "dp_groups", "pp_groups", "ep_model_groups", "ep_data_groups", "cp_groups"]
)


def _lines(grid: torch.Tensor, axis: int) -> list[list[int]]:
    """The rank lists running along ``axis`` of ``grid``, ordered by the remaining axes (slowest first)."""
    return grid.movedim(axis, -1).reshape(-1, grid.shape[axis]).tolist()


def _singletons(world_size: int) -> list[list[int]]:
    return [[rank] for rank in range(world_size)]


def ascending_ring_PG_group(  # noqa: N802 - NxD's name
    lnc_size: int,
    cluster_ranks_nonexp: torch.Tensor,
    cluster_ranks_exp: torch.Tensor,
    tp: int,
    dp: int,
    pp: int,
    ep_model_degree: int,
    ep_data_degree: int,
    cp: int = 1,
) -> ParallelGroups:
    """``LOGIC1``: every group is a line of the rank grids, ``cluster_ranks_nonexp`` shaped ``[pp, dp, cp, tp]``
    and ``cluster_ranks_exp`` shaped ``[pp, dp_exp, ep, tp]`` (``lnc_size`` is not read: both layouts take the same
    arguments)."""
    dense, expert = cluster_ranks_nonexp.reshape(pp, dp, cp, tp), cluster_ranks_exp.reshape(pp, -1, ep_model_degree, tp)
    if expert.shape[1] != ep_data_degree:
        raise ValueError(f"the expert grid has {expert.shape[1]} expert-data-parallel ranks, not {ep_data_degree}")
    return ParallelGroups(
        tp_groups=_lines(dense, 3),
        dp_groups=_lines(dense, 1),
        pp_groups=_lines(dense, 0),
        ep_model_groups=_lines(expert, 2),
        ep_data_groups=_lines(expert, 1),
        cp_groups=_lines(dense, 2),
    )


_TRN2_ROWS = 4  # a Trn2 node's ranks form four rows of consecutive ranks


def _trn2_tp_groups(world_size: int, tp: int) -> list[list[int]]:
    """Per node: row 0 + row 3 and row 1 + row 2 (all four rows, in that order, when tp spans the node)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 64))
    width = per_node // _TRN2_ROWS
    groups = []
    for start in range(0, world_size - world_size % per_node, per_node):
        row = [list(range(start + i * width, start + (i + 1) * width)) for i in range(_TRN2_ROWS)]
        outer, inner = row[0] + row[3], row[1] + row[2]
        groups.extend([outer + inner] if per_node // tp == 1 else [outer, inner])
    if len(groups) != world_size // tp:
        raise ValueError(
            f"the Trn2 row layout gives {len(groups)} tp groups of {len(groups[0]) if groups else 0} ranks for a world "
            f"of {world_size} with nodes of {per_node}; tp {tp} needs {world_size // tp} (it pairs rows: tp must be "
            "half a node or a whole one)"
        )
    return groups


def _across(tp_groups: list[list[int]], span: int, inner: int) -> list[list[int]]:
    """Groups that take one rank from each of ``span // inner`` neighbouring blocks of tp groups: ``tp_groups`` cut
    into runs of ``span``, each run's groups joined ``inner`` at a time into blocks, the blocks' ranks paired
    position by position."""
    if len(tp_groups) % span:
        raise ValueError(f"{len(tp_groups)} tp groups do not divide into runs of {span}")
    out = []
    for first in range(0, len(tp_groups), span):
        run = tp_groups[first : first + span]
        blocks = [[rank for group in run[i : i + inner] for rank in group] for i in range(0, span, inner)]
        out.extend(list(ranks) for ranks in zip(*blocks, strict=True))
    return out


def ascending_descending_ring_PG_group(  # noqa: N802 - NxD's name
    lnc_size: int,
    cluster_ranks_nonexp: torch.Tensor,
    cluster_ranks_exp: torch.Tensor,
    tp: int,
    dp: int,
    pp: int,
    ep_model_degree: int,
    ep_data_degree: int,
    cp: int = 1,
) -> ParallelGroups:
    """``LOGIC2``: tp groups from the Trn2 rows (nodes of ``LOCAL_WORLD_SIZE`` ranks, 64 by default); cp, dp and pp
    groups pair the ranks of neighbouring tp groups (cp within runs of cp groups, dp across cp blocks, pp across
    dp x cp blocks); a dimension of size 1 gives one-rank groups. Expert groups are the expert grid's lines."""
    world_size = dist.get_world_size()
    tp_groups = _trn2_tp_groups(world_size, tp)
    expert = cluster_ranks_exp.reshape(pp, -1, ep_model_degree, tp)
    return ParallelGroups(
        tp_groups=tp_groups,
        dp_groups=_across(tp_groups, dp * cp, cp) if dp > 1 else _singletons(world_size),
        pp_groups=_across(tp_groups, pp * dp * cp, dp * cp) if pp > 1 else _singletons(world_size),
        ep_model_groups=_lines(expert, 2) if ep_model_degree > 1 else _singletons(world_size),
        ep_data_groups=_lines(expert, 1) if ep_data_degree > 1 else _singletons(world_size),
        cp_groups=_across(tp_groups, cp, 1),
    )


class PG_Group_Logic(Enum):  # noqa: N801 - NxD's name
    """The two layouts; a member calls its function."""

    LOGIC1 = (ascending_ring_PG_group, "Ascending Ring PG Group")
    LOGIC2 = (ascending_descending_ring_PG_group, "Ascending Descending Ring PG Group")

    def __init__(self, func: Callable[..., ParallelGroups], description: str) -> None:
        self.func = func
        self.description = description

    def __call__(self, *args: Any, **kwargs: Any) -> ParallelGroups:
        return self.func(*args, **kwargs)


def get_logic_chosen(lnc_size: int, hardware_type: Any, tp: int) -> PG_Group_Logic:
    """``LOGIC2`` where a Trn2 tp ring would otherwise join ranks that are not neighbours (tp 64 at one core per
    logical core, tp 32 at two, with the whole 64-rank node in use); ``LOGIC1`` everywhere else."""
    from meshpar.compat.nxd.utils.utils import hardware

    two_rows = hardware_type == hardware.TRN2 and (lnc_size, tp) in ((1, 64), (2, 32))
    if two_rows and lnc_size == 2 and dist.get_world_size() < 64:
        two_rows = False  # half a node: the consecutive layout's rings close
    return PG_Group_Logic.LOGIC2 if two_rows else PG_Group_Logic.LOGIC1


# -- helper process groups over meshpar's mesh ------------------------------------------------------------------------
def is_tcp_store_available() -> bool:
    """Whether the default process group has a rendezvous store to hand out."""
    return default_store() is not None


def get_tcp_store() -> dist.Store:
    """The default process group's rendezvous store (a key-value store every rank reaches)."""
    store = default_store()
    if store is None:
        raise RuntimeError("get_tcp_store: the default process group has no store (is torch.distributed initialised?)")
    return store


def initialize_pp_gloo_groups() -> None:
    """A gloo (CPU) group over each pipeline group, for metadata the pipeline sends beside the tensors; every rank
    makes every one (once: :mod:`meshpar.compat.nxd._groups`)."""
    group_among(get_parallel().group_ranks("pp"), backend="gloo")
    _PP_GLOO_READY[:] = [get_parallel()]


_PP_GLOO_READY: list[ParallelDims] = []  # the parallel state initialize_pp_gloo_groups ran under


def get_pp_gloo_group() -> dist.ProcessGroup:
    """This rank's pipeline group on gloo (after :func:`initialize_pp_gloo_groups`)."""
    dims = get_parallel()
    if not _PP_GLOO_READY or _PP_GLOO_READY[0] is not dims:
        raise RuntimeError("get_pp_gloo_group: call initialize_pp_gloo_groups() first (on every rank)")
    return group_among(dims.group_ranks("pp"), backend="gloo")


def create_pg_with_ranks(ranks: Sequence[int]) -> dist.ProcessGroup | None:
    """A process group over the pipeline stages ``ranks`` (pp ranks) of this rank's pipeline (NxD's group for a
    weight shared between stages, e.g. a tied embedding); ``None`` on ranks at other stages. Every rank must call
    it with the same stages: each pipeline gets its group, made by all ranks together the first time (the same
    groups after that)."""
    dims = get_parallel()
    stages = list(ranks)
    if not stages or any(not 0 <= s < dims.pp for s in stages):
        raise ValueError(f"create_pg_with_ranks({stages}): pipeline stages must lie in 0..{dims.pp - 1}")
    return group_among([[pipeline[s] for s in stages] for pipeline in dims.group_ranks("pp")])


def get_pipeline_model_parallel_sr_group(parity: bool | None = None) -> list[list[int]]:
    """The send / receive pairs of every pipeline, ``[stage i's rank, stage i+1's rank]`` (the last stage paired with
    the first): all of them, or with ``parity`` those starting at the stages of that parity (``True``: odd), NxD's
    way of splitting them into two sets of disjoint pairs."""
    dims = get_parallel()
    starts = range(dims.pp) if parity is None else range(int(bool(parity)), dims.pp, 2)
    return [[ranks[i], ranks[(i + 1) % dims.pp]] for ranks in dims.group_ranks("pp") for i in starts]


def _pair_group(offset: int, as_list: bool) -> Any:
    """The group of this rank and the pipeline rank ``offset`` stages on (1: next, -1: previous), over gloo as NxD
    makes them on CPU; ``as_list``: the pairs of that direction, NxD's replica-group form."""
    dims = get_parallel()
    start = dims.pp_rank if offset == 1 else (dims.pp_rank - 1) % dims.pp
    if as_list:
        return get_pipeline_model_parallel_sr_group(bool(start % 2))
    if dims.pp == 1:
        raise RuntimeError("the next / previous rank groups exist at pipeline parallel size > 1 only (as in NxD)")
    pipeline = next(i for i, ranks in enumerate(dims.group_ranks("pp")) if dist.get_rank() in ranks)
    return groups_over(get_pipeline_model_parallel_sr_group(), backend="gloo")[pipeline * dims.pp + start]


def get_next_rank_group(as_list: bool = False) -> Any:
    """The group of this rank and the next pipeline stage's rank (``as_list``: the pairs starting at stages of this
    stage's parity)."""
    return _pair_group(1, as_list)


def get_prev_rank_group(as_list: bool = False) -> Any:
    """The group of the previous pipeline stage's rank and this rank (``as_list``: the pairs starting at stages of
    the previous stage's parity)."""
    return _pair_group(-1, as_list)


__all__ = [
    "PG_Group_Logic",
    "ParallelGroups",
    "ascending_descending_ring_PG_group",
    "ascending_ring_PG_group",
    "create_pg_with_ranks",
    "get_logic_chosen",
    "get_next_rank_group",
    "get_pipeline_model_parallel_sr_group",
    "get_prev_rank_group",
    "get_pp_gloo_group",
    "get_tcp_store",
    "initialize_pp_gloo_groups",
    "is_tcp_store_available",
]
