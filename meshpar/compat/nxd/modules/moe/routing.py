"""``neuronx_distributed.modules.moe.routing``: routers that pick each token's experts.

A router is a replicated ``linear_router`` (``[E, H]``) giving ``router_logits`` ``[T, E]`` for the flattened tokens,
the ``expert_affinities`` (softmax or sigmoid of the logits, ``[T, E]``) and the ``expert_index`` (``[T, k]``).
Under sequence parallelism each rank scores its own tokens and the logits are gathered, so every rank returns all
tokens' rows (in training and evaluation alike: NxD's inference path gathers later, to the same result); the
router's weight grad is then partial per rank and is marked ``sequence_parallel_enabled`` for NxD's tp sum.
:class:`RouterTopK` takes the ``k`` largest logits (``apply_act_fn_over_topk``: the activation over those ``k`` only,
zero elsewhere); :class:`RouterSinkhorn` (top-1) picks by a fixed number of Sinkhorn balancing iterations while
training and by the logits otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshpar.compat.nxd.parallel_layers import mappings, parallel_state


class RouterBase(nn.Module, ABC):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        act_fn: str,
        sequence_parallel_enabled: bool,
        sequence_dimension: int | None,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
        tensor_model_parallel_group: Any = None,
        jitter_eps: float = 0.0,
        store_transposed_weights: bool = False,
        apply_act_fn_over_topk: bool = False,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"Invalid top_k={top_k} for num_experts={num_experts}")
        if act_fn not in ("sigmoid", "softmax"):
            raise ValueError("act_fn must be either 'sigmoid' or 'softmax'")
        if store_transposed_weights:
            raise NotImplementedError("store_transposed_weights is a Neuron inference layout; not provided")
        self.num_experts, self.top_k, self.hidden_size, self.act_fn = num_experts, top_k, hidden_size, act_fn
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_parallel_enabled and sequence_dimension is None else sequence_dimension
        self.dtype, self.device, self.bias = dtype, device, bias
        self.jitter_eps, self.store_transposed_weights = jitter_eps, store_transposed_weights
        self.apply_act_fn_over_topk = apply_act_fn_over_topk
        self.tensor_parallel_group = (
            tensor_model_parallel_group
            if tensor_model_parallel_group is not None
            else parallel_state.get_tensor_model_parallel_group()
        )
        self.linear_router = nn.Linear(hidden_size, num_experts, bias=bias, dtype=dtype, device=device)
        self.linear_router.weight.sequence_parallel_enabled = sequence_parallel_enabled
        if bias:
            self.linear_router.bias.sequence_parallel_enabled = sequence_parallel_enabled

    def get_router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` logits of every token (gathered over tp when this rank holds a sequence shard)."""
        x = hidden_states.to(self.linear_router.weight.dtype)
        if self.jitter_eps != 0.0 and self.training:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
        logits = self.linear_router(x)
        if self.sequence_parallel_enabled:
            logits = mappings.gather_from_sequence_parallel_region(
                logits, self.sequence_dimension, to_model_parallel=False, process_group=self.tensor_parallel_group
            )
        return logits.reshape(-1, self.num_experts)

    def apply_activation_fn(self, weights: torch.Tensor) -> torch.Tensor:
        if self.act_fn == "sigmoid":
            return torch.sigmoid(weights.to(torch.float64))
        return F.softmax(weights, dim=1, dtype=torch.float64)

    @abstractmethod
    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(router_logits [T, E], expert_affinities [T, E], expert_index [T, k])``."""


class RouterTopK(RouterBase):
    """Top-``k`` routing (no balancing of its own: train it with ``load_balancing_loss_func``)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        bias: bool = False,
        tensor_model_parallel_group: Any = None,
        act_fn: str = "softmax",
        apply_act_fn_over_topk: bool = False,
        jitter_eps: float = 0.0,
        store_transposed_weights: bool = False,
    ) -> None:
        super().__init__(
            num_experts, top_k, hidden_size, act_fn, sequence_parallel_enabled, sequence_dimension, dtype, device,
            bias=bias, tensor_model_parallel_group=tensor_model_parallel_group, jitter_eps=jitter_eps,
            store_transposed_weights=store_transposed_weights, apply_act_fn_over_topk=apply_act_fn_over_topk,
        )  # fmt: skip

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.get_router_logits(hidden_states)
        if self.apply_act_fn_over_topk:
            top, index = logits.to(torch.float64).topk(self.top_k, dim=1)
            affinities = torch.zeros_like(logits, dtype=torch.float64).scatter(1, index, self.apply_activation_fn(top))
        else:
            affinities = self.apply_activation_fn(logits)
            index = logits.topk(self.top_k, dim=1).indices
        return logits, affinities.to(hidden_states.dtype), index.detach().long()


class RouterSinkhorn(RouterBase):
    """Top-1 routing balanced by ``sinkhorn_iterations`` Sinkhorn steps while training (``sinkhorn_tol``: assert
    the last step changed the column scaling by less)."""

    DEFAULT_SINKHORN_ITERS = 30

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        act_fn: str = "sigmoid",
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sinkhorn_iterations: int | None = None,
        sinkhorn_tol: float | None = None,
    ) -> None:
        if top_k != 1:
            raise NotImplementedError("RouterSinkhorn only supports Top-1 routing")
        super().__init__(
            num_experts, top_k, hidden_size, act_fn, sequence_parallel_enabled, sequence_dimension, dtype, device
        )
        self.sinkhorn_iterations = self.DEFAULT_SINKHORN_ITERS if sinkhorn_iterations is None else sinkhorn_iterations
        self.sinkhorn_tol = sinkhorn_tol

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.get_router_logits(hidden_states)
        affinities = self.apply_activation_fn(logits).to(hidden_states.dtype)
        with torch.no_grad():
            scores = logits.detach()
            if self.training:
                scores = self._sinkhorn(scores.float(), self.sinkhorn_iterations, self.sinkhorn_tol)
            index = scores.argmax(dim=1, keepdim=True)
        return logits, affinities, index.long()

    @staticmethod
    def _sinkhorn(cost: torch.Tensor, num_iters: int, tol: float | None = None) -> torch.Tensor:
        """``exp(cost)`` scaled by row factors ``r`` and column factors ``c`` alternately fitted so rows sum to
        ``1 / T`` and columns to ``1 / E`` (a fixed number of steps, as a compiled graph needs)."""
        if num_iters == 0:
            return cost
        weights = cost.exp()
        tokens, experts = weights.shape
        rows = torch.ones(tokens, dtype=weights.dtype, device=weights.device)
        cols = torch.ones(experts, dtype=weights.dtype, device=weights.device)
        change = torch.tensor(float("inf"))
        for _ in range(num_iters):
            rows = 1.0 / (tokens * ((weights * cols).sum(dim=1) + 1e-8))
            new_cols = 1.0 / (experts * ((weights * rows.unsqueeze(1)).sum(dim=0) + 1e-8))
            change, cols = (new_cols - cols).abs().mean(), new_cols
        if tol is not None and float(change) >= tol:
            raise AssertionError(f"Sinkhorn error {float(change)} exceeds tolerance {tol}")
        return weights * cols * rows.unsqueeze(1)


__all__ = ["RouterBase", "RouterSinkhorn", "RouterTopK"]
