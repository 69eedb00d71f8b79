"""The emulation job: a pipeline's training under its schedule's weight delays in one process, the cheap way to study
optimizers under delay on one device, with the reference :class:`~ds_async.pipe.delayed.DelayedTrainer`.

:func:`run` (``python -m ds_async.emulate --config CONFIG.json``) trains the job of a DeepSpeed JSON with a
``"ds_async"`` section, the same file ``launch/train.py`` reads, in one process:

- model, partition, seed, tokenizer, data streams, schedule and correction from the ``ds_async`` section;
- optimizer (``ds_async.optim.build_optimizer``), ``scheduler`` (DeepSpeed's ``lr_schedules`` class of that name,
  else ``torch.optim.lr_scheduler``'s, stepped after every optimizer step), ``gradient_clipping`` and the batch
  split from DeepSpeed's keys; the data-parallel degree a launch would take from its world size is
  ``train_batch_size / (micro-batch x accumulation)`` when all three are given, else 1, and each replica reads
  its own share of the documents, as on the engine;
- evaluation on the drained newest weights at the steps :class:`ds_async.cadence.Cadence` plans;
- the run folder ``<logging.dir>/<run_name>`` gets what a ``launch/train.py`` run writes (``manifest.json`` with
  the resolved config, tensorboard events, ``summary.json``, ``loss.png``), the manifest adding an ``emulation``
  section (device, card, precision). Instead of engine checkpoints it keeps ``emulation_state.pt`` (weights,
  older versions, optimizer, scheduler, data position, curves, training clock) at ``checkpoint.every`` steps and when
  ``--time-limit`` runs out (exit 75); ``--resume`` continues from it, the same as a run that never stopped. A run
  whose loss turns NaN or inf stops there as on the engine (``train.on_nonfinite = "stop"``), but first writes its
  ``summary.json`` up to that step with ``"stopped"`` saying why: a diverged run is a result of a sweep, not a
  run to try again.

Precision: fp32 on CPU always. On a GPU, ``bf16.enabled`` trains as the engine does under bf16 (bf16 weights and
versions, fp32 master weights and optimizer state through :class:`~ds_async.optim.master.MasterWeights`, Muon's
step fused with ``performance.fused_optimizer_step``), and ``torch_autocast`` runs each layer's forward under bf16
autocast over fp32 weights. ``performance.compile`` compiles the whole model's forward and loss as one region;
``loss_chunk`` applies; other levers change no result beyond rounding and are not applied. Data is read ahead (on
a GPU by a reader process) and staged on the device in chunks (:class:`ds_async.prefetch.Prefetcher`) and losses
reach the host a step late, so on a GPU the loop does not wait for the host. On CPU in fp32 a run equals
``launch/train.py``'s on the engine: the same validation losses, bit for bit (``tests/test_study.py``).
"""
from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from deepspeed.runtime import lr_schedules
from torch import nn

from . import config as cfgmod
from . import console, data, fp8, jsonfile, metrics, telemetry, tokenizer
from .cadence import Cadence
from .config import ConfigError, data_parallel_degree, gradient_clipping
from .data import DataError
from .job import default_run_name, seed_everything, start_run_log, steps_for, use_deterministic
from .metrics import HostValue
from .models import cache_compiled_code, check_seq_len, check_vocab, decoder_layers
from .models.partition import build_layers, stage_bounds, stage_of_layers
from .nonfinite import NonFiniteLoss, SkipNonFinite
from .optim import Muon, build_optimizer
from .optim.master import MasterWeights
from .pipe.delayed import DelayedTrainer
from .prefetch import Prefetcher, ReaderProcess, reads_in_background


# ---------------------------------------------------------------------------------------------------------------
# A whole job from a DeepSpeed JSON config, in one process


def precision(ds_config: dict, device: torch.device) -> str:
    """What the emulation computes in for this config on ``device``: ``bf16`` (``bf16.enabled``: bf16 weights and
    fp32 master weights, as the engine trains), ``autocast`` (``torch_autocast``: bf16 autocast over fp32 weights)
    or ``fp32`` (the config asks for neither, or the device is a CPU)."""

    if (ds_config.get("fp16") or {}).get("enabled"):
        raise ConfigError("fp16.enabled: the emulation runs fp32 or bf16 (bf16 or torch_autocast)")
    autocast = ds_config.get("torch_autocast") or {}
    if autocast.get("enabled") and str(autocast.get("dtype", "bfloat16")).replace("torch.", "") != "bfloat16":
        raise ConfigError(f"torch_autocast.dtype: the emulation autocasts to bfloat16 only, got {autocast['dtype']!r}")
    bf16 = bool((ds_config.get("bf16") or {}).get("enabled"))
    if bf16 and autocast.get("enabled"):
        raise ConfigError("bf16.enabled: bf16 and torch_autocast are both enabled; choose one")
    if device.type != "cuda":
        return "fp32"
    return "bf16" if bf16 else "autocast" if autocast.get("enabled") else "fp32"


