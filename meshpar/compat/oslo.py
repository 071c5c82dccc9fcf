"""OSLO: ``oslo.initialize(model, config)`` returning a model with OSLO's generator forward.

``config`` is OSLO's dict or JSON file (``{"model_parallelism": {"enable": true, "pipeline_parallel_size": N}}``;
meshpar's own keys work too; microbatches default to the pipeline size). The returned model is a
:class:`meshpar.hf.ParallelizedModel`: ``train_step``, ``generate``, ``save_parallelized`` (``save_pretrained``'s
arguments, ``merge_checkpoints``) and ``from_parallelized`` as documented there. An optimizer built on the model
before ``initialize`` keeps training the parallel model, FSDP included: at its first step it is pointed at what
replaced its parameters on this rank (:meth:`OsloModel.stale_optimizer`; meshpar's own model refuses such an
optimizer and asks for ``rebind_optimizer``); ``generate`` works at any pp (:mod:`meshpar.hf.generation`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from meshpar.hf.config import ParallelConfig, load_config
from meshpar.hf.parallelize import ParallelizedModel


class OsloModel(ParallelizedModel):
    """OSLO's training forward: ``for out in model(**batch, labels=labels): out.loss.backward()``."""

    def forward(self, labels: torch.Tensor | None = None, **inputs: Any) -> Any:
        if labels is not None and torch.is_grad_enabled():
            return self._training_outputs(labels, inputs)
        return super().forward(labels=labels, **inputs)

    def stale_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """OSLO's contract: an optimizer built on the model before ``initialize`` trains the parallel model."""
        self.rebind_optimizer(optimizer)

    def _training_outputs(self, labels: torch.Tensor, inputs: dict[str, Any]) -> Iterator[Any]:
        """Runs the whole step (every microbatch's forward and backward, pipelined under pp, grads synced over dp)
        when iterated, then yields one output whose ``loss`` is the step's mean token loss: its ``backward()`` has
        nothing left to do, so grads are exactly those of :meth:`train_step` at every tp / pp / dp."""
        from transformers.modeling_outputs import ModelOutput

        loss = self.train_step(labels=labels, **inputs)
        yield ModelOutput(loss=loss.detach().requires_grad_())


def initialize(model: nn.Module, config: ParallelConfig | dict | str | os.PathLike | None = None) -> OsloModel:
    """OSLO's entry point (``oslo.initialize``): shard ``model`` as ``config`` says."""
    return OsloModel(model, load_config(config))


__all__ = ["OsloModel", "initialize"]
