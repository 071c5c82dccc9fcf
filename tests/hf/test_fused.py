"""meshpar's fused norms inside HF models: replaced only where proven the same math, equal to the stock model (loss,
every grad), names unchanged, compiled as one graph, and under ``parallelize`` at tp x sp x pp equal to dense."""

from __future__ import annotations

import copy

import pytest
import torch

from meshpar.hf.fused import FusedGatedMLP, FusedLayerNorm, FusedRMSNorm, use_fused_modules
from meshpar.testing import run_distributed
from tests.hf._configs import batch, build
from tests.hf.test_parallelize import equivalence_case


@pytest.mark.parametrize(
    ("family", "fused_types", "stock_left"),
    [("llama", {FusedRMSNorm, FusedGatedMLP}, 0), ("qwen3", {FusedRMSNorm, FusedGatedMLP}, 0),
     ("gpt2", {FusedLayerNorm}, 0), ("bert", {FusedLayerNorm}, 0), ("gemma2", set(), 11)],
)  # fmt: skip
def test_fused_modules_equal_the_stock_model(family: str, fused_types: set[type], stock_left: int) -> None:
    stock = build(family)
    fused = copy.deepcopy(stock)
    names = [n for n, _ in stock.named_parameters()]
    kept = use_fused_modules(fused)
    assert [n for n, _ in fused.named_parameters()] == names  # the same FQNs, the same order
    replaced = {type(m) for m in fused.modules() if isinstance(m, (FusedRMSNorm, FusedLayerNorm, FusedGatedMLP))}
    assert len(kept) == stock_left, kept
    assert replaced == fused_types
    # Gemma: norms scale by (1 + weight), the MLP's act is tanh-GeLU: the probes tell, nothing is replaced
    assert all("differs" in why for why in kept.values()), kept
    data = batch(family)
    expected, got = stock(**data), fused(**data)
    torch.testing.assert_close(got.loss, expected.loss)
    expected.loss.backward()
    got.loss.backward()
    for (name, mine), ref in zip(fused.named_parameters(), stock.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, ref.grad, msg=name)


def test_a_norm_with_other_math_under_a_norm_name_stays_stock() -> None:
    class OffsetRMSNorm(torch.nn.Module):  # RMSNorm by name, not by math
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(8)), 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight + 1

    model = torch.nn.Sequential(OffsetRMSNorm())
    assert use_fused_modules(model) == {"0": "OffsetRMSNorm: output differs from the stock module's"}
    assert isinstance(model[0], OffsetRMSNorm)


def test_fused_norm_compiles_into_one_graph() -> None:
    model = build("llama")
    use_fused_modules(model)
    norm = model.model.norm
    assert isinstance(norm, FusedRMSNorm)
    compiled = torch.compile(norm, fullgraph=True)
    x = torch.randn(2, 5, norm.weight.shape[0], requires_grad=True)
    compiled(x).sum().backward()
    ref = x.detach().requires_grad_()
    torch.testing.assert_close(compiled(x), norm(ref))


@pytest.mark.parametrize(("family", "world", "tp", "pp", "sp"), [("llama", 4, 2, 2, True), ("gpt2", 2, 2, 1, True)])
def test_parallelized_with_fused_kernels_matches_dense(family: str, world: int, tp: int, pp: int, sp: bool) -> None:
    """``fused_kernels: true``: the fused norms under tensor, sequence and pipeline parallelism, equal to dense."""
    run_distributed(equivalence_case, world, family, tp, pp, sp, False, False, "1f1b", 2, True)
