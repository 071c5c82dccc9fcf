"""Tensor-parallel plans from a HuggingFace model's own metadata (transformers' ``tp_plan``).

transformers keeps, per model family, ``config.base_model_tp_plan`` (module FQN pattern -> style string) and on each
head class a ``_tp_plan``; ``model.tp_plan`` merges them under full FQNs. This module maps every style string onto
meshpar's DTensor styles and adds what transformers lacks: a vocab-parallel LM head feeding
:func:`meshpar.parallel_cross_entropy` (transformers gathers full-vocabulary logits on every rank), a vocab-parallel
input embedding for every family, key/value heads replicated where tp exceeds them, and head-count checks that need
only the config, so they run before any process group exists. A style meshpar cannot apply exactly is refused with
the modules that use it; nothing is guessed from module names.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from meshpar._compat import DeviceMesh, ParallelStyle
from meshpar._in_place import become
from meshpar.hf.conv1d import on_conv1d
from meshpar.hf.experts import ExpertsOverTP
from meshpar.hf.fixups import gaussian_topk_over_tp
from meshpar.tensor_parallel import ColumnParallel, ReplicatedKV, RowParallel, VocabParallel
from meshpar.tensor_parallel.style import (
    AllReduceOutput,
    LocalParameters,
    PackedColumnParallel,
    ReplicatedGradSum,
    RopeGradSum,
)

# transformers style strings meshpar does not apply yet, with the reason a user reads in the refusal
UNSUPPORTED_STYLES = {
    "packed_colwise": "packed weights as bare parameters outside an experts module",
    "packed_rowwise": "fused (packed) weights split per part along the input",
    "sequence_parallel": "transformers' sequence-parallel style (use meshpar's 'sequence_parallel' config key)",
}

# module styles whose bare parameters may carry their own 'colwise' / 'rowwise' entries: 'local_params' (the
# forward reads this rank's shards: an attention's per-head sinks) and 'all_reduce' (also the output is a partial sum:
# shared experts stored as 3-D parameters)
_OWNER_STYLES = ("local_params", "all_reduce")


def _parameter_dim(style: str, ndim: int) -> int | None:
    """The dim a 'colwise' / 'rowwise' entry splits a bare parameter along, with ``nn.Linear``'s ``[..., out, in]``
    layout for weights: colwise the output features (a 1-D parameter: its only dim), rowwise the input features
    (``None``: a 1-D rowwise parameter, a bias added after the reduction, which meshpar does not place)."""
    if style == "colwise":
        return -2 if ndim >= 2 else -1
    if style == "rowwise" and ndim >= 2:
        return -1
    return None


def _expert_feature_split(style: str, ndim: int) -> tuple[int, int] | None:
    """``(dim, parts)`` splitting an experts module's stacked weight by intermediate features for the plan's style
    of it (``[experts, out, in]`` weights, ``[experts, out]`` biases); ``None`` where no split keeps the output a
    partial sum (a rowwise bias, added after the reduction) or for a style that places no weight."""
    parts = 2 if style == "packed_colwise" else 1
    if style in ("colwise", "packed_colwise") and ndim in (2, 3):
        return (-2 if ndim == 3 else -1, parts)
    if style == "rowwise" and ndim == 3:
        return (-1, 1)
    return None


# the projections whose outputs hold whole attention heads (separate q/k/v or fused), by transformers' names
_QUERY_LIKE = ("q_proj", "query", "qkv_proj", "query_key_value", "Wqkv", "c_attn", "W_pack", "q_lin")
_KEY_VALUE = ("k_proj", "v_proj", "key", "value", "k_lin", "v_lin")
_FUSED_QKV = ("qkv_proj", "query_key_value", "Wqkv", "c_attn", "W_pack")
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
# styles whose output is this rank's feature shard (the ones that split heads)
_LOCAL_OUTPUT = ("colwise", "packed_colwise")


def fqn_matches(pattern: str, name: str) -> bool:
    """``parallelize_module``'s rule: dot-separated atoms, each matched with fnmatch (``*`` is one atom)."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts, strict=True))


def takes_use_cache(model: nn.Module) -> bool:
    """Whether the HF model's forward takes ``use_cache``, by name or through ``**kwargs`` (GraniteMoE's)."""
    params = inspect.signature(type(model).forward).parameters
    return "use_cache" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def folds_choices(model: nn.Module) -> bool:
    """Whether the model's forward folds a ``[batch, choices, seq]`` batch into the base model's batch (HF's
    multiple-choice heads)."""
    return type(model).__name__.endswith("ForMultipleChoice")


