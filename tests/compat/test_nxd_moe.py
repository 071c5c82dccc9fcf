"""NxD's MoE modules (``meshpar.compat.nxd.modules.moe``) against a dense mixture of experts written out here: at
tp 1, 2 and 4 (one gloo world of 4) the layer's output, the input's grad, the router's and every expert weight's
grad equal dense, with gated and plain MLPs, top-1 and top-2, renormalised affinities, biases, sequence parallelism,
and a capacity factor that drops tokens first come first served (the dense reference drops the same ones); the
load-balancing loss, the routers (top-k, activation over the top-k, Sinkhorn balancing) and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshpar.testing import run_distributed
from tests.compat.test_nxd_layers import _shard

E, H, INTER = 4, 8, 12


def dense_moe(x, router_w, up_w, up_b, down_w, down_b, *, top_k, capacity_factor, normalize, glu, act, router_b=None):
    """The dense layer: tokens in (flattened) order, each expert keeps its first C arrivals."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ router_w.T + (router_b if router_b is not None else 0)
    affinities = F.softmax(logits, dim=1, dtype=torch.float64).to(x.dtype)
    index = logits.topk(top_k, dim=1).indices
    total = tokens.shape[0]
    capacity = total
    if capacity_factor is not None and capacity_factor < E / top_k:
        capacity = min(math.ceil(total * top_k * capacity_factor / E), total)
    arrivals, kept = [0] * E, torch.zeros(total, E)
    for t in range(total):
        for e in index[t].tolist():
            arrivals[e] += 1
            kept[t, e] = float(arrivals[e] <= capacity)
    weights = affinities * kept
    if normalize:
        weights = weights / weights.sum(dim=1, keepdim=True).clamp_min(1e-12)
    out = torch.zeros_like(tokens)
    for e in range(E):
        h = tokens @ up_w[e] + (up_b[e] if up_b is not None else 0)
        inter = down_w.shape[1]
        h = act(h[:, :inter]) * h[:, inter:] if glu else act(h)
        y = h @ down_w[e] + (down_b[e] if down_b is not None else 0)
        out = out + y * weights[:, e : e + 1]
    return out.view(x.shape), logits, index


CASES = {
    "glu_top2_normalised": dict(glu=True, top_k=2, capacity_factor=None, normalize=True, bias=False, sp=False),
    "glu_top2_dropping_bias_sp": dict(glu=True, top_k=2, capacity_factor=1.0, normalize=True, bias=True, sp=True),
    "relu_top1_dropping": dict(glu=False, top_k=1, capacity_factor=0.5, normalize=False, bias=True, sp=False),
}


