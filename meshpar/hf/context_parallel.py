"""Context parallelism for HF causal LMs: each cp rank holds ``1 / cp`` of every sequence (load-balanced chunks,
:mod:`meshpar.context_parallel`), and the model's attention runs over the whole sequence through transformers'
attention interface.

What ``parallelize`` does with ``{"context_parallel_size": cp}``:

- the model's attention implementation becomes ``"meshpar_context_parallel"`` (registered in transformers'
  ``AttentionInterface``): every attention layer hands its local queries, keys and values (rotary positions already
  applied, with the tokens' global positions) to :func:`meshpar.context_parallel.context_parallel_attention`, with
  the layer's own causal flag, sliding window, scaling and logit soft-capping; transformers builds no mask of its own
  (a registered mask function that returns none), the masks are evaluated on global positions;
- each batch is cut per rank (:func:`shard_batch`): the token ids and positions into this rank's chunks, the labels
  shifted over the whole sequence first (token t scores token t + 1, across chunk borders), the padding mask kept
  whole for the keys; ``document_ids`` (``[batch, seq]``, meshpar's own input) marks sequences packed into one row,
  each attending within its own document (what a block-diagonal 4-D mask gives the dense model);
- the loss's normaliser counts the scored tokens over dp and cp, and dense grads are summed over both
  (:attr:`meshpar.parallel_dims.ParallelDims.grad_mesh`).

A family whose attention does not go through the interface, or uses what the context-parallel attention does not
compute (attention sinks, ALiBi or relative position biases, dropout while training), is refused: the model is proven
on a probe against its dense forward at ``parallelize`` time (:func:`verify_context_parallel`).

Pooled and span heads (sequence classification, multiple choice, question answering: a row's scores read off its
last or first token, or taken over all of its positions) need whole sequences after the layers. For them the model
is called with whole sequences (:func:`pool_over_whole_sequences`): its base model's inputs are cut into this rank's
chunks on the way in, the layers run on the chunks, and the hidden states are gathered over cp in sequence order (at
the base model's output, or its last layer's: :data:`GATHER_POINTS`), so the head and the pooling by position see
whole sequences on every cp rank. Each cp rank then computes its replica's loss; the rows it is divided by are
counted over dp x cp (cp times the rows), so each rank holds ``1 / cp`` of it, and the gather's backward sums the cp
ranks' grads: the grads are the dense ones.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from meshpar._compat import DeviceMesh
from meshpar.context_parallel import (
    AttentionMask,
    check_sequence_length,
    context_parallel_attention,
    gather_sequence,
    local_positions,
    shard_sequence,
)
from meshpar.hf.hf_plan import dense_probe, eval_mode, text_config
from meshpar.hf.stages import head_output
from meshpar.parallel_dims import ParallelDims
from meshpar.tensor_parallel.cross_entropy import IGNORE_INDEX

ATTENTION = "meshpar_context_parallel"
INPUTS_KEY = "meshpar_context"  # the keyword the model's forward carries down to its attention layers
# heads that read whole sequences after the layers (see the module docstring)
POOLED_TASKS = ("sequence_classification", "multiple_choice", "question_answering")


@dataclass
class ContextParallelInputs:
    """What every attention layer of one forward needs besides its q, k, v: the cp mesh, the implementation, the
    whole sequence's key padding (``[batch, seq]``, True for real tokens; ``None``: no padding) and, for sequences
    packed into one row, which document each token belongs to."""

    mesh: DeviceMesh
    implementation: str
    key_padding: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None  # [batch, seq]: sequences packed into one row

    def row_slice(self, start: int, stop: int) -> ContextParallelInputs:
        """The inputs of rows ``start:stop`` (a pipeline's microbatch)."""
        return ContextParallelInputs(
            self.mesh,
            self.implementation,
            self.key_padding[start:stop] if self.key_padding is not None else None,
            self.document_ids[start:stop] if self.document_ids is not None else None,
        )


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[batch, heads, local, head_dim]`` in, ``[batch, local, heads,
    head_dim]`` out."""
    inputs = kwargs.get(INPUTS_KEY)
    if inputs is None:
        raise RuntimeError(
            f"{type(module).__name__}: the model runs meshpar's context-parallel attention but this forward got no "
            "context-parallel inputs; call the parallelized model (train_step, eval_loss), not its inner module"
        )
    if dropout and module.training:
        raise ValueError(f"{type(module).__name__}: attention dropout under context parallelism is not supported")
    sinks = kwargs.get("s_aux")  # attention sinks (GPT-OSS and kin): one logit per head, value zero
    unsupported = [name for name in ("sinks", "position_bias", "alibi") if kwargs.get(name) is not None]
    if attention_mask is not None:  # transformers' mask functions give none here: the model built a mask of its own
        unsupported.append("a mask the model builds itself")
    if unsupported:
        raise ValueError(f"{type(module).__name__}: context-parallel attention does not compute {unsupported}")
    mask = AttentionMask(
        causal=getattr(module, "is_causal", True),
        sliding_window=sliding_window,
        document_ids=inputs.document_ids,
        key_padding=inputs.key_padding,
    )
    out = context_parallel_attention(
        query, key, value, inputs.mesh, mask, scale=scaling, implementation=inputs.implementation, softcap=softcap,
        sinks=sinks,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """transformers' mask functions build a mask over the local tokens: context-parallel attention builds its own."""
    return None


def use_context_parallel_attention(model: nn.Module) -> None:
    """Route every attention layer of ``model`` through :func:`_attention` (refused for a model whose attention
    does not go through transformers' attention interface)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    can_set = getattr(model, "_can_set_attn_implementation", None)
    if not callable(can_set) or not can_set():
        raise ValueError(
            f"{type(model).__name__}: its attention does not go through transformers' attention interface, which "
            "context parallelism replaces; use context_parallel_size 1"
        )
    if getattr(text_config(model.config), "attention_chunk_size", None):  # its mask function is replaced too
        raise ValueError(
            f"{type(model).__name__}: chunked local attention (attention_chunk_size) is not what context-parallel "
            "attention computes (causal, sliding windows, documents); use context_parallel_size 1"
        )
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)
    model.set_attn_implementation(ATTENTION)


def padding_counted_positions(model: nn.Module) -> int | None:
    """The padding index a family counts its positions from, where it does (RoBERTa and its kin: position embeddings
    with a padding index; a real token's position is ``padding_idx`` + how many real tokens end there, a pad's
    ``padding_idx``), else ``None`` (positions 0, 1, ...)."""
    embeddings = getattr(getattr(model, "base_model", model), "embeddings", None)
    table, pad = getattr(embeddings, "position_embeddings", None), getattr(embeddings, "padding_idx", None)
    return pad if isinstance(table, nn.Embedding) and table.padding_idx is not None and pad is not None else None


def count_positions_over_whole_sequences(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks for position embeddings that their decoder feeds with positions it counts itself from its own input's
    length (BART and its kin: ``arange(length) + cache length``, whatever ``position_ids`` it is given): under
    context parallelism that length is this rank's chunk, so each chunk would restart at 0. The hooks hand such a
    table this rank's tokens' positions in the whole sequence instead, plus the decoder's offset (its cache length),
    and only in a forward that carries context-parallel inputs (generation decodes densely). Returns the handles."""
    handles = []
    for decoder in model.modules():
        table = getattr(decoder, "embed_positions", None)
        if not isinstance(table, nn.Module) or not _takes(table, "position_ids") or _takes(decoder, "position_ids"):
            continue
        # the cp mesh of this decoder's current forward (set at each call: None when it carries no cp inputs)
        current: dict[str, DeviceMesh | None] = {"mesh": None}

        def enter(module: nn.Module, args: Any, kwargs: dict[str, Any], current: dict = current) -> None:
            context = kwargs.get(INPUTS_KEY)
            current["mesh"] = context.mesh if isinstance(context, ContextParallelInputs) else None

        def whole(
            module: nn.Module, args: Any, kwargs: dict[str, Any], current: dict = current
        ) -> tuple[Any, dict[str, Any]] | None:
            positions, mesh = kwargs.get("position_ids"), current["mesh"]
            if mesh is None or not isinstance(positions, torch.Tensor) or positions.dim() != 1:
                return None
            cp = mesh.size()
            mine = local_positions(positions.shape[0] * cp, cp, mesh.get_local_rank(), positions.device)
            return args, {**kwargs, "position_ids": mine + positions[:1]}

        handles += [
            decoder.register_forward_pre_hook(enter, with_kwargs=True),
            table.register_forward_pre_hook(whole, with_kwargs=True),
        ]
    return handles


def _takes(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward names the parameter ``name``."""
    return name in inspect.signature(type(module).forward).parameters


def _whole_positions(tokens: torch.Tensor, ids: Any, padding_idx: int | None) -> torch.Tensor:
    """The positions the dense model gives a batch without ``position_ids`` (see
    :func:`padding_counted_positions`), for the whole sequences."""
    batch, seq_len = tokens.shape[:2]
    if padding_idx is None:
        return torch.arange(seq_len, device=tokens.device).expand(batch, -1)
    if isinstance(ids, torch.Tensor):
        real = ids.ne(padding_idx).long()
        return torch.cumsum(real, 1) * real + padding_idx
    return torch.arange(padding_idx + 1, seq_len + padding_idx + 1, device=tokens.device).expand(batch, -1)


def shard_batch(
    labels: torch.Tensor | None,
    inputs: dict[str, Any],
    mesh: DeviceMesh,
    implementation: str,
    shift: bool,
    padding_idx: int | None = None,
) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """This cp rank's part of a batch: token ids (or embeddings), token types and positions in its chunks, the
    labels shifted over the whole sequence (``shift``: the model scores position t against label t + 1) and then cut
    alike, the padding mask whole for the keys. Positions not given are the dense model's own, counted over the whole
    sequence (from ``padding_idx``: :func:`padding_counted_positions`)."""
    tokens = inputs.get("input_ids")
    tokens = tokens if isinstance(tokens, torch.Tensor) else inputs.get("inputs_embeds")
    if not isinstance(tokens, torch.Tensor):
        raise ValueError("context parallelism needs input_ids or inputs_embeds")
    seq_len, cp = tokens.shape[1], mesh.size()
    check_sequence_length(seq_len, cp)
    out = {k: v for k, v in inputs.items() if k not in ("attention_mask", "position_ids", "document_ids")}
    for name in ("input_ids", "inputs_embeds", "token_type_ids"):  # per token (BERT's segments too)
        if isinstance(inputs.get(name), torch.Tensor):
            out[name] = shard_sequence(inputs[name], 1, mesh)
    positions = inputs.get("position_ids")
    if positions is None:
        positions = _whole_positions(tokens, inputs.get("input_ids"), padding_idx)
    out["position_ids"] = shard_sequence(positions, 1, mesh)
    # sequences packed into one row: which document each token is in ([batch, seq]), each attending within its own
    documents = inputs.get("document_ids")
    if documents is not None and tuple(documents.shape) != tuple(tokens.shape[:2]):
        raise ValueError(f"document_ids must be [batch, seq] = {tuple(tokens.shape[:2])}, got {tuple(documents.shape)}")
    padding = inputs.get("attention_mask")
    key_padding = padding.bool() if isinstance(padding, torch.Tensor) and not padding.bool().all() else None
    out[INPUTS_KEY] = ContextParallelInputs(mesh, implementation, key_padding, documents)
    if labels is not None:
        if shift:
            labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        labels = shard_sequence(labels, 1, mesh)
    return labels, out


# where a pooled or span head's whole sequences are gathered, tried in this order until one is proven on the probe:
# the base model's output (its final norm and view on the chunks: GPT-2 reshapes to its input's shape), or the last
# layer's (a pooler inside the base model, BERT's, then reads the whole sequence's first token)
GATHER_POINTS = ("base_model", "last_layer")


def pool_over_whole_sequences(
    model: nn.Module, mesh: DeviceMesh, implementation: str, padding_idx: int | None, gather_at: nn.Module | None
) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that let ``model`` (a pooled or span head, or a pipeline stage of one, called with whole sequences) run
    its layers on this cp rank's chunks and what follows ``gather_at`` (its base model, or its last layer: see
    :data:`GATHER_POINTS`; ``None`` on a stage that holds neither's output) on whole sequences (see the module
    docstring). Returns the hooks' handles."""
    cut = partial(_cut_base_inputs, mesh=mesh, implementation=implementation, padding_idx=padding_idx)
    handles = [model.base_model.register_forward_pre_hook(cut, with_kwargs=True)]
    if gather_at is not None:
        handles.append(gather_at.register_forward_hook(partial(_gather_hidden_states, mesh=mesh)))
    return handles


def gather_module(model: nn.Module, layers: str, point: str) -> nn.Module:
    """The module whose output :data:`GATHER_POINTS`' ``point`` names in ``model`` (``layers``: its layer list)."""
    if point == "base_model":
        return model.base_model
    container = model.get_submodule(layers)
    return list(container)[-1]


def _cut_base_inputs(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    mesh: DeviceMesh,
    implementation: str,
    padding_idx: int | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The base model's whole-sequence inputs as this rank's chunks (:func:`shard_batch`)."""
    inputs = dict(kwargs)
    if args:  # BERT-style heads hand the ids positionally
        if len(args) > 1 or "input_ids" in inputs:
            raise ValueError(f"{type(module).__name__} got positional inputs context parallelism cannot place")
        inputs["input_ids"] = args[0]
    return (), shard_batch(None, inputs, mesh, implementation, shift=False, padding_idx=padding_idx)[1]


def _gather_hidden_states(module: nn.Module, args: Any, output: Any, *, mesh: DeviceMesh) -> Any:
    """The hidden states ``module`` returns (a layer's, or a base model's ``last_hidden_state``) of every cp rank's
    chunks, in sequence order (grads summed over cp)."""
    if isinstance(output, torch.Tensor):
        return gather_sequence(output, 1, mesh)
    if isinstance(output, ModelOutput) and isinstance(output.get("last_hidden_state"), torch.Tensor):
        output["last_hidden_state"] = gather_sequence(output["last_hidden_state"], 1, mesh)
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (gather_sequence(output[0], 1, mesh), *output[1:])
    raise TypeError(f"{type(module).__name__} returned {type(output).__name__}; context parallelism needs its hidden "
                    "states (a tensor, a model output's last_hidden_state, or a tuple starting with one)")  # fmt: skip


def local_key_padding(inputs: dict[str, Any], mesh: DeviceMesh) -> torch.Tensor:
    """Which of this cp rank's tokens are real (``[batch, local seq]``, 1 / 0): the whole sequence's padding mask
    cut to the rank's chunks (all ones without padding)."""
    context = inputs[INPUTS_KEY]
    tokens = inputs.get("input_ids")
    tokens = tokens if isinstance(tokens, torch.Tensor) else inputs["inputs_embeds"]
    if context.key_padding is None:
        return torch.ones(tokens.shape[:2], device=tokens.device)
    positions = local_positions(context.key_padding.shape[1], mesh.size(), mesh.get_local_rank(), tokens.device)
    return context.key_padding[:, positions].to(torch.float32)


_PROBE_CAP = 128  # tokens: a probe longer than any window up to half of this


def probe_length(model: nn.Module, cp: int, sequence_shards: int = 1) -> int:
    """The probe's length: at least ``4 cp`` tokens, and past twice the longest window or chunk the config names (up
    to :data:`_PROBE_CAP` and the model's own position limit), so that a mask cut at a window is exercised by the
    proof, in ``2 cp`` equal chunks, each cp rank's part split again into ``sequence_shards`` (sequence
    parallelism's tp) equal shards."""
    config = text_config(model.config)
    skip = ("layer", "pattern", "feed_forward")  # max_window_layers, sliding_window_pattern, chunk_size_feed_forward
    windows = [
        v for k, v in vars(config).items()
        if ("window" in k or "chunk" in k) and not any(s in k for s in skip) and type(v) is int and v > 0
    ]  # fmt: skip
    positions = [getattr(config, k, None) for k in ("max_position_embeddings", "n_positions")]
    limit = min([_PROBE_CAP, *(p for p in positions if type(p) is int and p > 0)])
    unit = 2 * cp * sequence_shards
    length = -(-max([4 * cp, *(2 * w + 2 for w in windows)]) // unit) * unit
    if length > limit:
        length = limit // unit * unit
    return max(-(-4 * cp // unit) * unit, length)


def dense_probe_logits(model: nn.Module, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, the dense model's scores, :func:`meshpar.hf.stages.head_output`) of one probe sequence, computed
    before the model is changed."""
    with dense_probe(model, length=seq_len) as (forward, ids):
        return ids, head_output(forward()).float()


@torch.no_grad()
def verify_context_parallel(
    model: nn.Module,
    ids: torch.Tensor,
    dense_logits: torch.Tensor,
    dims: ParallelDims,
    implementation: str,
    padding_idx: int | None,
    pooled: bool,
    **forward_kwargs: Any,
) -> str | None:
    """What differs between the context-parallel model's logits for this rank's tokens and the dense ones (``None``
    when they agree): the proof that the family's attention is what :func:`_attention` computes. ``pooled``: a
    pooled or span head, called with whole sequences (:func:`pool_over_whole_sequences`), its outputs whole;
    ``forward_kwargs``: for the model's forward besides the ids."""
    mesh = dims.cp_mesh
    inputs = {"input_ids": ids}
    if not pooled:
        _, inputs = shard_batch(None, inputs, mesh, implementation, False, padding_idx)  # as the steps cut batches
    try:
        with eval_mode(model):
            logits = head_output(model(**inputs, use_cache=False, **forward_kwargs)).float()
    except Exception as error:  # the family's forward cannot run this way: a refusal, never a crash
        return f"its forward raises {type(error).__name__}: {error}"
    positions = local_positions(ids.shape[-1], mesh.size(), mesh.get_local_rank(), ids.device)
    want = dense_logits if pooled else dense_logits[:, positions]
    if logits.shape[-1] != want.shape[-1]:  # a vocab-parallel head: this tp rank's slice (torch.chunk's split)
        want = want.chunk(dims.tp, -1)[dims.tp_rank]
    error = ((logits - want).norm() / want.norm().clamp_min(1e-6)).item()
    return None if error < 1e-4 else f"its logits differ from the dense model's by {error:.1e} (relative)"
