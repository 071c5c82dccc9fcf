"""parallel_cross_entropy against F.cross_entropy on gathered logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshpar import parallel_cross_entropy
from meshpar._compat import DTensor, Shard
from meshpar.testing import run_distributed, setup_parallel, shard_of


def _inputs(vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, vocab) * 4).to(dtype)
    labels = torch.randint(0, vocab, (3, 7))
    labels[0, 2] = -100
    labels[1, :3] = -100
    labels[2, 0] = vocab - 1
    labels[2, 1] = 0
    return logits, labels


def cross_entropy_case(tp: int, vocab: int, label_smoothing: float, as_dtensor: bool, dtype: torch.dtype) -> None:
    dims = setup_parallel(tp=tp)
    logits, labels = _inputs(vocab, dtype)
    dense_logits = logits.clone().requires_grad_()
    expected = F.cross_entropy(
        dense_logits.float().view(-1, vocab), labels.view(-1), reduction="none", label_smoothing=label_smoothing
    ).view(3, 7)
    grad_out = torch.rand(3, 7)
    expected.backward(grad_out)

    local = shard_of(logits, dims.tp_mesh, -1).clone().requires_grad_()
    if as_dtensor:
        inp = DTensor.from_local(
            local, dims.tp_mesh, [Shard(2)], shape=logits.shape, stride=logits.stride(), run_check=False
        )
    else:
        inp = local
    loss = parallel_cross_entropy(inp, labels, label_smoothing=label_smoothing, vocab_size=vocab)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(loss, expected.detach(), **tol)
    loss.backward(grad_out)
    torch.testing.assert_close(local.grad, shard_of(dense_logits.grad, dims.tp_mesh, -1), **tol)
    assert local.grad.dtype == dtype


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("as_dtensor", [False, True])
def test_parallel_cross_entropy_matches_dense(tp: int, label_smoothing: float, as_dtensor: bool) -> None:
    run_distributed(cross_entropy_case, 4, tp, 36, label_smoothing, as_dtensor, torch.float32)


@pytest.mark.parametrize("as_dtensor", [False, True])
def test_vocab_not_divisible_by_tp(as_dtensor: bool) -> None:
    run_distributed(cross_entropy_case, 4, 4, 38, 0.1, as_dtensor, torch.float32)  # shards of 10, 10, 10, 8


def test_parallel_cross_entropy_bf16_logits() -> None:
    run_distributed(cross_entropy_case, 2, 2, 64, 0.1, False, torch.bfloat16)


def ignore_all_case() -> None:
    dims = setup_parallel(tp=2)
    logits = torch.randn(4, 10, requires_grad=True)
    labels = torch.full((4,), -100)
    local = shard_of(logits.detach(), dims.tp_mesh, -1).requires_grad_()
    loss = parallel_cross_entropy(local, labels)
    assert torch.equal(loss, torch.zeros(4))
    loss.sum().backward()
    assert torch.equal(local.grad, torch.zeros_like(local))


def test_all_ignored_gives_zero_loss_and_grad() -> None:
    run_distributed(ignore_all_case, 2)


def bad_shapes_case(kind: str) -> None:
    setup_parallel(tp=2)
    if kind == "labels":
        parallel_cross_entropy(torch.randn(4, 5), torch.zeros(3, dtype=torch.long))
    else:
        parallel_cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), vocab_size=12)


def test_mismatched_label_shape_raises() -> None:
    with pytest.raises(AssertionError, match="disagree on the token dims"):
        run_distributed(bad_shapes_case, 2, "labels")


def test_shard_width_not_matching_vocab_size_raises() -> None:
    with pytest.raises(AssertionError, match="does not match vocab_size 12 split over tp=2"):
        run_distributed(bad_shapes_case, 2, "vocab")
