"""The routers' load-balancing loss of HF mixture-of-experts models, over the global batch.

With ``output_router_logits`` a transformers MoE causal LM adds ``router_aux_loss_coef`` times Switch Transformers'
load-balancing loss to its loss: ``E * sum_e f_e * P_e``, where over every router and every (unpadded) token ``f_e``
is the share of top-k assignments that went to expert ``e`` and ``P_e`` its mean routing probability. It is not a
mean of per-token terms, so the mean of each dp replica's own value is not the global batch's. Here the assignment
counts and token counts are summed over dp (they carry no grad), and each replica scores its own probabilities
against them: the replicas' values average to the global loss, and each one's grads are its exact share.

Under context parallelism each cp rank routes its own chunks' tokens: the counts are summed over dp x cp, each rank
scores its tokens' probabilities (padding masked by the whole sequence's padding mask, cut to the rank's chunks), and
the cp ranks' shares sum to their replica's.

The formula is checked once against the model's own loss on its own outputs (``output.aux_loss``); a family whose
auxiliary loss it does not reproduce is refused, never approximated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar.hf.hf_plan import expert_count, text_config
from meshpar.parallel_dims import ParallelDims


def check_router_loss_layout(model: nn.Module, pp: int, sequence_parallel: bool) -> None:
    """The global load-balancing loss is built from the router logits of one whole forward of this replica's batch
    (or of its cp ranks' chunks; pp = 1, whole sequences or chunks on every tp rank); elsewhere a model that asks for
    it is refused before any step."""
    split = pp > 1 or sequence_parallel
    if not getattr(text_config(model.config), "output_router_logits", False) or not split:
        return
    where = "pipeline_parallel_size > 1" if pp > 1 else "sequence_parallel"
    raise ValueError(
        f"{type(model).__name__} adds the routers' load-balancing loss (output_router_logits=True), which meshpar "
        f"computes over the global batch only without {where}; set config.output_router_logits=False (the loss "
        "then leaves it out) or use another layout"
    )


def router_loss_wanted(output: Any) -> bool:
    """Whether the model computed a load-balancing loss (``output_router_logits`` was on)."""
    return getattr(output, "aux_loss", None) is not None and isinstance(getattr(output, "router_logits", None), tuple)


def _sums(
    router_logits: tuple[torch.Tensor, ...], experts: int, top_k: int, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k assignments per expert, routing probability per expert, tokens), summed over routers and the
    unpadded tokens of this batch; only the probabilities carry grad."""
    assigned = router_logits[0].new_zeros(experts, dtype=torch.float32)
    probs = router_logits[0].new_zeros(experts, dtype=torch.float32)
    tokens = router_logits[0].new_zeros((), dtype=torch.float32)
    weight = None if mask is None else mask.reshape(-1).to(device=assigned.device, dtype=torch.float32)
    for logits in router_logits:
        routing = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(routing, top_k, dim=-1).indices
        rows = torch.ones(routing.shape[0], device=routing.device) if weight is None else weight
        assigned = assigned.index_add(0, chosen.reshape(-1), rows.repeat_interleave(top_k).detach())
        probs = probs + (routing * rows.unsqueeze(-1)).sum(0)
        tokens = tokens + rows.sum()
    return assigned.detach(), probs, tokens.detach()


def _balance(assigned: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor, experts: int) -> torch.Tensor:
    return experts * (assigned / tokens * probs / tokens).sum()


class RouterLoss:
    """``coef * load-balancing loss`` of one model, this replica's share of the global batch's (see the module
    docstring)."""

    def __init__(self, model: nn.Module) -> None:
        text = text_config(model.config)
        self.experts = expert_count(model.config)
        self.top_k = getattr(text, "num_experts_per_tok", None)
        self.coef = getattr(model, "router_aux_loss_coef", getattr(text, "router_aux_loss_coef", None))
        self.family = type(model).__name__
        self.checked = False

    def __call__(
        self,
        output: Any,
        attention_mask: torch.Tensor | None,
        dims: ParallelDims,
        scored: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's share; ``attention_mask``: what the model's forward was given (its own loss used it),
        ``scored``: which of this rank's tokens count when that is not the mask (cp: the padding of its chunks)."""
        if self.experts is None or self.top_k is None or self.coef is None:
            raise ValueError(
                f"{self.family} returned a router auxiliary loss, but meshpar cannot read its experts, top-k or "
                "coefficient from the config to compute it over the global batch; set output_router_logits=False"
            )
        assigned, probs, tokens = _sums(output.router_logits, self.experts, self.top_k, attention_mask)
        if not self.checked:  # the model's own value on this rank's batch: the formula must reproduce it
            own = _balance(assigned, probs, tokens, self.experts).detach()
            if not torch.allclose(own, output.aux_loss.detach().float(), rtol=1e-4, atol=1e-6):
                raise ValueError(
                    f"{self.family}'s router auxiliary loss ({float(output.aux_loss):.6g}) is not the Switch "
                    f"load-balancing loss meshpar makes global ({float(own):.6g}); set output_router_logits=False"
                )
            self.checked = True
        if scored is not None:
            assigned, probs, tokens = _sums(output.router_logits, self.experts, self.top_k, scored)
        if dims.dp > 1 or dims.cp > 1:
            counts = torch.cat([assigned, tokens.reshape(1)])
            dist.all_reduce(counts, group=dims.grad_mesh.get_group())
            assigned, tokens = counts[:-1], counts[-1]
        # grads are summed over dp x cp and divided by dp afterwards: dp times each rank's share, so the result is the
        # global value
        return self.coef * dims.dp * _balance(assigned, probs, tokens.clamp(min=1), self.experts)
