"""parallel_cross_entropy against F.cross_entropy on gathered logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshpar import parallel_cross_entropy
from meshpar._compat import DTensor, Shard
from meshpar.tensor_parallel.cross_entropy import token_cross_entropy
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
    loss = parallel_cross_entropy(
        inp, labels, label_smoothing=label_smoothing, vocab_size=vocab, tp_mesh=None if as_dtensor else dims.tp_mesh
    )
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
    loss = parallel_cross_entropy(local, labels, tp_mesh=dims.tp_mesh)
    assert torch.equal(loss, torch.zeros(4))
    loss.sum().backward()
    assert torch.equal(local.grad, torch.zeros_like(local))


def test_all_ignored_gives_zero_loss_and_grad() -> None:
    run_distributed(ignore_all_case, 2)


def bad_shapes_case(kind: str) -> None:
    mesh = setup_parallel(tp=2).tp_mesh
    if kind == "labels":
        parallel_cross_entropy(torch.randn(4, 5), torch.zeros(3, dtype=torch.long), tp_mesh=mesh)
    elif kind == "vocab":
        parallel_cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), vocab_size=12, tp_mesh=mesh)
    else:
        parallel_cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long))


def test_mismatched_label_shape_raises() -> None:
    with pytest.raises(AssertionError, match="disagree on the token dims"):
        run_distributed(bad_shapes_case, 2, "labels")


def test_local_logits_without_their_mesh_are_refused() -> None:
    with pytest.raises(AssertionError, match="local logits shards need tp_mesh="):
        run_distributed(bad_shapes_case, 2, "mesh")


def test_shard_width_not_matching_vocab_size_raises() -> None:
    with pytest.raises(AssertionError, match="does not match vocab_size 12 split over tp=2"):
        run_distributed(bad_shapes_case, 2, "vocab")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_token_cross_entropy_matches_f_cross_entropy_over_many_row_chunks(
    dtype: torch.dtype, label_smoothing: float
) -> None:
    """Whole-vocabulary logits large enough that the CPU references run in several row chunks (the last one short)."""
    torch.manual_seed(0)
    rows, vocab = 2 * 3000 + 7, 1001  # ~2 MiB of fp32 per chunk: 523 rows, 12 chunks
    logits = (torch.randn(2, rows // 2, vocab) * 4).to(dtype)
    labels = torch.randint(0, vocab, (2, rows // 2))
    labels[0, ::5] = -100
    labels[1, -1] = vocab - 1
    dense = logits.clone().requires_grad_()
    expected = F.cross_entropy(
        dense.float().flatten(0, 1), labels.flatten(), reduction="none", label_smoothing=label_smoothing
    ).view(labels.shape)
    grad_out = torch.rand(labels.shape)
    expected.backward(grad_out)
    ours = logits.clone().requires_grad_()
    loss = token_cross_entropy(ours, labels, label_smoothing=label_smoothing)
    loss.backward(grad_out)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(loss, expected.detach(), **tol)
    torch.testing.assert_close(ours.grad, dense.grad, **tol)
    assert ours.grad.dtype == dtype


@pytest.mark.parametrize("label", [-1, 10, -7])
def test_token_cross_entropy_refuses_a_label_outside_the_vocabulary(label: int) -> None:
    labels = torch.tensor([3, label, -100])
    with pytest.raises(RuntimeError, match=r"every label must be in \[0, 10\) or ignore_index=-100"):
        token_cross_entropy(torch.randn(3, 10), labels)


def out_of_vocabulary_label_case(label: int) -> None:
    mesh = setup_parallel(tp=2).tp_mesh
    labels = torch.tensor([1, label])
    parallel_cross_entropy(torch.randn(2, 5), labels, vocab_size=10, tp_mesh=mesh)  # no rank owns the label


def test_parallel_cross_entropy_refuses_a_label_outside_the_vocabulary_on_every_rank() -> None:
    with pytest.raises(AssertionError, match=r"(?s)rank 0.*every label must be in \[0, 10\).*rank 1.*every label"):
        run_distributed(out_of_vocabulary_label_case, 2, 10)


@pytest.mark.parametrize("smoothing", [-0.1, 1.5])
def test_label_smoothing_outside_0_1_is_refused(smoothing: float) -> None:
    with pytest.raises(ValueError, match=rf"label_smoothing must be in \[0, 1\], got {smoothing}"):
        token_cross_entropy(torch.randn(3, 10), torch.tensor([1, 2, 3]), label_smoothing=smoothing)
