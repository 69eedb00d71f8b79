"""The training job: config -> tokenizer -> pipeline model -> engine -> train/eval/save loop -> logs.

``launch/train.py`` is a thin command-line wrapper around :func:`train`. Checkpoints (``ds_async.checkpoint``)
are saved on drained pipelines, like evaluations, and ``resume`` continues a run exactly where one stopped.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from . import config as cfgmod
from .config import ConfigError, DsAsyncConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_tokenizer(cfg: DsAsyncConfig, run_dir: Path, dist):
    """Load the configured tokenizer; ``train:<vocab>`` trains one on the training stream (rank 0) first."""
    from . import data, tokenizer

    spec = cfg.tokenizer
    if spec.startswith("train:"):
        try:
            vocab = int(spec.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"ds_async.tokenizer: 'train:<vocab size>' expected, got {spec!r}") from None
        path = run_dir / "tokenizer.json"
        if dist.get_rank() == 0 and not path.exists():
            stream = data.load_text_stream(cfg.data.train, "train", cfg.data.text_field)
            texts = (data.usable_text(row.get(cfg.data.text_field), cfg.data.min_chars)[0] for row in stream)
            tokenizer.train_bpe((t for t in texts if t is not None), vocab, str(path))
        dist.barrier()
        spec = str(path)
    return data.load_tokenizer(spec)


def check_vocab(tok, hf_config, spec: str) -> None:
    """The tokenizer's ids must all be rows of the model's embedding."""
    if len(tok) > hf_config.vocab_size:
        raise ConfigError(f"ds_async.model: vocab_size {hf_config.vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({len(tok)} tokens from {spec}); the tokenizer does not match the model")


def tokenizer_fingerprint(tok) -> dict:
    """Size and hash of the vocabulary: a resumed run must tokenize exactly like the saved one."""
    vocab = json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode()
    return {"size": len(tok), "sha256": hashlib.sha256(vocab).hexdigest()}


def _resume_from(resume: str, cfg: DsAsyncConfig, ckpt_root: Path) -> Path | None:
    """The checkpoint ``--resume`` means: ``latest`` is the newest complete one in the run's checkpoint folder;
    anything else is a checkpoint folder or a folder of them."""
    from . import checkpoint

    if resume == "latest":
        if cfg.checkpoint.dir is None and cfg.logging.run_name is None:
            raise ConfigError("--resume: this run's checkpoint folder is not fixed (its run name is a timestamp): "
                              "set ds_async.checkpoint.dir or ds_async.logging.run_name (--run-name), or pass "
                              "--resume PATH")
        return checkpoint.resolve(ckpt_root)
    if not Path(resume).exists():
        raise checkpoint.CheckpointError(f"--resume {resume}: no such checkpoint or folder")
    return checkpoint.resolve(resume)


def _agree(value, group):
    """Rank 0's ``value`` (an object, or the exception it raised) on every rank."""
    import torch.distributed as tdist

    box = [value]
    tdist.broadcast_object_list(box, src=0, group=group)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def steps_for(cfg: DsAsyncConfig, tokens_per_step: int) -> int:
    if cfg.train.steps is not None:
        return cfg.train.steps
    return math.ceil(cfg.train.tokens / tokens_per_step)


