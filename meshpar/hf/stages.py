"""Pipeline stage forwards for HuggingFace families (GPT-2, Llama causal LMs; BERT masked LM).

HF models' own ``forward`` cannot run with pieces missing, so each family gets a stage forward that runs whatever the
stage owns: embeddings (first stage), its decoder blocks, final norm and LM head (last stage). Attention is causal
through SDPA with no mask (right-padded causal LM batches need no padding mask).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn


def _positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def gpt2_stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    body = self.transformer
    if body.wte is not None:
        x = body.drop(body.wte(x) + body.wpe(_positions(x)))
    for block in body.h:
        x = block(x)
    if body.ln_f is not None:
        x = self.lm_head(body.ln_f(x))
    return x


def llama_stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    body = self.model
    if body.embed_tokens is not None:
        x = body.embed_tokens(x)
        seq = x.shape[1]
    else:  # a later stage receives sequence shards under sequence parallelism
        seq = x.shape[1] * getattr(self, "meshpar_sequence_shards", 1)
    positions = torch.arange(seq, device=x.device).unsqueeze(0)
    position_embeddings = body.rotary_emb(x, positions)
    for layer in body.layers:
        x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)
    if body.norm is not None:
        x = self.lm_head(body.norm(x))
    return x


def bert_stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """BERT for masked LM: bidirectional attention, no padding mask (full-length batches)."""
    body = self.bert
    if body.embeddings is not None:
        x = body.embeddings(input_ids=x)
    for layer in body.encoder.layer:
        x = layer(x)
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
