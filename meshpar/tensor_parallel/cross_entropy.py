"""Cross entropy over vocab-sharded logits, without gathering them.

Each tp rank holds logits ``[..., V/tp]`` for its vocabulary slice. Instead of Megatron's three all-reduces
(max, target logit, sum of exps), every rank reduces its slice to a few per-token statistics (local max, sum of
``exp(x - local max)``, target logit if owned, sum of logits for label smoothing) and one all-gather of those
``[tokens, 4]`` statistics gives every rank the exact global log-partition function (the online-softmax merge).
The backward needs no communication: the gradient of each rank's slice is local, and stays sharded.

Per-token loss, as ``F.cross_entropy(..., reduction="none")``:
``loss = (1 - eps) * (logZ - x_target) + eps * (logZ - mean_j x_j)``, 0 where ``label == ignore_index``.
"""

from __future__ import annotations

from typing import Any

import torch

import meshpar.ops.cross_entropy  # noqa: F401 - registers torch.ops.meshpar.vocab_ce_*
from meshpar._compat import DeviceMesh, DTensor, Shard, all_gather_single, assert_async, funcol
from meshpar.tensor_parallel._init import shard_range

# the label that scores nothing (torch's and HF's convention): padding, the token after the last, masked positions
IGNORE_INDEX = -100


def _merge_stats(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge ``[tp, N, 4]`` per-rank statistics into (logZ, target logit, sum of logits), each ``[N]``."""
    row_max, sum_exp, target, sum_logits = stats.unbind(-1)
    global_max = row_max.amax(dim=0)
    total = (sum_exp * torch.exp(row_max - global_max)).sum(dim=0)
    return global_max + torch.log(total), target.sum(dim=0), sum_logits.sum(dim=0)


def token_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mesh: DeviceMesh | None,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and log-partition of a local logits shard ``[N, V_local]``: local statistics, one all-gather
    of them over tp, the merge. Shared by the unfused and the fused (chunked) cross entropy."""
    stats = torch.ops.meshpar.vocab_ce_stats(logits, labels, vocab_start)
    if mesh is not None and mesh.size() > 1:
        stats = funcol.wait_tensor(all_gather_single(stats.contiguous(), 0, mesh)).view(mesh.size(), *stats.shape)
    else:
        stats = stats.unsqueeze(0)
    log_z, target, sum_logits = _merge_stats(stats)
    loss = (1.0 - label_smoothing) * (log_z - target)
    if label_smoothing > 0:
        loss = loss + label_smoothing * (log_z - sum_logits / vocab_size)
    return loss, log_z


def check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Refuse a label outside ``[0, vocab_size)`` that is not ``ignore_index``, as ``F.cross_entropy`` does: no rank
    owns it, so its loss would silently be the log-partition alone. Every tp rank holds the same labels, so every rank
    raises; on accelerators the check is asynchronous (no host sync)."""
    valid = ((labels >= 0) & (labels < vocab_size)) | (labels == ignore_index)
    assert_async(valid.all(), f"cross entropy: every label must be in [0, {vocab_size}) or ignore_index={ignore_index}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        mesh: DeviceMesh | None,
        vocab_start: int,
        vocab_size: int,
        label_smoothing: float,
        ignore_index: int,
    ) -> torch.Tensor:
        loss, log_z = token_losses(logits, labels, mesh, vocab_start, vocab_size, label_smoothing)
        ignored = labels == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, labels, log_z, ignored)
        ctx.vocab_start, ctx.vocab_size = vocab_start, vocab_size
        ctx.label_smoothing = label_smoothing
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, labels, log_z, ignored = ctx.saved_tensors
        scale = grad_loss.float().masked_fill(ignored, 0.0)
        grad = torch.ops.meshpar.vocab_ce_grad(
            logits, labels, log_z, scale, ctx.vocab_start, ctx.vocab_size, ctx.label_smoothing
        )
        return grad, None, None, None, None, None, None


def parallel_cross_entropy(
    parallel_logits: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    *,
    tp_mesh: DeviceMesh | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token loss from vocab-sharded logits ``[..., V/tp]`` (a local shard or a ``Shard(-1)`` DTensor).

    A vocabulary tp does not divide is split like ``torch.chunk`` (ranks hold ``ceil(V / tp)`` columns, the last
    fewer): DTensor logits know ``V`` and their mesh; for local shards pass ``vocab_size`` and ``tp_mesh``. No padded
    columns ever exist, so losses
    are exactly those of the unsharded vocabulary. Returns a replicated ``[...]`` tensor; the gradient w.r.t. the
    logits stays sharded.
    """
    if isinstance(parallel_logits, DTensor):
        mesh = parallel_logits.device_mesh
        if len(parallel_logits.placements) != 1 or parallel_logits.placements[0] not in (
            Shard(-1),
            Shard(parallel_logits.ndim - 1),
        ):
            raise ValueError(
                f"parallel_cross_entropy expects logits sharded on the last dim, got {parallel_logits.placements}"
            )
        local = parallel_logits.to_local()
        vocab_size = parallel_logits.shape[-1]
    elif tp_mesh is None:
        raise TypeError(
            "parallel_cross_entropy: local logits shards need tp_mesh= (dims.tp_mesh); a Shard(-1) DTensor carries it"
        )
    else:
        mesh, local = tp_mesh, parallel_logits
    if local.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(local.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    vocab_local = local.shape[-1]
    if vocab_size is None:
        vocab_size = vocab_local * mesh.size()
    vocab_start, expected_local = shard_range(vocab_size, mesh)
    if expected_local != vocab_local:
        raise ValueError(
            f"logits shard of width {vocab_local} on tp rank {mesh.get_local_rank()} does not match vocab_size "
            f"{vocab_size} split over tp={mesh.size()} (expected {expected_local})"
        )
    return _checked_per_token_loss(local, labels, mesh, vocab_start, vocab_size, label_smoothing, ignore_index)


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token loss of whole-vocabulary logits ``[..., V]``, as ``F.cross_entropy(logits.float(), labels,
    reduction="none")`` computes it, with meshpar's kernels: nothing of the logits' size is saved or allocated in
    forward (aten saves a log-softmax) and one pass writes the grad in backward (aten zero-fills, scatters, then
    reads both). The loss of models whose head is not vocab-sharded (tp=1, a head kept whole)."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    return _checked_per_token_loss(logits, labels, None, 0, logits.shape[-1], label_smoothing, ignore_index)


def _checked_per_token_loss(
    local: torch.Tensor,
    labels: torch.Tensor,
    mesh: DeviceMesh | None,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float,
    ignore_index: int,
) -> torch.Tensor:
    """Both entry points' shared tail: the label smoothing and labels checked, the autograd function applied to the
    flattened tokens, the loss back in the labels' shape."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    check_labels(labels, vocab_size, ignore_index)
    loss = _VocabParallelCrossEntropy.apply(
        local.reshape(-1, local.shape[-1]),
        labels.reshape(-1),
        mesh,
        vocab_start,
        vocab_size,
        float(label_smoothing),
        ignore_index,
    )
    return loss.view(labels.shape)
