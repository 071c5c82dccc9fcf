"""meshpar ops on DTensor inputs: local math on local shards, placements kept, replicated-weight grads correct."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshpar import ops
from meshpar._compat import DTensor, Replicate, Shard
from meshpar.testing import run_distributed, setup_parallel, shard_of


def dtensor_ops_case(sequence_sharded: bool) -> None:
    dims = setup_parallel(tp=2)
    mesh = dims.tp_mesh
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8)
    w = torch.randn(8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    grad = torch.randn(2, 6, 8)
    expected = F.layer_norm(x, (8,), w, b)
    expected.backward(grad)

    placement = Shard(1) if sequence_sharded else Replicate()
    x_local = shard_of(x, mesh, 1) if sequence_sharded else x
    x_d = DTensor.from_local(x_local.clone(), mesh, [placement])
    w_d = DTensor.from_local(w.detach().clone(), mesh, [Replicate()]).requires_grad_()
    b_d = DTensor.from_local(b.detach().clone(), mesh, [Replicate()]).requires_grad_()
    out = ops.layer_norm(x_d, w_d, b_d)
    assert isinstance(out, DTensor) and out.placements == (placement,)
    torch.testing.assert_close(out.full_tensor(), expected.detach(), atol=1e-5, rtol=1e-5)
    grad_local = shard_of(grad, mesh, 1) if sequence_sharded else grad
    out.backward(DTensor.from_local(grad_local, mesh, [placement]))
    torch.testing.assert_close(w_d.grad.full_tensor(), w.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b_d.grad.full_tensor(), b.grad, atol=1e-5, rtol=1e-5)

    act = ops.swiglu(x_d, x_d)
    assert act.placements == (placement,)
    torch.testing.assert_close(act.full_tensor(), F.silu(x) * x, atol=1e-5, rtol=1e-5)


def test_ops_on_sequence_sharded_dtensors() -> None:
    run_distributed(dtensor_ops_case, 2, True)


def test_ops_on_replicated_dtensors() -> None:
    run_distributed(dtensor_ops_case, 2, False)
