"""The training job: config -> tokenizer -> pipeline model -> engine -> train/eval/save loop -> logs.

:class:`Trainer` holds one job's parts and runs it in small steps (``setup``, built by
:class:`~ds_async.trainer_setup.TrainerSetup`; ``train_step``, ``validate``, ``save``, ``close``); when to evaluate,
save and drain is :class:`~ds_async.cadence.Cadence`'s plan, which the emulation shares. ``launch/train.py`` is a
thin command-line wrapper around :func:`train`. Checkpoints (:mod:`ds_async.checkpoint`) are saved on drained
pipelines, like evaluations, and ``resume`` continues a run exactly where one stopped.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as tdist
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from . import checkpoint
from . import config as cfgmod
from . import data, fp8, metrics, telemetry
from .builder import Place, destroy_groups, init_distributed, process_groups
from .cadence import Cadence
from .checkpoint import folder
from .config import DsAsyncConfig
from .job import optimizer_type, start_run_log, steps_for
from .nonfinite import LossMonitor, NonFiniteLoss, NonFiniteWeights, SkipNonFinite, weights_nonfinite
from .optim.client import check_optimizer_block
from .pipe.engine import AsyncPipelineEngine, StepReport
from .preempt import Preempted, Preemption
from .prefetch import MicroBatchReader, ReaderProcess
from .trainer_setup import TrainerSetup


def train(config_path: str, max_steps: int | None = None, run_name: str | None = None,
          resume: str | None = None, reader: ReaderProcess | None = None, overrides: dict | None = None) -> dict | None:
    """Run the job described by the DeepSpeed JSON at ``config_path`` with ``overrides`` set in it (dotted key ->
    value, the command line's ``--set``); returns the summary on the reporting rank.

    ``resume``: ``"latest"`` continues from the newest complete checkpoint in the run's checkpoint folder (or
    starts afresh if there is none); a path names a checkpoint or a folder of them. ``reader``: this rank's reader
    process, started by the caller (:func:`~ds_async.builder.start_reader`), which the job then owns.
    """
    try:
        trainer = Trainer(config_path, max_steps=max_steps, run_name=run_name, overrides=overrides)
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    ended = False  # on every rank alike: the run's end, or its preemption, raised on every rank at one step
    try:
        trainer.setup(resume, reader)
        summary = trainer.run()
        ended = True
        return summary
    except BaseException as e:
        ended = isinstance(e, Preempted)
        trainer.discard_unused_folders()
        raise
    finally:
        trainer.release(ended)


class Trainer(TrainerSetup):
    """One training job. ``setup`` builds everything (every rank; :class:`~ds_async.trainer_setup.TrainerSetup`),
    ``run`` trains to the end and returns the summary on the reporting rank (``None`` elsewhere)."""

    # The job's state, all of it. Set by __init__: what the config and the launcher fix.
    config_path: str
    overrides: dict  # --set: dotted key -> value, set in the JSON at config_path
    cfg: DsAsyncConfig
    ds_config: dict  # DeepSpeed's part, its schedule length this run's (a resume may set another)
    max_steps: int | None  # --max-steps: stops the run early, changes nothing else
    rank: int
    world: int
    device: torch.device
    mbs: int  # micro-batch size
    gas: int  # micro-batches a step
    length: int  # the run's steps, from the config
    groups_before: set  # the process groups the caller held: release keeps them
    start_clock: telemetry.StartClock
    # Set by setup (TrainerSetup), in this order: the run's folders and the checkpoint it resumes from ...
    group: tdist.ProcessGroup  # gloo, for the host-side agreements (checkpoint files, loss flags)
    preemption: Preemption | None  # SIGTERM handling (a run that saves, in the main thread)
    writer: folder.BackgroundWriter | None  # checkpoint.async_save: the saves' own thread and process group
    run_dir: Path | None
    ckpt_root: Path | None
    resume_from: Path | None
    # ... the tokenizer, the model and the engine ...
    tok: PreTrainedTokenizerBase
    fingerprint: dict  # the tokenizer's, checked on resume and saved with every checkpoint
    hf_config: PretrainedConfig
    place: Place  # this rank's stage and replica, known before the engine (which is checked to agree)
    engine: AsyncPipelineEngine
    monitor: LossMonitor | None  # train.on_nonfinite = "stop"; "skip" wraps the engine's optimizer instead
    tokens_per_step: int
    total_steps: int  # the last step this job runs: length, or max_steps if sooner
    cadence: Cadence
    # ... the data (read on a thread while the engine builds) ...
    train_iter: MicroBatchReader | None  # the training stream, on the ranks that read data
    held_out: list  # the validation micro-batches, read once at start, on this rank's device
    # ... the restored position.
    start: int  # the step the job starts after: 0, or the checkpoint's
    last_saved: int | None
    # Set by _start_logging: the logs and what they measure.
    stage_of_rank: list[int]
    clock: telemetry.StageClock
    grad_norm: telemetry.GradNormTap | None  # on the reporting rank
    ds_monitor: metrics.DeepSpeedMonitor
    log: metrics.RunLogger
    in_flight: list[tuple[int, object, float, object]]  # (step, loss on its way to the host, lr, norm): not reported
    to_log: list[tuple[int, float | None, float, object]]  # reported, waiting for their norm to land to be logged
    # Advanced by the loop's checks.
    weights_ok_at: int | None  # the last step whose weights were checked finite
    end_checked: bool  # the end's checks ran (skipped steps, weights)

    def __init__(self, config_path: str, max_steps: int | None = None, run_name: str | None = None,
                 overrides: dict | None = None):
        self.start_clock = telemetry.StartClock()  # marked along set-up and at the end of the first step
        self.config_path, self.overrides = config_path, dict(overrides or {})
        self.ds_config, cfg = cfgmod.load(config_path, self.overrides)
        cfgmod.check_engine(cfg)  # before any process group: an emulation-only schedule stops every rank at once
        check_optimizer_block(self.ds_config, cfg.correction)
        self.cfg = cfg if run_name is None else replace(cfg, logging=replace(cfg.logging, run_name=run_name))
        self.max_steps = max_steps
        self.run_dir = self.ckpt_root = None  # set by setup, on every rank (rank 0 creates the folders)
        self.preemption = self.writer = None
        init_distributed()
        self.groups_before = process_groups()  # the caller's: release keeps them
        self.start_clock.mark("process group")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device = torch.device(get_accelerator().current_device_name())  # the engine's
        fp8.check(cfg.performance.fp8, self.ds_config, cfg.performance.compile, device)
        if cfg.performance.cuda_graphs and device.type != "cuda":
            raise cfgmod.ConfigError(f"ds_async.performance.cuda_graphs: CUDA graphs need an NVIDIA GPU; this run is "
                                     f"on {device.type}: set it to false")
        tbs, self.mbs, self.gas = cfgmod.check_batch(self.ds_config, self.cfg, self.world)
        self.length = steps_for(self.cfg, tbs * self.cfg.data.seq_len)  # the run's; max_steps only stops it early
        self.ds_config = cfgmod.with_schedule_length(self.ds_config, self.length)

    def discard_unused_folders(self) -> None:
        """After a failure: the run's own checkpoint folder (not a ``checkpoint.dir`` the config names) if this job
        holds it and saved nothing in it, then the run folder if nothing else is left in it (a trained tokenizer,
        logs of steps that ran, are kept)."""
        if self.rank != 0 or self.ckpt_root is None or self.cfg.checkpoint.dir is not None:
            return
        if folder.discard_if_unused(self.ckpt_root) and self.run_dir is not None:
            try:
                self.run_dir.rmdir()  # only if empty
            except OSError:
                pass

    def _start_logging(self, carried: dict) -> None:
        """The run's logs (:mod:`ds_async.metrics`) and what they measure (:mod:`ds_async.telemetry`): every rank
        times its steps and passes (idle per stage); the reporting rank reads the gradient norm and the rates.
        ``carried``: the logger state a resumed run's checkpoint saved (training clock, curves so far)."""
        cfg, engine, log_cfg = self.cfg, self.engine, self.cfg.logging
        layout = [None] * self.world  # (stage, replica, reports) of every rank
        tdist.all_gather_object(layout, (engine.stage_id, engine.grid.data_parallel_id, engine.is_reporting_rank),
                                group=self.group)
        self.stage_of_rank = [stage for stage, _, _ in layout]
        self.clock = telemetry.StageClock(engine.device.type == "cuda", warmup=log_cfg.warmup_steps,
                                          window=log_cfg.window, start_step=self.start)
        telemetry.time_passes(engine, self.clock)
        self.grad_norm = telemetry.GradNormTap(engine) if engine.is_reporting_rank else None
        self.ds_monitor = metrics.DeepSpeedMonitor(engine, next(r for r, (*_, reports) in enumerate(layout) if reports))
        peak = telemetry.peak_flops(log_cfg.peak_tflops, engine.device)
        self.log = start_run_log(
            self.run_dir, cfg, self.config_path, self.overrides, self.ds_config, self.hf_config, start_step=self.start,
            total_steps=self.total_steps, tokens_per_step=self.tokens_per_step, micro_batch_size=self.mbs,
            micro_batches=self.gas, data_parallel=engine.grid.data_parallel_size,
            peak_flops=None if peak is None else peak * self.world, carried=carried, resumed_from=self.resume_from,
            enabled=engine.is_reporting_rank, monitor=self.ds_monitor, card=metrics.card_name(engine.device))
        # (step, loss and gradient norm on their way to the host, lr). Under flush-free schedules a step's loss is
        # read after the next step is queued (a drain reads at once), so the last stage's host never waits for its
        # GPU to empty. Its norm exists later on the GPU (once stage 0 has finished the batch): the step is logged
        # once the norm has landed (``ready``), at the latest when the next step's loss has, or at a drain.
        self.in_flight = []
        self.to_log = []

    # ----------------------------------------------------------------------------------------------- the loop
    def run(self) -> dict | None:
        try:
            for step in range(self.start + 1, self.total_steps + 1):
                last = self.preemption is not None and self.preemption.last_step()
                report = self.train_step(step, drain=last)
                if step == self.start + 1:
                    self.start_clock.mark("first step")
                    self.log.start(step, self.start_clock.spans())
                self._log_gathered(step, report)
                if last and step != self.total_steps:
                    self._stop_preempted(step)
                if step != self.total_steps and self.cadence.evaluates(step):
                    self.log.validation(step, self.validate())
                if step != self.total_steps and self.cadence.saves(step):
                    self.save(step)
            return self.close()
        except (NonFiniteLoss, NonFiniteWeights) as e:  # every rank stops: the check is collective
            self._close_stopped(f"{type(e).__name__}: {e}")
            raise

    def train_step(self, step: int, drain: bool = False) -> StepReport:
        """Run batch ``step - 1``; report the losses that have reached the host. ``drain``: the pipeline drains
        after this step whatever the cadence plans (a preempted run's last step). Returns what the engine
        measured in the step."""
        engine = self.engine
        next_drain = step if drain else self.cadence.next_drain(step)
        engine.drain_after(next_drain - 1)  # flush-free: drain only where the pipeline must be empty
        self.clock.begin(step)
        report = engine.train_step(self.train_iter)  # its loss is None off the last stage under flush-free rules
        self.clock.end(step)  # before the loss's copy is queued: once the loss is on the host, so is this mark
        norm = self.grad_norm.take(report) if self.grad_norm is not None else None
        loss = report.loss
        self.in_flight.append((step, None if loss is None else metrics.HostValue(loss), engine.get_lr()[0], norm))
        # A step's loss is read a step late unless the pipeline drains here, under 1F1B too, whose loss is final
        # once the step is issued: reading it now would hold the host until the GPU has finished the step, and the
        # GPU would then idle while the host issues the next one.
        drained = next_drain == step
        self._report(step if drained else step - 1, drained)
        if self.monitor is not None:
            self._stop_if_nonfinite(upto=step if drained else None)
        return report

    def _report(self, upto: int, drained: bool = True) -> None:
        while self.in_flight and self.in_flight[0][0] <= upto:
            s, value, lr, norm = self.in_flight.pop(0)
            loss = None if value is None else float(value)
            if self.monitor is not None:
                self.monitor.submit(s, loss)
            if self.log.enabled:
                self.to_log.append((s, loss, lr, norm))
        # A step is logged once its norm is on the host, at the latest when the next step's loss is (by then stage 0
        # has long finished the step's batch, so reading it does not wait), or at a drain.
        while self.to_log and (drained or self.to_log[0][0] < upto or not hasattr(self.to_log[0][3], "ready")
                               or self.to_log[0][3].ready()):
            s, loss, lr, norm = self.to_log.pop(0)  # its loss was on the host, so is its end mark: its span folds
            self.log.train_step(s, float("nan") if loss is None else loss, lr,
                                grad_norm=None if norm is None else float(norm), step_time=self.clock.window_mean(s))
        self.ds_monitor.flush()

    def _log_gathered(self, step: int, report: StepReport) -> None:
        """The figures that need every rank (collectives, on their steps only): the optimizer's (of the step that
        returned ``report``) and the stages'."""
        log_cfg = self.cfg.logging
        if log_cfg.optimizer_every and step % log_cfg.optimizer_every == 0:
            self.log.optimizer(step, self.engine.optimizer_stats(report))
        if step != self.total_steps and (log_cfg.stages_every and step % log_cfg.stages_every == 0
                                         or self.cadence.evaluates(step)):
            self.log.stages(step, self._gather_stages()[0])

    def _gather_stages(self, final: bool = False) -> tuple[dict, dict]:
        """Each stage's peak memory, idle fraction and optimizer fraction on the reporting rank (an object all-gather over all
        ranks): over the steps folded since the last gather, and over the whole run (after the warm-up). A stage's
        replicas: the largest peak, the idle (optimizer) time of all of them over their wall time."""
        self.clock.fold(wait=final)
        mine = {"peak_memory_gib": telemetry.peak_memory_gib(self.engine.device), "window": self.clock.take_window(),
                "run": self.clock.take_run()}
        gathered = [None] * self.world
        tdist.all_gather_object(gathered, mine, group=self.group)
        out = ({}, {})
        for stage in sorted(set(self.stage_of_rank)):
            ranks = [g for r, g in enumerate(gathered) if self.stage_of_rank[r] == stage]
            peak = max(g["peak_memory_gib"] for g in ranks)
            for k, part in enumerate(("window", "run")):
                busy, wall, optimizer = (sum(g[part][key] for g in ranks) for key in ("busy_s", "wall_s", "optimizer_s"))
                out[k][stage] = {"peak_memory_gib": round(peak, 4),
                                 "idle_fraction": telemetry.idle_fraction(busy, wall),
                                 "optimizer_fraction": telemetry.optimizer_fraction(optimizer, wall),
                                 "steps": ranks[0][part]["steps"]}
        return out

    def _stop_if_nonfinite(self, upto: int | None = None) -> None:
        """``stop``: raise NonFiniteLoss if a step's loss up to ``upto`` was NaN/inf. At the end (``upto`` the last
        step, drained) also: warn about skipped steps and refuse a last step that was skipped (``skip``), and
        refuse non-finite weights."""
        bad = self.monitor.check(upto) if self.monitor is not None else None
        if bad is not None:
            step, kind = bad
            raise NonFiniteLoss(f"step {step}: the training loss is {kind}; training stopped there "
                                f"(ds_async.train.on_nonfinite = 'stop') and saved nothing after it: {self._kept()}")
        if upto is not None and upto == self.total_steps and not self.end_checked:
            self.end_checked = True
            self._check_skipped()
            self._check_weights(upto)

    def _kept(self) -> str:
        """Which checkpoint a run that stops now leaves as its newest (each one saved was checked finite)."""
        if self.last_saved is None:
            return "no checkpoint was saved"
        newest = self.resume_from if self.resume_from is not None and self.last_saved == self.start else \
            checkpoint.step_dir(self.ckpt_root, self.last_saved)
        return f"the newest checkpoint is {newest}"

    def _check_weights(self, step: int) -> None:
        """Every rank: raise NonFiniteWeights unless the (drained) weights after ``step`` are finite on all ranks.
        A step's loss is computed before its update, so it cannot tell whether the update overflowed."""
        if self.weights_ok_at == step:
            return
        kind = weights_nonfinite(self.engine.module.parameters(), self.group)
        if kind is not None:
            raise NonFiniteWeights(f"step {step}: the weights are {kind} after this step's update (its loss, "
                                   "computed before the update, did not show it); training stopped there and "
                                   f"saved nothing after it: {self._kept()}")
        self.weights_ok_at = step

    def _check_skipped(self) -> None:
        """``skip``, at the end: a warning line naming the skipped steps, and NonFiniteLoss if the last step was
        one of them (the run would end on a non-finite loss; nothing is saved after the newest checkpoint)."""
        opt = self.engine.optimizer
        if not isinstance(opt, SkipNonFinite) or not opt.skipped_calls:
            return
        steps = [self.start + c for c in opt.skipped_calls]
        shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
        if self.rank == 0:
            print(f"ds_async: warning: {len(steps)} of the {opt.calls} steps this job ran had a non-finite loss or "
                  f"gradient and their updates were skipped (ds_async.train.on_nonfinite = 'skip'): step "
                  f"{shown}", flush=True)
        if opt.overflow:  # the last step's
            trailing = 0
            while trailing < len(steps) and opt.skipped_calls[-1 - trailing] == opt.calls - trailing:
                trailing += 1
            raise NonFiniteLoss(f"step {self.total_steps}: the last step's loss or gradient was not finite (the "
                                f"last {trailing} step(s) were all skipped, {len(steps)} in this job), so the run "
                                "ends on a non-finite loss; ended without the final evaluation and save "
                                f"(ds_async.train.on_nonfinite = 'skip'): {self._kept()}")

    def validate(self) -> float:
        """Mean validation loss over ``eval.batches`` micro-batches per replica (the pipeline must be drained): the
        first ones of the validation source, read once at start. No evaluation reads a stream, so none delays the
        process's exit (``ds_async.data`` waits at exit until its last stream read is a grace period old)."""
        it = iter(self.held_out) if self.place.reads_data else None
        return self.engine.eval_batch(it, num_micro_batches=self.cfg.eval.batches).item()

    def save(self, step: int) -> None:
        self._stop_if_nonfinite(upto=step)
        self._check_weights(step)  # a checkpoint holds finite weights, or is not written
        began = time.monotonic()
        checkpoint.save(self.engine, self.ckpt_root, hf_config=self.hf_config, tokenizer=self.tok,
                        keep=self.cfg.checkpoint.keep, group=self.group, writer=self.writer,
                        data_state=self.train_iter.state_dict() if self.train_iter is not None else None,
                        extra={"seconds": self.log.elapsed(), "history": self.log.history},
                        meta={"tokenizer": self.fingerprint, "ds_async": cfgmod.resolved(self.cfg),
                              "optimizer": {"type": optimizer_type(self.ds_config)}, "deepspeed": self.ds_config,
                              "run_steps": self.length})
        if self.preemption is not None and self.writer is None:  # a background write's time is not seen here
            self.preemption.timed_save(step, time.monotonic() - began)
        self.last_saved = step

    def _stop_preempted(self, step: int) -> None:
        """The last step of a preempted run (drained): save it, close the logs without a summary (the run goes on
        after ``--resume``) and raise Preempted on every rank."""
        if self.last_saved != step:
            self.save(step)
        self._wait_saved()
        self.preemption.saved()
        self.log.suspend()
        self.ds_monitor.close()
        if self.train_iter is not None:
            self.train_iter.close()
        raise Preempted(step, checkpoint.step_dir(self.ckpt_root, step))

    def _wait_saved(self) -> None:
        """Until the checkpoint being written in the background (``checkpoint.async_save``) is complete; its error if
        its write failed (on every rank alike)."""
        if self.writer is not None:
            self.writer.wait()

    def release(self, ended: bool) -> None:
        """Put back what the job changed in its process (the SIGTERM handler), however it ended; after a run that
        ended on every rank alike (``ended``: finished or preempted), also destroy the process groups it made. After a
        failure they are left as they are: a rank that failed alone leaves its peers inside a collective, where a
        destroy could wait for them."""
        if self.preemption is not None:
            self.preemption.close()
            self.preemption = None
        if ended:
            destroy_groups(keep=self.groups_before)

    def _checkpoints_named(self) -> dict:
        """The summary's ``checkpoint`` (the newest this run saved) and ``resumed_from``."""
        return {"checkpoint": str(checkpoint.step_dir(self.ckpt_root, self.last_saved))
                if self.last_saved is not None else None,
                "resumed_from": str(self.resume_from) if self.resume_from else None}

    def _close_stopped(self, reason: str) -> None:
        """A run stopped by a non-finite loss or weights: ``summary.json`` of the steps logged, ``stopped`` saying
        why (a diverged run is a result, as the emulation records it), without the final evaluation, save or the
        collectives of :meth:`close`."""
        self._wait_saved()  # the newest checkpoint, the last good one, is complete before the run stops
        train = self.log.history["train"]
        self.log.close(train[-1][0] if train else self.start, plot=self.cfg.logging.plot,
                       extra={**self._checkpoints_named(), "stopped": reason})
        self.ds_monitor.close()
        if self.train_iter is not None:
            self.train_iter.close()

    def close(self) -> dict | None:
        """The final evaluation and save, and the run summary (on the reporting rank)."""
        total, engine = self.total_steps, self.engine
        self._stop_if_nonfinite(upto=total)
        if self.cadence.evaluates(total):
            self.log.validation(total, self.validate())
        if self.cadence.saves(total) and self.last_saved != total:
            self.save(total)
        self._wait_saved()
        # Documents skipped by the training stream, over the replicas (the last stage's copies of the stream).
        counts = [None] * dist.get_world_size()
        tdist.all_gather_object(counts, self.train_iter.skipped if self.train_iter is not None
                                and engine.is_last_stage() else None, group=self.group)
        skipped_docs = {k: sum(c[k] for c in counts if c) for k in data.SKIP_REASONS}
        window, run = self._gather_stages(final=True)
        self.log.stages(total, window)
        clock = self.clock
        summary = self.log.close(total, plot=self.cfg.logging.plot, extra={
            "stages": {f"stage{s}": figures for s, figures in run.items()},
            "skipped_docs": skipped_docs, "skipped_steps": int(engine.skipped_steps), **self._checkpoints_named()},
            step_time=clock.total_wall / clock.total_steps if clock.total_steps else None)
        self.ds_monitor.close()
        if self.train_iter is not None:
            self.train_iter.close()
        return summary if engine.is_reporting_rank else None
