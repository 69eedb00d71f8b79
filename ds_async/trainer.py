"""The training job: config -> tokenizer -> pipeline model -> engine -> train/eval/save loop -> logs.

:class:`Trainer` holds one job's parts and runs it in small steps (``setup``, ``train_step``, ``validate``,
``save``, ``close``); when to evaluate, save and drain is :class:`~ds_async.cadence.Cadence`'s plan, which the
emulation shares. ``launch/train.py`` is a thin command-line wrapper around :func:`train`. Checkpoints
(:mod:`ds_async.checkpoint`) are saved on drained pipelines, like evaluations, and ``resume`` continues a run
exactly where one stopped.
"""
from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import checkpoint
from . import config as cfgmod
from . import console, fp8, tokenizer
from . import resume as policy
from .cadence import Cadence
from .checkpoint.folder import agree
from .config import ConfigError, DsAsyncConfig
from .job import default_run_name, optimizer_type, seed_everything, start_run_log, steps_for
from .models import check_seq_len, check_vocab
from .preempt import Preempted, Preemption

if TYPE_CHECKING:  # the engine's module imports DeepSpeed, which the trainer imports only once it builds an engine
    from .pipe.engine import StepReport


def _resume_from(resume: str, cfg: DsAsyncConfig, ckpt_root: Path) -> Path | None:
    """The checkpoint ``--resume`` means: ``latest`` is the newest complete one in the run's checkpoint folder
    (None if it has none: the run starts at step 0); anything else is a checkpoint folder, a folder of them, or a
    run folder (its ``checkpoints/``), which must hold a complete checkpoint (CheckpointError naming it if not)."""
    from . import checkpoint

    if resume == "latest":
        if cfg.checkpoint.dir is None and cfg.logging.run_name is None:
            raise ConfigError("--resume: this run's checkpoint folder is not fixed (its run name is a timestamp): "
                              "set ds_async.checkpoint.dir or ds_async.logging.run_name (--run-name), or pass "
                              "--resume PATH")
        return checkpoint.resolve(ckpt_root)
    path = Path(resume)
    if not path.exists():
        raise checkpoint.CheckpointError(f"--resume {resume}: no such checkpoint or folder")
    found = checkpoint.resolve(path)
    if found is None and (path / "checkpoints").is_dir():  # a run folder
        found = checkpoint.resolve(path / "checkpoints")
    if found is None:
        raise checkpoint.CheckpointError(
            f"--resume {resume}: no complete checkpoint there (a checkpoint folder step_N with {checkpoint.MANIFEST}, "
            "a folder of them, or a run folder with them in checkpoints/); nothing to resume from")
    return found


def _or_error(fn, *args):
    """``fn(*args)``, or the ConfigError or CheckpointError it raised (for :func:`~ds_async.checkpoint.folder.agree`)."""
    try:
        return fn(*args)
    except (ConfigError, checkpoint.CheckpointError) as e:
        return e


def _config_keys(section: dict, ds_config: dict) -> dict:
    """A job's config as the flat keys :mod:`ds_async.resume` compares: ``ds_async.<key>`` and
    ``deepspeed.<key>``."""
    return {**policy.flatten(section, "ds_async"), **policy.flatten(ds_config, "deepspeed")}


def check_optimizer_type(manifest: dict, ds_config: dict, folder) -> None:
    """A resumed run must step with the optimizer type its checkpoint was saved with: another type's state would load
    without a word and drop what it cannot use (AdamW's moments as SGD's absent momentum). Compared without case;
    a manifest that records no optimizer is not checked."""
    saved = (manifest.get("optimizer") or {}).get("type")
    now = optimizer_type(ds_config)
    if "optimizer" in manifest and str(saved).lower() != str(now).lower():
        raise ConfigError(f"optimizer.type: {now!r}, but the checkpoint {folder} was saved with {saved!r}, whose "
                          "state does not carry over to another optimizer; resume with the same type, or start a "
                          "new run from its weights (ds_async.model.path after python -m ds_async.export)")


def stream_recipe(section: dict) -> dict:
    """What decides the training stream's documents and their order, from a resolved ``ds_async`` section: a saved
    position in the stream refers to these."""
    data = section.get("data") or {}
    validation = data.get("validation")
    return {**{f"data.{k}": data.get(k) for k in ("train", "text_field", "seq_len", "shuffle_buffer", "min_chars")},
            "data.validation.from_train": validation.get("from_train") if isinstance(validation, dict) else None,
            "seed": section.get("seed")}


