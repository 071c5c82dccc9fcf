"""Mixture-of-experts layers under tensor parallelism: whole experts per tp rank.

transformers' ``moe_tp_experts`` style splits every expert's features over tp, with the fused gate/up weights in a
strided layout (``_StridedShard``) that torch 2.13's DCP cannot save ("overlapping chunks"). meshpar shards the
experts module's 3-D weights ``[num_experts, ...]`` over their first dim instead (``Shard(0)``, the model's own
shapes and FQNs, so checkpoints reshard like any other parameter): each rank keeps ``num_experts / tp`` whole experts
and runs the tokens routed to them; every token is on every tp rank, so the partial outputs summed over tp are the
dense output. Forward: one all-reduce of the output; backward: one of the input grad and one of the routing weights'
grad (the router stays replicated). Each rank picks the routes to its own experts and runs them, one route per row,
through the family's own experts forward (:func:`meshpar.expert_parallel.dispatch`; under expert parallelism the
routes travel to the ep rank holding their expert first), so no forward ever sees an expert it does not hold.
With ``expert_tensor_parallel_size`` 1 (``ExpertsOverTP(split_over_tp=False)``) every tp rank holds all of its ep
rank's experts and routes every tp-th token instead, the experts' grads summed over tp in backward. Experts handed one
block of tokens per expert instead of routes (Llama-4) run their own blocks, all-gathered back in expert order.
Identity ("zero-computation") experts (LongCat-Flash: routed after the real ones, with rows in the fused gate/up
weight only, which its forward never reads) run on the rank their tokens are on, never sent anywhere; that weight is
kept as one group per rank of its real experts' rows and an equal share of the identity rows
(:class:`meshpar._stored_layout.GroupedRows`, the model's shape in checkpoints). Where the identity experts do not
split evenly over the ranks, tensor parallelism alone splits every expert by features instead, each packed weight
per part (see :class:`ExpertsOverTP`); expert parallelism refuses.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from meshpar._compat import DeviceMesh, ParallelStyle, Replicate, Shard
from meshpar._in_place import mix_into
from meshpar._stored_layout import GroupedRows
from meshpar.expert_parallel import capacity_keep, combine, dispatch, experts_touched, without_dropped
from meshpar.hf.capacity import TokenLayout, dense_token_order
from meshpar.parallel_dims import ParallelDims
from meshpar.tensor_parallel._collectives import (
    all_gather,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from meshpar.tensor_parallel.layers import distribute_parameter, parameters_replaced
from meshpar.tensor_parallel.style import LocalParameters


class _LocalExperts:
    """Mixin for a transformers experts module whose expert weights are ``Shard(0)`` DTensors over tp, or over
    ``("ep", "tp")`` under expert parallelism (``ep_mesh`` set: routes travel by all-to-all,
    :mod:`meshpar.expert_parallel`)."""

    tp_mesh: DeviceMesh
    ep_mesh: DeviceMesh | None
    takes_blocks: bool  # the family's forward takes one block of tokens per expert (Llama-4), not routes
    # experts split over tp (each tp rank 1/tp of the ep rank's), or whole on every tp rank with the tokens split
    split_over_tp: bool
    capacity: tuple[float, str] | None  # (capacity factor, drop policy), see ExpertsOverTP
    num_experts: int
    # tokens arrive as sequence shards (sequence parallelism): gathered on entry, the output reduce-scattered back
    sequence_parallel: bool
    # token dropping under sequence or context parallelism: the layer's input grid of this forward, recorded by a
    # pre-hook on the layer (meshpar.hf.capacity.record_token_layouts)
    token_layout_recorded: bool = False
    token_layout: TokenLayout | None = None
    # identity experts (ids num_experts .. num_experts + identity_experts - 1), run where their tokens are; the
    # weights that also hold their rows (GroupedRows), by name: how many of each group's rows are real experts'
    identity_experts: int = 0
    routed_slots: dict[str, int]

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
    ) -> object:
        if top_k_index is None:
            if self.sequence_parallel:
                raise NotImplementedError(
                    f"{type(self).__name__}: experts handed blocks of tokens per expert under sequence parallelism; "
                    "turn 'sequence_parallel' off"
                )
            return self._forward_blocks(hidden_states) if self.ep_mesh is None else self._route_blocks(hidden_states)
        mesh = self.tp_mesh
        order, cp_mesh = None, None
        if self.capacity is not None and self.token_layout_recorded:  # out of the dense order: meshpar.hf.capacity
            # (the layout is kept after use: a recomputing backward runs the experts again without their layer's hooks)
            rows, device = hidden_states.shape[0], hidden_states.device
            order = dense_token_order(self.token_layout, rows, mesh, self.sequence_parallel, device)
            cp_mesh = self.token_layout.cp_mesh
        if self.sequence_parallel:  # per-token inputs: any dim-0 order works if the output is scattered back alike
            hidden_states = gather_from_sp(hidden_states, mesh, 0)
            top_k_weights = gather_from_sp(top_k_weights, mesh, 0)
            top_k_index = all_gather(top_k_index, mesh, 0)
            order = all_gather(order, mesh, 0) if order is not None else None
        else:
            hidden_states, top_k_weights = copy_to_tp(hidden_states, mesh), copy_to_tp(top_k_weights, mesh)
        if self.capacity is not None:  # on every tp rank alike: the same tokens, the same routes
            top_k_index, top_k_weights = self._drop_over_capacity(top_k_index, top_k_weights, order, cp_mesh)
        out = self._forward_routed(hidden_states, top_k_index, top_k_weights)
        return reduce_scatter_to_sp(out, mesh, 0) if self.sequence_parallel else reduce_from_tp(out, mesh)

    def _drop_over_capacity(
        self, index: torch.Tensor, weights: torch.Tensor, order: torch.Tensor | None, cp_mesh: DeviceMesh | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routes past their expert's capacity sent nowhere, decided over one forward of the replica's tokens
        in the dense order: this cp rank's chunks decide with the other cp ranks' routes (gathered; no grad flows
        through the decision)."""
        if cp_mesh is None:
            keep = capacity_keep(index, weights, self.num_experts, *self.capacity, order)
        else:
            rows, rank = index.shape[0], cp_mesh.get_local_rank()
            keep = capacity_keep(
                all_gather(index, cp_mesh, 0),
                all_gather(weights.detach(), cp_mesh, 0),
                self.num_experts,
                *self.capacity,
                all_gather(order, cp_mesh, 0),
            )[rank * rows : (rank + 1) * rows]
        return without_dropped(index, weights, keep, self.num_experts)

    def _forward_routed(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial output: the routes to its experts (those of its tp coordinate; under expert
        parallelism sent to the ep ranks holding them and back, :mod:`meshpar.expert_parallel`) run as one route per
        row through the model's own experts forward (each row's weight applied as the model applies it), summed per
        token. No route names an expert the rank does not hold, so any forward of the family works as written."""
        ep_mesh, tp_mesh = self.ep_mesh, self.tp_mesh
        ep = ep_mesh.size() if ep_mesh is not None else 1
        shards = {name: p.to_local() for name, p in self._parameters.items() if p is not None}
        tokens, all_tokens = None, hidden_states.shape[0]
        tp, tp_rank = (tp_mesh.size(), tp_mesh.get_local_rank()) if self.split_over_tp else (1, 0)
        if not self.split_over_tp and tp_mesh.size() > 1:
            # every expert of the ep rank here: this tp rank routes every tp-th token; each expert's grads are summed
            # over tp (the other tokens' share) inside backward, before any dp reduction or optimizer sees them
            tokens = torch.arange(tp_mesh.get_local_rank(), all_tokens, tp_mesh.size(), device=hidden_states.device)
            hidden_states, top_k_index, top_k_weights = (
                hidden_states[tokens],
                top_k_index[tokens],
                top_k_weights[tokens],
            )
            shards = dict(zip(shards, _GradsSummedOverTP.apply(tp_mesh, *shards.values()), strict=True))
        # a weight that also holds identity experts' rows: the forward gets its real experts' rows only
        slots = self.routed_slots
        shards = {n: s[:, : slots[n]].flatten(0, 1) if n in slots else s for n, s in shards.items()}
        rows, local_index, weights, routes = dispatch(
            hidden_states, top_k_index, top_k_weights, num_experts=self.num_experts, ep_mesh=ep_mesh,
            tp_rank=tp_rank, tp=tp,
        )  # fmt: skip
        local = self.num_experts // (ep * tp)
        if rows.shape[0]:
            out = self._local_forward(rows, local_index.unsqueeze(-1), weights.unsqueeze(-1), local, shards)
        else:  # no route reached this rank's experts: their grads are zeros, as the dense model's rows of them
            # the empty rows and weights stay in the graph: their all-to-alls' backwards are collectives every ep
            # rank must join, even with nothing to send
            empty = rows + weights.unsqueeze(-1).to(rows.dtype)
            out = experts_touched(empty, list(shards.values()))
        out = combine(out, routes, ep_mesh)
        if self.identity_experts and tp_rank == 0:  # once per token: the first tp coordinate (or this rank's share)
            out = out + self._identity_forward(hidden_states, top_k_index, top_k_weights)
        if tokens is None:
            return out
        return out.new_zeros((all_tokens, *out.shape[1:])).index_copy(0, tokens, out)  # the others': summed over tp

    def _local_forward(
        self,
        rows: torch.Tensor,
        local_index: torch.Tensor,
        weights: torch.Tensor,
        local: int,
        shards: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The model's own experts forward on this rank's ``local`` experts (their weights ``shards``), for rows of
        one route each."""
        if self.takes_blocks:  # the rows came weighted (weights of one): used anyway, as the routed forwards use them
            return self._local_blocks_forward(rows * weights.to(rows.dtype), local_index.squeeze(-1), local, shards)
        return self._own_forward(local, shards, rows, local_index, weights)

    def _identity_forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The identity experts' (weighted) output per token, computed here by the family's own forward on their
        routes alone, one route per row (it reads no weight for them): nothing to send, nothing to hold."""
        k, flat = top_k_index.shape[-1], top_k_index.reshape(-1)
        picked = torch.nonzero(flat >= self.num_experts).squeeze(-1)
        tokens = picked // k
        rows, ids = hidden_states[tokens], (flat[picked] - self.num_experts).unsqueeze(-1)
        weights = top_k_weights.reshape(-1)[picked].unsqueeze(-1)
        out = self._own_forward(0, {}, rows, ids, weights, identity=self.identity_experts)
        return out.new_zeros((hidden_states.shape[0], *out.shape[1:])).index_add(0, tokens, out)

    def _own_forward(
        self, local: int, shards: dict[str, torch.Tensor], *args: torch.Tensor, identity: int = 0
    ) -> torch.Tensor:
        """The family's own experts forward as if the module held ``local`` experts (the weights ``shards``) and
        ``identity`` identity experts after them."""
        counts = {"num_experts": local}
        if self.identity_experts:  # LongCat-Flash's names for its counts
            # its forward squeezes the routes dim of one expert's mask, which fails for one route per row: each row
            # also gets a route of weight 0 to an identity expert, which adds exactly nothing
            rows, index, weights = args
            identity = max(identity, 1)
            args = (rows, torch.cat([index, torch.full_like(index, local)], -1), torch.cat([weights, weights * 0], -1))
            counts.update(num_routed_experts=local, total_experts=local + identity, zero_expert_num=identity)
        previous = {name: getattr(self, name) for name in counts}
        try:
            for name, value in counts.items():
                setattr(self, name, value)
            with parameters_replaced(self, shards):
                return super().forward(*args)  # type: ignore[misc]
        finally:
            for name, value in previous.items():
                setattr(self, name, value)

    def _route_blocks(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Experts handed one block of (already weighted) tokens per expert, under expert parallelism: each non-zero
        row is a route (its expert, weight 1) and travels as the routed families' routes do; the zero rows (the
        experts a token was not routed to) stay, their output zero. Exact because such a forward maps a zero row to
        zero with a zero grad (checked on the family when sharded: :func:`_zero_rows_inert`)."""
        width = hidden_states.shape[-1]
        blocks = copy_to_tp(hidden_states, self.tp_mesh).view(self.num_experts, -1, width)
        experts, tokens = blocks.detach().ne(0).any(-1).nonzero(as_tuple=True)
        rows = blocks[experts, tokens]
        out = self._forward_routed(rows, experts.unsqueeze(-1), rows.new_ones((rows.shape[0], 1)))
        whole = out.new_zeros((self.num_experts, blocks.shape[1], out.shape[-1])).index_put((experts, tokens), out)
        return reduce_from_tp(whole.view(-1, out.shape[-1]), self.tp_mesh)

    def _local_blocks_forward(
        self, rows: torch.Tensor, local_index: torch.Tensor, local: int, shards: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """A blocks-per-expert forward on routed rows: each local expert's rows into one block, the blocks padded
        with zero rows to the longest (inert, see :meth:`_route_blocks`), the rows' outputs taken back in order."""
        order = torch.argsort(local_index, stable=True)
        counts = torch.bincount(local_index, minlength=local)
        slot = torch.arange(rows.shape[0], device=rows.device) - (torch.cumsum(counts, 0) - counts)[local_index[order]]
        expert = local_index[order]
        blocks = rows.new_zeros((local, int(counts.max()), rows.shape[-1])).index_put((expert, slot), rows[order])
        out = self._own_forward(local, shards, blocks.reshape(-1, rows.shape[-1]))
        picked = out.view(local, blocks.shape[1], -1)[expert, slot]
        return picked.new_zeros(picked.shape).index_copy(0, order, picked)

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
        out = self._own_forward(local, shards, blocks[start : start + local].reshape(-1, width))
        return gather_from_tp(out.view(local, -1, out.shape[-1]), mesh, 0).reshape(-1, out.shape[-1])


class _GradsSummedOverTP(torch.autograd.Function):
    """Identity on expert weights held whole by every tp rank; backward sums their grads over tp in one flat
    all-reduce (each tp rank ran its share of the tokens). One per MoE layer and forward, on every tp rank alike."""

    @staticmethod
    def forward(ctx: object, mesh: DeviceMesh, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.mesh, ctx.like = mesh, [(w.shape, w.dtype, w.device) for w in weights]
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx: object, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # a weight the family's forward left unused has no grad here: zeros (the same flat layout on every tp rank)
        grads = [
            g if g is not None else torch.zeros(s, dtype=t, device=d)
            for g, (s, t, d) in zip(grads, ctx.like, strict=True)
        ]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=ctx.mesh.get_group())
        parts = flat.split([g.numel() for g in grads])
        return (None, *(part.view_as(g) for part, g in zip(parts, grads, strict=True)))


class ExpertsOverTP(ParallelStyle):
    """Shard a transformers experts module (3-D expert weights, ``forward(hidden, top_k_index, top_k_weights)``)
    into whole experts per tp rank; see the module docstring.

    ``features`` (the plan's entries for the module's weights: parameter name -> ``(dim, parts)``, ``None`` where the
    plan's style gives no feature split) is the layout for experts that cannot be split into whole experts under
    tensor parallelism alone: LongCat-Flash's when its identity ("zero-computation") experts, whose rows its fused
    gate/up weight holds too, do not split evenly over tp. Then every rank keeps
    every expert with ``1 / tp`` of its intermediate features (transformers' ``moe_tp_experts`` meaning): the output
    is a partial sum, all-reduced (:class:`meshpar.tensor_parallel.style.LocalParameters` with ``partial_output``),
    and the identity experts' output is divided by tp inside it, so that the sum counts it once."""

    def __init__(
        self,
        features: dict[str, tuple[int, int] | None] | None = None,
        *,
        sequence_parallel: bool = False,
        capacity_factor: float | None = None,
        drop_policy: str = "probs",
        split_over_tp: bool = True,
    ) -> None:
        super().__init__()
        self.features = features
        self.sequence_parallel = sequence_parallel
        # False: Megatron-Core's expert_tensor_parallel_size 1 (every tp rank holds its ep rank's experts whole and
        # routes a 1/tp share of the tokens), for routed experts only
        self.split_over_tp = split_over_tp
        # token dropping (meshpar.expert_parallel.drop_over_capacity), per forward of one replica's tokens
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy

    def mesh_for(self, dims: ParallelDims) -> DeviceMesh:
        """The mesh the experts are sharded over: ``("ep", "tp")`` under expert parallelism, else tp
        (:func:`meshpar.recipe.apply_recipe` applies the style with it)."""
        return dims.expert_mesh

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        expert_parallel = device_mesh.ndim == 2  # ("ep", "tp"): see ParallelDims.expert_mesh
        tp_mesh = device_mesh["tp"] if expert_parallel else device_mesh
        experts, identity, tp = routed_experts(module), identity_experts(module), device_mesh.size()
        cls = type(module)
        takes_blocks = takes_token_blocks(module)
        if takes_blocks and self.capacity_factor is not None:
            raise ValueError(capacity_refusal(module))
        if identity and self.capacity_factor is not None:
            raise ValueError(identity_capacity_refusal(module))
        # the ranks the experts are split over: ep x tp (whole experts per rank), or ep alone (whole on each tp rank)
        split = tp if self.split_over_tp else (device_mesh["ep"].size() if expert_parallel else 1)
        if expert_parallel and takes_blocks and not _zero_rows_inert(module):
            raise ValueError(
                f"{cls.__name__}: its forward takes blocks of tokens per expert (every token in every expert's block), "
                "and a zero row does not stay zero through it (biases?), so the rows of experts a token was not "
                "routed to cannot be left out; use expert_parallel_size 1"
            )
        stacked = _stacked_over_experts(module, experts, identity)
        # identity experts' rows go with the real experts' rows, an equal share per rank (GroupedRows)
        identity_split = not identity or (experts % split == 0 and identity % split == 0)
        whole = stacked and identity_split
        if expert_parallel and not stacked:
            raise ValueError(
                f"{cls.__name__}: expert parallelism needs experts stacked whole in every weight (weights not stacked "
                "over the experts cannot be routed); use expert_parallel_size 1"
            )
        if expert_parallel and not identity_split:
            raise ValueError(identity_split_refusal(module, experts, identity, split))
        if not self.split_over_tp and (takes_blocks or not whole):
            raise ValueError(
                f"{cls.__name__}: expert_tensor_parallel_size 1 keeps routed experts whole on every tp rank; these "
                "experts take blocks of tokens, or cannot be split into whole experts; leave it unset"
            )
        if self.features is not None and not whole:
            if self.sequence_parallel:
                raise ValueError(
                    f"{cls.__name__}: experts split by features under sequence parallelism are not supported; turn "
                    "'sequence_parallel' off"
                )
            return _experts_by_features(module, device_mesh, self.features, self.src_data_rank)
        if not isinstance(experts, int) or experts % split:
            over = f"ep x tp = {tp}" if expert_parallel else f"tp={tp}"
            over = over if self.split_over_tp else f"ep={split}"
            raise ValueError(
                f"{cls.__name__}: {experts} experts cannot be split into whole experts over {over}; use sizes whose "
                "product divides the number of experts"
            )
        if not stacked:
            others = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 0 or p.shape[0] != experts]
            others += [n for n, child in module.named_children() if any(True for _ in child.parameters())]
            raise ValueError(
                f"{cls.__name__}: only modules whose parameters are all stacked over the experts can be sharded "
                f"into whole experts ({others} are not)"
            )
        if self.split_over_tp:  # ep blocks of experts, each block split over tp
            placements = [Shard(0)] * device_mesh.ndim
        else:  # ep blocks of experts, each whole on every tp rank
            placements = [Shard(0), Replicate()] if expert_parallel else [Replicate()]
        routed_slots = {}
        for name, param in list(module.named_parameters(recurse=False)):
            if identity and param.shape[0] == experts + identity:  # one group per rank: its experts, its identities
                layout = GroupedRows((experts // split, identity // split), 1, tuple(param.shape))
                module.__dict__.setdefault("checkpoint_shapes", {})[name] = layout
                param = nn.Parameter(layout.pack(param.detach()), param.requires_grad)
                routed_slots[name] = experts // split
            setattr(module, name, distribute_parameter(param, device_mesh, placements, self.src_data_rank))
        mix_into(module, _LocalExperts, "TensorParallel")
        module.num_experts, module.identity_experts, module.routed_slots = experts, identity, routed_slots
        module.tp_mesh, module.sequence_parallel = tp_mesh, self.sequence_parallel
        module.ep_mesh = device_mesh["ep"] if expert_parallel else None
        module.split_over_tp, module.takes_blocks = self.split_over_tp, takes_blocks
        module.capacity = (self.capacity_factor, self.drop_policy) if self.capacity_factor is not None else None
        return module


def takes_token_blocks(module: nn.Module) -> bool:
    """Whether an experts module's forward takes one block of tokens per expert (Llama-4), not routes
    ``(hidden, top_k_index, top_k_weights)``."""
    return len(inspect.signature(type(module).forward).parameters) < 4


def capacity_refusal(module: nn.Module) -> str:
    return (
        f"{type(module).__name__}: its forward takes blocks of already weighted tokens per expert, which leaves no "
        "routes to drop; leave expert_capacity_factor unset"
    )


def _zero_rows_inert(module: nn.Module) -> bool:
    """Whether the experts' blocks forward maps zero rows to zero outputs with zero input grads (a gated MLP without
    biases does, whatever its weights): tried with random weights of the module's shapes, so that the answer is the
    forward's, not this model's values."""
    generator = torch.Generator().manual_seed(0)
    weights = {
        name: torch.randn(p.shape, generator=generator, dtype=torch.float32)
        for name, p in module.named_parameters(recurse=False)
    }
    width, experts = getattr(module, "hidden_size", None), getattr(module, "num_experts", None)
    if not isinstance(width, int) or not isinstance(experts, int):
        return False
    rows = torch.zeros((experts * 2, width), requires_grad=True)
    try:
        with torch.enable_grad(), parameters_replaced(module, weights):
            out = type(module).forward(module, rows)
            (grad,) = torch.autograd.grad(out, rows, torch.randn(out.shape, generator=generator))
    except Exception:  # a forward this probe cannot drive: not proven inert
        return False
    return not out.detach().any() and not grad.any()


def routed_experts(module: nn.Module) -> int | None:
    """How many real (weighted) experts an experts module routes to: ``num_experts``, or LongCat-Flash's
    ``num_routed_experts`` (its identity experts come after them)."""
    count = getattr(module, "num_experts", None)
    return count if isinstance(count, int) else getattr(module, "num_routed_experts", None)


def identity_experts(module: nn.Module) -> int:
    """How many identity ("zero-computation") experts an experts module routes to after its real ones
    (LongCat-Flash's ``zero_expert_num``, run by an ``nn.Identity`` child); 0 for the rest."""
    count = getattr(module, "zero_expert_num", 0)
    if not isinstance(count, int) or count <= 0:
        return 0
    if not any(isinstance(child, nn.Identity) for child in module.children()):
        raise ValueError(
            f"{type(module).__name__}: it names {count} identity experts (zero_expert_num) but holds no nn.Identity "
            "to run them; meshpar does not know what they compute"
        )
    return count


def identity_capacity_refusal(module: nn.Module) -> str:
    return (
        f"{type(module).__name__}: token dropping with identity (zero-computation) experts is not supported (which "
        "routes an identity expert keeps is not defined by the capacity rule); leave expert_capacity_factor unset"
    )


def identity_split_refusal(module: nn.Module, experts: int | None, identity: int, split: int) -> str:
    return (
        f"{type(module).__name__}: its {experts} experts and {identity} identity experts (whose rows its fused "
        f"weight holds too) cannot each be split evenly over {split} ranks; use an ep x tp (or ep, with "
        "expert_tensor_parallel_size 1) that divides both counts"
    )


def _stacked_over_experts(module: nn.Module, experts: object, identity: int) -> bool:
    """Whether every weight of ``module`` is stacked over its ``experts`` real experts (or over those and its
    ``identity`` identity experts: a weight that holds rows for them too, LongCat-Flash's fused gate/up)."""
    if not isinstance(experts, int):
        return False
    counts = {experts, experts + identity}
    if any(any(True for _ in child.parameters()) for child in module.children()):
        return False
    return all(p.dim() > 0 and p.shape[0] in counts for p in module.parameters(recurse=False))


def _experts_by_features(
    module: nn.Module, mesh: DeviceMesh, features: dict[str, tuple[int, int] | None], src_data_rank: int | None
) -> nn.Module:
    """Every expert on every rank, each with this rank's share of its intermediate features (see ExpertsOverTP)."""
    held = {n for n, p in module.named_parameters(recurse=False) if p is not None}
    unplaced = sorted(n for n in held if features.get(n) is None) + [
        n for n, child in module.named_children() if any(True for _ in child.parameters())
    ]
    if unplaced:
        raise ValueError(
            f"{type(module).__name__}: its experts cannot be split into whole experts over tp={mesh.size()}, and the "
            f"plan gives no feature split for {unplaced}"
        )
    style = LocalParameters({n: spec for n, spec in features.items() if n in held and spec}, partial_output=True)
    style.src_data_rank = src_data_rank
    style._apply(module, mesh)
    tp = mesh.size()
    for child in module.children():
        if isinstance(child, nn.Identity):  # an identity expert: counted once in the sum over tp
            child.register_forward_hook(lambda _m, _args, out: out / tp)
    return module
