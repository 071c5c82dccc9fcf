"""``neuronx_distributed.modules.moe.token_shuffling``: tokens shuffled across a group of data-parallel ranks
before an MoE layer routes them, and brought back after (the BASE-layers load balancer: a rank's tokens come from
one sequence and are correlated, a mix from several ranks spreads over the experts more evenly).

``token_shuffle(hidden_states, seed)`` permutes this rank's ``[s0, s1, h]`` tokens at random and all-to-alls them in
equal parts within the token shuffle group (``parallel_state.initialize_token_shuffle_group``); it returns the
shuffled tokens and the permutation, which ``token_unshuffle`` takes to invert both steps. Every rank of a tensor-
parallel group uses the same permutation (drawn on its first rank and broadcast, or from ``seed``): the tp ranks must
move the same tokens, or their partial expert outputs would be summed across different tokens. Without a seed the
permutation is drawn from the default CPU generator, so an activation-checkpoint recompute draws it again the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from meshpar.compat.nxd.parallel_layers import mappings, parallel_state
from meshpar.expert_parallel import all_to_all


def _all_to_all_for_token_shuffle(x: Tensor, split_dim: int, concat_dim: int) -> Tensor:
    """``x`` cut into equal parts along ``split_dim``, part ``r`` sent to the group's rank ``r``, the received
    parts joined along ``concat_dim`` (differentiable; the identity at group size 1)."""
    size = parallel_state.get_token_shuffle_group_size()
    if size == 1:
        return x
    if x.shape[split_dim] % size != 0:
        raise ValueError(
            f"token shuffling: {x.shape[split_dim]} tokens do not split evenly over the shuffle group of {size}"
        )
    group = parallel_state.get_token_shuffle_group()
    moved = x.movedim(split_dim, 0).contiguous()
    part = moved.shape[0] // size
    received = all_to_all(moved, [part] * size, [part] * size, mappings.group_mesh(group))
    pieces = received.split(part, dim=0)
    return torch.cat([p.movedim(0, split_dim) for p in pieces], dim=concat_dim)


def all_to_all_for_shuffle(hidden_states: Tensor, input_is_sequence_parallel: bool = True) -> Tensor:
    """The rows of ``hidden_states`` exchanged in equal parts within the shuffle group. ``input_is_sequence_parallel``
    (NxD's default): each rank exchanges all of its rows; otherwise the tp ranks, which hold the same rows, each
    exchange their 1/tp of them and gather the results back."""
    if not input_is_sequence_parallel:
        hidden_states = mappings.scatter_to_sequence_parallel_region(hidden_states, 0)
    shuffled = _all_to_all_for_token_shuffle(hidden_states, 0, 0)
    if not input_is_sequence_parallel:
        shuffled = mappings.gather_from_sequence_parallel_region(shuffled, 0, to_model_parallel=False)
    return shuffled


def _permutation(count: int, device: torch.device, seed: int | None) -> Tensor:
    if seed is not None:
        permutation = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    else:
        permutation = torch.randperm(count)
    permutation = permutation.to(device)
    if parallel_state.get_tensor_model_parallel_size() > 1 and seed is None:
        group = parallel_state.get_tensor_model_parallel_group()
        dist.broadcast(permutation, src=dist.get_process_group_ranks(group)[0], group=group)
    return permutation


def token_shuffle(hidden_states: Tensor, seed: int | None = None) -> tuple[Tensor, Tensor]:
    """This rank's ``[s0, s1, h]`` tokens permuted and exchanged within the shuffle group: ``(shuffled tokens in the
    same shape, the permutation)``."""
    shape = hidden_states.shape
    if len(shape) != 3:
        raise ValueError(f"token_shuffle takes [s0, s1, h] hidden states, got shape {tuple(shape)}")
    rows = hidden_states.reshape(-1, shape[-1])
    permutation = _permutation(rows.shape[0], rows.device, seed)
    return all_to_all_for_shuffle(rows[permutation]).reshape(shape), permutation


def token_unshuffle(permuted_states: Tensor, permutation: Tensor) -> Tensor:
    """:func:`token_shuffle` undone: the rows exchanged back (the equal exchange is its own inverse), then put back
    in their original order."""
    shape = permuted_states.shape
    rows = all_to_all_for_shuffle(permuted_states.reshape(-1, shape[-1]))
    restored = torch.empty_like(rows).index_copy(0, permutation, rows)
    return restored.view(shape)


__all__ = ["all_to_all_for_shuffle", "token_shuffle", "token_unshuffle"]
