"""Mixture-of-experts layers under tensor parallelism: whole experts per tp rank.

transformers' ``moe_tp_experts`` style splits every expert's features over tp, with the fused gate/up weights in a
strided layout (``_StridedShard``) that torch 2.13's DCP cannot save ("overlapping chunks"). meshpar shards the
experts module's 3-D weights ``[num_experts, ...]`` over their first dim instead (``Shard(0)``, the model's own
shapes and FQNs, so checkpoints reshard like any other parameter): each rank keeps ``num_experts / tp`` whole experts
and runs the tokens routed to them; every token is on every tp rank, so the partial outputs summed over tp are the
dense output. Forward: one all-reduce of the output; backward: one of the input grad and one of the routing weights'
grad (the router stays replicated). Routes to other ranks' experts get the local index ``num_local_experts``, which
transformers' experts forwards skip (expert parallelism uses the same sentinel). Experts handed one block of tokens
per expert instead of routes (Llama-4) run their own blocks, all-gathered back in expert order.
"""

from __future__ import annotations

import torch
from torch import nn

from meshpar._compat import DeviceMesh, ParallelStyle, Shard
from meshpar._in_place import mix_into
from meshpar.tensor_parallel._collectives import copy_to_tp, gather_from_tp, reduce_from_tp
from meshpar.tensor_parallel.layers import distribute_parameter, parameters_replaced


class _LocalExperts:
    """Mixin for a transformers experts module whose expert weights are ``Shard(0)`` DTensors over tp."""

    tp_mesh: DeviceMesh
    num_experts: int

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
    ) -> object:
        if top_k_index is None:
            return self._forward_blocks(hidden_states)
        mesh = self.tp_mesh
        local = self.num_experts // mesh.size()
        start = mesh.get_local_rank() * local
        elsewhere = (top_k_index < start) | (top_k_index >= start + local)
        local_index = torch.where(elsewhere, local, top_k_index - start)
        weights = copy_to_tp(top_k_weights, mesh).masked_fill(elsewhere, 0.0)
        shards = {name: p.to_local() for name, p in self._parameters.items() if p is not None}
        previous = (self.num_experts, getattr(self, "_is_expert_parallel", None))
        try:
            self.num_experts = local
            if previous[1] is not None:
                self._is_expert_parallel = True  # transformers' grouped forwards then mask the sentinel routes
            with parameters_replaced(self, shards):
                out = super().forward(copy_to_tp(hidden_states, mesh), local_index, weights)  # type: ignore[misc]
        finally:
            self.num_experts = previous[0]
            if previous[1] is not None:
                self._is_expert_parallel = previous[1]
        return reduce_from_tp(out, mesh)

    def _forward_blocks(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Experts handed one block of (already weighted) tokens per expert, ``[experts * tokens, hidden]`` in expert
        order (Llama-4): this rank runs its experts' blocks and the blocks are all-gathered back in order (backward:
        each rank keeps its blocks' grad; the input grad, non-zero only in this rank's blocks, is summed over tp)."""
        mesh = self.tp_mesh
        local = self.num_experts // mesh.size()
        start = mesh.get_local_rank() * local
        width = hidden_states.shape[-1]
        blocks = copy_to_tp(hidden_states, mesh).view(self.num_experts, -1, width)
        shards = {name: p.to_local() for name, p in self._parameters.items() if p is not None}
        with parameters_replaced(self, shards):
            out = super().forward(blocks[start : start + local].reshape(-1, width))  # type: ignore[misc]
        return gather_from_tp(out.view(local, -1, out.shape[-1]), mesh, 0).reshape(-1, out.shape[-1])


class ExpertsOverTP(ParallelStyle):
    """Shard a transformers experts module (3-D expert weights, ``forward(hidden, top_k_index, top_k_weights)``)
    into whole experts per tp rank; see the module docstring."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        experts, tp = getattr(module, "num_experts", None), device_mesh.size()
        cls = type(module)
        if not isinstance(experts, int) or experts % tp:
            raise ValueError(
                f"{cls.__name__}: {experts} experts cannot be split into whole experts over tp={tp}; use a tp that "
                "divides the number of experts"
            )
        others = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 0 or p.shape[0] != experts]
        others += [n for n, child in module.named_children() if any(True for _ in child.parameters())]
        if others:
            raise ValueError(
                f"{cls.__name__}: only modules whose parameters are all stacked over the experts can be sharded "
                f"into whole experts ({others} are not)"
            )
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, distribute_parameter(param, device_mesh, [Shard(0)], self.src_data_rank))
        mix_into(module, _LocalExperts, "TensorParallel")
        module.tp_mesh = device_mesh
        return module
