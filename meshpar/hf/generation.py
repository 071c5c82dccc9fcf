"""HF ``generate`` across pipeline stages: one driver runs HF's decoding loop, every other rank follows.

HF's loop (greedy, sampling, beam search, stopping criteria) decides on full-vocabulary logits, step by step. Under
pp the logits exist only on the last stage, and every rank of a model replica must run each forward together. So
the last stage's tp rank 0 runs ``generate`` on a stand-in model whose forward is the whole pipeline (no KV cache:
each step re-runs the sequence, which keeps the pipeline's shapes simple); before each forward it sends the ids to
every rank of its replica (over tp inside the last stage, then over each pp column), which run the same pipeline
forward. At the end it sends a stop and the generated sequences, which every rank returns. Only the driver's random
numbers matter for sampling, so ranks never disagree on a token or on when to stop.

Padded (left-padded) prompts: HF's loop keeps an attention mask and, for models whose forward takes ``position_ids``,
positions counted from each row's first real token; the driver sends both with the ids and every stage runs the
model's forward with them, as the dense model's ``generate`` does.

Encoder-decoders (T5, BART): the prompt (and its mask) goes to every rank once; HF's loop then grows the decoder's
sequence from the decoder start token, and each step runs the whole pipeline on the prompt and that sequence (beam
search's rows: the prompt repeated per beam, as HF expands it), as the dense model's ``generate`` decodes.

Replicas whose forwards communicate with each other (expert parallelism: the MoE layers' all-to-alls span dp
replicas; FSDP2: every forward gathers weights over dp) run every pipeline forward together, with the same number of
microbatches. Before each forward the replicas' drivers agree on whether any of them still decodes and on a
microbatch count that divides every running replica's rows; a replica that is done (fewer steps, an earlier end of
sequence) runs stand-in forwards of its last sequence until all are, as HF's ``synced_gpus`` does without pp.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from meshpar.failure import agree, stop_all_ranks_on_error

if TYPE_CHECKING:
    from meshpar.hf.parallelize import ParallelizedModel

_RUN, _RESULT, _PROMPT, _IDLE = 1, 2, 3, 4  # _IDLE: a stand-in forward of a replica that is done (lockstep)
_MAX_ROWS = 3  # tensors one exchange carries: the ids, a mask, positions
_HEADER = 4  # flag, microbatches, batch, seq


class _PipelineAsModel(PreTrainedModel, GenerationMixin):
    """What HF's ``generate`` drives on the driver rank: a model without parameters whose forward is the pipeline."""

    _supports_sdpa = True  # it runs no attention itself: any implementation the stages use is fine
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # nor experts: any experts implementation the config names (mixture-of-experts families) is fine; transformers
    # reads this cached answer before guessing from the module's source
    _can_set_experts_implementation_cached_value = True

    def __init__(self, config: Any, logits: Callable[..., torch.Tensor], device: torch.device) -> None:
        super().__init__(copy.deepcopy(config))  # PreTrainedModel adjusts its config's attention setting
        # HF reads .device from the first parameter
        self.device_marker = torch.nn.Parameter(torch.empty(0, device=device), requires_grad=False)
        self._logits = logits

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **_: Any,
    ) -> Any:
        """HF's loop passes the mask it keeps (one it built from ``pad_token_id`` in the prompt, or the caller's)
        and positions from it; :func:`_model_inputs` keeps those the real model's forward takes."""
        return CausalLMOutputWithPast(logits=self._logits(input_ids, attention_mask, position_ids))


def _model_inputs(model: ParallelizedModel) -> tuple[bool, bool]:
    """Whether the model's own forward takes (``attention_mask``, ``position_ids``): HF's ``generate`` gives the
    dense model those only (it computes positions from the mask only for a forward that takes them)."""
    names = inspect.signature(model.model_class.forward).parameters
    return "attention_mask" in names, "position_ids" in names


