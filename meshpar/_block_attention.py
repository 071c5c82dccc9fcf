"""One block of attention with its log-sum-exp, forward and backward, on torch's fused kernels: the step of ring
attention (:mod:`meshpar.context_parallel`).

A ring step attends this rank's queries to one rank's keys and returns the output and each query's log-sum-exp, which
the ring merges; its backward is given the *merged* output and log-sum-exp, so each step's probabilities come out
normalised by the whole sequence (flash attention's backward, run once per block). torch's fused attention kernels
take exactly these: on CPU ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward), on CUDA the
memory-efficient kernel ``_scaled_dot_product_efficient_attention`` (and its backward), both with an additive mask
and an explicit log-sum-exp. Neither keeps the step's scores or probabilities; the one ``queries x keys`` tensor a
step may hold is its additive mask (in the inputs' dtype, freed when the step ends; nothing of that size is saved),
and blocks every key of which a query may see, or that are causal on their diagonal, are run with none.

What the kernels do not do is handled around them: keys and values of different widths (latent attention) are
zero-padded to one width (zero features add nothing to a score, and the padded output columns are cut off); a query
with no permitted key in the block gets output 0 and log-sum-exp -inf (the kernels leave some finite value there,
which would distort the merge); Gemma-2's soft-capping has no fused kernel and stays on the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshpar._compat import (
    efficient_attention,
    efficient_attention_backward,
    flash_attention_cpu,
    flash_attention_cpu_backward,
)

_LSE_ALIGN = 32  # the memory-efficient kernel pads its log-sum-exp to a multiple of this many queries
_BIAS_ALIGN = 16  # and needs the additive mask's rows to start on this many elements


def fused_supported(q: torch.Tensor, softcap: float | None) -> bool:
    """Whether a fused kernel computes this block: no soft-capping, a CPU tensor, or a CUDA tensor in a dtype the
    memory-efficient kernel takes."""
    if softcap is not None:
        return False
    if q.device.type == "cpu":
        return q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    return q.device.type == "cuda" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _widen(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def _bias(allow: torch.Tensor, q: torch.Tensor, keys: int) -> torch.Tensor:
    """The additive mask ``[batch, heads, queries, keys]`` (0 allowed, -inf not) in ``q``'s dtype; on CUDA a view of
    rows padded to the kernel's alignment."""
    batch, heads, queries = q.shape[0], q.shape[1], q.shape[2]
    padded = keys if q.device.type == "cpu" else -(-keys // _BIAS_ALIGN) * _BIAS_ALIGN
    bias = torch.zeros(allow.shape[0], allow.shape[1], queries, padded, dtype=q.dtype, device=q.device)
    bias[..., :keys].masked_fill_(~allow.expand(allow.shape[0], allow.shape[1], queries, keys), float("-inf"))
    return bias[..., :keys].expand(batch, heads, queries, keys)


def _no_key(allow: torch.Tensor, queries: int) -> torch.Tensor:
    """``[batch or 1, 1, queries, 1]``: True where a query may attend to no key of the block."""
    return ~allow.expand(allow.shape[0], allow.shape[1], queries, allow.shape[-1]).any(-1, keepdim=True)


def _as_kernel_output(out: torch.Tensor) -> torch.Tensor:
    """``out`` ``[batch, heads, queries, width]`` laid out in memory as the memory-efficient kernel's forward returns
    its output, ``[batch, queries, heads, width]``. Its half-precision backward reads a given output in that layout
    whatever the strides say: handed a contiguous ``[batch, heads, ...]`` output it returned q and k grads that were
    wrong or NaN (v's were right) on an H200 with torch 2.11, where the same call with the output in the forward's
    layout matched torch's own autograd through the kernel. Its fp32 backward reads either."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allow: torch.Tensor | None,
    scale: float,
    *,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[batch, heads, queries, dk]``, ``k`` / ``v`` ``[batch, heads, keys, dk / dv]`` (heads already repeated
    for grouped queries), ``allow`` bool broadcastable to ``[batch, heads, queries, keys]``: (output ``[..., dv]`` in
    fp32, log-sum-exp ``[..., 1]`` in fp32, -inf and output 0 for a query with no permitted key). ``allow=None``: every
    key permitted, or with ``causal`` key ``j`` permitted to query ``i`` where ``j <= i`` (a square block whose keys
    are its queries' own positions); no mask is built for either, and the kernels skip the causal block's upper half."""
    width, dv, queries = max(q.shape[-1], v.shape[-1]), v.shape[-1], q.shape[2]
    q, k, v = _widen(q, width), _widen(k, width), _widen(v, width)
    bias = None if allow is None else _bias(allow, q, k.shape[2])
    if q.device.type == "cpu":
        out, lse = flash_attention_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    else:
        out, lse = efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)[:2]
        lse = lse[..., :queries]
    out, lse = out[..., :dv].float(), lse.float().unsqueeze(-1)
    if allow is None:  # every query has a key (its own, when causal)
        return out, lse
    none = _no_key(allow, queries)
    return out.masked_fill(none, 0.0), lse.masked_fill(none, float("-inf"))


def block_backward(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    allow: torch.Tensor | None,
    scale: float,
    *,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grads of one block's ``q``, ``k``, ``v`` (shapes, ``allow`` and ``causal`` as :func:`block_forward`'s)
    given the grad of the merged output ``d_out``, the merged output ``out`` and the merged log-sum-exp ``lse``
    ``[..., 1]`` (finite: 0 for a query with no key anywhere, whose output is 0). In fp32."""
    dk_width, dv, queries = q.shape[-1], v.shape[-1], q.shape[2]
    width, dtype = max(dk_width, dv), q.dtype
    q, k, v = _widen(q, width), _widen(k, width), _widen(v, width)
    d_out, out = _widen(d_out.to(dtype), width).contiguous(), _widen(out.to(dtype), width)
    lse = lse.squeeze(-1).float().contiguous()
    bias = None if allow is None else _bias(allow, q, k.shape[2])
    if q.device.type == "cpu":
        out = out.contiguous()
        dq, dk, dv_ = flash_attention_cpu_backward(d_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    else:
        lse = F.pad(lse, (0, -(-queries // _LSE_ALIGN) * _LSE_ALIGN - queries)).contiguous()
        out = _as_kernel_output(out)
        unused = torch.empty((), dtype=torch.int64)  # the dropout seed and offset: no dropout here
        needs = [True, True, True, False]  # no grad of the mask
        dq, dk, dv_ = efficient_attention_backward(
            d_out, q, k, v, bias, out, lse, unused, unused, 0.0, needs, causal, scale=scale
        )[:3]
    return dq[..., :dk_width].float(), dk[..., :dk_width].float(), dv_[..., :dv].float()
