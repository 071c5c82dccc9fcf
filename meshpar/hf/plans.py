"""Tensor-parallel plans for HuggingFace models: GPT-2, BERT and Llama families, user plans and an automatic plan.

A plan is a dict ``module FQN pattern -> style`` for ``parallelize_module``, plus the attribute fix-ups the model's
attention needs afterwards (GPT-2 splits its fused QKV output by ``split_size``, which becomes per rank). Embedding
and LM head are vocab-parallel; the head emits vocab-sharded logits for :func:`meshpar.parallel_cross_entropy`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from transformers.pytorch_utils import Conv1D

from meshpar._compat import DeviceMesh, DTensor, ParallelStyle
from meshpar.hf.conv1d import ColumnParallelConv1D, RowParallelConv1D
from meshpar.tensor_parallel import (
    ColumnParallel,
    GatherSequenceInput,
    ReplicatedKV,
    RowParallel,
    SequenceParallelNorm,
    VocabParallel,
    gather_from_tp,
    scatter_to_sp,
)
from meshpar.tensor_parallel._init import check_divisible


class Conv1DColumn(ParallelStyle):
    def __init__(
        self,
        *,
        fused: int = 1,
        gather_output: bool = False,
        num_heads: int | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.fused, self.gather_output, self.num_heads = fused, gather_output, num_heads
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not Conv1D:
            raise TypeError(f"Conv1DColumn applies to transformers Conv1D, got {type(module).__name__}")
        if self.num_heads is not None:
            check_divisible(self.num_heads, device_mesh.size(), "the number of attention heads", "Conv1DColumn")
        return ColumnParallelConv1D.from_conv1d(
            module, device_mesh, fused=self.fused, gather_output=self.gather_output,
            sequence_parallel=self.sequence_parallel,
        )  # fmt: skip


class Conv1DRow(ParallelStyle):
    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not Conv1D:
            raise TypeError(f"Conv1DRow applies to transformers Conv1D, got {type(module).__name__}")
        return RowParallelConv1D.from_conv1d(module, device_mesh, sequence_parallel=self.sequence_parallel)


class ScatterSequenceInput(ParallelStyle):
    """Enter the sequence-parallel region at the first transformer layer: its hidden-states input (full sequence,
    replicated) is split into this rank's sequence shard. Embeddings and masks before it see the full sequence."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def scatter(_module: nn.Module, args: tuple, kwargs: dict) -> tuple:
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
    task: str  # "causal_lm", "masked_lm", "sequence_classification" or "base"
    styles: dict[str, ParallelStyle]
    fixups: list[Callable[[nn.Module, int], None]] = field(default_factory=list)
    ties: list[tuple[str, str]] = field(default_factory=list)  # (target param FQN, source param FQN)
    layers: str = ""  # FQN of the transformer layer container (pipeline splitting)


def _gpt2_fix_attention(model: nn.Module, tp: int) -> None:
    for module in model.modules():
        if type(module).__name__ == "GPT2Attention":
            module.split_size //= tp
            module.num_heads //= tp


def _sequence_parallel_styles(layers: str, norms: list[str], final_norm: str) -> dict[str, ParallelStyle]:
    """Scatter into the first layer, norms on shards, gather after the final norm (the LM head is column-parallel
    over the vocabulary on the full sequence)."""
    styles: dict[str, ParallelStyle] = {f"{layers}.0": ScatterSequenceInput()}
    styles.update({norm: SequenceParallelNorm() for norm in norms})
    styles[final_norm] = SequenceParallelFinalNorm()
    return styles


def _causal_lm_head(model: nn.Module, styles: dict, embedding: str) -> tuple[str, list[tuple[str, str]]]:
    """A vocab-parallel LM head (uneven vocabularies allowed), tied to ``embedding`` when the model ties them."""
    if not hasattr(model, "lm_head"):
        return "base", []
    styles["lm_head"] = ColumnParallel(allow_uneven=True)
    tied = model.lm_head.weight is model.get_parameter(embedding)
    return "causal_lm", [("lm_head.weight", embedding)] if tied else []


