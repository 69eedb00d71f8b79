"""How a training job (:class:`~ds_async.trainer.Trainer`) is built, on every rank: its run folder and checkpoint
folder agreed and locked, the checkpoint ``--resume`` names and what may change since it
(:mod:`ds_async.resume`), the engine, the data streams and the sources checked before the first step, and the
restored state. :class:`TrainerSetup` holds these steps of ``setup``; the trainer is the rest of the job (the loop,
its logs, evaluation, saves, the end).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch.distributed as tdist
from deepspeed import comm as dist

from . import checkpoint
from . import config as cfgmod
from . import console, data, tokenizer
from . import resume as policy
from .builder import check_place, initialize, place_of, start_reader
from .cadence import Cadence
from .checkpoint import folder
from .checkpoint.folder import agree
from .config import ConfigError
from .data import DataError
from .job import default_run_name, seed_everything, steps_for, use_deterministic
from .models import build_pipeline, check_seq_len, check_vocab, compile_line, model_config
from .nonfinite import LossMonitor, SkipNonFinite, check_skip_supported
from .prefetch import MicroBatchReader, ReaderProcess, reads_in_background
from .preempt import Preemption
from .resume import check_optimizer_type, checkpoint_to_resume, config_keys, stream_recipe


def _or_error(fn, *args):
    """``fn(*args)``, or the ConfigError or CheckpointError it raised (for
    :func:`~ds_async.checkpoint.folder.agree`)."""
    try:
        return fn(*args)
    except (ConfigError, checkpoint.CheckpointError) as e:
        return e


@dataclasses.dataclass
class SourceReads:
    """What a rank's start-up reads of its data found (:meth:`TrainerSetup._read_sources`)."""
    stream: data.PackedBatches | None = None  # the training stream, its first micro-batch buffered
    held_out: list = dataclasses.field(default_factory=list)  # the validation micro-batches, on the host
    counts: dict = dataclasses.field(default_factory=dict)  # key: (documents read, not UTF-8 of them, the source)
    error: Exception | None = None  # what stopped the reads, for every rank to raise


