"""What the two training jobs (``ds_async.trainer`` on the pipeline engine, ``ds_async.emulate`` in one process)
derive alike from a config: its seeds, its run length, its run folder's default name, the optimizer type its
checkpoints record, and the run folder's logger with its manifest. Both import it; neither imports the other.
"""
from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from . import metrics
from .config import DsAsyncConfig, resolved
from .flops import model_flops_per_token
from .models import hf_io


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def use_deterministic(on: bool) -> None:
    """``performance.deterministic``: torch's deterministic algorithms, cuBLAS's fixed workspace (read when cuBLAS
    starts, so before the model's first product) and no cuDNN autotuning. Off: left as torch has them."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def optimizer_type(ds_config: dict) -> str | None:
    """The DeepSpeed ``optimizer.type`` of a job (None without an optimizer block), as checkpoints record it."""
    return (ds_config.get("optimizer") or {}).get("type")


def default_run_name(cfg: DsAsyncConfig, ds_config: dict) -> str:
    """The run folder's name without ``logging.run_name``: schedule, optimizer type and the start time."""
    return f"{cfg.schedule}-{optimizer_type(ds_config) or 'none'}-{time.strftime('%Y%m%d-%H%M%S')}"


def steps_for(cfg: DsAsyncConfig, tokens_per_step: int) -> int:
    if cfg.train.steps is not None:
        return cfg.train.steps
    return math.ceil(cfg.train.tokens / tokens_per_step)


def start_run_log(run_dir: Path, cfg: DsAsyncConfig, config_path, overrides: dict, ds_config: dict, hf_config, *,
                  start_step: int, total_steps: int, tokens_per_step: int, micro_batch_size: int, micro_batches: int,
                  data_parallel: int, peak_flops: float | None, carried: dict | None, resumed_from,
                  enabled: bool = True, monitor=None, **manifest_extra) -> metrics.RunLogger:
    """The run folder's logger (:class:`~ds_async.metrics.RunLogger`) and its ``manifest.json``, as both jobs write
    them. ``carried``: the logger state a resumed run saved (training clock, curves so far; ``None`` for a new
    run); ``peak_flops``: of all the job's devices together; ``manifest_extra``: what one job's manifest adds."""
    carried = carried or {}
    log = metrics.RunLogger(run_dir, total_steps, tokens_per_step, enabled=enabled, progress=cfg.logging.progress,
                            every=cfg.logging.every, start_step=start_step, window=cfg.logging.window,
                            warmup=cfg.logging.warmup_steps,
                            flops_per_step=model_flops_per_token(hf_config, cfg.data.seq_len) * tokens_per_step,
                            peak_flops=peak_flops, monitor=monitor,
                            seconds_before=float(carried.get("seconds", 0.0)))
    log.history.update(carried.get("history", {}))  # keys a saved state lacks start empty
    log.manifest(config_file=str(config_path), overrides=overrides, ds_async=resolved(cfg), deepspeed=ds_config,
                 world_size=cfg.pipeline_stages * data_parallel, pipeline_stages=cfg.pipeline_stages,
                 data_parallel=data_parallel, micro_batch_size=micro_batch_size, micro_batches=micro_batches,
                 tokens_per_step=tokens_per_step, total_steps=total_steps, model=hf_io.config_dict(hf_config),
                 resumed_from=None if resumed_from is None else str(resumed_from), **manifest_extra)
    return log
