"""``neuronx_distributed.modules.moe.shared_experts``: ``SharedExperts``, the MLP every token goes through beside its
routed experts (DeepSeek-style shared experts), for NxD's ``MoE(shared_experts=...)``.

``num_shared_experts`` shared experts are one gated MLP of intermediate size ``I * num_shared_experts``, split
over tp as NxD splits it: ``gate_proj`` / ``up_proj`` column-parallel (or ``gate_up_proj``, each rank's gate rows
then its up rows, with ``fused_gate_up_projection``), ``down_proj`` row-parallel with ``reduce_output=False``.
``forward(x [T, H], seq_len)`` returns this rank's partial ``[T, H]``; the ``MoE`` layer adds it to the routed
experts' partial output and sums both over tp once.

NxD's inference layouts are for evaluation only: ``transpose_weights`` (weights stored transposed, loaded from a
checkpoint transposed by :meth:`SharedExperts.preshard_hook`) runs in ``eval()`` and is refused in training (NxD's
transposed layers do not sum their input grads over tp, so their grads would be wrong);
``sequence_parallel_enabled`` (weights replicated on every Neuron core with an SPMD rank) is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshpar.compat.nxd.modules.moe.model_utils import ACT2FN
from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.compat.nxd.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear
from meshpar.compat.nxd.parallel_layers.utils import ensure_parallel_state


def _refuse_training(layer: nn.Module) -> None:
    if layer.training:
        raise NotImplementedError(
            f"{type(layer).__name__} is NxD's inference layout (weights stored transposed); its input grad is not "
            "summed over tp, so it runs in eval() only: train with transpose_weights=False"
        )


class ColumnParallelLinearTransposed(ColumnParallelLinear):
    """A column-parallel layer whose ``weight`` is used transposed: ``x @ weight`` (with ``weight``
    ``[out / tp, in]``, the input is ``[..., out / tp]``). NxD's inference layout: ``eval()`` only."""

    def forward(self, input: torch.Tensor, slice_indices: torch.Tensor | None = None) -> Any:
        _refuse_training(self)
        weight = self.weight[slice_indices, :] if slice_indices is not None else self.weight
        output = self._cpl_maybe_gather_output(input @ weight)
        if self.skip_bias_add:
            return output, self.bias
        return output + self.bias if self.bias is not None else output


class RowParallelLinearTransposed(RowParallelLinear):
    """A row-parallel layer whose ``weight`` is used transposed: ``x @ weight`` (with ``weight`` ``[out, in / tp]``,
    the input is ``[..., out]`` and the output this rank's ``[..., in / tp]``). NxD's inference layout: ``eval()``
    only."""

    def forward(self, input_: torch.Tensor, slice_indices: torch.Tensor | None = None) -> Any:
        _refuse_training(self)
        weight = self.weight[:, slice_indices] if slice_indices is not None else self.weight
        output = self._rpl_maybe_reduce_output(self._rpl_maybe_scatter_input(input_) @ weight)
        if self.skip_bias_add:
            return output, self.bias
        return output + self.bias if self.bias is not None else output


class SharedExperts(nn.Module):
    """The shared experts' MLP split over tp (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_shared_experts: int,
        hidden_act: str,
        dtype: torch.dtype = torch.float32,
        tensor_model_parallel_group: Any = None,
        reduce_dtype: torch.dtype = torch.float32,
        fused_gate_up_projection: bool = False,
        sequence_parallel_enabled: bool = False,
        transpose_weights: bool = False,
    ) -> None:
        super().__init__()
        if sequence_parallel_enabled:
            raise NotImplementedError(
                "SharedExperts(sequence_parallel_enabled=True) replicates the weights on every Neuron core for "
                "inference (an SPMD rank per core); not provided: shard them over tp (the default)"
            )
        if transpose_weights and fused_gate_up_projection:
            raise ValueError("SharedExperts: transpose_weights with fused_gate_up_projection is not supported (NxD)")
        if hidden_act not in ACT2FN:
            raise ValueError(f"Unknown activation: {hidden_act} ; Supported: {list(ACT2FN)}")
        ensure_parallel_state()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_shared_experts, self.act_fn, self.dtype = num_shared_experts, ACT2FN[hidden_act], dtype
        self.reduce_dtype, self.fused_gate_up_projection = reduce_dtype, fused_gate_up_projection
        self.transpose_weights, self.sequence_parallel_enabled = transpose_weights, sequence_parallel_enabled
        self.tensor_parallel_group = tensor_model_parallel_group or parallel_state.get_tensor_model_parallel_group()
        self._initialize_parallel_layers()

    def _initialize_parallel_layers(self) -> None:
        width = self.intermediate_size * self.num_shared_experts
        common = dict(dtype=self.dtype, reduce_dtype=self.reduce_dtype,
                      tensor_model_parallel_group=self.tensor_parallel_group)  # fmt: skip
        if self.fused_gate_up_projection:
            self.gate_up_proj = self._column(2 * width, stride=2, **common)
            self.down_proj = self._row(width, **common)
        elif self.transpose_weights:  # each projection the other kind, its weight stored transposed
            self.gate_proj = self._row(width, **common)
            self.up_proj = self._row(width, **common)
            self.down_proj = self._column(width, **common)
        else:
            self.gate_proj = self._column(width, **common)
            self.up_proj = self._column(width, **common)
            self.down_proj = self._row(width, **common)

    def _column(self, output_size: int, stride: int = 1, **kwargs: Any) -> ColumnParallelLinear:
        cls = ColumnParallelLinearTransposed if self.transpose_weights else ColumnParallelLinear
        return cls(self.hidden_size, output_size, stride=stride, bias=False, gather_output=False, **kwargs)

    def _row(self, input_size: int, **kwargs: Any) -> RowParallelLinear:
        cls = RowParallelLinearTransposed if self.transpose_weights else RowParallelLinear
        return cls(input_size, self.hidden_size, bias=False, input_is_parallel=True, reduce_output=False, **kwargs)

    def preshard_hook(self, model_state_dict: dict[str, Any], prefix: str) -> None:
        """With ``transpose_weights``, the full checkpoint's ``[out, in]`` projections transposed to the stored
        layout before they are sharded (``prefix`` ends with ``weight``, NxD's convention)."""
        if not self.transpose_weights or not prefix.endswith("weight"):
            return
        base = prefix.removesuffix("weight")
        for name in ("gate_proj", "up_proj", "down_proj"):
            key = f"{base}{name}.weight"
            model_state_dict[key] = model_state_dict[key].T.contiguous()

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """This rank's partial output for the tokens ``x`` (``seq_len``, NxD's switch between its inference paths,
        changes nothing here)."""
        if self.fused_gate_up_projection:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


__all__ = ["ColumnParallelLinearTransposed", "RowParallelLinearTransposed", "SharedExperts"]