@contextlib.contextmanager
def dense_probe(
    model: nn.Module, grad: bool = False, length: int = 4
) -> Iterator[tuple[Callable[..., object], torch.Tensor]]:
    """A forward of the dense model on a tiny batch of token ids (``length`` of them per row), in eval mode with the
    RNG untouched (each module's mode restored after), for reading what it does: yields (the function that runs it,
    with any extra keyword arguments such as labels; the ids)."""
    shape = (1, 2, length) if folds_choices(model) else (1, length)  # a multiple-choice head: [batch, choices, seq]
    ids = torch.randint(0, getattr(model.config, "vocab_size", 2), shape, generator=torch.Generator().manual_seed(0))
    ids = ends_with_eos(model, ids.to(next(iter(model.parameters())).device))
    # an encoder-decoder's decoder runs on the same ids (T5's forward builds no decoder inputs of its own)
    decoder = {"decoder_input_ids": ids} if getattr(model.config, "is_encoder_decoder", False) else {}
    with eval_mode(model), torch.set_grad_enabled(grad), torch.random.fork_rng(devices=[]):
        yield (lambda **extra: model(input_ids=ids, use_cache=False, **decoder, **extra)), ids


def ends_with_eos(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """An encoder-decoder's probe ids with each row ending in its end-of-sequence token, as real inputs do (BART's
    classifiers pool each row's last one and refuse a row without); other models' ids as they are."""
    eos = getattr(model.config, "eos_token_id", None)
    if getattr(model.config, "is_encoder_decoder", False) and isinstance(eos, int):
        ids = ids.clone()
        ids[..., -1] = eos
    return ids


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout) inside, each module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def expert_count(config: object) -> int | None:
    """How many (routed) experts a mixture-of-experts config counts, under whichever name it uses; ``None`` for a
    dense model."""
    text = text_config(config)
    return next((getattr(text, n) for n in _EXPERT_COUNTS if isinstance(getattr(text, n, None), int)), None)


def identity_expert_count(config: object) -> int:
    """How many identity ("zero-computation") experts a config routes to after its real ones (LongCat-Flash's
    ``zero_expert_num``); 0 for the rest."""
    count = getattr(text_config(config), "zero_expert_num", 0)
    return count if isinstance(count, int) and count > 0 else 0