def build_scheduler(block: dict | None, optimizer: torch.optim.Optimizer):
    """The ``scheduler`` block as DeepSpeed builds it: its ``lr_schedules`` class of that name, else
    ``torch.optim.lr_scheduler``'s, with ``params`` as keyword arguments; None without a block."""
    if not block:
        return None
    name = block.get("type")
    cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name or "", None)
    if cls is None:
        raise ConfigError(f"scheduler.type: unknown scheduler {name!r} (neither deepspeed.runtime.lr_schedules nor "
                          "torch.optim.lr_scheduler has it)")
    try:
        return cls(optimizer, **block.get("params", {}))
    except TypeError as e:
        raise ConfigError(f"scheduler.params: {e}") from None


def tokenize_batch(tokens: int) -> int:
    """Documents a stream tokenizes at a time when a run reads ``tokens`` tokens from it: the stream is the same
    whatever the batch, but a short run (a CPU test) should not tokenize 64 long documents to use a few thousand
    tokens; a long one takes the library's default of 64, as ``launch/train.py`` does."""
    return max(1, min(64, tokens // 2 ** 16))


def _autocast(layers: Sequence[nn.Module], device: torch.device) -> list[nn.Module]:
    """Each layer's forward under bf16 autocast; the backward and the optimizer step stay outside it."""

    class Autocast(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return self.inner(x)

    return [Autocast(layer) for layer in layers]


class _OneProcess:
    """The rank/barrier interface ``ds_async.tokenizer.resolve`` expects, for a single process."""

    @staticmethod
    def get_rank() -> int:
        return 0

    @staticmethod
    def barrier() -> None:
        pass


class Stopped(Exception):
    """A run stopped at its time limit with its state saved; ``run(..., resume=True)`` continues it."""

    def __init__(self, step: int, state_file: Path):
        super().__init__(f"stopped at the time limit after step {step}; state saved to {state_file}; run again "
                         "with --resume to continue")
        self.step, self.state_file = step, state_file


STATE_FILE = "emulation_state.pt"


class Emulation:
    """One job of a DeepSpeed JSON, trained in this process (:func:`run` drives it): the constructor builds what
    the config asks for, in the order ``launch/train.py`` does (so the same seeds give the same weights and data);
    :meth:`restore` continues a saved state, :meth:`start_logging` opens the run folder's logs, :meth:`train`
    runs the steps and :meth:`finish` writes the summary."""

    def __init__(self, config_path: str, max_steps: int | None = None, run_name: str | None = None,
                 device: str | None = None, overrides: dict | None = None):

        self.start_clock = telemetry.StartClock()  # marked along the build and at the end of the first step
        self.config_path, self.overrides = config_path, dict(overrides or {})
        ds_config, cfg = cfgmod.load(config_path, self.overrides)
        if run_name is not None:
            cfg = replace(cfg, logging=replace(cfg.logging, run_name=run_name))
        self.cfg, self.dp = cfg, data_parallel_degree(ds_config)
        _, self.mbs, self.gas = cfgmod.check_batch(ds_config, cfg, cfg.pipeline_stages * self.dp)
        self.tokens_per_step = self.mbs * self.gas * self.dp * cfg.data.seq_len
        planned = steps_for(cfg, self.tokens_per_step)
        self.ds_config = cfgmod.with_schedule_length(ds_config, planned)
        self.total_steps = planned if max_steps is None else min(planned, max_steps)
        self._place(device)
        # Where the training stream is read in a process, it is started now: its imports overlap the model's build.
        reads = reads_in_background(cfg.performance.data_reader, self.device)
        reader = ReaderProcess(imports=("ds_async.data", "datasets")) if reads else None
        try:
            self._build()
        except BaseException:
            if reader is not None:
                reader.close()
            raise
        self.start_clock.mark("model")
        self._open_data(reader)

        self.cadence = Cadence(self.total_steps, eval_every=cfg.eval.every, save_every=cfg.checkpoint.every,
                               evaluate=bool(cfg.data.validation), final_save=False)
        self.done, self.resumed_from, self.log = 0, None, None
        # Losses and norms reach the host a step or two late (HostValue), so the host queues the next step while
        # the device runs this one; a non-finite loss still stops the run, at most two steps after it.
        self.pending: collections.deque = collections.deque()

    def _place(self, device: str | None) -> None:

        if "optimizer" not in self.ds_config:
            raise ConfigError("optimizer: the emulation builds the optimizer from this block; it is missing")
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda":
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(dev)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        self.device, self.precision = dev, precision(self.ds_config, dev)
        fp8.check(self.cfg.performance.fp8, self.ds_config, self.cfg.performance.compile, dev)
        if self.precision == "bf16" and self.cfg.train.on_nonfinite == "skip":
            raise ConfigError("ds_async.train.on_nonfinite: 'skip' needs fp32 or torch_autocast weights, not bf16")
        seed_everything(self.cfg.seed)
        use_deterministic(self.cfg.performance.deterministic)
        cache_compiled_code(self.cfg.performance)  # as models.build_pipeline

    def _build(self) -> None:
        """Run folder, tokenizer, model, optimizer (bf16: with fp32 masters), LR scheduler and the trainer."""

        cfg, ds_config, dev = self.cfg, self.ds_config, self.device
        self.run_dir = Path(cfg.logging.dir) / (cfg.logging.run_name or default_run_name(cfg, ds_config))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.state_file = self.run_dir / STATE_FILE
        self.tokenizer = tokenizer.resolve(cfg, self.run_dir, _OneProcess)
        layers, loss_fn, self.hf_config = build_layers(cfg.model, seed=cfg.seed, loss_chunk=cfg.performance.loss_chunk)
        if cfg.performance.fp8:  # as the pipeline converts its stages (models.build_pipeline)
            for layer in decoder_layers(layers):
                fp8.convert(layer, cfg.performance.fp8)
        check_vocab(self.tokenizer, self.hf_config, cfg.tokenizer)
        check_seq_len(cfg, self.hf_config)
        self.bounds = stage_bounds(cfg.partition.method, layers, cfg.pipeline_stages, cfg.partition.boundaries)
        layers.to(dev)
        try:
            optimizer = build_optimizer(ds_config["optimizer"], layers, cfg.correction)
        except ValueError as e:
            raise ConfigError(f"optimizer: {e}") from None
        if self.precision == "bf16":  # the engine's bf16 arithmetic: bf16 module and versions, fp32 masters, state
            fused = cfg.performance.fused_optimizer_step and isinstance(optimizer, Muon)
            optimizer = MasterWeights(optimizer, layers, fused=fused, device=dev)
        self.layers, self.optimizer = layers, optimizer
        self.stepped = SkipNonFinite(optimizer) if cfg.train.on_nonfinite == "skip" else optimizer
        with console.deepspeed_quiet(cfg.logging.deepspeed_log):  # its schedulers warn when built, as the CLI's do
            self.scheduler = build_scheduler(ds_config.get("scheduler"), optimizer)
        run_layers = _autocast(layers, dev) if self.precision == "autocast" else list(layers)
        self.trainer = DelayedTrainer(run_layers, stage_of_layers(self.bounds), loss_fn, self.stepped, cfg.schedule,
                                      self.gas, cfg.pipeline_stages, data_parallel=self.dp,
                                      clip=gradient_clipping(ds_config),
                                      after_step=self._after_step, compile=cfg.performance.compile)

    def _after_step(self) -> None:
        # As DeepSpeed: a skipped step leaves the LR schedule where it was.
        if self.scheduler is not None and not getattr(self.stepped, "overflow", False):
            self.scheduler.step()

    def _validation_stream(self, rank: int):

        cfg, mbs = self.cfg, self.mbs
        tokens = cfg.eval.batches * mbs * cfg.data.seq_len
        return data.open_batches(cfg.data, "validation", self.tokenizer, mbs, dp_rank=rank, dp_world_size=self.dp,
                                 seed=cfg.seed, tokenize_batch=tokenize_batch(tokens))

    def _open_data(self, reader: ReaderProcess | None) -> None:
        """The training stream, read ahead for the run's steps and none past its last (by ``reader``, if any: see
        ``performance.data_reader``; in this process otherwise)."""

        cfg = self.cfg
        tokens = self.total_steps * self.mbs * self.gas * cfg.data.seq_len
        streams = functools.partial(data.open_replica_streams, cfg.data, self.tokenizer, self.mbs, self.dp, cfg.seed,
                                    tokenize_batch(tokens))
        self.batches = Prefetcher(streams, self.gas, self.device, steps=self.total_steps,
                                  chunk=min(16, self.total_steps), background=reader is not None, reader=reader)
        self.held_out: list[list] = []  # the validation micro-batches of each replica: the same every evaluation

    @torch.no_grad()
    def validate(self) -> float:
        """The mean validation loss on the newest weights, as the engine averages it."""

        cfg = self.cfg
        if not self.held_out:
            for r in range(self.dp):
                stream = self._validation_stream(r)
                batches = [b for _, b in zip(range(cfg.eval.batches), stream)]
                stream.close()
                if len(batches) < cfg.eval.batches:
                    raise data.DataError(f"{cfg.data.validation}: {len(batches)} validation micro-batches for "
                                         f"replica {r}, ds_async.eval.batches asks for {cfg.eval.batches}")
                self.held_out.append([(x.to(self.device), y.to(self.device)) for x, y in batches])
        means = []
        for batches in self.held_out:  # as the engine: each replica's micro-batch losses summed, then the mean
            total = None
            for x, y in batches:
                loss = self.trainer.eval_loss(x, y)
                total = loss if total is None else total + loss
            means.append(total / len(batches))
        mean = sum(means[1:], means[0])
        return (mean / self.dp if self.dp > 1 else mean).item()

    # -- state ----------------------------------------------------------------------------------------------------
    def _identity(self) -> dict:

        return {"ds_async": cfgmod.resolved(self.cfg), "deepspeed": self.ds_config, "total_steps": self.total_steps}

    def restore(self) -> dict | None:
        """Continue from the run folder's saved state, if there is one (the same config only); returns it."""

        if not self.state_file.exists():
            return None
        state = torch.load(self.state_file, map_location="cpu", weights_only=True)
        if jsonfile.dumps(state["identity"], sort_keys=True) != jsonfile.dumps(self._identity(), sort_keys=True):
            raise ConfigError(f"--resume: {self.state_file} was saved by a run of another config or length; "
                              "remove it to start again")
        self.layers.load_state_dict(state["layers"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.trainer.load_state_dict(state["trainer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.batches.load_state_dict(state["data"], steps=self.total_steps - state["step"])
        if isinstance(self.stepped, SkipNonFinite):
            self.stepped.skipped = state["skipped_steps"]
        torch.set_rng_state(state["rng"])
        self.done, self.resumed_from = state["step"], str(self.state_file)
        return state

    def save(self, step: int) -> None:
        """The state after ``step`` to the run folder, atomically."""
        doc = {"identity": self._identity(), "step": step, "layers": self.layers.state_dict(),
               "trainer": self.trainer.state_dict(), "optimizer": self.optimizer.state_dict(),
               "data": self.batches.state_dict(), "history": self.log.history, "seconds": self.log.elapsed(),
               "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
               "skipped_steps": getattr(self.stepped, "skipped", 0), "rng": torch.get_rng_state()}
        tmp = self.state_file.with_suffix(".tmp")
        torch.save(doc, tmp)
        os.replace(tmp, self.state_file)

    # -- logging ------------------------------------------------------------------------------------------------
    def start_logging(self, state: dict | None = None) -> None:
        """The run folder's logger and manifest; a restored ``state`` carries its curves and clock over."""

        cfg = self.cfg
        self.log = start_run_log(
            self.run_dir, cfg, self.config_path, self.overrides, self.ds_config, self.hf_config, start_step=self.done,
            total_steps=self.total_steps, tokens_per_step=self.tokens_per_step, micro_batch_size=self.mbs,
            micro_batches=self.gas, data_parallel=self.dp,
            peak_flops=telemetry.peak_flops(cfg.logging.peak_tflops, self.device), carried=state,
            resumed_from=self.resumed_from,
            emulation={"device": str(self.device), "card": metrics.card_name(self.device), "precision": self.precision,
                       "parameters": sum(q.numel() for q in self.layers.parameters()),
                       "compile": cfg.performance.compile, "partition": self.bounds,
                       "torch_threads": torch.get_num_threads(),
                       # the tokenizer's thread pool (None: one thread per core)
                       "tokenizer_threads": os.environ.get("RAYON_NUM_THREADS")})

    def report(self, upto_all: bool = False) -> None:
        """Log the steps whose figures have reached the host (all of them with ``upto_all``)."""
        while self.pending and (upto_all or len(self.pending) > 2 or self.pending[0][1].ready()):
            step, loss, lr, norm = self.pending.popleft()
            value = float(loss)
            self.log.train_step(step, value, lr, grad_norm=None if norm is None else float(norm))
            if not math.isfinite(value) and self.cfg.train.on_nonfinite == "stop":
                raise NonFiniteLoss(f"step {step}: the training loss is {'NaN' if math.isnan(value) else 'inf'}; "
                                    "training stopped there (ds_async.train.on_nonfinite = 'stop')")

    # -- the loop -------------------------------------------------------------------------------------------------
    def train(self, deadline: float | None = None) -> None:
        """The steps left; past ``deadline`` (``time.perf_counter`` seconds) the state is saved and
        :class:`Stopped` raised."""

        first = self.done + 1
        self.start_clock.mark("data")  # the stream, a resumed run's state, the logs
        try:
            for step in range(first, self.total_steps + 1):
                loss, norm = self.trainer.step_batch(self.batches.next_step())
                if step == first:
                    self.start_clock.mark("first step")
                    self.log.start(step, self.start_clock.spans())
                self.pending.append((step, HostValue(loss), self.optimizer.param_groups[0]["lr"],
                                     None if norm is None else HostValue(norm)))
                self.report()
                if self.cadence.evaluates(step):
                    self.report(upto_all=True)
                    self.log.validation(step, self.validate())
                out_of_time = deadline is not None and time.perf_counter() > deadline
                if (self.cadence.saves(step) or out_of_time) and step < self.total_steps:
                    self.report(upto_all=True)
                    self.save(step)
                    if out_of_time:
                        self.log.suspend()
                        raise Stopped(step, self.state_file)
            self.report(upto_all=True)
        finally:
            self.batches.close()

    def finish(self, stopped: str | None = None) -> dict:
        """The summary (``summary.json``, the console line); the saved state is no longer needed. ``stopped``: why
        the run ended before its last step (its summary then covers the steps it ran)."""

        skipped = self.batches.skipped
        skipped_docs = {k: skipped.get(k, 0) for k in data.SKIP_REASONS}
        train = self.log.history["train"]
        steps = self.total_steps if stopped is None or not train else train[-1][0]
        summary = self.log.close(steps, plot=self.cfg.logging.plot,
                                 extra={"skipped_docs": skipped_docs,
                                        "skipped_steps": getattr(self.stepped, "skipped", 0),
                                        "checkpoint": None, "resumed_from": self.resumed_from,
                                        **({"stopped": stopped} if stopped else {})})
        self.state_file.unlink(missing_ok=True)
        return summary


def run(config_path: str, max_steps: int | None = None, run_name: str | None = None,
        device: str | None = None, resume: bool = False, time_limit: float | None = None,
        overrides: dict | None = None) -> dict:
    """Train the job of the DeepSpeed JSON at ``config_path``, with ``overrides`` (dotted key -> value, the command
    line's ``--set``) set in it, in this process (see the module docstring); returns the run summary (also written
    to ``<run folder>/summary.json``).

    ``time_limit`` (seconds from the call): once a step ends past it, the run saves its state to
    ``<run folder>/emulation_state.pt`` and raises :class:`Stopped`; so does a ``checkpoint.every`` step (without
    stopping). ``resume``: continue from that file when the run folder has one (the same config only). A NaN or
    inf loss raises :class:`~ds_async.nonfinite.NonFiniteLoss` after the summary of the steps run is written."""
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    job = Emulation(config_path, max_steps=max_steps, run_name=run_name, device=device, overrides=overrides)
    job.start_logging(job.restore() if resume else None)
    try:
        job.train(deadline)
    except NonFiniteLoss as e:
        job.finish(stopped=f"{type(e).__name__}: {e}")
        raise
    return job.finish()


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(prog="python -m ds_async.emulate",
                                     description="Train a ds_async JSON config's job in one process under its "
                                                 "schedule's weight delays (the delay emulation).")
    parser.add_argument("--config", required=True, help="DeepSpeed JSON with a \"ds_async\" section")
    cfgmod.add_set_argument(parser)
    parser.add_argument("--run-name", default=None, help="override ds_async.logging.run_name")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds: save the run's state and exit 75 once a step ends past this")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the run folder's emulation_state.pt (left by --time-limit or "
                             "checkpoint.every), if there is one")
    args = parser.parse_args(argv)
    try:
        run(args.config, max_steps=args.max_steps, run_name=args.run_name, device=args.device, resume=args.resume,
            time_limit=args.time_limit, overrides=dict(args.sets))
    except Stopped as e:
        print(f"ds_async: {e}", file=sys.stderr, flush=True)
        return 75  # EX_TEMPFAIL: schedulers treat it as "run again"
    except (ConfigError, DataError, NonFiniteLoss, FileNotFoundError) as e:
        print(f"ds_async: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    status = main()
    if status == 0:
        console.exit_now()  # the summary is written: the interpreter's teardown would only hold the process
    sys.exit(status)