def moe_case(glu: bool, top_k: int, capacity_factor: float | None, normalize: bool, bias: bool, sp: bool) -> None:
    from meshpar.compat.nxd.modules.moe import ExpertMLPs, MoE, RouterTopK
    from meshpar.compat.nxd.parallel_layers import parallel_state

    act = F.silu if glu else F.relu
    for tp in (1, 2, 4):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
        torch.manual_seed(0)
        columns = 2 * INTER if glu else INTER
        router_w = torch.randn(E, H) * 0.5
        up_w, down_w = torch.randn(E, H, columns) * 0.3, torch.randn(E, INTER, H) * 0.3
        up_b, down_b = (torch.randn(E, columns) * 0.1, torch.randn(E, H) * 0.1) if bias else (None, None)
        x = torch.randn(8, 2, H) if sp else torch.randn(2, 8, H)  # NxD's [S, B, H] under SP, else [B, S, H]
        router = RouterTopK(E, top_k, H, sequence_parallel_enabled=sp)
        experts = ExpertMLPs(E, top_k, H, INTER, "silu" if glu else "relu", glu, capacity_factor,
                             normalize_top_k_affinities=normalize, bias=bias)  # fmt: skip
        layer = MoE(router, experts, sequence_parallel_enabled=sp, return_router_logits=True, return_expert_index=True)
        stride = 2 if glu else 1
        up = experts.mlp_op.gate_up_proj if glu else experts.mlp_op.up_proj
        with torch.no_grad():
            router.linear_router.weight.copy_(router_w)
            up.weight.copy_(_shard(up_w, 2, tp, rank, stride))
            experts.mlp_op.down_proj.weight.copy_(_shard(down_w, 1, tp, rank))
            if bias:
                up.bias.copy_(_shard(up_b, 1, tp, rank, stride))
                experts.mlp_op.down_proj.bias.copy_(down_b)
        assert up.weight.shape == (E, H, columns // tp) and up.weight.partition_dim == 2
        local_x = x.chunk(tp, dim=0)[rank] if sp else x
        xp = local_x.clone().requires_grad_()
        out, logits, index = layer(xp)
        dense_params = [t.clone().requires_grad_() if t is not None else None
                        for t in (router_w, up_w, up_b, down_w, down_b)]  # fmt: skip
        xd = x.clone().requires_grad_()
        ref, ref_logits, ref_index = dense_moe(xd, *dense_params, top_k=top_k, capacity_factor=capacity_factor,
                                               normalize=normalize, glu=glu, act=act)  # fmt: skip
        expected = ref.chunk(tp, dim=0)[rank] if sp else ref
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(index, ref_index)
        grad = torch.randn_like(ref)
        out.backward(grad.chunk(tp, dim=0)[rank] if sp else grad)
        ref.backward(grad)
        torch.testing.assert_close(xp.grad, xd.grad.chunk(tp, dim=0)[rank] if sp else xd.grad, atol=1e-5, rtol=1e-4)
        router_grad = router.linear_router.weight.grad.clone()
        if sp:  # a sequence-parallel router's grad is this rank's part: NxD sums it over tp (marked for that)
            assert router.linear_router.weight.sequence_parallel_enabled
            torch.distributed.all_reduce(router_grad, group=group)
        torch.testing.assert_close(router_grad, dense_params[0].grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(up.weight.grad, _shard(dense_params[1].grad, 2, tp, rank, stride), atol=1e-5,
                                   rtol=1e-4)  # fmt: skip
        torch.testing.assert_close(experts.mlp_op.down_proj.weight.grad, _shard(dense_params[3].grad, 1, tp, rank),
                                   atol=1e-5, rtol=1e-4)  # fmt: skip
        if bias:
            torch.testing.assert_close(up.bias.grad, _shard(dense_params[2].grad, 1, tp, rank, stride), atol=1e-5,
                                       rtol=1e-4)  # fmt: skip
            torch.testing.assert_close(experts.mlp_op.down_proj.bias.grad, dense_params[4].grad, atol=1e-5, rtol=1e-4)
        layer.eval()  # evaluation routes the same (a sequence-parallel router gathers its logits there too)
        with torch.no_grad():
            torch.testing.assert_close(layer(local_x)[0], expected, atol=1e-5, rtol=1e-5)
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("case", list(CASES))
def test_nxd_moe_equals_dense_mixture_of_experts(case: str) -> None:
    run_distributed(moe_case, 4, **CASES[case])


def capacity_case() -> None:
    """At capacity factor 0.5 with 8 tokens, top-1, 4 experts, each expert keeps its first ceil(8*0.5/4) = 1 token:
    dropped tokens get a zero output."""
    from meshpar.compat.nxd.modules.moe import ExpertMLPs
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)

    experts = ExpertMLPs(E, 1, H, INTER, "relu", False, 0.5)
    assert experts.expert_capacity(8) == 1
    index = torch.tensor([[0], [0], [1], [2], [1], [3], [3], [0]])
    kept = experts._kept(index, 8)
    assert kept.sum(dim=1).tolist() == [1, 0, 1, 1, 0, 1, 0, 0]
    out = experts(torch.randn(8, H), torch.ones(8, E) / E, index)
    assert (out[kept.sum(dim=1) == 0] == 0).all() and (out[kept.sum(dim=1) == 1] != 0).any()
    assert ExpertMLPs(E, 2, H, INTER, "relu", False, 2.0).capacity_factor is None  # E / k: nothing to drop
    assert ExpertMLPs(E, 2, H, INTER, "relu", False, 0.0).capacity_factor is None  # blockwise: dropless


def test_capacity_factor_drops_tokens_first_come_first_served() -> None:
    run_distributed(capacity_case, 1)


def test_load_balancing_loss() -> None:
    from meshpar.compat.nxd.modules.moe import load_balancing_loss_func

    torch.manual_seed(1)
    logits = torch.randn(32, E)
    probabilities = logits.softmax(-1)
    chosen = probabilities.topk(2, dim=-1).indices
    expected = 0.0
    for slot in range(2):
        for e in range(E):
            expected += (chosen[:, slot] == e).float().mean() * probabilities[:, e].mean()
    torch.testing.assert_close(load_balancing_loss_func(logits, E, 2), expected * E / 2, atol=1e-6, rtol=0)
    uniform = torch.eye(E).repeat(8, 1) * 10  # every expert chosen equally, probabilities nearly one-hot
    assert abs(float(load_balancing_loss_func(uniform, E, 1)) - 1.0) < 1e-3


def routers_case() -> None:
    from meshpar.compat.nxd.modules.moe import RouterSinkhorn, RouterTopK
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)

    torch.manual_seed(2)
    x = torch.randn(2, 16, H)
    router = RouterTopK(E, 2, H, act_fn="sigmoid", apply_act_fn_over_topk=True)
    logits, affinities, index = router(x)
    assert logits.shape == (32, E) and index.shape == (32, 2)
    assert torch.equal(index, logits.topk(2, dim=1).indices)
    assert ((affinities > 0).sum(dim=1) == 2).all()  # the activation over the chosen two only
    torch.testing.assert_close(affinities.gather(1, index), logits.gather(1, index).sigmoid())
    sinkhorn = RouterSinkhorn(E, 1, H)
    skewed = torch.zeros(32, E)
    skewed[:, 0] = 2.0  # scores that prefer expert 0 for every token
    skewed += torch.randn(32, E) * 0.1
    balanced = RouterSinkhorn._sinkhorn(skewed, 30)
    torch.testing.assert_close(balanced.sum(dim=0), torch.full((E,), 1 / E), atol=1e-3, rtol=0)
    counts = torch.bincount(balanced.argmax(dim=1), minlength=E)
    assert counts.max() < 32 and (skewed.argmax(dim=1) == 0).all()  # balancing spreads what argmax would not
    sinkhorn.eval()
    _, _, eval_index = sinkhorn(x)
    assert torch.equal(eval_index.squeeze(1), sinkhorn.linear_router(x).reshape(-1, E).argmax(dim=1))
    with pytest.raises(NotImplementedError, match="Top-1"):
        RouterSinkhorn(E, 2, H)
    with pytest.raises(ValueError, match="Invalid top_k"):
        RouterTopK(E, E + 1, H)
    with pytest.raises(ValueError, match="act_fn"):
        RouterTopK(E, 1, H, act_fn="relu")


