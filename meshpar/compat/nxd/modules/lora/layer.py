"""``neuronx_distributed.modules.lora.layer``: low-rank adapters around single-device layers.

A LoRA layer wraps its ``base_layer`` and adds ``scaling * B(A(dropout(x)))`` to its output, ``A`` of rank
``lora_rank`` (``[r, in]``) and ``B`` back to the output (``[out, r]``), ``B`` zero at the start so the wrapped
model begins as the base model. :meth:`LoraLayer.merge` adds ``scaling * B @ A`` (``get_delta_weight``) to the base
weight, after which the layer computes the base alone; :meth:`LoraLayer.unmerge` takes it out again.

:class:`LoraLinear` wraps ``nn.Linear`` and HF's ``Conv1D`` (``is_conv_1d_layer``: its weight is ``[in, out]``, so
the delta is transposed); :class:`LoraEmbedding` wraps ``nn.Embedding`` (``A`` is looked up by token, ``A`` starts
at zero and ``B`` random, as NxD does); :class:`LoraConv2d` wraps ``nn.Conv2d`` (``A`` a convolution with the base's
kernel, ``B`` a 1x1 one). The tensor-parallel layers are in :mod:`.tp_layer`.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshpar.compat.nxd.modules.lora.config import LoraConfig


def _hf_conv1d() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return Conv1D


def layer_features(layer: nn.Module) -> tuple[int, Any]:
    """``(in_features, out_features)`` of a layer LoRA can wrap (``out`` is a list for the grouped q/k/v layer)."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if isinstance(layer, nn.Conv2d):
        return layer.in_channels, layer.out_channels
    if isinstance(layer, nn.Embedding):
        return layer.num_embeddings, layer.embedding_dim
    if hasattr(layer, "input_size") and hasattr(layer, "output_size"):  # Column / RowParallelLinear
        return layer.input_size, layer.output_size
    if hasattr(layer, "input_size") and hasattr(layer, "output_sizes"):  # GQAQKVColumnParallelLinear
        return layer.input_size, layer.output_sizes
    conv1d = _hf_conv1d()
    if conv1d is not None and isinstance(layer, conv1d):
        rows, cols = layer.weight.shape
        return rows, cols
    raise ValueError(f"LoRA cannot wrap a {type(layer).__name__}: it has no known input and output sizes")


def _scaled(x: torch.Tensor, scaling: float) -> torch.Tensor:
    return x * scaling