class _Replica:
    """Sends the driver's commands to every rank of its model replica: over tp inside the last stage (source: tp
    rank 0), then down each pp column (source: the last stage)."""

    def __init__(self, model: ParallelizedModel) -> None:
        dims = model.dims
        self.device = dims.device
        self.tp_group = dims.tp_mesh.get_group() if dims.tp > 1 else None
        self.pp_group = dims.pp_mesh.get_group()
        self.last_stage = dims.pp_rank == dims.pp - 1
        self.driver = self.last_stage and dims.tp_rank == 0

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self.last_stage and self.tp_group is not None:
            dist.broadcast(tensor, group=self.tp_group, group_src=0)
        dist.broadcast(tensor, group=self.pp_group, group_src=dist.get_world_size(self.pp_group) - 1)

    def exchange(
        self, flag: int = 0, microbatches: int = 0, *rows: torch.Tensor | None
    ) -> tuple[int, int, list[torch.Tensor | None]]:
        """The driver sends ``flag``, the microbatch count of a forward and ``[batch, seq]`` tensors (the ids, then
        an optional mask and positions); every other rank calls it without them and receives them all (``None``
        where the driver sent ``None``)."""
        present = [r is not None for r in rows]
        shape = next((r.shape for r in rows if r is not None), (0, 0))
        header = torch.zeros(_HEADER + _MAX_ROWS, dtype=torch.long)  # then which tensors follow
        if self.driver:
            header[:_HEADER] = torch.tensor([flag, microbatches, *shape])
            header[_HEADER : _HEADER + len(present)] = torch.tensor(present, dtype=torch.long)
        header = header.to(self.device)
        self._broadcast(header)
        flag, microbatches, batch, seq, *sent = header.tolist()
        # one contiguous message (HF's beam search returns views, a beam dimension sliced away: stack copies them)
        stacked = (
            torch.stack([r.long() for r in rows if r is not None])
            if self.driver
            else torch.empty(sum(sent), batch, seq, dtype=torch.long, device=self.device)
        )
        self._broadcast(stacked)
        received = iter(stacked.unbind(0))
        return flag, microbatches, [next(received) if was_sent else None for was_sent in sent]


def _microbatches(rows: int, configured: int) -> int:
    """The most microbatches (up to the configured count) that divide the rows of this decoding step."""
    return max(m for m in range(1, min(rows, configured) + 1) if rows % m == 0)


class _Lockstep:
    """The drivers of replicas whose forwards communicate (see the module docstring): before each forward they
    agree, over the group of every replica's driver (the dp x cp group of the last stage's tp rank 0), on whether any
    still decodes and on the microbatch count."""

    def __init__(self, model: ParallelizedModel) -> None:
        self.group = model.dims.grad_mesh.get_group()

    def microbatches(self, rows: int, configured: int) -> int | None:
        """The count every replica's next forward uses (``rows``: this replica's, 0 when it is done); ``None``
        when every replica is done."""
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, rows, group=self.group)
        running = [r for r in everyone if r]
        return _microbatches(math.gcd(*running), configured) if running else None


@contextlib.contextmanager
def _logits_only(model: ParallelizedModel) -> Iterator[None]:
    """During generation the last stage gathers full-vocabulary logits and computes no loss."""
    pipeline = model.pipeline
    last = pipeline.plan.num_stages - 1  # other stages hold no head (or a stand-in for it: T5's)
    named = [dict(chunk.stage.named_modules()) for chunk in pipeline.chunks if chunk.stage_index == last]
    # a vocab-parallel head (tp > 1) gathers its logits; at tp = 1 the head is the model's own (``plan.head`` empty)
    heads = [modules[model.plan.head] for modules in named if model.plan.head and model.plan.head in modules]
    saved = (pipeline.loss_fn, pipeline.num_microbatches, [h.gather_output for h in heads])
    pipeline.loss_fn = lambda logits, *args, **kwargs: logits.new_zeros(())
    for head in heads:
        head.gather_output = True
    try:
        yield
    finally:
        pipeline.loss_fn, pipeline.num_microbatches = saved[0], saved[1]
        for head, gather in zip(heads, saved[2], strict=True):
            head.gather_output = gather


