"""Pipeline stage forwards for HuggingFace models.

Every causal LM whose config carries transformers' ``base_model_pp_plan`` (or, without one, whose base model, or the
one module it wraps, holds one layer list: the plan is then read from its children in the order the dense forward
calls them, and must pass the composition check) runs the model's
*own* forward on each stage (:func:`decoder_stage_forward`): the layer list is swapped for a view of the full depth
in which the stage's layers sit at their global indices and every other index passes its input through, so
per-layer data the forward reads by index (``config.layer_types[i]``: sliding-window masks, per-type rotary tables)
stays right; the pieces before the layers (embedding, dropout) act only on the first stage (a learned position
embedding the forward adds adds nothing later) and those after them (final norm) only on the last, which returns the
head's logits; a parameter-free module the forward calls on both sides of the layers (NanoChat's one norm) acts in
its early calls on the first stage and in its late ones on the last. Masks, positions and rotary tables are built by the
model's forward itself, with the user's attention implementation. :func:`check_stage_composition` proves, on the
dense model before it is split, that the stages composed reproduce its forward.

GPT-2, Llama and BERT keep hand-written stage forwards (they also run sequence-parallel stages): each builds the mask
the HF model would for its configured attention implementation (none for sdpa's ``is_causal``, a 4-D causal mask for
eager attention) from the microbatch's ``attention_mask`` (``[batch, seq]``, 1 = attend), so the user's choice of
attention implementation holds under pipeline parallelism too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from meshpar._in_place import mix_into
from meshpar.hf.hf_plan import base_model_name

_log = logging.getLogger(__name__)


def _positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def _full_sequence(self: nn.Module, x: torch.Tensor, first_stage: bool) -> int:
    """A later stage receives sequence shards under sequence parallelism."""
    return x.shape[1] if first_stage else x.shape[1] * getattr(self, "meshpar_sequence_shards", 1)


def _attention_mask(
    config: object, hidden: torch.Tensor, seq: int, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor | None:
    """The mask the HF model itself would build from a ``[batch, seq]`` padding mask for the configured attention
    implementation: ``None`` where none is needed (sdpa's ``is_causal``, bidirectional without padding), a 4-D
    causal mask for eager attention, a block mask for flex attention."""
    if mask is None and not causal:
        return None
    try:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
    except ImportError as error:  # pragma: no cover - older transformers
        raise RuntimeError("an attention_mask under pipeline parallelism needs transformers>=4.53") from error
    like = hidden.new_empty((hidden.shape[0], seq, 1))  # the shape, dtype and device the mask builders read
    if causal:
        return create_causal_mask(
            config=config, inputs_embeds=like, attention_mask=mask, past_key_values=None, position_ids=None
        )
    return create_bidirectional_mask(config=config, inputs_embeds=like, attention_mask=mask)


def gpt2_stage_forward(self: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    body = self.transformer
    first = body.wte is not None
    seq = _full_sequence(self, x, first)
    if first:
        x = body.drop(body.wte(x) + body.wpe(_positions(x)))
    mask = _attention_mask(body.config, x, seq, attention_mask, causal=True)
    for block in body.h:
        x = block(x, attention_mask=mask)
    if body.ln_f is not None:
        x = self.lm_head(body.ln_f(x))
    return x


def llama_stage_forward(self: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    body = self.model
    first = body.embed_tokens is not None
    seq = _full_sequence(self, x, first)
    if first:
        x = body.embed_tokens(x)
    positions = torch.arange(seq, device=x.device).unsqueeze(0)
    position_embeddings = body.rotary_emb(x, positions)
    mask = _attention_mask(body.config, x, seq, attention_mask, causal=True)
    for layer in body.layers:
        x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=position_embeddings)
    if body.norm is not None:
        x = self.lm_head(body.norm(x))
    return x


def bert_stage_forward(self: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """BERT for masked LM: bidirectional attention, padding masked where ``attention_mask`` is 0."""
    body = self.bert
    first = body.embeddings is not None
    seq = _full_sequence(self, x, first)
    if first:
        x = body.embeddings(input_ids=x)
    mask = _attention_mask(body.config, x, seq, attention_mask, causal=False)
    for layer in body.encoder.layer:
        x = layer(x, attention_mask=mask)
    if getattr(self, "cls", None) is not None:
        x = self.cls(x)
    return x


class _GPT2Stage:
    forward = gpt2_stage_forward


class _LlamaStage:
    forward = llama_stage_forward


class _BertStage:
    forward = bert_stage_forward


# family -> (the stage's forward as a mixin, parameter-free modules every stage keeps)
STAGE_FORWARDS: dict[str, tuple[type, tuple[str, ...]]] = {
    "gpt2": (_GPT2Stage, ()),
    "llama": (_LlamaStage, ("model.rotary_emb",)),
    "bert": (_BertStage, ()),
}


def install_stage_forward(stage: nn.Module, family: str) -> nn.Module:
    if family not in STAGE_FORWARDS:
        raise ValueError(f"pipeline parallelism supports the families {sorted(STAGE_FORWARDS)}, not {family!r}")
    # the stage is the HF model with other stages' pieces removed; it runs meshpar's forward (meshpar._in_place)
    return mix_into(stage, STAGE_FORWARDS[family][0], "PipelineStage")


@dataclass(frozen=True)
class PipelineLayout:
    """Where a causal LM's pieces are, from transformers' pipeline plan (full FQNs)."""

    container: str  # the transformer-layer list, e.g. "model.layers"
    before: tuple[str, ...]  # plan entries that run before the layers: first stage only (embedding, dropout)
    after: tuple[str, ...]  # plan entries after them: last stage only (final norm)
    keep: tuple[str, ...]  # parameter-free base-model modules every stage needs (rotary embeddings)
    base: str  # the base model, whose forward non-last stages run
    num_layers: int
    # each layer's plain attributes (attention_type, block_type, ...): a forward may read them from every layer
    layer_attributes: tuple[tuple[tuple[str, object], ...], ...]
    # the embeddings among ``before``: on later stages they add nothing (a learned position embedding the forward
    # adds to the hidden states it is handed)
    embeddings: tuple[str, ...] = ()
    # layers return a tuple (hidden states first: GPT-J's blocks in older transformers), so stand-ins do too
    layer_returns_tuple: bool = False
    # parameter-free modules the forward calls on both sides of the layers, with their number of calls before them
    both_sides: tuple[tuple[str, int], ...] = ()

    def stage_sides(self, model: nn.Module) -> tuple[list[str], list[str]]:
        """(first stage's, last stage's) modules of this layout that hold parameters, for the splitter."""
        holding = [n for n in (*self.before, *self.after) if _holds_parameters(model, n)]
        return [n for n in holding if n in self.before], [n for n in holding if n in self.after]


def _holds_parameters(module: nn.Module, name: str) -> bool:
    return any(True for _ in module.get_submodule(name).parameters())


def pipeline_layout(model: nn.Module) -> PipelineLayout | None:
    """The layout of a causal LM with transformers' ``base_model_pp_plan``; ``None`` when it has none. Raises when
    the plan does not describe the model (a base-model module outside the plan holds parameters)."""
    config = getattr(model, "config", None)
    plan = list(dict(getattr(config, "base_model_pp_plan", None) or {}))
    prefix = base_model_name(model)
    if plan and prefix:
        base = model.get_submodule(prefix)
        missing = [n for n in plan if getattr(base, n, None) is None]
        if missing:
            raise ValueError(
                f"{type(model).__name__}: transformers' pipeline plan {plan} names {missing}, which "
                f"{type(base).__name__} does not have (its children: {[n for n, _ in base.named_children()]}): the "
                "plan does not describe this model, so pipeline parallelism cannot place its layers (use "
                "pipeline_parallel_size 1)"
            )
    return _layout(model, plan) if plan else None


def _layer_holder(base: nn.Module, prefix: str) -> str:
    """FQN of the module whose children are the layer list and its neighbours: the base model, or the one module
    it wraps (OPT's ``model.decoder``)."""
    holder, path = base, prefix
    while True:
        holding = [(n, m) for n, m in holder.named_children() if _holds_parameters(holder, n)]
        if len(holding) != 1 or any(isinstance(m, nn.ModuleList) for _, m in holding):
            return path
        name, holder = holding[0]
        path = f"{path}.{name}"


@dataclass(frozen=True)
class _RunOrder:
    """What one dense forward shows about ``holder``'s children."""

    calls: list[str]  # every call of a child, in order (a layer list: its first layer's calls)
    returns_tuple: bool  # the layers of the layer list return tuples

    @property
    def order(self) -> list[str]:
        """The children in the order of their first calls."""
        return list(dict.fromkeys(self.calls))


def _run_order(model: nn.Module, holder: nn.Module, layer_list: str) -> _RunOrder:
    """The children of ``holder`` in the order the dense model's forward first calls them, on a tiny batch:
    registration order need not be run order; whether the layers of ``layer_list`` return tuples (other lists, such
    as per-layer rotary tables, may); and every call in order.
    A model on meta cannot run: its registration order, tensors (nothing proves that guess, so
    :mod:`meshpar.hf.parallelize` refuses it)."""
    if any(p.is_meta for p in model.parameters()):
        return _RunOrder([name for name, _ in holder.named_children()], False)
    calls_seen: list[str] = []
    returns_tuple: list[bool] = []
    handles = []
    for name, child in holder.named_children():
        calls = child[0] if isinstance(child, nn.ModuleList) and len(child) > 0 else child
        handles.append(calls.register_forward_pre_hook(lambda *_, n=name: calls_seen.append(n)))
        if name == layer_list and calls is not child:
            handles.append(
                calls.register_forward_hook(lambda _m, _a, out: returns_tuple.append(isinstance(out, tuple)))
            )
    ids = torch.randint(0, getattr(model.config, "vocab_size", 2), (1, 4), generator=torch.Generator().manual_seed(0))
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(input_ids=ids.to(next(iter(model.parameters())).device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes:
            module.training = training
    return _RunOrder(calls_seen, any(returns_tuple))


def _both_sides(calls: list[str], layer_list: str, holder: nn.Module, holder_path: str) -> tuple[tuple[str, int], ...]:
    """Parameter-free children called both before and after the layers (NanoChat's one norm, applied to the
    embeddings and to the last hidden states), with how many of their calls come before: their early calls belong
    to the first stage and their late ones to the last, as plan pieces on either side do."""
    if layer_list not in calls:
        return ()
    first = calls.index(layer_list)
    last = len(calls) - 1 - calls[::-1].index(layer_list)
    sided = []
    for name, _ in holder.named_children():
        early = calls[:first].count(name)
        if name != layer_list and early and calls[last:].count(name) and not _holds_parameters(holder, name):
            sided.append((f"{holder_path}.{name}", early))
    return tuple(sided)


def inferred_pipeline_layout(model: nn.Module) -> PipelineLayout | None:
    """For a causal LM without transformers' pipeline plan: the plan read from the module holding its one layer list
    (the base model, or the single module it wraps): the list and the children holding parameters, in the order a
    forward of the dense model calls them; ``None`` when there is no single layer list. Only a guess until
    :func:`check_stage_composition` proves it on the dense model."""
    prefix = base_model_name(model)
    if not prefix:
        return None
    holder_path = _layer_holder(model.get_submodule(prefix), prefix)
    holder = model.get_submodule(holder_path)
    lists = [n for n, m in holder.named_children() if isinstance(m, nn.ModuleList) and _holds_parameters(holder, n)]
    if len(lists) != 1:
        return None
    # parameter-free children (rotary tables) run on every stage, as they are, unless they act on both sides
    run = _run_order(model, holder, lists[0])
    order = [n for n in run.order if n == lists[0] or _holds_parameters(holder, n)]
    if lists[0] not in order:
        return None
    layout = _layout(model, order, holder_path)
    if layout is None:
        return None
    both = _both_sides(run.calls, lists[0], holder, holder_path)
    return replace(layout, layer_returns_tuple=run.returns_tuple, both_sides=both)


def _layout(model: nn.Module, names: list[str], holder_path: str | None = None) -> PipelineLayout | None:
    """The layout of ``names`` (children of ``holder_path``, the base model by default, in run order)."""
    prefix = base_model_name(model)
    if not prefix or not type(model).__name__.endswith("ForCausalLM"):
        return None
    holder_path = holder_path or prefix
    base = model.get_submodule(holder_path)
    lists = [name for name in names if isinstance(getattr(base, name, None), nn.ModuleList)]
    if len(lists) != 1:
        return None
    index = names.index(lists[0])
    others = [n for n, m in base.named_children() if n not in names]
    holding = [n for n in others if _holds_parameters(base, n)]
    if holding:
        raise ValueError(
            f"{type(model).__name__}: the pipeline plan {names} leaves out {holding}, which hold "
            "parameters; pipeline parallelism cannot place them (use pipeline_parallel_size 1)"
        )
    full = [f"{holder_path}.{n}" for n in names]
    # parameter-free plan pieces (dropouts) go to every stage too: where they must not act they become identities,
    # so it does not matter which side of the layers the model registered them on
    free = [f for f, n in zip(full, names, strict=True) if n != lists[0] and not _holds_parameters(base, n)]
    return PipelineLayout(
        container=full[index],
        before=tuple(full[:index]),
        after=tuple(full[index + 1 :]),
        keep=tuple(f"{holder_path}.{n}" for n in others) + tuple(free),
        base=prefix,
        num_layers=len(base.get_submodule(lists[0])),
        layer_attributes=tuple(_plain_attributes(layer) for layer in base.get_submodule(lists[0])),
        embeddings=tuple(
            f
            for f, n in zip(full[:index], names[:index], strict=True)
            if isinstance(base.get_submodule(n), nn.Embedding)
        ),
    )


def _plain_attributes(module: nn.Module) -> tuple[tuple[str, object], ...]:
    plain = (str, int, float, bool, type(None))
    return tuple(
        (k, v) for k, v in vars(module).items() if not k.startswith("_") and k != "training" and isinstance(v, plain)
    )


def _present(model: nn.Module, fqn: str) -> bool:
    """Whether this stage holds the module ``fqn`` (the splitter sets the pieces of other stages to ``None``)."""
    parent, _, name = fqn.rpartition(".")
    return (model.get_submodule(parent) if parent else model)._modules.get(name) is not None


class _PassThrough(nn.Module):
    """Stands in for a layer another stage owns: hands its hidden states on unchanged, and carries that layer's
    plain attributes (a forward may read ``layer.attention_type`` of every layer to pick its mask)."""

    def __init__(self, attributes: tuple[tuple[str, object], ...] = (), as_tuple: bool = False) -> None:
        super().__init__()
        for name, value in attributes:
            setattr(self, name, value)
        self.as_tuple = as_tuple

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> object:
        return (hidden_states,) if self.as_tuple else hidden_states


class _Sided(nn.Module):
    """Stands in for a module called on both sides of the layers: its first ``early`` calls act only on the first
    stage, the later ones only on the last; elsewhere it hands its input on."""

    def __init__(self, module: nn.Module, early: int, first: bool, last: bool) -> None:
        super().__init__()
        self.module, self.early, self.first, self.last = module, early, first, last
        self.calls = 0

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> object:
        acts = self.first if self.calls < self.early else self.last
        self.calls += 1
        return self.module(x, *args, **kwargs) if acts else x


class _NoEmbedding(nn.Module):
    """Stands in for an embedding of the first stage on later ones: a 0-dim zero, so ``hidden + embedding(...)``
    leaves the received hidden states as they are (a 0-dim operand changes neither their shape nor dtype)."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        return torch.zeros((), device=tensors[0].device if tensors else None)


@contextlib.contextmanager
def _stage_view(
    model: nn.Module, layout: PipelineLayout, owned: dict[int, nn.Module], first: bool, last: bool
) -> Iterator[None]:
    """Temporarily make ``model`` (a stage, or the dense model in the composition check) compute one stage."""
    saved = []

    def swap(fqn: str, new: nn.Module) -> None:
        parent, _, name = fqn.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        saved.append((owner, name, owner._modules[name]))
        owner._modules[name] = new

    for fqn in () if first else layout.before:
        swap(fqn, _NoEmbedding() if fqn in layout.embeddings else nn.Identity())
    for fqn in () if last else layout.after:
        swap(fqn, nn.Identity())
    for fqn, early in () if first and last else layout.both_sides:
        swap(fqn, _Sided(model.get_submodule(fqn), early, first, last))
    stand_ins = [
        owned.get(i) or _PassThrough(layout.layer_attributes[i], layout.layer_returns_tuple)
        for i in range(layout.num_layers)
    ]
    swap(layout.container, nn.ModuleList(stand_ins))
    try:
        yield
    finally:
        for owner, name, module in reversed(saved):
            owner._modules[name] = module


def _run_stage(
    model: nn.Module,
    layout: PipelineLayout,
    owned: dict[int, nn.Module],
    first: bool,
    last: bool,
    x: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    inputs = {"input_ids" if first else "inputs_embeds": x, "attention_mask": attention_mask, "use_cache": False}
    with _stage_view(model, layout, owned, first, last):
        if last:  # the model class's own forward: final norm, head and whatever it applies to the logits
            own = super(_DecoderStage, model).forward if isinstance(model, _DecoderStage) else model.forward
            return own(**inputs).logits
        return model.get_submodule(layout.base)(**inputs).last_hidden_state


def decoder_stage_forward(self: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One stage of a causal LM split by :func:`pipeline_layout`: token ids (first stage) or hidden states in,
    hidden states or (last stage) logits out."""
    layout: PipelineLayout = self.meshpar_layout
    layers = self.get_submodule(layout.container)
    owned = {int(key): layer for key, layer in layers._modules.items()}
    first = all(_present(self, name) for name in layout.before)
    last = self.meshpar_last_stage
    return _run_stage(self, layout, owned, first, last, x, attention_mask)


def check_stage_composition(
    model: nn.Module, layout: PipelineLayout, stage_layers: Sequence[Sequence[str]], first_modules: Sequence[str]
) -> None:
    """Raise unless the stages, run one after another on the dense model with :func:`decoder_stage_forward`'s
    logic, give the dense model's logits on a small padded batch: a forward step that transformers' pipeline plan
    does not describe (scaling the embeddings in the base model's forward, say) would otherwise be repeated or lost
    on some stage, silently."""
    misplaced = [n for n in layout.before if n not in first_modules and n not in layout.keep]
    if misplaced:
        raise ValueError(
            f"{type(model).__name__}: {misplaced} run before the layers in transformers' pipeline plan but are "
            "registered after them, so the splitter would give them to the last stage; use pipeline_parallel_size 1"
        )
    vocab = getattr(model.config, "vocab_size", 2)
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding exercises the model's own mask building on every stage
    device = next(iter(model.parameters())).device
    ids, mask = ids.to(device), mask.to(device)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    container = model.get_submodule(layout.container)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            x = ids
            for stage, keys in enumerate(stage_layers):
                owned = {int(k): container[int(k)] for k in keys}
                x = _run_stage(model, layout, owned, stage == 0, stage == len(stage_layers) - 1, x, mask)
    except Exception as error:  # the forward needs something a stage does not have
        raise ValueError(
            f"{type(model).__name__}: its forward cannot run stage by stage ({type(error).__name__}: {error}); use "
            "pipeline_parallel_size 1"
        ) from error
    finally:
        for module, training in modes:
            module.training = training
    error = ((x.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    if x.shape != want.shape or error > 1e-5:
        raise ValueError(
            f"{type(model).__name__}: its pipeline stages do not reproduce the dense forward (relative error "
            f"{error:.1e}): its forward does something its pipeline plan (transformers', or read from its "
            "modules) does not describe; use pipeline_parallel_size 1"
        )


def install_decoder_stage(stage: nn.Module, layout: PipelineLayout) -> nn.Module:
    """Give a stage of a causal LM split by :func:`pipeline_layout` its forward (the user's attention
    implementation is kept)."""
    stage.meshpar_layout = layout
    stage.meshpar_last_stage = stage.get_output_embeddings() is not None
    return mix_into(stage, _DecoderStage, "PipelineStage")


class _DecoderStage:
    forward = decoder_stage_forward
