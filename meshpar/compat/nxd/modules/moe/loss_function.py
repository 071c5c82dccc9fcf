"""``neuronx_distributed.modules.moe.loss_function``: the Switch Transformer load-balancing loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def load_balancing_loss_func(router_logits: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """``(E / k) * sum_e f_e * P_e`` summed over the ``k`` routing slots: ``f_e`` the share of tokens whose slot
    picks expert ``e`` (top-k of the softmax), ``P_e`` the mean softmax probability of ``e``; ``router_logits``
    ``[tokens, E]`` (every layer's rows concatenated). Balanced routing gives 1 per slot."""
    probabilities = F.softmax(router_logits, dim=-1, dtype=torch.float64)
    chosen = probabilities.topk(top_k, dim=-1).indices  # [T, k]
    per_slot = F.one_hot(chosen, num_experts).to(torch.float32)  # [T, k, E]
    fraction = per_slot.mean(dim=0)  # [k, E]
    mean_probability = probabilities.to(torch.float32).mean(dim=0)  # [E]
    return (fraction * mean_probability).sum() * (num_experts / top_k)


__all__ = ["load_balancing_loss_func"]
