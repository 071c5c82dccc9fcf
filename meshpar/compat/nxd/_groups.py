"""Process groups over lists of global ranks, made once: the one way the NxD view makes groups of its own.

NxD code names groups by rank lists (torch_xla's ``groups=[[0, 1], [2, 3]]``, NxD's kv-shared, pipeline gloo,
shared-weight and one-rank groups), often at every step. A c10d group is a collective to make (every rank makes
every group, in the same order) and keeps sockets and a transport thread for the life of the job, so each list of
rank lists becomes its groups the first time it is asked for and the same groups after that. The cache belongs to
the default process group it was made under: a new world (``destroy_process_group`` then ``init_process_group``)
starts it afresh.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

_Key = tuple[tuple[tuple[int, ...], ...], str | None]
_MADE: dict[_Key, list[dist.ProcessGroup | None]] = {}
_WORLD: list[object] = []  # the default group the cache was filled under


def groups_over(rank_lists: Sequence[Sequence[int]], backend: str | None = None) -> list[dist.ProcessGroup | None]:
    """The groups over ``rank_lists``, in their order (``None`` for those this rank is not in). Every rank must make
    the same calls in the same order, as for ``torch.distributed.new_group``; a repeated call returns the groups
    made by the first."""
    world = dist.GroupMember.WORLD
    if not _WORLD or _WORLD[0] is not world:
        _MADE.clear()
        _WORLD[:] = [world]
    key = (tuple(tuple(int(rank) for rank in ranks) for ranks in rank_lists), backend)
    if key not in _MADE:
        me = dist.get_rank()
        made = [dist.new_group(list(ranks), backend=backend) for ranks in key[0]]
        _MADE[key] = [group if me in ranks else None for group, ranks in zip(made, key[0], strict=True)]
    return _MADE[key]


def group_among(rank_lists: Sequence[Sequence[int]], backend: str | None = None) -> dist.ProcessGroup | None:
    """This rank's group among ``rank_lists``, disjoint lists (``None`` if it is in none of them); made as
    :func:`groups_over` makes them."""
    mine = [group for group in groups_over(rank_lists, backend) if group is not None]
    if len(mine) > 1:
        raise ValueError(f"rank {dist.get_rank()} is in more than one of the groups {list(rank_lists)}")
    return mine[0] if mine else None