def text_config(config: object) -> object:
    """The language-model part of a composite config (the config itself for plain LMs)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


class ConfigView:
    """A module's view of a shared config with some counts of its own (``overrides``); everything else, writes
    included, goes to the shared config, so a later change there (the attention implementation) still reaches it."""

    def __init__(self, config: object, overrides: dict[str, object]) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_overrides", dict(overrides))

    def __getattr__(self, name: str) -> object:
        state = self.__dict__
        if name.startswith("__") or "_config" not in state:  # copy / pickle probing a half-built view
            raise AttributeError(name)
        if name in state["_overrides"]:
            return state["_overrides"][name]
        return getattr(state["_config"], name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self._config, name, value)

    def __repr__(self) -> str:
        return f"ConfigView({self._overrides}, of {type(self._config).__name__})"


@dataclass(frozen=True)
class divide_attribute:  # noqa: N801 - used like a function in plan dicts
    """A plan fix-up for attentions that reshape with a head count of their own: each rank holds ``1/tp`` of the
    heads, so the count ``name`` is divided by tp (without it the view silently reads features as sequence
    positions). ``config_names``: counts the forward reads from ``module.config`` (Phi-3 slices its packed q/k/v
    with ``config.num_attention_heads``): the module gets a :class:`ConfigView` with those divided. A class rather
    than a closure so that plans pickle."""

    name: str | tuple[str, ...] | None = None  # several: GPT-2's num_heads and split_size
    config_names: tuple[str, ...] = ()

    def __call__(self, module: nn.Module, tp: int) -> None:
        for name in (self.name,) if isinstance(self.name, str) else self.name or ():
            setattr(module, name, getattr(module, name) // tp)
        if self.config_names:
            config = module.config
            module.config = ConfigView(config, {n: getattr(config, n) // tp for n in self.config_names})


def _tp_rank_of(module: nn.Module) -> int:
    """This rank's index on the tp mesh, read off the module's first sharded (DTensor) parameter."""
    for param in module.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            return mesh.get_local_rank()
    raise ValueError(f"{type(module).__name__}: no tensor-parallel parameter to read this rank's tp index from")


@dataclass(frozen=True)
class alibi_heads:  # noqa: N801 - used like a function in plan dicts
    """A plan fix-up for attentions with ALiBi (Bloom, Falcon-RW): the model builds one bias per head for all heads
    (``alibi``, ``[batch * heads, 1, keys]`` or ``[batch, heads, 1, keys]``; Falcon also folds it into a per-head
    ``attention_mask``) and hands it to every layer. Each rank's attention holds ``heads / tp`` contiguous heads (its
    column shard of the projection): the head counts ``names`` are divided by tp and a pre-hook keeps this rank's
    heads' rows of the bias (and of a per-head mask), so every head adds its own slope, as in the dense model."""

    names: tuple[str, ...] = ("num_heads",)

    def __call__(self, module: nn.Module, tp: int) -> None:
        heads = getattr(module, self.names[0])
        for name in self.names:
            setattr(module, name, getattr(module, name) // tp)
        local = heads // tp
        start = _tp_rank_of(module) * local

        def own_heads(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            alibi, mask = kwargs.get("alibi"), kwargs.get("attention_mask")
            if alibi is None:
                return None
            if alibi.dim() == 4:
                alibi = alibi[:, start : start + local]
            else:
                alibi = alibi.unflatten(0, (-1, heads))[:, start : start + local].flatten(0, 1)
            changed = {"alibi": alibi}
            if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == heads and heads > 1:
                changed["attention_mask"] = mask[:, start : start + local]
            return args, {**kwargs, **changed}

        module.register_forward_pre_hook(own_heads, with_kwargs=True)


@dataclass(frozen=True)
class per_head_inputs:  # noqa: N801 - used like a function in plan dicts
    """A plan fix-up for attentions handed a per-head tensor (T5's ``position_bias``, ``[batch, heads, q, k]``,
    computed by the first block and handed on by the model): the head count ``name`` is divided by tp, and a
    per-head input that still holds every head (the first block's own is already this rank's) keeps this rank's
    ``heads / tp`` contiguous heads."""

    name: str
    inputs: tuple[str, ...]

    def __call__(self, module: nn.Module, tp: int) -> None:
        heads = getattr(module, self.name)
        setattr(module, self.name, heads // tp)
        local = heads // tp
        start = _tp_rank_of(module) * local

        def own_heads(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            changed = {
                name: kwargs[name][:, start : start + local]
                for name in self.inputs
                if isinstance(kwargs.get(name), torch.Tensor)
                and kwargs[name].dim() >= 2
                and kwargs[name].shape[1] == heads
                and local != heads
            }
            return (args, {**kwargs, **changed}) if changed else None

        module.register_forward_pre_hook(own_heads, with_kwargs=True)


_BERT_ENCODER = {
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}


def _t5_attention(prefix: str) -> dict[str, object]:
    return {
        f"{prefix}.q": "colwise",
        f"{prefix}.k": "colwise",
        f"{prefix}.v": "colwise",
        f"{prefix}.o": "rowwise",
        f"{prefix}": per_head_inputs("n_heads", ("position_bias",)),
        f"{prefix}.relative_attention_bias": LocalParameters({"weight": 1}),
    }


_T5_STACKS = {
    **_t5_attention("*.block.*.layer.0.SelfAttention"),
    **_t5_attention("decoder.block.*.layer.1.EncDecAttention"),
    # the feed-forward is the last sublayer: 1 in the encoder, 2 in the decoder; gated (wi_0, wi_1) from T5 v1.1 on
    **{
        f"{stack}.block.*.layer.{index}.DenseReluDense.{name}": style
        for stack, index in (("encoder", 1), ("decoder", 2))
        for name, style in (("wi", "colwise"), ("wi_0", "colwise"), ("wi_1", "colwise"), ("wo", "rowwise"))
    },
}

_BART_STACKS = {
    **{
        f"{stack}.layers.*.{attention}.{name}": style
        for stack, attention in (("encoder", "self_attn"), ("decoder", "self_attn"), ("decoder", "encoder_attn"))
        for name, style in (
            ("q_proj", "colwise"),
            ("k_proj", "colwise"),
            ("v_proj", "colwise"),
            ("out_proj", "rowwise"),
        )
    },
    **{
        f"{stack}.layers.*.{name}": style
        for stack in ("encoder", "decoder")
        for name, style in (("fc1", "colwise"), ("fc2", "rowwise"))
    },
}

# meshpar's tables for families the installed transformers ships no plan for: data in transformers' format
# (base-model-relative FQN patterns -> style strings), plus fix-ups fn(module, tp) where the attention keeps a head
# count. Table plans are verified like transformers' plans (meshpar.hf.verify).
TABLES: dict[str, dict[str, str | Callable[[nn.Module, int], None]]] = {
    "opt": {
        "decoder.layers.*.self_attn.q_proj": "colwise",
        "decoder.layers.*.self_attn.k_proj": "colwise",
        "decoder.layers.*.self_attn.v_proj": "colwise",
        "decoder.layers.*.self_attn.out_proj": "rowwise",
        "decoder.layers.*.self_attn": divide_attribute("num_heads"),
        "decoder.layers.*.fc1": "colwise",
        "decoder.layers.*.fc2": "rowwise",
    },
    # GPT-2's linear layers are transformers Conv1D (weight [in, out]); c_attn packs [q | k | v]
    "gpt2": {
        "h.*.attn.c_attn": "packed_colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.attn": divide_attribute(("num_heads", "split_size")),
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    # BERT's post-norm encoder layers (sequence parallelism runs their norms on shards; see sequence_parallel), which
    # RoBERTa and its copies (XLM-R, CamemBERT) share module for module
    **{family: _BERT_ENCODER for family in ("bert", "roberta", "xlm-roberta", "camembert")},
    # ALBERT shares one layer (group) across its depth: sharded once, run at every depth
    "albert": {
        "encoder.albert_layer_groups.*.albert_layers.*.attention.query": "colwise",
        "encoder.albert_layer_groups.*.albert_layers.*.attention.key": "colwise",
        "encoder.albert_layer_groups.*.albert_layers.*.attention.value": "colwise",
        "encoder.albert_layer_groups.*.albert_layers.*.attention.dense": "rowwise",
        "encoder.albert_layer_groups.*.albert_layers.*.ffn": "colwise",
        "encoder.albert_layer_groups.*.albert_layers.*.ffn_output": "rowwise",
    },
    # ELECTRA's discriminator / generator encoders are BERT's layers
    "electra": _BERT_ENCODER,
    # GPT-Neo: the projections sit in attn.attention, which splits heads with its own count
    "gpt_neo": {
        "h.*.attn.attention.q_proj": "colwise",
        "h.*.attn.attention.k_proj": "colwise",
        "h.*.attn.attention.v_proj": "colwise",
        "h.*.attn.attention.out_proj": "rowwise",
        "h.*.attn.attention": divide_attribute("num_heads"),
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    # DistilBERT reshapes with -1 heads: no count to divide
    "distilbert": {
        "transformer.layer.*.attention.q_lin": "colwise",
        "transformer.layer.*.attention.k_lin": "colwise",
        "transformer.layer.*.attention.v_lin": "colwise",
        "transformer.layer.*.attention.out_lin": "rowwise",
        "transformer.layer.*.ffn.lin1": "colwise",
        "transformer.layer.*.ffn.lin2": "rowwise",
    },
    # Bloom packs [q | k | v] per head (GPT-NeoX's layout), so a contiguous column shard holds whole heads; ALiBi's
    # per-head biases follow the heads
    "bloom": {
        "h.*.self_attention.query_key_value": "colwise",
        "h.*.self_attention.dense": "rowwise",
        "h.*.self_attention": alibi_heads(),
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
    # Falcon packs [q | k | v] per head (its original layout) or per key/value group [q ... q | k | v] (the new
    # decoder architecture: Falcon-40B / 180B), both whole heads or groups in a contiguous column shard; its
    # multi-query layout (one key/value head after all query heads, Falcon-7B) is refused by the head check
    "falcon": {
        "h.*.self_attention.query_key_value": "colwise",
        "h.*.self_attention.dense": "rowwise",
        "h.*.self_attention": alibi_heads(("num_heads", "num_kv_heads")),
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
    # BART and the encoder-decoders built like it (mBART, Blenderbot, BlenderbotSmall, Pegasus, Marian): each
    # attention reshapes with -1 heads
    **{family: _BART_STACKS for family in ("bart", "mbart", "blenderbot", "blenderbot-small", "pegasus", "marian")},
    # T5 / mT5 / UMT5: encoder and decoder stacks; each attention reshapes with -1 heads but builds its zero position
    # bias with its own head count; block 0's relative position bias (an embedding [buckets, heads]) is kept per head
    # with the heads, and the later blocks reuse what block 0 computed (this rank's heads)
    **{family: _T5_STACKS for family in ("t5", "mt5", "umt5")},
    "gptj": {
        "h.*.attn.q_proj": "colwise",
        "h.*.attn.k_proj": "colwise",
        "h.*.attn.v_proj": "colwise",
        "h.*.attn.out_proj": "rowwise",
        "h.*.attn": divide_attribute("num_attention_heads"),
        "h.*.mlp.fc_in": "colwise",
        "h.*.mlp.fc_out": "rowwise",
    },
}


# meshpar's corrections to plans transformers ships (same format): entries the shipped plan lacks, each found by the
# verification refusing the plan as shipped; and Megatron's layout where transformers gathers packed outputs
# (proven by the same verification)
# DeepSeek-V2's multi-head latent attention entries: transformers ships them for V2 but not for V3 and the families
# built on its attention, which then stay replicated (all attention weights on every rank); the same MLA module, proven
# by the one-block verification like any plan
_MLA_ATTENTION = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.q_b_proj": "colwise",
    "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
    "layers.*.self_attn.kv_b_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
# packed [gate | up] (GLM, Phi-3): each rank keeps its share of both halves, the down projection takes the local
# features; transformers gathers the packed output and splits it again ('colwise_gather_output' +
# 'rowwise_split_input'): an all-gather per layer and full-size activations on every rank
_PACKED_MLP = {"layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.mlp.down_proj": "rowwise"}
# packed [q | k | v] (Phi-3): each rank keeps its heads of q, k and v; the attention slices q/k/v with the config's
# head count and its own key/value count, both divided by tp
_PACKED_ATTENTION = {
    "layers.*.self_attn.qkv_proj": "packed_colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn": divide_attribute(
        "num_key_value_heads", config_names=("num_attention_heads", "num_key_value_heads")
    ),
}
# Doge's attention gates each key/value head by dt_proj(all of its value features) * A: the shipped rowwise dt_proj
# gives every rank the gates of all heads while it holds half of them; each rank keeps its heads' gates and A's. Its
# per-head q/k norms meet only this rank's heads (their grads are partial over tp), as Qwen3's plan says for its own
# per-head q/k norms (each rank's heads only): their grads are partial over tp
_HEAD_NORMS = {
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}
_DOGE_ATTENTION = {
    **_HEAD_NORMS,
    "layers.*.self_attn.dt_proj": RowParallel(local_output=True),
    "layers.*.self_attn": "local_params",
    "layers.*.self_attn.A": "colwise",
}
# Families whose shipped plans shard their experts only, leaving every attention weight on every rank (and their
# layers out of sequence parallelism): Megatron's attention layout, per-head q/k norms' grads summed over tp
_ATTENTION = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
AMENDMENTS: dict[str, dict[str, object]] = {
    **{family: _ATTENTION for family in ("granitemoe", "granitemoeshared", "phimoe")},
    "hunyuan_v1_moe": {
        **_ATTENTION,
        "layers.*.self_attn.query_layernorm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.key_layernorm": "replicated_with_grad_allreduce",
    },
    # per-head attention sinks, kept with their heads
    "flint": {
        **_ATTENTION,
        **_HEAD_NORMS,
        "layers.*.self_attn": "local_params",
        "layers.*.self_attn.sinks": "colwise",
    },
    # its attention output is gated per feature before o_proj
    "afmoe": {
        **_ATTENTION,
        **_HEAD_NORMS,
        "layers.*.self_attn.gate_proj": "colwise",
    },
    "doge": _DOGE_ATTENTION,
    # the shipped plan shards the embedding only: its stacked experts (weights and biases) split whole over tp / ep
    "gpt_oss": {"layers.*.mlp.experts": "moe_tp_experts"},
    # the activation sparsity of Gemma-3n's first layers cuts at statistics over all of a token's MLP features
    "gemma3n_text": {"layers.*.mlp": gaussian_topk_over_tp()},
    # xIELU's learnable alpha_p / alpha_n act on each rank's MLP feature shard: their grads are partial over tp
    **{family: {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"} for family in ("apertus", "apertus1p5_text")},
    # GLM-4-MoE's per-head q/k norms (``use_qk_norm``, on in Sarvam-MoE's config) act on each rank's heads
    **{family: _HEAD_NORMS for family in ("glm4_moe", "sarvam_moe")},
    "deepseek_v3": _MLA_ATTENTION,
    "axk1": _MLA_ATTENTION,
    "youtu": _MLA_ATTENTION,
    "phi3": {**_PACKED_ATTENTION, **_PACKED_MLP},
    "phi4_multimodal": {**_PACKED_ATTENTION, **_PACKED_MLP},
    **{family: _PACKED_MLP for family in ("glm", "glm4", "glm4v_text", "glm_image_text", "glm_ocr_text")},
}


def base_model_name(model: nn.Module) -> str:
    """FQN of the base model inside a model with a head: transformers' ``base_model_prefix`` when the model has
    that attribute, else the top-level child holding the input embedding (Llama-4's text-only causal LM declares
    ``language_model`` but keeps its base model under ``model``); "" when there is none or the embedding is a child
    of the model itself (T5's encoder and decoder share it from there)."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    get_in = getattr(model, "get_input_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    if embedding is not None and any(child is embedding for child in model.children()):
        return ""  # the embedding is the model's own child (T5's shared one): the model is its own base model
    for name, child in model.named_children():
        if embedding is not None and any(m is embedding for m in child.modules()):
            return name
    return ""


def _under_base_model(model: nn.Module, plan: dict) -> dict:
    prefix = base_model_name(model)
    if prefix:
        return {f"{prefix}.{key}": style for key, style in plan.items()}
    return dict(plan)


def hf_tp_plan(model: nn.Module) -> dict[str, object]:
    """The model's own plan under full FQNs: transformers' merged plan (base plan under the base model's prefix,
    heads' plans), else meshpar's table for the family; empty when there is neither."""
    plan = getattr(model, "tp_plan", None)
    config = getattr(model, "config", None)
    if not plan and getattr(config, "base_model_tp_plan", None):  # transformers before 5 merges nothing itself
        plan = {**_under_base_model(model, config.base_model_tp_plan), **(getattr(type(model), "_tp_plan", None) or {})}
    model_type = getattr(config, "model_type", None)
    if not plan:
        plan = _under_base_model(model, TABLES.get(model_type, {}))
    return {**plan, **_under_base_model(model, AMENDMENTS.get(model_type, {}))} if plan else {}


def _name_of(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


@dataclass(frozen=True)
class PatternFixup:
    """Run ``fn(module, tp)`` on every module matching ``pattern`` of the module it is given (the whole model, a
    pipeline stage, or the block :mod:`meshpar.hf.verify` checks)."""

    pattern: str
    fn: Callable[[nn.Module, int], None]

    def __call__(self, model: nn.Module, tp: int) -> None:
        for name, module in model.named_modules():
            if fqn_matches(self.pattern, name):
                self.fn(module, tp)

    def __str__(self) -> str:
        shown = repr(self.fn) if isinstance(self.fn, divide_attribute) else _name_of(self.fn)
        return f"{self.pattern}: {shown}"


def fixup_on(pattern: str, fn: Callable[[nn.Module, int], None]) -> PatternFixup:
    """``fn(module, tp)`` on every module matching ``pattern`` (see :class:`PatternFixup`)."""
    return PatternFixup(pattern, fn)


def attention_heads(config: object) -> tuple[int | None, int | None]:
    """(attention heads, key/value heads) of a model config; ``None`` where the config does not say."""
    text = text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None)
    if kv_heads is None and getattr(text, "model_type", None) == "falcon":  # Falcon's own names and layouts
        multi_query = getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False)
        kv_heads = 1 if multi_query else getattr(text, "num_kv_heads", None)
    return heads, kv_heads or heads


def _leaf(pattern: str) -> str:
    return pattern.rsplit(".", 1)[-1]


def _allowed(count: int, tp: int) -> str:
    return ", ".join(str(t) for t in range(1, count + 1) if count % t == 0)


def check_heads(config: object, plan: dict[str, str], tp: int, model_type: str) -> bool:
    """Raise before any collective when tp splits attention heads or experts unevenly; returns whether key/value
    heads must be replicated (fewer of them than tp ranks, grouped-query attention)."""
    if tp == 1:
        return False
    experts = expert_count(config)
    if experts is not None and "moe_tp_experts" in plan.values() and experts % tp:
        raise ValueError(
            f"{model_type}: {experts} experts cannot be split into whole experts over tp={tp}; use tp in "
            f"{{{_allowed(experts, tp)}}}"
        )
    heads, kv_heads = attention_heads(config)
    splits = [p for p, s in plan.items() if s in _LOCAL_OUTPUT and _leaf(p) in _QUERY_LIKE + _KEY_VALUE]
    if not splits or heads is None:
        return False
    if heads % tp:
        raise ValueError(
            f"{model_type}: {heads} attention heads cannot be split over tp={tp} ({splits[0]} is column-parallel); "
            f"use tp in {{{_allowed(heads, tp)}}} or pad the heads with meshpar.pad_model"
        )
    if kv_heads % tp == 0:
        return False
    fused = [p for p in splits if _leaf(p) in _FUSED_QKV]
    if fused or tp % kv_heads:
        raise ValueError(
            f"{model_type}: {kv_heads} key/value heads can neither be split over tp={tp} nor replicated evenly"
            + (f" inside the fused projection {fused[0]}" if fused else "")
            + f"; use tp in {{{_allowed(kv_heads, tp)}}}"
            + ("" if fused else f" or a multiple of {kv_heads} that divides {heads}")
        )
    return True


def _style_for(style: str, pattern: str, context: dict) -> ParallelStyle | None:
    """meshpar's style for one transformers style string (``None``: the module stays replicated)."""
    if style == "colwise":
        if context["replicate_kv"] and _leaf(pattern) in _KEY_VALUE:
            return ReplicatedKV(num_kv_heads=context["kv_heads"])
        return ColumnParallel()
    if style in ("colwise_gather_output", "colwise_rep"):
        return ColumnParallel(gather_output=True)
    if style == "rowwise":
        return RowParallel()
    if style in ("rowwise_split_input", "rowwise_rep"):
        return RowParallel(input_is_parallel=False)
    if style == "embedding_rowwise":
        return VocabParallel()
    if style == "embedding_colwise":
        return VocabParallel(shard_across_embedding=True)
    if style == "replicated_with_grad_allreduce":
        return ReplicatedGradSum()
    if style == "mla_kv_a_proj":
        return RopeGradSum(rope_dim=text_config(context["config"]).qk_rope_head_dim)
    if style == "replicate":
        return None
    if style == "moe_tp_experts":
        return ExpertsOverTP()
    if style == "packed_colwise":
        return PackedColumnParallel(**_packed_parts(pattern, context["config"]))
    raise KeyError(style)


def _packed_parts(pattern: str, config: object) -> dict[str, object]:
    """The parts of a packed projection: fused q/k/v by the config's head counts (whole heads per rank), else
    transformers' meaning of 'packed_colwise': two halves (``[gate | up]``)."""
    if _leaf(pattern) not in _FUSED_QKV:
        return {"parts": 2}
    text = text_config(config)
    heads, kv_heads = attention_heads(config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return {"parts": (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), "unit": head_dim}


# transformers' nn.Linear subclasses whose forward is exactly the linear map (x @ W.T + b)
_PLAIN_LINEAR = ("FalconLinear",)


class AsLinear(ParallelStyle):
    """``style`` on one of transformers' ``nn.Linear`` subclasses whose forward is the plain linear map (Falcon's
    ``FalconLinear``: ``x @ W.T + b``): the module becomes the ``nn.Linear`` it computes, then ``style`` shards it.
    meshpar's styles take exactly ``nn.Linear`` (a subclass's own forward would otherwise be dropped unseen); the
    plan's verification proves the result per model, as for every plan."""

    def __init__(self, style: ParallelStyle) -> None:
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear) or type(module).__name__ not in _PLAIN_LINEAR:
            raise TypeError(f"AsLinear applies to {_PLAIN_LINEAR}, got {type(module).__name__}")
        become(module, nn.Linear)
        self.style.src_data_rank = self.src_data_rank
        return self.style._apply(module, device_mesh)


def _names(items: Iterable[tuple[str, object]]) -> list[str]:
    return [name for name, _ in items]


def resolve_entries(
    model: nn.Module, plan: dict[str, object], tp: int, *, replicate_kv: bool
) -> tuple[dict[str, ParallelStyle], list[Callable[[nn.Module, int], None]]]:
    """meshpar styles and fix-ups for a plan's entries: ``ParallelStyle`` objects as they are, transformers style
    strings mapped onto meshpar's styles, callables as fix-ups ``fn(module, tp)``. Entries that match no module of
    this model (``q_norm`` switched off, say) are skipped. Raises naming every entry meshpar cannot apply (packed or
    expert weights, bare parameters, unknown strings)."""
    modules = _names(model.named_modules())
    conv1d = [name for name, module in model.named_modules() if type(module) is Conv1D]
    plain_linear = [name for name, module in model.named_modules() if type(module).__name__ in _PLAIN_LINEAR]
    params = _names(model.named_parameters(remove_duplicate=False))
    config = getattr(model, "config", None)
    _, kv_heads = attention_heads(config)
    context = {"replicate_kv": replicate_kv, "kv_heads": kv_heads, "config": config}
    styles: dict[str, ParallelStyle] = {}
    fixups: list[Callable[[nn.Module, int], None]] = []
    refused = []
    experts = {pattern for pattern, style in plan.items() if style == "moe_tp_experts"}
    local = {pattern: {} for pattern, style in plan.items() if style in _OWNER_STYLES}
    features: dict[str, dict[str, tuple[int, int] | None]] = {pattern: {} for pattern in experts}
    ndims = {name: param.dim() for name, param in model.named_parameters(remove_duplicate=False)}
    for pattern, style in plan.items():
        on_modules = any(fqn_matches(pattern, name) for name in modules)
        on_params = not on_modules and any(fqn_matches(pattern, name) for name in params)
        owner, _, leaf = pattern.rpartition(".")
        if not on_modules and not on_params:
            continue  # no such module here
        if owner in experts and (on_params or style == "moe_identity_expert"):
            # an expert weight or identity expert: its experts module's style places it (whole experts where it can)
            if on_params:  # None: no feature split; refused only if the experts cannot be split whole
                ndim = next(n for name, n in ndims.items() if fqn_matches(pattern, name))
                features[owner][leaf] = _expert_feature_split(style, ndim)
            continue
        if on_params and owner in local and isinstance(style, str):
            ndim = next(n for name, n in ndims.items() if fqn_matches(pattern, name))
            dim = _parameter_dim(style, ndim)
            if dim is None:
                refused.append(f"{pattern}: '{style}' on a {ndim}-D bare parameter")
            else:
                local[owner][leaf] = dim  # sharded by its module's LocalParameters
        elif style in _OWNER_STYLES:
            continue  # made below, once its parameters' entries are known
        elif isinstance(style, ParallelStyle):
            styles[pattern] = style
        elif callable(style):
            fixups.append(fixup_on(pattern, style))
        elif not isinstance(style, str):
            raise TypeError(
                f"plan[{pattern!r}] must be a ParallelStyle, a transformers style string or a fix-up fn(module, tp), "
                f"got {type(style).__name__}"
            )
        elif style in UNSUPPORTED_STYLES and not (on_modules and style == "packed_colwise"):
            refused.append(f"{pattern}: '{style}' ({UNSUPPORTED_STYLES[style]})")
        elif on_params:
            refused.append(f"{pattern}: '{style}' on a bare parameter")
        else:
            try:
                mapped = _style_for(style, pattern, context)
            except KeyError:
                refused.append(f"{pattern}: '{style}' (a style string meshpar does not know)")
                continue
            if mapped is not None and any(fqn_matches(pattern, name) for name in conv1d):
                try:
                    mapped = on_conv1d(mapped, pattern)
                except ValueError as error:
                    refused.append(f"{error} ('{style}')")
                    continue
            if mapped is not None and any(fqn_matches(pattern, name) for name in plain_linear):
                mapped = AsLinear(mapped)
            if mapped is not None:
                styles[pattern] = mapped
    for pattern, split in features.items():
        if split and isinstance(styles.get(pattern), ExpertsOverTP):
            styles[pattern] = ExpertsOverTP(features=split)
    for pattern, shards in local.items():
        partial = plan[pattern] == "all_reduce"
        if shards:
            styles[pattern] = LocalParameters(shards, partial_output=partial)
        elif partial:
            styles[pattern] = AllReduceOutput()
    if refused:
        raise ValueError(
            f"{type(model).__name__} at tp={tp}: meshpar cannot yet apply these entries of the model's "
            f"tensor-parallel plan: {'; '.join(refused)}. Use tp=1 (data or pipeline parallelism need no plan) or "
            "pass plan={...} with styles for these modules"
        )
    return styles, fixups


def embedding_and_head(model: nn.Module) -> tuple[str | None, str | None, bool]:
    """FQNs of the input embedding and of the output (LM) head, and whether they share one weight."""
    names = {id(module): name for name, module in model.named_modules()}
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    embedding_name = names.get(id(embedding)) if isinstance(embedding, nn.Embedding) else None
    head_name = names.get(id(head)) if type(head) is nn.Linear else None
    tied = embedding_name is not None and head_name is not None and head.weight is embedding.weight
    return embedding_name, head_name, tied


@dataclass(frozen=True)
class KeyValueGroups:
    """With replicated key/value heads each rank holds one of them for all its query heads: attention modules that
    repeat key/value heads (``num_key_value_groups``) repeat it for ``heads / tp`` query heads."""

    heads: int

    def __call__(self, model: nn.Module, tp: int) -> None:
        for module in model.modules():
            if hasattr(module, "num_key_value_groups") and any(hasattr(module, n) for n in _KEY_VALUE):
                module.num_key_value_groups = self.heads // tp

    def __str__(self) -> str:
        return f"attention num_key_value_groups = {self.heads} // tp (key/value heads replicated)"


def kv_group_fixup(heads: int) -> KeyValueGroups:
    return KeyValueGroups(heads)


def layer_container(model: nn.Module) -> str:
    """FQN of the transformer-layer list: the ``nn.ModuleList`` of the model's transformers pipeline plan, else its
    largest ``nn.ModuleList`` ("" when it has none)."""
    pp_plan = getattr(model, "pp_plan", None) or {}
    for name in pp_plan:
        try:
            if isinstance(model.get_submodule(name), nn.ModuleList):
                return name
        except AttributeError:
            continue
    lists = [
        (sum(p.numel() for p in m.parameters()), n) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)
    ]
    return max(lists)[1] if lists else ""
