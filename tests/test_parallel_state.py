"""init_parallel / ParallelDims / parallel_state views of the mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import meshpar
from meshpar import ParallelDims, parallel_state
from meshpar.testing import run_distributed


def run_on_fake_ranks(fn: Callable[[], Any], world_size: int) -> list[Any]:
    """``fn()`` as each rank of a ``world_size`` job, one rank after another in this process, on torch's fake process
    group (groups are bookkeeping, nothing is sent): for layouts of more ranks than are worth starting processes for.
    ``fn`` must tear down meshpar's state; the default group and this process's RNG are restored here."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    results = []
    with torch.random.fork_rng():  # init_parallel seeds the generator
        for rank in range(world_size):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            try:
                results.append(fn())
            finally:
                meshpar.destroy_parallel(destroy_process_group=True)
    return results


def state_case(tp: int, pp: int, vpp: int | None) -> dict:
    import torch.distributed as dist

    parallel_state.initialize_model_parallel(tp, pp, vpp)
    dims = meshpar.get_parallel()
    assert parallel_state.model_parallel_is_initialized()
    out = {
        "rank": dist.get_rank(),
        "tp": (parallel_state.get_tensor_model_parallel_size(), parallel_state.get_tensor_model_parallel_rank()),
        "pp": (parallel_state.get_pipeline_model_parallel_size(), parallel_state.get_pipeline_model_parallel_rank()),
        "dp": (parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()),
        "tp_groups": parallel_state.get_tensor_model_parallel_group(as_list=True),
        "pp_groups": parallel_state.get_pipeline_model_parallel_group(as_list=True),
        "dp_groups": parallel_state.get_data_parallel_group(as_list=True),
        "tp_group_size": dist.get_world_size(parallel_state.get_tensor_model_parallel_group()),
        "first": parallel_state.is_pipeline_first_stage(),
        "last": parallel_state.is_pipeline_last_stage(),
        "mesh_dims": dims.mesh.mesh_dim_names,
    }
    if vpp:  # the chunk being worked on is apex's state, in its view
        from meshpar.compat.apex import parallel_state as apex_state

        out["first_v0"] = apex_state.is_pipeline_first_stage()
        out["last_v0"] = apex_state.is_pipeline_last_stage()
        apex_state.set_virtual_pipeline_model_parallel_rank(1)
        out["first_v1"] = apex_state.is_pipeline_first_stage()
        out["first_v1_ignore"] = apex_state.is_pipeline_first_stage(ignore_virtual=True)
        out["last_v1"] = apex_state.is_pipeline_last_stage()
    parallel_state.destroy_model_parallel()
    assert not parallel_state.model_parallel_is_initialized()
    return out


def test_megatron_rank_layout_tp_fastest_then_pp_then_dp() -> None:
    results = run_distributed(state_case, 4, 2, 2, None)
    for r in results:
        assert r["mesh_dims"] == ("dp", "pp", "cp", "tp")
        assert r["tp_groups"] == [[0, 1], [2, 3]]
        assert r["pp_groups"] == [[0, 2], [1, 3]]
        assert r["dp_groups"] == [[0], [1], [2], [3]]
        assert r["tp_group_size"] == 2
    assert [r["tp"] for r in results] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert [r["pp"] for r in results] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert [r["dp"] for r in results] == [(1, 0)] * 4
    assert [r["first"] for r in results] == [True, True, False, False]
    assert [r["last"] for r in results] == [False, False, True, True]


def test_data_parallel_takes_the_rest_of_the_world() -> None:
    results = run_distributed(state_case, 4, 2, 1, None)
    assert results[0]["dp_groups"] == [[0, 2], [1, 3]]
    assert [r["dp"] for r in results] == [(2, 0), (2, 0), (2, 1), (2, 1)]


def test_virtual_pipeline_rank_changes_first_and_last_stage() -> None:
    results = run_distributed(state_case, 2, 1, 2, 2)
    rank0, rank1 = results
    assert rank0["first"] and rank0["first_v0"] and not rank0["first_v1"] and rank0["first_v1_ignore"]
    assert rank1["last"] and not rank1["last_v0"] and rank1["last_v1"]  # meshpar's own getters know no chunks


