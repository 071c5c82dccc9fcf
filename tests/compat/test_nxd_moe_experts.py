"""NxD's MoE building blocks (``modules.moe.moe_parallel_layers``, ``.experts``, ``.shared_experts``) against dense
MLPs written out here, in one gloo world of 4: the expert-fused layers and ``Experts`` at tp 1, 2 and 4 and under
expert parallelism (tp 1 x ep 2, tp 2 x ep 2), the outputs (summed over tp, as NxD's MoE sums them), the input's and
every weight's grad and the weights after an SGD step equal dense; the experts are the same at every tp and ep;
the expert-parallel marks; ``SharedExperts`` alone and inside ``MoE``; and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshpar.testing import run_distributed
from tests.compat.test_nxd_layers import _shard

E, C, H, INTER = 4, 6, 8, 12
LR = 0.1


def dense_experts(x, up_w, up_b, down_w, down_b, *, glu):
    """Expert ``e``'s MLP over its slots ``x[e]`` (``x`` ``[E or 1, C, H]``), gate columns then up columns."""
    h = torch.einsum("ech,ehi->eci", x.expand(up_w.shape[0], -1, -1), up_w)
    if up_b is not None:
        h = h + up_b[:, None]
    h = F.silu(h[..., :INTER]) * h[..., INTER:] if glu else F.silu(h)
    y = torch.einsum("eci,eih->ech", h, down_w)
    return y + down_b[:, None] if down_b is not None else y


def _dense_weights(glu: bool, bias: bool) -> list[torch.Tensor | None]:
    torch.manual_seed(0)
    columns = 2 * INTER if glu else INTER
    up_w, down_w = torch.randn(E, H, columns) * 0.3, torch.randn(E, INTER, H) * 0.3
    up_b, down_b = (torch.randn(E, columns) * 0.1, torch.randn(E, H) * 0.1) if bias else (None, None)
    return [up_w, up_b, down_w, down_b]


def _load(module, dense, experts: slice, tp: int, tp_rank: int, glu: bool) -> list[torch.nn.Parameter | None]:
    """This rank's parts of the dense weights copied into ``module`` (an ``Experts``); its parameters in the order
    of ``dense``."""
    up_w, up_b, down_w, down_b = dense
    up = module.gate_up_proj if glu else module.up_proj
    stride = 2 if glu else 1
    with torch.no_grad():
        up.weight.copy_(_shard(up_w[experts], 2, tp, tp_rank, stride))
        module.down_proj.weight.copy_(_shard(down_w[experts], 1, tp, tp_rank))
        if up_b is not None:
            up.bias.copy_(_shard(up_b[experts], 1, tp, tp_rank, stride))
            module.down_proj.bias.copy_(down_b[experts])
    return [up.weight, up.bias, module.down_proj.weight, module.down_proj.bias]


