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

Under sequence parallelism each tp rank's routers run on its shard of the sequence, and the model's own loss, which
reads every router's logits against the whole padding mask, cannot run on them: the forward is called without it
(``output_router_logits=False``), the routers' logits are taken from the modules transformers records them from
(:func:`recorded_router_logits`), each tp rank scores its shard's tokens (the counts summed over tp as well) and the
tp ranks' shares are added into one value on every tp rank, each rank's grads from its own share (summed over tp as
every per-token module's are under sequence parallelism).

Under pipeline parallelism each stage routes its own layers' tokens, microbatch by microbatch; the loss needs the
counts of every stage and microbatch before the first backward, so it runs with the GPipe schedule
(:class:`PipelineRouterLoss`): after the forwards the counts are summed over pp x dp x cp (and tp under sequence
parallelism, each tp rank routing its shard), and each stage's backward adds the loss's grad of its routing
probabilities, which is linear in them once the counts are known.

The formula is checked once against the model's own loss on its own outputs (``output.aux_loss``): on the first
step's batch, or under sequence or pipeline parallelism on a padded probe of the dense model at ``parallelize``
time; a family whose auxiliary loss it does not reproduce is refused, never approximated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar.hf.context_parallel import local_key_padding
from meshpar.hf.hf_plan import dense_probe, expert_count, text_config
from meshpar.parallel_dims import ParallelDims
from meshpar.tensor_parallel._collectives import scatter_to_sp


def check_router_loss_layout(model: nn.Module, pp: int, schedule: str) -> None:
    """The global load-balancing loss is built from the router logits of one whole forward of this replica's batch
    (or of its cp ranks' chunks, or tp ranks' shards; pp = 1). Under pipeline parallelism every microbatch's
    assignments must be counted before any backward (:class:`PipelineRouterLoss`): schedule ``"gpipe"``; another
    schedule for a model that asks for it is refused before any step."""
    if not router_loss_asked(model) or pp == 1:
        return
    family = type(model).__name__
    why = None
    if schedule != "gpipe":
        why = (
            f"under pipeline_parallel_size > 1 only with pipeline_schedule 'gpipe' (every microbatch's routing is "
            f"counted before the first backward; {schedule!r} starts backwards earlier)"
        )
    elif _router_recorder(model) is None:
        why = "under pipeline_parallel_size > 1 from router modules meshpar can hook, and this family has none"
    if why is not None:
        raise ValueError(
            f"{family} adds the routers' load-balancing loss (output_router_logits=True), which meshpar computes over "
            f"the global batch {why}; set config.output_router_logits=False (the loss then leaves it out) or use "
            "another layout"
        )


def _router_recorder(model: nn.Module) -> tuple[type, int] | None:
    """(the module class, the index in its output) transformers records ``router_logits`` from, if by class."""
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    target, index = getattr(recorder, "target_class", None), getattr(recorder, "index", 0)
    return (target, index) if isinstance(target, type) else None


@contextlib.contextmanager
def recorded_router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """The router logits of the forwards run inside, layer by layer, as transformers would record them."""
    target, index = _router_recorder(model)
    logits: list[torch.Tensor] = []

    def record(_module: nn.Module, _args: Any, output: Any) -> None:
        logits.append(output[index] if isinstance(output, tuple) else output)

    handles = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, target)]
    try:
        yield logits
    finally:
        for handle in handles:
            handle.remove()


