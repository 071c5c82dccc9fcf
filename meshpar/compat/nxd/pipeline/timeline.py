"""``neuronx_distributed.pipeline.timeline``: ``PPTimeline``, the pipeline's Chrome-trace timeline: recorded on the
ranks at dp rank 0 and tp rank 0 (one per pipeline stage), gathered over the pipeline group and written by pipeline
rank 0. ``NxDPPModel(trace_file_path=...)`` records one span per ``run_train`` / ``run_eval`` on every stage."""

from __future__ import annotations

from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.compat.nxd.utils.timeline import Timeline


class PPTimeline(Timeline):
    def __init__(self, trace_file_path: str | None, pp_rank: int) -> None:
        super().__init__(trace_file_path, pp_rank)
        if self.enabled:
            self.group = parallel_state.get_pipeline_model_parallel_group()

    @property
    def should_record(self) -> bool:
        return (
            self.enabled
            and parallel_state.get_data_parallel_rank() == 0
            and parallel_state.get_tensor_model_parallel_rank() == 0
        )

    def _collect_events_for_all_ranks(self) -> None:
        self.all_rank_events = parallel_state.gather_python_object(self.current_rank_events, self.group)


__all__ = ["PPTimeline"]