def gpt2_plan(model: nn.Module, tp: int, sp: bool = False) -> HFPlan:
    config = model.config
    check_divisible(config.n_head, tp, "the number of attention heads (n_head)", "GPT-2 plan")
    prefix = "transformer." if hasattr(model, "transformer") else ""
    styles: dict[str, ParallelStyle] = {
        f"{prefix}wte": VocabParallel(),
        f"{prefix}h.*.attn.c_attn": Conv1DColumn(fused=3, num_heads=config.n_head, sequence_parallel=sp),
        f"{prefix}h.*.attn.c_proj": Conv1DRow(sequence_parallel=sp),
        f"{prefix}h.*.mlp.c_fc": Conv1DColumn(sequence_parallel=sp),
        f"{prefix}h.*.mlp.c_proj": Conv1DRow(sequence_parallel=sp),
    }
    if sp:
        norms = [f"{prefix}h.*.ln_1", f"{prefix}h.*.ln_2"]
        styles.update(_sequence_parallel_styles(f"{prefix}h", norms, f"{prefix}ln_f"))
    task, ties = _causal_lm_head(model, styles, "transformer.wte.weight")
    return HFPlan("gpt2", task, styles, [_gpt2_fix_attention], ties, f"{prefix}h")


def llama_plan(model: nn.Module, tp: int, sp: bool = False) -> HFPlan:
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    check_divisible(heads, tp, "the number of attention heads", "Llama plan")
    replicate_kv = kv_heads % tp != 0
    if replicate_kv and tp % kv_heads != 0:
        raise ValueError(
            f"Llama plan: {kv_heads} key/value heads can neither be split over tp={tp} nor replicated evenly; "
            f"use a tp that divides {kv_heads} or is a multiple of it"
        )
    if replicate_kv and sp:
        raise ValueError(
            "Llama plan: sequence parallelism with replicated KV heads is not supported; use tp <= kv heads"
        )
    prefix = "model." if hasattr(model, "model") else ""
    # Under SP, attention and MLP each all-gather their input once (Llama reshapes by the input's sequence length)
    # and their column projections take the gathered input as is.
    gathered = {"input_gathered": sp}
    kv_style = ReplicatedKV(num_kv_heads=kv_heads) if replicate_kv else ColumnParallel(num_heads=kv_heads, **gathered)
    styles: dict[str, ParallelStyle] = {
        f"{prefix}embed_tokens": VocabParallel(),
        f"{prefix}layers.*.self_attn.q_proj": ColumnParallel(num_heads=heads, **gathered),
        f"{prefix}layers.*.self_attn.k_proj": kv_style,
        f"{prefix}layers.*.self_attn.v_proj": kv_style,
        f"{prefix}layers.*.self_attn.o_proj": RowParallel(sequence_parallel=sp),
        f"{prefix}layers.*.mlp.gate_proj": ColumnParallel(**gathered),
        f"{prefix}layers.*.mlp.up_proj": ColumnParallel(**gathered),
        f"{prefix}layers.*.mlp.down_proj": RowParallel(sequence_parallel=sp),
    }
    if sp:
        styles[f"{prefix}layers.*.self_attn"] = GatherSequenceInput()
        styles[f"{prefix}layers.*.mlp"] = GatherSequenceInput()
        norms = [f"{prefix}layers.*.input_layernorm", f"{prefix}layers.*.post_attention_layernorm"]
        styles.update(_sequence_parallel_styles(f"{prefix}layers", norms, f"{prefix}norm"))
    task, ties = _causal_lm_head(model, styles, "model.embed_tokens.weight")
    fixups = [_llama_fix_kv_groups] if replicate_kv else []
    return HFPlan("llama", task, styles, fixups, ties, f"{prefix}layers")


def _llama_fix_kv_groups(model: nn.Module, tp: int) -> None:
    """With replicated KV heads each rank holds one KV head for all its query heads."""
    for module in model.modules():
        if type(module).__name__ == "LlamaAttention":
            module.num_key_value_groups = module.config.num_attention_heads // tp


