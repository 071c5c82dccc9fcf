"""Tiny HuggingFace models built from configs (never downloaded)."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

VOCAB = 64


def build(
    family: str, *, heads: int = 4, layers: int = 2, kv_heads: int | None = None, vocab: int = VOCAB
) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(
            vocab_size=vocab, n_positions=32, n_embd=8 * heads, n_layer=layers, n_head=heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
        )  # fmt: skip
        return GPT2LMHeadModel(config).eval()
    if family == "llama":
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads or max(1, heads // 2), max_position_embeddings=32,
            attn_implementation="sdpa",
        )  # fmt: skip
        return LlamaForCausalLM(config).eval()
    if family in ("bert", "bert_cls"):
        config = BertConfig(
            vocab_size=vocab, hidden_size=8 * heads, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation="sdpa",
        )  # fmt: skip
        cls = BertForMaskedLM if family == "bert" else BertForSequenceClassification
        return cls(config).eval()
    raise ValueError(family)


def batch(family: str, rows: int = 4, seq: int = 16, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    if family == "bert":
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = ids[:, ::3]
        return {"input_ids": ids, "labels": labels}
    if family == "bert_cls":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (rows,), generator=generator)}
    return {"input_ids": ids, "labels": ids.clone()}