def _in_background(fn) -> Future:
    """``fn()`` on a thread of its own; the future's ``result`` returns what it returned or raises what it raised."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="ds_async-sources")
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)  # the submitted call still runs; the thread ends with it


def _discard(reads: Future | None) -> None:
    """After a failed set-up: wait for the source reads, then close the training stream they opened."""
    if reads is None:
        return
    try:
        stream = reads.result().stream
    except BaseException:  # noqa: BLE001 - the set-up's own failure is the one raised
        return
    if stream is not None:
        stream.close()


class TrainerSetup:
    """The set-up steps of a :class:`~ds_async.trainer.Trainer` (it sets the config, ranks and run length in its
    ``__init__``, and declares the state each step sets); :meth:`setup` runs them in order."""

    def setup(self, resume: str | None = None, reader: ReaderProcess | None = None) -> None:
        """``reader``: this rank's reader process if the caller started it (:func:`~ds_async.builder.start_reader`,
        earlier than this could), which the trainer then owns; else it is started here where one is needed."""
        seed_everything(self.cfg.seed)
        use_deterministic(self.cfg.performance.deterministic)
        self.group = tdist.new_group(backend="gloo")  # host-side agreement: checkpoint files, loss flags
        ckpt = self.cfg.checkpoint
        # Python runs signal handlers in the main thread only; a trainer run elsewhere leaves SIGTERM as it is.
        if ckpt.saves and ckpt.preempt_grace_s > 0 and \
                threading.current_thread() is threading.main_thread():
            self.preemption = Preemption(ckpt.preempt_grace_s, self.group, say=self.rank == 0)
        self.writer = folder.BackgroundWriter(tdist.new_group(backend="gloo")) \
            if ckpt.async_save and ckpt.saves else None
        self.weights_ok_at, self.end_checked = None, False  # see _check_weights, _stop_if_nonfinite
        self.train_iter = None  # the training stream's reader (_build_data), which then owns the reader process
        if reader is None:  # started now, so that its imports overlap the model's build
            reader = start_reader(self.cfg, self.rank, self.world, self.device.type)
        try:
            self._set_up(resume, reader)
        except BaseException:
            if self.train_iter is not None:
                self.train_iter.close()
            elif reader is not None:
                reader.close()
            raise
        self.start_clock.mark("data")

    def _set_up(self, resume: str | None, reader: ReaderProcess | None) -> None:
        """:meth:`setup`'s steps from the run folder on: ``reader`` is the reader process started for this rank."""
        self._locate_run(resume)
        changed, lengths = self._plan_resume() if self.resume_from is not None else ({}, None)
        self._load_tokenizer(changed)
        self.place = place_of(self.cfg, self.rank, self.world)
        if reader is not None:  # reads from the run's position from now on, the start or the checkpoint's
            position = self._saved_position() if self.resume_from is not None else None
            if self.resume_from is None or position is not None:
                MicroBatchReader.begin_at(reader, self._opener("train"), self._chunk(), position)
        reads = _in_background(self._read_sources) if self.place.reads_data else None
        try:
            self._build_engine()
            check_place(self.engine, self.place)
        except BaseException:
            _discard(reads)
            raise
        self._check_sources(self._build_data(reads.result() if reads else SourceReads(), reader))
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
        cfg, root = self.cfg, self.ckpt_root
        saves = cfg.checkpoint.saves
        if saves:
            try:
                folder.prepare(root)
            except OSError as e:
                raise ConfigError(f"ds_async.checkpoint.dir: {root} cannot hold checkpoints ({type(e).__name__}: "
                                  f"{e.strerror or e}); point it at a writable folder") from None
            folder.lock(root)
        found = checkpoint_to_resume(resume, cfg, root) if resume is not None else None
        newest = checkpoint.latest(root) if saves and resume is None else None
        if newest is not None:
            raise checkpoint.CheckpointError(
                f"{root}: holds checkpoints of an earlier run (newest {newest.name}), which this run's first save "
                "would move aside; pass --resume to continue that run, or give this one another run name "
                "(--run-name) or ds_async.checkpoint.dir; to start over, move that folder away first")
        return found

    def _read_sources(self) -> SourceReads:
        """This rank's start-up reads of its data, on a thread while the model builds: open the training stream and
        buffer its first micro-batch (kept for the first step), and read the ``eval.batches`` micro-batches an
        evaluation reads, so that data that cannot be opened or read, holds no usable text (an empty source, a wrong
        ``data.text_field``, nothing but non-UTF-8 lines) or too little for an evaluation stops the job at start
        (:meth:`_check_sources`) rather than at the first evaluation or mid-run. The streams shuffle with generators of
        their own: the reads draw nothing from the global RNGs that the model's build and training use."""
        reads, cfg = SourceReads(), self.cfg
        try:
            reads.stream = self._opener("train")()
        except (ConfigError, DataError, FileNotFoundError) as e:
            reads.error = e
            return reads
        for key, role in (("ds_async.data.train", "train"), ("ds_async.data.validation", "validation")):
            source = getattr(cfg.data, role)
            if not source:
                continue
            read = 0
            try:
                if role == "train":
                    batches = reads.stream
                    batches.peek()
                else:  # everything an evaluation reads, kept for every evaluation (they read the same)
                    batches = self._opener("validation")()
                    try:
                        for read in range(cfg.eval.batches):
                            reads.held_out.append(next(batches))
                    finally:
                        batches.close()
                reads.counts[key] = (batches.documents, batches.skipped["non_utf8"], data.describe(source))
            except StopIteration:
                reads.error = data.DataError(
                    f"{key}: {data.describe(source)}: too little text for ds_async.eval.batches = {cfg.eval.batches} "
                    f"micro-batches of {self.mbs} x {cfg.data.seq_len} tokens per replica (data-parallel rank "
                    f"{self.place.replica} ran out after {read})")
            except (ConfigError, data.DataError, FileNotFoundError) as e:
                reads.error = e if str(e).startswith(key) else type(e)(f"{key}: {e}")
            except Exception as e:  # noqa: BLE001 - whatever the reader raised, as a one-line DataError
                reads.error = data.DataError(f"{key}: {data.describe(source)}: cannot be read ({type(e).__name__}: "
                                             f"{e})")
            if reads.error is not None:
                break
        return reads

    def _check_sources(self, reads: SourceReads) -> None:
        """Every rank raises the first failing rank's error of its :meth:`_read_sources`. Of the documents read, half
        or more not UTF-8 is refused, a tenth gets a warning line (:func:`ds_async.data.check_encoding`)."""
        gathered = folder.gather((reads.error, reads.counts), self.group)
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

    def _load_tokenizer(self, changed: dict[str, dict[str, tuple]]) -> None:
        """The tokenizer and the model's config, checked against each other and the data's sequence length. A resume
        first checks the model's config against the checkpoint's, adding its applied changes to ``changed``."""
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

    def _build_engine(self) -> None:
        """The model and the DeepSpeed engine."""
        cfg = self.cfg
        with console.deepspeed_quiet(cfg.logging.deepspeed_log):
            module = build_pipeline(cfg, self.hf_config)
            self.start_clock.mark("model")
            self.engine = engine = initialize(module, self.ds_config, schedule=cfg.schedule,
                                              correction=cfg.correction,
                                              fused_optimizer_step=cfg.performance.fused_optimizer_step,
                                              stats_every=cfg.logging.optimizer_every)
        self.start_clock.mark("engine")
        if self.rank == 0 and (line := compile_line(cfg.performance)):
            print(line, flush=True)
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

    def _build_data(self, reads: SourceReads, reader: ReaderProcess | None) -> SourceReads:
        """The training stream ``reads`` opened, to be read by ``reader`` (see :meth:`setup`), which the stream's
        reader then owns (it is closed here if unused), and the validation micro-batches on this rank's device."""
        if reads.stream is not None:
            self.train_iter = self._read_ahead(reads.stream, reader)
        elif reader is not None:
            reader.close()
        self.held_out = [(x.to(self.engine.device), y.to(self.engine.device)) for x, y in reads.held_out]
        return reads

    def _read_ahead(self, stream, reader: ReaderProcess | None):
        """``stream`` as the engine reads it (:class:`ds_async.prefetch.MicroBatchReader`): tokenized and packed in a
        reader process :meth:`_chunk` micro-batches at a time (``performance.data_reader``), or here one at a time.
        The stream opened here serves the set-up's checks; a fresh run's reader opens its own (:meth:`_set_up`)."""
        background = reads_in_background(self.cfg.performance.data_reader, self.device)
        return MicroBatchReader(stream, self._opener("train"), self.engine.device,
                                chunk=self._chunk() if background else 1, background=background, reader=reader)

    def _opener(self, role: str) -> functools.partial:
        """What opens this rank's micro-batches of ``data.train`` (shuffled, repeating) or ``data.validation`` (one
        pass), here or in a reader process: with the replica :func:`~ds_async.builder.place_of` gives this rank."""
        cfg = self.cfg
        return functools.partial(data.open_batches, cfg.data, role, self.tok, self.mbs, dp_rank=self.place.replica,
                                 dp_world_size=self.place.replicas, seed=cfg.seed)

    def _chunk(self) -> int:
        """Micro-batches a reader process hands over at a time: 16 steps' worth. Per chunk the host pays a queue
        transfer, a pinned copy and the copy's launch, which at one step a chunk left the training loop waiting."""
        return 16 * self.gas

    def _plan_resume(self) -> tuple[dict[str, dict[str, tuple]], tuple[int, int, int] | None]:
        """Before the engine is built: what ``--resume`` does with each key changed since the checkpoint
        (:mod:`ds_async.resume`): ConfigError for a refused one; the LR schedule built for the length
        ``train.on_resume_length`` says. Returns, for :meth:`_restore` to report, the changes by action and, if the
        run's or the schedule's length changed, (the checkpoint's run length, this run's, the schedule's)."""
        manifest = agree(_or_error(checkpoint.read_manifest, self.resume_from) if self.rank == 0 else None,
                          self.group)
        check_optimizer_type(manifest, self.ds_config, self.resume_from)
        changed = policy.plan(config_keys(manifest.get("ds_async") or {}, manifest.get("deepspeed") or {}),
                              config_keys(cfgmod.resolved(self.cfg), self.ds_config), self.resume_from)
        saved_run = manifest.get("run_steps")
        saved_schedule = ((manifest.get("deepspeed") or {}).get("scheduler") or {}).get("params", {}).get(
            "total_num_steps", saved_run)
        schedule = policy.schedule_length(self.cfg.train.on_resume_length, saved_schedule, self.length)
        self.ds_config = cfgmod.with_schedule_length(self.ds_config, self.length, schedule)
        moved = saved_run is not None and (saved_run != self.length or saved_schedule != schedule)
        return changed, (saved_run, self.length, schedule) if moved else None

    def _saved_position(self) -> dict | None:
        """This rank's training-stream position in the checkpoint it resumes from, read before the build; None where
        it cannot be read now: the restore then verifies the checkpoint, names what is wrong, and hands the reader
        its position itself."""
        try:
            return checkpoint.data_position(self.resume_from, self.place.stage, self.place.replica)
        except Exception:  # noqa: BLE001 - reported by the restore, which reads the same file
            return None

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
