"""NxD's ``pad_model``: add zero attention heads so that tp divides the head count, without changing outputs.

A padded head has zero query, key and value weights (and biases), so its attention output is zero, and the output
projection's padded input columns are zero too: the model computes exactly what it did before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


def get_number_of_extra_heads(num_heads: int, tp_degree: int) -> int:
    """NxD: how many zero heads make ``num_heads`` divisible by ``tp_degree``."""
    return (-num_heads) % tp_degree


def divide(numerator: int, denominator: int) -> int:
    """NxD's ``divide``: exact integer division, refusing a remainder."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


@torch.no_grad()
def _pad_sharded_dim(layer: nn.Module, old_heads: int, new_heads: int) -> None:
    """NxD's 1-axis padding of a meshpar tensor-parallel linear: its sharded dim (column: output features, row: input
    features) grows to the size it would have for ``new_heads``, the added heads all zero, at the end."""
    from meshpar._compat import distribute_tensor
    from meshpar.tensor_parallel.layers import ColumnParallelLinear, mark_partitioned

    column = isinstance(layer, ColumnParallelLinear)
    size = layer.output_size if column else layer.input_size
    new = divide(size * new_heads, old_heads)
    mesh = layer.tp_mesh
    full = layer.weight.full_tensor()
    full = _pad_rows(full, 1, size, new) if column else _pad_rows(full.t(), 1, size, new).t().contiguous()
    placement = layer.weight.placements
    layer.weight = nn.Parameter(distribute_tensor(full, mesh, placement), requires_grad=layer.weight.requires_grad)
    if column and layer.bias is not None:
        bias = _pad_rows(layer.bias.full_tensor(), 1, size, new)
        layer.bias = nn.Parameter(distribute_tensor(bias, mesh, layer.bias.placements))
    mark_partitioned(layer)
    if column:
        layer.output_size = layer.out_features = new
    else:
        layer.input_size = layer.in_features = new


def pad_model(
    model: nn.Module,
    tp_degree: int,
    n_heads: int,
    wrapped_classes: Iterable[type] = (),
    pad_hook_fn: Callable[[nn.Module, float], None] | None = None,
    *,
    layer_padders: dict[type, Callable[[nn.Module, int, int], None]] | None = None,
) -> nn.Module:
    """NxD's ``pad_model``: pad attention from ``n_heads`` to the next multiple of ``tp_degree`` heads.

    Within ``wrapped_classes`` instances (the whole model if none are given), every meshpar
    ``ColumnParallelLinear`` / ``RowParallelLinear`` has its sharded dim padded by ``tgt_src_ratio = padded /
    n_heads`` (zero heads at the end), and ``pad_hook_fn(module, tgt_src_ratio)`` is called for every instance of
    ``wrapped_classes`` (to fix what the padding cannot know, a split size, say). Unsharded GPT-2, Llama
    (multi-head) and BERT attention modules, as HF builds them, are padded head by head (fused QKV included), so
    ``meshpar.parallelize`` can then shard them; the model's config gets the padded head count. ``layer_padders``
    pads other sharded layer classes (a compatibility view's own): ``padder(layer, n_heads, padded_heads)``.
    """
    wrapped = tuple(wrapped_classes)
    padded = n_heads + get_number_of_extra_heads(n_heads, tp_degree)
    if padded == n_heads:
        return model
    from meshpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    ratio = padded / n_heads
    roots = [m for m in model.modules() if isinstance(m, wrapped)] if wrapped else [model]
    touched = 0
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            padder = next((fn for cls, fn in (layer_padders or {}).items() if isinstance(module, cls)), None)
            if padder is not None:
                padder(module, n_heads, padded)
                touched += 1
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                _pad_sharded_dim(module, n_heads, padded)
                touched += 1
            elif type(module).__name__ in _BUILTIN:
                _BUILTIN[type(module).__name__](module, n_heads, padded)
                touched += 1
        if pad_hook_fn is not None and wrapped:
            pad_hook_fn(root, ratio)
            touched += 1
    if touched == 0:
        raise ValueError(
            f"pad_model found nothing to pad in {type(model).__name__}: no meshpar parallel linear layer and no "
            "GPT-2 / Llama / BERT attention (pass wrapped_classes and a pad_hook_fn for other modules)"
        )
    config = getattr(model, "config", None)
    for key in _CONFIG_KEYS:
        if config is not None and getattr(config, key, None) == n_heads:
            setattr(config, key, padded)
    if config is not None and getattr(config, "num_key_value_heads", None) == n_heads:
        config.num_key_value_heads = padded
    return model