def _pipeline_logits(
    model: ParallelizedModel,
    microbatches: int,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    prompt: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor | None:
    """The last stage's logits for ``ids`` (an encoder-decoder's: the decoder's sequence, with the encoder's
    ``prompt`` and its mask, each row repeated as often as HF's loop expanded the batch: per beam)."""
    model.pipeline.num_microbatches = microbatches
    inputs = {"input_ids": ids, "labels": ids}
    inputs |= {"attention_mask": mask} if mask is not None else {}
    inputs |= {"position_ids": positions} if positions is not None else {}
    if prompt is not None:
        repeats = ids.shape[0] // prompt[0].shape[0]
        encoder_ids, encoder_mask = (None if t is None else t.repeat_interleave(repeats, 0) for t in prompt)
        inputs = {"input_ids": encoder_ids, "decoder_input_ids": ids, "labels": ids}
        inputs |= {"attention_mask": encoder_mask} if encoder_mask is not None else {}
    _, outputs = model.pipeline.run_eval(return_outputs=True, **inputs)
    return torch.cat(outputs) if outputs else None


def pipelined_generate(model: ParallelizedModel, input_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """``generate`` at pp > 1; returns the driver's sequences on every rank of the replica."""

    def check() -> None:
        if input_ids is None:
            raise ValueError("generate() with pipeline_parallel_size > 1 needs input_ids (the prompts)")
        if kwargs.get("use_cache"):
            raise ValueError("generate() with pipeline_parallel_size > 1 runs without a KV cache; drop use_cache=True")

    agree("generate", check)  # a request meshpar cannot serve is refused on every rank; the job stays usable
    with stop_all_ranks_on_error("generate"):  # the followers wait in a broadcast: never leave them there
        return _generate(model, input_ids, kwargs)


def _first_row(prompt: tuple[torch.Tensor, torch.Tensor | None] | None) -> Any:
    """An encoder-decoder's prompt cut to its first row (a stand-in forward's encoder input)."""
    return None if prompt is None else tuple(None if t is None else t[:1] for t in prompt)


def _decoder_start(model: ParallelizedModel, prompt: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """An encoder-decoder's first decoder ids: the caller's ``decoder_input_ids``, else its decoder start token per
    row (as HF's ``generate`` begins)."""
    given = kwargs.pop("decoder_input_ids", None)
    if given is not None:
        return given.to(prompt.device)
    config = model.hf_config
    start = getattr(config, "decoder_start_token_id", None)
    start = start if start is not None else getattr(config, "bos_token_id", None)
    if start is None:
        raise ValueError(f"{model.model_class.__name__}: its config names no decoder_start_token_id; pass one")
    return torch.full((prompt.shape[0], 1), start, dtype=torch.long, device=prompt.device)


def _generate(model: ParallelizedModel, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    replica = _Replica(model)
    configured = model.pipeline.num_microbatches
    prompt = None  # an encoder-decoder's prompt and its mask: the encoder's input at every step
    coupled = model.dims.ep > 1 or model._fsdp
    lockstep = _Lockstep(model) if coupled and replica.driver else None
    with torch.no_grad(), _logits_only(model):
        if replica.driver:
            takes_mask, takes_positions = _model_inputs(model)
            config = copy.deepcopy(model.hf_config)
            start = input_ids.to(replica.device)
            if getattr(config, "is_encoder_decoder", False):
                mask = kwargs.pop("attention_mask", None)
                prompt = (start, None if mask is None else mask.to(replica.device))
                replica.exchange(_PROMPT, 0, *prompt)
                # HF's loop drives the decoder's sequence alone (from its start token, nothing of it padding: the
                # start token may be the pad token, as T5's)
                start = _decoder_start(model, start, kwargs)
                kwargs["attention_mask"] = torch.ones_like(start)
                config.is_encoder_decoder = False

            def run(ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None,
                    encoder: tuple[torch.Tensor, torch.Tensor | None] | None) -> torch.Tensor:  # fmt: skip
                rows = ids.shape[0]
                microbatches = lockstep.microbatches(rows, configured) if lockstep else None
                microbatches = microbatches or _microbatches(rows, configured)
                replica.exchange(_RUN, microbatches, ids, mask, positions)
                return _pipeline_logits(model, microbatches, ids, mask, positions, encoder)

            def logits(ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None) -> torch.Tensor:
                mask = mask if takes_mask and mask is not None and not bool(mask.all()) else None
                positions = positions if takes_positions and mask is not None else None  # else arange: the default
                return run(ids, mask, positions, prompt)

            stand_in = _PipelineAsModel(config, logits, replica.device)
            result = stand_in.generate(start, use_cache=False, **kwargs)
            sequences = result if torch.is_tensor(result) else result.sequences
            # done before the other replicas: stand-in forwards (its first row, repeated) until they are done too
            while lockstep is not None and (microbatches := lockstep.microbatches(0, configured)) is not None:
                ids = sequences[:1].repeat(microbatches, 1)
                replica.exchange(_IDLE, microbatches, ids, None, None)
                _pipeline_logits(model, microbatches, ids, None, None, _first_row(prompt))
            return replica.exchange(_RESULT, 0, sequences.long())[2][0]
        while True:
            flag, microbatches, (ids, mask, positions) = replica.exchange()
            if flag == _RESULT:
                return ids
            if flag == _PROMPT:
                prompt = (ids, mask)
                continue
            encoder = _first_row(prompt) if flag == _IDLE else prompt
            _pipeline_logits(model, microbatches, ids, mask, positions, encoder)
