"""LM head matmul + vocab-parallel cross entropy, chunk by chunk, never materialising the ``[tokens, V/tp]`` logits.

For each chunk of ``chunk_size`` tokens: logits of the chunk (this rank's vocab shard), their statistics merged over
tp with one small all-gather (as :func:`meshpar.parallel_cross_entropy`), the loss, and at once the gradient of the
chunk's logits, which is folded into ``d hidden`` and ``d weight`` and freed (Liger-Kernel's approach, vocab-parallel).
``d hidden`` is summed over tp once at the end. The loss is reduced (mean over non-ignored tokens, or sum), so the
precomputed grads only need scaling by the incoming scalar gradient in backward.
"""

from __future__ import annotations

from typing import Any

import torch

import meshpar.ops.cross_entropy  # noqa: F401 - registers torch.ops.meshpar.vocab_ce_*
from meshpar._compat import DeviceMesh, DTensor
from meshpar.tensor_parallel._collectives import all_reduce_sum
from meshpar.tensor_parallel._init import shard_range
from meshpar.tensor_parallel.cross_entropy import IGNORE_INDEX, check_labels, token_losses


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        mesh: DeviceMesh,
        vocab_size: int,
        chunk_size: int,
        ignore_index: int,
        label_smoothing: float,
        reduction: str,
    ) -> torch.Tensor:
        vocab_start, _ = shard_range(vocab_size, mesh)
        ignored = labels == ignore_index
        count = (~ignored).sum().clamp(min=1) if reduction == "mean" else torch.ones((), device=hidden.device)
        token_scale = (~ignored).float() / count
        # grads in the parameters' dtype: each chunk's matmul accumulates in fp32 internally, and no fp32 copy of
        # the (large) LM-head weight is ever allocated
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h, y = hidden[rows], labels[rows]
            logits = h @ weight.t()
            loss, log_z = token_losses(logits, y, mesh, vocab_start, vocab_size, label_smoothing)
            total += (loss * token_scale[rows]).sum()
            grad_logits = torch.ops.meshpar.vocab_ce_grad(
                logits, y, log_z, token_scale[rows], vocab_start, vocab_size, label_smoothing
            )
            torch.matmul(grad_logits, weight, out=grad_hidden[rows])
            grad_weight.addmm_(grad_logits.t(), h)
            del logits, grad_logits
        grad_hidden = all_reduce_sum(grad_hidden, mesh)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    tp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Cross entropy of ``hidden [..., H] @ weight.T`` where ``weight`` is this rank's vocab shard ``[V/tp, H]``
    (a local tensor or the ``Shard(0)`` DTensor of a column-parallel LM head); ``hidden`` is replicated over tp.

    Returns the mean (over non-ignored tokens) or sum of the per-token losses. Peak extra memory is two
    ``[chunk_size, V/tp]`` blocks instead of the ``[tokens, V/tp]`` logits and their gradient; by default
    ``chunk_size`` keeps each block near 2**25 elements (64 MiB in bf16).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        vocab_size = weight.shape[0]
        weight = weight.to_local()
    elif tp_mesh is None:
        raise TypeError(
            "fused_linear_cross_entropy: a local weight shard needs tp_mesh= (dims.tp_mesh); a Shard(0) DTensor "
            "carries it"
        )
    else:
        mesh = tp_mesh
        vocab_size = vocab_size if vocab_size is not None else weight.shape[0] * mesh.size()
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    _, local = shard_range(vocab_size, mesh)
    if weight.shape[0] != local:
        raise ValueError(f"weight shard has {weight.shape[0]} rows, expected {local} for vocab_size {vocab_size}")
    if chunk_size is None:
        chunk_size = max(1, (1 << 25) // max(local, 1))
    check_labels(labels, vocab_size, ignore_index)
    return _FusedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        mesh,
        vocab_size,
        chunk_size,
        ignore_index,
        float(label_smoothing),
        reduction,
    )
