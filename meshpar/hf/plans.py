"""Which tensor-parallel plan a HuggingFace model gets: the user's, else the one its family ships (transformers' own,
or meshpar's table in the same format: :mod:`meshpar.hf.hf_plan`), mapped onto meshpar's styles.

A plan is a dict ``module FQN pattern -> style`` for ``parallelize_module``, plus the attribute fix-ups the model's
attention needs afterwards (GPT-2 splits its fused QKV output by ``split_size``, which becomes per rank). Embedding
and token heads (causal and masked LM) are vocab-parallel; the head emits vocab-sharded logits for
:func:`meshpar.parallel_cross_entropy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from meshpar._compat import DeviceMesh, DTensor, ParallelStyle
from meshpar.hf.experts import (
    ExpertsOverTP,
    capacity_refusal,
    identity_capacity_refusal,
    identity_split_refusal,
    takes_token_blocks,
)
from meshpar.hf.hf_plan import (
    attention_heads,
    base_model_name,
    check_heads,
    embedding_and_head,
    expert_count,
    fqn_matches,
    hf_tp_plan,
    identity_expert_count,
    kv_group_fixup,
    layer_container,
    resolve_entries,
)
from meshpar.hf.sequence_parallel import sequence_parallel_styles
from meshpar.hf.stages import inferred_pipeline_layout, pipeline_layout
from meshpar.tensor_parallel import (
    ColumnParallel,
    SequenceParallelNorm,
    VocabParallel,
    gather_from_tp,
    scatter_to_sp,
)
from meshpar.tensor_parallel.style import describe_style


class ScatterSequenceInput(ParallelStyle):
    """Enter the sequence-parallel region at the first transformer layer: its hidden-states input (full sequence,
    replicated) is split into this rank's sequence shard. Embeddings and masks before it see the full sequence."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def scatter(_module: nn.Module, args: tuple, kwargs: dict) -> tuple:
            if not args:  # hidden states passed by keyword
                return args, {**kwargs, "hidden_states": scatter_to_sp(kwargs["hidden_states"], device_mesh, 1)}
            return (scatter_to_sp(args[0], device_mesh, 1), *args[1:]), kwargs

        module.register_forward_pre_hook(scatter, with_kwargs=True)
        return module


class SequenceParallelFinalNorm(ParallelStyle):
    """The final norm runs on sequence shards and hands the full sequence back (HF models reshape the last hidden
    states with the full sequence length before the LM head). Its backward keeps this rank's chunk of the grad,
    which the LM head's input all-reduce has already made complete."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        SequenceParallelNorm()._apply(module, device_mesh)
        module.register_forward_hook(lambda _m, _args, out: gather_from_tp(out, device_mesh, 1))
        return module


@dataclass
class HFPlan:
    """What ``parallelize`` needs to know about one model family."""

    family: str
    # "causal_lm", "masked_lm", "seq2seq_lm", "token_classification", "sequence_classification", "multiple_choice",
    # "question_answering" or "base" (the model's own loss)
    task: str
    styles: dict[str, ParallelStyle]
    fixups: list[Callable[[nn.Module, int], None]] = field(default_factory=list)
    ties: list[tuple[str, str]] = field(default_factory=list)  # (target param FQN, source param FQN)
    layers: str = ""  # FQN of the transformer layer container (pipeline splitting)
    verify: bool = False  # prove the plan against the dense model at parallelize time (plans not meshpar's own)
    sequence_parallel: bool = False  # blocks take and return sequence shards (the verification splits their input)
    head: str = ""  # FQN of the LM head when it emits vocab-sharded logits (the loss is then vocab-parallel)

    def __str__(self) -> str:
        """The plan as it runs: every FQN pattern with its style and arguments, the fix-ups, ties and the rest; what
        ``parallelize`` logs, and what a user reads before editing it and passing it back as ``plan=``."""
        lines = [f"{self.family} ({self.task}) tensor-parallel plan:"]
        lines += [f"  {pattern}: {describe_style(style)}" for pattern, style in self.styles.items()] or ["  (nothing)"]
        if self.fixups:
            lines += ["fix-ups after sharding:", *(f"  {fixup}" for fixup in self.fixups)]
        if self.ties:
            lines += ["tied (one parameter, saved once):", *(f"  {target} = {source}" for target, source in self.ties)]
        lines.append(f"layers: {self.layers or '-'}; vocab-parallel head: {self.head or '-'}")
        lines.append(f"sequence parallel: {self.sequence_parallel}; verified against dense: {self.verify}")
        return "\n".join(lines)


def _seq2seq_lm_classes() -> set[str]:
    """The class names of transformers' sequence-to-sequence language models."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    names = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values()
    return {n for name in names for n in ((name,) if isinstance(name, str) else name)}


