"""The local half of vocab-parallel cross entropy, in one pass over a logits shard.

- ``meshpar::vocab_ce_stats(logits [N, V], labels [N], vocab_start) -> [N, 4]`` fp32: per row a pair ``(m, s)`` with
  ``m + log(s)`` the shard's log-partition (the kernel: the max and the online sum of ``exp(x - max)``; the CPU
  reference: ``(logsumexp, 1)``), the target logit when this shard owns the label (else 0) and the sum of logits.
- ``meshpar::vocab_ce_grad(logits, labels, log_z, scale, vocab_start, vocab_size, label_smoothing) -> dlogits``:
  ``(softmax - eps/V - (1-eps) * onehot) * scale`` written in the logits' dtype, chunk by chunk.

Neither materialises an fp32 copy of the logits. :func:`meshpar.parallel_cross_entropy` merges the statistics
across tp ranks and calls these.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from meshpar.ops._dispatch import block_size, run_triton
from meshpar.ops._triton import tl, triton

_MAX_BLOCK = 4096


@triton.jit
def _stats_kernel(X, LABELS, OUT, n_cols, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * n_cols
    running_max = float("-inf")
    running_sum = 0.0
    sum_x = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
        running_max = new_max
    local_label = tl.load(LABELS + row) - vocab_start
    owned = (local_label >= 0) & (local_label < n_cols)
    target = tl.load(base + tl.where(owned, local_label, 0)).to(tl.float32)
    target = tl.where(owned, target, 0.0)
    tl.store(OUT + row * 4 + 0, running_max)
    tl.store(OUT + row * 4 + 1, running_sum)
    tl.store(OUT + row * 4 + 2, target)
    tl.store(OUT + row * 4 + 3, sum_x)


@triton.jit
def _grad_kernel(
    X, LABELS, LOG_Z, SCALE, DX, n_cols, vocab_start, smooth_per_class, target_weight, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    log_z = tl.load(LOG_Z + row)
    scale = tl.load(SCALE + row)
    local_label = tl.load(LABELS + row) - vocab_start
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - log_z) - smooth_per_class - tl.where(cols == local_label, target_weight, 0.0)
        tl.store(DX + row * n_cols + cols, (grad * scale).to(DX.dtype.element_ty), mask=mask)


def vocab_ce_stats_reference(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """The CPU (and fallback) path: one temporary of the shard's size, exponentiated in place; ``logsumexp`` gives
    the log-partition in aten's vectorised kernel (reported as ``max = logZ, sum_exp = 1``, which merges across
    ranks exactly like a (max, sum) pair)."""
    x = logits if logits.dtype == torch.float32 else logits.float()
    log_z = torch.logsumexp(x, dim=-1)
    local_label = labels - vocab_start
    owned = (local_label >= 0) & (local_label < x.shape[-1])
    target = x.gather(-1, local_label.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target = torch.where(owned, target, torch.zeros_like(target))
    return torch.stack((log_z, torch.ones_like(log_z), target, x.sum(dim=-1)), dim=-1)


def vocab_ce_grad_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    log_z: torch.Tensor,
    scale: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float,
) -> torch.Tensor:
    """``(softmax - eps/V - (1-eps) onehot) * scale`` in one temporary, updated in place."""
    grad = torch.sub(logits.float(), log_z.unsqueeze(-1)).exp_()
    if label_smoothing:
        grad.sub_(label_smoothing / vocab_size)
    local_label = labels - vocab_start
    owned = (local_label >= 0) & (local_label < logits.shape[-1])
    index = local_label.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
    grad.scatter_add_(-1, index, (owned.to(grad.dtype) * -(1.0 - label_smoothing)).unsqueeze(-1))
    grad.mul_(scale.unsqueeze(-1))
    return grad if grad.dtype == logits.dtype else grad.to(logits.dtype)


@triton_op("meshpar::vocab_ce_stats", mutates_args=())
def vocab_ce_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int) -> torch.Tensor:
    if not run_triton(logits):
        return vocab_ce_stats_reference(logits, labels, vocab_start)
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], 4, dtype=torch.float32, device=logits.device)
    block = block_size(logits.shape[1], cap=_MAX_BLOCK)
    wrap_triton(_stats_kernel)[(logits.shape[0],)](
        logits, labels.contiguous(), out, logits.shape[1], vocab_start, BLOCK=block
    )
    return out


@triton_op("meshpar::vocab_ce_grad", mutates_args=())
def vocab_ce_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    log_z: torch.Tensor,
    scale: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float,
) -> torch.Tensor:
    if not run_triton(logits):
        return vocab_ce_grad_reference(logits, labels, log_z, scale, vocab_start, vocab_size, label_smoothing)
    logits = logits.contiguous()
    dx = torch.empty_like(logits)
    block = block_size(logits.shape[1], cap=_MAX_BLOCK)
    wrap_triton(_grad_kernel)[(logits.shape[0],)](
        logits, labels.contiguous(), log_z.contiguous(), scale.float().contiguous(), dx, logits.shape[1], vocab_start,
        label_smoothing / vocab_size, 1.0 - label_smoothing, BLOCK=block,
    )  # fmt: skip
    return dx


@vocab_ce_stats.register_fake
def _(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], 4, dtype=torch.float32)


@vocab_ce_grad.register_fake
def _(
    logits: torch.Tensor,
    labels: torch.Tensor,
    log_z: torch.Tensor,
    scale: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float,
) -> torch.Tensor:
    return torch.empty_like(logits)