def router_loss_asked(model: nn.Module) -> bool:
    """Whether the model's config asks for the load-balancing loss (``output_router_logits``)."""
    return bool(getattr(text_config(model.config), "output_router_logits", False))


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
        self._check_config()
        if not self.checked:  # the model's own value on this rank's batch: the formula must reproduce it
            self._check(output.router_logits, attention_mask, output.aux_loss)
        return self._share(output.router_logits, attention_mask if scored is None else scored, dims)

    def over_shards(
        self, router_logits: list[torch.Tensor], scored: torch.Tensor | None, dims: ParallelDims
    ) -> torch.Tensor:
        """Under sequence parallelism: from the routers' logits of this tp rank's shard
        (:func:`recorded_router_logits`), ``scored`` the padding mask of the sequence this rank's tp group holds
        (``None``: no padding); the same value on every tp rank, each one's grads from its own tokens (see the
        module docstring)."""
        self._check_config()
        if not self.checked:
            raise RuntimeError(f"{self.family}: the load-balancing loss under sequence parallelism was not proven")
        tp = dims.tp_mesh
        shard = scatter_to_sp(scored, tp, 1) if scored is not None else None  # the shard the routers saw
        mine = self._share(tuple(router_logits), shard, dims, over_tp=True)
        others = mine.detach().clone()
        dist.all_reduce(others, group=tp.get_group())
        return mine + (others - mine.detach())

    def prove(self, model: nn.Module) -> None:
        """Check the formula on the dense ``model`` (every rank, before sharding): a padded probe's own load-balancing
        loss against meshpar's, for layouts whose forwards cannot compute the model's own (sequence parallelism)."""
        self._check_config()
        if _router_recorder(model) is None:
            raise ValueError(
                f"{self.family} adds the routers' load-balancing loss, but transformers records its router logits "
                "from no module class meshpar can hook under sequence_parallel; set output_router_logits=False"
            )
        with dense_probe(model, length=8) as (forward, ids):
            mask = torch.ones_like(ids)
            mask[..., -3:] = 0
            output = forward(attention_mask=mask, output_router_logits=True)
        self._check(output.router_logits, mask, output.aux_loss)

    def _check_config(self) -> None:
        if self.experts is None or self.top_k is None or self.coef is None:
            raise ValueError(
                f"{self.family} returned a router auxiliary loss, but meshpar cannot read its experts, top-k or "
                "coefficient from the config to compute it over the global batch; set output_router_logits=False"
            )

    def _check(self, router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor | None, aux: torch.Tensor) -> None:
        own = _balance(*_sums(router_logits, self.experts, self.top_k, mask), self.experts).detach()
        if aux is None or not torch.allclose(own, aux.detach().float(), rtol=1e-4, atol=1e-6):
            got = "none" if aux is None else f"{float(aux):.6g}"
            raise ValueError(
                f"{self.family}'s router auxiliary loss ({got}) is not the Switch load-balancing loss meshpar makes "
                f"global ({float(own):.6g}); set output_router_logits=False"
            )
        self.checked = True

    def _share(
        self,
        router_logits: tuple[torch.Tensor, ...],
        mask: torch.Tensor | None,
        dims: ParallelDims,
        over_tp: bool = False,
    ) -> torch.Tensor:
        """This rank's share: its tokens' probabilities against the assignment and token counts of the whole batch
        (summed over dp x cp, and over tp where the tp ranks hold different tokens)."""
        assigned, probs, tokens = _sums(router_logits, self.experts, self.top_k, mask)
        counts = torch.cat([assigned, tokens.reshape(1)])
        if dims.dp > 1 or dims.cp > 1:
            dist.all_reduce(counts, group=dims.grad_mesh.get_group())
        if over_tp and dims.tp > 1:
            dist.all_reduce(counts, group=dims.tp_mesh.get_group())
        assigned, tokens = counts[:-1], counts[-1]
        # grads are summed over dp x cp and divided by dp afterwards: dp times each rank's share, so the result is the
        # global value
        return self.coef * dims.dp * _balance(assigned, probs, tokens.clamp(min=1), self.experts)


class _RouterGradInto(torch.autograd.Function):
    """The stage output unchanged; in backward the routing probabilities of this stage and microbatch also get the
    load-balancing loss's grad (known once every microbatch was counted: :meth:`PipelineRouterLoss.sum_counts`)."""

    @staticmethod
    def forward(ctx: Any, loss: PipelineRouterLoss, probs: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        ctx.loss = loss
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor]:
        return None, ctx.loss.probs_grad(), grad


