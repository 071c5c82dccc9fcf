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
_MADE: dict[_Key, dist.ProcessGroup | None] = {}
_WORLD: list[object] = []  # the default group the cache was filled under


def group_among(rank_lists: Sequence[Sequence[int]], backend: str | None = None) -> dist.ProcessGroup | None:
    """This rank's group among ``rank_lists`` (``None`` if it is in none of them). Every rank must make the same
    calls in the same order, as for ``torch.distributed.new_group``; a repeated call returns the groups made by the
    first."""
    world = dist.GroupMember.WORLD
    if not _WORLD or _WORLD[0] is not world:
        _MADE.clear()
        _WORLD[:] = [world]
    key = (tuple(tuple(int(rank) for rank in ranks) for ranks in rank_lists), backend)
    if key not in _MADE:
        me, mine = dist.get_rank(), None
        for ranks in key[0]:
            group = dist.new_group(list(ranks), backend=backend)
            if me in ranks:
                mine = group
        _MADE[key] = mine
    return _MADE[key]