def train(config_path: str, max_steps: int | None = None, run_name: str | None = None,
          resume: str | None = None) -> dict | None:
    """Run the job described by the DeepSpeed JSON at ``config_path``; returns the summary on the reporting rank.

    ``resume``: ``"latest"`` continues from the newest complete checkpoint in the run's checkpoint folder (or
    starts afresh if there is none); a path names a checkpoint or a folder of them.
    """
    trainer = Trainer(config_path, max_steps=max_steps, run_name=run_name)
    try:
        trainer.setup(resume)
        return trainer.run()
    except BaseException:
        trainer.discard_unused_folders()
        raise
    finally:
        trainer.release()


class Trainer:
    """One training job. ``setup`` builds everything (every rank), ``run`` trains to the end and returns the summary
    on the reporting rank (``None`` elsewhere)."""

    def __init__(self, config_path: str, max_steps: int | None = None, run_name: str | None = None):
        from deepspeed import comm as dist
        from deepspeed.accelerator import get_accelerator

        from .builder import init_distributed
        from .optim.client import check_optimizer_block

        self.config_path = config_path
        self.ds_config, cfg = cfgmod.load(config_path)
        cfgmod.check_engine(cfg)  # before any process group: an emulation-only schedule stops every rank at once
        check_optimizer_block(self.ds_config, cfg.correction)
        self.cfg = cfg if run_name is None else replace(cfg, logging=replace(cfg.logging, run_name=run_name))
        self.max_steps = max_steps
        self.run_dir: Path | None = None  # set by setup, on every rank (rank 0 creates them)
        self.ckpt_root: Path | None = None
        self.preemption: Preemption | None = None  # SIGTERM handling, from setup on (a run that saves)
        init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        fp8.check(cfg.performance.fp8, self.ds_config, cfg.performance.compile,
                  torch.device(get_accelerator().current_device_name()))
        tbs, self.mbs, self.gas = cfgmod.check_batch(self.ds_config, self.cfg, self.world)
        self.length = steps_for(self.cfg, tbs * self.cfg.data.seq_len)  # the run's; max_steps only stops it early
        self.ds_config = cfgmod.with_schedule_length(self.ds_config, self.length)

    def discard_unused_folders(self) -> None:
        """After a failure: the run's own checkpoint folder (not a ``checkpoint.dir`` the config names) if this job
        holds it and saved nothing in it, then the run folder if nothing else is left in it (a trained tokenizer,
        logs of steps that ran, are kept)."""
        from .checkpoint import folder

        if self.rank != 0 or self.ckpt_root is None or self.cfg.checkpoint.dir is not None:
            return
        if folder.discard_if_unused(self.ckpt_root) and self.run_dir is not None:
            try:
                self.run_dir.rmdir()  # only if empty
            except OSError:
                pass

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self, resume: str | None = None) -> None:
        import torch.distributed as tdist

        seed_everything(self.cfg.seed)
        self.group = tdist.new_group(backend="gloo")  # host-side agreement: checkpoint files, loss flags
        ckpt = self.cfg.checkpoint
        # Python runs signal handlers in the main thread only; a trainer run elsewhere leaves SIGTERM as it is.
        if (ckpt.every > 0 or ckpt.final) and ckpt.preempt_grace_s > 0 and \
                threading.current_thread() is threading.main_thread():
            self.preemption = Preemption(ckpt.preempt_grace_s, self.group, say=self.rank == 0)
        self.weights_ok_at, self.end_checked = None, False  # see _check_weights, _stop_if_nonfinite
        self._locate_run(resume)
        changed, lengths = self._plan_resume() if self.resume_from is not None else ({}, None)
        self._build_engine(changed)
        self._check_sources(self._build_data())
        carried = self._restore(changed, lengths) if self.resume_from is not None else {}
        self.start = self.engine.global_steps  # 0, or the step of the checkpoint it resumed from
        if self.start >= self.total_steps:
            bound = (f"--max-steps {self.max_steps}" if self.max_steps is not None and self.max_steps < self.start
                     else f"the run's {self.total_steps} steps")
            raise ConfigError(f"--resume: {self.resume_from} is at step {self.start}, and {bound} end there or "
                              "before: nothing is left to train")
        self.last_saved = self.start if self.resume_from is not None else None
        if self.train_iter is not None:
            self.train_iter.start()  # from the position checked and restored above
        self._start_logging(carried)

    def _locate_run(self, resume: str | None) -> None:
        from deepspeed import comm as dist

        from . import checkpoint

        cfg = self.cfg
        self.run_dir = Path(cfg.logging.dir) / agree(cfg.logging.run_name or default_run_name(cfg, self.ds_config),
                                                      self.group)
        self.ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        found = None
        if self.rank == 0:
            try:
                try:
                    self.run_dir.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise ConfigError(f"ds_async.logging.dir: cannot create the run folder {self.run_dir} "
                                      f"({type(e).__name__}: {e.strerror or e})") from None
                found = self._claim_checkpoint_dir(resume)
            except (ConfigError, checkpoint.CheckpointError) as e:
                found = e
        self.resume_from = agree(found, self.group)
        if resume is not None and self.resume_from is None and self.rank == 0:
            print(f"ds_async: no complete checkpoint in {self.ckpt_root}; starting from step 0", flush=True)
        dist.barrier()

    def _claim_checkpoint_dir(self, resume: str | None) -> Path | None:
        """Rank 0, before anything is built: a run that saves checks that its checkpoint folder can hold files
        (created, a probe file written and removed) and locks it for the job's life (a second job on the folder is
        refused); then finds the checkpoint to resume from, and refuses to start afresh over an earlier run's
        checkpoints (its first save would move them aside). Returns the checkpoint to resume from or None."""
        from . import checkpoint
        from .checkpoint import folder

        cfg, root = self.cfg, self.ckpt_root
        saves = cfg.checkpoint.every > 0 or cfg.checkpoint.final
        if saves:
            try:
                folder.prepare(root)
            except OSError as e:
                raise ConfigError(f"ds_async.checkpoint.dir: {root} cannot hold checkpoints ({type(e).__name__}: "
                                  f"{e.strerror or e}); point it at a writable folder") from None
            folder.lock(root)
        found = _resume_from(resume, cfg, root) if resume is not None else None
        newest = checkpoint.latest(root) if saves and resume is None else None
        if newest is not None:
            raise checkpoint.CheckpointError(
                f"{root}: holds checkpoints of an earlier run (newest {newest.name}), which this run's first save "
                "would move aside; pass --resume to continue that run, or give this one another run name "
                "(--run-name) or ds_async.checkpoint.dir; to start over, move that folder away first")
        return found

    def _check_sources(self, error: Exception | None) -> None:
        """``error``: this rank's failure to open its training stream, if any. Without one, on the ranks that read
        data, buffer the training stream's first micro-batch (kept for the first step) and read the ``eval.batches``
        micro-batches an evaluation reads, so that data that cannot be opened or read, holds no usable text (an empty
        source, a wrong ``data.text_field``, nothing but non-UTF-8 lines) or too little for an evaluation stops the
        job at start rather than at the first evaluation or mid-run. Every rank raises the first failing rank's
        error. Of the documents read, half or more not UTF-8 is refused, a tenth gets a warning line
        (:func:`ds_async.data.check_encoding`). The RNG states are left as they were."""
        from . import data
        from .checkpoint import folder
        from .checkpoint.state import rng_state, set_rng_state

        counts = {}
        self.held_out = []  # the validation micro-batches
        if error is None and self.needs_data:
            saved = rng_state()
            for key, role in (("ds_async.data.train", "train"), ("ds_async.data.validation", "validation")):
                source = getattr(self.cfg.data, role)
                if not source:
                    continue
                read = 0
                try:
                    if role == "train":
                        batches = self.train_iter
                        batches.peek()
                    else:  # everything an evaluation reads, kept for every evaluation (they read the same)
                        batches = self._stream("validation")
                        try:
                            for read in range(self.cfg.eval.batches):
                                x, y = next(batches)
                                self.held_out.append((x.to(self.engine.device), y.to(self.engine.device)))
                        finally:
                            batches.close()
                    counts[key] = (batches.documents, batches.skipped["non_utf8"], data.describe(source))
                except StopIteration:
                    error = data.DataError(
                        f"{key}: {data.describe(source)}: too little text for ds_async.eval.batches = "
                        f"{self.cfg.eval.batches} micro-batches of {self.mbs} x {self.cfg.data.seq_len} tokens per "
                        f"replica (data-parallel rank {self.engine.grid.data_parallel_id} ran out after {read})")
                except (ConfigError, data.DataError, FileNotFoundError) as e:
                    error = e if str(e).startswith(key) else type(e)(f"{key}: {e}")
                except Exception as e:  # noqa: BLE001 - whatever the reader raised, as a one-line DataError
                    error = data.DataError(f"{key}: {data.describe(source)}: cannot be read ({type(e).__name__}: "
                                           f"{e})")
                if error is not None:
                    break
            set_rng_state(saved)
        gathered = folder.gather((error, counts), self.group)
        errors = [e for e, _ in gathered if e is not None]
        if errors:
            raise errors[0]
        for key in ("ds_async.data.train", "ds_async.data.validation"):
            seen = [c[key] for _, c in gathered if key in c]
            if seen:
                warning = data.check_encoding(sum(d for d, _, _ in seen), sum(b for _, b, _ in seen),
                                              f"{key}: {seen[0][2]}")
                if warning and self.rank == 0:
                    print(warning, flush=True)

    def _build_engine(self, changed: dict[str, dict[str, tuple]]) -> None:
        """The tokenizer, the model and the DeepSpeed engine. A resume first checks the model's config against the
        checkpoint's, adding its applied changes to ``changed``."""
        from deepspeed import comm as dist

        from .builder import initialize
        from .models import build_pipeline, model_config
        from .nonfinite import LossMonitor, SkipNonFinite, check_skip_supported

        cfg = self.cfg
        if self.resume_from is not None and cfg.tokenizer.startswith("train:"):
            # The one the saved run trained, checked against the checkpoint's manifest.
            self.tok = tokenizer.load_from_checkpoint(self.resume_from)
        else:
            self.tok = tokenizer.resolve(cfg, self.run_dir, dist, group=self.group)
        self.fingerprint = tokenizer.fingerprint(self.tok)  # checked on resume, recorded with every save
        self.hf_config = model_config(cfg, self.tok)
        if self.resume_from is not None:
            for what, keys in self._check_model_unchanged().items():
                changed.setdefault(what, {}).update(keys)
        check_vocab(self.tok, self.hf_config, cfg.tokenizer)
        check_seq_len(cfg, self.hf_config)
        with console.deepspeed_quiet(cfg.logging.deepspeed_log):
            module = build_pipeline(cfg, self.hf_config)
            self.engine = engine = initialize(module, self.ds_config, schedule=cfg.schedule,
                                              correction=cfg.correction,
                                              fused_optimizer_step=cfg.performance.fused_optimizer_step,
                                              stats_every=cfg.logging.optimizer_every)
        self.monitor = None
        if cfg.train.on_nonfinite == "skip":
            check_skip_supported(engine.optimizer)
            engine.optimizer = SkipNonFinite(engine.optimizer, self.group)
        else:
            self.monitor = LossMonitor(self.group, lag=engine.is_async)
        self.tokens_per_step = engine.train_batch_size() * cfg.data.seq_len
        self.total_steps = steps_for(cfg, self.tokens_per_step)
        if self.max_steps is not None:
            self.total_steps = min(self.total_steps, self.max_steps)
        self.cadence = Cadence(self.total_steps, eval_every=cfg.eval.every, save_every=cfg.checkpoint.every,
                               evaluate=bool(cfg.data.validation), final_save=cfg.checkpoint.final)

    def _stream(self, role: str):
        """This rank's micro-batches of ``data.train`` (shuffled, repeating) or ``data.validation`` (one pass)."""
        from . import data

        cfg, engine = self.cfg, self.engine
        return data.open_batches(cfg.data, role, self.tok, self.mbs, dp_rank=engine.grid.data_parallel_id,
                                 dp_world_size=engine.grid.data_parallel_size, seed=cfg.seed)

    def _build_data(self) -> Exception | None:
        """Open the training stream on the ranks that read data; returns the error that stopped it, for
        :meth:`_check_sources` to raise on every rank."""
        from .data import DataError

        self.needs_data = self.engine.is_first_stage() or self.engine.is_last_stage()
        self.train_iter, error = None, None
        if self.needs_data:
            try:
                self.train_iter = self._read_ahead(self._stream("train"))
            except (ConfigError, DataError, FileNotFoundError) as e:
                error = e
        return error

    def _read_ahead(self, stream):
        """``stream`` as the engine reads it (:class:`ds_async.prefetch.MicroBatchReader`): tokenized and packed in a
        reader process a step at a time (``performance.data_reader``), or here one micro-batch at a time."""
        import functools

        from . import data
        from .prefetch import MicroBatchReader

        cfg, engine = self.cfg, self.engine
        mode = cfg.performance.data_reader
        background = mode == "process" or (mode == "auto" and engine.device.type == "cuda")
        opener = functools.partial(data.open_batches, cfg.data, "train", self.tok, self.mbs,
                                   dp_rank=engine.grid.data_parallel_id,
                                   dp_world_size=engine.grid.data_parallel_size, seed=cfg.seed)
        # A reader process hands over 16 steps at a time: per chunk the host pays a queue transfer, a pinned copy
        # and the copy's launch, which at one step a chunk left the training loop waiting on the reader.
        return MicroBatchReader(stream, opener, engine.device, chunk=16 * self.gas if background else 1,
                                background=background)

    def _plan_resume(self) -> tuple[dict[str, dict[str, tuple]], tuple[int, int, int] | None]:
        """Before the engine is built: what ``--resume`` does with each key changed since the checkpoint
        (:mod:`ds_async.resume`): ConfigError for a refused one; the LR schedule built for the length
        ``train.on_resume_length`` says. Returns, for :meth:`_restore` to report, the changes by action and, if the
        run's or the schedule's length changed, (the checkpoint's run length, this run's, the schedule's)."""
        manifest = agree(_or_error(checkpoint.read_manifest, self.resume_from) if self.rank == 0 else None,
                          self.group)
        check_optimizer_type(manifest, self.ds_config, self.resume_from)
        changed = policy.plan(_config_keys(manifest.get("ds_async") or {}, manifest.get("deepspeed") or {}),
                              _config_keys(cfgmod.resolved(self.cfg), self.ds_config), self.resume_from)
        saved_run = manifest.get("run_steps")
        saved_schedule = ((manifest.get("deepspeed") or {}).get("scheduler") or {}).get("params", {}).get(
            "total_num_steps", saved_run)
        schedule = policy.schedule_length(self.cfg.train.on_resume_length, saved_schedule, self.length)
        self.ds_config = cfgmod.with_schedule_length(self.ds_config, self.length, schedule)
        moved = saved_run is not None and (saved_run != self.length or saved_schedule != schedule)
        return changed, (saved_run, self.length, schedule) if moved else None

    def _check_model_unchanged(self) -> dict[str, dict[str, tuple]]:
        """A resume refuses a model whose architecture differs from the checkpoint's (its ``config.json``), naming
        the key: weights of one shape load into another only to fail later, and a changed ``rope_theta`` or norm
        epsilon would load and silently compute another function."""
        file = Path(self.resume_from) / "config.json"
        try:
            saved = type(self.hf_config).from_dict(json.loads(file.read_text())).to_dict()
        except (OSError, ValueError, TypeError):
            return {}  # checked on load: the checkpoint's files are verified against its manifest
        now = policy.model_keys(self.hf_config.to_dict())
        # Over this model's keys: both sides hold every default, and config.json may hold entries of its own.
        return policy.plan({k: v for k, v in policy.model_keys(saved).items() if k in now}, now, self.resume_from)

    def _restore(self, changed: dict[str, dict[str, tuple]], lengths: tuple[int, int, int] | None) -> dict:
        """Load the checkpoint; returns the trainer state this rank saved with it (its logger's clock and curves).
        Rank 0 says what the resume applied: ``changed`` and ``lengths`` (from :meth:`_plan_resume`), and the LR
        it continues at."""
        from . import checkpoint

        restored = checkpoint.load(self.engine, self.resume_from, group=self.group,
                                   check={"tokenizer": self.fingerprint})
        if self.train_iter is not None:
            self.train_iter.load_state_dict(restored["data"])
        if self.rank == 0:
            step = self.engine.global_steps
            print(f"ds_async: resumed from {self.resume_from} (step {step})", flush=True)
            recipe = stream_recipe({})  # its keys have a line of their own, below
            applied = {k: v for k, v in changed.get(policy.APPLIED, {}).items()
                       if not any(k == f"ds_async.{r}" or k.startswith(f"ds_async.{r}.") for r in recipe)}
            if applied:
                print(policy.describe_applied(applied, step, *restored["lr"]), flush=True)
            if lengths is not None:
                print(policy.length_line(self.cfg.train.on_resume_length, step, *lengths,
                                         cfgmod.length_scheduler(self.ds_config), *restored["lr"]), flush=True)
            saved = stream_recipe(restored["manifest"].get("ds_async", {}))
            now = stream_recipe(cfgmod.resolved(self.cfg))
            moved = [k for k in now if saved.get(k) != now[k]]
            if moved:
                print(f"ds_async: warning: changed since the checkpoint: {', '.join(moved)}; the saved position "
                      "in the training stream refers to the old data, so the run does not continue as it would have",
                      flush=True)
        return restored["extra"]

    def _start_logging(self, carried: dict) -> None:
        """The run's logs (:mod:`ds_async.metrics`) and what they measure (:mod:`ds_async.telemetry`): every rank
        times its steps and passes (idle per stage); the reporting rank reads the gradient norm and the rates.
        ``carried``: the logger state a resumed run's checkpoint saved (training clock, curves so far)."""
        import torch.distributed as tdist

        from . import metrics, telemetry

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
            self.run_dir, cfg, self.config_path, self.ds_config, self.hf_config, start_step=self.start,
            total_steps=self.total_steps, tokens_per_step=self.tokens_per_step, micro_batch_size=self.mbs,
            micro_batches=self.gas, data_parallel=engine.grid.data_parallel_size,
            peak_flops=None if peak is None else peak * self.world, carried=carried, resumed_from=self.resume_from,
            enabled=engine.is_reporting_rank, monitor=self.ds_monitor, card=metrics.card_name(engine.device))
        # (step, loss and gradient norm on their way to the host, lr). Under flush-free schedules a step's loss is
        # read after the next step is queued (a drain reads at once), so the last stage's host never waits for its
        # GPU to empty. Its norm exists later on the GPU (once stage 0 has finished the batch): the step is logged
        # once the norm has landed (``ready``), at the latest when the next step's loss has, or at a drain.
        self.in_flight: list[tuple[int, object, float, object]] = []
        self.to_log: list[tuple[int, float | None, float, object]] = []

    # ----------------------------------------------------------------------------------------------- the loop
    def run(self) -> dict | None:
        from .nonfinite import NonFiniteLoss, NonFiniteWeights

        try:
            for step in range(self.start + 1, self.total_steps + 1):
                last = self.preemption is not None and self.preemption.last_step()
                report = self.train_step(step, drain=last)
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
        from . import metrics

        engine = self.engine
        next_drain = step if drain else self.cadence.next_drain(step)
        engine.drain_after(next_drain - 1)  # flush-free: drain only where the pipeline must be empty
        self.clock.begin(step)
        report = engine.train_step(self.train_iter)  # its loss is None off the last stage under flush-free rules
        self.clock.end(step)  # before the loss's copy is queued: once the loss is on the host, so is this mark
        norm = self.grad_norm.take(report) if self.grad_norm is not None else None
        loss = report.loss
        self.in_flight.append((step, None if loss is None else metrics.HostValue(loss), engine.get_lr()[0], norm))
        drained = next_drain == step or not engine.is_async
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
        """Each stage's peak memory and idle fraction on the reporting rank (an object all-gather over all
        ranks): over the steps folded since the last gather, and over the whole run (after the warm-up). A stage's
        replicas: the largest peak, the idle time of all of them over their wall time."""
        import torch.distributed as tdist

        from . import telemetry

        self.clock.fold(wait=final)
        mine = {"peak_memory_gib": telemetry.peak_memory_gib(self.engine.device), "window": self.clock.take_window(),
                "run": {"busy_s": self.clock.total_busy, "wall_s": self.clock.total_wall,
                        "steps": self.clock.total_steps}}
        gathered = [None] * self.world
        tdist.all_gather_object(gathered, mine, group=self.group)
        out = ({}, {})
        for stage in sorted(set(self.stage_of_rank)):
            ranks = [g for r, g in enumerate(gathered) if self.stage_of_rank[r] == stage]
            peak = max(g["peak_memory_gib"] for g in ranks)
            for k, part in enumerate(("window", "run")):
                busy, wall = sum(g[part]["busy_s"] for g in ranks), sum(g[part]["wall_s"] for g in ranks)
                out[k][stage] = {"peak_memory_gib": round(peak, 4),
                                 "idle_fraction": telemetry.idle_fraction(busy, wall), "steps": ranks[0][part]["steps"]}
        return out

    def _stop_if_nonfinite(self, upto: int | None = None) -> None:
        """``stop``: raise NonFiniteLoss if a step's loss up to ``upto`` was NaN/inf. At the end (``upto`` the last
        step, drained) also: warn about skipped steps and refuse a last step that was skipped (``skip``), and
        refuse non-finite weights."""
        from .nonfinite import NonFiniteLoss

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
        from . import checkpoint

        if self.last_saved is None:
            return "no checkpoint was saved"
        folder = self.resume_from if self.resume_from is not None and self.last_saved == self.start else \
            checkpoint.step_dir(self.ckpt_root, self.last_saved)
        return f"the newest checkpoint is {folder}"

    def _check_weights(self, step: int) -> None:
        """Every rank: raise NonFiniteWeights unless the (drained) weights after ``step`` are finite on all ranks.
        A step's loss is computed before its update, so it cannot tell whether the update overflowed."""
        from .nonfinite import NonFiniteWeights, weights_nonfinite

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
        from .nonfinite import NonFiniteLoss, SkipNonFinite

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
        it = iter(self.held_out) if self.needs_data else None
        return self.engine.eval_batch(it, num_micro_batches=self.cfg.eval.batches).item()

    def save(self, step: int) -> None:
        from . import checkpoint

        self._stop_if_nonfinite(upto=step)
        self._check_weights(step)  # a checkpoint holds finite weights, or is not written
        checkpoint.save(self.engine, self.ckpt_root, hf_config=self.hf_config, tokenizer=self.tok,
                        keep=self.cfg.checkpoint.keep, group=self.group,
                        data_state=self.train_iter.state_dict() if self.train_iter is not None else None,
                        extra={"seconds": self.log.elapsed(), "history": self.log.history},
                        meta={"tokenizer": self.fingerprint, "ds_async": cfgmod.resolved(self.cfg),
                              "optimizer": {"type": optimizer_type(self.ds_config)}, "deepspeed": self.ds_config,
                              "run_steps": self.length})
        self.last_saved = step

    def _stop_preempted(self, step: int) -> None:
        """The last step of a preempted run (drained): save it, close the logs without a summary (the run goes on
        after ``--resume``) and raise Preempted on every rank."""
        if self.last_saved != step:
            self.save(step)
        self.preemption.saved()
        self.log.suspend()
        self.ds_monitor.close()
        if self.train_iter is not None:
            self.train_iter.close()
        raise Preempted(step, checkpoint.step_dir(self.ckpt_root, step))

    def release(self) -> None:
        """Put back what the job changed in its process (the SIGTERM handler), however it ended."""
        if self.preemption is not None:
            self.preemption.close()
            self.preemption = None

    def _checkpoints_named(self) -> dict:
        """The summary's ``checkpoint`` (the newest this run saved) and ``resumed_from``."""
        from . import checkpoint

        return {"checkpoint": str(checkpoint.step_dir(self.ckpt_root, self.last_saved))
                if self.last_saved is not None else None,
                "resumed_from": str(self.resume_from) if self.resume_from else None}

    def _close_stopped(self, reason: str) -> None:
        """A run stopped by a non-finite loss or weights: ``summary.json`` of the steps logged, ``stopped`` saying
        why (a diverged run is a result, as the emulation records it), without the final evaluation, save or the
        collectives of :meth:`close`."""
        train = self.log.history["train"]
        self.log.close(train[-1][0] if train else self.start, plot=self.cfg.logging.plot,
                       extra={**self._checkpoints_named(), "stopped": reason})
        self.ds_monitor.close()
        if self.train_iter is not None:
            self.train_iter.close()

    def close(self) -> dict | None:
        """The final evaluation and save, and the run summary (on the reporting rank)."""
        import torch.distributed as tdist
        from deepspeed import comm as dist

        from . import data

        total, engine = self.total_steps, self.engine
        self._stop_if_nonfinite(upto=total)
        if self.cadence.evaluates(total):
            self.log.validation(total, self.validate())
        if self.cadence.saves(total) and self.last_saved != total:
            self.save(total)
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
