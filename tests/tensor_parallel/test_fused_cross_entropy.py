"""fused_linear_cross_entropy vs the dense LM head + F.cross_entropy: loss and grads of hidden and weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshpar._compat import DTensor, Shard
from meshpar.tensor_parallel.fused_cross_entropy import fused_linear_cross_entropy
from meshpar.testing import run_distributed, setup_parallel, shard_of


def fused_case(tp: int, vocab: int, chunk: int, smoothing: float, reduction: str, as_dtensor: bool) -> None:
    dims = setup_parallel(tp=tp)
    torch.manual_seed(0)
    hidden = torch.randn(2, 13, 16, requires_grad=True)
    weight = torch.randn(vocab, 16, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 13))
    labels[0, :4] = -100
    dense = F.cross_entropy(
        (hidden @ weight.t()).view(-1, vocab), labels.view(-1), label_smoothing=smoothing, reduction=reduction
    )
    dense.backward()
    local_weight = shard_of(weight.detach(), dims.tp_mesh, 0).clone().requires_grad_()
    w = (
        DTensor.from_local(local_weight, dims.tp_mesh, [Shard(0)], shape=weight.shape, stride=weight.stride())
        if as_dtensor
        else local_weight
    )
    h = hidden.detach().clone().requires_grad_()
    loss = fused_linear_cross_entropy(
        h,
        w,
        labels,
        vocab_size=vocab,
        chunk_size=chunk,
        label_smoothing=smoothing,
        reduction=reduction,
        tp_mesh=None if as_dtensor else dims.tp_mesh,
    )
    torch.testing.assert_close(loss, dense.detach(), atol=1e-5, rtol=1e-5)
    (loss * 3).backward()
    torch.testing.assert_close(h.grad, hidden.grad * 3, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(local_weight.grad, shard_of(weight.grad, dims.tp_mesh, 0) * 3, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("vocab", "chunk"), [(40, 7), (38, 26), (40, 1000)])  # 38: uneven vocab at tp=4
@pytest.mark.parametrize(("smoothing", "reduction"), [(0.0, "mean"), (0.1, "sum")])
def test_fused_linear_cross_entropy_matches_dense(tp, vocab, chunk, smoothing, reduction) -> None:
    run_distributed(fused_case, 4, tp, vocab, chunk, smoothing, reduction, tp == 2)


def bad_case() -> None:
    mesh = setup_parallel(tp=2).tp_mesh
    fused_linear_cross_entropy(
        torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4, dtype=torch.long), vocab_size=12, tp_mesh=mesh
    )


def test_wrong_shard_size_raises() -> None:
    with pytest.raises(AssertionError, match="weight shard has 5 rows, expected 6 for vocab_size 12"):
        run_distributed(bad_case, 2)


def out_of_vocabulary_label_case() -> None:
    mesh = setup_parallel(tp=2).tp_mesh
    labels = torch.tensor([0, 12, -100, 3])  # 12: past the vocabulary, owned by no rank
    fused_linear_cross_entropy(torch.randn(4, 8), torch.randn(6, 8), labels, vocab_size=12, tp_mesh=mesh)


def test_a_label_outside_the_vocabulary_raises_on_every_rank() -> None:
    with pytest.raises(AssertionError, match=r"(?s)rank 0.*must be in \[0, 12\).*rank 1.*must be in \[0, 12\)"):
        run_distributed(out_of_vocabulary_label_case, 2)
