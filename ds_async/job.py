"""What the two training jobs (``ds_async.trainer`` on the pipeline engine, ``ds_async.emulate`` in one process)
derive alike from a config: its seeds, its run length, its run folder's default name, the optimizer type its
checkpoints record. Both import it; neither imports the other.
"""
from __future__ import annotations

import math
import os
import random
import time

import numpy as np
import torch

from .config import DsAsyncConfig


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
