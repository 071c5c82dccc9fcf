"""``neuronx_distributed.modules.moe.experts``: ``Experts``, every expert's MLP over capacity-shaped slots.

``forward(hidden_states [E', C, H])`` (expert ``e``'s ``C`` token slots at ``hidden_states[e]``; ``E'`` every expert,
the ones in ``expert_indices``, or 1 broadcast over them) returns ``[E', C, H]``: this rank's partial sum over its
intermediate slice (the ``down_proj`` is not summed over tp: NxD's MoE sums once, after combining the experts).
The projections are :mod:`.moe_parallel_layers`' (``gate_up_proj`` ``[E / ep, H, 2I / tp]``, each rank's gate
columns then its up columns, or ``up_proj``; ``down_proj`` ``[E / ep, I / tp, H]``).

Under expert parallelism, in training, each ep rank's ``[E, C, H]`` slots go to the ranks holding their experts by
all-to-all (``[E / ep, ep, C, H]`` there) and the outputs come back the same way, NxD's
``enter_expert_parallel_region`` / ``exit_expert_parallel_region`` over the module's ep group (the parallel state's
unless given); in evaluation NxD's module computes the slots of the local experts only, so its input then has
``E / ep`` experts. ``expert_indices`` with ep > 1 is refused, as in NxD.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshpar.compat.nxd.modules.moe.model_utils import GLUType, expert_activation
from meshpar.compat.nxd.modules.moe.moe_parallel_layers import (
    ExpertFusedColumnParallelLinear,
    ExpertFusedLinear,
    ExpertFusedRowParallelLinear,
    expert_parallel_mesh,
)
from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.compat.nxd.parallel_layers.mappings import swap_split_over_ep
from meshpar.compat.nxd.parallel_layers.utils import ensure_parallel_state


class Experts(nn.Module):
    """Every local expert's MLP over its token slots (see the module docstring)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        glu: bool,
        activation_fn: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | None,
        bias: bool = False,
        glu_type: GLUType | str | None = GLUType.GLU,
        hidden_act_scaling_factor: float = 1.0,
        hidden_act_bias: float = 0.0,
        gate_clamp_upper_limit: float | None = None,
        gate_clamp_lower_limit: float | None = None,
        up_clamp_upper_limit: float | None = None,
        up_clamp_lower_limit: float | None = None,
        input_layer_init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        is_prefill: bool = True,
        tensor_model_parallel_group: Any = None,
        expert_model_parallel_group: Any = None,
        expert_distribution: list[list[int]] | None = None,
    ) -> None:
        super().__init__()
        ensure_parallel_state(device)
        self._glu = glu
        self._glu_type = GLUType.validate(glu_type) if glu else glu_type
        self._activation_fn = activation_fn
        self.num_experts = num_experts
        self.hidden_act_scaling_factor, self.hidden_act_bias = hidden_act_scaling_factor, hidden_act_bias
        self.gate_clamp_upper_limit, self.gate_clamp_lower_limit = gate_clamp_upper_limit, gate_clamp_lower_limit
        self.up_clamp_upper_limit, self.up_clamp_lower_limit = up_clamp_upper_limit, up_clamp_lower_limit
        self.tensor_parallel_group = (
            tensor_model_parallel_group
            if tensor_model_parallel_group is not None
            else parallel_state.get_tensor_model_parallel_group()
        )
        self._ep_group = expert_model_parallel_group
        self.ep_mesh = expert_parallel_mesh(expert_model_parallel_group)
        common = dict(
            num_experts=num_experts, bias=bias, dtype=dtype, device=device,
            tensor_model_parallel_group=self.tensor_parallel_group,
            expert_model_parallel_group=expert_model_parallel_group, is_prefill=is_prefill,
            expert_distribution=expert_distribution,
        )  # fmt: skip
        first = ExpertFusedColumnParallelLinear(
            input_size=hidden_size, output_size=intermediate_size * (2 if glu else 1), stride=2 if glu else 1,
            init_method=input_layer_init_method, is_fused_gate_up=glu, **common,
        )  # fmt: skip
        setattr(self, "gate_up_proj" if glu else "up_proj", first)
        self.down_proj = ExpertFusedRowParallelLinear(
            input_size=intermediate_size, output_size=hidden_size, reduce_output=False,
            init_method=output_layer_init_method, **common,
        )  # fmt: skip

    expert_model_parallel_group = ExpertFusedLinear.expert_model_parallel_group

    def forward(self, hidden_states: torch.Tensor, expert_indices: torch.Tensor | None = None) -> torch.Tensor:
        ep = self.ep_mesh.size() if self.ep_mesh is not None else 1
        if expert_indices is not None and ep > 1:
            raise ValueError("Selective expert loading is not supported with expert parallelism.")
        if hidden_states.dim() != 3:
            raise ValueError(f"Experts takes [experts, capacity, hidden] slots; got shape {tuple(hidden_states.shape)}")
        computed = self.num_experts if expert_indices is None else expert_indices.shape[0]
        if ep > 1 and not self.training:
            computed //= ep  # evaluation computes the local experts' slots only (NxD's)
        if hidden_states.shape[0] not in (1, computed):
            raise ValueError(
                f"Experts: {hidden_states.shape[0]} experts' slots for {computed} experts (or 1, broadcast over them)"
            )
        e, c, h = hidden_states.shape
        exchanged = ep > 1 and self.training
        dispatched = hidden_states.view(e, 1, c, h)
        if exchanged:  # NxD's enter_expert_parallel_region, over this module's ep group
            dispatched = swap_split_over_ep(dispatched, 0, 1, self.ep_mesh)
        first = self.gate_up_proj if self._glu else self.up_proj
        intermediate = self._activation(first(dispatched, expert_indices=expert_indices))
        projected = self.down_proj(intermediate, expert_indices=expert_indices)
        return (swap_split_over_ep(projected, 1, 0, self.ep_mesh) if exchanged else projected).squeeze(1)

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        return expert_activation(
            x, self._activation_fn, self._glu_type if self._glu else None, self.hidden_act_scaling_factor,
            self.hidden_act_bias, (self.gate_clamp_lower_limit, self.gate_clamp_upper_limit),
            (self.up_clamp_lower_limit, self.up_clamp_upper_limit),
        )  # fmt: skip


__all__ = ["Experts"]
