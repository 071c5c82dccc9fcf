"""``neuronx_distributed.parallel_layers.loss_functions``: the per-token cross entropy and log-probabilities of
vocab-sharded logits (``[..., V/tp]``, this rank's plain shard or a DTensor) over the parallel state's tp group, on
meshpar's :func:`meshpar.parallel_cross_entropy`."""

from __future__ import annotations

import torch

from meshpar.compat.nxd.parallel_layers.mappings import traced_as_call
from meshpar.parallel_dims import get_parallel
from meshpar.tensor_parallel import parallel_cross_entropy as _native_parallel_cross_entropy


@traced_as_call
def parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0, **kwargs: object
) -> torch.Tensor:
    """NxD's per-token cross entropy (not reduced), differentiable w.r.t. the sharded logits."""
    kwargs.setdefault("tp_mesh", get_parallel().tp_mesh)
    return _native_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing, **kwargs)


class DistributedLogprob:
    """NxD's log-probability of each target under vocab-sharded logits: minus the per-token cross entropy (the
    same numerically stable log-sum-exp over tp). ``inference`` is NxD's switch to skip saving for backward;
    here the result is differentiable either way."""

    @staticmethod
    def apply(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, inference: bool = True) -> torch.Tensor:
        return -parallel_cross_entropy(vocab_parallel_logits, target)


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, inference: bool = True
) -> torch.Tensor:
    """``[B, S-1]`` log-probabilities of the next token: ``target`` is the unshifted ids (shifted here)."""
    shifted = target.roll(shifts=-1, dims=-1)
    return DistributedLogprob.apply(vocab_parallel_logits, shifted, inference)[:, :-1].contiguous()


__all__ = ["DistributedLogprob", "from_parallel_logits_to_logprobs", "parallel_cross_entropy"]
