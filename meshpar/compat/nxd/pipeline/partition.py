"""``neuronx_distributed.pipeline.partition``: NxD's helpers for placing layers on pipeline stages.

``create_partitions(stages, layer_names)`` gives the ``pipeline_cuts`` NxD's examples pass to ``NxDPPModel``: the
layers dealt out evenly, the remainder to the *last* stages (NxD's rule; meshpar's own even split gives it to the
first ones), one cut after each stage's last layer. ``stage_to_pipeline_parallel_rank`` says which pp rank runs a
(virtual) stage. The rest of NxD's module analyses its own torch.fx split (``partition_traced_model``,
``analyze_pipeline_module``, ``PipelineIO``, ...): meshpar's pipelines run as schedule data over stages built once
(:mod:`meshpar.pipeline`), so those are not provided.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshpar.compat.nxd.parallel_layers.parallel_state import (  # noqa: F401 - rank: in NxD's namespace (patched)
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_size,
)

__all__ = ["create_partitions", "stage_to_pipeline_parallel_rank"]


class TooFewLayersError(ValueError, AssertionError):
    """Fewer layers than pipeline stages. NxD asserts this (``AssertionError``, what its tests expect); meshpar
    raises ``ValueError`` for bad sizes: this is both."""


def create_partitions(pipeline_parallel_size: int, model_layer_names: Sequence[str]) -> list[str]:
    """The names of the layers each stage but the last ends with (NxD's ``pipeline_cuts``): ``len // stages`` layers
    per stage, one more on each of the last ``len % stages`` stages."""
    layers = len(model_layer_names)
    if pipeline_parallel_size < 1 or layers < pipeline_parallel_size:
        raise TooFewLayersError(
            f"create_partitions: {layers} layers cannot fill {pipeline_parallel_size} pipeline stages (each needs one)"
        )
    base, extra = divmod(layers, pipeline_parallel_size)
    sizes = [base + (1 if stage >= pipeline_parallel_size - extra else 0) for stage in range(pipeline_parallel_size)]
    cuts, end = [], 0
    for size in sizes[:-1]:
        end += size
        cuts.append(model_layer_names[end - 1])
    return cuts


def stage_to_pipeline_parallel_rank(stage: int, pp_size: int | None = None) -> int:
    """The pp rank that runs ``stage`` (virtual stages go round the ranks: stage ``s`` on rank ``s % pp``)."""
    return stage % (pp_size if pp_size is not None else get_pipeline_model_parallel_size())
