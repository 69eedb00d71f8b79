"""``AsyncPipelineEngine``: DeepSpeed's PipelineEngine with flush-free schedules.

Under a synchronous rule (``1f1b``) this is DeepSpeed's own TrainSchedule, untouched: the baseline. Under a
flush-free rule (``2bw``, ``pipedream``) a :class:`~ds_async.pipe.schedule.FlushFreeSchedule` lives across
``train_batch`` calls, and this class adds only what differs: forwards on stashed weight versions
(:class:`~ds_async.pipe.versions.WeightVersions`), gradients gathered per batch, the pipeline's gradient norm
gathered ahead of the step, the optimizer step at the batch boundary while the next batch is in flight (on GPUs on
a side stream), and a loss report that involves only the last stage's replicas. How the optimizer takes the
norm and steps is the stage's :mod:`~ds_async.pipe.steps` plan.

What a batch measured comes back from :meth:`AsyncPipelineEngine.train_step` as a :class:`StepReport` (the loss, the
pipeline's squared gradient norm, the staleness of the weights); ``train_batch`` is DeepSpeed's API and returns the
loss alone. Between the instructions of one batch the engine keeps a :class:`BatchState`, made anew at the start of
every ``train_step``, because DeepSpeed's call structure has no return path there:

- DeepSpeed runs a schedule's instructions as ``fn(**cmd.kwargs)`` and drops what they return, so this stage's
  squared norm goes from the batch reduce (``_exec_batch_reduce``) to the batch step (``_exec_batch_step``) through
  the batch state;
- DeepSpeed's ``_take_model_step`` calls ``clip_fp32_gradients()`` without arguments, so the pipeline's norm that the
  batch step gathered ahead of DeepSpeed's step reaches the clip through it too;
- under ``1f1b`` DeepSpeed's own ``train_batch`` runs the whole batch and returns the loss alone, and the step
  measures the norm and the staleness inside it, so what the report carries is collected there as well.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from types import MethodType

import torch
from deepspeed import comm as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..optim.clip import clip_, squared_norm, sum_in_stage_order
from ..optim.master import MasterWeights
from ..optim.stats import optimizer_stats
from . import bf16, steps
from . import schedule as fs
from . import version_rule
from .streams import StageStreams, to_device
from .versions import WeightVersions


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`AsyncPipelineEngine.train_step` measured on this rank (tensors on the device, not waited for).

    ``loss``: the batch's mean loss (averaged over replicas) on the last stage; under flush-free rules ``None`` on
    the other stages. ``grad_norm_sq``: the pipeline's squared gradient norm the step clipped by, on every rank;
    ``None`` with clipping off or where DeepSpeed's optimizer computes the norm itself (ZeRO, fp16).
    ``staleness_sq``: ``||W_used - W_current||^2`` on this stage, on the steps the engine's ``stats_every`` measures;
    ``None`` on the others and under ``1f1b``.
    """
    loss: torch.Tensor | None
    grad_norm_sq: torch.Tensor | None
    staleness_sq: torch.Tensor | None


@dataclass
class BatchState:
    """Values of one batch that pass between DeepSpeed's instructions, where DeepSpeed gives them no return path
    (the module docstring says where). ``stage_sq``: this stage's squared gradient norm, from the batch reduce to the
    batch step; ``global_sq``: the pipeline's, from the batch step to DeepSpeed's clip if the step plan did not bind
    it; ``grad_norm_sq`` and ``staleness_sq``: what the :class:`StepReport` carries."""
    stage_sq: torch.Tensor | None = None
    global_sq: torch.Tensor | None = None
    grad_norm_sq: torch.Tensor | None = None
    staleness_sq: torch.Tensor | None = None


