"""``"meshpar_grouped_mm"``: an experts implementation for transformers' mixture-of-experts families that runs each
projection as one :func:`meshpar.ops.grouped_mm` (Triton on CUDA, a per-expert loop on CPU).

transformers dispatches an experts module's forward by ``config._experts_implementation`` through its
``ExpertsInterface`` (``"eager"``, ``"grouped_mm"``, ``"batched_mm"``, ...); importing :mod:`meshpar.hf` registers
this one there, so ``model.set_experts_implementation("meshpar_grouped_mm")`` selects it, before or after
``meshpar.parallelize`` (under expert parallelism meshpar calls the family's forward on the rows and the local
experts each rank holds, so this forward runs there unchanged). It follows the family's declared layout as
transformers' own grouped forward does (gate and up stacked or not, weights stored transposed, biases, the family's
gating, a post-expert norm); the token-expert pairs are sorted by expert, and an expert-parallel rank's pairs for
experts it does not hold (ids at or past ``num_experts``) go last and contribute nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from meshpar.ops import grouped_mm

NAME = "meshpar_grouped_mm"


def _projection(module: nn.Module, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows @ w[e]`` per group: ``w`` stored ``[E, in, out]`` when the family keeps it transposed, else
    ``[E, out, in]`` (read transposed through its strides, not copied)."""
    return grouped_mm(rows, weight if module.is_transposed else weight.transpose(1, 2), offsets)


def grouped_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output for ``hidden_states [T, H]`` routed to ``top_k_index [T, k]`` with ``top_k_weights``."""
    tokens, top_k = top_k_index.shape
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    rows = hidden_states[order // top_k]
    held = expert_ids < self.num_experts  # False only for an expert-parallel rank's pairs of experts it lacks
    counts = torch.bincount(expert_ids, minlength=self.num_experts)[: self.num_experts]
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    # in range for the bias lookup; those pairs' rows lie past offsets[-1] (grouped_mm: zero) and their weight is zeroed
    expert_ids = expert_ids.clamp(max=self.num_experts - 1)

    up_weight, up_bias = (
        (self.gate_up_proj, getattr(self, "gate_up_proj_bias", None))
        if self.has_gate
        else (self.up_proj, getattr(self, "up_proj_bias", None))
    )
    hidden = _projection(self, rows, up_weight, offsets)
    if self.has_bias and up_bias is not None:
        hidden = hidden + up_bias[expert_ids]
    hidden = self._apply_gate(hidden) if self.has_gate else self.act_fn(hidden)
    out = _projection(self, hidden, self.down_proj, offsets)
    if self.has_bias and getattr(self, "down_proj_bias", None) is not None:
        out = out + self.down_proj_bias[expert_ids]
    if getattr(self, "has_post_expert_norm", False):  # older transformers (5.17) have none
        out = self.post_expert_norm(out)
    routed_weights = top_k_weights.reshape(-1)[order] * held.to(top_k_weights.dtype)
    out = out * routed_weights.unsqueeze(-1).to(out.dtype)
    unsorted = torch.empty_like(out).index_copy_(0, order, out)
    return unsorted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def register() -> None:
    """Make ``"meshpar_grouped_mm"`` an experts implementation transformers knows (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(NAME, grouped_experts_forward)
