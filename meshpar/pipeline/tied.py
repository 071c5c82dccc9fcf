"""Weights a model uses in two places (a tied input embedding and LM head), kept one weight across pipeline stages.

Splitting a model into stages gives each stage its own copy of a weight the model ties: the first stage's
embedding and the last stage's head then hold two parameters where the dense model has one. The dense grad of that
one weight is the sum of its uses' grads, so every copy must get that sum, or the copies drift apart and train a
different model (silently: each stage's loss still goes down). :class:`TiedCopies` finds this rank's copies of each
tied group by name (stages keep the original FQNs), makes a process group of the pipeline ranks holding copies
(per data-, context- and tensor-parallel position), starts every copy from the first holder's values, and after
each backward sums the copies' grads (on this rank and over that group) into each copy. Grad norms count each
weight once (:func:`meshpar.grad_clip.mark_shared_copy` on every copy but the first holder's), as Megatron counts
its embedding once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from meshpar._compat import local_tensor
from meshpar.grad_clip import mark_shared_copy
from meshpar.parallel_dims import ParallelDims
from meshpar.recipe import has_parameter


def tied_parameter_groups(model: nn.Module) -> list[list[str]]:
    """The FQN groups that name one parameter object of ``model`` (each of two names or more, sorted; the groups in
    order of their first name): what a split must keep one weight."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


def merged_groups(groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """``groups`` with every two that share a name merged into one (a weight tied in the model and also marked
    shared by hand is one group), sorted as :func:`tied_parameter_groups` sorts them."""
    merged: list[set[str]] = []
    for group in groups:
        joined = set(group)
        for other in [m for m in merged if m & joined]:
            joined |= other
            merged.remove(other)
        merged.append(joined)
    return sorted(sorted(group) for group in merged if len(group) > 1)


class TiedCopies:
    """This rank's copies of each tied group in ``stages`` (this rank's stage modules, original FQNs) and the group
    of pipeline ranks that hold copies of it. Building it is a collective over the world (every rank learns which
    pipeline ranks hold which groups, and every rank takes part in every new process group)."""

    def __init__(self, groups: Sequence[Sequence[str]], stages: Sequence[nn.Module], dims: ParallelDims) -> None:
        self.names = [list(group) for group in groups]
        self.copies: list[list[nn.Parameter]] = []
        for group in self.names:
            found = [stage.get_parameter(n) for stage in stages for n in group if has_parameter(stage, n)]
            self.copies.append(list({id(p): p for p in found}.values()))  # one object reached by two names: one copy
        # group index -> the process group of this rank's pipeline ranks holding copies (two ranks or more)
        self.process_groups: dict[int, dist.ProcessGroup] = {}
        first_holder: dict[int, bool] = {i: bool(copies) for i, copies in enumerate(self.copies)}
        if self.names and dims.pp > 1:
            held = [i for i, copies in enumerate(self.copies) if copies]
            everyone: list[list[int] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, held)
            me = dist.get_rank()
            for index in range(len(self.names)):
                for ranks in dims.group_ranks("pp"):  # same order on every rank: each new_group is collective
                    holders = [r for r in ranks if index in everyone[r]]
                    if len(holders) < 2:
                        continue
                    group = dist.new_group(holders)
                    if me in holders:
                        self.process_groups[index] = group
                        first_holder[index] = me == holders[0]
        for index, copies in enumerate(self.copies):
            for position, param in enumerate(copies):
                if position > 0 or not first_holder[index]:
                    mark_shared_copy(param)
        self.copy_first_values()

    @property
    def crosses_ranks(self) -> bool:
        """Whether a tied group has copies on more than one pipeline rank."""
        return bool(self.process_groups)

    @property
    def sums_grads(self) -> bool:
        """Whether :meth:`sum_grads` has work: a group with two copies on this rank or copies on other ranks."""
        return self.crosses_ranks or any(len(copies) > 1 for copies in self.copies)

    @torch.no_grad()
    def copy_first_values(self) -> None:
        """Every copy takes the first holder's values (each stage of a model built on meta initialised its own)."""
        for index, copies in enumerate(self.copies):
            if not copies:
                continue
            group = self.process_groups.get(index)
            if group is not None:
                dist.broadcast(local_tensor(copies[0]), group=group, group_src=0)
            for param in copies[1:]:
                local_tensor(param).copy_(local_tensor(copies[0]))

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Each copy's grad becomes the sum of all copies' grads: the dense grad of the one weight (a copy whose
        stage did not use it counts zero). Linear, so before or after the data-parallel mean alike."""
        for index, copies in enumerate(self.copies):
            group = self.process_groups.get(index)
            if len(copies) < 2 and group is None:
                continue
            total = sum((p.grad if p.grad is not None else torch.zeros_like(p) for p in copies[1:]),
                        copies[0].grad if copies[0].grad is not None else torch.zeros_like(copies[0]))  # fmt: skip
            total = total.clone() if total is copies[0].grad else total
            if group is not None:
                dist.all_reduce(local_tensor(total), group=group)
            for position, param in enumerate(copies):
                param.grad = total if position == 0 else total.clone()  # own tensors: in-place scaling hits one
