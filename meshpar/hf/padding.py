"""NxD's ``pad_model``: add zero attention heads so that tp divides the head count, without changing outputs.

A padded head has zero query, key and value weights (and biases), so its attention output is zero, and the output
projection's padded input columns are zero too: the model computes exactly what it did before.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def _pad_rows(t: torch.Tensor, blocks: int, old: int, new: int) -> torch.Tensor:
    """Pad dim 0, viewed as ``[blocks, old]``, to ``[blocks, new]`` with zeros."""
    view = t.reshape(blocks, old, *t.shape[1:])
    pad = torch.zeros(blocks, new - old, *t.shape[1:], dtype=t.dtype, device=t.device)
    return torch.cat([view, pad], dim=1).reshape(blocks * new, *t.shape[1:])


def _pad_linear_out(linear: nn.Linear, old: int, new: int) -> None:
    with torch.no_grad():
        linear.weight = nn.Parameter(_pad_rows(linear.weight.data, 1, old, new))
        if linear.bias is not None:
            linear.bias = nn.Parameter(_pad_rows(linear.bias.data, 1, old, new))
    linear.out_features = new


def _pad_linear_in(linear: nn.Linear, old: int, new: int) -> None:
    with torch.no_grad():
        linear.weight = nn.Parameter(_pad_rows(linear.weight.data.t(), 1, old, new).t().contiguous())
    linear.in_features = new


def _pad_gpt2(attn: nn.Module, heads: int, padded: int) -> None:
    hd = attn.head_dim
    old, new = heads * hd, padded * hd
    with torch.no_grad():
        w = attn.c_attn.weight.data  # Conv1D [in, 3 * old]
        attn.c_attn.weight = nn.Parameter(_pad_rows(w.t(), 3, old, new).t().contiguous())
        attn.c_attn.bias = nn.Parameter(_pad_rows(attn.c_attn.bias.data, 3, old, new))
        attn.c_attn.nf = 3 * new
        attn.c_proj.weight = nn.Parameter(_pad_rows(attn.c_proj.weight.data, 1, old, new))
    attn.split_size, attn.num_heads = new, padded


def _pad_llama(attn: nn.Module, heads: int, padded: int) -> None:
    if attn.config.num_key_value_heads != heads:
        raise NotImplementedError("pad_model pads multi-head attention; grouped-query attention is not supported")
    hd = attn.head_dim
    for name in ("q_proj", "k_proj", "v_proj"):
        _pad_linear_out(getattr(attn, name), heads * hd, padded * hd)
    _pad_linear_in(attn.o_proj, heads * hd, padded * hd)


def _pad_bert(attention: nn.Module, heads: int, padded: int) -> None:
    core = attention.self
    hd = core.attention_head_size
    for name in ("query", "key", "value"):
        _pad_linear_out(getattr(core, name), heads * hd, padded * hd)
    _pad_linear_in(attention.output.dense, heads * hd, padded * hd)
    core.num_attention_heads, core.all_head_size = padded, padded * hd


_BUILTIN = {"GPT2Attention": _pad_gpt2, "LlamaAttention": _pad_llama, "BertAttention": _pad_bert}
_CONFIG_KEYS = ("n_head", "num_attention_heads")


def pad_model(
    model: nn.Module,
    tp_degree: int,
    n_heads: int,
    wrapped_classes: tuple[type, ...] = (),
    pad_hook_fn: Callable[[nn.Module, int, int], None] | None = None,
) -> nn.Module:
    """Pad every attention module of ``model`` from ``n_heads`` to the next multiple of ``tp_degree`` heads.

    GPT-2, Llama (multi-head) and BERT attention are padded by meshpar; modules of ``wrapped_classes`` are handed to
    ``pad_hook_fn(module, n_heads, padded_heads)``. The model's config is updated to the padded head count.
    """
    padded = math.ceil(n_heads / tp_degree) * tp_degree
    if padded == n_heads:
        return model
    touched = 0
    for module in model.modules():
        if wrapped_classes and isinstance(module, wrapped_classes):
            if pad_hook_fn is None:
                raise ValueError("wrapped_classes need a pad_hook_fn(module, n_heads, padded_heads)")
            pad_hook_fn(module, n_heads, padded)
            touched += 1
        elif type(module).__name__ in _BUILTIN:
            _BUILTIN[type(module).__name__](module, n_heads, padded)
            touched += 1
    if touched == 0:
        raise ValueError(f"pad_model found no attention module to pad in {type(model).__name__}; pass wrapped_classes")
    config = getattr(model, "config", None)
    for key in _CONFIG_KEYS:
        if config is not None and getattr(config, key, None) == n_heads:
            setattr(config, key, padded)
    if config is not None and getattr(config, "num_key_value_heads", None) == n_heads:
        config.num_key_value_heads = padded
    return model