class AsyncPipelineEngine(PipelineEngine):
    def __init__(self, *args, schedule: str | version_rule.VersionRule = version_rule.SYNC,
                 fused_optimizer_step: bool = False, stats_every: int = 0, **kwargs):
        self.rule = version_rule.get(schedule)
        self.rule.check_engine()  # before DeepSpeed builds anything: an emulation-only rule is refused by its key
        super().__init__(*args, **kwargs)
        self.is_async = self.rule.flush_free
        self.stats_every = stats_every  # measure the staleness of the weights at every this many steps (0: never)
        self._step_events: list | None = None  # CUDA (start, end) events around each step (record_step_events)
        self._pass_timer = None  # pass_begin() -> token and pass_end(token) around every pass (set_pass_timer)
        self._segment = None  # (FlushFreeSchedule, its step iterator) while the pipeline is not drained
        self._drain_at: int | None = None  # last batch of the current segment, when known in advance
        self._next_forward = 0  # global index of the next micro-batch this stage will forward
        self._batch_losses: dict[int, torch.Tensor] = {}
        self._batch = BatchState()  # made anew by every train_step
        self.versions = None
        self.streams = StageStreams(enabled=self.is_async and self.device.type == "cuda")
        if self.is_async:
            slots = self.rule.max_versions(self.stage_id, self.num_stages, self.micro_batches)
            self.versions = WeightVersions(self.module, slots, first_version=self.global_steps)
            if self.using_bf16_optimizer and type(self.optimizer) is BF16_Optimizer:
                self.optimizer.__class__ = bf16.PrecomputedNormBF16Optimizer
        self.step_plan = self._plan_steps(fused_optimizer_step)
        self._configure_python_gc()  # what deepspeed.initialize does once it has built an engine

    def _plan_steps(self, fused: bool) -> steps.StepPlan:
        opt, clip = self.optimizer, self.gradient_clipping()
        if isinstance(opt, MasterWeights):  # fused or not, the plan is the same: MasterWeights steps itself
            order = steps.slot_indices(self.versions.entries, opt.weights) if self.is_async else None
            return steps.MasterWeightsStep(opt, self.module, clip, order)
        if isinstance(opt, bf16.PrecomputedNormBF16Optimizer):
            can_wait = self.dp_world_size == 1 and not self.zero_optimization() and not opt.has_moe_layers
            order = [steps.slot_indices(self.versions.entries, g) for g in opt.bf16_groups] if fused else None
            return steps.DeepSpeedBF16Step(opt, clip, can_wait, fused, order)
        return steps.StepPlan(self.module, fused=fused,
                              own_norm=self.using_bf16_optimizer or self.zero_optimization() or self.fp16_enabled(),
                              bf16_optimizer=opt if self.using_bf16_optimizer and self.is_async else None)

    @property
    def is_reporting_rank(self) -> bool:
        """The rank that logs: first data-parallel replica of the last stage (it computes the loss)."""
        return self.is_last_stage() and self.grid.data_parallel_id == 0

    # ----------------------------------------------------------------------------------------------- training
    def drain_after(self, batch: int) -> None:
        """Plan the next drain: the pipeline empties after batch ``batch`` (before an eval, a save, the end).
        Stage 0 reads up to ``p - 1`` micro-batches ahead, which with ``m < p - 1`` crosses several batch
        boundaries, so the end must be known before the batches ahead are started."""
        if self._segment is not None and self._next_forward > (batch + 1) * self.micro_batches:
            raise RuntimeError(f"cannot drain after batch {batch}: micro-batch {self._next_forward - 1} was already "
                               "started; plan the drain with drain_after() earlier")
        self._drain_at = batch
        if self._segment is not None:
            self._segment[0].end_batch = batch + 1

    def train_batch(self, data_iter=None, flush: bool = False):
        """DeepSpeed's API: :meth:`train_step`'s loss alone."""
        return self.train_step(data_iter, flush).loss

    def train_step(self, data_iter=None, flush: bool = False) -> StepReport:
        """Run batch ``t = global_steps`` until this stage has applied its update; what it measured.

        Under a flush-free rule the pipeline is not drained: forwards of the next batch may already have run, and
        the iterator keeps being read across calls. ``flush=True`` drains it after this batch. The report's loss is
        the batch's mean loss (averaged over replicas) on the last stage and ``None`` on the others, which never
        wait for it.
        """
        self._batch = BatchState()
        loss = super().train_batch(data_iter) if not self.is_async else self._train_flush_free(data_iter, flush)
        return StepReport(loss, self._batch.grad_norm_sq, self._batch.staleness_sq)

    def _train_flush_free(self, data_iter, flush: bool):
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        batch = self.global_steps
        if flush:
            self.drain_after(batch)
        if self._segment is None:
            end = None if self._drain_at is None or self._drain_at < batch else self._drain_at + 1
            sched = fs.FlushFreeSchedule(self.micro_batches, self.num_stages, self.stage_id, self.rule,
                                         first_batch=batch, end_batch=end)
            self._reserve_pipe_buffers(sched.num_pipe_buffers())
            self._segment = (sched, iter(sched.steps()))
        sched, instructions = self._segment
        flush = sched.end_batch == batch + 1
        self.fwd_outputs, self.total_loss, self._compute_loss = [], None, True  # DeepSpeed's per-call state
        stepped = False
        with self.streams.computing():
            for cmds in instructions:
                for cmd in cmds:
                    MethodType(self._ASYNC_INSTRUCTIONS[type(cmd)], self)(**cmd.kwargs)
                    stepped |= isinstance(cmd, fs.OptimizerStep)
                if stepped and not flush:
                    break
            if flush:
                self._segment = None
                self.streams.wait_for_side()
                self.versions.restore_master()
            return self._batch_loss(batch)

    def wait_for_step(self) -> None:
        """Order the current stream after the optimizer steps queued so far (GPU-side only)."""
        self.streams.wait_for_side()

    def _next_batch(self):
        batch = super()._next_batch()
        if batch is None or self.device.type != "cuda" or not self.is_async:
            return batch
        return to_device(batch, self.device)

    def _batch_loss(self, batch: int):
        if not self.is_last_stage():
            return None
        loss = self._batch_losses.pop(batch) / self.micro_batches
        if self.is_data_parallel:
            dist.all_reduce(loss, group=self.mpu.get_data_parallel_group())
            loss /= self.dp_world_size
        self.agg_train_loss = loss
        return loss

    def _exec_stashed_forward(self, buffer_id: int, micro_batch: int, version: int):
        self.streams.wait_for_version(version)
        self.versions.activate(version)
        self._next_forward = micro_batch + 1
        self._exec_forward_pass(buffer_id)
        if self.is_last_stage():
            batch = micro_batch // self.micro_batches
            self._batch_losses[batch] = self._batch_losses.get(batch, 0.0) + self.loss.detach().float()

    def _exec_stashed_backward(self, buffer_id: int, micro_batch: int, version: int):
        if self.module.recomputes:
            self.versions.point_at(version)  # the recomputed forward runs on the original forward's weights
        self._exec_backward_pass(buffer_id)
        self.versions.backward_done(version)

    # ----------------------------------------------------------------------------------- the batch boundary
    def _exec_batch_reduce(self, batch: int):
        self.versions.restore_master()
        # Behind the previous step on the side stream: the compute stream goes straight on to the next batch.
        with self.streams.on_side(keep=self.versions.slot_grads() if self.streams.side else ()):
            self._reduce_batch_grads()

    def _reduce_batch_grads(self):
        self.versions.gather_grads()
        if not self.step_plan.grads_wait:
            self.step_plan.hand_over()
        if self.dp_world_size > 1 or self.zero_optimization():
            self._exec_reduce_grads()
        elif self.pipeline_enable_backward_allreduce and not self.step_plan.grads_wait:
            self._cast_like_one_replica_reduce()
        if self.gradient_clipping() > 0.0:
            grads = self.step_plan.norm_grads()
            self._batch.stage_sq = None if grads is None else squared_norm(grads)

    def _exec_reduce_grads(self):
        """DeepSpeed's gradient all-reduce, which 1F1B's schedule calls at every batch boundary. Over one replica
        without ZeRO, only what it changes: the missing gradients it fills with zeros and its casts
        (:meth:`_cast_like_one_replica_reduce`), as the flush-free path does; its flatten, all-reduce and copy-back
        passes would cost a host-bound stage GPU idle time at every step for nothing."""
        if (self.is_async or self.dp_world_size > 1 or self.zero_optimization() or self.has_moe_layers
                or self.gradient_predivide_factor() != 1.0 or not self.pipeline_enable_backward_allreduce):
            super()._exec_reduce_grads()
            return
        if not self.using_bf16_optimizer:
            self._get_gradients_for_reduction()  # fills missing gradients with zeros, as DeepSpeed's reduce does
        self._cast_like_one_replica_reduce()

    def _cast_like_one_replica_reduce(self):
        """What DeepSpeed's all-reduce over one replica changes, without its flatten/cast/copy passes: only the cast
        to the communication dtype where it narrows (exact under the bf16 optimizer, whose buffers hold bf16 sums)."""
        dtype = self.communication_data_type
        if dtype == torch.float32 or (dtype == torch.bfloat16 and self.using_bf16_optimizer):
            return
        grads = (self.optimizer.get_grads_for_reduction() if self.using_bf16_optimizer
                 else self._get_gradients_for_reduction())[0]  # the latter also zero-fills, as DeepSpeed does
        with torch.no_grad():
            for g in grads:
                if g.dtype != dtype:
                    g.copy_(g.to(dtype))

    def _global_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        """The pipeline's squared norm: the stages' parts gathered and added in stage order, as the emulation adds
        them (an all-reduce adds in its backend's order, e.g. gloo with 4 ranks: s0 + (s1 + (s2 + s3))). Every path
        to the norm (flush-free step, flushed step, DeepSpeed's clip) comes through here, so this is where the norm is
        kept for the batch's :class:`StepReport`."""
        parts = [torch.empty_like(sq) for _ in range(self.num_stages)]
        dist.all_gather(parts, sq, group=self.grid.get_pipe_parallel_group())
        self._batch.grad_norm_sq = sum_in_stage_order(parts)
        return self._batch.grad_norm_sq

    def set_pass_timer(self, timer) -> None:
        """Call ``timer.pass_begin()`` (a token) before and ``timer.pass_end(token)`` after every forward and backward
        pass of this stage, and ``timer.optimizer_begin()`` / ``timer.optimizer_end(token)`` around every optimizer
        step (``ds_async.telemetry.StageClock``); ``None`` stops it."""
        self._pass_timer = timer

    def record_step_events(self) -> list:
        """From now on, append CUDA ``(start, end)`` events around each flush-free optimizer step (after the norm's
        all-gather: the step itself, not the wait for the other stages) to the returned list; on GPUs only."""
        self._step_events = []
        return self._step_events

    def _exec_forward_pass(self, buffer_id: int):
        token = self._pass_timer.pass_begin() if self._pass_timer is not None else None
        super()._exec_forward_pass(buffer_id)
        if self._pass_timer is not None:
            self._pass_timer.pass_end(token)

    def _exec_backward_pass(self, buffer_id: int):
        token = self._pass_timer.pass_begin() if self._pass_timer is not None else None
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if isinstance(outputs, tuple) and not self.is_last_stage() and not self.is_pipe_partitioned:
            self._joint_backward(buffer_id, outputs)
        else:
            super()._exec_backward_pass(buffer_id)
            if self.is_last_stage():
                # DeepSpeed's last stage keeps its outputs (the logits) until the slot's next forward. They carry
                # DeepSpeed's backward hooks, which hold this engine: a cycle through autograd's graph that the
                # collector cannot see, which kept the whole stage (weights, versions, optimizer state) after its job.
                self.pipe_buffers["outputs"][buffer_id] = None
        if self._pass_timer is not None:
            self._pass_timer.pass_end(token)

    def _joint_backward(self, buffer_id: int, outputs: tuple) -> None:
        """DeepSpeed's backward of a stage whose output is a tuple (a MoE stage's hidden states and router sums), in
        one ``torch.autograd.backward`` over every float output instead of one ``backward`` per output.

        Per output, DeepSpeed's reentrant activation checkpoint frees its saved inputs in the first backward and the
        second fails (``ctx.deepspeed_saved_tensors`` is None); and gradients come out as sums of partial passes,
        not the single pass the emulation runs. Otherwise as DeepSpeed: bf16 optimizer hooks, buffers freed."""
        out_tensors = [t for t in outputs if t.is_floating_point()]
        grads = self.grad_layer
        if len(out_tensors) != len(grads):
            raise RuntimeError(f"stage {self.stage_id}: {len(out_tensors)} float outputs but {len(grads)} gradients")
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()
        self._running_engine_backward = True  # DeepSpeed's post-backward hook checks it
        try:
            torch.autograd.backward(out_tensors, list(grads))
        finally:
            self._running_engine_backward = False
        if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)
        self.pipe_buffers["output_tensors"][buffer_id] = None
        self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_batch_step(self, batch: int):
        self.versions.restore_master()  # DeepSpeed's step reads the module's parameters (fp32 clipping)
        needed = self.rule.weight_version(self._next_forward, self.stage_id, self.num_stages, self.micro_batches)
        # The norm's all-gather holds SMs on every stage until the last joins: the schedule issues this step when
        # stage 0 finishes the batch, and the side stream starts it only once this stage's passes got as far.
        with self.streams.on_side(after_current=self._batch.stage_sq is not None):  # behind this batch's reduce
            self._step_and_publish(batch, needed)
            self.streams.published(batch + 1)

    def _step_and_publish(self, batch: int, needed: int) -> None:
        if self.stats_every and (batch + 1) % self.stats_every == 0:
            used = self.rule.weight_version(batch * self.micro_batches, self.stage_id, self.num_stages,
                                            self.micro_batches)
            self._batch.staleness_sq = self.versions.distance_sq(used)
        state = self._batch
        if state.stage_sq is not None:
            state.global_sq, state.stage_sq = self._global_norm_sq(state.stage_sq), None
        timed = self._step_events is not None and self.device.type == "cuda"
        if timed:  # after the norm's all-gather: the step, not the wait for the other stages
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        slot = self.versions.claim(batch + 1, needed_from=needed) if self.step_plan.writes_slot else None
        step = self.step_plan.bind(state.global_sq, slot)
        if step is not None:
            state.global_sq = None  # taken; otherwise clip_fp32_gradients takes it
        with bf16.stepping_with(self.optimizer, step) if step is not None else nullcontext():
            self._exec_optimizer_step()
        if slot is None:
            self.versions.publish(batch + 1, needed_from=needed)
        if timed:
            end.record()
            self._step_events.append((start, end))

    def _take_model_step(self, lr_kwargs=None):
        token = self._pass_timer.optimizer_begin() if self._pass_timer is not None else None
        if self.is_async or not self.step_plan.grads_wait:  # flush-free steps bind their plan themselves
            super()._take_model_step(lr_kwargs)
        else:
            sq = self._global_norm_sq(squared_norm(self.step_plan.norm_grads())) if self.gradient_clipping() else None
            with bf16.stepping_with(self.optimizer, self.step_plan.bind(sq, None)):
                super()._take_model_step(lr_kwargs)
        if self._pass_timer is not None:
            self._pass_timer.optimizer_end(token)

    def clip_fp32_gradients(self):
        """Clip by the whole model's gradient norm (DeepSpeed's pipeline averages per-stage norms instead)."""
        if self.step_plan.grads_wait:
            return  # the plan's step applies the clip factor as it reads the bf16 gradients
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        sq, self._batch.global_sq = self._batch.global_sq, None  # gathered by _step_and_publish under flush-free rules
        clip_(grads, self._global_norm_sq(squared_norm(grads)) if sq is None else sq, self.gradient_clipping())

    _ASYNC_INSTRUCTIONS = {
        fs.ForwardPass: _exec_stashed_forward,
        fs.BackwardPass: _exec_stashed_backward,
        fs.ReduceGrads: _exec_batch_reduce,
        fs.OptimizerStep: _exec_batch_step,
    }

    def optimizer_stats(self, report: StepReport) -> dict[str, float]:
        """The optimizer figures of the step that returned ``report``, for the whole model
        (:func:`ds_async.optim.stats.optimizer_stats`)."""
        return optimizer_stats(self, report.staleness_sq)

    def eval_batch(self, data_iter, *args, **kwargs):
        if self._segment is not None:
            raise RuntimeError("eval_batch() needs a drained pipeline: call train_batch(..., flush=True) first")
        return super().eval_batch(data_iter, *args, **kwargs)

    # --------------------------------------------------------------------------------------- checkpointing
    COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")

    def state_dict(self) -> dict:
        """What a drained engine carries beyond its module's weights and its optimizer: DeepSpeed's counters and,
        under a flush-free rule, the weight versions it holds (:meth:`WeightVersions.state_dict`)."""
        if self._segment is not None:
            raise RuntimeError("cannot save in the middle of a flush-free segment: drain the pipeline first "
                               "(engine.drain_after / train_batch(flush=True))")
        return {"counters": {k: int(getattr(self, k, 0)) for k in self.COUNTERS},
                "versions": None if self.versions is None else self.versions.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a freshly built engine whose module already holds the newest weights."""
        for k, v in state["counters"].items():
            setattr(self, k, v)
        self._next_forward = self.global_steps * self.micro_batches
        if self.versions is not None:
            self.versions.load_state_dict(state["versions"])

    def layout(self) -> dict:
        """What must match between a job that saves a checkpoint and one that resumes it."""
        return {"schedule": self.rule.name, "pipeline_stages": self.num_stages,
                "data_parallel": self.grid.data_parallel_size, "micro_batches": self.micro_batches,
                "micro_batch_size": self.train_micro_batch_size_per_gpu(), "parts": list(self.module.parts)}

    def _recv_tensor_meta(self, send_stage):
        # DeepSpeed carves activation receive buffers from the same cache as gradient receive buffers, so on a
        # middle stage a received activation and a received gradient can share memory. Give activations their own.
        shared, self._grad_layer_buf = self._grad_layer_buf, []
        try:
            return super()._recv_tensor_meta(send_stage)
        finally:
            self._grad_layer_buf = shared


# DeepSpeed's instruction table holds PipelineEngine's own functions: rebuild it by name on this class, so that the
# overridden passes are what DeepSpeed's TrainSchedule executes too; flush-free schedules add four instructions.
AsyncPipelineEngine._INSTRUCTION_MAP = {kind: getattr(AsyncPipelineEngine, fn.__name__)
                                        for kind, fn in PipelineEngine._INSTRUCTION_MAP.items()}
AsyncPipelineEngine._ASYNC_INSTRUCTIONS = {**AsyncPipelineEngine._INSTRUCTION_MAP,
                                           **AsyncPipelineEngine._ASYNC_INSTRUCTIONS}
