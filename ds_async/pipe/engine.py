"""``AsyncPipelineEngine``: DeepSpeed's PipelineEngine with flush-free schedules.

``1f1b`` is DeepSpeed's own TrainSchedule, untouched: the synchronous baseline. ``2bw`` and ``pipedream`` run a
:class:`~ds_async.pipe.schedule.FlushFreeSchedule` that lives across ``train_batch`` calls; this class adds only
what differs: forwards on stashed weight versions (:class:`~ds_async.pipe.versions.WeightVersions`), gradients
gathered per batch, the optimizer step at the batch boundary while the next batch is in flight, and a loss report
that involves only the last stage's replicas.
"""
from __future__ import annotations

from contextlib import contextmanager
from types import MethodType

import torch
from deepspeed import comm as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..config import SCHEDULES
from ..optim.clip import clip_, clip_coefficient, copy_scaled_, squared_norm, sum_in_stage_order
from . import schedule as fs
from .bf16_step import PrecomputedNormBF16Optimizer
from .delay import weight_version
from .p2p import NeighbourLinks, NonBlockingP2P
from .versions import WeightVersions

P2P_MODES = ("overlap", "deepspeed")


class AsyncPipelineEngine(NonBlockingP2P, PipelineEngine):
    def __init__(self, *args, schedule: str = "1f1b", p2p: str = "deepspeed", fused_optimizer_step: bool = False,
                 **kwargs):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if p2p not in P2P_MODES:
            raise ValueError(f"p2p must be one of {P2P_MODES}, got {p2p!r}")
        self.schedule_name = schedule
        super().__init__(*args, **kwargs)
        self.links = None
        if p2p == "overlap":
            if self.is_pipe_partitioned or self.is_grad_partitioned or self.has_bool_tensors:
                raise ValueError("p2p 'overlap' does not handle DeepSpeed's partitioned or boolean pipe tensors; "
                                 "use p2p 'deepspeed'")
            self.links = NeighbourLinks(self.grid._topo.get_axis_comm_lists("pipe"), self.global_rank)
        self.is_async = schedule != "1f1b"
        self._segment = None  # (FlushFreeSchedule, its step iterator) while the pipeline is not drained
        self._batch_losses: dict[int, torch.Tensor] = {}
        self._next_forward = 0  # global index of the next micro-batch this stage will forward
        self._stepped = False
        self._drain_at: int | None = None  # last batch of the current segment, when known in advance
        self._version_ready: dict[int, torch.cuda.Event] = {}  # published on the side stream, not yet waited for
        self.versions = None
        # The squared gradient norm from a batch's reduce to its step: this stage's, then the pipeline's (gathered
        # by the step, which the schedule issues once every stage has reduced the batch).
        self._stage_sq: torch.Tensor | None = None
        self._global_sq: torch.Tensor | None = None
        self.stats_every = 0  # compute the staleness of the weights at every this many steps (0: never)
        self.step_events: list | None = None  # benchmarks: (start, end) CUDA events around each optimizer step
        self._staleness_sq = None
        # On GPUs the batch boundary (gradient hand-over, reduce, norm) and the optimizer step run on a side stream:
        # with blocking p2p, work on the compute stream would stall every neighbour, once per stage per batch.
        # Forwards never read the master, so only the first forward on the version a step publishes waits for it.
        self._step_stream = torch.cuda.Stream() if self.is_async and self.device.type == "cuda" else None
        # The passes and the p2p run on a high-priority stream, so the side stream's kernels take only the SMs the
        # passes leave free (their tails, the waits for neighbours) instead of slowing the passes down.
        self._compute_stream = torch.cuda.Stream(priority=-1) if self._step_stream is not None else None
        if self.is_async:
            slots = fs.FlushFreeSchedule(self.micro_batches, self.num_stages, self.stage_id, schedule).num_versions()
            self.versions = WeightVersions(self.module, slots, first_version=self.global_steps)
            if self.using_bf16_optimizer and type(self.optimizer) is BF16_Optimizer:
                self.optimizer.__class__ = PrecomputedNormBF16Optimizer
        # With one replica and no ZeRO nothing reads DeepSpeed's gradient buffers (its grad_accum_dtype: bf16 by
        # default, or fp32) between the batch boundary and the step, so the bf16 gradients can wait there and be
        # handed over already clipped: the norm is summed from them, and the hand-over writes g * clip factor in one
        # pass instead of a copy, a read for the norm and a read-modify-write to clip (see copy_scaled_).
        bf16_waits = (isinstance(self.optimizer, PrecomputedNormBF16Optimizer) and self.dp_world_size == 1
                      and not self.zero_optimization() and not self.optimizer.has_moe_layers)
        self.clip_at_hand_over = bf16_waits and self.gradient_clipping() > 0.0
        # Further, the whole AdamW step can go from the waiting bf16 gradients to the weights in one pass per tensor.
        self.fused_optimizer_step = fused_optimizer_step
        if fused_optimizer_step:
            if not (bf16_waits and PrecomputedNormBF16Optimizer.supports_one_pass(self.optimizer.optimizer)):
                raise ValueError("performance.fused_optimizer_step needs a flush-free schedule, DeepSpeed's bf16 "
                                 "optimizer (bf16 enabled, ZeRO off) over torch's AdamW (\"torch_adam\": true, no "
                                 "amsgrad), one data-parallel replica and no MoE layers")
            slot_of = {id(master): k for k, (_, _, master) in enumerate(self.versions.entries)}
            self._slot_order = [[slot_of[id(lp)] for lp in group] for group in self.optimizer.bf16_groups]
        self._claimed_slot = None  # the slot the fused step writes the new version into

    @property
    def _bf16_grads_wait(self) -> bool:
        """The batch's bf16 gradients stay on the parameters from the reduce to the step, which takes them."""
        return self.clip_at_hand_over or self.fused_optimizer_step

    @property
    def is_reporting_rank(self) -> bool:
        """The rank that logs: first data-parallel replica of the last stage (it computes the loss)."""
        return self.is_last_stage() and self.grid.data_parallel_id == 0

    # ----------------------------------------------------------------------------------------------- training
    def drain_after(self, batch: int) -> None:
        """Plan the next drain: the pipeline empties after batch ``batch`` (before an eval, a save, the end).

        Stage 0 reads up to ``p - 1`` micro-batches ahead; when ``m < p - 1`` (PipeDream with small batches) that
        crosses more than one batch boundary, so the end must be known before the batches ahead are started.
        """
        if self._segment is not None and self._next_forward > (batch + 1) * self.micro_batches:
            raise RuntimeError(f"cannot drain after batch {batch}: micro-batch {self._next_forward - 1} was already "
                               "started; plan the drain with drain_after() earlier")
        self._drain_at = batch
        if self._segment is not None:
            self._segment[0].end_batch = batch + 1

    def train_batch(self, data_iter=None, flush: bool = False):
        """Run batch ``t = global_steps`` until this stage has applied its update.

        Under ``2bw``/``pipedream`` the pipeline is not drained: forwards of the next batch may already have run,
        and the iterator keeps being read across calls. ``flush=True`` drains it after this batch (before an
        evaluation, a checkpoint, or at the end). Returns the batch's mean loss (averaged over replicas) on the
        last stage and ``None`` on the others, which never wait for it.
        """
        if not self.is_async:
            loss = super().train_batch(data_iter)
            self._complete_sends()
            return loss
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
            sched = fs.FlushFreeSchedule(self.micro_batches, self.num_stages, self.stage_id, self.schedule_name,
                                         first_batch=batch, end_batch=end)
            self._reserve_pipe_buffers(sched.num_pipe_buffers())
            self._segment = (sched, iter(sched.steps()))
        sched, steps = self._segment
        flush = sched.end_batch == batch + 1
        self.fwd_outputs, self.total_loss, self._compute_loss = [], None, True  # DeepSpeed's per-call state
        self._stepped = False
        with self._on_compute_stream():
            for cmds in steps:
                for cmd in cmds:
                    MethodType(self._ASYNC_INSTRUCTIONS[type(cmd)], self)(**cmd.kwargs)
                if self._stepped and not flush:
                    break
            if flush:
                self._segment = None
                self._complete_sends()
                if self._step_stream is not None:
                    torch.cuda.current_stream().wait_stream(self._step_stream)
                    self._version_ready.clear()
                self.versions.restore_master()
            return self._batch_loss(batch)

    @contextmanager
    def _on_compute_stream(self):
        """Run on the compute stream, ordered after the caller's stream on entry and before it on exit (GPU-side
        waits only), so what the caller does between calls (a loss ``.item()``, a checkpoint) sees finished work."""
        if self._compute_stream is None:
            yield
            return
        caller = torch.cuda.current_stream()
        self._compute_stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self._compute_stream):
                yield
        finally:
            caller.wait_stream(self._compute_stream)

    def _next_batch(self):
        # DeepSpeed's ``.to(device)`` copies from pageable memory, which makes the host wait for the GPU on the first
        # and last stage every micro-batch: the host could never run ahead, which flush-free schedules (and
        # non-blocking p2p) rely on. Stage through pinned memory without waiting; stock 1F1B keeps DeepSpeed's copy.
        batch = super()._next_batch()
        if batch is None or self.device.type != "cuda" or not (self.is_async or self.links is not None):
            return batch
        return _to_device(batch, self.device)

    def _complete_sends(self):
        # A drained pipeline may still have a non-blocking send in flight: complete it now, not at interpreter
        # exit, where gloo aborted the process over a send it still held (seen on CPU, about 1 run in 10).
        if self.links is not None:
            self.links.wait_sends()

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
        ready = self._version_ready.pop(version, None)
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        self.versions.activate(version)
        self._next_forward = micro_batch + 1
        super()._exec_forward_pass(buffer_id)
        if self.is_last_stage():
            batch = micro_batch // self.micro_batches
            self._batch_losses[batch] = self._batch_losses.get(batch, 0.0) + self.loss.detach().float()

    def _exec_stashed_backward(self, buffer_id: int, micro_batch: int, version: int):
        if self.module.activation_checkpoint_interval:
            self.versions.point_at(version)
        super()._exec_backward_pass(buffer_id)
        self.versions.backward_done(version)

    def _exec_batch_reduce(self, batch: int):
        self.versions.restore_master()
        side = self._step_stream
        if side is None:
            return self._reduce_batch_grads()
        # The batch-boundary work (gradient hand-over, replica all-reduce, norm) queues on the side stream behind
        # the previous step, so the compute stream goes straight on to the next batch's passes. The gradients were
        # made on the compute stream and are dropped here: keep their memory until the side stream has read them.
        side.wait_stream(torch.cuda.current_stream())
        for g in self.versions.slot_grads():
            g.record_stream(side)
        with torch.cuda.stream(side):
            self._reduce_batch_grads()

    def _reduce_batch_grads(self):
        self.versions.gather_grads()
        if self._bf16_grads_wait:
            return self._start_stage_norm()
        if self.using_bf16_optimizer:
            self._hand_grads_to_bf16_optimizer()
        if self.dp_world_size == 1 and not self.zero_optimization():
            self._reduce_over_one_replica()
        else:
            self._exec_reduce_grads()
        self._start_stage_norm()

    def _reduce_over_one_replica(self):
        """What DeepSpeed's gradient all-reduce does with a single replica, minus its copies.

        DeepSpeed would still flatten every gradient into a stage-sized buffer, cast it to the communication dtype,
        all-reduce it over one rank and copy it back: four passes over the gradients on the compute stream (by memory
        traffic ~2 ms per step on a stage of the 0.9B benchmark model; estimated, not measured alone). Only the cast
        could change a value, and only where it narrows: under DeepSpeed's bf16 optimizer every gradient in its fp32
        buffers is a bf16 sum handed over whole, so the bf16 cast is exact too.
        """
        if not self.pipeline_enable_backward_allreduce:
            return
        if self.using_bf16_optimizer:
            grads, _ = self.optimizer.get_grads_for_reduction()
        else:
            grads, _ = self._get_gradients_for_reduction()  # also gives gradient-less parameters zeros, as DeepSpeed
        dtype = self.communication_data_type
        if dtype == torch.float32 or (dtype == torch.bfloat16 and self.using_bf16_optimizer):
            return
        with torch.no_grad():
            for g in grads:
                if g.dtype != dtype:
                    g.copy_(g.to(dtype))

    def _start_stage_norm(self):
        """This stage's squared gradient norm; the optimizer step gathers the other stages' (see _step_and_publish)."""
        if self.gradient_clipping() <= 0.0:
            return
        if self.using_bf16_optimizer:
            if not isinstance(self.optimizer, PrecomputedNormBF16Optimizer):
                return
            if self._bf16_grads_wait:  # still the bf16 gradients: half the bytes to read
                grads = [lp.grad for group in self.optimizer.bf16_groups for lp in group if lp.grad is not None]
            else:
                grads = self.optimizer.get_grads_for_norm(for_clipping=True)
        elif self.zero_optimization() or self.fp16_enabled():
            return  # DeepSpeed's ZeRO optimizers compute their own norm at step time (a barrier, but correct)
        else:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        self._stage_sq = squared_norm(grads)

    def _global_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        """The pipeline's squared norm from this stage's ``sq``. An all-reduce would add the stages in its backend's
        order (gloo, 4 ranks: s0 + (s1 + (s2 + s3))), which the emulation cannot know; the stages are gathered and
        added in stage order instead. On NCCL only the current stream waits for the other stages."""
        parts = [torch.empty_like(sq) for _ in range(self.num_stages)]
        dist.all_gather(parts, sq, group=self.grid.get_pipe_parallel_group())
        return sum_in_stage_order(parts)

    def _take_model_step(self, lr_kwargs=None):
        if self._bf16_grads_wait:
            sq, self._global_sq = self._global_sq, None
            norm = coef = None
            if self.gradient_clipping() > 0.0:
                if sq is None:
                    raise RuntimeError("optimizer step without this batch's gradient norm: its gradients were never "
                                       "handed over (every step must follow its batch's ReduceGrads)")
                norm, coef = clip_coefficient(sq, self.gradient_clipping())
            self.optimizer.clipped_norm = norm
            if self.fused_optimizer_step:
                slot, self._claimed_slot = self._claimed_slot, None
                outs = [[slot[k] for k in order] for order in self._slot_order]
                scale = torch.ones((), device=self.device) if coef is None else coef
                self.optimizer.one_pass = (self._take_bf16_grads(), scale, [outs])
            else:
                self._hand_grads_to_bf16_optimizer(scale=coef)
        elif isinstance(self.optimizer, PrecomputedNormBF16Optimizer):
            self.optimizer.squared_norm, self._global_sq = self._global_sq, None
        # Otherwise DeepSpeed's step calls clip_fp32_gradients, which takes _global_sq.
        return super()._take_model_step(lr_kwargs)

    def _hand_grads_to_bf16_optimizer(self, scale: torch.Tensor | None = None):
        # DeepSpeed's BF16_Optimizer collects gradients into its buffers (grad_accum_dtype) from hooks on the bf16
        # parameters; forwards ran on version slots, so those hooks never fired: hand the gathered gradients over
        # here, in one foreach call, as exact copies of the bf16 sums (DeepSpeed's per-parameter ``_update_hp_grad``
        # adds the same copies to zeroed buffers), or with ``scale`` (the clip factor) as g * scale, which equals
        # the copy clipped afterwards bit for bit. ``PrecomputedNormBF16Optimizer`` does not zero the buffers after
        # its step (DeepSpeed zeroes them twice per step, 8 bytes a parameter): the copy overwrites them, and only
        # a buffer written last batch but not this one is zeroed here. Other optimizers get DeepSpeed's addition.
        opt = self.optimizer
        if opt.autoep_folding_tp_group is not None:
            raise NotImplementedError("flush-free schedules do not support DeepSpeed's AutoEP gradient folding")
        overwrite = isinstance(opt, PrecomputedNormBF16Optimizer)
        hp_grads, lp_grads, stale = [], [], []
        for i, group in enumerate(opt.bf16_groups):
            for j, lp in enumerate(group):
                hp = opt.fp32_groups_gradients[i][j]
                if lp.grad is not None:
                    hp_grads.append(hp)
                    lp_grads.append(lp.grad.view(hp.shape))
                    lp._hp_grad = hp
                    opt.fp32_groups_has_gradients[i][j] = True
                    lp.grad = None
                elif overwrite and opt.fp32_groups_has_gradients[i][j]:  # written last batch, not this one
                    stale.append(hp)
                    opt.fp32_groups_has_gradients[i][j] = False
        if hp_grads and scale is not None:
            copy_scaled_(hp_grads, lp_grads, scale)
        elif hp_grads:
            (torch._foreach_copy_ if overwrite else torch._foreach_add_)(hp_grads, lp_grads)
        if stale:
            torch._foreach_zero_(stale)

    def _take_bf16_grads(self) -> list[list[torch.Tensor]]:
        """The bf16 gradients by parameter group, taken off the parameters (zeros where a parameter got none: the
        fp32 gradient DeepSpeed's step would read there)."""
        grads = []
        for group in self.optimizer.bf16_groups:
            grads.append([torch.zeros_like(lp) if lp.grad is None else lp.grad for lp in group])
            for lp in group:
                lp.grad = None
        return grads

    def _exec_batch_step(self, batch: int):
        self.versions.restore_master()  # DeepSpeed's step reads the module's parameters (fp32 clipping)
        needed = weight_version(self.schedule_name, self._next_forward, self.stage_id, self.num_stages,
                                self.micro_batches)
        if self._step_stream is None:
            self._step_and_publish(batch, needed)
        else:
            if self._stage_sq is not None:
                # The norm's all-gather holds SMs on every stage until the last one joins; the schedule issues this
                # step when stage 0 finishes the batch, and the side stream starts it only when this stage's passes
                # have got as far (on 4x H200, 1.9-2.5 ms a step faster than starting it at the reduce, where it
                # waited up to 1.5 passes on stage 3).
                self._step_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._step_stream):  # behind this batch's reduce, see _exec_batch_reduce
                self._step_and_publish(batch, needed)
                self._version_ready[batch + 1] = torch.cuda.Event()
                self._version_ready[batch + 1].record(self._step_stream)
        self._stepped = True

    def _step_and_publish(self, batch: int, needed: int) -> None:
        if self.stats_every and (batch + 1) % self.stats_every == 0:
            used = weight_version(self.schedule_name, batch * self.micro_batches, self.stage_id, self.num_stages,
                                  self.micro_batches)
            self._staleness_sq = self.versions.distance_sq(used)
        if self._stage_sq is not None:
            self._global_sq, self._stage_sq = self._global_norm_sq(self._stage_sq), None
        timed = self.step_events is not None and self.device.type == "cuda"
        if timed:  # after the norm's all-gather: the step, not the wait for the other stages
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        if self.fused_optimizer_step:
            self._claimed_slot = self.versions.claim(batch + 1, needed_from=needed)
            self._exec_optimizer_step()
        else:
            self._exec_optimizer_step()
            self.versions.publish(batch + 1, needed_from=needed)
        if timed:
            end.record()
            self.step_events.append((start, end))

    _ASYNC_INSTRUCTIONS = {
        fs.ForwardPass: _exec_stashed_forward,
        fs.BackwardPass: _exec_stashed_backward,
        fs.ReduceGrads: _exec_batch_reduce,
        fs.OptimizerStep: _exec_batch_step,
    }

    def optimizer_stats(self) -> dict[str, float]:
        """The last step's optimizer figures for the whole model, for tensorboard: update RMS and lr per parameter
        group, the correction buffer's norm, and ``staleness`` = ||W_used - W_current|| (the weights the batch's
        gradients were computed on vs the weights they update; 0 under ``1f1b``).

        Collective over all ranks (one host sync and one object all-gather): call it on logging steps only.
        """
        from ..optim.client import base_optimizer
        from ..optim.optimizers import finish_stats, stack_sums
        from ..optim.sharded import ShardedOptimizer

        if self._step_stream is not None:
            torch.cuda.current_stream().wait_stream(self._step_stream)  # the step just queued there
        base = base_optimizer(self.optimizer)
        inner = base.optimizer if isinstance(base, ShardedOptimizer) else base
        sums, lrs = {}, {}
        counts = isinstance(base, ShardedOptimizer) or self.grid.data_parallel_id == 0  # replicas repeat it
        if inner is not None and counts:
            raw = inner.stat_sums()
            sums = dict(zip(raw, stack_sums(raw).tolist()))
            lrs = inner.last_lrs
        if self._staleness_sq is not None and self.grid.data_parallel_id == 0:
            sums["staleness_sq"] = self._staleness_sq.item()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (sums, lrs))
        total, all_lrs = {}, {}
        for rank_sums, rank_lrs in gathered:
            for k, v in rank_sums.items():
                total[k] = total.get(k, 0.0) + v
            all_lrs.update(rank_lrs)
        staleness = total.pop("staleness_sq", None)
        out = finish_stats(list(total), torch.tensor(list(total.values()), dtype=torch.float64), all_lrs) \
            if total else {}
        if staleness is not None:
            out["staleness"] = staleness ** 0.5
        elif self.stats_every and not self.is_async:
            out["staleness"] = 0.0
        return out

    def eval_batch(self, data_iter, *args, **kwargs):
        if self._segment is not None:
            raise RuntimeError("eval_batch() needs a drained pipeline: call train_batch(..., flush=True) first")
        out = super().eval_batch(data_iter, *args, **kwargs)
        self._complete_sends()
        return out

    # ---------------------------------------------------------------------------------- fixes to DeepSpeed
    def _recv_tensor_meta(self, send_stage):
        # DeepSpeed carves activation receive buffers from the same cache as gradient receive buffers, so on a
        # middle stage a received activation and a received gradient can share memory. Give activations their own.
        shared, self._grad_layer_buf = self._grad_layer_buf, []
        try:
            return super()._recv_tensor_meta(send_stage)
        finally:
            self._grad_layer_buf = shared

    def clip_fp32_gradients(self):
        """Clip by the whole model's gradient norm (DeepSpeed's pipeline averages per-stage norms instead)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        sq, self._global_sq = self._global_sq, None  # gathered by _step_and_publish under flush-free schedules
        clip_(grads, self._global_norm_sq(squared_norm(grads)) if sq is None else sq, self.gradient_clipping())


# DeepSpeed's instruction table holds PipelineEngine's own functions, so overriding a method (the p2p ones in
# NonBlockingP2P) would not change what its schedule executes; rebuild both tables by name on this class.
AsyncPipelineEngine._INSTRUCTION_MAP = {kind: getattr(AsyncPipelineEngine, fn.__name__)
                                        for kind, fn in PipelineEngine._INSTRUCTION_MAP.items()}
AsyncPipelineEngine._ASYNC_INSTRUCTIONS = {**AsyncPipelineEngine._INSTRUCTION_MAP,
                                           **AsyncPipelineEngine._ASYNC_INSTRUCTIONS}


def _to_device(x, device):
    if torch.is_tensor(x):
        return x if x.device == device else x.pin_memory().to(device, non_blocking=True)
    return type(x)(_to_device(y, device) for y in x)
