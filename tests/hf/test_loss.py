"""meshpar.hf.loss.TokenLoss on one process: HF's causal / masked LM losses, and the global-batch normaliser."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshpar.hf.loss import TokenLoss
from meshpar.parallel_dims import ParallelDims

VOCAB = 11


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = torch.randn(3, 6, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (3, 6))
    labels[1, 2:] = -100  # padding
    return logits, labels


def test_causal_lm_loss_is_hf_shifted_mean() -> None:
    logits, labels = _batch()
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    loss = TokenLoss("causal_lm", 0)
    torch.testing.assert_close(loss(logits, labels), want)
    torch.testing.assert_close(loss.pipeline_loss(logits, input_ids=labels, labels=labels), want)


def test_masked_lm_loss_is_unshifted_mean() -> None:
    logits, labels = _batch()
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(TokenLoss("masked_lm", 0)(logits, labels), want)


def test_microbatch_losses_sum_to_the_global_mean() -> None:
    """Inside over_global_batch each microbatch's loss is normalised by the whole batch's scored tokens: the mean of
    the microbatch losses (what a pipeline's 1/m scaling makes) is the global token mean, however padding falls."""
    logits, labels = _batch()
    loss = TokenLoss("causal_lm", 0)
    want = loss(logits, labels)
    dims = ParallelDims(dp=1, pp=1, tp=1, world_size=1)
    with loss.over_global_batch(labels, dims, microbatches=3):
        parts = [loss(lg, lb) for lg, lb in zip(logits.split(1), labels.split(1), strict=True)]
    torch.testing.assert_close(torch.stack(parts).mean(), want)
    naive = torch.stack([loss(lg, lb) for lg, lb in zip(logits.split(1), labels.split(1), strict=True)]).mean()
    assert not torch.allclose(naive, want), "the padded microbatch would be over-weighted by a mean of means"


def test_unknown_task_is_refused() -> None:
    with pytest.raises(ValueError, match="no token loss"):
        TokenLoss("sequence_classification", 0)
