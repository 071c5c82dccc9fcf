"""``neuronx_distributed.modules.lora.tp_layer``: low-rank adapters around NxD's tensor-parallel layers.

The adapter is split the way its base layer is, so ``B(A(x))`` has the base output's layout and every rank's delta
``B @ A`` is its shard of the dense delta:

- around a ``ColumnParallelLinear``: ``A`` whole (an ``nn.Linear`` on every rank), ``B`` a ``ColumnParallelLinear``
  with the base's output split and gathering;
- around a ``RowParallelLinear``: ``A`` a ``RowParallelLinear`` with the base's input split (its output summed over
  tp), ``B`` whole;
- around a ``GQAQKVColumnParallelLinear``: ``A`` whole, ``B`` a ``GQAQKVColumnParallelLinear`` with the base's q / k /
  v sizes, key / value replication and fusing, so the layer returns ``(q, k, v)`` with the adapters added.

Under sequence parallelism the whole part next to the sharded sequence (``A`` of a column layer, ``B`` of a row
layer) sees one rank's tokens only; it is marked ``sequence_parallel_enabled`` so NxD's
``allreduce_sequence_parallel_gradients`` (which ``NxDOptimizer`` runs) sums its grad over tp, like a norm's. The
adapter parameters are float32 whatever the base's dtype (NxD's choice: small, and trained).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.init import xavier_normal_

from meshpar.compat.nxd.modules.lora.config import LoraConfig
from meshpar.compat.nxd.modules.lora.layer import LoraLayer, LoraLinear
from meshpar.compat.nxd.modules.qkv_linear import GQAQKVColumnParallelLinear
from meshpar.compat.nxd.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear


def _mark_sequence_parallel(module: nn.Module, enabled: bool) -> None:
    if enabled:
        for param in module.parameters():
            param.sequence_parallel_enabled = True


def _to_base_device(lora: LoraLayer) -> None:
    weight = next(iter(lora.get_base_layer().parameters()), None)
    if weight is not None:
        for name in ("lora_A", "lora_B"):
            getattr(lora, name).to(weight.device)


class LoraParallelLinear(LoraLinear):
    """LoRA around a ``ColumnParallelLinear`` or ``RowParallelLinear`` (see the module docstring)."""

    def __init__(self, base_layer: nn.Module, lora_config: LoraConfig) -> None:
        super().__init__(base_layer, lora_config)

    def update_layer(self, lora_config: LoraConfig, init_method: Any = xavier_normal_) -> None:
        base = self.get_base_layer()
        self.lora_dropout = self._dropout(lora_config)
        sequence_parallel = base.sequence_parallel_enabled
        if isinstance(base, RowParallelLinear):
            if not base.reduce_output:
                raise ValueError(
                    "LoRA around a RowParallelLinear with reduce_output=False: its output is a partial "
                    "sum the adapter's cannot be added to; keep reduce_output=True"
                )
            self.lora_A = RowParallelLinear(
                self.in_features,
                self.lora_rank,
                bias=False,
                input_is_parallel=base.input_is_parallel,
                init_method=init_method,
                sequence_parallel_enabled=sequence_parallel,
                sequence_dimension=base.sequence_dimension,
                tensor_model_parallel_group=base.tensor_parallel_group,
            )
            self.lora_B = nn.Linear(self.lora_rank, self.out_features, bias=False, dtype=torch.float32)
            _mark_sequence_parallel(self.lora_B, sequence_parallel)
        elif isinstance(base, ColumnParallelLinear):
            self.lora_A = nn.Linear(self.in_features, self.lora_rank, bias=False, dtype=torch.float32)
            self.lora_B = ColumnParallelLinear(
                self.lora_rank,
                self.out_features,
                bias=False,
                gather_output=base.gather_output,
                init_method=init_method,
                sequence_parallel_enabled=sequence_parallel,
                sequence_dimension=base.sequence_dimension,
                tensor_model_parallel_group=base.tensor_parallel_group,
            )
            _mark_sequence_parallel(self.lora_A, sequence_parallel)
        else:
            raise TypeError(f"LoraParallelLinear wraps a Column- or RowParallelLinear, not a {type(base).__name__}")
        self.init_lora_parameters(lora_config.init_lora_weights)
        _to_base_device(self)

    def get_delta_weight(self) -> torch.Tensor:
        """This rank's shard of ``scaling * B @ A``: the base weight's local shape."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling


class LoraGQAQKVParallelLinear(LoraLayer):
    """LoRA around a ``GQAQKVColumnParallelLinear`` (see the module docstring); ``forward`` returns ``(q, k, v)``."""

    def __init__(self, base_layer: nn.Module, lora_config: LoraConfig) -> None:
        super().__init__(base_layer, lora_config)
        self.update_layer(lora_config)

    def update_layer(self, lora_config: LoraConfig, init_method: Any = xavier_normal_) -> None:
        base = self.get_base_layer()
        self.lora_dropout = self._dropout(lora_config)
        self.lora_A = nn.Linear(self.in_features, self.lora_rank, bias=False, dtype=torch.float32)
        self.lora_B = GQAQKVColumnParallelLinear(
            self.lora_rank,
            self.out_features,
            bias=False,
            gather_output=base.gather_output,
            dtype=torch.float32,
            init_method=init_method,
            kv_size_multiplier=base.kv_size_multiplier,
            sequence_parallel_enabled=base.sequence_parallel_enabled,
            fuse_qkv=base.fuse_qkv,
        )
        _mark_sequence_parallel(self.lora_A, base.sequence_parallel_enabled)
        self.init_lora_parameters(lora_config.init_lora_weights)
        _to_base_device(self)

    def init_lora_parameters(self, init_lora_weights: str) -> None:
        mode = init_lora_weights.lower()
        if mode == "default":
            nn.init.kaiming_uniform_(self.lora_A.weight, a=5**0.5)
        elif mode == "gaussian":
            nn.init.normal_(self.lora_A.weight, std=1 / self.lora_rank)
        else:
            raise ValueError(f"Unknown LoRA parameters initialization with {init_lora_weights}")
        with torch.no_grad():
            for part in self.get_qkv(self.lora_B):
                part.zero_()

    def get_qkv(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The local q, k and v weights of a grouped q/k/v layer (row slices of ``weight_qkv`` when fused)."""
        if layer.fuse_qkv:
            kv = layer.kv_output_size_per_partition
            return tuple(layer.weight_qkv.split([layer.q_output_size_per_partition, kv, kv], dim=0))
        return layer.weight_q, layer.weight_k, layer.weight_v

    def get_delta_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.lora_A.weight
        return tuple((b @ a) * self.scaling for b in self.get_qkv(self.lora_B))

    @torch.no_grad()
    def _shift(self, sign: int) -> None:
        for weight, delta in zip(self.get_qkv(self.get_base_layer()), self.get_delta_weight(), strict=True):
            weight.add_(sign * delta.to(weight.dtype))  # a row slice: writes into the layer's weight

    def merge(self, safe_merge: bool = False) -> None:
        if safe_merge and not all(torch.isfinite(d).all() for d in self.get_delta_weight()):
            raise ValueError("NaNs detected in the merged weights. The adapter seems to be broken")
        self._shift(+1)
        self.merged = True

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        self._shift(-1)
        self.merged = False

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return q, k, v
        lora_q, lora_k, lora_v = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        return tuple((out + lora * self.scaling).to(x.dtype) for out, lora in ((q, lora_q), (k, lora_k), (v, lora_v)))


__all__ = ["LoraGQAQKVParallelLinear", "LoraParallelLinear"]
