"""Flush-free 1F1B: DeepSpeed's TrainSchedule stretched over many batches, as a generator of instructions.

One schedule object drives a stage through a *segment* of consecutive batches without draining the pipeline
between them: the stage warms up once, runs steady 1F1B across batch boundaries and drains only when the segment
ends (end of training, or before an evaluation or checkpoint that needs an empty pipeline). Each optimizer step
reads the stage's gradients right after the backward of its batch's last micro-batch (``ReduceGrads``, emitted with
the next step's communication, so the gradient send to the previous stage is not held up by it), while the next
batch's forwards already run. Under 2BW the update itself (``OptimizerStep``) waits for the whole pipeline's
gradient norm, which exists only once stage 0 has finished the batch, ``stage_id`` steps later: it is emitted then,
so that the norm exchange it starts finds every stage ready instead of spinning on the GPU meanwhile. 2BW leaves it
the slack: the version it publishes is first read a whole batch later.

Which weights each micro-batch uses is the schedule's :class:`~ds_async.pipe.version_rule.VersionRule`; every forward and backward instruction
carries its global micro-batch index and that version, so the engine, the simulator and the tests all read the
same facts. The step grid (which micro-batch is forwarded or backwarded at each step on each stage) is
DeepSpeed's: neighbouring stages alternate forward and backward steps so every send meets its receive.

No torch.distributed here: the schedule is plain data, testable and simulated without processes.
"""
from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds

from . import version_rule


class ForwardPass(ds.ForwardPass):
    """Forward of global micro-batch ``micro_batch`` on weight ``version``, reading pipeline buffer ``buffer_id``."""

    def __init__(self, buffer_id: int, micro_batch: int, version: int):
        super().__init__(buffer_id=buffer_id, micro_batch=micro_batch, version=version)


class BackwardPass(ds.BackwardPass):
    """Backward of ``micro_batch`` through the same ``version`` its forward used (weight stashing)."""

    def __init__(self, buffer_id: int, micro_batch: int, version: int):
        super().__init__(buffer_id=buffer_id, micro_batch=micro_batch, version=version)


class ReduceGrads(ds.ReduceGrads):
    """Gather batch ``batch``'s gradients onto the optimizer's parameters and all-reduce them across replicas."""

    def __init__(self, batch: int):
        super().__init__(batch=batch)


class OptimizerStep(ds.OptimizerStep):
    """Apply batch ``batch``'s update, making ``W(batch + 1)``."""

    def __init__(self, batch: int):
        super().__init__(batch=batch)


class FlushFreeSchedule(ds.TrainSchedule):
    """Continuous 1F1B over batches ``first_batch, first_batch + 1, ...`` for one stage.

    Args:
        micro_batches: ``m``, micro-batches per optimizer step on this replica.
        stages, stage_id: pipeline depth and this stage.
        rule: a flush-free :class:`~ds_async.pipe.version_rule.VersionRule` or its name (``"2bw"``, ``"pipedream"``).
        first_batch: index of the segment's first batch (global optimizer step count when it starts).
        end_batch: one past the segment's last batch, or ``None`` for "not known yet". It is read lazily, so it
            may be set while the schedule runs, as long as no instruction of a batch past it was generated yet.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, rule: str | version_rule.VersionRule,
                 first_batch: int = 0, end_batch: int | None = None):
        rule = version_rule.get(rule)
        if not rule.flush_free:
            raise ValueError(f"schedule '{rule.name}' is synchronous: DeepSpeed's TrainSchedule runs it")
        rule.check(stages, micro_batches)
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.m, self.rule, self.first_batch, self.end_batch = micro_batches, rule, first_batch, end_batch

    # DeepSpeed's step grid indexes micro-batches from 0 within the schedule; ours are segment-relative too, and
    # become global (``first_batch * m + local``) on the instructions.
    def _valid_micro_batch(self, local: int) -> bool:
        return local >= 0 and (self.end_batch is None or local < (self.end_batch - self.first_batch) * self.m)

    def num_pipe_buffers(self) -> int:
        return max(2, self.stages - self.stage_id)

    def _global(self, local: int) -> int:
        return self.first_batch * self.m + local

    def _version(self, local: int) -> int:
        return self.rule.weight_version(self._global(local), self.stage_id, self.stages, self.m)

    def _is_last_of_batch(self, local: int) -> bool:
        return (local + 1) % self.m == 0

    def _finished(self, step_id: int) -> bool:
        if self.end_batch is None:
            return False
        total = (self.end_batch - self.first_batch) * self.m
        return step_id >= 2 * (total + self.stages - 1)

    def steps(self):
        prev = -1
        pending_reduce = None  # batch whose gradients are reduced at the next step
        steps_due: list[tuple[int, int]] = []  # (step id, batch) of optimizer steps not emitted yet
        step_id = 0
        while not self._finished(step_id):
            local, is_forward = self._step_to_micro_batch(step_id)
            cmds = []
            valid, prev_valid = self._valid_micro_batch(local), self._valid_micro_batch(prev)
            buf = self._buffer_idx(local) if valid else None
            prev_buf = self._buffer_idx(prev) if prev_valid else None
            if is_forward:
                if prev_valid and self._valid_stage(self.prev_stage):
                    cmds.append(ds.SendGrad(prev_buf))
                if valid and self._valid_stage(self.prev_stage):
                    cmds.append(ds.RecvActivation(buf))
            else:
                if valid and self._valid_stage(self.next_stage):
                    cmds.append(ds.RecvGrad(buf))
                if prev_valid and self._valid_stage(self.next_stage):
                    cmds.append(ds.SendActivation(prev_buf))
            if pending_reduce is not None:
                cmds += [ds.ReduceTiedGrads(), ReduceGrads(pending_reduce)]
                steps_due.append((step_id + self.rule.step_lag(self.stage_id), pending_reduce))
                pending_reduce = None
            while steps_due and steps_due[0][0] <= step_id:
                cmds.append(OptimizerStep(steps_due.pop(0)[1]))
            if valid:
                if is_forward:
                    if self.is_first_stage or self.is_last_stage:
                        cmds.append(ds.LoadMicroBatch(buf))
                    cmds.append(ForwardPass(buf, self._global(local), self._version(local)))
                else:
                    cmds.append(BackwardPass(buf, self._global(local), self._version(local)))
                    if self._is_last_of_batch(local):
                        pending_reduce = self._global(local) // self.m
            prev = local
            step_id += 1
            if self._finished(step_id):  # the drain: nothing follows, so nothing is left to wait for
                if pending_reduce is not None:
                    cmds += [ds.ReduceTiedGrads(), ReduceGrads(pending_reduce)]
                    steps_due.append((step_id, pending_reduce))
                cmds += [OptimizerStep(batch) for _, batch in steps_due]
            yield cmds
