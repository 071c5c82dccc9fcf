"""Data parallelism: how each dp replica's grads become their mean over ``mesh["dp"]``.

:class:`DataParallelGrads` is the one component every entry point holds (``meshpar.parallelize``, NxD's
``PipelineModel``, apex's ``build_model(wrap_with_ddp=True)`` chunks); its mode says which of the four ways runs: one
flat all-reduce after backward (:func:`allreduce_gradients`), bucketed all-reduces overlapping backward
(:class:`meshpar.grad_sync.OverlappedGradSync`), FSDP2's reduce-scatter during backward (:func:`apply_fsdp`, applied
by the recipe), or none here because the optimizer reduce-scatters them (``DistributedOptimizer(zero1=True,
reduce_scatter_grads=True)``). Parameters are plain tensors or DTensors on the tp mesh; their local shards are what
each dp replica owns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from meshpar._compat import DeviceMesh, local_tensor
from meshpar._dp_checks import holds_different_experts, is_dp_sharded, is_expert_parallel
from meshpar._in_place import mix_into
from meshpar.grad_sync import OverlappedGradSync, grad_buffer, pack_grads, unpack_grads


def allreduce_gradients(
    parameters: Iterable[torch.nn.Parameter],
    dp_mesh: DeviceMesh,
    *,
    reduce_dtype: torch.dtype | None = None,
    divisor: int | None = None,
) -> None:
    """Average the grads of ``parameters`` over the dp group, flattened into one bucket per dtype
    (``reduce_dtype=torch.float32`` reduces bf16/fp16 grads in fp32). ``divisor`` (default: the group's size) is
    what the sum is divided by: expert grads are summed over the expert-data-parallel group but divided by all of
    dp, whose replicas' losses they already hold (the all-to-all brought them).

    A parameter may have a grad on some dp ranks and none on others (an expert no token of this rank's batch was
    routed to): it counts as zeros where missing, and every rank ends with the same averaged grad, or with ``None``
    where no rank had one (as the dense step on the whole batch): one "has a grad" flag per parameter rides in the
    same all-reduce (:func:`meshpar.grad_sync.pack_grads`)."""
    divisor = dp_mesh.size() if divisor is None else divisor
    if dp_mesh.size() == 1 and divisor == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for param in dict.fromkeys(p for p in parameters if p.requires_grad):
        by_dtype.setdefault(local_tensor(param).dtype, []).append(param)
    for bucket in by_dtype.values():
        local = local_tensor(bucket[0])
        flat = grad_buffer([local_tensor(p).numel() for p in bucket], reduce_dtype or local.dtype, local.device)
        missing = pack_grads(bucket, flat)
        if dp_mesh.size() > 1:
            dist.all_reduce(flat, group=dp_mesh.get_group())
        flat /= divisor
        unpack_grads(bucket, flat, missing)


DP_MODES = ("allreduce", "overlapped", "fsdp", "optimizer")


def choose_dp_mode(dp_mesh: DeviceMesh, *, fsdp: bool = False, overlap: bool | None = None) -> str:
    """FSDP2 where the parameters are dp-sharded; otherwise overlapped all-reduces where asked (default: on CUDA,
    where communication runs beside compute), else one all-reduce after backward."""
    if fsdp:
        return "fsdp"
    if overlap is None:
        overlap = dp_mesh.device_type == "cuda"
    return "overlapped" if overlap else "allreduce"


class DataParallelGrads:
    """Averages this rank's grads over dp in one of :data:`DP_MODES`:

    - ``"allreduce"``: :meth:`finish` all-reduces them after backward, one flat buffer per dtype;
    - ``"overlapped"``: bucketed all-reduces start while backward runs, one :class:`OverlappedGradSync` per pipeline
      chunk (a chunk's buckets start in its last backward); :meth:`finish` waits for them;
    - ``"fsdp"``: FSDP2 reduce-scattered them during backward; :meth:`finish` gives parameters no dp rank used
      their ``None`` grad back (:func:`drop_grads_no_dp_rank_used`, for every mode's ``apply_fsdp`` units);
    - ``"optimizer"``: left to the optimizer (ZeRO-1 reduce-scatters each grad to its owner).

    ``chunks`` are the model chunks (one module for an unpipelined model); a parameter two chunks share belongs to
    the first. With dp == 1 every mode does nothing.

    Under context parallelism ``dp_mesh`` is dp x cp (:attr:`ParallelDims.grad_mesh`) and ``divisor`` dp: the cp
    ranks' grads are parts of one replica's, summed. Under expert parallelism (``expert_dp_mesh``: the
    expert-data-parallel group, see :mod:`meshpar.parallel_dims`) the expert weights, DTensors over a mesh with an
    ``"ep"`` dim (or plain weights NxD marks ``expert_model_parallel``), are summed over that group after backward
    and divided by dp, in the all-reduce modes (``expert_dp_mesh`` ``None``: no expert parallelism, and such a marked
    plain weight is a dense one); under FSDP2
    they are their own units over that group (:func:`apply_fsdp`); in the optimizer's mode the optimizer reduces them
    (:class:`meshpar.optim.DistributedOptimizer` owns their state within that group).
    """

    def __init__(
        self,
        mode: str,
        dp_mesh: DeviceMesh,
        chunks: Sequence[torch.nn.Module],
        *,
        expert_dp_mesh: DeviceMesh | None = None,
        divisor: int | None = None,
    ) -> None:
        if mode not in DP_MODES:
            raise ValueError(f"unknown data-parallel mode {mode!r}; one of {DP_MODES}")
        self.mode = mode
        self.dp_mesh = dp_mesh
        self.divisor = dp_mesh.size() if divisor is None else divisor
        self.expert_dp_mesh = expert_dp_mesh
        self.chunks = list(chunks)
        fsdp_divisors = {u._meshpar_grad_divisor for c in self.chunks for u in c.modules() if _is_fsdp_unit(u)}
        wrong = mode == "optimizer" or (mode == "fsdp" and fsdp_divisors != {self.divisor})
        if self.divisor != dp_mesh.size() and wrong:
            raise ValueError(
                f"data-parallel mode {mode!r} divides the grads' sum by its group's size, not by {self.divisor} "
                "(context parallelism: dp alone); use the all-reduce modes, or apply_fsdp(..., divisor=dp)"
            )
        experts = [p for chunk in self._chunk_parameters(experts=True) for p in chunk]
        if experts and expert_dp_mesh is None:
            raise ValueError("expert-parallel weights need the expert-data-parallel group (expert_dp_mesh)")
        overlapped = mode == "overlapped" and dp_mesh.size() > 1
        self.syncs = (
            [OverlappedGradSync(params, dp_mesh, divisor=self.divisor) for params in self._chunk_parameters()]
            if overlapped
            else []
        )

    def _chunk_parameters(self, experts: bool = False) -> list[list[torch.nn.Parameter]]:
        """Each chunk's own parameters: the dense ones, or (``experts``) the expert-parallel ones. Without an
        expert-data-parallel group (no ep dim) a plain weight marked as NxD marks experts, whatever the ep size, is
        held alike by every dp rank: a dense one."""
        claimed: set[int] = set()
        per_chunk = []
        for chunk in self.chunks:
            own = [p for p in chunk.parameters() if id(p) not in claimed]
            claimed.update(id(p) for p in own)
            per_chunk.append([p for p in own if holds_different_experts(p, self.expert_dp_mesh is not None) == experts])
        return per_chunk

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backwards inside accumulate grads locally without starting dp reductions (gradient accumulation: every
        microbatch but the last)."""
        stack = contextlib.ExitStack()
        for sync in self.syncs:
            stack.enter_context(sync.no_sync())
        return stack

    def finish(self) -> None:
        """After the step's last backward: every parameter's grad is the dp mean (``"fsdp"``: already;
        ``"optimizer"``: still this replica's own)."""
        for chunk in self.chunks:  # parameters no dp rank used under apply_fsdp: None grads, as dense
            drop_grads_no_dp_rank_used(chunk, self.dp_mesh)
        if self.mode == "overlapped":
            for sync in self.syncs:
                sync.finish()
        elif self.mode == "allreduce":
            # parameters FSDP2 shards over dp (stages sharded by a user's stage_transform) reduced their own grads
            params = (p for chunk in self._chunk_parameters() for p in chunk if not is_dp_sharded(p))
            allreduce_gradients(params, self.dp_mesh, divisor=self.divisor)
        if self.expert_dp_mesh is not None and self.mode != "optimizer":
            # experts FSDP2 shards over edp reduce-scattered their own grads; the optimizer's mode leaves them to it
            experts = (p for chunk in self._chunk_parameters(experts=True) for p in chunk if not is_dp_sharded(p))
            allreduce_gradients(experts, self.expert_dp_mesh, divisor=self.divisor)


class _ZeroGradsForUnused(torch.autograd.Function):
    """Identity on an FSDP unit's inputs. Its backward runs once the unit's own backward is done and before FSDP's
    post-backward (whose hook wraps the inputs outside this one): every trainable parameter of the unit still without
    a grad gets a zero grad. FSDP2 reduce-scatters the grads a rank has, paired by position across ranks; a parameter
    one dp rank used and another did not (an expert no token of that rank's batch reached) would pair different
    tensors (gloo aborts, NCCL hangs or mixes grads). Zeros are the unused rank's true contribution to the mean.
    Which parameters were used and which were filled is noted, so :func:`drop_grads_no_dp_rank_used` can take the
    zeros back where no rank used a parameter (the dense step skips it)."""

    @staticmethod
    def forward(ctx: object, unit: torch.nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx: object, *grads: torch.Tensor) -> tuple[object, ...]:
        usage = ctx.unit._meshpar_grad_usage
        for name, module, attr in _unit_parameters(ctx.unit):  # FSDP's unsharded parameters during backward
            param = getattr(module, attr)
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
                usage.filled.add(name)
            else:
                usage.used.add(name)
        return (None, *grads)


class _GradUsage:
    """The parameters of one FSDP unit that had a grad of their own (``used``) or a zero grad from
    :class:`_ZeroGradsForUnused` (``filled``) in the backward passes since the last
    :func:`drop_grads_no_dp_rank_used`."""

    def __init__(self) -> None:
        self.used: set[str] = set()
        self.filled: set[str] = set()


def _is_fsdp_unit(module: torch.nn.Module) -> bool:
    return hasattr(module, "_meshpar_grad_divisor")


def _unit_parameters(unit: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """The parameters one ``fully_shard`` unit manages (its own, not those of nested units), as (name within the
    unit, module, attribute): FSDP swaps sharded and unsharded parameter objects, names stay."""
    from torch.distributed.fsdp import FSDPModule

    params, stack = [], [("", unit)]
    while stack:
        prefix, module = stack.pop()
        params.extend((prefix + attr, module, attr) for attr, p in module._parameters.items() if p is not None)
        stack.extend((f"{prefix}{n}.", c) for n, c in module.named_children() if not isinstance(c, FSDPModule))
    return params


def _give_unused_parameters_zero_grads(unit: torch.nn.Module) -> None:
    unit._meshpar_grad_usage = _GradUsage()

    def wrap_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_grad_enabled():
            return None
        flat = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keyed = [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not flat and not keyed:  # nothing to hang the backward on (token ids in): the root, whose parameters
            return None  # (embedding, final norm, head) every rank uses
        outs = _ZeroGradsForUnused.apply(module, *(a for _, a in flat), *(v for _, v in keyed))
        args = list(args)
        for (i, _), out in zip(flat, outs, strict=False):
            args[i] = out
        kwargs = {**kwargs, **{k: out for (k, _), out in zip(keyed, outs[len(flat) :], strict=True)}}
        return tuple(args), kwargs

    unit.register_forward_pre_hook(wrap_inputs, with_kwargs=True)


def drop_grads_no_dp_rank_used(model: torch.nn.Module, dp_mesh: DeviceMesh) -> None:
    """After the step's last backward under :func:`apply_fsdp`: a parameter that no dp rank used (its unit ran, so
    every rank gave it a zero grad for FSDP's reduce-scatter) gets its grad back to ``None``, as in the dense step,
    which an optimizer then skips (AdamW would otherwise still move it by its moments and weight decay). One small
    all-reduce over dp; a collective call on every dp rank. A grad left from earlier backward passes (accumulation
    without ``zero_grad``) is kept unless it is exactly zero on every rank."""
    units = [m for m in model.modules() if hasattr(m, "_meshpar_grad_usage")]
    if not units or (dp_mesh.size() == 1 and not any(u._meshpar_grad_usage.filled for u in units)):
        return
    entries = [(unit, name, module, attr) for unit in units for name, module, attr in _unit_parameters(unit)]
    kept, ours = [], []  # kept: used here, or a grad not ours alone; ours: only our zeros went into it (read it)
    for i, (unit, name, module, attr) in enumerate(entries):
        usage, grad = unit._meshpar_grad_usage, module._parameters[attr].grad
        kept.append(float(name in usage.used or grad is not None))
        if grad is not None and name in usage.filled and name not in usage.used:
            ours.append((i, grad))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    flags = torch.tensor(kept, device=device)
    if ours:  # an earlier backward's grad may be in it: one device tensor, no host sync per parameter
        flags[[i for i, _ in ours]] = torch.stack([local_tensor(g).count_nonzero().float() for _, g in ours])
    if dp_mesh.size() > 1:
        dist.all_reduce(flags, group=dp_mesh.get_group())
    for (unit, name, module, attr), flag in zip(entries, flags.tolist(), strict=True):
        if flag == 0 and name in unit._meshpar_grad_usage.filled:
            module._parameters[attr].grad = None
    for unit in units:
        unit._meshpar_grad_usage = _GradUsage()


def apply_fsdp(
    model: torch.nn.Module,
    dp_mesh: DeviceMesh,
    *,
    block_cls: type | tuple[type, ...] | None = None,
    reshard_after_forward: bool = True,
    mp_policy: object | None = None,
    divisor: int | None = None,
    expert_dp_mesh: DeviceMesh | None = None,
) -> torch.nn.Module:
    """FSDP2 ``fully_shard`` over ``mesh["dp"]`` (per block, then the root), on top of tensor parallelism; under
    context parallelism over dp x cp (``dims.grad_mesh``), the grads' sum divided by ``divisor`` (dp) instead of the
    mesh's size.

    Under expert parallelism (``expert_dp_mesh``: the expert-data-parallel group, see :mod:`meshpar.parallel_dims`)
    each module holding expert weights (DTensors over ``("ep", "tp")``) is a unit of its own first, sharded over
    ``edp`` (the ranks holding the same experts; torchtitan's ``dp_mod_ep``), its grads' sum divided by dp like the
    dense ones (the all-to-all already brought every dp replica's tokens to them); the enclosing blocks and the root
    shard the dense weights over dp.

    Apply after TP (and activation checkpointing): parameters that are DTensors on the tp mesh become 2-D
    ``(dp, tp)`` DTensors, sharded over dp between steps and gathered for each block's forward and backward.
    A parameter some dp rank did not use in the step (an expert its batch never reached) gets a zero grad there, so
    every rank reduce-scatters the same tensors (FSDP2 would otherwise pair different ones); call
    :func:`drop_grads_no_dp_rank_used` after the step's last backward to give one that *no* rank used its ``None``
    grad back, as in the dense step (``ParallelizedModel.train_step`` / ``allreduce_gradients`` do).
    """
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, object] = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    divisor = dp_mesh.size() if divisor is None else divisor
    experts = [m for m in model.modules() if any(is_expert_parallel(p) for p in m.parameters(recurse=False))]
    if experts and expert_dp_mesh is None:
        raise ValueError("apply_fsdp: the model holds expert-parallel weights; pass expert_dp_mesh (dims.edp_mesh)")
    units = [m for m in model.modules() if isinstance(m, block_cls)] if block_cls is not None else []
    for unit in [*experts, *units, model]:  # innermost first: a unit leaves its nested units' parameters alone
        mesh = expert_dp_mesh if unit in experts else dp_mesh
        fully_shard(unit, **kwargs, mesh=mesh)
        if divisor != mesh.size():  # under cp (dense units), and expert units (edp ranks; the divisor is dp)
            unit.set_gradient_divide_factor(float(divisor))
            # a sum, then the division (gloo has no pre-scaled sum); with one rank there is no sum, and torch 2.13
            # would divide twice
            unit.set_force_sum_reduction_for_comms(mesh.size() > 1)
        unit._meshpar_grad_divisor = divisor
        _give_unused_parameters_zero_grads(unit)  # after fully_shard: its post-backward wraps the inputs outside
    return model


class _CheckpointedBlock:
    """Runs the block's own forward (compiled, with ``compile_blocks``) under activation checkpointing."""

    def forward(self, *args: object, **kwargs: object) -> object:
        if self._meshpar_replay_tp_rng:
            from meshpar.random import activation_checkpoint

            return activation_checkpoint(self._meshpar_block_forward, *args, **kwargs)
        return torch.utils.checkpoint.checkpoint(self._meshpar_block_forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(
    model: torch.nn.Module,
    block_cls: type | tuple[type, ...] = (),
    *,
    replay_tp_rng: bool = True,
    compile_blocks: bool = False,
    check_fn: Callable[[torch.nn.Module], bool] | None = None,
    wrapper: type[_CheckpointedBlock] = _CheckpointedBlock,
) -> torch.nn.Module:
    """Recompute every ``block_cls`` module in backward, replaying the tensor-parallel RNG state (dropout masks in
    sharded regions come out the same). Apply after TP, before FSDP.

    ``compile_blocks`` compiles each block's forward with ``torch.compile`` and checkpoints *around* the compiled
    graph, so the recompute in backward runs the compiled graph too. The other order (checkpoint inside a compiled
    block, torchtitan's) does not compile in torch 2.13 once DTensor parameters enter the checkpointed region: AOT
    autograd saves the ``DeviceMesh`` among the tensors for backward and fails, so dynamo falls back to eager. With the
    checkpoint outside, its RNG handling stays in eager code: the default generator (which Inductor draws its dropout
    seeds from) and the TP tracker are restored before the recompute, so dropout masks replay exactly.

    ``replay_tp_rng=False`` uses torch's plain non-reentrant checkpoint (no tracker replay). ``check_fn`` picks the
    blocks by a predicate instead of (or besides) their class (NxD's and FSDP's way). ``wrapper`` is the class mixed
    in (a subclass of the default names the checkpointed blocks after a compatibility view's own wrapper)."""
    prefix = "Checkpointed" if wrapper is _CheckpointedBlock else wrapper.__name__
    for module in list(model.modules()):
        chosen = isinstance(module, block_cls) or (check_fn is not None and module is not model and check_fn(module))
        if chosen and not isinstance(module, _CheckpointedBlock):
            mix_into(module, wrapper, prefix)  # in place, FQNs kept (meshpar._in_place)
            inner = super(_CheckpointedBlock, module).forward
            module._meshpar_block_forward = torch.compile(inner) if compile_blocks else inner
            module._meshpar_replay_tp_rng = replay_tp_rng
    return model
