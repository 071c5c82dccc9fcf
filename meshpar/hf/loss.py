"""The losses of HF heads under meshpar, each normalised over the whole global batch.

Token-level heads (language models, token classifiers; :class:`TokenLoss`): vocab-parallel where the LM head is
vocab-sharded, the sum of the token losses over the count of scored tokens in the global batch (every microbatch,
every dp replica), so loss and grads equal the single-process mean however padding falls: a mean of per-microbatch
(or per-replica) means would weigh the tokens of a padded microbatch more (the gradient-accumulation loss bug).
Per-example heads (sequence classification, multiple choice, question answering; :class:`RowLoss`): HF's losses,
each term's sum over the global count of the rows (or label elements) it scores. ``global_normalizer`` computes the
counts once per step; the step hands them to every call of the loss (an argument, no state in the loss).
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshpar._compat import DeviceMesh
from meshpar.hf.hf_plan import dense_probe
from meshpar.parallel_dims import ParallelDims
from meshpar.tensor_parallel import parallel_cross_entropy
from meshpar.tensor_parallel.cross_entropy import IGNORE_INDEX, token_cross_entropy

TASKS = ("causal_lm", "masked_lm", "seq2seq_lm", "token_classification")
ROW_TASKS = ("sequence_classification", "multiple_choice", "question_answering")


def causal_labels_shifted(model: nn.Module) -> bool:
    """Whether a causal LM's own loss scores the logits at position t against the label at t + 1 (HF's
    ``ForCausalLMLoss``: nearly every family) or at t (the ``ForCausalLM`` classes of BART, mBART, Blenderbot,
    Pegasus, Marian..., whose labels come shifted by the caller): meshpar's loss must do what the model does. Proven
    by one dense forward on a small batch where the model can run it; otherwise (a model on meta, a forward that
    needs more inputs) read from its forward: the shared loss function shifts. Refused when neither tells."""
    shared = "loss_function" in _forward_source(model)
    if any(p.is_meta for p in model.parameters()):
        if shared:
            return True
        raise ValueError(
            f"{type(model).__name__} computes its own causal-LM loss, whose label alignment meshpar proves on the "
            "dense model, which a model built on meta cannot run; build it on cpu"
        )
    try:
        with dense_probe(model) as (forward, ids):
            out = forward(labels=ids)
    except Exception:  # the forward needs more than ids (a multimodal model): the forward's own words decide
        out = None
    if out is not None and getattr(out, "loss", None) is not None and getattr(out, "logits", None) is not None:
        logits = out.logits.float()
        candidates = {
            True: F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()),
            False: F.cross_entropy(logits.flatten(0, 1), ids.flatten()),
        }
        for shifted, loss in candidates.items():
            if torch.allclose(loss, out.loss.float(), rtol=1e-4, atol=1e-6):
                return shifted
    if shared:  # a loss with more in it (a router's auxiliary loss): the shared function shifts
        return True
    raise ValueError(
        f"{type(model).__name__} computes its own causal-LM loss, which matches neither next-token labels nor labels "
        "at the logits' own positions; meshpar cannot reproduce it (use pipeline and tensor parallelism with a model "
        "whose loss is transformers' shared causal-LM loss)"
    )


def _forward_source(model: nn.Module) -> str:
    try:
        return inspect.getsource(inspect.unwrap(type(model).forward))
    except (OSError, TypeError):
        return ""


def decoder_inputs_from_labels(model: object, labels: torch.Tensor) -> torch.Tensor:
    """An encoder-decoder's decoder inputs built from ``labels`` as its own forward builds them when handed labels
    alone (meshpar takes the labels out to compute the loss itself): the model's
    ``prepare_decoder_input_ids_from_labels`` (T5, BART), else its modeling module's ``shift_tokens_right`` with the
    config's pad and decoder-start tokens (Blenderbot)."""
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return prepare(labels=labels)
    # the modeling module of the model's class (a pipeline stage's class is meshpar's subclass of it)
    modules = (sys.modules.get(cls.__module__) for cls in type(model).__mro__)
    shift = next((m.shift_tokens_right for m in modules if hasattr(m, "shift_tokens_right")), None)
    config = getattr(model, "config", None)
    if callable(shift) and config is not None:
        return shift(labels, config.pad_token_id, config.decoder_start_token_id)
    raise ValueError(
        f"{type(model).__name__}: meshpar cannot build its decoder inputs from the labels; pass decoder_input_ids"
    )


