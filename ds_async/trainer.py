"""The training job: config -> tokenizer -> pipeline model -> engine -> train/eval loop -> logs.

``launch/train.py`` is a thin command-line wrapper around :func:`train`.
"""
from __future__ import annotations

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
            tokenizer.train_bpe((row[cfg.data.text_field] for row in stream), vocab, str(path))
        dist.barrier()
        spec = str(path)
    return data.load_tokenizer(spec)


def steps_for(cfg: DsAsyncConfig, tokens_per_step: int) -> int:
    if cfg.train.steps is not None:
        return cfg.train.steps
    return math.ceil(cfg.train.tokens / tokens_per_step)


def train(config_path: str, max_steps: int | None = None, run_name: str | None = None) -> dict | None:
    """Run the job described by the DeepSpeed JSON at ``config_path``; returns the summary on the reporting rank."""
    from deepspeed import comm as dist

    from . import data, metrics
    from .initialize import init_distributed, initialize
    from .models import build_pipeline, model_config

    ds_config, cfg = cfgmod.load(config_path)
    if run_name is not None:
        cfg = replace(cfg, logging=replace(cfg.logging, run_name=run_name))
    init_distributed()
    _, mbs, gas = cfgmod.check_batch(ds_config, cfg, dist.get_world_size())
    seed_everything(cfg.seed)

    name = cfg.logging.run_name or f"{cfg.schedule}-{ds_config.get('optimizer', {}).get('type', 'none')}-" \
                                   f"{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.logging.dir) / name
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    tok = resolve_tokenizer(cfg, run_dir, dist)
    hf_config = model_config(cfg)
    if len(tok) > hf_config.vocab_size:
        raise ConfigError(f"ds_async.model: vocab_size {hf_config.vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({len(tok)} tokens from {cfg.tokenizer})")
    module = build_pipeline(cfg, hf_config)
    engine = initialize(module, ds_config, schedule=cfg.schedule, p2p=cfg.p2p, correction=cfg.correction)
    engine.stats_every = cfg.logging.every

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
                                  text_field=cfg.data.text_field)

    needs_data = engine.is_first_stage() or engine.is_last_stage()
    train_iter = stream("train", cfg.data.train, True) if needs_data else None

    def validate() -> float:
        batches = cfg.eval.batches
        it = stream("validation", cfg.data.validation, False) if needs_data else None
        return engine.eval_batch(it, num_micro_batches=batches).item()

    log = metrics.RunLogger(run_dir, total_steps, tokens_per_step, enabled=engine.is_reporting_rank,
                            progress=cfg.logging.progress, every=cfg.logging.every)
    log.manifest(config_file=str(config_path), ds_async=cfgmod.resolved(cfg), deepspeed=ds_config,
                 world_size=dist.get_world_size(), pipeline_stages=cfg.pipeline_stages, data_parallel=dp_world,
                 micro_batch_size=mbs, micro_batches=gas, tokens_per_step=tokens_per_step, total_steps=total_steps,
                 model=hf_config.to_dict())

    evaluating = bool(cfg.data.validation and cfg.eval.every)
    for step in range(1, total_steps + 1):
        # Flush-free schedules drain only where the pipeline must be empty: before an evaluation and at the end.
        next_drain = min(total_steps, -(-step // cfg.eval.every) * cfg.eval.every) if evaluating else total_steps
        engine.drain_after(next_drain - 1)
        loss = engine.train_batch(train_iter)  # None off the last stage under async schedules
        log.train_step(step, float("nan") if loss is None else loss.item(), engine.get_lr()[0])
        if step % cfg.logging.every == 0:
            log.scalars(step, {f"optimizer/{k}": v for k, v in engine.optimizer_stats().items()})
        if evaluating and step % cfg.eval.every == 0 and step != total_steps:
            log.validation(step, validate())
    if cfg.data.validation:
        log.validation(total_steps, validate())
    summary = log.close(total_steps, plot=cfg.logging.plot)
    return summary if engine.is_reporting_rank else None