def experts_case(glu: bool, bias: bool) -> None:
    """tp 1, 2, 4 and tp 1 x ep 2, tp 2 x ep 2: every ep rank holds its slots of every expert (``C / ep`` of them,
    its share of the ``[E, C, H]`` slots); the outputs come back to it, summed over tp."""
    from meshpar.compat.nxd.modules.moe.experts import Experts
    from meshpar.compat.nxd.parallel_layers import parallel_state as ps

    for tp, ep in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2)):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        block = slice(ep_rank * E // ep, (ep_rank + 1) * E // ep)
        dense = _dense_weights(glu, bias)
        module = Experts(E, H, INTER, glu, F.silu, torch.float32, None, bias=bias)
        params = _load(module, dense, block, tp, tp_rank, glu)
        assert params[0].shape == (E // ep, H, (2 * INTER if glu else INTER) // tp) and params[0].partition_dim == 2
        assert params[2].shape == (E // ep, INTER // tp, H) and params[2].partition_dim == 1
        x_all = torch.randn(E, C, H, generator=torch.Generator().manual_seed(1))
        x = x_all.chunk(ep, dim=1)[ep_rank].clone().requires_grad_()
        out = module(x)
        total = out.clone()
        dist.all_reduce(total, group=ps.get_tensor_model_parallel_group())

        dense_params = [t.clone().requires_grad_() if t is not None else None for t in dense]
        xd = x_all.clone().requires_grad_()
        ref = dense_experts(xd, *dense_params[:3], None, glu=glu)
        if bias:  # the down bias is added on every tp rank before the sum (NxD's; tp copies of it)
            ref = ref + tp * dense_params[3][:, None]
        expected = ref.chunk(ep, dim=1)[ep_rank]
        torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)

        grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
        # the partial outputs' grad is the sum's: each rank's output gets the whole grad of its slots
        out.backward(grad.chunk(ep, dim=1)[ep_rank])
        ref.backward(grad)
        torch.testing.assert_close(x.grad, xd.grad.chunk(ep, dim=1)[ep_rank], atol=1e-5, rtol=1e-4)
        stride = 2 if glu else 1
        wanted = [
            _shard(dense_params[0].grad[block], 2, tp, tp_rank, stride),
            _shard(dense_params[1].grad[block], 1, tp, tp_rank, stride) if bias else None,
            _shard(dense_params[2].grad[block], 1, tp, tp_rank),
            dense_params[3].grad[block] / tp if bias else None,  # the tp copies' grads sum to the dense one
        ]
        for param, expect in zip(params, wanted, strict=True):
            if param is not None:
                torch.testing.assert_close(param.grad, expect, atol=1e-5, rtol=1e-4)
        with torch.no_grad():  # an SGD step on both sides: the weights stay this rank's parts of the dense ones
            for i, (param, dense_param) in enumerate(zip(params, dense_params, strict=True)):
                if param is not None:
                    param -= LR * param.grad
                    # the down bias's tp copies each step by their grad, 1/tp of the dense bias's
                    dense_param -= LR * dense_param.grad / (tp if i == 3 else 1)
        stepped = [
            _shard(dense_params[0][block], 2, tp, tp_rank, stride),
            _shard(dense_params[2][block], 1, tp, tp_rank),
        ]
        torch.testing.assert_close(params[0].detach(), stepped[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(params[2].detach(), stepped[1], atol=1e-6, rtol=1e-5)

        module.eval()  # evaluation: the local experts' slots only (NxD's), no exchange
        with torch.no_grad():
            local = x_all[block]
            out = module(local)
            dist.all_reduce(out, group=ps.get_tensor_model_parallel_group())
            dense_now = [t.detach() if t is not None else None for t in dense_params]
            ref = dense_experts(local, dense_now[0][block], dense_now[1][block] if bias else None,
                                dense_now[2][block], None, glu=glu)  # fmt: skip
            if bias:
                ref = ref + tp * dense_now[3][block][:, None]
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=f"tp {tp} ep {ep}")
        ps.destroy_model_parallel()


@pytest.mark.parametrize("glu,bias", [(True, False), (False, True)], ids=["glu", "plain_bias"])
def test_experts_equal_dense_at_every_tp_and_ep(glu: bool, bias: bool) -> None:
    run_distributed(experts_case, 4, glu=glu, bias=bias)


def layers_case() -> None:
    """The fused layers alone: one expert's slots broadcast over all experts, ``expert_indices`` picking experts,
    the experts the same at every tp and ep, the expert-parallel marks, and the refusals."""
    from meshpar.compat.nxd.modules.moe.moe_parallel_layers import (
        ExpertFusedColumnParallelLinear,
        ExpertFusedLinearWithAsyncCommunication,
        ExpertFusedRowParallelLinear,
    )
    from meshpar.compat.nxd.parallel_layers import parallel_state as ps

    def build(**kw):
        torch.manual_seed(3)
        column = ExpertFusedColumnParallelLinear(E, H, 2 * INTER, bias=True, stride=2, **kw)
        row = ExpertFusedRowParallelLinear(E, INTER, H, bias=True, **kw)
        return column, row

    ps.initialize_model_parallel()
    whole_column, whole_row = build()
    assert not hasattr(whole_column.weight, "expert_model_parallel")  # ep 1: dense weights
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    block = slice(2 * ep_rank, 2 * ep_rank + 2)
    column, row = build()
    torch.testing.assert_close(column.weight, _shard(whole_column.weight[block], 2, 2, tp_rank, 2), rtol=0, atol=0)
    torch.testing.assert_close(column.bias, _shard(whole_column.bias[block], 1, 2, tp_rank, 2), rtol=0, atol=0)
    torch.testing.assert_close(row.weight, _shard(whole_row.weight[block], 1, 2, tp_rank), rtol=0, atol=0)
    torch.testing.assert_close(row.bias, whole_row.bias[block], rtol=0, atol=0)
    for layer in (column, row):
        assert all(p.expert_model_parallel and p.is_prefill for p in layer.parameters())
        assert all(t.expert_model_parallel for t in layer.state_dict().values())
        assert layer.expert_model_parallel_group.size() == 2
    assert all(p.expert_model_parallel for p in column.to(torch.float64).parameters())  # marks survive a cast
    assert (column.weight.partition_dim, column.bias.partition_dim, row.weight.partition_dim) == (2, 1, 1)
    with pytest.raises(NotImplementedError, match="expert_distribution"):
        ExpertFusedRowParallelLinear(E, INTER, H, expert_distribution=[[0, 1], [2, 3]])
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    torch.manual_seed(4)
    column = ExpertFusedColumnParallelLinear(E, H, INTER)
    row = ExpertFusedRowParallelLinear(E, INTER, H)
    up, down = torch.randn(E, H, INTER), torch.randn(E, INTER, H)
    with torch.no_grad():
        column.weight.copy_(_shard(up, 2, 2, tp_rank))
        row.weight.copy_(_shard(down, 1, 2, tp_rank))
    x = torch.randn(1, 1, C, H, requires_grad=True)  # one set of slots broadcast over every expert
    out = row(column(x))  # row's output summed over tp (reduce_output defaults to True)
    ref_x = x.detach().clone().requires_grad_()
    ref = torch.einsum("exci,eih->exch", torch.einsum("exch,ehi->exci", ref_x.expand(E, -1, -1, -1), up), down)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, atol=1e-4, rtol=1e-5)  # summed over experts and over tp
    picked = torch.tensor([3, 1])
    some = row(column(x.detach().expand(2, -1, -1, -1), expert_indices=picked), expert_indices=picked)
    torch.testing.assert_close(some, ref.detach()[picked], atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="disagree on the number of experts"):
        column(torch.randn(3, 1, C, H))
    with pytest.raises(NotImplementedError, match="sequence parallelism"):
        ExpertFusedLinearWithAsyncCommunication.apply(x, column.weight, None, False, True, 0, True, group)
    ps.destroy_model_parallel()


def test_expert_fused_layers() -> None:
    run_distributed(layers_case, 4)


def experts_refusals_case() -> None:
    from meshpar.compat.nxd.modules.moe.experts import Experts
    from meshpar.compat.nxd.parallel_layers import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    module = Experts(E, H, INTER, True, F.silu, torch.float32, None)
    with pytest.raises(ValueError, match="Selective expert loading"):
        module(torch.randn(2, C, H), expert_indices=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"\[experts, capacity, hidden\]"):
        module(torch.randn(C, H))
    with pytest.raises(ValueError, match="3 experts' slots for 4 experts"):
        module(torch.randn(3, C, H))
    with pytest.raises(ValueError, match="glu_type"):
        Experts(E, H, INTER, True, F.silu, torch.float32, None, glu_type="geglu")
    ps.destroy_model_parallel()


def test_experts_refusals() -> None:
    run_distributed(experts_refusals_case, 2)


def _dense_shared(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def shared_case() -> None:
    """``SharedExperts`` at tp 1, 2, 4, fused and unfused, summed over tp, equals the dense gated MLP (outputs,
    grads); its transposed inference layout loads a dense checkpoint and computes the same in eval; and inside
    ``MoE`` the shared experts' output joins the routed experts' before the one tp sum."""
    from meshpar.compat.nxd.modules.moe import ExpertMLPs, MoE, RouterTopK
    from meshpar.compat.nxd.modules.moe.shared_experts import SharedExperts
    from meshpar.compat.nxd.parallel_layers import parallel_state as ps
    from meshpar.compat.nxd.parallel_layers.checkpointing import get_sharded_model_dict

    shared, width = 2, 2 * INTER
    for tp in (1, 2, 4):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        torch.manual_seed(5)
        gate, up, down = torch.randn(width, H) * 0.3, torch.randn(width, H) * 0.3, torch.randn(H, width) * 0.3
        x = torch.randn(10, H)
        for fused in (False, True):
            module = SharedExperts(H, INTER, shared, "silu", fused_gate_up_projection=fused)
            with torch.no_grad():
                if fused:
                    module.gate_up_proj.weight.copy_(_shard(torch.cat([gate, up]), 0, tp, rank, 2))
                else:
                    module.gate_proj.weight.copy_(_shard(gate, 0, tp, rank))
                    module.up_proj.weight.copy_(_shard(up, 0, tp, rank))
                module.down_proj.weight.copy_(_shard(down, 1, tp, rank))
            xp = x.clone().requires_grad_()
            out = module(xp, 10)
            total = out.clone()
            dist.all_reduce(total, group=group)
            dense = [t.clone().requires_grad_() for t in (gate, up, down)]
            xd = x.clone().requires_grad_()
            ref = _dense_shared(xd, *dense)
            torch.testing.assert_close(total, ref, atol=1e-5, rtol=1e-5)
            grad = torch.randn_like(ref)
            out.backward(grad)  # the column layers sum the input's grad over tp; the tp sum hands out the whole grad
            ref.backward(grad)
            torch.testing.assert_close(xp.grad, xd.grad, atol=1e-5, rtol=1e-4)
            down_grad = _shard(dense[2].grad, 1, tp, rank)
            torch.testing.assert_close(module.down_proj.weight.grad, down_grad, atol=1e-5, rtol=1e-4)
            if fused:
                gate_grad = module.gate_up_proj.weight.grad
                expect = _shard(torch.cat([dense[0].grad, dense[1].grad]), 0, tp, rank, 2)
            else:
                gate_grad, expect = module.gate_proj.weight.grad, _shard(dense[0].grad, 0, tp, rank)
            torch.testing.assert_close(gate_grad, expect, atol=1e-5, rtol=1e-4)

        transposed = SharedExperts(H, INTER, shared, "silu", transpose_weights=True)
        state = {"gate_proj.weight": gate.clone(), "up_proj.weight": up.clone(), "down_proj.weight": down.clone()}
        transposed.load_state_dict(get_sharded_model_dict(transposed, state))
        assert transposed.gate_proj.weight.shape == (H, width // tp)
        with pytest.raises(NotImplementedError, match="eval"):
            transposed(x, 10)
        transposed.eval()
        with torch.no_grad():
            total = transposed(x, 10)
            dist.all_reduce(total, group=group)
        torch.testing.assert_close(total, _dense_shared(x, gate, up, down), atol=1e-5, rtol=1e-5)

        torch.manual_seed(6)  # MoE with shared experts: routed experts plus the shared MLP, one tp sum
        router = RouterTopK(E, 2, H)
        experts = ExpertMLPs(E, 2, H, INTER, "silu", True, None)
        module = SharedExperts(H, INTER, shared, "silu")
        with torch.no_grad():
            module.gate_proj.weight.copy_(_shard(gate, 0, tp, rank))
            module.up_proj.weight.copy_(_shard(up, 0, tp, rank))
            module.down_proj.weight.copy_(_shard(down, 1, tp, rank))
        with_shared = MoE(router, experts, shared_experts=module)
        without = MoE(router, experts)
        tokens = torch.randn(2, 5, H)
        with torch.no_grad():
            torch.testing.assert_close(
                with_shared(tokens)[0], without(tokens)[0] + _dense_shared(tokens, gate, up, down),
                atol=1e-5, rtol=1e-5,
            )  # fmt: skip
        ps.destroy_model_parallel()
    with pytest.raises(NotImplementedError, match="sequence_parallel_enabled"):
        SharedExperts(H, INTER, 1, "silu", sequence_parallel_enabled=True)
    with pytest.raises(ValueError, match="Unknown activation"):
        SharedExperts(H, INTER, 1, "swish")


def test_shared_experts() -> None:
    run_distributed(shared_case, 4)
