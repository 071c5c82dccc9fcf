"""``neuronx_distributed.modules.moe.expert_mlps``: ``ExpertMLPs``, every expert's MLP over the tokens routed to it.

The experts' weights are those of ``mlp_op``, an :class:`~meshpar.compat.nxd.modules.moe.experts.Experts` (as
NxD's), split over tp along the intermediate dim (the parameters plain local shards with NxD's attributes):
``mlp_op.gate_up_proj.weight`` ``[E, H, 2I/tp]`` (each rank's gate columns then its up
columns; ``mlp_op.up_proj.weight`` ``[E, H, I/tp]`` without a gate) and ``mlp_op.down_proj.weight``
``[E, I/tp, H]``. The output is each rank's partial sum over its intermediate slice; the ``MoE`` layer sums it over tp
once, after the experts' outputs are combined (NxD's delayed all-reduce).

Routing to experts (training): each token goes to its ``top_k`` experts, its output the sum of their outputs
weighted by the token's affinities for them (renormalised over the chosen experts with
``normalize_top_k_affinities``). With a ``capacity_factor`` each expert takes at most
``C = min(T, ceil(T * top_k * capacity_factor / E))`` tokens, first come first served in token order, and the rest
of its tokens are dropped for that expert (their affinity for it set to zero before any renormalisation: NxD's
policy); a factor of at least ``E / top_k`` (or ``None``) drops nothing. NxD's blockwise path
(``capacity_factor <= 0``) is dropless, so it computes what ``None`` does. Each expert computes only the tokens it
takes.

Expert parallelism (``expert_model_parallel_size`` ep > 1): each rank holds ``E / ep`` whole experts, its ep rank's
contiguous block (each still split over tp), marked ``expert_model_parallel`` as NxD marks them; the kept
(token, expert) pairs go to the ranks holding their experts by all-to-all and their outputs come back the same way
(:mod:`meshpar.expert_parallel`'s dispatcher: only the kept pairs travel, rather than NxD's capacity-sized slots,
to the same result). Capacity is counted over this rank's tokens, as in NxD. A rank whose experts received no
tokens still gets a (zero) grad for each of them, so every rank's grad reduction sees the same parameters. Each
expert is initialised from a seed of its own (one draw per tensor from the default generator, plus its expert id), so
a rank builds only its own experts, and they are what the ep-1 layer built from the same generator state holds.

NxD's Neuron kernel options are accepted and change nothing; the few that would change the result
(``early_expert_affinity_modulation``, hybrid sharding, ``expert_distribution``) are refused, and so are names NxD
does not have.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshpar.compat.nxd.modules.moe.experts import Experts
from meshpar.compat.nxd.modules.moe.model_utils import ACT2FN, GLUType, expert_activation
from meshpar.compat.nxd.modules.moe.moe_parallel_layers import expert_parallel_mesh
from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.compat.nxd.parallel_layers.mappings import copy_to_tensor_model_parallel_region, group_mesh
from meshpar.expert_parallel import combine, dispatch, experts_touched

# NxD's options of its Neuron kernels and inference sharding: accepted, and change nothing here (the torch path)
_NEURON_OPTIONS = frozenset({
    "enable_spmd_rank", "blockwise_nki_autograd_cls", "use_torch_block_wise", "logical_nc_config",
    "parallelize_token_to_block_mapping", "optimized_block_to_token_mapping", "use_block_parallel",
    "always_augment_inputs_for_blockwise_matmul", "block_sharding_strategy", "skip_dma_token", "skip_dma_weight",
    "tkg_tensor_model_parallel_group", "tkg_expert_model_parallel_group", "cte_tensor_model_parallel_group",
    "cte_expert_model_parallel_group", "is_prefill", "use_shard_on_intermediate_dynamic_while",
    "use_shard_on_block_dynamic_while", "use_index_calc_kernel",
})  # fmt: skip
# options that would change what is computed, refused when set
_REFUSED_OPTIONS = {
    "early_expert_affinity_modulation": "scaling the experts' inputs by the affinities is not provided",
    "enabled_hybrid_sharding": "hybrid prefill / decode sharding is Neuron inference; not provided",
    "expert_distribution": "expert_distribution places experts on expert-parallel ranks out of order or more than "
    "once; this view gives each ep rank its contiguous block of experts",
}


def _check_neuron_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - _NEURON_OPTIONS - set(_REFUSED_OPTIONS))
    if unknown:
        raise TypeError(f"ExpertMLPs got unexpected keyword arguments {unknown}")
    for name, why in _REFUSED_OPTIONS.items():
        if options.get(name):
            raise NotImplementedError(f"ExpertMLPs({name}=...): {why}")


class _ShareOfReplicated(torch.autograd.Function):
    """A replicated weight's ``1/tp`` share in a tp-partial sum (the sum over tp holds it once), with the grad of the
    whole weight: every rank's incoming grad is the same (the sum's grad reaches each rank whole), so passing it
    through unscaled is the sum of the ranks' shares' grads, and the replicas stay equal."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, tp: int) -> torch.Tensor:
        return weight / tp

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ExpertMLPs(nn.Module):
    """The routed experts' MLPs (see the module docstring); ``forward(hidden_states [T, H], expert_affinities
    [T, E], expert_index [T, k], seq_len)`` returns this rank's partial ``[T, H]`` output."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        glu_mlp: bool,
        capacity_factor: float | None,
        sequence_parallel_enabled: bool = False,
        block_size: int | None = None,
        normalize_top_k_affinities: bool = False,
        bias: bool = False,
        glu_type: GLUType | str | None = GLUType.GLU,
        hidden_act_scaling_factor: float = 1.0,
        hidden_act_bias: float = 0.0,
        gate_clamp_upper_limit: float | None = None,
        gate_clamp_lower_limit: float | None = None,
        up_clamp_upper_limit: float | None = None,
        up_clamp_lower_limit: float | None = None,
        return_bias: bool = False,
        init_method: Callable | None = nn.init.kaiming_uniform_,
        output_layer_init_method: Callable | None = nn.init.kaiming_uniform_,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tensor_model_parallel_group: Any = None,
        expert_model_parallel_group: Any = None,
        **neuron_kernel_options: Any,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"Invalid top_k={top_k} for num_experts={num_experts}")
        if hidden_act not in ACT2FN:
            raise ValueError(f"Unknown activation: {hidden_act} ; Supported: {list(ACT2FN)}")
        if normalize_top_k_affinities and top_k == 1:
            raise ValueError("top_k must be greater than 1 for normalizing top-k expert affinities")
        if return_bias:
            raise NotImplementedError("Returning bias is currently unsupported for MoE")
        _check_neuron_options(neuron_kernel_options)
        if capacity_factor is not None and (capacity_factor <= 0 or capacity_factor >= num_experts / top_k):
            capacity_factor = None  # blockwise (dropless) or a capacity no expert can exceed: nothing dropped
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.intermediate_size, self.hidden_act, self.glu_mlp = intermediate_size, hidden_act, glu_mlp
        self.capacity_factor, self.block_size = capacity_factor, block_size
        self.normalize_top_k_affinities, self.bias = normalize_top_k_affinities, bias
        self.glu_type = GLUType.validate(glu_type) if glu_mlp else glu_type
        self.hidden_act_scaling_factor, self.hidden_act_bias = hidden_act_scaling_factor, hidden_act_bias
        self.gate_limits = (gate_clamp_lower_limit, gate_clamp_upper_limit)
        self.up_limits = (up_clamp_lower_limit, up_clamp_upper_limit)
        self.sequence_parallel_enabled, self.return_bias = sequence_parallel_enabled, return_bias
        self.dtype, self.device = dtype, device
        self.tensor_parallel_group = (
            tensor_model_parallel_group
            if tensor_model_parallel_group is not None
            else parallel_state.get_tensor_model_parallel_group()
        )
        self.tp_mesh = group_mesh(self.tensor_parallel_group)
        # the state's ep group by default (None without expert parallelism: no one-rank groups made here, which
        # would be a collective call every rank must make, pipeline stages without MoE layers included)
        self.ep_mesh = expert_parallel_mesh(expert_model_parallel_group)
        self.expert_model_parallel_group = (
            self.ep_mesh.get_group() if self.ep_mesh is not None else expert_model_parallel_group
        )
        self.mlp_op = Experts(
            num_experts, hidden_size, intermediate_size, glu_mlp, ACT2FN[hidden_act], dtype, device, bias=bias,
            glu_type=glu_type, input_layer_init_method=init_method, output_layer_init_method=output_layer_init_method,
            tensor_model_parallel_group=self.tensor_parallel_group,
            expert_model_parallel_group=expert_model_parallel_group,
        )  # fmt: skip
        self.local_experts = slice(self.mlp_op.down_proj._experts.start, self.mlp_op.down_proj._experts.stop)

    # -- routing ------------------------------------------------------------------------------------------------
    @staticmethod
    def get_expert_mask(expert_index: torch.Tensor, num_experts: int) -> torch.Tensor:
        """``[T, E]``: 1 where the token chose the expert (a k-hot row per token)."""
        mask = torch.zeros(expert_index.shape[0], num_experts, dtype=torch.float64, device=expert_index.device)
        return mask.scatter_add_(1, expert_index, torch.ones_like(expert_index, dtype=torch.float64))

    @staticmethod
    def get_expert_affinities_masked(
        expert_affinities: torch.Tensor, expert_mask: torch.Tensor, normalize_top_k_affinities: bool
    ) -> torch.Tensor:
        """The affinities of the kept (token, expert) pairs, zero elsewhere (renormalised to sum 1 per token)."""
        masked = expert_affinities.masked_fill(expert_mask == 0, 0)
        if normalize_top_k_affinities:
            masked = masked / masked.abs().sum(dim=1, keepdim=True).clamp_min(1e-12)
        return masked

    def expert_capacity(self, total_tokens: int) -> int:
        if self.capacity_factor is None:
            return total_tokens
        wanted = math.ceil(total_tokens * self.top_k * self.capacity_factor / self.num_experts)
        return min(wanted, total_tokens)

    def _kept(self, expert_index: torch.Tensor, total_tokens: int) -> torch.Tensor:
        """The ``[T, E]`` mask of (token, expert) pairs that are computed: each expert's first ``C`` tokens."""
        mask = self.get_expert_mask(expert_index, self.num_experts)
        if self.capacity_factor is not None:
            position = mask.cumsum(dim=0)  # 1-based arrival order of each token at each expert
            mask = mask.masked_fill(position > self.expert_capacity(total_tokens), 0)
        return mask

    # -- the experts' MLPs ----------------------------------------------------------------------------------------
    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        glu_type = self.glu_type if self.glu_mlp else None
        return expert_activation(
            x, ACT2FN[self.hidden_act], glu_type, self.hidden_act_scaling_factor, self.hidden_act_bias,
            self.gate_limits, self.up_limits,
        )  # fmt: skip

    def _expert(self, e: int, tokens: torch.Tensor, down_bias: torch.Tensor | None) -> torch.Tensor:
        """Local expert ``e``'s partial output (this rank's intermediate slice) for ``tokens`` ``[n, H]``;
        ``down_bias``: the experts' ``1/tp`` shares of the output bias."""
        op = self.mlp_op
        up = op.gate_up_proj if self.glu_mlp else op.up_proj
        hidden = tokens @ up.weight[e]
        if up.bias is not None:
            hidden = hidden + up.bias[e]
        out = self._activation(hidden) @ op.down_proj.weight[e]
        return out + down_bias[e] if down_bias is not None else out

    def forward(
        self,
        hidden_states: torch.Tensor,
        expert_affinities: torch.Tensor,
        expert_index: torch.Tensor,
        seq_len: int | None = None,
        padding_mask: torch.Tensor | None = None,
        expert_affinities_masked_full: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's partial output ``[T, H]``: per token the affinity-weighted sum of its kept experts' outputs
        (``padding_mask`` ``[B, S]``: padded tokens' affinities zeroed)."""
        total = hidden_states.shape[0]
        kept = self._kept(expert_index, total)
        affinities = self.get_expert_affinities_masked(expert_affinities, kept, self.normalize_top_k_affinities)
        if padding_mask is not None:
            affinities = affinities * padding_mask.reshape(-1, 1).to(affinities.dtype)
        x = copy_to_tensor_model_parallel_region(hidden_states, self.tensor_parallel_group)
        # one route per (token, chosen expert); a dropped one goes nowhere (expert id E, the dispatcher's sentinel)
        route_kept = kept.gather(1, expert_index) > 0
        route_experts = torch.where(route_kept, expert_index, self.num_experts)
        route_weights = affinities.gather(1, expert_index).to(hidden_states.dtype)
        rows, local_ids, weights, routes = dispatch(
            x, route_experts, route_weights, num_experts=self.num_experts, ep_mesh=self.ep_mesh
        )
        down_bias = self.mlp_op.down_proj.bias
        if down_bias is not None:  # each expert's output bias, a 1/tp share on every rank (summed over tp later)
            down_bias = _ShareOfReplicated.apply(down_bias, self.tp_mesh.size())
        if rows.shape[0]:
            out = torch.zeros_like(rows)
            for e in range(self.local_experts.stop - self.local_experts.start):
                picked = (local_ids == e).nonzero().squeeze(1)
                if picked.numel():
                    out = out.index_add(0, picked, self._expert(e, rows[picked], down_bias) * weights[picked, None])
        else:  # no route reached this rank's experts: zero grads for them (every rank's grad reduction sees the
            # same parameters), and the empty rows and weights stay in the graph, as the all-to-alls' backwards are
            # collectives every ep rank must join
            out = experts_touched(rows + weights.unsqueeze(-1), list(self.mlp_op.parameters()))
        return combine(out, routes, self.ep_mesh)


__all__ = ["ExpertMLPs"]