class PipelineRouterLoss:
    """The load-balancing loss of a model split into pipeline stages, over the global batch, run with the GPipe
    schedule (see the module docstring). :meth:`attach` hooks each of this rank's stages; per step :meth:`start`,
    then the pipeline calls :meth:`sum_counts` between its forwards and backwards; :attr:`value` is the loss's value,
    the same on every rank."""

    def __init__(self, model: nn.Module, loss: RouterLoss, dims: ParallelDims, sequence_parallel: bool) -> None:
        if not loss.checked:
            raise RuntimeError(f"{loss.family}: the load-balancing loss under pipeline parallelism was not proven")
        self.loss, self.dims = loss, dims
        # the stages' routers run on each tp rank's sequence shard
        self.shards = sequence_parallel and dims.tp > 1
        self.target, self.index = _router_recorder(model)
        self.value: torch.Tensor | None = None
        self._coefficient: torch.Tensor | None = None
        self._recording: list[torch.Tensor] | None = None
        self._mask: torch.Tensor | None = None
        self.start()

    def attach(self, chunk: nn.Module) -> list[Any]:
        """Hook a stage ``chunk`` (called with each microbatch's inputs as keywords): its routers' logits are
        recorded during its forward, and its output carries their probabilities' grad back. Returns the handles."""
        handles = [m.register_forward_hook(self._record) for m in chunk.modules() if isinstance(m, self.target)]
        handles.append(chunk.register_forward_pre_hook(self._begin, with_kwargs=True))
        handles.append(chunk.register_forward_hook(self._end, with_kwargs=True))
        return handles

    def start(self) -> None:
        """Forget the last step's counts (each step's loss is its own batch's)."""
        experts = self.loss.experts
        self._assigned = torch.zeros(experts, device=self.dims.device)
        self._probs = torch.zeros(experts, device=self.dims.device)
        self._tokens = torch.zeros((), device=self.dims.device)
        self.value = self._coefficient = None

    def _record(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if self._recording is not None:
            self._recording.append(output[self.index] if isinstance(output, tuple) else output)

    def _begin(self, _chunk: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        # the padding of the tokens this rank's routers see: its cp chunks' (context parallelism), its tp shard of
        # them (sequence parallelism)
        cp = self.dims.cp > 1
        mask = local_key_padding(kwargs, self.dims.cp_mesh) if cp else kwargs.get("attention_mask")
        if self.shards and mask is not None:
            mask = scatter_to_sp(mask, self.dims.tp_mesh, 1)
        self._recording, self._mask = [], mask

    def _end(self, _chunk: nn.Module, _args: Any, _kwargs: dict[str, Any], output: Any) -> Any:
        logits, self._recording = self._recording, None
        if not logits:
            return output
        assigned, probs, tokens = _sums(tuple(logits), self.loss.experts, self.loss.top_k, self._mask)
        self._assigned += assigned
        self._probs += probs.detach()
        self._tokens += tokens
        if not (torch.is_grad_enabled() and probs.requires_grad):
            return output
        if isinstance(output, torch.Tensor):
            return _RouterGradInto.apply(self, probs, output)
        if isinstance(output, (tuple, list)):
            index = next((i for i, t in enumerate(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if index is not None:
                carried = list(output)
                carried[index] = _RouterGradInto.apply(self, probs, carried[index])
                return type(output)(carried)
        raise TypeError(
            f"a pipeline stage of {self.loss.family} returned {type(output).__name__}; the load-balancing loss's grad "
            "travels back with a tensor the stage outputs"
        )

    def sum_counts(self) -> None:
        """Sum the counts and probabilities over every stage (pp), replica (dp), cp rank and sequence shard (tp,
        under sequence parallelism); then the loss's value and the grad of each microbatch's probabilities are
        known."""
        dims, experts = self.dims, self.loss.experts
        totals = torch.cat([self._assigned, self._tokens.reshape(1), self._probs])
        dist.all_reduce(totals, group=dims.pp_mesh.get_group())
        if dims.dp > 1 or dims.cp > 1:
            dist.all_reduce(totals, group=dims.grad_mesh.get_group())
        if self.shards:  # each tp rank routed its own tokens; each one's grads come from them (summed over tp)
            dist.all_reduce(totals, group=dims.tp_mesh.get_group())
        assigned, tokens, probs = totals[:experts], totals[experts].clamp(min=1), totals[experts + 1 :]
        self.value = self.loss.coef * _balance(assigned, probs, tokens, experts)
        # d value / d probs, times dp: the grads are summed over dp x cp and divided by dp afterwards (as
        # RouterLoss._share)
        self._coefficient = self.loss.coef * dims.dp * experts * assigned / tokens**2

    def probs_grad(self) -> torch.Tensor:
        if self._coefficient is None:
            raise RuntimeError(
                f"{self.loss.family}: a stage's backward ran before the load-balancing loss's counts were summed over "
                "every microbatch (pipeline schedule 'gpipe' sums them between the forwards and the backwards)"
            )
        return self._coefficient
