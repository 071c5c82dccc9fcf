"""Pipeline stage forwards for HuggingFace families (GPT-2, Llama causal LMs; BERT masked LM).

HF models' own ``forward`` cannot run with pieces missing, so each family gets a stage forward that runs whatever the
stage owns: embeddings (first stage), its decoder blocks, final norm and LM head (last stage). Every stage receives
the microbatch's ``attention_mask`` (``[batch, seq]``, 1 = attend) and builds the same 4-D mask as the HF model
(``transformers.masking_utils``): causal and padding for GPT-2 and Llama, padding for BERT. Without a mask,
attention is causal (BERT: full) through SDPA.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn


def _positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def _full_sequence(self: nn.Module, x: torch.Tensor, first_stage: bool) -> int:
    """A later stage receives sequence shards under sequence parallelism."""
    return x.shape[1] if first_stage else x.shape[1] * getattr(self, "meshpar_sequence_shards", 1)


def _attention_mask(
    config: object, hidden: torch.Tensor, seq: int, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor | None:
    """The 4-D mask the HF model itself would build from a ``[batch, seq]`` padding mask (``None`` without one)."""
    if mask is None:
        return None
    try:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
    except ImportError as error:  # pragma: no cover - older transformers
        raise RuntimeError("an attention_mask under pipeline parallelism needs transformers>=4.53") from error
    like = hidden.new_empty((hidden.shape[0], seq, 1))  # the shape, dtype and device the mask builders read
    if causal:
        return create_causal_mask(
            config=config, inputs_embeds=like, attention_mask=mask, past_key_values=None, position_ids=None
        )
    return create_bidirectional_mask(config=config, inputs_embeds=like, attention_mask=mask)


def gpt2_stage_forward(self: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    body = self.transformer
    first = body.wte is not None
    seq = _full_sequence(self, x, first)
    if first:
        x = body.drop(body.wte(x) + body.wpe(_positions(x)))
    mask = _attention_mask(body.config, x, seq, attention_mask, causal=True)
    for block in body.h:
        x = block(x, attention_mask=mask)
    if body.ln_f is not None:
        x = self.lm_head(body.ln_f(x))
    return x


def llama_stage_forward(self: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    body = self.model
    first = body.embed_tokens is not None
    seq = _full_sequence(self, x, first)
    if first:
        x = body.embed_tokens(x)
    positions = torch.arange(seq, device=x.device).unsqueeze(0)
    position_embeddings = body.rotary_emb(x, positions)
    mask = _attention_mask(body.config, x, seq, attention_mask, causal=True)
    for layer in body.layers:
        x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=position_embeddings)
    if body.norm is not None:
        x = self.lm_head(body.norm(x))
    return x


def bert_stage_forward(self: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """BERT for masked LM: bidirectional attention, padding masked where ``attention_mask`` is 0."""
    body = self.bert
    first = body.embeddings is not None
    seq = _full_sequence(self, x, first)
    if first:
        x = body.embeddings(input_ids=x)
    mask = _attention_mask(body.config, x, seq, attention_mask, causal=False)
    for layer in body.encoder.layer:
        x = layer(x, attention_mask=mask)
    if getattr(self, "cls", None) is not None:
        x = self.cls(x)
    return x


STAGE_FORWARDS: dict[str, tuple[Callable[..., torch.Tensor], tuple[str, ...]]] = {
    "gpt2": (gpt2_stage_forward, ()),
    "llama": (llama_stage_forward, ("model.rotary_emb",)),
    "bert": (bert_stage_forward, ()),
}


def install_stage_forward(stage: nn.Module, family: str) -> nn.Module:
    if family not in STAGE_FORWARDS:
        raise ValueError(f"pipeline parallelism supports the families {sorted(STAGE_FORWARDS)}, not {family!r}")
    stage.forward = types.MethodType(STAGE_FORWARDS[family][0], stage)
    stage.config._attn_implementation = "sdpa"  # causal attention without a mask
    return stage
