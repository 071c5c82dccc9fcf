"""``neuronx_distributed.kernels.ring_attention_kernel``: NxD's ring-attention entry point with its signature.

NxD's Llama example calls it with this rank's id and its context-parallel ring (``parallel_state.
get_context_model_parallel_src_tgt_pairs()``) when it runs with ``context_parallel_size > 1``: q, k and v hold this
rank's contiguous piece of the sequence (NxD's layout, ``utils.batch_utils.get_batch_on_this_context_parallel_rank``),
``[batch, heads, seq / cp, head_dim]``. The attention is meshpar's ring (:func:`meshpar.context_parallel.
context_parallel_attention` with ``layout="contiguous"``): K/V blocks travel around the cp group, each step computes
only the (query, key) pairs the causal mask permits, exact in forward and backward. At context-parallel size 1 it is
the local sequence's own attention, computed as :func:`..flash_attn.nki_flash_attn_func` computes it. The rank and
ring given are checked against this rank's, so a call made for another layout is refused, not guessed.

Differences (Neuron details or deliberate): the local sequence must split into two equal halves (an even
``seq / cp``; NxD's kernel takes multiples of its tile), dropout inside ring attention is refused at cp > 1, and
``mixed_precision`` changes nothing (each step keeps the softmax in fp32).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshpar.compat.nxd.kernels.flash_attn import attention
from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.compat.nxd.parallel_layers.mappings import traced_as_call
from meshpar.context_parallel import AttentionMask, context_parallel_attention
from meshpar.parallel_dims import get_parallel


@traced_as_call  # one call in a pipeline's fx trace, however the model imports it
def nki_ring_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rank_id: int,
    src_tgt_pairs: list[list[int]],
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = True,
    mixed_precision: bool = True,
    seed: Any = None,
) -> torch.Tensor:
    """NxD's ring attention over the context-parallel group: q, k, v ``[batch, heads, seq / cp, head_dim]`` (this
    rank's contiguous piece; fewer key/value heads allowed), the output in the same layout."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    ring = parallel_state.get_context_model_parallel_src_tgt_pairs()
    if rank_id != rank or [list(pair) for pair in src_tgt_pairs] != ring:
        raise ValueError(
            f"nki_ring_attn_func(rank_id={rank_id}, src_tgt_pairs={src_tgt_pairs}) on rank {rank}, whose "
            f"context-parallel ring is {ring}: pass torch.distributed.get_rank() and "
            "parallel_state.get_context_model_parallel_src_tgt_pairs()"
        )
    dims = get_parallel()
    if dims.cp == 1:
        return attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, seed=seed)
    if dropout_p > 0:
        raise NotImplementedError(
            f"nki_ring_attn_func(dropout_p={dropout_p}) at context-parallel size {dims.cp}: attention dropout is not "
            "provided inside ring attention; use dropout_p=0"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads evenly")
    if q.shape[2] % 2:
        raise ValueError(
            f"nki_ring_attn_func: this rank's {q.shape[2]} tokens do not split into two equal halves (the ring's "
            f"steps work on half pieces); make the sequence length a multiple of 2 x cp = {2 * dims.cp}"
        )
    return context_parallel_attention(
        q, k, v, dims.cp_mesh, AttentionMask(causal=causal), scale=softmax_scale, implementation="ring",
        layout="contiguous",
    )  # fmt: skip


__all__ = ["nki_ring_attn_func"]
