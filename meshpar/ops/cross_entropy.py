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


# rows per step of the CPU references: ~2 MiB of fp32 temporaries, so they stay in cache and in malloc's heap (a
# full-size temporary is mmapped and page-faulted afresh on every call: on a 2-core machine, at [2048, 8192], the
# unchunked pair took 1.4x the time of the chunked one, and aten's log_softmax + nll 1.6x)
_REFERENCE_CHUNK_BYTES = 1 << 21


def _row_chunks(rows: int, cols: int) -> list[slice]:
    """Row slices of the CPU references: one slice when compiling (Inductor fuses the whole-tensor form; a loop would
    unroll into the graph), else ~``_REFERENCE_CHUNK_BYTES`` of fp32 per slice."""
    if torch.compiler.is_compiling():
        return [slice(0, rows)]
    step = max(1, _REFERENCE_CHUNK_BYTES // (4 * max(cols, 1)))
    return [slice(start, start + step) for start in range(0, rows, step)]


def _label_index(labels: torch.Tensor, vocab_start: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether this shard owns each row's label ``[N]``, its clamped local column ``[N, 1]``)."""
    local_label = labels - vocab_start
    owned = (local_label >= 0) & (local_label < cols)
    return owned, local_label.clamp(0, cols - 1).unsqueeze(-1)


def vocab_ce_stats_reference(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """The CPU (and fallback) path, row chunk by row chunk: ``logsumexp`` gives the log-partition in aten's
    vectorised kernel (reported as ``max = logZ, sum_exp = 1``, which merges across ranks exactly like a (max, sum)
    pair)."""
    rows, cols = logits.shape
    out = torch.empty(rows, 4, dtype=torch.float32, device=logits.device)
    for part in _row_chunks(rows, cols):
        x = logits[part].float()
        out[part, 0] = torch.logsumexp(x, dim=-1)
        out[part, 3] = x.sum(dim=-1)
    out[:, 1] = 1.0
    owned, index = _label_index(labels, vocab_start, cols)
    out[:, 2] = logits.gather(-1, index).squeeze(-1).float().masked_fill(~owned, 0.0)
    return out


def vocab_ce_grad_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    log_z: torch.Tensor,
    scale: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float,
) -> torch.Tensor:
    """``(softmax - eps/V - (1-eps) onehot) * scale``, row chunk by row chunk into the output (fp32 logits) or one
    chunk-sized fp32 temporary (other dtypes)."""
    rows, cols = logits.shape
    grad = torch.empty_like(logits)
    owned, index = _label_index(labels, vocab_start, cols)
    scale = scale.float()
    hit = (owned.float() * -(1.0 - label_smoothing) * scale).unsqueeze(-1)
    for part in _row_chunks(rows, cols):
        out = grad[part] if grad.dtype == torch.float32 else torch.empty_like(grad[part], dtype=torch.float32)
        torch.sub(logits[part].float(), log_z[part].unsqueeze(-1), out=out).exp_()
        if label_smoothing:
            out.sub_(label_smoothing / vocab_size)
        out.mul_(scale[part].unsqueeze(-1)).scatter_add_(-1, index[part], hit[part])
        if out.dtype != grad.dtype:
            grad[part] = out
    return grad


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
