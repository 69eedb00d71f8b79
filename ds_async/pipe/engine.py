"""``AsyncPipelineEngine``: DeepSpeed's PipelineEngine with a choice of schedule.

``1f1b`` is DeepSpeed's own TrainSchedule, untouched: the synchronous baseline.
"""
from __future__ import annotations

from deepspeed import comm as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..config import SCHEDULES
from ..optim.clip import clip_by_global_norm


class AsyncPipelineEngine(PipelineEngine):
    def __init__(self, *args, schedule: str = "1f1b", **kwargs):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if schedule != "1f1b":
            raise NotImplementedError(f"schedule '{schedule}' is not implemented yet")
        self.schedule_name = schedule
        super().__init__(*args, **kwargs)

    @property
    def is_reporting_rank(self) -> bool:
        """The rank that logs: first data-parallel replica of the last stage (it computes the loss)."""
        return self.is_last_stage() and self.grid.data_parallel_id == 0

    def clip_fp32_gradients(self):
        """Clip by the whole model's gradient norm (DeepSpeed's pipeline averages per-stage norms instead)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        group = self.grid.get_pipe_parallel_group()
        clip_by_global_norm(grads, self.gradient_clipping(), lambda t: dist.all_reduce(t, group=group))