def task_of(model: nn.Module) -> str:
    """Which loss meshpar computes from the model's logits, by the HF head class."""
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel", "DoubleHeadsModel")):
        # GPT-2's double heads: its ``loss`` is the language model's (the multiple-choice loss is returned apart)
        return "causal_lm"
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) and (
        name.endswith("ForConditionalGeneration") or name in _seq2seq_lm_classes()
    ):  # (Marian's is MarianMTModel)
        return "seq2seq_lm"  # the decoder's logits score the labels as they are (the model shifts them in)
    if name.endswith("ForTokenClassification"):
        return "token_classification"  # a label per token, -100 unscored: normalised over the global batch too
    if name.endswith("ForSequenceClassification"):
        return "sequence_classification"  # per-example heads: meshpar's RowLoss, over the global batch's rows
    if name.endswith("ForMultipleChoice"):
        return "multiple_choice"
    if name.endswith("ForQuestionAnswering"):
        return "question_answering"
    return "masked_lm" if name.endswith("ForMaskedLM") else "base"


def _vocab_head(model: nn.Module, styles: dict[str, ParallelStyle]) -> str:
    """The LM head's FQN when the plan makes it emit vocab-sharded logits (column-parallel, not gathered)."""
    _, head, _ = embedding_and_head(model)
    style = styles.get(head) if head else None
    return head if isinstance(style, ColumnParallel) and not style.gather_output else ""


def _embedding_aliases(model: nn.Module, embedding: str) -> list[str]:
    """Other ``nn.Embedding`` modules holding the input embedding's weight (T5's encoder and decoder each keep an
    ``embed_tokens`` tied to the shared one): sharded like it, their weight tied to its shards."""
    weight = model.get_submodule(embedding).weight
    return [
        name
        for name, module in model.named_modules(remove_duplicate=False)
        if name != embedding and isinstance(module, nn.Embedding) and module.weight is weight
    ]


def _head_ties(model: nn.Module) -> list[tuple[str, str]]:
    """(LM head weight, input embedding weight) when the model ties them: one parameter, saved once; and (other
    name, head parameter) for a head parameter the model also registers elsewhere (BERT's MLM bias, which
    ``cls.predictions`` holds as ``bias``, its decoder as ``decoder.bias``): sharding the head shards it there too."""
    embedding, head, tied = embedding_and_head(model)
    ties = [(f"{head}.weight", f"{embedding}.weight")] if tied else []
    aliases = [f"{alias}.weight" for alias in (_embedding_aliases(model, embedding) if embedding else [])]
    ties += [(alias, f"{embedding}.weight") for alias in aliases]
    if head is not None:
        owners: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), []).append(name)
        for local, param in model.get_submodule(head).named_parameters(recurse=False):
            ties += [
                (other, f"{head}.{local}")
                for other in owners[id(param)]
                if not other.startswith(f"{head}.") and other not in aliases  # tied to the embedding above
            ]
    return [(target, source) for target, source in ties if target != f"{embedding}.weight"]


