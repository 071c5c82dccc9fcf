"""meshpar.hf.loss.TokenLoss: HF's causal / masked LM losses, the global-batch normaliser, bad labels refused."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import meshpar
from meshpar.hf.loss import TokenLoss
from meshpar.parallel_dims import ParallelDims
from meshpar.testing import run_distributed, setup_parallel
from tests.hf._configs import batch, build

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
    """With the step's global normaliser each microbatch's loss is normalised by the whole batch's scored tokens: the
    mean of the microbatch losses (what a pipeline's 1/m scaling makes) is the global token mean, however padding
    falls."""
    logits, labels = _batch()
    loss = TokenLoss("causal_lm", 0)
    want = loss(logits, labels)
    dims = ParallelDims(dp=1, pp=1, tp=1, world_size=1)
    normalizer = loss.global_normalizer(labels, {}, dims, microbatches=3)
    parts = [loss(lg, lb, normalizer) for lg, lb in zip(logits.split(1), labels.split(1), strict=True)]
    torch.testing.assert_close(torch.stack(parts).mean(), want)
    naive = torch.stack([loss(lg, lb) for lg, lb in zip(logits.split(1), labels.split(1), strict=True)]).mean()
    assert not torch.allclose(naive, want), "the padded microbatch would be over-weighted by a mean of means"


def test_unknown_task_is_refused() -> None:
    with pytest.raises(ValueError, match="no token loss"):
        TokenLoss("sequence_classification", 0)


def out_of_vocabulary_label_case(pp: int) -> None:
    setup_parallel(tp=2 // pp, pp=pp)
    config = {"tensor_parallel_size": 2 // pp, "pipeline_parallel_size": pp, "num_microbatches": 2}
    model = meshpar.parallelize(build("qwen3", layers=2), config)
    data = batch("qwen3")
    data["labels"][0, 3] = 64  # the vocabulary is 64: a token id no rank's shard holds
    model.train_step(**data)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_label_outside_the_vocabulary_stops_train_step_on_every_rank(pp: int) -> None:
    """tp=2: both ranks refuse it; pp=2: the last stage refuses it and the first stops with its reason."""
    with pytest.raises(AssertionError) as error:
        run_distributed(out_of_vocabulary_label_case, 2, pp)
    message = str(error.value)
    reason = r"every label must be in \[0, 64\) or ignore_index=-100"
    assert re.search(rf"(?s)rank 0:.*{reason}.*rank 1:.*{reason}", message), message