def reinit_case(rounds: int) -> list[int]:
    """init_parallel / destroy_parallel again and again (Megatron-style test suites, sweeps, apex's
    destroy_model_parallel): the number of live process groups stays flat once every layout was built, and each
    context's mesh still communicates, through plain collectives and DTensor ops (whose caches treat equal meshes
    as one)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    live = []
    for layout in [(2, 1), (1, 2), (2, 2)] * rounds:
        dims = meshpar.init_parallel(tp=layout[0], pp=layout[1])
        dims.pipeline_ends_group()
        ones = torch.ones(1)
        dist.all_reduce(ones, group=dims.tp_mesh.get_group())
        assert ones.item() == layout[0]
        weight = distribute_tensor(torch.arange(8.0).reshape(4, 2), dims.tp_mesh, [Shard(0)])
        assert (weight * 2).sum().full_tensor().item() == 56.0
        meshpar.destroy_parallel()
        live.append(len(dist.distributed_c10d._world.pg_map))
    return live


def test_reinitialising_reuses_the_process_groups_of_an_equal_layout() -> None:
    for live in run_distributed(reinit_case, 4, 3):
        assert len(set(live[3:])) == 1, f"live process groups after each init/destroy: {live}"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 2, "pp": 1, "tp": 3, "world_size": 4}, r"dp\*pp\*tp = 2\*1\*3 = 6 does not equal the world size 4"),
        ({"dp": -1, "pp": 1, "tp": 3, "world_size": 4}, "world size 4 is not divisible by tp\\*pp = 3\\*1"),
        ({"dp": 1, "pp": 0, "tp": 4, "world_size": 4}, "pp must be a positive int"),
        ({"dp": 1, "pp": 1, "tp": -2, "world_size": 4}, "tp must be a positive int"),
        ({"dp": 0, "pp": 1, "tp": 4, "world_size": 4}, "dp must be a positive int"),
        ({"dp": 2, "pp": 1, "tp": 2, "world_size": 4, "virtual_pipeline_size": 2}, "needs pipeline parallelism"),
        ({"dp": 2, "pp": 1, "tp": 2, "world_size": 4, "ep": 4}, "expert parallel size 4 does not divide"),
        ({"dp": 6, "pp": 1, "tp": 1, "world_size": 6, "ep": 4}, r"use ep in \{1, 2, 3, 6\}"),
        ({"dp": 2, "pp": 1, "tp": 2, "world_size": 4, "ep": 0}, "ep must be a positive int"),
        ({"dp": -1, "pp": 1, "tp": 3, "world_size": 8, "cp": 2}, r"not divisible by tp\*cp\*pp = 3\*2\*1 = 6"),
        ({"dp": 2, "pp": 1, "tp": 1, "world_size": 8, "cp": 2}, r"dp\*pp\*cp\*tp = 2\*1\*2\*1 = 4 does not equal"),
        (
            {"dp": 3, "pp": 1, "tp": 1, "world_size": 6, "cp": 2, "ep": 4},
            r"does not divide the data x context parallel size 6 .*use ep in \{1, 2, 3, 6\}",
        ),
    ],
)
def test_bad_sizes_fail_before_any_collective(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def bad_world_case() -> str:
    try:
        meshpar.init_parallel(tp=3)
    except ValueError as e:
        assert not meshpar.is_initialized()
        return str(e)
    raise AssertionError("init_parallel accepted tp=3 on 4 ranks")


def test_init_parallel_rejects_bad_layout_on_every_rank() -> None:
    messages = run_distributed(bad_world_case, 4)
    assert all("not divisible by tp*pp" in m for m in messages)


def test_getters_before_init_raise() -> None:
    with pytest.raises(RuntimeError, match="not initialised"):
        meshpar.get_parallel()


def double_init_case() -> None:
    meshpar.init_parallel(tp=2)
    meshpar.init_parallel(tp=2)


def test_double_init_raises() -> None:
    with pytest.raises(AssertionError, match="already initialised"):
        run_distributed(double_init_case, 2)


@pytest.mark.parametrize(
    ("gpus", "local_ranks", "expected"), [(0, 1, "cpu"), (1, 1, "cuda"), (1, 4, "cpu"), (8, 4, "cuda")]
)
def test_default_device_needs_a_gpu_per_local_rank(monkeypatch, gpus: int, local_ranks: int, expected: str) -> None:
    """``torchrun --nproc-per-node 4`` on a one-GPU host falls back to the CPU instead of failing in set_device."""
    from meshpar import parallel_dims

    monkeypatch.setattr(parallel_dims.torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(parallel_dims.torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    assert parallel_dims._default_device_type() == expected


def test_cuda_without_a_gpu_per_local_rank_raises_before_any_collective(monkeypatch) -> None:
    from meshpar import parallel_dims

    monkeypatch.setattr(parallel_dims.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(parallel_dims.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="one GPU per local rank: 2 local ranks but 1 GPU"):
        meshpar.init_parallel(device_type="cuda")
    assert not meshpar.is_initialized()
    monkeypatch.setattr(parallel_dims.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA device"):
        meshpar.init_parallel(device_type="cuda")


def default_device_case() -> str:
    dims = meshpar.init_parallel(tp=2)
    return dims.device_type


def test_existing_gloo_group_means_cpu() -> None:
    assert run_distributed(default_device_case, 2) == ["cpu", "cpu"]


def pipeline_ends_group_case() -> list:
    import torch
    import torch.distributed as dist

    from meshpar.testing.reference import setup_parallel

    dims = setup_parallel(pp=4, dp=1)
    made = []
    original = dist.new_group
    dist.new_group = lambda ranks, *a, **k: made.append(ranks) or original(ranks, *a, **k)
    try:
        first = dims.pipeline_ends_group()
        again = setup_parallel(pp=4, dp=1).pipeline_ends_group()  # another ParallelDims over the same mesh
    finally:
        dist.new_group = original
    assert again is first and len(made) <= 1, "one group per mesh, not one per model built on it"
    if first is None:
        return [dims.pp_rank, None]
    value = torch.ones(1)
    dist.all_reduce(value, group=first)
    return [dims.pp_rank, value.item()]


def test_pipeline_ends_group_joins_first_and_last_stage_once_per_mesh() -> None:
    results = sorted(run_distributed(pipeline_ends_group_case, 4))
    assert results == [[0, 2.0], [1, None], [2, None], [3, 2.0]]


def expert_state_case() -> dict:
    import torch.distributed as dist

    parallel_state.initialize_model_parallel(2, 1, expert_model_parallel_size=2)  # 8 ranks: tp2, dp4, ep2
    dims = meshpar.get_parallel()
    out = {
        "ep": (parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()),
        "edp": (parallel_state.get_expert_data_parallel_world_size(), parallel_state.get_expert_data_parallel_rank()),
        "ep_group": dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()),
        "edp_group": dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group()),
        "expert_mesh": dims.expert_mesh.mesh.tolist(),
    }
    parallel_state.destroy_model_parallel()
    return out


def test_expert_groups_are_carved_out_of_dp_ep_fastest() -> None:
    """Megatron-Core's layout (the diagram in meshpar.parallel_dims): with tp2 x dp4 and ep2, adjacent dp replicas
    of one tp coordinate form an ep group, every other one an expert-data-parallel group."""
    results = run_on_fake_ranks(expert_state_case, 8)
    for rank, result in enumerate(results):
        tp_rank, dp_rank = rank % 2, rank // 2
        first = (dp_rank // 2) * 4 + tp_rank  # the ep group's first global rank
        assert result["ep"] == (2, dp_rank % 2) and result["edp"] == (2, dp_rank // 2), result
        assert result["ep_group"] == [first, first + 2], result
        assert result["edp_group"] == [rank % 4, rank % 4 + 4], result
        assert result["expert_mesh"] == [
            [first - tp_rank, first - tp_rank + 1],
            [first - tp_rank + 2, first - tp_rank + 3],
        ]


def context_state_case() -> dict:
    import torch.distributed as dist

    parallel_state.initialize_model_parallel(2, 1, context_parallel_size=2)  # 8 ranks: tp2, cp2, dp2
    out = {
        "cp": (parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()),
        "cp_group": dist.get_process_group_ranks(parallel_state.get_context_parallel_group()),
        "dp_cp": dist.get_process_group_ranks(parallel_state.get_data_parallel_group_with_context_parallel()),
        "dp": parallel_state.get_data_parallel_size(),
    }
    parallel_state.destroy_model_parallel()
    return out


def test_context_parallel_groups_sit_between_pp_and_tp() -> None:
    """The mesh is (dp, pp, cp, tp): tp fastest, then cp; dp x cp together reduce the dense grads."""
    for rank, result in enumerate(run_on_fake_ranks(context_state_case, 8)):
        tp_rank, cp_rank = rank % 2, (rank // 2) % 2
        first = rank - 2 * cp_rank  # cp rank 0 of this (dp, tp) position
        assert result["cp"] == (2, cp_rank) and result["dp"] == 2, result
        assert result["cp_group"] == [first, first + 2], result
        assert result["dp_cp"] == [tp_rank, tp_rank + 2, tp_rank + 4, tp_rank + 6], result


def expert_groups_under_cp_case() -> tuple[list[int], list[int], int]:
    import torch.distributed as dist

    dims = meshpar.init_parallel(tp=1, cp=2, ep=2)  # 4 ranks: dp2 x cp2, ep carved from dp x cp
    out = (
        dist.get_process_group_ranks(dims.ep_mesh.get_group()),
        dist.get_process_group_ranks(dims.edp_mesh.get_group()),
        parallel_state.get_expert_data_parallel_world_size(),
    )
    parallel_state.destroy_model_parallel()
    return out


def test_expert_groups_under_context_parallelism_are_carved_from_dp_and_cp() -> None:
    """With cp2 x dp2 and ep2 the ep groups are the cp pairs of each dp rank (cp fastest), the expert-data-parallel
    groups the same cp rank of the two dp ranks."""
    results = run_distributed(expert_groups_under_cp_case, 4)
    assert [r[0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[1] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert {r[2] for r in results} == {2}