def _check_ties(model: nn.Module, plan: HFPlan) -> None:
    """Tied embedding and head share one parameter: sharding only one of them would untie them."""
    for target, source in plan.ties:
        if not target.endswith(".weight"):  # a head's bias registered twice follows the head
            continue
        owners = [name.rpartition(".")[0] for name in (target, source)]
        sharded = [any(fqn_matches(pattern, owner) for pattern in plan.styles) for owner in owners]
        if sharded[0] != sharded[1]:
            raise ValueError(
                f"{type(model).__name__}: {target} is tied to {source}, but the plan shards only "
                f"{owners[sharded.index(True)]}; give both the same vocab-parallel style or neither"
            )


def _output_module(model: nn.Module) -> str | None:
    """FQN of the model's output embeddings, whatever their type."""
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    if out is None:
        return None
    return next((name for name, module in model.named_modules() if module is out), None)


def metadata_plan(model: nn.Module, tp: int, sp: bool = False) -> HFPlan:
    """The plan the model's family ships (transformers' ``tp_plan``, else meshpar's table in the same format),
    mapped onto meshpar's styles, with a vocab-parallel input embedding and LM head (see
    :mod:`meshpar.hf.hf_plan`)."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    entries = hf_tp_plan(model)
    replicate_kv = check_heads(model.config, entries, tp, model_type)
    if sp and replicate_kv:
        raise ValueError(
            f"{model_type}: sequence parallelism with key/value heads replicated over tp is not supported; use a tp "
            "that divides the key/value heads, or turn 'sequence_parallel' off"
        )
    embedding, head, tied = embedding_and_head(model)
    task = task_of(model)
    # meshpar's own embedding and head styles replace the plan's (transformers gathers full-vocabulary logits); a head
    # that is no plain Linear (Dory's adds a per-token logit scale) stays whole: full logits, the plain loss
    entries = {p: s for p, s in entries.items() if p not in (embedding, head, _output_module(model))}
    styles, fixups = resolve_entries(model, entries, tp, replicate_kv=replicate_kv)
    token_head = task in ("causal_lm", "masked_lm", "seq2seq_lm")  # logits per token: vocab-parallel, parallel loss
    if head is not None and token_head:
        # a bias the model adds to the whole vocabulary's logits after the head (BART's final_logits_bias) needs them
        # whole: the head's shards are gathered, the loss is the plain one
        gathered = isinstance(getattr(model, "final_logits_bias", None), torch.Tensor)
        styles[head] = ColumnParallel(allow_uneven=True, gather_output=gathered)
    if embedding is not None and (not tied or token_head):
        styles[embedding] = VocabParallel()
        for alias in _embedding_aliases(model, embedding):  # T5's encoder / decoder embed_tokens: one weight
            styles[alias] = VocabParallel()
    if replicate_kv:
        fixups.append(kv_group_fixup(attention_heads(model.config)[0]))
    layers = layer_container(model)
    if sp:
        try:  # what runs after the layers (the final norm), from the pipeline layout
            layout = pipeline_layout(model) or inferred_pipeline_layout(model)
        except ValueError:  # a pipeline plan that does not describe the model: no final norm is known
            layout = None
        # base-model modules after the layers (no head); a model without an LM head: those registered after them
        final = list(layout.stage_sides(model)[1]) if layout is not None else _registered_after(model, layers)
        styles = sequence_parallel_styles(
            model, styles, layers, final, ScatterSequenceInput(), SequenceParallelFinalNorm()
        )
    return HFPlan(model_type, task, styles, fixups, _head_ties(model), layers, verify=True, sequence_parallel=sp)


def _registered_after(model: nn.Module, layers: str) -> list[str]:
    """The base model's modules holding parameters registered after the one holding the layer list (BERT's
    pooler), as full FQNs."""
    base = base_model_name(model)
    if not base or not layers.startswith(f"{base}."):
        return []
    holder = layers[len(base) + 1 :].split(".")[0]
    names = [n for n, _ in model.get_submodule(base).named_children()]
    after = names[names.index(holder) + 1 :] if holder in names else []
    return [f"{base}.{n}" for n in after if any(True for _ in model.get_submodule(f"{base}.{n}").parameters())]


def user_plan(model: nn.Module, plan: dict[str, object], tp: int) -> HFPlan:
    """A plan the user passed: it replaces meshpar's entirely (nothing automatic is built or checked first). Values
    are meshpar or torch ``ParallelStyle`` objects, transformers style strings (``"colwise"``, ``"rowwise"``, ...)
    or fix-ups ``fn(module, tp)`` run on every matching module after sharding (e.g. dividing an attention's
    ``num_heads`` by tp: :func:`meshpar.hf.hf_plan.divide_attribute`)."""
    names = [name for name, _ in model.named_modules()]
    unmatched = [pattern for pattern in plan if not any(fqn_matches(pattern, name) for name in names)]
    if unmatched:
        raise ValueError(f"plan entries {unmatched[:6]} match no module of {type(model).__name__}")
    styles, fixups = resolve_entries(model, plan, tp, replicate_kv=False)
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    return HFPlan(model_type, task_of(model), styles, fixups, _head_ties(model), layer_container(model), verify=True)


def _sizes(layout: object, sequence_parallel: bool) -> tuple[int, bool]:
    """(tp, sequence parallelism) from a tp size, a ``parallelize`` config (dict or ``ParallelConfig``) or a
    ``ParallelDims``."""
    if isinstance(layout, int):
        return layout, sequence_parallel
    if isinstance(layout, dict):
        return int(layout.get("tensor_parallel_size", 1)), bool(layout.get("sequence_parallel", sequence_parallel))
    if hasattr(layout, "tensor_parallel_size"):
        return layout.tensor_parallel_size, bool(getattr(layout, "sequence_parallel", sequence_parallel))
    if hasattr(layout, "tp"):
        return layout.tp, sequence_parallel
    raise TypeError(f"plan_for takes a tp size, a parallelize config or a ParallelDims, got {type(layout).__name__}")


def plan_for(
    model: nn.Module,
    layout: int | dict | object,
    sequence_parallel: bool = False,
    plan: dict[str, object] | HFPlan | None = None,
) -> HFPlan:
    """The complete plan ``parallelize`` applies to ``model`` for ``layout`` (a tp size, the config dict given to
    ``parallelize``, or a ``ParallelDims``): every module's style with its arguments, the fix-ups, ties and sequence
    parallel regions. ``print`` it to read it; pass it (or an edited copy) back as ``parallelize(..., plan=...)``
    and it is applied unchanged.

    It is the user's ``plan`` if given (a dict, or an ``HFPlan`` as returned here); else the plan the family ships
    (transformers' own, or meshpar's table in the same format: GPT-2, BERT, OPT, GPT-J); at tp=1 nothing needs
    sharding. A model with none of these is refused: meshpar does not guess from module names."""
    tp, sequence_parallel = _sizes(layout, sequence_parallel)
    ep = _expert_parallel_size(layout)
    capacity = _expert_capacity(layout)
    experts_over_tp = _expert_setting(layout, "expert_tensor_parallel_size", None) in (None, tp)
    if isinstance(plan, HFPlan):
        _check_ties(model, plan)
        return plan
    if plan is not None:
        built = user_plan(model, plan, tp)
    else:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if tp == 1 and not sequence_parallel and ep == 1 and capacity is None:  # dp and pp need no plan
            name = model_type or type(model).__name__
            built = HFPlan(name, task_of(model), {}, ties=_head_ties(model), layers=layer_container(model))
        elif tp == 1 and not sequence_parallel and hf_tp_plan(model):  # ep or token dropping alone: the experts
            built = metadata_plan(model, tp)
            built.styles = {p: style for p, style in built.styles.items() if isinstance(style, ExpertsOverTP)}
            built.fixups = []
        elif hf_tp_plan(model):
            built = metadata_plan(model, tp, sequence_parallel)
        else:
            raise ValueError(
                f"{type(model).__name__} (model type {model_type!r}) has neither a tensor-parallel plan in the "
                f"installed transformers nor a meshpar table: pass plan={{module FQN pattern: style}} "
                "(docs/hf-models.md: 'A plan for a model no table covers'), or use tp=1"
            )
    built.head = _vocab_head(model, built.styles)
    _check_ties(model, built)
    if ep > 1 or capacity is not None:
        _check_expert_parallel(model, built, ep, tp if experts_over_tp else 1, capacity is not None)
    for style in built.styles.values():
        if isinstance(style, ExpertsOverTP):
            if capacity is not None:
                style.capacity_factor, style.drop_policy = capacity
            style.split_over_tp = experts_over_tp
    return built


def _expert_setting(layout: object, key: str, default: object) -> object:
    """A key of a ``parallelize`` config (a dict or a :class:`ParallelConfig`); ``default`` for other layouts."""
    return layout.get(key, default) if isinstance(layout, dict) else getattr(layout, key, default)


def _expert_capacity(layout: object) -> tuple[float, str] | None:
    """(capacity factor, drop policy) from a ``parallelize`` config, ``None`` for dropless experts."""
    factor = _expert_setting(layout, "expert_capacity_factor", None)
    return None if factor is None else (float(factor), _expert_setting(layout, "expert_drop_policy", "probs"))


def _expert_parallel_size(layout: object) -> int:
    """From a config, or a ``ParallelDims`` (its ``ep``)."""
    return int(_expert_setting(layout, "expert_parallel_size", getattr(layout, "ep", 1)))


def _check_expert_parallel(model: nn.Module, plan: HFPlan, ep: int, tp: int, dropping: bool = False) -> None:
    """Expert parallelism (and token dropping) needs experts modules in the plan, and whole experts for every one
    of the ep x tp ranks (checked before any process group exists)."""
    experts = [pattern for pattern, style in plan.styles.items() if isinstance(style, ExpertsOverTP)]
    if not experts:
        asked = f"expert_parallel_size={ep}" if ep > 1 else "expert_capacity_factor"
        raise ValueError(
            f"{asked}: {type(model).__name__} has no experts module in its plan (expert parallelism and token dropping "
            "apply to the stacked experts of a mixture-of-experts model); leave them unset"
        )
    for name, module in model.named_modules() if dropping else ():
        if any(fqn_matches(pattern, name) for pattern in experts) and takes_token_blocks(module):
            raise ValueError(capacity_refusal(module))
    count, identity = expert_count(model.config), identity_expert_count(model.config)
    if count is not None and count % (ep * tp):
        raise ValueError(
            f"{type(model).__name__}: {count} experts cannot be split into whole experts over ep x tp = {ep} x {tp}; "
            "use an ep x tp that divides the number of experts"
            + (" (or expert_tensor_parallel_size 1: experts split over ep only)" if tp > 1 else "")
        )
    if identity and dropping:
        raise ValueError(identity_capacity_refusal(model))
    if identity and ep > 1 and identity % (ep * tp):
        raise ValueError(identity_split_refusal(model, count, identity, ep * tp))


def plan_summary(model: nn.Module, styles: dict[str, ParallelStyle]) -> str:
    """Which module got which style and placements, and parameters held per rank vs the dense model."""
    lines, local_total, global_total = [], 0, 0
    seen = set()
    for name, module in model.named_modules():
        style = next((s for pattern, s in styles.items() if fqn_matches(pattern, name)), None)
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        for _, p in params:
            seen.add(id(p))
            local_total += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
            global_total += p.numel()
        if style is not None:
            placements = ", ".join(
                f"{n}={tuple(repr(x) for x in p.placements)}" for n, p in params if isinstance(p, DTensor)
            )
            lines.append(f"{name}: {type(style).__name__} [{placements}]")
    lines.append(f"parameters per rank: {local_total:,} of {global_total:,} ({local_total / max(global_total, 1):.1%})")
    return "\n".join(lines)