class TokenLoss:
    """``loss(logits, labels, normalizer)``: summed token losses over ``normalizer`` (the global batch's scored tokens,
    :meth:`global_normalizer`), or their mean over this batch without one."""

    def __init__(
        self, task: str, vocab_sharded: int, tp_mesh: DeviceMesh | None = None, *, shift_labels: bool | None = None
    ) -> None:
        """``vocab_sharded`` is the vocabulary size when the logits are vocab-sharded over ``tp_mesh``, else 0.
        ``shift_labels``: score position t against label t + 1 (default: for causal LMs; BART's ``ForCausalLM``
        classes do not, :func:`causal_labels_shifted`)."""
        if vocab_sharded and tp_mesh is None:
            raise ValueError("vocab-sharded logits need the tp mesh they are sharded over")
        if task not in TASKS:
            raise ValueError(f"no token loss for task {task!r}; one of {TASKS}")
        self.causal = task == "causal_lm" if shift_labels is None else shift_labels
        self.vocab_sharded = vocab_sharded
        self.tp_mesh = tp_mesh

    def scored(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels a token loss is computed for, at the logits' positions: causal LMs predict token t+1 at
        position t, so the labels shift left along the sequence (the last dim: GPT-2's double heads score
        ``[batch, choices, seq]``) and the last position scores nothing (as HF does; slicing the logits instead would
        copy them forward and zero-fill plus copy a full-size grad in backward)."""
        return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX) if self.causal else labels

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, normalizer: torch.Tensor | None = None
    ) -> torch.Tensor:
        scored = self.scored(labels)
        if self.vocab_sharded:
            losses = parallel_cross_entropy(logits, scored, vocab_size=self.vocab_sharded, tp_mesh=self.tp_mesh)
        else:
            losses = token_cross_entropy(logits, scored)
        return losses.sum() / (normalizer if normalizer is not None else (scored != IGNORE_INDEX).sum().clamp(min=1))

    def split_targets(self, labels: torch.Tensor | None, inputs: dict) -> tuple[torch.Tensor | None, dict]:
        """(what the loss scores, the model's inputs): the labels, kept apart from the inputs."""
        return labels, inputs

    def of_output(self, output: object, labels: torch.Tensor, normalizer: torch.Tensor | None = None) -> torch.Tensor:
        return self(output.logits, labels, normalizer)  # type: ignore[attr-defined]

    def pipeline_loss(  # noqa: ANN201
        self,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_normalizer: torch.Tensor | None = None,
        **_: object,
    ):
        """The last pipeline stage's ``loss_fn``: it receives the microbatch's inputs, the step's normaliser among
        them (a 0-d tensor every microbatch gets whole)."""
        return self(logits, labels, loss_normalizer)

    def global_normalizer(
        self, labels: torch.Tensor, inputs: dict, dims: ParallelDims, microbatches: int
    ) -> torch.Tensor:
        """The scored tokens of every dp replica's ``labels`` (one scalar all-reduce over dp), scaled so that the
        grads come out right (:func:`_over_the_global_batch`)."""
        return _over_the_global_batch((self.scored(labels) != IGNORE_INDEX).sum(), dims, microbatches)


def _over_the_global_batch(count: torch.Tensor, dims: ParallelDims, microbatches: int) -> torch.Tensor:
    """``count`` (this replica's, one or several terms) summed over dp, scaled so that the grads come out right: each
    replica's grads are later averaged over dp and each microbatch's loss scaled by 1/``microbatches``; the
    normaliser undoes both. A count of none is 1 (a loss of 0 where HF's mean of nothing is NaN)."""
    if dims.dp > 1 or dims.cp > 1:  # cp: every cp rank holds part of each sequence's scored tokens
        count = count.clone()
        dist.all_reduce(count, group=dims.grad_mesh.get_group())
    return count.clamp(min=1) / (dims.dp * microbatches)


class RowLoss:
    """HF's loss of a per-example head, normalised over the global batch: each term's sum over this batch's rows
    divided by its global count (``normalizer``, one entry per term, :meth:`global_normalizer`), or its mean over
    this batch without one.

    - sequence classification: HF's problem types (``config.problem_type``, else as HF infers it): regression (MSE
      over every label element), single-label (cross entropy over the rows not labelled -100), multi-label (BCE
      with logits over every label element);
    - multiple choice: cross entropy over each row's choices, rows labelled -100 unscored;
    - question answering: the mean of two terms, cross entropy of the start and of the end positions, a position
      outside the sequence unscored (HF clamps it to the sequence length and ignores that index).
    """

    def __init__(self, task: str, config: object) -> None:
        if task not in ROW_TASKS:
            raise ValueError(f"no per-example loss for task {task!r}; one of {ROW_TASKS}")
        self.task, self.config = task, config
        self.qa = task == "question_answering"

    def split_targets(self, labels: torch.Tensor | None, inputs: dict) -> tuple[tuple[torch.Tensor, ...] | None, dict]:
        """(the targets, the model's inputs without them): ``labels``, or question answering's ``start_positions``
        and ``end_positions`` taken out of the inputs (so the model computes no loss of its own)."""
        if not self.qa:
            return (labels,) if labels is not None else None, inputs
        if labels is not None:
            raise ValueError("a question-answering head is trained on start_positions and end_positions, not labels")
        names = ("start_positions", "end_positions")
        given = [n for n in names if inputs.get(n) is not None]
        if not given:
            return None, inputs
        if len(given) == 1:
            raise ValueError(f"a question-answering loss needs both start_positions and end_positions, got {given}")
        return tuple(inputs[n] for n in names), {k: v for k, v in inputs.items() if k not in names}

    def _problem(self, labels: torch.Tensor) -> str:
        problem = getattr(self.config, "problem_type", None)
        if problem is not None:
            return problem
        if self.config.num_labels == 1:
            return "regression"
        return (
            "single_label_classification" if labels.dtype in (torch.long, torch.int) else "multi_label_classification"
        )

    def _terms(
        self, logits: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(summed loss, how many it scores) per term, on this batch."""
        if self.qa:
            terms = []
            for scores, positions in zip(logits, targets, strict=True):
                positions = positions.squeeze(-1) if positions.dim() > 1 else positions
                ignored = scores.size(1)
                positions = positions.to(scores.device).clamp(0, ignored)
                total = F.cross_entropy(scores, positions, ignore_index=ignored, reduction="sum")
                terms.append((total, (positions != ignored).sum()))
            return terms
        (scores,), (labels,) = logits, targets
        labels = labels.to(scores.device)
        if self.task == "multiple_choice":
            total = F.cross_entropy(scores, labels, ignore_index=IGNORE_INDEX, reduction="sum")
            return [(total, (labels != IGNORE_INDEX).sum())]
        problem = self._problem(labels)
        if problem == "regression":
            if self.config.num_labels == 1:
                scores, labels = scores.squeeze(), labels.squeeze()
            return [(F.mse_loss(scores, labels, reduction="sum"), torch.tensor(labels.numel(), device=scores.device))]
        if problem == "single_label_classification":
            flat = labels.view(-1)
            total = F.cross_entropy(scores.view(-1, self.config.num_labels), flat, reduction="sum")
            return [(total, (flat != IGNORE_INDEX).sum())]
        if problem == "multi_label_classification":
            total = F.binary_cross_entropy_with_logits(scores, labels, reduction="sum")
            return [(total, torch.tensor(labels.numel(), device=scores.device))]
        raise ValueError(f"unknown problem_type {problem!r}")

    def logits(self, output: object) -> tuple[torch.Tensor, ...]:
        if self.qa:
            return output.start_logits, output.end_logits  # type: ignore[attr-defined]
        return (output.logits,)  # type: ignore[attr-defined]

    def __call__(
        self,
        logits: tuple[torch.Tensor, ...],
        targets: tuple[torch.Tensor, ...],
        normalizer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        terms = self._terms(logits, targets)
        counts = normalizer if normalizer is not None else torch.stack([c for _, c in terms]).clamp(min=1)
        return sum(total / counts[i] for i, (total, _) in enumerate(terms)) / len(terms)

    def of_output(
        self, output: object, targets: tuple[torch.Tensor, ...], normalizer: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self(self.logits(output), targets, normalizer)

    def pipeline_loss(  # noqa: ANN201
        self,
        output: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_normalizer: object = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        **_: object,
    ):
        """The last pipeline stage's ``loss_fn``: the head's output (question answering: start and end scores stacked
        on the last dim, :func:`meshpar.hf.stages.head_output`) and the microbatch's targets; the step's normaliser
        is handed whole to every microbatch (one 0-d tensor per term)."""
        if self.qa:
            return self(tuple(output.unbind(-1)), (start_positions, end_positions), loss_normalizer)
        return self((output,), (labels,), loss_normalizer)

    def counts(self, targets: tuple[torch.Tensor, ...], inputs: dict) -> torch.Tensor:
        """How many each term scores in this batch (the sequence length bounds question answering's positions)."""
        if self.qa:
            tokens = inputs.get("input_ids")
            tokens = tokens if isinstance(tokens, torch.Tensor) else inputs["inputs_embeds"]
            length = tokens.shape[1]
            return torch.stack(
                [(p.squeeze(-1) if p.dim() > 1 else p).clamp(0, length).ne(length).sum() for p in targets]
            )
        (labels,) = targets
        if self.task == "multiple_choice" or self._problem(labels) == "single_label_classification":
            return (labels.reshape(-1) != IGNORE_INDEX).sum().reshape(1)
        return torch.tensor([labels.numel()], device=labels.device)

    def global_normalizer(
        self, targets: tuple[torch.Tensor, ...], inputs: dict, dims: ParallelDims, microbatches: int
    ) -> torch.Tensor:
        """Each term's scored rows (or label elements) over every dp replica (one small all-reduce), scaled as
        :func:`_over_the_global_batch` says."""
        return _over_the_global_batch(self.counts(targets, inputs), dims, microbatches)
