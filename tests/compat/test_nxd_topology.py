"""NxD's replica-group layouts (``parallel_state.ascending_ring_PG_group``, ``ascending_descending_ring_PG_group``,
``get_logic_chosen``) against lists worked out by hand from the layouts' rules, and the helper groups over
meshpar's mesh (``create_pg_with_ranks``, the pipeline's gloo groups, the rendezvous store) on a gloo world."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from meshpar.testing import run_distributed


def _grids(world: int, tp: int, pp: int, dp: int, cp: int, ep: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    ranks = torch.arange(world)
    edp = world // (tp * pp * ep)
    return ranks.reshape(pp, dp, cp, tp), ranks.reshape(pp, edp, ep, tp), edp


def _coords(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


@pytest.mark.parametrize(("tp", "pp", "dp", "cp", "ep"), [(2, 2, 2, 2, 1), (2, 2, 4, 1, 2), (1, 4, 2, 2, 2)])
def test_ascending_ring_groups_are_the_grid_lines(tp: int, pp: int, dp: int, cp: int, ep: int) -> None:
    """Each kind of group partitions the world, and within a group exactly the coordinate it is named for varies,
    rising by one from member to member."""
    from meshpar.compat.nxd.parallel_layers import parallel_state

    world = tp * pp * dp * cp
    dense, expert, edp = _grids(world, tp, pp, dp, cp, ep)
    groups = parallel_state.ascending_ring_PG_group(1, dense, expert, tp, dp, pp, ep, edp, cp)
    layouts = {
        "tp_groups": ((pp, dp, cp, tp), 3),
        "cp_groups": ((pp, dp, cp, tp), 2),
        "dp_groups": ((pp, dp, cp, tp), 1),
        "pp_groups": ((pp, dp, cp, tp), 0),
        "ep_model_groups": ((pp, edp, ep, tp), 2),
        "ep_data_groups": ((pp, edp, ep, tp), 1),
    }
    for field, (shape, axis) in layouts.items():
        lists = getattr(groups, field)
        assert sorted(r for g in lists for r in g) == list(range(world)), field
        for group in lists:
            coords = [_coords(r, shape) for r in group]
            assert [c[axis] for c in coords] == list(range(shape[axis])), (field, group)
            assert len({c[:axis] + c[axis + 1 :] for c in coords}) == 1, (field, group)
    assert groups.tp_groups[1] == list(range(tp, 2 * tp))  # consecutive ranks, in order


def test_ascending_descending_ring_pairs_a_nodes_outer_and_inner_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes of 16 ranks (four rows of 4), 32 ranks, tp 8: a node's tp groups are row 0 + row 3 and row 1 + row 2;
    pp 2 pairs the nodes' ranks position by position; dp, cp and experts of size 1 give one-rank groups."""
    from meshpar.compat.nxd.parallel_layers import parallel_state

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    dense, expert, _ = _grids(32, 8, 2, 2, 1, 1)
    with mock.patch("torch.distributed.get_world_size", return_value=32):
        groups = parallel_state.ascending_descending_ring_PG_group(1, dense, expert, 8, 1, 4, 1, 4)
        two_by_two = parallel_state.ascending_descending_ring_PG_group(1, dense, expert, 8, 2, 2, 1, 4)
    node0 = [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    node1 = [[r + 16 for r in g] for g in node0]
    assert groups.tp_groups == node0 + node1
    assert groups.dp_groups == groups.ep_model_groups == [[r] for r in range(32)]
    assert groups.cp_groups == [[r] for g in node0 + node1 for r in g]
    # pp 4: one rank from each tp group, position by position
    assert groups.pp_groups[:2] == [[0, 4, 16, 20], [1, 5, 17, 21]]
    assert groups.pp_groups[4] == [12, 8, 28, 24]
    # dp 2 x pp 2: dp pairs a node's two tp groups, pp pairs the nodes
    assert two_by_two.dp_groups[:2] == [[0, 4], [1, 5]] and two_by_two.dp_groups[8] == [16, 20]
    assert two_by_two.pp_groups[0] == [0, 16] and two_by_two.pp_groups[8] == [4, 20]
    with mock.patch("torch.distributed.get_world_size", return_value=32), pytest.raises(ValueError, match="pairs rows"):
        parallel_state.ascending_descending_ring_PG_group(1, dense, expert, 4, 2, 4, 1, 8)


def test_the_layout_is_chosen_by_trainium_generation_core_size_and_tp() -> None:
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.utils.utils import hardware

    logic1, logic2 = parallel_state.PG_Group_Logic.LOGIC1, parallel_state.PG_Group_Logic.LOGIC2
    with mock.patch("torch.distributed.get_world_size", return_value=64):
        assert parallel_state.get_logic_chosen(1, hardware.TRN1, 64) is logic1
        assert parallel_state.get_logic_chosen(1, hardware.TRN2, 64) is logic2
        assert parallel_state.get_logic_chosen(2, hardware.TRN2, 32) is logic2
        assert parallel_state.get_logic_chosen(2, hardware.TRN2, 16) is logic1
    with mock.patch("torch.distributed.get_world_size", return_value=32):
        assert parallel_state.get_logic_chosen(2, hardware.TRN2, 32) is logic1  # half a node
    dense, expert, edp = _grids(8, 2, 2, 2, 1, 1)
    assert logic1(1, dense, expert, 2, 2, 2, 1, edp) == parallel_state.ascending_ring_PG_group(
        1, dense, expert, 2, 2, 2, 1, edp
    )


def helper_groups_case() -> dict[str, object]:
    import torch.distributed as dist

    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    try:
        with pytest.raises(RuntimeError, match="initialize_pp_gloo_groups"):
            parallel_state.get_pp_gloo_group()
        assert parallel_state.PP_GROUP_PG_GLOO is None  # NxD's module global, before the groups exist
        parallel_state.initialize_pp_gloo_groups()
        parallel_state.initialize_pp_gloo_groups()  # once per state
        pp_group = parallel_state.get_pp_gloo_group()
        assert parallel_state.PP_GROUP_PG_GLOO is pp_group
        rank = dist.get_rank()
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=pp_group)
        last = parallel_state.create_pg_with_ranks([1])
        both = parallel_state.create_pg_with_ranks([0, 1])
        shared = torch.tensor([float(rank)])
        dist.all_reduce(shared, group=both)
        with pytest.raises(ValueError, match="stages must lie"):
            parallel_state.create_pg_with_ranks([2])
        store = parallel_state.get_tcp_store()
        store.set(f"rank{rank}", str(rank * 10))
        dist.barrier()
        return {
            "pp_sum": value.item(),
            "pp_ranks": dist.get_process_group_ranks(pp_group),
            "in_last": last is not None and dist.get_process_group_ranks(last),
            "shared_sum": shared.item(),
            "store": [store.get(f"rank{r}").decode() for r in range(dist.get_world_size())],
            "available": parallel_state.is_tcp_store_available(),
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_helper_groups_follow_meshpars_pipeline_groups() -> None:
    """pp2 x dp2: the gloo pipeline group and the stage groups join each rank with its pipeline partner (meshpar's
    layout, dp outermost: ranks 2k and 2k + 1 form a pipeline), the stage-1 group exists on stage-1 ranks alone,
    and every rank reads what the others wrote to the store."""
    results = run_distributed(helper_groups_case, 4)
    from meshpar.parallel_dims import MESH_DIM_NAMES

    assert MESH_DIM_NAMES[:2] == ("dp", "pp")  # the pipeline partner below follows from this order
    for rank, got in enumerate(results):
        partner = rank ^ 1
        assert got["pp_ranks"] == sorted([rank, partner])
        assert got["pp_sum"] == got["shared_sum"] == rank + partner
        assert got["in_last"] == ([max(rank, partner)] if rank % 2 == 1 else False)
        assert got["store"] == ["0", "10", "20", "30"] and got["available"]


def send_receive_groups_case() -> dict[str, object]:
    import torch.distributed as dist

    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=4)
    try:
        rank = dist.get_rank()
        groups = {"next": parallel_state.get_next_rank_group(), "prev": parallel_state.get_prev_rank_group()}
        # the pairs starting at even stages reduce first, then those starting at odd ones (each rank is in one pair
        # of each set, so no rank waits in one pair while its partner waits in another)
        order = ["next", "prev"] if rank % 2 == 0 else ["prev", "next"]
        sums = {}
        for name in order:
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=groups[name])
            sums[name] = (dist.get_process_group_ranks(groups[name]), value.item())
        return {
            "all": parallel_state.get_pipeline_model_parallel_sr_group(),
            "even": parallel_state.get_pipeline_model_parallel_sr_group(False),
            "odd": parallel_state.get_pipeline_model_parallel_sr_group(True),
            "next_list": parallel_state.get_next_rank_group(as_list=True),
            "prev_list": parallel_state.get_prev_rank_group(as_list=True),
            **sums,
            "same": parallel_state.get_next_rank_group() is parallel_state.get_next_rank_group(),
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_send_receive_pairs_join_each_stage_with_its_neighbours() -> None:
    """pp4: the pairs of adjacent stages (the last with the first), split by parity as NxD splits them, and each
    rank's next / previous group holding it and that neighbour (made once)."""
    for rank, got in enumerate(run_distributed(send_receive_groups_case, 4)):
        assert got["all"] == [[0, 1], [1, 2], [2, 3], [3, 0]]
        assert got["even"] == [[0, 1], [2, 3]] and got["odd"] == [[1, 2], [3, 0]]
        nxt, prev = (rank + 1) % 4, (rank - 1) % 4
        assert got["next"] == (sorted([rank, nxt]), float(rank + nxt))
        assert got["prev"] == (sorted([rank, prev]), float(rank + prev))
        assert got["next_list"] == (got["odd"] if rank % 2 else got["even"])
        assert got["prev_list"] == (got["even"] if rank % 2 else got["odd"])
        assert got["same"]
