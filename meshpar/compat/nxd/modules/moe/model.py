"""``neuronx_distributed.modules.moe.model``: ``MoE``, a mixture-of-experts layer of a router and ``ExpertMLPs``
(optionally shared experts and a norm in front).

``forward(hidden_states)`` takes ``[B, S, H]`` (or, with ``sequence_parallel_enabled``, this rank's sequence shard
along ``sequence_dimension``, NxD's ``[S/tp, B, H]`` by default), routes every token, runs the experts and returns
``(output, [router_logits], [expert_index])`` as ``return_router_logits`` / ``return_expert_index`` ask, the output
in the input's layout. The experts' tp-partial output is summed over tp once at the end (reduce-scattered back to
the sequence shard under sequence parallelism), and the affinities enter the tp region there, so their grads are
summed over tp too (NxD's delayed all-reduce). With ``token_shuffle_group_size`` > 1 the tokens are shuffled across
that many data-parallel ranks first and brought back after (:mod:`.token_shuffling`); the returned router logits and
expert indices are those of the shuffled tokens, as in NxD.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshpar.compat.nxd.modules.moe import token_shuffling
from meshpar.compat.nxd.modules.moe.expert_mlps import ExpertMLPs
from meshpar.compat.nxd.modules.moe.routing import RouterBase
from meshpar.compat.nxd.parallel_layers import mappings, parallel_state


class MoE(nn.Module):
    def __init__(
        self,
        router: RouterBase,
        expert_mlps: ExpertMLPs,
        shared_experts: nn.Module | None = None,
        rmsnorm: nn.Module | None = None,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        return_router_logits: bool = False,
        return_expert_index: bool = False,
        token_shuffle_group_size: int = 1,
        token_shuffle_seed: int | None = None,
        tensor_model_parallel_group: Any = None,
        init_tkg_module: bool = False,
        tkg_config: Any = None,
    ) -> None:
        super().__init__()
        for attr in ("num_experts", "top_k", "hidden_size"):
            if getattr(router, attr) != getattr(expert_mlps, attr):
                raise ValueError(f"Inconsistent {attr} across the router and expert_mlps")
        sequence_dimension = 0 if sequence_dimension is None else sequence_dimension
        if router.sequence_parallel_enabled:
            if not sequence_parallel_enabled:
                raise ValueError("MoE layer must have SP enabled to run router in SP")
            if router.sequence_dimension != sequence_dimension:
                raise ValueError(f"Inconsistent sequence_dimension across MoE and router modules, "
                                 f"{router.sequence_dimension} != {sequence_dimension}")  # fmt: skip
        if init_tkg_module:
            raise NotImplementedError("the fused token-generation module is Neuron inference; not provided")
        self.router, self.expert_mlps, self.shared_experts, self.rmsnorm = router, expert_mlps, shared_experts, rmsnorm
        self.sequence_parallel_enabled, self.sequence_dimension = sequence_parallel_enabled, sequence_dimension
        self.return_router_logits, self.return_expert_index = return_router_logits, return_expert_index
        self.token_shuffle_group_size, self.token_shuffle_seed = token_shuffle_group_size, token_shuffle_seed
        self.shuffle_permutation: torch.Tensor | None = None  # the last one, kept when a seed is given (as NxD)
        if token_shuffle_group_size > 1:
            parallel_state.initialize_token_shuffle_group(token_shuffle_group_size)
        self.ep_enabled = parallel_state.get_expert_model_parallel_size() > 1
        self.tensor_parallel_group = (
            tensor_model_parallel_group
            if tensor_model_parallel_group is not None
            else parallel_state.get_tensor_model_parallel_group()
        )
        self.moe_fused_tkg = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        is_speculative_decoding: bool = False,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        if residual is not None:
            hidden_states = hidden_states + residual
            return (*self._forward(hidden_states, padding_mask), hidden_states)
        return self._forward(hidden_states, padding_mask)

    def _forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        if self.rmsnorm is not None:
            hidden_states = self.rmsnorm(hidden_states)
        permutation = None
        if self.token_shuffle_group_size > 1:
            hidden_states, permutation = token_shuffling.token_shuffle(hidden_states, seed=self.token_shuffle_seed)
            if self.token_shuffle_seed is not None:
                self.shuffle_permutation = permutation
        if self.sequence_parallel_enabled:
            full = mappings.gather_from_sequence_parallel_region(
                hidden_states, self.sequence_dimension, to_model_parallel=False,
                process_group=self.tensor_parallel_group,
            )  # fmt: skip
        else:
            full = hidden_states
        logits, affinities, index = self.router(hidden_states if self.router.sequence_parallel_enabled else full)
        affinities = mappings.copy_to_tensor_model_parallel_region(affinities, self.tensor_parallel_group)
        tokens = full.reshape(-1, full.shape[-1])
        output = self.expert_mlps(tokens, affinities, index, full.shape[self.sequence_dimension], padding_mask)
        if self.shared_experts is not None:
            output = output + self.shared_experts(tokens, full.shape[self.sequence_dimension])
        output = output.view(full.shape)
        if self.sequence_parallel_enabled:
            output = mappings.reduce_scatter_to_sequence_parallel_region(
                output, self.sequence_dimension, process_group=self.tensor_parallel_group
            )
        else:
            output = mappings.reduce_from_tensor_model_parallel_region(output, self.tensor_parallel_group)
        if permutation is not None:
            output = token_shuffling.token_unshuffle(output, permutation)
        result: tuple[torch.Tensor, ...] = (output,)
        if self.return_router_logits:
            result += (logits,)
        if self.return_expert_index:
            result += (index,)
        return result


__all__ = ["MoE"]