class GatherSequenceOutput(ParallelStyle):
    """Leave the sequence-parallel region after this module (BERT's last encoder layer): its output is gathered to
    the full sequence for the replicated heads; backward keeps this rank's chunk of the (complete) grad."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda _m, _args, out: gather_from_tp(out, device_mesh, 1))
        return module


def bert_plan(model: nn.Module, tp: int, sp: bool = False) -> HFPlan:
    config = model.config
    heads = config.num_attention_heads
    check_divisible(heads, tp, "the number of attention heads", "BERT plan")
    prefix = "bert." if hasattr(model, "bert") else ""
    layer = f"{prefix}encoder.layer.*."
    gathered = {"input_gathered": sp}
    styles: dict[str, ParallelStyle] = {
        f"{prefix}embeddings.word_embeddings": VocabParallel(),
        f"{layer}attention.self.query": ColumnParallel(num_heads=heads, **gathered),
        f"{layer}attention.self.key": ColumnParallel(num_heads=heads, **gathered),
        f"{layer}attention.self.value": ColumnParallel(num_heads=heads, **gathered),
        f"{layer}attention.output.dense": RowParallel(sequence_parallel=sp),
        f"{layer}intermediate.dense": ColumnParallel(sequence_parallel=sp),
        f"{layer}output.dense": RowParallel(sequence_parallel=sp),
    }
    if sp:  # post-norm blocks: both LayerNorms act on sequence shards; heads after the encoder see the full sequence
        styles[f"{layer}attention.self"] = GatherSequenceInput()
        styles[f"{layer}attention.output.LayerNorm"] = SequenceParallelNorm()
        styles[f"{layer}output.LayerNorm"] = SequenceParallelNorm()
        styles[f"{prefix}encoder.layer.0"] = ScatterSequenceInput()
        styles[f"{prefix}encoder.layer.{config.num_hidden_layers - 1}"] = GatherSequenceOutput()
    task, ties = "base", []
    name = type(model).__name__
    if name == "BertForMaskedLM":
        styles["cls.predictions.decoder"] = ColumnParallel(allow_uneven=True)
        task = "masked_lm"
        ties.append(("cls.predictions.bias", "cls.predictions.decoder.bias"))
        if model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight:
            ties.append(("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"))
    elif name == "BertForSequenceClassification":
        task = "sequence_classification"
    return HFPlan("bert", task, styles, [], ties, f"{prefix}encoder.layer")


_FAMILIES = {"gpt2": gpt2_plan, "llama": llama_plan, "bert": bert_plan}

_COLUMN_NAMES = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "gate_proj", "up_proj", "fc1", "c_fc", "wi")
_ROW_NAMES = ("o_proj", "out_proj", "down_proj", "fc2", "wo", "c_proj")


def automatic_plan(model: nn.Module, tp: int, sp: bool = False) -> HFPlan:
    """Guess a plan from module names: attention q/k/v and MLP up projections are column-parallel, attention output
    and MLP down projections row-parallel, everything else replicated. Raises where a layer cannot be classified."""
    if sp:
        raise ValueError("config key 'sequence_parallel': the automatic plan does not support it; pass plan={...}")
    styles: dict[str, ParallelStyle] = {}
    undecided = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, (nn.Linear, Conv1D)) or "lm_head" in name or "classifier" in name:
            continue
        if leaf in _COLUMN_NAMES:
            styles[name] = ColumnParallel() if isinstance(module, nn.Linear) else Conv1DColumn()
        elif leaf in _ROW_NAMES:
            styles[name] = RowParallel() if isinstance(module, nn.Linear) else Conv1DRow()
        elif leaf == "dense":
            parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
            styles[name] = RowParallel() if parent == "output" else ColumnParallel()
        elif isinstance(module, Conv1D) and leaf == "c_attn":
            undecided.append(f"{name} (fused QKV: register a family plan)")
        else:
            undecided.append(name)
    if undecided:
        raise ValueError(
            f"automatic plan cannot decide how to shard {undecided[:8]} of {type(model).__name__}; pass plan={{...}}"
        )
    if not styles:
        raise ValueError(f"automatic plan found no attention or MLP projections in {type(model).__name__}")
    return HFPlan("auto", "base", styles)


def plan_for(model: nn.Module, tp: int, sequence_parallel: bool = False) -> HFPlan:
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family in _FAMILIES:
        return _FAMILIES[family](model, tp, sequence_parallel)
    return automatic_plan(model, tp, sequence_parallel)


def apply_ties(model: nn.Module, ties: list[tuple[str, str]]) -> None:
    """Point tied parameters at the one sharded parameter (sharding each copy separately would untie them)."""
    for target, source in ties:
        owner_name, _, attr = target.rpartition(".")
        src_owner, _, src_attr = source.rpartition(".")
        setattr(model.get_submodule(owner_name), attr, getattr(model.get_submodule(src_owner), src_attr))


def plan_summary(model: nn.Module, styles: dict[str, ParallelStyle]) -> str:
    """Which module got which style and placements, and parameters held per rank vs the dense model."""
    lines, local_total, global_total = [], 0, 0
    seen = set()
    for name, module in model.named_modules():
        style = next((s for pattern, s in styles.items() if fnmatch.fnmatch(name, pattern)), None)
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