class LoraLayer(nn.Module, ABC):
    """What every LoRA layer shares: the wrapped ``base_layer``, rank, scale, merge state and initialisation."""

    adapter_layer_names = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
    other_param_names = ("lora_rank", "lora_alpha", "scaling", "lora_dropout")

    def __init__(self, base_layer: nn.Module, lora_config: LoraConfig) -> None:
        if lora_config.lora_rank <= 0:
            raise ValueError(
                f"`lora_rank` should be a positive integer value but the value passed is {lora_config.lora_rank}"
            )
        super().__init__()
        self.base_layer = base_layer
        self.lora_config = lora_config
        self.lora_rank, self.lora_alpha = lora_config.lora_rank, lora_config.lora_alpha
        self.lora_A: nn.Module | None = None
        self.lora_B: nn.Module | None = None
        self.lora_embedding_A: nn.Parameter | None = None
        self.lora_embedding_B: nn.Parameter | None = None
        self.lora_dropout: nn.Module | None = None
        self.in_features, self.out_features = layer_features(self.get_base_layer())
        self.merged = False
        root = math.sqrt(self.lora_rank) if lora_config.use_rslora else self.lora_rank
        self.scaling = self.lora_alpha / root

    def get_base_layer(self) -> nn.Module:
        """The innermost wrapped layer (a LoRA layer may wrap another)."""
        layer: nn.Module = self
        while hasattr(layer, "base_layer"):
            layer = layer.base_layer
        return layer

    def _dropout(self, lora_config: LoraConfig) -> nn.Module:
        return nn.Dropout(p=lora_config.lora_dropout) if lora_config.lora_dropout > 0.0 else nn.Identity()

    def _follow_base(self) -> None:
        """Adapters on the base weight's device and dtype (the layer was built before them)."""
        weight = getattr(self.get_base_layer(), "weight", None)
        if weight is not None:
            for name in self.adapter_layer_names:
                part = getattr(self, name)
                if isinstance(part, nn.Module):
                    part.to(weight.device, dtype=weight.dtype)
                elif isinstance(part, nn.Parameter):
                    part.data = part.data.to(weight.device, dtype=weight.dtype)

    @torch.no_grad()
    def merge(self, safe_merge: bool = False) -> None:
        """Add the adapter's delta to the base weight (``safe_merge``: refuse, leaving the weight as it was, if the
        sum is not finite)."""
        weight = self.get_base_layer().weight
        merged = weight + self.get_delta_weight().to(weight.dtype)
        if safe_merge and not torch.isfinite(merged).all():
            raise ValueError("NaNs detected in the merged weights. The adapter seems to be broken")
        weight.copy_(merged)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        weight = self.get_base_layer().weight
        weight.sub_(self.get_delta_weight().to(weight.dtype))
        self.merged = False

    @abstractmethod
    def update_layer(self, *args: Any) -> None:
        """Create the adapter's parameters."""

    @abstractmethod
    def get_delta_weight(self) -> Any:
        """``scaling * B @ A`` in the base weight's layout."""

    def init_lora_parameters(self, init_lora_weights: str) -> None:
        """``"default"``: ``A`` as ``nn.Linear`` initialises (Kaiming uniform), ``"gaussian"``: ``A ~ N(0, 1/r)``;
        ``B`` zero. Embedding adapters: ``A`` zero, ``B ~ N(0, 1)``."""
        mode = init_lora_weights.lower()
        if mode not in ("default", "gaussian"):
            raise ValueError(f"Unknown LoRA parameters initialization with {init_lora_weights}")
        if self.lora_A is not None:
            if mode == "default":
                nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            else:
                nn.init.normal_(self.lora_A.weight, std=1 / self.lora_rank)
            nn.init.zeros_(self.lora_B.weight)
        if self.lora_embedding_A is not None:
            nn.init.zeros_(self.lora_embedding_A)
            nn.init.normal_(self.lora_embedding_B)

    def transpose(self, weight: torch.Tensor) -> torch.Tensor:
        return nn.Parameter(weight.T) if isinstance(weight, nn.Parameter) else weight.T

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def _in_fp32_on_cpu(weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Half-precision products on CPU run in float32 (the caller casts the result back)."""
    if weights[0].device.type == "cpu" and weights[0].dtype in (torch.float16, torch.bfloat16):
        return tuple(w.float() for w in weights)
    return weights


class LoraLinear(LoraLayer):
    """LoRA around ``nn.Linear`` (or HF ``Conv1D`` with ``is_conv_1d_layer``)."""

    def __init__(self, base_layer: nn.Module, lora_config: LoraConfig, is_conv_1d_layer: bool = False) -> None:
        super().__init__(base_layer, lora_config)
        self.is_conv_1d_layer = is_conv_1d_layer
        self.update_layer(lora_config)

    def update_layer(self, lora_config: LoraConfig) -> None:
        self.lora_dropout = self._dropout(lora_config)
        self.lora_A = nn.Linear(self.in_features, self.lora_rank, bias=False)
        self.lora_B = nn.Linear(self.lora_rank, self.out_features, bias=False)
        self.init_lora_parameters(lora_config.init_lora_weights)
        self._follow_base()

    def get_delta_weight(self) -> torch.Tensor:
        b, a = _in_fp32_on_cpu((self.lora_B.weight, self.lora_A.weight))
        delta = _scaled(b @ a, self.scaling)
        return (delta.T if self.is_conv_1d_layer else delta).to(self.lora_B.weight.dtype)

    def _adapter(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.lora_A.weight.dtype)
        return _scaled(self.lora_B(self.lora_A(self.lora_dropout(x))), self.scaling)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = self.base_layer(x, *args, **kwargs)
        if isinstance(result, tuple):  # skip_bias_add: (output, bias)
            return (self._add(result[0], x), *result[1:])
        return self._add(result, x)

    def _add(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return output
        return (output + self._adapter(x)).to(x.dtype if x.is_floating_point() else output.dtype)


class LoraEmbedding(LoraLayer):
    """LoRA around ``nn.Embedding``: ``lora_embedding_A`` ``[r, num_embeddings]`` is looked up by token (with the
    base's padding and norm settings), ``lora_embedding_B`` ``[dim, r]`` maps it to the embedding."""

    def __init__(self, base_layer: nn.Module, lora_config: LoraConfig) -> None:
        super().__init__(base_layer, lora_config)
        self.update_layer(lora_config)

    def update_layer(self, lora_config: LoraConfig) -> None:
        self.lora_dropout = self._dropout(lora_config)
        self.lora_embedding_A = nn.Parameter(torch.empty(self.lora_rank, self.in_features))
        self.lora_embedding_B = nn.Parameter(torch.empty(self.out_features, self.lora_rank))
        self.init_lora_parameters(lora_config.init_lora_weights)
        self._follow_base()

    def get_delta_weight(self) -> torch.Tensor:
        b, a = _in_fp32_on_cpu((self.lora_embedding_B.data, self.lora_embedding_A.data))
        return _scaled((b @ a).T, self.scaling).to(self.lora_embedding_A.dtype)

    def _embed(self, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        base = self.get_base_layer()
        return F.embedding(
            input,
            weight,
            padding_idx=base.padding_idx,
            max_norm=base.max_norm,
            norm_type=base.norm_type,
            scale_grad_by_freq=base.scale_grad_by_freq,
            sparse=base.sparse,
        )

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        looked_up = self._embed(x, self.lora_embedding_A.T)
        return result + _scaled(looked_up @ self.lora_embedding_B.T, self.scaling).to(result.dtype)


class LoraConv2d(LoraLayer):
    """LoRA around ``nn.Conv2d``: ``A`` a convolution to ``r`` channels with the base's kernel, stride, padding and
    dilation; ``B`` a 1x1 convolution back. Grouped convolutions are refused."""

    def __init__(self, base_layer: nn.Module, lora_config: LoraConfig) -> None:
        super().__init__(base_layer, lora_config)
        self.update_layer(lora_config)

    def update_layer(self, lora_config: LoraConfig) -> None:
        base = self.get_base_layer()
        if base.groups != 1:
            raise ValueError(f"LoRA cannot wrap a grouped convolution (groups={base.groups})")
        self.lora_dropout = self._dropout(lora_config)
        self.lora_A = nn.Conv2d(
            self.in_features,
            self.lora_rank,
            base.kernel_size,
            base.stride,
            base.padding,
            dilation=base.dilation,
            bias=False,
        )
        self.lora_B = nn.Conv2d(self.lora_rank, self.out_features, (1, 1), (1, 1), bias=False)
        self.init_lora_parameters(lora_config.init_lora_weights)
        self._follow_base()

    def get_delta_weight(self) -> torch.Tensor:
        b, a = _in_fp32_on_cpu((self.lora_B.weight, self.lora_A.weight))
        # a k x k convolution followed by a 1x1 one is one k x k convolution with kernel B[:, :, 0, 0] @ A
        delta = torch.einsum("or,rihw->oihw", b[:, :, 0, 0], a)
        return _scaled(delta, self.scaling).to(self.lora_A.weight.dtype)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        adapter = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        return (result + _scaled(adapter, self.scaling)).to(x.dtype)


__all__ = ["LoraConv2d", "LoraEmbedding", "LoraLayer", "LoraLinear"]
