"""The torch_xla calls NxD's scripts and examples make, as ``meshpar.compat.nxd.xla`` gives them on CPU / CUDA:
the collectives with torch_xla's signatures against what each rank contributed, ``mesh_reduce``, the generator
state round trip, moving nested data to the device, the empty metrics report and ``spawn`` with and without a
launcher. (``optimizer_step``, ``all_reduce`` and ``rendezvous``: tests/compat/test_nxd_layers.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from meshpar.testing import run_distributed


def collectives_case() -> dict[str, object]:
    import statistics

    from meshpar.compat.nxd import xla as xm
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = xm.get_ordinal()
    mine = torch.arange(6.0).reshape(2, 3) + 10 * rank
    tp_groups = parallel_state.get_tensor_model_parallel_replica_groups()
    pair = next(g for g in tp_groups if rank in g)
    gathered_world = xm.all_gather(mine, dim=1)
    gathered_pair = xm.all_gather(mine, dim=0, groups=tp_groups, pin_layout=False)
    into = torch.empty(4, 3)
    xm.all_gather(mine, groups=tp_groups, output=into)
    scattered = xm.reduce_scatter(xm.REDUCE_SUM, torch.ones(4, 2) * (rank + 1), 0.5, 0, 2, groups=tp_groups)
    whole = xm.reduce_scatter(xm.REDUCE_MAX, torch.full((8,), float(rank)), scale=1, scatter_dim=0, shard_count=4)
    reduced = xm.mesh_reduce("loss", float(rank), statistics.mean)
    return {
        "world": gathered_world,
        "pair": gathered_pair,
        "into": into,
        "pair_ranks": pair,
        "scattered": scattered,
        "whole": whole,
        "mesh": reduced,
    }


def test_collectives_with_torch_xlas_signatures() -> None:
    results = run_distributed(collectives_case, 4)
    parts = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(4)]
    for got in results:
        torch.testing.assert_close(got["world"], torch.cat(parts, dim=1))
        a, b = got["pair_ranks"]
        torch.testing.assert_close(got["pair"], torch.cat([parts[a], parts[b]], dim=0))
        torch.testing.assert_close(got["into"], got["pair"])
        # (a + 1 + b + 1) * 0.5 in every element of this rank's half of the rows
        torch.testing.assert_close(got["scattered"], torch.full((2, 2), (a + b + 2) * 0.5))
        torch.testing.assert_close(got["whole"], torch.full((2,), 3.0))
        assert got["mesh"] == 1.5


def test_without_a_process_group_the_collectives_are_this_process_alone() -> None:
    from meshpar.compat.nxd import xla as xm

    x = torch.arange(4.0)
    torch.testing.assert_close(xm.all_gather(x), x)
    torch.testing.assert_close(xm.reduce_scatter(xm.REDUCE_SUM, x, 2.0, 0, 1), 2 * x)
    with pytest.raises(ValueError, match="shard_count must be 1"):
        xm.reduce_scatter(xm.REDUCE_SUM, x, 1.0, 0, 2)
    assert xm.mesh_reduce("tag", 3, sum) == 3


def test_the_generator_state_round_trips_and_an_integer_seeds_it() -> None:
    from meshpar.compat.nxd import xla as xm

    saved_outside = torch.get_rng_state()
    try:
        xm.set_rng_state(1234)
        first = torch.rand(5)
        torch.manual_seed(1234)
        torch.testing.assert_close(first, torch.rand(5))  # an integer seeds as torch.manual_seed does
        state = xm.get_rng_state()
        expected = torch.rand(5)
        torch.rand(100)  # the stream moves on
        xm.set_rng_state(state)
        torch.testing.assert_close(torch.rand(5), expected)  # restored exactly, not re-seeded
    finally:
        torch.set_rng_state(saved_outside)


def test_nested_data_goes_to_the_device_and_the_metrics_report_is_empty() -> None:
    from meshpar.compat.nxd import xla as xm

    data = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": "text"}
    moved = xm.send_cpu_data_to_device(data, xm.xla_device())
    assert moved["b"] == "text" and moved["a"][1][1] == 3 and isinstance(moved["a"][1], tuple)
    assert moved["a"][0].device == xm.xla_device()
    with pytest.raises(NotImplementedError, match="SPMD"):
        xm.send_cpu_data_to_device(data, "cpu", input_sharding=object())
    assert "no XLA metrics" in xm.metrics_report() and xm.short_metrics_report() == xm.metrics_report()
    assert xm.counter_names() == [] and xm.metric_names() == [] and xm.counter_value("x") is None
    xm.clear_all()


def record_spawned(index: int, directory: str) -> None:
    """What a spawned NxD entry point sees: its index, the launch variables, and a working gloo group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(index)])
    dist.all_reduce(total)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    seen = {"index": index, **{k: os.environ[k] for k in keys}, "total": total.item()}
    Path(directory, f"{index}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


@pytest.mark.slow  # two fresh processes
def test_spawn_starts_the_processes_with_the_launch_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshpar.compat.nxd import xla as xm

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    xm.spawn(record_spawned, args=(str(tmp_path),), nprocs=2)
    seen = sorted((json.loads(p.read_text()) for p in tmp_path.glob("*.json")), key=lambda s: s["index"])
    assert [s["index"] for s in seen] == [0, 1]
    for s in seen:
        assert s["RANK"] == s["LOCAL_RANK"] == str(s["index"]) and s["WORLD_SIZE"] == "2" and s["total"] == 1.0


def test_spawn_under_a_launcher_runs_the_entry_point_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshpar.compat.nxd import xla as xm

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    calls = []
    xm.spawn(lambda index, tag: calls.append((index, tag)), args=("x",))
    assert calls == [(1, "x")]
    with pytest.raises(ValueError, match="let the launcher choose"):
        xm.spawn(lambda index: None, nprocs=8)


def reused_groups_case() -> list[int]:
    """A replica-group list given at every step: new process groups the first time only (counted at
    ``torch.distributed.new_group``), for the collectives, ``rendezvous``, the ZeRO-1 grad norm and parallel_state's
    helper groups (shared-weight, pipeline gloo, kv-shared and one-rank groups) alike."""
    from unittest import mock

    import torch.distributed as dist

    from meshpar.compat.nxd import xla as xm
    from meshpar.compat.nxd.parallel_layers import grads, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    made = []
    real = dist.new_group
    with mock.patch.object(dist, "new_group", side_effect=lambda *a, **k: made.append(a) or real(*a, **k)):
        counts = []
        for _ in range(3):
            before = len(made)
            total = xm.all_reduce(xm.REDUCE_SUM, torch.ones(1), groups=[[0], [1]])
            xm.rendezvous("step", b"", replicas=[0, 1])
            param = torch.nn.Parameter(torch.ones(2))
            param.grad = torch.ones(2)
            grads.get_grad_norm([param], zero1_optimizer=True, zero1_optimizer_groups=[[0], [1]])
            shared = parallel_state.create_pg_with_ranks([0])
            parallel_state.initialize_pp_gloo_groups()
            parallel_state.initialize_kv_group(1)
            own = parallel_state.get_context_model_parallel_group()
            assert total.item() == 1.0 and shared.size() == own.size() == 1
            assert parallel_state.get_pp_gloo_group().size() == 1
            counts.append(len(made) - before)
    return counts


def test_replica_group_lists_make_their_process_groups_once() -> None:
    for counts in run_distributed(reused_groups_case, 2):
        assert counts[0] > 0 and counts[1:] == [0, 0], counts
