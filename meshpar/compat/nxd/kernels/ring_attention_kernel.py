"""``neuronx_distributed.kernels.ring_attention_kernel``: NxD's ring-attention entry point with its signature.

NxD calls it with this rank's id and its context-parallel ring (``parallel_state.
get_context_model_parallel_src_tgt_pairs()``) when its Llama example runs with ``context_parallel_size > 1``. The
NxD view runs context-parallel size 1 only (``initialize_model_parallel`` refuses more; meshpar's own context
parallelism runs HF models: ``parallelize(model, {"context_parallel_size": ...})``), where the ring is this rank
alone and the attention is the local sequence's own: computed as :func:`..flash_attn.nki_flash_attn_func` computes it.
The rank and ring given are checked against this rank's, so a call made for another layout is refused, not guessed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshpar.compat.nxd.kernels.flash_attn import attention
from meshpar.compat.nxd.parallel_layers import parallel_state


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
    """NxD's ring attention over the context-parallel group: q, k, v ``[batch, heads, seq, head_dim]`` (fewer
    key/value heads allowed), the output in the same layout."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    ring = parallel_state.get_context_model_parallel_src_tgt_pairs()
    if rank_id != rank or [list(pair) for pair in src_tgt_pairs] != ring:
        raise ValueError(
            f"nki_ring_attn_func(rank_id={rank_id}, src_tgt_pairs={src_tgt_pairs}) on rank {rank}, whose "
            f"context-parallel ring is {ring}: pass torch.distributed.get_rank() and "
            "parallel_state.get_context_model_parallel_src_tgt_pairs()"
        )
    return attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, seed=seed)


__all__ = ["nki_ring_attn_func"]