def test_routers() -> None:
    run_distributed(routers_case, 1)


def refusals_case() -> None:
    from meshpar.compat.nxd.modules.moe import ExpertMLPs, MoE, RouterTopK
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="Inconsistent top_k"):
        MoE(RouterTopK(E, 1, H), ExpertMLPs(E, 2, H, INTER, "silu", True, None))
    with pytest.raises(ValueError, match="must have SP enabled"):
        MoE(RouterTopK(E, 1, H, sequence_parallel_enabled=True), ExpertMLPs(E, 1, H, INTER, "silu", True, None))
    with pytest.raises(ValueError, match="Unknown activation"):
        ExpertMLPs(E, 1, H, INTER, "swish", True, None)
    with pytest.raises(ValueError, match="normalizing top-k"):
        ExpertMLPs(E, 1, H, INTER, "silu", True, None, normalize_top_k_affinities=True)
    with pytest.raises(ValueError, match=r"divisible|divide"):
        ExpertMLPs(E, 1, H, 7, "silu", True, None)  # intermediate 7 over tp 2
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        ExpertMLPs(E, 1, H, INTER, "silu", True, None, capacity_facter=1.0)
    with pytest.raises(NotImplementedError, match="early_expert_affinity_modulation"):
        ExpertMLPs(E, 1, H, INTER, "silu", True, None, early_expert_affinity_modulation=True)
    ExpertMLPs(E, 1, H, INTER, "silu", True, None, use_torch_block_wise=True, logical_nc_config=2)  # kernel knobs
    with pytest.raises(ValueError, match="divisor of the data parallel size 1"):  # tp2 on 2 ranks: dp is 1
        MoE(RouterTopK(E, 1, H), ExpertMLPs(E, 1, H, INTER, "silu", True, None), token_shuffle_group_size=2)