def train(config_path: str, max_steps: int | None = None, run_name: str | None = None,
          resume: str | None = None) -> dict | None:
    """Run the job described by the DeepSpeed JSON at ``config_path``; returns the summary on the reporting rank.

    ``resume``: ``"latest"`` continues from the newest complete checkpoint in the run's checkpoint folder (or
    starts afresh if there is none); a path names a checkpoint or a folder of them.
    """
    import torch.distributed as tdist
    from deepspeed import comm as dist

    from . import checkpoint, data, metrics
    from .initialize import init_distributed, initialize
    from .models import build_pipeline, model_config
    from .nonfinite import LossMonitor, NonFiniteLoss, SkipNonFinite, check_skip_supported

    ds_config, cfg = cfgmod.load(config_path)
    if run_name is not None:
        cfg = replace(cfg, logging=replace(cfg.logging, run_name=run_name))
    init_distributed()
    _, mbs, gas = cfgmod.check_batch(ds_config, cfg, dist.get_world_size())
    seed_everything(cfg.seed)
    group = tdist.new_group(backend="gloo")  # host-side agreement: checkpoint files, loss flags

    name = _agree(cfg.logging.run_name or f"{cfg.schedule}-{ds_config.get('optimizer', {}).get('type', 'none')}-"
                                          f"{time.strftime('%Y%m%d-%H%M%S')}", group)
    run_dir = Path(cfg.logging.dir) / name
    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    resume_from = None
    if resume is not None:
        try:
            found = _resume_from(resume, cfg, ckpt_root) if dist.get_rank() == 0 else None
        except (ConfigError, checkpoint.CheckpointError) as e:
            found = e
        resume_from = _agree(found, group)
        if resume_from is None and dist.get_rank() == 0:
            print(f"ds_async: no complete checkpoint in {ckpt_root}; starting from step 0", flush=True)
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    if resume_from is not None and cfg.tokenizer.startswith("train:"):
        tok = data.load_tokenizer(str(resume_from / "tokenizer.json"))  # the one the saved run trained
    else:
        tok = resolve_tokenizer(cfg, run_dir, dist)
    hf_config = model_config(cfg)
    check_vocab(tok, hf_config, cfg.tokenizer)
    module = build_pipeline(cfg, hf_config)
    engine = initialize(module, ds_config, schedule=cfg.schedule, p2p=cfg.p2p, correction=cfg.correction,
                        fused_optimizer_step=cfg.performance.fused_optimizer_step)
    engine.stats_every = cfg.logging.optimizer_every
    monitor = None
    if cfg.train.on_nonfinite == "skip":
        check_skip_supported(engine.optimizer)
        engine.optimizer = SkipNonFinite(engine.optimizer, group)
    else:
        monitor = LossMonitor(group, lag=engine.is_async)

    dp_rank, dp_world = engine.grid.data_parallel_id, engine.grid.data_parallel_size
    seq_len = cfg.data.seq_len
    tokens_per_step = engine.train_batch_size() * seq_len
    total_steps = steps_for(cfg, tokens_per_step)
    if max_steps is not None:
        total_steps = min(total_steps, max_steps)

    def stream(split: str, source: str, train: bool):
        return data.PackedBatches(data.load_text_stream(source, split, cfg.data.text_field), tok, seq_len, mbs,
                                  dp_rank=dp_rank, dp_world_size=dp_world, seed=cfg.seed,
                                  shuffle_buffer=cfg.data.shuffle_buffer if train else 0, repeat=train,
                                  text_field=cfg.data.text_field, min_chars=cfg.data.min_chars, source=source)

    needs_data = engine.is_first_stage() or engine.is_last_stage()
    train_iter = stream("train", cfg.data.train, True) if needs_data else None
    fingerprint = tokenizer_fingerprint(tok)
    start = 0
    if resume_from is not None:
        restored = checkpoint.load(engine, resume_from, group=group, check={"tokenizer": fingerprint})
        if train_iter is not None:
            train_iter.load_state_dict(restored["data"])
        start = engine.global_steps
        if dist.get_rank() == 0:
            print(f"ds_async: resumed from {resume_from} (step {start})", flush=True)
            saved = restored["manifest"].get("ds_async", {})
            now = cfgmod.resolved(cfg)
            changed = [f"data.{k}" for k in ("train", "text_field", "seq_len", "shuffle_buffer", "min_chars")
                       if saved.get("data", {}).get(k) != now["data"][k]] + \
                      (["seed"] if saved.get("seed") != now["seed"] else [])
            if changed:
                print(f"ds_async: warning: changed since the checkpoint: {', '.join(changed)}; the saved position "
                      "in the training stream refers to the old data, so the run does not continue as it would have",
                      flush=True)
    last_saved = start if resume_from is not None else None

    def save(step: int) -> None:
        nonlocal last_saved
        stop_if_nonfinite(upto=step)
        checkpoint.save(engine, ckpt_root, hf_config=hf_config, tokenizer=tok, keep=cfg.checkpoint.keep,
                        data_state=train_iter.state_dict() if train_iter is not None else None, group=group,
                        meta={"tokenizer": fingerprint, "ds_async": cfgmod.resolved(cfg)})
        last_saved = step

    def stop_if_nonfinite(upto: int | None = None) -> None:
        bad = monitor.check(upto) if monitor is not None else None
        if bad is not None:
            step, kind = bad
            kept = f"the newest checkpoint is {checkpoint.step_dir(ckpt_root, last_saved)}" \
                if last_saved is not None else "no checkpoint was saved"
            raise NonFiniteLoss(f"step {step}: the training loss is {kind}; training stopped there "
                                f"(ds_async.train.on_nonfinite = 'stop') and saved nothing after it: {kept}")

    def validate() -> float:
        batches = cfg.eval.batches
        it = stream("validation", cfg.data.validation, False) if needs_data else None
        return engine.eval_batch(it, num_micro_batches=batches).item()

    log = metrics.RunLogger(run_dir, total_steps, tokens_per_step, enabled=engine.is_reporting_rank,
                            progress=cfg.logging.progress, every=cfg.logging.every, start_step=start)
    log.manifest(config_file=str(config_path), ds_async=cfgmod.resolved(cfg), deepspeed=ds_config,
                 world_size=dist.get_world_size(), pipeline_stages=cfg.pipeline_stages, data_parallel=dp_world,
                 micro_batch_size=mbs, micro_batches=gas, tokens_per_step=tokens_per_step, total_steps=total_steps,
                 model=hf_config.to_dict(), resumed_from=str(resume_from) if resume_from else None)

    evaluating = bool(cfg.data.validation and cfg.eval.every)
    every = cfg.checkpoint.every
    # (step, loss on its way to the host, lr). Under flush-free schedules a step's loss is read after the next
    # step is queued (a drain reads at once), so the last stage's host never waits for its GPU to empty.
    in_flight: list[tuple[int, metrics.HostValue | None, float]] = []

    def report(upto: int) -> None:
        while in_flight and in_flight[0][0] <= upto:
            s, value, lr = in_flight.pop(0)
            loss = None if value is None else float(value)
            if monitor is not None:
                monitor.submit(s, loss)
            log.train_step(s, float("nan") if loss is None else loss, lr)

    for step in range(start + 1, total_steps + 1):
        # Flush-free schedules drain only where the pipeline must be empty: before an evaluation, a checkpoint
        # and at the end.
        next_drain = min([total_steps] + [-(-step // k) * k for k in (cfg.eval.every if evaluating else 0, every)
                                           if k])
        engine.drain_after(next_drain - 1)
        loss = engine.train_batch(train_iter)  # None off the last stage under async schedules
        in_flight.append((step, None if loss is None else metrics.HostValue(loss), engine.get_lr()[0]))
        drained = next_drain == step or not engine.is_async
        report(step if drained else step - 1)
        if monitor is not None:
            stop_if_nonfinite(upto=step if drained else None)
        if cfg.logging.optimizer_every and step % cfg.logging.optimizer_every == 0:
            log.scalars(step, {f"optimizer/{k}": v for k, v in engine.optimizer_stats().items()})
        if evaluating and step % cfg.eval.every == 0 and step != total_steps:
            log.validation(step, validate())
        if every and step % every == 0 and step != total_steps:
            save(step)
    stop_if_nonfinite(upto=total_steps)
    if cfg.data.validation:
        log.validation(total_steps, validate())
    if (cfg.checkpoint.final or (every and total_steps % every == 0)) and last_saved != total_steps:
        save(total_steps)
    # Documents skipped by the training stream, over the replicas (the last stage's copies of the stream).
    counts = [None] * dist.get_world_size()
    tdist.all_gather_object(counts, train_iter.skipped if train_iter is not None and engine.is_last_stage()
                            else None, group=group)
    skipped_docs = {k: sum(c[k] for c in counts if c) for k in data.SKIP_REASONS}
    summary = log.close(total_steps, plot=cfg.logging.plot,
                        extra={"skipped_docs": skipped_docs, "skipped_steps": int(engine.skipped_steps),
                               "checkpoint": str(checkpoint.step_dir(ckpt_root, last_saved))
                               if last_saved is not None else None,
                               "resumed_from": str(resume_from) if resume_from else None})
    return summary if engine.is_reporting_rank else None
