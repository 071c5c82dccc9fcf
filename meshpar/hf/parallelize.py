"""``meshpar.parallelize(model, config)``: one call to shard a HuggingFace model with TP, PP and DP (OSLO's promise).

With ``pipeline_parallel_size == 1`` the result trains as usual: ``out = model(**batch, labels=labels)``,
``out.loss.backward()``, ``optimizer.step()`` (call ``model.allreduce_gradients()`` when dp > 1, or use
``model.train_step``). With dp > 1 on CUDA (or ``overlap_grad_reduce: true``) the dp all-reduce of the grads runs in
buckets during backward; run the backwards of earlier gradient-accumulation microbatches under ``model.no_sync()``.
``fsdp: true`` shards parameters, grads and optimizer state over dp instead (FSDP2 per layer, then the root of the
model or of each pipeline stage); checkpoints stay layout-free.

With ``pipeline_parallel_size > 1`` the forward and backward of all microbatches run inside
``loss = model.train_step(**batch, labels=labels)``, which returns the mean loss on every rank. LM losses are
computed from vocab-sharded logits with :func:`meshpar.parallel_cross_entropy`; the logits are never gathered.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar import checkpoint, rebind
from meshpar._compat import local_tensor
from meshpar._same_batch import check_same_batch
from meshpar.context_parallel import gather_sequence
from meshpar.data_parallel import DataParallelGrads, choose_dp_mode
from meshpar.failure import agree, first_failure_on_any_rank, shared_refusal, stop_all_ranks_on_error
from meshpar.grad_clip import mark_shared_copy
from meshpar.grad_sync import OverlappedGradSync
from meshpar.hf.capacity import dropless, record_token_layouts
from meshpar.hf.config import ParallelConfig, load_config
from meshpar.hf.context_parallel import (
    GATHER_POINTS,
    POOLED_TASKS,
    count_positions_over_whole_sequences,
    dense_probe_logits,
    gather_module,
    local_key_padding,
    padding_counted_positions,
    pool_over_whole_sequences,
    probe_length,
    shard_batch,
    use_context_parallel_attention,
    verify_context_parallel,
)
from meshpar.hf.context_parallel import INPUTS_KEY as CONTEXT_INPUTS
from meshpar.hf.fused import use_fused_modules
from meshpar.hf.generation import pipelined_generate
from meshpar.hf.hf_plan import takes_use_cache, text_config
from meshpar.hf.init import init_hf_weights
from meshpar.hf.loss import ROW_TASKS, RowLoss, TokenLoss, causal_labels_shifted, decoder_inputs_from_labels
from meshpar.hf.loss import TASKS as LOSS_TASKS
from meshpar.hf.plans import HFPlan, plan_for, plan_summary
from meshpar.hf.router_loss import (
    PipelineRouterLoss,
    RouterLoss,
    check_router_loss_layout,
    recorded_router_logits,
    router_loss_asked,
    router_loss_wanted,
)
from meshpar.hf.stages import (
    PipelineLayout,
    check_stage_composition,
    decoder_pipeline_plan,
    encoder_decoder_layout,
    head_modules,
    head_output,
    install_decoder_stage,
    tensors_crossing,
)
from meshpar.hf.verify import verify_plan
from meshpar.materialize import is_meta
from meshpar.parallel_dims import ParallelDims, get_parallel, init_parallel, is_initialized
from meshpar.pipeline.model import PipelineModel, StageChunk
from meshpar.pipeline.split import StagePlan, build_stages, plan_encoder_decoder_stages
from meshpar.recipe import Recipe, apply_recipe, block_classes, has_parameter
from meshpar.replicas import make_replicas_equal

_log = logging.getLogger(__name__)

# heads whose loss the last pipeline stage computes from the head's output
PIPELINE_TASKS = (
    "causal_lm",
    "seq2seq_lm",
    "masked_lm",
    "token_classification",
    "sequence_classification",
    "multiple_choice",
    "question_answering",
)
# what every pipeline stage's forward is handed from a batch (and the targets its loss reads): other tensors are refused
# under pp, never dropped (BERT's token_type_ids once were: a silently wrong loss)
_STAGE_INPUTS = ("attention_mask", "input_ids", "position_ids", "token_type_ids", "decoder_input_ids",
                 "decoder_attention_mask")  # fmt: skip
_PIPELINE_TARGETS = ("labels", "start_positions", "end_positions")
# GPT-2 double heads' multiple-choice inputs: only its mc scores and mc loss read them, which no step returns (the LM
# loss and logits, at any pp), so a pipeline needs them on no stage
_UNREAD_UNDER_PP = ("mc_token_ids", "mc_labels")
# heads whose loss is a sum over tokens each cp rank scores for its own part of the sequence, causal or bidirectional
# attention alike; pooled and span heads (POOLED_TASKS) read whole sequences gathered after the layers
CONTEXT_PARALLEL_TASKS = ("causal_lm", "masked_lm", "token_classification", *POOLED_TASKS)


def _check_context_parallel_head(model: nn.Module, plan: HFPlan, config: ParallelConfig) -> None:
    """The heads context parallelism trains: per-token ones, and pooled or span ones where their whole sequences
    can be gathered after the layers (pipelines: each stage cuts, the last gathers; under sequence parallelism the
    probe proves a point whose output is whole over tp again)."""
    name, task = type(model).__name__, plan.task.replace("_", " ")
    if plan.task not in CONTEXT_PARALLEL_TASKS:
        raise ValueError(
            f"context parallelism is for causal / masked LMs, token classifiers and pooled or span heads; {name} is "
            f"a {task} model"
        )
    if plan.task not in POOLED_TASKS:
        return
    why = None
    if getattr(model.config, "is_encoder_decoder", False):
        why = "an encoder-decoder"
    elif is_meta(model):
        why = "a model built on meta (where its whole sequences are gathered is proven on the dense model's probe)"
    elif not plan.layers:
        why = "a model whose layer container meshpar cannot name"
    elif getattr(text_config(model.config), "output_router_logits", False):
        why = "the routers' load-balancing loss (output_router_logits)"
    if why is not None:
        raise ValueError(
            f"{name}: a {task} head under context parallelism (its rows' scores read off whole sequences, gathered "
            f"after the layers) is not supported with {why}; use context_parallel_size 1"
        )


def _check_existing_mesh(config: ParallelConfig) -> None:
    """A config that contradicts the mesh already built in this process is refused (before anything collective)."""
    if not is_initialized():
        return
    dims = get_parallel()
    have = {"tp": dims.tp, "pp": dims.pp, "ep": dims.ep, "cp": dims.cp}
    wanted = {
        "tp": config.tensor_parallel_size,
        "pp": config.pipeline_parallel_size,
        "ep": config.expert_parallel_size,
        "cp": config.context_parallel_size,
    }
    if have != wanted:
        shown = ", ".join(f"{k}={v}" for k, v in have.items())
        asked = ", ".join(f"{k}={v}" for k, v in wanted.items())
        raise ValueError(
            f"meshpar is initialised with {shown}, which the config ({asked}) contradicts; call "
            "meshpar.destroy_parallel() first to parallelize with another layout"
        )


def _init_mesh(config: ParallelConfig) -> ParallelDims:
    if is_initialized():
        return get_parallel()
    return init_parallel(
        tp=config.tensor_parallel_size,
        pp=config.pipeline_parallel_size,
        dp=config.data_parallel_size,
        virtual_pipeline_size=config.virtual_pipeline_size if config.pipeline_parallel_size > 1 else None,
        seed=config.seed,
        ep=config.expert_parallel_size,
        cp=config.context_parallel_size,
    )


class ParallelizedModel(nn.Module):
    def __init__(self, model: nn.Module, config: ParallelConfig, plan: dict | HFPlan | None = None) -> None:
        super().__init__()
        self.parallel_config = config
        # the plan (and its head-count checks) before the mesh: a bad layout fails before any process group is
        # created; where one exists, every rank refuses alike and the job stays usable (meshpar.failure.agree)
        self.plan: HFPlan = agree("parallelize", lambda: self._checked_plan(model, config, plan))
        # from here on ranks communicate: an error on one of them alone stops them all (meshpar.failure)
        with stop_all_ranks_on_error("parallelize"):
            self._build(model, config)

    @staticmethod
    def _checked_plan(model: nn.Module, config: ParallelConfig, plan: dict | HFPlan | None) -> HFPlan:
        if not isinstance(model, nn.Module):
            raise TypeError(f"parallelize takes a HuggingFace model (an nn.Module), got {type(model).__name__}")
        _check_existing_mesh(config)
        built = plan_for(model, config, plan=plan)
        if config.context_parallel_size > 1:
            _check_context_parallel_head(model, built, config)
        _log.info("%s", built)  # the plan that runs (meshpar.hf.plan_for returns it, to print, edit and pass back)
        return built

    def _build(self, model: nn.Module, config: ParallelConfig) -> None:
        self.dims = _init_mesh(config)
        self.hf_config = model.config
        self.model_class = type(model)
        # the loss reads vocab-sharded logits only where the plan really shards the LM head
        vocab = getattr(text_config(self.hf_config), "vocab_size", None)
        self.vocab_sharded = vocab if self.dims.tp > 1 and self.plan.head else 0
        self._from_meta = is_meta(model)  # built on "meta": allocate and initialise only this rank's shards
        # every rank built its own copy: rank 0's values everywhere (DDP's rule), so that verification and sharding
        # see one model, and a refusal can only mean the plan; across pp and dp the pipeline does it (PipelineModel)
        make_replicas_equal(model, self.dims, over=("tp",) if self.dims.pp > 1 else ("tp", "dp"))
        task = self.plan.task
        self.loss_fn: TokenLoss | RowLoss | None = None
        self._cp_shift: bool | None = None  # context parallelism: the labels shift over the whole sequence
        if task in LOSS_TASKS:
            # whether the labels shift is the model's own convention, proven on it (every rank alike: one model)
            shift = agree("parallelize", lambda: causal_labels_shifted(model)) if task == "causal_lm" else None
            if self.dims.cp > 1:  # shifted before the sequence is cut (shard_batch), never again on a shard
                self._cp_shift, shift = bool(shift), False
            self.loss_fn = TokenLoss(task, self.vocab_sharded, self.dims.tp_mesh, shift_labels=shift)
        elif task in ROW_TASKS:
            self.loss_fn = RowLoss(task, self.hf_config)
        check_router_loss_layout(model, self.dims.pp, config.pipeline_schedule)
        self._router_loss = RouterLoss(model)
        self._pipeline_router_loss: PipelineRouterLoss | None = None  # pp > 1: see _split
        # under sequence parallelism the model's own load-balancing loss cannot run on the routers' shards, nor on a
        # pipeline's stages: meshpar's is computed from the recorded logits instead, its formula proven on the dense
        # model here
        self._router_loss_over_shards = self.plan.sequence_parallel and router_loss_asked(model)
        self._no_router_loss = {"output_router_logits": False} if self._router_loss_over_shards else {}
        if self._router_loss_over_shards or (self.dims.pp > 1 and router_loss_asked(model)):
            if self._from_meta:
                raise ValueError(
                    f"{type(model).__name__}: the routers' load-balancing loss under sequence or pipeline parallelism "
                    "is proven on the dense model first, and one built on meta has no values; build it on CPU, or set "
                    "output_router_logits=False"
                )
            self._router_loss.prove(model)
        self._verify(model)
        self._no_kv_cache = {"use_cache": False} if _builds_kv_cache(model) else {}  # see forward
        self.recipe = self._recipe()
        # how grads are averaged over dp: FSDP2, overlapped all-reduces (default on CUDA) or one after backward
        overlap = self.parallel_config.overlap_grad_reduce
        self.dp_mode = choose_dp_mode(self.dims.dp_mesh, fsdp=self._fsdp, overlap=overlap)
        # the layer classes (hybrid models mix several: linear and full attention) for splitting the pipeline
        classes = block_classes(model, self.plan.layers)
        self._layer_cls = (classes[0] if len(classes) == 1 else classes) if classes else None
        originals = {} if self._from_meta else dict(model.named_parameters(remove_duplicate=False))
        probe = (
            dense_probe_logits(
                model, probe_length(model, self.dims.cp, self.dims.tp if self.plan.sequence_parallel else 1)
            )
            if self.dims.cp > 1 and not self._from_meta
            else None
        )
        # the user's attention implementation: generate() decodes with it (no sequence to split, step by step)
        self._dense_attention = getattr(model.config, "_attn_implementation", None)
        self._cp_padding_idx = padding_counted_positions(model)  # RoBERTa's positions count from its padding index
        self._pool_hooks: list[Any] = []  # a pooled or span head's under cp (see _pool_at)
        self._pool_point = GATHER_POINTS[0]
        if self.dims.cp > 1:
            use_context_parallel_attention(model)
            count_positions_over_whole_sequences(model)  # BART and its kin count positions from the chunk's length
            if task in POOLED_TASKS:  # whole sequences gathered at the first point the probe proves (see below)
                self._pool_hooks = self._pool_at(model, GATHER_POINTS[0])
        if self.dims.pp == 1:
            self.module = self._shard(model)
            self.pipeline = None
            self.data_parallel = DataParallelGrads(
                self.dp_mode,
                self.dims.grad_mesh,
                [self.module],
                expert_dp_mesh=self.dims.expert_dp_mesh,
                divisor=self.dims.dp,
            )
        else:
            if probe is not None:  # proven on the whole model (every rank holds it until the split)
                self._verify_context_parallel(model, *probe)
                probe = None
            for handle in self._pool_hooks:  # the stages get their own (see _split)
                handle.remove()
            self.pipeline = self._split(model)
            self.module = None
            self.data_parallel = self.pipeline.data_parallel
            self._tied_group = self._tied_embedding_group()
            if self._from_meta:
                self._broadcast_tied_weights()
            if self.dims.pp_rank == self.dims.pp - 1:  # grad norms count the tied embedding once, on stage 0
                for param in self._local_tied_parameters():
                    mark_shared_copy(param)
        self._record_replacements(originals)
        if probe is not None:
            self._verify_context_parallel(self.module, *probe)
        # capacity-limited experts seeing their tokens out of the dense order, or some of them, learn where each sits
        record_token_layouts(self.local_modules(), self.plan.layers, self.dims.cp > 1)

    def _pool_at(self, model: nn.Module, point: str, gathers: bool = True) -> list[Any]:
        """A pooled or span head's hooks (:func:`meshpar.hf.context_parallel.pool_over_whole_sequences`) on
        ``model`` or a pipeline stage of it, whole sequences gathered at ``point`` (where ``gathers``: a stage that
        holds the model's last layer)."""
        self._pool_point = point
        impl, mesh = self.parallel_config.context_parallel_implementation, self.dims.cp_mesh
        at = gather_module(model, self.plan.layers, point) if gathers else None
        return pool_over_whole_sequences(model, mesh, impl, self._cp_padding_idx, at)

    def _verify_context_parallel(self, module: nn.Module, ids: torch.Tensor, dense_logits: torch.Tensor) -> None:
        """The context-parallel model's logits on a probe equal the dense model's, on every rank (else refused on
        every rank alike). A pooled or span head tries each point its whole sequences can be gathered at
        (:data:`meshpar.hf.context_parallel.GATHER_POINTS`) and keeps the first one proven."""
        impl = self.parallel_config.context_parallel_implementation
        pooled = self.plan.task in POOLED_TASKS
        for index, point in enumerate(GATHER_POINTS if pooled else (None,)):
            if index:  # the hooks of the point before were not proven
                for handle in self._pool_hooks:
                    handle.remove()
                self._pool_hooks = self._pool_at(module, point)
            with dropless(module):  # proven against the dense forward, which drops nothing
                found = verify_context_parallel(
                    module, ids, dense_logits, self.dims, impl, self._cp_padding_idx, pooled, **self._no_router_loss
                )
            failed = first_failure_on_any_rank(found)
            if failed is None:
                return
        rank, what = failed
        # a forward that ran and differs computes something the context-parallel attention does not; one that raised
        # says only that it cannot run this way (its error names why)
        why = (
            "its attention computes something meshpar's context-parallel attention does not (sinks, position biases, "
            "non-standard masks)"
            if what.startswith("its logits differ")
            else "the family's forward does not run with its sequence split over cp ranks"
        )
        raise shared_refusal(
            ValueError(
                f"{self.model_class.__name__} (rank {rank}): under context parallelism {what}: {why}; use "
                "context_parallel_size 1"
            )
        )

    def _record_replacements(self, originals: dict[str, nn.Parameter]) -> None:
        """Remember what replaced each of the model's parameters on this rank (:mod:`meshpar.rebind`; a parameter
        reached by several names, tied, takes the one this rank holds), for :meth:`rebind_optimizer`."""
        current: dict[str, nn.Parameter] = {}
        for module in self.local_modules():
            current.update(module.named_parameters(remove_duplicate=False))
        replaced: dict[int, tuple[nn.Parameter, nn.Parameter | None]] = {}
        for name, original in originals.items():
            held = replaced.get(id(original), (original, None))[1]
            replaced[id(original)] = (original, held if held is not None else current.get(name))
        self._replaced = rebind.replacements(replaced.values())
        rebind.watch(self, self._replaced)

    def rebind_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point an optimizer built on the model before ``parallelize`` at this rank's parallel parameters (see
        :func:`meshpar.rebind.rebind`); returns it. Building the optimizer after ``parallelize`` needs none of this."""
        rebind.rebind(optimizer, self._replaced)
        return optimizer

    def stale_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Called when ``optimizer`` steps while it still holds the parameters this model replaced: stepping them
        would train nothing, so it is refused."""
        raise RuntimeError(
            f"{type(optimizer).__name__} holds the parameters of the model as it was before meshpar.parallelize; "
            "stepping them would train nothing. Call model.rebind_optimizer(optimizer) once, or build the optimizer "
            "after parallelize"
        )

    def _verify(self, model: nn.Module) -> None:
        """Prove a plan that is not one of meshpar's own on the first block of each layer structure and on a custom
        input embedding (see :mod:`meshpar.hf.verify`)."""
        wanted = self.parallel_config.verify
        if not (self.plan.verify if wanted is None else wanted) or self.dims.tp == 1 or not self.plan.styles:
            return
        if self._from_meta:
            _log.warning(
                "%s: the tensor-parallel plan is not verified (built on the meta device)", type(model).__name__
            )
            return
        verify_plan(model, self.plan, self.dims)

    @property
    def _fsdp(self) -> bool:
        return self.parallel_config.fsdp and self.dims.grad_mesh.size() > 1

    # -- building ------------------------------------------------------------------------------------------------
    def _recipe(self) -> Recipe:
        config = self.parallel_config
        return Recipe(
            tp_plan=self.plan.styles,
            blocks=self.plan.layers,
            fixups=self.plan.fixups,
            ties=self.plan.ties,
            activation_checkpointing=config.activation_checkpointing,
            compile=config.compile,
            fsdp=self._fsdp,
            init_weights=init_hf_weights,
        )

    def _shard(self, module: nn.Module) -> nn.Module:
        """The HF model (pp = 1) or one of its stages through the model-agnostic recipe (:mod:`meshpar.recipe`).
        The plan runs at tp=1 too, so parameters have the same logical shapes (GPT-2's fused QKV is
        [in, 3, hidden]) in every layout and checkpoints load across any change of tp."""
        fused = self.parallel_config.fused_kernels
        if fused or (fused is None and self.dims.device.type == "cuda"):
            # before the plan: the fused norms hold the same parameters under the same names, so styles apply alike
            for name, why in use_fused_modules(module).items():
                _log.info("%s stays stock: %s", name, why)
        # a meta-built model's stages were allocated and initialised by the splitter, rank by rank
        return apply_recipe(
            module,
            self.dims,
            self.recipe,
            initialised_per_rank=self._from_meta and self.dims.pp > 1,
            replicas_equal=True,  # made equal before sharding: over tp in _build, over pp and dp by the pipeline
        )

    def _pipeline_plan(self, model: nn.Module) -> tuple[PipelineLayout, StagePlan]:
        """The model's pipeline layout and the stage plan that is built, proven on the dense model (no collective:
        each rank decides alike)."""
        family, config = self.plan.family, self.parallel_config
        if self.plan.task not in PIPELINE_TASKS:
            why = "meshpar has no loss of its own for it to compute on the last stage"
            raise ValueError(
                f"pipeline parallelism runs heads meshpar computes the loss of on the last stage ({PIPELINE_TASKS}); "
                f"{type(model).__name__} has a {self.plan.task!r} head: {why}; use pipeline_parallel_size 1 (tensor "
                "and data parallelism work for it)"
            )
        if getattr(model.config, "is_encoder_decoder", False):
            return self._encoder_decoder_plan(model)
        layout, stages = decoder_pipeline_plan(
            model,
            self.dims.pp * config.virtual_pipeline_size,
            transformer_layer_cls=self._layer_cls,
            auto_partition=config.auto_partition,
            from_meta=self._from_meta,
        )
        crossing = tensors_crossing(layout, stages) if config.pipeline_schedule == "zero_bubble" else []
        if max(crossing, default=1) > 1:
            raise ValueError(
                f"the zero_bubble schedule splits the backward of stages that pass one tensor on; {family}'s stages "
                f"pass on {crossing} (the hidden states and what its layers are handed besides): use pipeline_schedule "
                "'1f1b'"
            )
        return layout, stages

    def _encoder_decoder_plan(self, model: nn.Module) -> tuple[PipelineLayout, StagePlan]:
        """An encoder-decoder's layout and apex's split-rank stage plan (the first stages run the encoder, the rest
        the decoder), proven on the dense model."""
        config = self.parallel_config
        if config.auto_partition:
            raise ValueError(
                "auto_partition balances one layer list; an encoder-decoder's stages split at the encoder's end "
                "(apex's split rank); drop auto_partition"
            )
        if config.pipeline_schedule == "zero_bubble":
            raise ValueError(
                "the zero_bubble schedule splits the backward of stages that pass one tensor on; an encoder-decoder's "
                "decoder stages pass on the encoder's output too: use pipeline_schedule '1f1b'"
            )
        layout = encoder_decoder_layout(model)
        lists = [(fqn, list(model.get_submodule(fqn)._modules)) for fqn, _, _ in layout.layer_lists()]
        first, last = layout.stage_sides(model)
        stages = plan_encoder_decoder_stages(
            lists[0],
            lists[1],
            self.dims.pp * config.virtual_pipeline_size,
            first_stage_modules=first,
            last_stage_modules=[*last, *head_modules(model, layout.base)],
            encoder_modules=layout.middle,  # each holds parameters (parameter-free pieces run on every stage)
        )
        check_stage_composition(model, layout, stages)
        return layout, stages

    def _split(self, model: nn.Module) -> PipelineModel:
        """The pipeline, decided once and proven on the dense model (:meth:`_pipeline_plan`); this rank's stages
        built once from that plan, each given the model's own forward (:func:`meshpar.hf.stages.install_decoder_stage`:
        transformers' pipeline plan, meshpar's table (GPT-2, BERT) or a plan read off the model) and sharded, then run
        by meshpar's pipeline runtime."""
        config, loss_fn = self.parallel_config, self.loss_fn
        # a refusal is agreed on by every rank (one collective), so it leaves the job usable; the plan's probes run
        # the dense forward, with the model's own attention under context parallelism
        with self._own_attention(model):
            layout, plan = agree("parallelize", lambda: self._pipeline_plan(model))
        if loss_fn is None:  # _pipeline_plan refuses heads meshpar has no loss for; this guards that invariant
            raise ValueError(f"{type(model).__name__}: pipeline stages need meshpar's loss for the model's head")
        shards = self.dims.tp if config.sequence_parallel else 1  # later stages receive sequence shards
        # every rank built the whole model: the first rank's values along pp and dp before splitting (DDP's rule)
        make_replicas_equal(model, self.dims, over=("pp", "dp"))
        stages = build_stages(
            model, plan, self.dims.pp_rank, self.dims.pp, keep_modules=layout.keep,
            stage_init_fn=init_hf_weights,  # used only for a model built on "meta"
            device=self.dims.device,
        )  # fmt: skip
        # every stage runs the model's forward on the ids (and positions: generation from padded prompts)
        calls = (*_STAGE_INPUTS, CONTEXT_INPUTS)
        if self.dims.cp > 1 and self.plan.task in POOLED_TASKS:  # each stage cuts its inputs; the last gathers
            self._pool_hooks = [
                handle
                for index, stage in stages
                for handle in self._pool_at(stage, self._pool_point, gathers=index == plan.num_stages - 1)
            ]
        chunks = [
            StageChunk(self._shard(install_decoder_stage(stage, layout, shards)), index, ["input_ids"], calls)
            for index, stage in stages
        ]
        # the routers' load-balancing loss: every stage's routing counted between the forwards and the backwards
        self._pipeline_router_loss = (
            PipelineRouterLoss(model, self._router_loss, self.dims, self.plan.sequence_parallel)
            if router_loss_asked(model)
            else None
        )
        if self._pipeline_router_loss is not None:
            for chunk in chunks:
                self._pipeline_router_loss.attach(chunk)
        return PipelineModel(
            chunks,
            plan,
            self.dims,
            num_microbatches=config.num_microbatches,
            loss_fn=loss_fn.pipeline_loss,
            schedule=config.pipeline_schedule,
            dp_mode=self.dp_mode,
            average_grads_over_dp=False,  # train_step finishes the averaging (after the tied-embedding sync)
            broadcast_loss=True,
            between_forwards_and_backwards=(
                self._pipeline_router_loss.sum_counts if self._pipeline_router_loss is not None else None
            ),
        )

    def _tied_embedding_group(self) -> dist.ProcessGroup | None:
        """The group summing the two stages' grads of a tied embedding (made once per mesh, see
        :meth:`ParallelDims.pipeline_ends_group`)."""
        return self.dims.pipeline_ends_group() if self._ties_across_stages() else None

    def _ties_across_stages(self) -> bool:
        """Whether a tied parameter has copies on more than one stage (an LM head tied to the input embedding: one on
        the first stage, one on the last), decided from the stage plan alike on every rank: false only where every
        tied name lives on the first stage (an encoder-decoder classifier's embeddings, tied to one another: one
        parameter, nothing to sum)."""
        first = self.pipeline.plan.first_stage_modules
        names = {n for pair in self.tied_parameters.items() for n in pair}
        return not all(any(n.startswith(f"{m}.") for m in first) for n in names)

    # -- running -------------------------------------------------------------------------------------------------
    def local_modules(self) -> list[nn.Module]:
        """The HF modules (or pipeline stages) this rank holds, with the original parameter names."""
        return [self.module] if self.module is not None else self.pipeline.local_modules()

    def _checked_on_device(self, labels: torch.Tensor | None, inputs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """:meth:`_check_inputs`, then :meth:`_on_device`, then an encoder-decoder's decoder inputs from the labels
        where none are given: what every entry point does with a batch."""
        self._check_inputs(inputs)
        tensors = {k: v for k, v in (*inputs.items(), ("labels", labels)) if isinstance(v, torch.Tensor)}
        check_same_batch(tensors, self.dims, type(self).__name__)
        labels, inputs = self._on_device(labels, inputs)
        if (
            self.plan.task == "seq2seq_lm"
            and labels is not None
            and inputs.get("decoder_input_ids") is None
            and inputs.get("decoder_inputs_embeds") is None
        ):  # what the model does with labels alone: the decoder's inputs are the labels shifted right
            inputs = {**inputs, "decoder_input_ids": decoder_inputs_from_labels(self.local_modules()[0], labels)}
        return labels, inputs

    def _check_inputs(self, inputs: dict[str, Any]) -> None:
        """Inputs meshpar cannot use get their own message (not a traceback from deep inside the model)."""
        ids = inputs.get("input_ids")
        if isinstance(ids, torch.Tensor) and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
            raise TypeError(
                f"input_ids must hold integer token ids (torch.long, as tokenizers return them), got {ids.dtype}; "
                "convert with .long(), or pass vectors as inputs_embeds"
            )
        tokens = ids if isinstance(ids, torch.Tensor) else inputs.get("inputs_embeds")
        if self.pipeline is not None:
            known = (*_STAGE_INPUTS, *_PIPELINE_TARGETS, *_UNREAD_UNDER_PP)
            unused = sorted(k for k, v in inputs.items() if isinstance(v, torch.Tensor) and k not in known)
            if unused:
                raise ValueError(
                    f"{unused}: pipeline stages are handed {list(_STAGE_INPUTS)} of a batch, and its loss the "
                    f"targets {list(_PIPELINE_TARGETS)}; drop the others, or use pipeline_parallel_size 1"
                )
        tp = self.dims.tp
        if self.parallel_config.sequence_parallel and isinstance(tokens, torch.Tensor) and tokens.shape[1] % tp:
            raise ValueError(
                f"sequence_parallel splits the sequence over tp={tp}, but this batch's sequence length "
                f"{tokens.shape[1]} is not a multiple of {tp}; pad the sequences to a multiple of {tp} (tokenizers: "
                f"pad_to_multiple_of={tp}; padded positions masked in attention_mask and labelled -100)"
            )

    def _on_device(self, labels: torch.Tensor | None, inputs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The batch on this rank's device: a data loader's CPU tensors work on CUDA ranks as they do on CPU ones."""
        device = self.dims.device

        def move(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.device != device:
                return value.to(device, non_blocking=True)
            return value

        return move(labels), {name: move(value) for name, value in inputs.items()}

    def forward(self, labels: torch.Tensor | None = None, **inputs: Any) -> Any:
        return self._module_forward(labels, inputs)

    def _module_forward(
        self, labels: torch.Tensor | None, inputs: dict[str, Any], normalizer: torch.Tensor | None = None
    ) -> Any:
        """The HF model's forward on this rank's shards (pp=1), with meshpar's vocab-parallel loss (over
        ``normalizer``, the global batch's scored tokens, when given)."""
        labels, inputs = self._checked_on_device(labels, inputs)
        if self.pipeline is not None:
            raise RuntimeError("with pipeline_parallel_size > 1 use loss = model.train_step(**batch, labels=labels)")
        return self._forward_on(*self._split_targets(labels, inputs), normalizer)

    def _forward_on(self, targets: Any, inputs: dict[str, Any], normalizer: torch.Tensor | None) -> Any:
        """:meth:`_module_forward` on a checked batch whose targets are already apart from the model's inputs."""
        inputs = {**inputs, **self._no_router_loss}  # see _build: the model's own cannot run on sequence shards
        if torch.is_grad_enabled():
            # a training forward needs no key/value cache, and one costs: compiled blocks guard on their layer's cache
            # slot, so each layer compiles its own graph and past dynamo's recompile limit (8) the rest run eagerly;
            # a checkpoint's recompute appends to it again (HF turns it off under gradient checkpointing too); and an
            # output that keeps it holds every layer's keys and values alive. Pass use_cache=True to get one anyway.
            inputs = {**self._no_kv_cache, **inputs}
        if targets is None or self.loss_fn is None:
            return self.module(**inputs, **({"labels": targets} if targets is not None else {}))
        if self._router_loss_over_shards:
            with recorded_router_logits(self.module) as router_logits:
                out = self.module(**inputs)
            out["loss"] = self.loss_fn.of_output(out, targets, normalizer)
            padding = local_key_padding(inputs, self.dims.cp_mesh) if self.dims.cp > 1 else inputs.get("attention_mask")
            out["loss"] = out["loss"] + self._router_loss.over_shards(router_logits, padding, self.dims)
            return out
        out = self.module(**inputs)
        out["loss"] = self.loss_fn.of_output(out, targets, normalizer)
        if router_loss_wanted(out):  # the routers' load-balancing loss, over the global batch as the tokens' loss
            scored = local_key_padding(inputs, self.dims.cp_mesh) if self.dims.cp > 1 else None
            out["loss"] = out["loss"] + self._router_loss(out, inputs.get("attention_mask"), self.dims, scored)
        return out

    @property
    def _cuts_sequences(self) -> bool:
        """Whether a step cuts each batch into this cp rank's chunks before the model (cp > 1, per-token heads); a
        pooled or span head is called with whole sequences (its base model cuts them: ``_pool_at``)."""
        return self.dims.cp > 1 and self.plan.task not in POOLED_TASKS

    def _split_targets(self, labels: torch.Tensor | None, inputs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """(what the loss scores, the model's inputs): the labels, or a question-answering head's start and end
        positions taken out of the inputs; for a head with the model's own loss, the labels as they are."""
        if self.loss_fn is None:
            return labels, inputs
        if self._cuts_sequences:
            # this cp rank's part of every sequence, the labels shifted over the whole of it first (pooled heads are
            # called with whole sequences: pool_over_whole_sequences cuts them inside)
            impl = self.parallel_config.context_parallel_implementation
            return shard_batch(labels, inputs, self.dims.cp_mesh, impl, bool(self._cp_shift), self._cp_padding_idx)
        return self.loss_fn.split_targets(labels, inputs)

    def _loss_normalizer(self, targets: Any, inputs: dict[str, Any]) -> torch.Tensor | None:
        """What every microbatch's losses on every dp rank are divided by: the global batch's scored tokens, rows or
        label elements (``global_normalizer`` of :mod:`meshpar.hf.loss`); ``None`` for a head with the model's own
        loss, checked by :meth:`_check_rows_alike` instead."""
        if self.loss_fn is None:
            self._check_rows_alike(targets, inputs)
            return None
        if targets is None:
            raise ValueError(
                f"{self.model_class.__name__}: a training or evaluation step needs the targets its loss scores ("
                + (
                    "start_positions and end_positions"
                    if isinstance(self.loss_fn, RowLoss) and self.loss_fn.qa
                    else "labels"
                )
                + ")"
            )
        microbatches = self.parallel_config.num_microbatches if self.pipeline is not None else 1
        return self.loss_fn.global_normalizer(targets, inputs, self.dims, microbatches)

    @staticmethod
    def _with_normalizer(inputs: dict[str, Any], normalizer: torch.Tensor | None) -> dict[str, Any]:
        """The pipeline's inputs with the step's loss normaliser (a 0-d tensor each microbatch gets whole: the last
        stage's loss_fn receives it)."""
        if normalizer is None:
            return inputs
        # a 0-d tensor reaches every microbatch whole; a per-term one goes as a tuple of them
        return {**inputs, "loss_normalizer": normalizer if normalizer.dim() == 0 else tuple(normalizer.unbind())}

    def _check_rows_alike(self, labels: torch.Tensor | None, inputs: dict[str, Any]) -> None:
        """A head meshpar has no loss of its own for keeps the model's loss, a mean over something in each replica's
        batch: exact across dp replicas only when every replica holds as many rows and none is unscored (-100 in
        its labels, or in any input named like a target: ``*labels``, ``*label``, ``*positions``): the mean of the
        replicas' means is then the global mean. Anything else is refused, on every rank alike (every rank sees the
        same counts), never averaged per replica."""
        if self.dims.dp == 1:
            return
        targets = [labels] if isinstance(labels, torch.Tensor) else []
        targets += [
            value
            for name, value in inputs.items()
            if isinstance(value, torch.Tensor)
            and name.endswith(("labels", "label", "positions"))
            and name != "position_ids"
        ]
        if not targets:
            return
        rows = targets[0].shape[0]
        mine = torch.tensor([rows, sum(int((t == -100).sum()) for t in targets)], device=self.dims.device)
        counts = [torch.zeros_like(mine) for _ in range(self.dims.dp)]
        dist.all_gather(counts, mine, group=self.dims.dp_mesh.get_group())
        rows, unscored = [int(c[0]) for c in counts], sum(int(c[1]) for c in counts)
        if len(set(rows)) > 1 or unscored:
            raise shared_refusal(
                ValueError(
                    f"{self.model_class.__name__} keeps the model's own loss, a mean over each replica's rows; at "
                    f"dp={self.dims.dp} that equals the global batch's loss only with as many rows on every replica "
                    f"and none unscored, but the replicas hold {rows} rows and {unscored} labels of -100. Give every "
                    "replica the same number of scored rows, or use data_parallel_size 1"
                )
            )

    @stop_all_ranks_on_error("train_step")
    def train_step(
        self, labels: torch.Tensor | None = None, *, sync_dp_grads: bool = True, **inputs: Any
    ) -> torch.Tensor:
        """Forward and backward of one batch (all microbatches under pp), tied-weight and dp grad sync; returns the
        mean token loss of the global batch (all dp ranks), whose grads the parameters then hold. The optimizer step
        is yours. ``sync_dp_grads=False`` leaves each dp rank's grads un-averaged for an optimizer that reduces them
        itself (``DistributedOptimizer(zero1=True, reduce_scatter_grads=True)``)."""
        if not sync_dp_grads and self.grad_syncs:
            raise ValueError(
                "sync_dp_grads=False, but overlap_grad_reduce already all-reduces the grads during backward; build the "
                "model with overlap_grad_reduce: false when the optimizer reduce-scatters them"
            )
        labels, inputs = self._checked_on_device(labels, inputs)
        targets, model_inputs = self._split_targets(labels, inputs)
        normalizer = self._loss_normalizer(targets, model_inputs)
        if self.pipeline is None:
            loss = self._step_loss(targets, model_inputs, normalizer)
            loss.backward()
            loss = loss.detach()
        else:
            labels, inputs = (targets, model_inputs) if self._cuts_sequences else (labels, inputs)
            loss = self._pipeline_loss(
                lambda: self.pipeline.run_train(labels=labels, **self._with_normalizer(inputs, normalizer))
            )
        if sync_dp_grads:
            self.allreduce_gradients()  # first: the dp all-reduces may still be in flight (overlap_grad_reduce)
        if self.pipeline is not None:
            self._sync_tied_grads()  # the tied-embedding sum commutes with the dp mean
        return self._mean_over_dp(loss) if self.pipeline is None else loss

    def _pipeline_loss(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A pipeline step's loss on every rank: ``run``'s (already the dp mean: broadcast_and_average_loss), summed
        over the cp ranks' shares, plus the routers' load-balancing loss of the batch where the model adds one
        (:class:`meshpar.hf.router_loss.PipelineRouterLoss`, counted during the step; the same on every rank)."""
        if self._pipeline_router_loss is None:
            return self._summed_over_cp(run())
        self._pipeline_router_loss.start()
        loss = self._summed_over_cp(run())
        return loss + self._pipeline_router_loss.value

    def _step_loss(self, targets: Any, inputs: dict[str, Any], normalizer: torch.Tensor | None) -> torch.Tensor:
        """The loss a step (pp=1) trains or evaluates on a checked batch split by :meth:`_split_targets`: the
        output's ``loss`` (meshpar's for the heads it knows)."""
        out = self._forward_on(targets, inputs, normalizer)
        if getattr(out, "loss", None) is None:
            others = [k for k in out if k.endswith("loss") and k != "loss"] if hasattr(out, "keys") else []
            raise ValueError(
                f"{self.model_class.__name__} returned no loss for this batch"
                + (f" (it returned {others}, which meshpar does not combine for you)" if others else "")
                + ": pass the targets its loss needs (labels), or run model(**batch) and backward your own loss"
            )
        return out.loss

    def _mean_over_dp(self, loss: torch.Tensor) -> torch.Tensor:
        """Each dp replica saw its own slice of the batch: report the mean over replicas on every rank."""
        if self.dims.dp == 1 and self.dims.cp == 1:
            return loss
        loss = loss.detach().clone()
        # under cp each rank holds its tokens' share of its replica's loss: summed over cp, averaged over dp
        dist.all_reduce(loss, group=self.dims.grad_mesh.get_group())
        return loss / self.dims.dp

    def _summed_over_cp(self, loss: torch.Tensor) -> torch.Tensor:
        """A pipeline's loss (the dp mean) under cp: each cp rank's is its tokens' share, summed to the batch's."""
        if self.dims.cp == 1:
            return loss
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=self.dims.cp_mesh.get_group())
        return loss

    @contextlib.contextmanager
    def _eval_mode(self) -> Any:
        """Evaluation without dropout (``module.eval()``), each module's own mode restored after."""
        modes = [(m, m.training) for local in self.local_modules() for m in local.modules()]
        for local in self.local_modules():
            local.eval()
        try:
            yield
        finally:
            for module, training in modes:
                module.training = training

    @torch.no_grad()
    @stop_all_ranks_on_error("eval_loss")
    def eval_loss(self, labels: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        """The mean loss of the global batch without gradients, in eval mode (no dropout; the mode is restored
        after), on every rank (pipeline: forward-only schedule)."""
        labels, inputs = self._checked_on_device(labels, inputs)
        targets, model_inputs = self._split_targets(labels, inputs)
        normalizer = self._loss_normalizer(targets, model_inputs)
        with self._eval_mode():
            if self.pipeline is None:
                return self._mean_over_dp(self._step_loss(targets, model_inputs, normalizer))
            # already the dp mean on every rank
            labels, inputs = (targets, model_inputs) if self._cuts_sequences else (labels, inputs)
            return self._pipeline_loss(
                lambda: self.pipeline.run_eval(labels=labels, **self._with_normalizer(inputs, normalizer))
            )

    @torch.no_grad()
    def eval_logits(self, labels: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor | None:
        """Logits of the whole batch (this rank's vocab shard under tp) where the last stage lives, else ``None``;
        in eval mode, as :meth:`eval_loss`. Under context parallelism each cp rank computes its chunks' logits and
        returns every position's, gathered over cp into the sequence's order (a pooled or span head's are whole
        already)."""
        with self._eval_mode():
            if self.pipeline is None:
                logits = head_output(self._module_forward(labels, inputs))
            else:
                labels, inputs = self._checked_on_device(labels, inputs)
                if self._cuts_sequences:  # this cp rank's chunks of every microbatch's rows (as train_step)
                    labels, inputs = self._split_targets(labels, inputs)
                _, outputs = self.pipeline.run_eval(return_outputs=True, labels=labels, **inputs)
                logits = torch.cat(outputs) if outputs else None
        if logits is not None and self._cuts_sequences:
            logits = gather_sequence(logits, 1, self.dims.cp_mesh)  # the cp ranks of a last stage hold their chunks'
        return logits

    @property
    def grad_syncs(self) -> list[OverlappedGradSync]:
        """The dp grad syncs that run during backward (``overlap_grad_reduce``): one, or one per pipeline chunk."""
        return self.data_parallel.syncs

    def allreduce_gradients(self) -> None:
        """Average the grads over dp (:class:`meshpar.data_parallel.DataParallelGrads`): wait for the all-reduces
        backward started (``overlap_grad_reduce``), or run them now; FSDP2 reduced them during backward."""
        self.data_parallel.finish()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backwards inside accumulate grads locally, without starting dp all-reduces (gradient accumulation: all
        microbatches but the last)."""
        return self.data_parallel.no_sync()

    def _local_tied_parameters(self) -> list[nn.Parameter]:
        """This rank's copies of the tied embedding / LM head, in the same (name) order on every rank of the
        embedding group; none without such a group."""
        if self._tied_group is None:
            return []
        names = sorted({n for pair in self.tied_parameters.items() for n in pair})
        held = [m.get_parameter(n) for m in self.local_modules() for n in names if has_parameter(m, n)]
        # one parameter reached by several names (an encoder-decoder's shared embedding: both stacks' embed_tokens)
        return list({id(p): p for p in held}.values())

    @torch.no_grad()
    def _broadcast_tied_weights(self) -> None:
        """A meta-built model's first and last stage initialised their copies of the tied embedding separately: the
        first stage's wins."""
        for param in self._local_tied_parameters():
            dist.broadcast(local_tensor(param), group=self._tied_group, group_src=0)

    def _sync_tied_grads(self) -> None:
        for param in self._local_tied_parameters():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(local_tensor(grad), group=self._tied_group)
            param.grad = grad

    @torch.no_grad()
    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """HF ``generate`` (greedy, sampling, beams, ...) with full logits gathered over tp; under pp one rank per
        replica drives HF's loop over the pipeline (:mod:`meshpar.hf.generation`) and every rank returns its
        sequences. Under context parallelism every cp rank decodes the whole prompt with the model's own attention
        (the weights are whole over cp; a decoding step has one token to split), with its KV cache."""
        if self.pipeline is not None:  # replicas coupled by ep or FSDP2 decode in lockstep there
            with self._dense_attention_for_decoding():
                return pipelined_generate(self, *args, **kwargs)
        if self.dims.ep > 1:
            # every MoE layer exchanges tokens with the other dp replicas of the ep group: all of them must run the
            # same number of decoding steps, however many each needs (HF's lockstep loop, as for ZeRO-3)
            kwargs.setdefault("synced_gpus", True)
        if self.parallel_config.sequence_parallel:
            raise RuntimeError("generate() is not supported with sequence_parallel (decoding steps have length 1)")
        # the vocab-parallel head, wherever the model keeps it (RoBERTa's is lm_head.decoder), gathers the logits
        head = self.module.get_submodule(self.plan.head) if self.plan.head else None
        previous = getattr(head, "gather_output", None)
        if previous is not None:
            head.gather_output = True
        with self._dense_attention_for_decoding():
            try:
                return self.module.generate(*args, **kwargs)
            finally:
                if previous is not None:
                    head.gather_output = previous

    def _dense_attention_for_decoding(self) -> contextlib.AbstractContextManager:
        """Under context parallelism, the model's own attention implementation while it decodes (on each of this
        rank's pipeline stages); context-parallel attention again after."""
        stack = contextlib.ExitStack()
        for module in self.local_modules():
            stack.enter_context(self._own_attention(module))
        return stack

    @contextlib.contextmanager
    def _own_attention(self, model: nn.Module) -> Any:
        """Under context parallelism, ``model`` with its own attention implementation inside (decoding, a dense
        probe); context-parallel attention again after."""
        if self.dims.cp == 1:
            yield
            return
        cp_attention = model.config._attn_implementation
        model.set_attn_implementation(self._dense_attention)
        try:
            yield
        finally:
            model.set_attn_implementation(cp_attention)

    def plan_summary(self) -> str:
        return "\n\n".join(plan_summary(m, self.plan.styles) for m in self.local_modules())

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def save_parallelized(
        self, save_directory: str | Path, merge_checkpoints: bool = False, step: int = 0, **save_pretrained_kwargs: Any
    ) -> Path:
        """A DCP checkpoint (any layout can load it), or with ``merge_checkpoints`` a plain HF directory
        (``config.json`` + ``model.safetensors``) that ``from_pretrained`` loads on one process. Other keywords are
        ``save_pretrained``'s (OSLO's contract), for the merged directory."""
        directory = Path(save_directory)
        if not merge_checkpoints:
            if save_pretrained_kwargs:
                raise TypeError(
                    f"save_parallelized: {sorted(save_pretrained_kwargs)} are save_pretrained arguments and apply to "
                    "merge_checkpoints=True only"
                )
            return checkpoint.save(directory, self.local_modules(), step=step, tied=self.tied_parameters)
        # the merge goes through a DCP checkpoint (checkpoint.consolidated_state): only rank 0 ever holds the whole
        # model, and it is the same merge as checkpoint.export_consolidated
        scratch = directory.parent / f".{directory.name}.merging"
        saved = checkpoint.save(scratch, self.local_modules(), step=0, tied=self.tied_parameters)
        if dist.get_rank() == 0:
            dense = self.model_class(self.hf_config)
            dense.load_state_dict(checkpoint.consolidated_state(saved), strict=False)  # stored in HF's shapes
            dense.save_pretrained(directory, **save_pretrained_kwargs)
            shutil.rmtree(scratch, ignore_errors=True)
        dist.barrier()
        return directory

    def from_parallelized(self, directory: str | Path) -> ParallelizedModel:
        """Load a checkpoint written by :meth:`save_parallelized` (DCP or merged HF directory) into this layout."""
        directory = Path(directory)
        if (directory / "model.safetensors").exists():
            checkpoint.load_consolidated(
                directory, self.local_modules(), strict=False, reshape=True, tied=self.tied_parameters
            )
        else:
            checkpoint.load(directory, self.local_modules(), tied=self.tied_parameters)
        return self

    @property
    def tied_parameters(self) -> dict[str, str]:
        """Tied LM head -> input embedding: saved once, restored into both (also across pipeline stages)."""
        return {target: source for target, source in self.plan.ties if target.endswith(".weight")}


def parallelize(
    model: nn.Module, config: ParallelConfig | dict | str | None = None, *, plan: dict | HFPlan | None = None
) -> ParallelizedModel:
    """Shard a HuggingFace model by the plan the installed transformers ships for its family (or meshpar's table in
    the same format where it ships none: GPT-2, BERT, OPT, ...), verified on one block, or by a user ``plan`` that
    replaces it: a dict ``FQN pattern -> style``, or the complete plan :func:`meshpar.hf.plan_for` returns (printed,
    edited, passed back: applied unchanged). The plan that runs is logged. An error on any rank once the mesh exists
    stops every rank (:mod:`meshpar.failure`)."""
    return ParallelizedModel(model, load_config(config), plan)


def _builds_kv_cache(model: nn.Module) -> bool:
    """The HF model's forward takes ``use_cache`` and builds a key/value cache unless told not to (decoders; BERT's
    heads take no such argument)."""
    return takes_use_cache(model) and bool(getattr(getattr(model, "config", None), "use_cache", False))
