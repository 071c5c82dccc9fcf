"""The token loss of HF models under meshpar (language models and token classifiers): vocab-parallel where the LM
head is vocab-sharded, and normalised by the scored tokens of the whole global batch.

A step's loss is the sum of its token losses over the count of scored tokens in the global batch (every
microbatch, every dp replica), so loss and grads equal the single-process mean however padding falls: a mean of
per-microbatch (or per-replica) means would weigh the tokens of a padded microbatch more (the gradient-accumulation
loss bug). :meth:`TokenLoss.global_normalizer` computes that count once per step; the step hands it to every call
of the loss (an argument, no state in the loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshpar._compat import DeviceMesh
from meshpar.parallel_dims import ParallelDims
from meshpar.tensor_parallel import parallel_cross_entropy
from meshpar.tensor_parallel.cross_entropy import IGNORE_INDEX, token_cross_entropy

TASKS = ("causal_lm", "masked_lm", "token_classification")


class TokenLoss:
    """``loss(logits, labels, normalizer)``: summed token losses over ``normalizer`` (the global batch's scored tokens,
    :meth:`global_normalizer`), or their mean over this batch without one."""

    def __init__(self, task: str, vocab_sharded: int, tp_mesh: DeviceMesh | None = None) -> None:
        """``vocab_sharded`` is the vocabulary size when the logits are vocab-sharded over ``tp_mesh``, else 0."""
        if vocab_sharded and tp_mesh is None:
            raise ValueError("vocab-sharded logits need the tp mesh they are sharded over")
        if task not in TASKS:
            raise ValueError(f"no token loss for task {task!r}; one of {TASKS}")
        self.causal = task == "causal_lm"
        self.vocab_sharded = vocab_sharded
        self.tp_mesh = tp_mesh

    def scored(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels a token loss is computed for, at the logits' positions: causal LMs predict token t+1 at
        position t, so the labels shift left and the last position scores nothing (as HF does; slicing the logits
        instead would copy them forward and zero-fill plus copy a full-size grad in backward)."""
        return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) if self.causal else labels

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, normalizer: torch.Tensor | None = None
    ) -> torch.Tensor:
        scored = self.scored(labels)
        if self.vocab_sharded:
            losses = parallel_cross_entropy(logits, scored, vocab_size=self.vocab_sharded, tp_mesh=self.tp_mesh)
        else:
            losses = token_cross_entropy(logits, scored)
        return losses.sum() / (normalizer if normalizer is not None else (scored != IGNORE_INDEX).sum().clamp(min=1))

    def pipeline_loss(  # noqa: ANN201
        self,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_normalizer: torch.Tensor | None = None,
        **_: object,
    ):
        """The last pipeline stage's ``loss_fn``: it receives the microbatch's inputs, the step's normaliser among
        them (a 0-d tensor every microbatch gets whole)."""
        return self(logits, labels, loss_normalizer)

    def global_normalizer(self, labels: torch.Tensor, dims: ParallelDims, microbatches: int) -> torch.Tensor:
        """The scored tokens of every dp replica's ``labels`` (one scalar all-reduce over dp), scaled so that the
        grads come out right: each replica's grads are later averaged over dp and each microbatch's loss scaled by
        1/``microbatches``; the normaliser undoes both."""
        count = (self.scored(labels) != IGNORE_INDEX).sum()
        if dims.dp > 1:
            count = count.clone()
            dist.all_reduce(count, group=dims.dp_mesh.get_group())
        return count.clamp(min=1) / (dims.dp * microbatches)