def test_nxd_moe_refusals() -> None:
    run_distributed(refusals_case, 2)


def token_shuffle_case(sp: bool) -> None:
    """tp2 x dp2, shuffle groups of the two dp ranks: tokens really move between the dp ranks and come back exactly;
    an MoE layer with token shuffling gives the output and input grad of the same layer without it (dropless: each
    token's output is its own), and its weight grads summed over dp equal the unshuffled layer's."""
    import torch.distributed as dist

    from meshpar.compat.nxd.modules.moe import ExpertMLPs, MoE, RouterTopK, token_shuffling
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    dp_rank, tp_rank = parallel_state.get_data_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    parallel_state.initialize_token_shuffle_group(2)
    assert parallel_state.get_token_shuffle_group_size() == 2
    assert sorted(map(sorted, parallel_state.get_token_shuffle_replica_groups())) == sorted(
        map(sorted, parallel_state.get_data_parallel_replica_groups())
    )
    marked = (1000.0 * dp_rank + torch.arange(16.0)).reshape(2, 8, 1)
    shuffled, permutation = token_shuffling.token_shuffle(marked)
    assert (shuffled >= 1000).any() and (shuffled < 1000).any()  # rows of both dp ranks on each
    torch.testing.assert_close(token_shuffling.token_unshuffle(shuffled, permutation), marked, rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not split evenly"):
        token_shuffling.token_shuffle(torch.zeros(1, 3, 1))

    def build(shuffle: int) -> MoE:
        torch.manual_seed(7)
        router = RouterTopK(E, 2, H, sequence_parallel_enabled=sp)
        experts = ExpertMLPs(E, 2, H, INTER, "silu", True, None, normalize_top_k_affinities=True)
        return MoE(router, experts, sequence_parallel_enabled=sp, token_shuffle_group_size=shuffle)

    plain, shuffling = build(1), build(2)
    torch.manual_seed(100 + dp_rank)  # each dp rank its own tokens
    x = torch.randn(8, 2, H) if sp else torch.randn(2, 8, H)
    local = x.chunk(2, dim=0)[tp_rank] if sp else x
    torch.manual_seed(50 + tp_rank)  # the tp ranks' generators differ: their permutations must still agree
    outs, grads = [], []
    for layer in (plain, shuffling):
        xp = local.clone().requires_grad_()
        out = layer(xp)[0]
        out.backward(torch.ones_like(out) * (1 + torch.arange(out.numel()).reshape(out.shape) % 3))
        outs.append(out.detach())
        grads.append(xp.grad)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)
    dp_group = parallel_state.get_data_parallel_group()
    for (name, p_plain), p_shuffled in zip(plain.named_parameters(), shuffling.parameters(), strict=True):
        summed = [p_plain.grad.clone(), p_shuffled.grad.clone()]
        for g in summed:
            dist.all_reduce(g, group=dp_group)
        torch.testing.assert_close(summed[1], summed[0], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("sp", [False, True])
def test_token_shuffling_moves_tokens_across_dp_and_changes_no_numbers(sp: bool) -> None:
    run_distributed(token_shuffle_case, 4, sp)
