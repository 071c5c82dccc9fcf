"""NxD's MoE under expert parallelism (``expert_model_parallel_size`` > 1) through the NxD view, against a dense
mixture of experts written out here: one training step through NxD's trainer API (``neuronx_distributed_config``,
``initialize_parallel_optimizer``; plain and ZeRO-1 optimizers, grad clipping active) at tp1 x ep2, tp1 x ep4 and
tp2 x ep2 in a gloo world of 4, each dp rank with its own batch: the loss, the clipped norm and every parameter after
an AdamW step equal one dense step on the mean of the replicas' losses. Also: the parallel state's ep / edp groups,
the expert-parallel regions' all-to-all, an ep rank whose experts get no token, and checkpoints saved per ep rank
(loaded back, refused at another ep size)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshpar.testing import run_distributed
from tests.compat.test_nxd_layers import _shard
from tests.compat.test_nxd_moe import dense_moe

E, H, INTER, B, S = 4, 8, 6, 2, 4
LR, MAX_NORM = 0.05, 0.05


def dense_replica_loss(x, target, w, *, top_k, capacity_factor, glu):
    """One replica's loss through the dense layer (``test_nxd_moe.dense_moe``: capacity counted over this replica's
    tokens, the kept affinities renormalised for top-k > 1)."""
    out, _, _ = dense_moe(
        x, w["router_w"], w["up_w"], w["up_b"], w["down_w"], w["down_b"], top_k=top_k,
        capacity_factor=capacity_factor, normalize=top_k > 1, glu=glu, act=F.silu if glu else F.relu,
        router_b=w["router_b"],
    )  # fmt: skip
    return ((out - target) ** 2).mean()


def _full_weights(glu: bool, skewed: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    columns = 2 * INTER if glu else INTER
    w = {
        "router_w": torch.randn(E, H) * 0.5,
        "router_b": torch.zeros(E),
        "up_w": torch.randn(E, H, columns) * 0.3,
        "up_b": torch.randn(E, columns) * 0.1,
        "down_w": torch.randn(E, INTER, H) * 0.3,
        "down_b": torch.randn(E, H) * 0.1,
    }
    if skewed:  # every token picks expert 0 (then 1): the ep ranks holding experts 2 and 3 get no token at all
        w["router_b"] = torch.tensor([40.0, 20.0, 0.0, 0.0])
    return w


def _batches(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(dp, B, S, H, generator=generator), torch.randn(dp, B, S, H, generator=generator)


def _dense_step(w, xs, targets, **kw):
    """The dense reference: loss (mean over replicas), the grad norm before clipping, the parameters after a clipped
    AdamW step."""
    params = {k: v.clone().requires_grad_() for k, v in w.items()}
    loss = sum(dense_replica_loss(x, t, params, **kw) for x, t in zip(xs, targets, strict=True)) / len(xs)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM)
    torch.optim.AdamW(list(params.values()), lr=LR).step()
    return loss.detach(), norm, {k: v.detach() for k, v in params.items()}


class _Net(torch.nn.Module):
    """The layer as NxD's Mixtral example builds it (with ``sp``: router and layer sequence-parallel, the tokens
    ``[S, B, H]`` split over tp along S)."""

    def __init__(self, glu: bool, top_k: int, capacity_factor: float | None, sp: bool = False) -> None:
        super().__init__()
        from meshpar.compat.nxd.modules.moe import ExpertMLPs, MoE, RouterTopK

        self.router = RouterTopK(E, top_k, H, bias=True, sequence_parallel_enabled=sp, sequence_dimension=0)
        self.experts = ExpertMLPs(E, top_k, H, INTER, "silu" if glu else "relu", glu, capacity_factor,
                                  normalize_top_k_affinities=top_k > 1, bias=True)  # fmt: skip
        self.moe = MoE(self.router, self.experts, sequence_parallel_enabled=sp, sequence_dimension=0)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((self.moe(x)[0] - target) ** 2).mean()


def _local(w: dict[str, torch.Tensor], glu: bool, experts: slice, tp: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """This rank's parts of the dense weights: its ep rank's experts, cut over tp the NxD way."""
    stride = 2 if glu else 1
    return {
        "router_w": w["router_w"],
        "router_b": w["router_b"],
        "up_w": _shard(w["up_w"][experts], 2, tp, tp_rank, stride),
        "up_b": _shard(w["up_b"][experts], 1, tp, tp_rank, stride),
        "down_w": _shard(w["down_w"][experts], 1, tp, tp_rank),
        "down_b": w["down_b"][experts],
    }


def _net_params(net: _Net, glu: bool) -> dict[str, torch.nn.Parameter]:
    up = net.experts.mlp_op.gate_up_proj if glu else net.experts.mlp_op.up_proj
    return {
        "router_w": net.router.linear_router.weight,
        "router_b": net.router.linear_router.bias,
        "up_w": up.weight,
        "up_b": up.bias,
        "down_w": net.experts.mlp_op.down_proj.weight,
        "down_b": net.experts.mlp_op.down_proj.bias,
    }


CONFIGS = [
    dict(tp=1, ep=2, zero1=False, glu=True, top_k=2, capacity_factor=None, skewed=False),
    dict(tp=1, ep=4, zero1=True, glu=False, top_k=1, capacity_factor=0.5, skewed=False),
    dict(tp=2, ep=2, zero1=False, glu=True, top_k=2, capacity_factor=1.0, skewed=False),
    dict(tp=1, ep=2, zero1=True, glu=True, top_k=2, capacity_factor=None, skewed=True),
    dict(tp=2, ep=2, zero1=True, glu=True, top_k=2, capacity_factor=1.0, skewed=False, sp=True),
]


def training_step_case(
    tp: int, ep: int, zero1: bool, glu: bool, top_k: int, capacity_factor, skewed: bool, sp: bool = False
) -> None:
    from meshpar.compat.nxd import trainer
    from meshpar.compat.nxd.parallel_layers import parallel_state as ps

    config = trainer.neuronx_distributed_config(
        tensor_parallel_size=tp, expert_parallel_size=ep, sequence_parallel=sp,
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": True, "max_grad_norm": MAX_NORM},
    )  # fmt: skip
    try:
        dp, tp_rank = ps.get_data_parallel_size(), ps.get_tensor_model_parallel_rank()
        assert ps.get_expert_model_parallel_size() == ep and ps.get_expert_data_parallel_size() == dp // ep
        w = _full_weights(glu, skewed)
        xs, targets = _batches(dp)
        net = _Net(glu, top_k, capacity_factor, sp)
        experts = net.experts.local_experts
        assert (
            experts.stop - experts.start == E // ep and experts.start == ps.get_expert_model_parallel_rank() * E // ep
        )
        params = _net_params(net, glu)
        for name in ("up_w", "up_b", "down_w", "down_b"):
            assert getattr(params[name], "expert_model_parallel", False), name
        assert not hasattr(params["router_w"], "expert_model_parallel")
        with torch.no_grad():
            for name, value in _local(w, glu, experts, tp, tp_rank).items():
                params[name].copy_(value)
        optimizer = trainer.initialize_parallel_optimizer(config, torch.optim.AdamW, net.parameters(), lr=LR)
        rank = ps.get_data_parallel_rank()
        x, target = xs[rank], targets[rank]
        if sp:  # this tp rank's part of the sequence ([S, B, H]); the replica's loss is the mean of the parts' losses
            x, target = (t.transpose(0, 1).chunk(tp)[tp_rank] for t in (x, target))
        loss = net(x, target) / (tp if sp else 1)
        loss.backward()
        if skewed and ps.get_expert_model_parallel_rank() == ep - 1:  # no token reached these experts: zero grads
            assert all(p.grad is not None and not p.grad.any() for p in net.experts.parameters())
        optimizer.step()
        if sp:  # the layer sees the tokens in [S, B, H] order (which decides who is dropped first)
            xs, targets = xs.transpose(1, 2), targets.transpose(1, 2)
        ref_loss, ref_norm, ref = _dense_step(w, xs, targets, top_k=top_k, capacity_factor=capacity_factor, glu=glu)
        mean_loss = loss.detach().clone()
        if sp:
            torch.distributed.all_reduce(mean_loss, group=ps.get_tensor_model_parallel_group())
        torch.distributed.all_reduce(mean_loss, group=ps.get_data_parallel_group())
        torch.testing.assert_close(mean_loss / dp, ref_loss, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(optimizer.grad_norm.reshape(()), ref_norm, atol=1e-6, rtol=1e-5)
        for name, value in _local(ref, glu, experts, tp, tp_rank).items():
            torch.testing.assert_close(params[name].detach(), value, atol=1e-6, rtol=1e-5, msg=name)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize(
    "index",
    range(len(CONFIGS)),
    ids=lambda i: "tp{tp}_ep{ep}_zero1_{zero1}".format(**CONFIGS[i]) + ("_sp" if CONFIGS[i].get("sp") else ""),
)
def test_nxd_moe_training_step_under_expert_parallelism_equals_dense(index: int) -> None:
    run_distributed(training_step_case, 4, **CONFIGS[index])


def groups_and_regions_case() -> None:
    """The ep / edp groups (ep fastest inside dp) and the regions' all-to-all: entering sends expert block j to ep
    rank j, leaving brings it back, and the grads go the inverse way."""
    import torch.distributed as dist

    from meshpar.compat.nxd.parallel_layers import mappings
    from meshpar.compat.nxd.parallel_layers import parallel_state as ps

    rank = dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert ps.get_expert_model_parallel_replica_groups() == [[0, 2], [1, 3]]
    assert ps.get_expert_data_parallel_replica_groups() == [[0], [1], [2], [3]]
    assert ps.get_expert_model_parallel_group(as_list=True) == [[0, 2], [1, 3]]
    assert ps.get_expert_model_parallel_rank() == rank // 2 and ps.get_expert_data_parallel_rank() == 0
    assert ps.get_expert_parallel_rank_from_global_rank(3) == 1
    assert f"|ep{rank // 2}|" in ps.rmsg_ep("x")
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    assert ps.get_expert_model_parallel_replica_groups() == [[0, 1], [2, 3]]
    assert ps.get_expert_data_parallel_replica_groups() == [[0, 2], [1, 3]]
    assert ps.get_expert_data_parallel_size() == 2 and ps.get_expert_data_parallel_rank() == rank // 2
    assert dist.get_process_group_ranks(ps.get_expert_data_parallel_group()) == [rank % 2, rank % 2 + 2]
    ep_rank = rank % 2
    every = torch.arange(4 * 4 * 3 * 5, dtype=torch.float32).view(4, 4, 3, 5)  # [source rank, e, c, h]
    x = every[rank].clone().requires_grad_()
    entered = mappings.enter_expert_parallel_region(x, scatter_gather=False)
    peers = [rank - ep_rank, rank - ep_rank + 1]  # this rank's ep group, in ep order
    expected = torch.stack([every[p][2 * ep_rank : 2 * ep_rank + 2] for p in peers], dim=1)
    assert entered.shape == (2, 2, 3, 5) and torch.equal(entered, expected)
    back = mappings.exit_expert_parallel_region(entered * 2, scatter_gather=True)
    assert torch.equal(back, 2 * x.detach())
    weight = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(rank))
    (back * weight).sum().backward()
    torch.testing.assert_close(x.grad, 2 * weight)
    with pytest.raises(ValueError, match="does not divide over the 2 expert-parallel ranks"):
        mappings.enter_expert_parallel_region(torch.zeros(3, 2, 5), scatter_gather=False)
    ps.destroy_model_parallel()
    with pytest.raises(NotImplementedError, match="context and expert parallelism together"):
        ps.initialize_model_parallel(context_parallel_size=2, expert_model_parallel_size=2)


def test_nxd_expert_parallel_groups_and_regions() -> None:
    run_distributed(groups_and_regions_case, 4)


def checkpoint_case(tmp: str, zero1: bool) -> None:
    """``save_checkpoint`` at tp1 x ep2 writes one model file per ep rank; loading it into a fresh model and
    optimizer at the same layout restores both (the next step equals the uninterrupted run's), at ep 1 it is refused on
    every rank; ``parallel_layers.save`` / ``load`` likewise."""
    from meshpar.compat.nxd import trainer
    from meshpar.compat.nxd.parallel_layers import checkpointing
    from meshpar.compat.nxd.parallel_layers import parallel_state as ps

    def setup(ep: int):
        config = trainer.neuronx_distributed_config(
            expert_parallel_size=ep, optimizer_config={"zero_one_enabled": zero1, "grad_clipping": False}
        )
        torch.manual_seed(2)  # every rank the same full weights (each keeps its experts)
        net = _Net(True, 2, None)
        return net, trainer.initialize_parallel_optimizer(config, torch.optim.AdamW, net.parameters(), lr=LR)

    def step(net, optimizer, seed):
        generator = torch.Generator().manual_seed(seed * 10 + ps.get_data_parallel_rank())
        x, target = torch.randn(B, S, H, generator=generator), torch.randn(B, S, H, generator=generator)
        optimizer.zero_grad()
        net(x, target).backward()
        optimizer.step()

    net, optimizer = setup(2)
    step(net, optimizer, 1)
    trainer.save_checkpoint(tmp, "one", model=net, optimizer=optimizer)
    checkpointing.save({"model": net.state_dict()}, f"{tmp}/plain")
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    names = sorted(p.name for p in (__import__("pathlib").Path(tmp) / "one" / "model").iterdir())
    assert names == [f"dp_rank_00_ep_rank_0{e}_tp_rank_00_pp_rank_00.pt" for e in range(2)], names
    step(net, optimizer, 2)
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    ps.destroy_model_parallel()

    fresh, fresh_optimizer = setup(2)
    trainer.load_checkpoint(tmp, "one", model=fresh, optimizer=fresh_optimizer)
    step(fresh, fresh_optimizer, 2)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)
    other = _Net(True, 2, None)
    checkpointing.load(f"{tmp}/plain", other)
    for name, value in other.state_dict().items():
        torch.testing.assert_close(value, saved[name], atol=0, rtol=0, msg=name)
    ps.destroy_model_parallel()

    dense, dense_optimizer = setup(1)
    with pytest.raises(ValueError, match="load_checkpoint failed on rank"):
        trainer.load_checkpoint(tmp, "one", model=dense, optimizer=dense_optimizer)
    with pytest.raises(ValueError, match=r"parallel_layers\.load failed on rank"):
        checkpointing.load(f"{tmp}/plain", dense)
    ps.destroy_model_parallel()


@pytest.mark.parametrize("zero1", [False, True], ids=["plain", "zero1"])
def test_nxd_checkpoints_under_expert_parallelism(tmp_path, zero1: bool) -> None:
    run_distributed(checkpoint_case, 4, str(tmp_path), zero1)


def replicas_and_grad_modes_case() -> None:
    """At dp 4 x ep 2 (edp 2): a model whose ranks built different values is made equal with the dense weights over
    dp and the expert weights over edp only (each ep rank keeps its own experts); the pipeline's grad reduction
    averages expert grads over edp in its all-reduce mode and leaves them to the optimizer in the optimizer's mode."""
    import torch.distributed as dist

    from meshpar.compat.nxd.parallel_layers import parallel_state as ps
    from meshpar.data_parallel import DataParallelGrads
    from meshpar.parallel_dims import get_parallel
    from meshpar.replicas import make_replicas_equal

    rank = dist.get_rank()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        dims = get_parallel()
        torch.manual_seed(100 + rank)  # every rank builds other values
        module = _Net(True, 2, None)
        make_replicas_equal(module, dims, over=("dp",))
        every = [None] * 4
        dist.all_gather_object(every, {k: v.detach().clone() for k, v in module.state_dict().items()})
        edp_first = [0, 1, 0, 1][rank]  # the first rank of this rank's edp group: [0, 2] or [1, 3]
        for name, value in module.state_dict().items():
            source = edp_first if ".mlp_op." in name else 0
            assert torch.equal(value, every[source][name]), name
        assert not torch.equal(every[0]["experts.mlp_op.down_proj.weight"], every[1]["experts.mlp_op.down_proj.weight"])

        for mode, expected in (("optimizer", "own"), ("allreduce", "edp mean")):
            for p in module.parameters():
                p.grad = torch.full_like(p, float(rank + 1))
            DataParallelGrads(mode, dims.dp_mesh, [module], expert_dp_mesh=dims.expert_dp_mesh).finish()
            down = module.experts.mlp_op.down_proj.weight.grad
            router = module.router.linear_router.weight.grad
            if expected == "own":
                assert (down == rank + 1).all() and (router == rank + 1).all()
            else:  # summed over the ranks holding the same experts, divided by dp
                assert torch.allclose(down, torch.full_like(down, (rank + 1 + (rank + 2) % 4 + 1) / 4))
                assert torch.allclose(router, torch.full_like(router, 10 / 4))
    finally:
        ps.destroy_model_parallel()


def test_replicas_and_grad_modes_keep_expert_weights_per_ep_rank() -> None:
    run_distributed(replicas_and_grad_modes_case, 4)


def init_case() -> None:
    """Each rank builds only its own experts, each from a seed of its own: at ep 2 they are the ep-1 layer's
    experts built from the same generator state, and no two experts start equal."""
    from meshpar.compat.nxd.modules.moe import ExpertMLPs
    from meshpar.compat.nxd.parallel_layers import parallel_state as ps

    def build() -> dict[str, torch.Tensor]:
        torch.manual_seed(7)
        layer = ExpertMLPs(E, 2, H, INTER, "silu", True, None, bias=True)
        return {name: p.detach().clone() for name, p in layer.named_parameters()}

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    split, block = build(), slice(2 * ps.get_expert_model_parallel_rank(), 2 * ps.get_expert_model_parallel_rank() + 2)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    whole = build()
    ps.destroy_model_parallel()
    for name, value in whole.items():
        assert split[name].shape[0] == E // 2 and torch.equal(split[name], value[block]), name
    up = whole["mlp_op.gate_up_proj.weight"]
    assert all(not torch.equal(up[a], up[b]) for a in range(E) for b in range(a))


def test_experts_are_built_per_rank_as_the_unsplit_layer_builds_them() -> None:
    run_distributed(init_case, 4)


def zero1_marked_experts_without_ep_case() -> None:
    """NxD marks expert weights ``expert_model_parallel`` whatever the ep size: at ep 1 (dp 4 here) they are
    replicated over dp like every other weight, and NxD's ZeRO-1 optimizer steps them so: after AdamW steps on
    per-rank grads every rank holds what torch's AdamW gives on the dp-averaged grads."""
    import torch.distributed as dist

    from meshpar.compat.nxd.optimizer import NeuronZero1Optimizer
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(4)]
    for p in params[2:]:
        p.expert_model_parallel = True
    dense = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = NeuronZero1Optimizer(params, torch.optim.AdamW, lr=1e-2, grad_clipping=False)
    reference = torch.optim.AdamW(dense, lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(3):
        torch.manual_seed(100 + step)
        grads = [torch.randn(world, 6, 4) for _ in params]
        for p, d, g in zip(params, dense, grads, strict=True):
            p.grad, d.grad = g[rank].clone(), g.mean(0)
        optimizer.step()
        reference.step()
    for p, d in zip(params, dense, strict=True):
        torch.testing.assert_close(p.detach(), d.detach(), atol=1e-6, rtol=1e-5)


def test_nxd_zero1_steps_marked_experts_as_dense_weights_without_expert_parallelism() -> None:
    run_distributed(zero1_marked_experts_without_ep_case, 4)


def marked_experts_without_ep_grads_case() -> None:
    """At dp 4 without expert parallelism, the weights NxD marks ``expert_model_parallel`` (whatever the ep size) are
    held alike by every dp rank: a pipeline's grad reduction averages them over dp like the dense ones (it used to
    refuse them for want of an expert-data-parallel group)."""
    import torch.distributed as dist

    from meshpar.compat.nxd.parallel_layers import parallel_state as ps
    from meshpar.data_parallel import DataParallelGrads
    from meshpar.parallel_dims import get_parallel

    rank = dist.get_rank()
    ps.initialize_model_parallel()
    try:
        dims = get_parallel()
        module = _Net(True, 1, None)
        for p in module.experts.parameters():  # as NxD's own layers mark them at any ep size
            p.expert_model_parallel = True
        for mode in ("allreduce", "overlapped"):
            for p in module.parameters():
                p.grad = torch.full_like(p, float(rank + 1))
            DataParallelGrads(mode, dims.dp_mesh, [module], expert_dp_mesh=dims.expert_dp_mesh).finish()
            for name, p in module.named_parameters():
                assert torch.allclose(p.grad, torch.full_like(p, 10 / 4)), (mode, name)
    finally:
        ps.destroy_model_parallel()


def test_marked_experts_without_expert_parallelism_are_averaged_over_dp() -> None:
    run_distributed(marked_experts_without_ep_grads_case, 4)
