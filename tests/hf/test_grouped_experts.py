"""``"meshpar_grouped_mm"``, meshpar's experts implementation (each projection one ``meshpar.ops.grouped_mm``),
against each family's eager experts forward: loss and every grad, in one process; and at ep2 x tp2 against dense."""

from __future__ import annotations

import copy

import pytest
import torch

import meshpar.hf  # noqa: F401  (registers the implementation)
from meshpar import ops
from meshpar.ops._dispatch import interpreting, triton_available
from meshpar.testing import run_distributed
from tests.hf._configs import batch, build
from tests.hf.test_expert_parallel import expert_parallel_case

# stacked gate / up (Mixtral), shared experts (Qwen2-MoE, DeepSeek-V3), biases, weights stored transposed and the
# family's own interleaved gating (gpt-oss), plain top-k (OLMoE)
FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "olmoe"]


def _with_random_expert_biases(model: torch.nn.Module) -> torch.nn.Module:
    """gpt-oss initialises its expert biases to zero, which would hide a bias added to the wrong rows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name and name.endswith("_bias"):
                param.normal_()
    return model


def _loss_and_grads(model: torch.nn.Module, data: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**data).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_experts_equal_the_eager_forward(family: str) -> None:
    eager = _with_random_expert_biases(build(family))
    eager.set_experts_implementation("eager")
    grouped = copy.deepcopy(eager)
    grouped.set_experts_implementation("meshpar_grouped_mm")
    data = batch(family)
    expected, expected_grads = _loss_and_grads(eager, data)
    kernels = triton_available() and (torch.cuda.is_available() or interpreting())
    with ops.triton_enabled(True if kernels and family == "gpt_oss" else None):  # one family through the kernels
        loss, grads = _loss_and_grads(grouped, data)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_grouped_experts_under_expert_parallelism_match_dense() -> None:
    """Each ep rank runs the forward on the rows and the experts it holds (ep2 x tp2 against the dense model)."""
    run_distributed(expert_parallel_case, 4, "mixtral", 2, 2, 1, 4, "meshpar_grouped_mm")


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])  # gpt-oss: biases, which a zero row does not cancel
def test_pairs_for_experts_a_rank_does_not_hold_contribute_nothing(family: str) -> None:
    """transformers' own expert parallelism hands a rank's experts forward ids at or past ``num_experts`` for the
    pairs routed to experts elsewhere: they add nothing, as a pair of weight zero does."""
    from meshpar.hf.grouped_experts import grouped_experts_forward

    experts = _with_random_expert_biases(build(family)).model.layers[0].mlp.experts
    torch.manual_seed(0)
    hidden = torch.randn(5, experts.gate_up_proj.shape[1 if experts.is_transposed else 2])
    elsewhere = experts.num_experts  # an expert this rank does not hold
    index = torch.tensor([[0, 3], [1, elsewhere], [elsewhere, 2], [3, 1], [0, 2]])
    weights = torch.rand(5, 2)
    away = index >= experts.num_experts
    got = grouped_experts_forward(experts, hidden, index, weights)
    want = grouped_experts_forward(experts, hidden, index.masked_fill(away, 0), weights.masked_fill(away, 0))
    torch.testing.assert_close(got, want)
