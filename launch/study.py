"""The loss-curve study (issue 6): synchronous vs asynchronous vs asynchronous + delay correction, per optimizer.

Each run trains a LLaMA through the single-process delay emulation (``ds_async.emulate.DelayedTrainer``) on one
device (CUDA if present, else CPU): ``--schedule 1f1b`` is synchronous, ``2bw`` PipeDream-2BW's constant one-step
delay, ``pipedream`` the original PipeDream's per-stage delay ``p - 1 - s`` (with one micro-batch per step). Data:
the enwiki shards of the shared corpus, packed by ``ds_async.data.PackedBatches``; validation on a fixed set of
held-out batches. A run folder holds tensorboard events, ``manifest.json`` (card, commit, resolved run config,
seed) and ``summary.json``, nothing else.

    # one run
    python launch/study.py --optimizer adamw --schedule 2bw --correction ef --seed 0 --out runs/study/one
    # a named matrix (tiny: CPU/CI; main: the table; extras: the sweeps), optionally one share of it per GPU
    python launch/study.py --matrix main --out launch/results/study [--gpu-index 0 --of 2]
    python launch/study.py --matrix main --list          # what would run, with estimated GPU seconds
    # the whole study on this host's GPUs: bash launch/study.sh [OUT] [NUM_GPUS]

A run with the same seed gets the same initial weights and the same batches whatever its optimizer, schedule or
correction, so the differences between variants are paired. Token streams are cached (``--token-cache``,
default ``.data/study_tokens``) so that all runs of a seed tokenize once; ``--prepare-data`` fills the cache for a
matrix without training (the cache is all a GPU machine needs: the corpus can stay behind).

The real engine (``--engine deepspeed``): the same run through ``ds_async.initialize`` -> ``AsyncPipelineEngine``,
one process per pipeline stage (one pipeline, no data parallelism), with the emulation's initial weights, batches,
LR schedule, clipping, optimizer block and correction; bf16 is DeepSpeed's ``torch_autocast`` over fp32 weights at
ZeRO-0 (the emulation autocasts each layer), fp32 on CPU, where the two are equal (``tests/test_study.py``). The
2BW engine needs ``m >= p`` micro-batches and validates on micro-batches of the training shape, so an engine spec
has ``eval_batch_size = micro_batch_size``. Only the reporting rank (last stage) writes the run folder, in the same
format (the manifest adds ``engine``, ``world_size`` and the DeepSpeed config).

    # one engine run on 2 processes (GPUs if present, gloo on CPU), and its emulation twin
    torchrun --nproc_per_node 2 launch/study.py --engine deepspeed --optimizer muon --schedule 2bw \
        --correction ef --batch 2x24 --eval-batches 21 --eval-batch-size 24 --out runs/study/engine
    python launch/study.py --optimizer muon --schedule 2bw --correction ef --batch 2x24 --eval-batches 21 \
        --eval-batch-size 24 --out runs/study/emulation
    # the engine matrix (group ``engine``: pairs <opt>-<variant>-s<seed>-{deepspeed,emulation}): under torchrun a
    # matrix runs its engine runs (one after the other, over all ranks), in one process its emulation runs
    CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2 --master_port 29610 launch/study.py --matrix engine \
        --gpu-index 0 --of 2 --out launch/results/study        # and GPUs 2,3 with --gpu-index 1, port 29611
    python launch/study.py --matrix engine --engine emulation --gpu-index 0 --of 4 --out launch/results/study
    # all of it on this host's GPUs: bash launch/study_engine.sh [OUT] [NUM_GPUS]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout where ds_async is not installed (a copied tree)
    sys.path.insert(1, str(ROOT))
DEFAULT_CORPUS = ROOT.parent / "shared" / "corpus"
DEFAULT_CACHE = ROOT / ".data" / "study_tokens"

# LLaMA shapes; vocab 8192 matches the corpus' bpe8192 tokenizer. Parameter counts include embedding and LM head.
MODELS = {
    # ~0.55M parameters (mostly the 8k-vocab embedding and head): the CPU/CI matrix
    "tiny": dict(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    # 20.5M parameters (14.2M in the 8 decoder layers)
    "20m": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                num_key_value_heads=6),
    # ~0.6M parameters, 6 decoder layers: 8 pipeline layers, one per stage at depth 8 (the CPU depth-8 pair)
    "tiny6": dict(hidden_size=32, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2),
    # 46.9M parameters (38.5M in the 12 decoder layers)
    "50m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=12, num_attention_heads=8,
                num_key_value_heads=8),
}
VOCAB = {"bpe8192.json": 8192, "bpe16384.json": 16384, "bpe32768.json": 32768}

# Peak learning rates and weight decay of each optimizer (``lr`` is Muon's rate for hidden matrices, ``adam_lr``
# the AdamW rate of its embedding, head and norm groups). Chosen for the synchronous runs and reused unchanged for
# the asynchronous ones; the ``extras`` LR sweep checks them (see the notebook).
OPTIMIZERS = {
    "adamw": dict(lr=3e-3, weight_decay=0.1),
    "muon": dict(lr=0.02, adam_lr=3e-3, weight_decay=0.1),
    "lion": dict(lr=3e-4, weight_decay=1.0),
    "sgd": dict(lr=0.1, weight_decay=0.0),
}

# How a run trains: the single-process delay emulation, or the real pipeline engine on `stages` processes.
ENGINES = ("emulation", "deepspeed")


@dataclass
class RunSpec:
    """One run. ``None`` fields are filled in by :meth:`resolved` (optimizer defaults, steps from tokens, ...).

    ``engine``: ``emulation`` (``ds_async.emulate.DelayedTrainer``, one process) or ``deepspeed`` (the real
    ``AsyncPipelineEngine`` through ``ds_async.initialize``, one process per stage); everything else means the same
    for both, so a spec and its copy with the other engine are the same run through two implementations.
    """

    name: str = "run"
    group: str = "single"
    optimizer: str = "adamw"
    schedule: str = "1f1b"
    stages: int = 2
    correction: str = "none"
    ef_lambda: float = 1.0
    nesterov_momentum: float = 0.9
    correction_delay: int = 1
    lr: float | None = None
    adam_lr: float | None = None
    lr_scale: float = 1.0
    weight_decay: float | None = None
    model: str = "20m"
    seq_len: int = 256
    micro_batches: int = 1
    micro_batch_size: int = 32
    steps: int | None = None
    tokens: int | None = None
    warmup: float = 0.1
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    eval_every: int | None = None
    eval_batches: int = 16
    eval_batch_size: int = 32
    seed: int = 0
    tokenizer: str = "bpe8192.json"
    train_files: str = "enwiki-train-*.parquet"
    validation_file: str = "enwiki-validation.parquet"
    shuffle_buffer: int = 1000
    precision: str = "auto"
    engine: str = "emulation"

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.seq_len

    @property
    def variant(self) -> str:
        """``sync``, ``2bw``, ``2bw+ef``, ``pipedream``, ... (the schedule, plus the correction if any)."""
        base = "sync" if self.schedule == "1f1b" else self.schedule
        return base if self.correction == "none" else f"{base}+{self.correction}"

    def resolved(self) -> RunSpec:
        defaults = OPTIMIZERS[self.optimizer]
        spec = dataclasses.replace(self)
        if spec.lr is None:
            spec.lr = defaults["lr"] * spec.lr_scale
        if spec.adam_lr is None and "adam_lr" in defaults:
            spec.adam_lr = defaults["adam_lr"] * spec.lr_scale
        if spec.weight_decay is None:
            spec.weight_decay = defaults["weight_decay"]
        if spec.steps is None:
            if spec.tokens is None:
                raise ValueError(f"{spec.name}: give steps or tokens")
            spec.steps = max(1, math.ceil(spec.tokens / spec.tokens_per_step))
        spec.tokens = spec.steps * spec.tokens_per_step
        if spec.eval_every is None:
            spec.eval_every = max(1, spec.steps // 10)
        return spec


def model_section(spec: RunSpec) -> dict:
    return {"family": "llama", "config": {**MODELS[spec.model], "vocab_size": VOCAB[spec.tokenizer],
                                          "max_position_embeddings": max(spec.seq_len, 64), "rms_norm_eps": 1e-5}}


def optimizer_block(spec: RunSpec) -> dict:
    """The DeepSpeed-style ``optimizer`` block ``ds_async.optim.build_optimizer`` takes."""
    if spec.optimizer == "adamw":
        return {"type": "AdamW", "params": {"lr": spec.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                            "weight_decay": spec.weight_decay, "torch_adam": True}}
    if spec.optimizer == "muon":
        # Muon on hidden matrices (no decay there: its lr x wd would be 7x AdamW's), AdamW on the rest.
        return {"type": "Muon", "params": {"lr": spec.lr, "momentum": 0.95, "nesterov": True, "weight_decay": 0.0,
                                           "adam_lr": spec.adam_lr, "adam_betas": [0.9, 0.95],
                                           "adam_weight_decay": spec.weight_decay}}
    if spec.optimizer == "lion":
        return {"type": "Lion", "params": {"lr": spec.lr, "betas": [0.9, 0.99], "weight_decay": spec.weight_decay}}
    if spec.optimizer == "sgd":
        return {"type": "SGD", "params": {"lr": spec.lr, "momentum": 0.9, "weight_decay": spec.weight_decay,
                                          **({"decoupled_weight_decay": True} if spec.weight_decay else {})}}
    raise ValueError(f"unknown optimizer {spec.optimizer!r}")


def correction_block(spec: RunSpec) -> dict | None:
    if spec.correction == "none":
        return None
    if spec.correction == "ef":
        return {"type": "ef", "lambda": spec.ef_lambda}
    if spec.correction == "nesterov":
        return {"type": "nesterov", "momentum": spec.nesterov_momentum, "delay": spec.correction_delay}
    raise ValueError(f"unknown correction {spec.correction!r}")


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then cosine decay to ``min_ratio`` at step ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def model_flops_per_token(spec: RunSpec, n_params: int, n_embedding: int) -> float:
    """Training FLOPs per token: 6 N (embedding lookup excluded) + 12 L h s for attention."""
    m = MODELS[spec.model]
    return 6 * (n_params - n_embedding) + 12 * m["num_hidden_layers"] * m["hidden_size"] * spec.seq_len


def estimated_flops(spec: RunSpec) -> float:
    """FLOPs of a run's training steps from its shapes alone."""
    m, v = MODELS[spec.model], VOCAB[spec.tokenizer]
    h, f, L = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    kv = h // m["num_attention_heads"] * m["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    non_embedding = L * per_layer + h * v + h
    r = spec.resolved()
    return r.tokens * (6 * non_embedding + 12 * L * h * r.seq_len)


# Planning assumptions for one GPU (H100/H200), eager PyTorch: model FLOPs at 60 TFLOP/s (15% of ~400 dense bf16),
# and at least a per-step host overhead: a step of the emulation dispatches ~2,100 (AdamW) to ~3,800 (Muon + EF)
# ops for the 8-layer model (counted with the CPU profiler), each ~8 us of host time, so a small model's step is
# launch-bound at ~3 ms per decoder layer plus ~3 ms, whatever the batch.
PLAN_FLOPS_PER_S = 60e12
PLAN_HOST_S_PER_LAYER = 3e-3
PLAN_START_S = 2.0


# An engine run (one process per stage) is planned as each stage doing its share of the layers' work, plus DeepSpeed's
# per-micro-batch instruction and p2p overhead and a longer start (engine build, process groups).
PLAN_ENGINE_S_PER_MICRO_BATCH = 5e-3
PLAN_ENGINE_START_S = 30.0


def estimated_seconds(spec: RunSpec) -> float:
    """Planned seconds of a run (see the assumptions above): steps, validations and start-up; GPU seconds for an
    emulation run, wall seconds on ``stages`` GPUs for an engine run."""
    r = spec.resolved()
    layers = MODELS[r.model]["num_hidden_layers"]
    if r.engine == "deepspeed":
        host = PLAN_HOST_S_PER_LAYER * (layers / r.stages + 1) + PLAN_ENGINE_S_PER_MICRO_BATCH * r.micro_batches
        step = max(estimated_flops(r) / r.steps / r.stages / PLAN_FLOPS_PER_S, host)
        evals = r.steps // r.eval_every + 1
        return r.steps * step + evals * r.eval_batches * (host / 3 + PLAN_ENGINE_S_PER_MICRO_BATCH) \
            + PLAN_ENGINE_START_S
    host = PLAN_HOST_S_PER_LAYER * (layers + 1)
    step = max(estimated_flops(r) / r.steps / PLAN_FLOPS_PER_S, host)
    evals = r.steps // r.eval_every + 1
    eval_flops = r.eval_batches * r.eval_batch_size * r.seq_len * estimated_flops(r) / r.tokens / 3
    return r.steps * step + evals * max(eval_flops / PLAN_FLOPS_PER_S, r.eval_batches * host / 3) + PLAN_START_S


# ---------------------------------------------------------------------------------------------------------------
# Data: a seed's whole token stream, tokenized once and cached


def _cache_key(spec: RunSpec, split: str) -> str:
    what = {"files": spec.train_files if split == "train" else spec.validation_file, "split": split,
            "tokenizer": spec.tokenizer, "seed": spec.seed if split == "train" else None,
            "shuffle_buffer": spec.shuffle_buffer if split == "train" else 0, "packing": "PackedBatches/v1"}
    return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16], what


def token_stream(spec: RunSpec, split: str, n_tokens: int, data_dir: Path | None, cache_dir: Path,
                 memo: dict | None = None):
    """The first ``n_tokens`` tokens of the stream ``PackedBatches`` cuts into rows for ``split``: documents of the
    train shards shuffled by the run's seed (``shuffle_buffer`` documents), or the validation file in order, each
    followed by EOS. Cutting it into rows of ``seq_len`` gives exactly ``PackedBatches(seq_len, mbs)``'s batches.

    Returns ``(uint16/int32 numpy array, info dict)``; read from ``cache_dir`` when a long enough prefix is there.
    """
    import numpy as np

    key, what = _cache_key(spec, split)
    memo = {} if memo is None else memo
    if key in memo and len(memo[key]) >= n_tokens:
        return memo[key][:n_tokens], {"cache_key": key, **what}
    path = cache_dir / f"{key}.npy"
    if path.exists():
        arr = np.load(path, mmap_mode="r")
        if len(arr) >= n_tokens:
            memo[key] = np.asarray(arr)
            return memo[key][:n_tokens], {"cache_key": key, **what}
    if data_dir is None or not (Path(data_dir) / "tokenizers" / spec.tokenizer).exists():
        raise FileNotFoundError(f"no token cache {path} with {n_tokens} tokens and no corpus at {data_dir} "
                                "(give --data-dir, or run --prepare-data where the corpus is)")
    from ds_async.data import PackedBatches, load_text_stream, load_tokenizer

    t0 = time.perf_counter()
    import datasets.config

    tokenizer = load_tokenizer(str(Path(data_dir) / "tokenizers" / spec.tokenizer))
    files = str(Path(data_dir) / what["files"])
    dataset = load_text_stream(files, split)
    chunk = 4096
    # Closing a stream over several parquet shards sleeps 5 s so that arrow's reader threads end before the
    # interpreter does (apache/arrow#45214); this process goes on to train for much longer than that.
    sleep, datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN, 0
    rows = PackedBatches(dataset, tokenizer, seq_len=chunk, micro_batch_size=1, seed=spec.seed,
                         shuffle_buffer=what["shuffle_buffer"], repeat=split == "train",
                         tokenize_batch=8 if n_tokens < 500_000 else 64)  # the stream is the same either way
    parts, have, last = [], 0, None
    for inputs, labels in rows:
        parts.append(inputs.view(-1).numpy())
        last = int(labels[0, -1])
        have += chunk
        if have >= n_tokens:
            break
    del rows, dataset  # closes the stream now, without the sleep
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = sleep
    if have < n_tokens - 1 or last is None:
        raise ValueError(f"{files}: only {have} tokens, {n_tokens} needed")
    dtype = np.uint16 if len(tokenizer) <= 65536 else np.int32
    arr = np.concatenate(parts + [np.array([last])]).astype(dtype)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)
    (cache_dir / f"{key}.json").write_text(json.dumps({**what, "tokens": len(arr)}, indent=1))
    print(f"[data] {split} seed={what['seed']}: {len(arr):,} tokens in {time.perf_counter() - t0:.1f}s -> {path}",
          flush=True)
    memo[key] = arr
    return arr[:n_tokens], {"cache_key": key, **what}


class Batches:
    """Micro-batch ``j`` = rows ``j*B .. j*B+B-1`` of the stream cut into rows of ``seq_len`` (on ``device``)."""

    def __init__(self, stream, seq_len: int, batch_size: int, device):
        import torch

        self.t, self.b = seq_len, batch_size
        self.data = torch.from_numpy(stream.astype("int64")).to(device)

    def __len__(self):
        return (len(self.data) - 1) // (self.t * self.b)

    def __getitem__(self, j: int):
        n = self.t * self.b
        if not 0 <= j < len(self):
            raise IndexError(j)
        span = self.data[j * n: j * n + n + 1]
        return span[:-1].view(self.b, self.t), span[1:].view(self.b, self.t)


# ---------------------------------------------------------------------------------------------------------------
# One run


def card_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def pick_device(arg: str, gpu_index: int = 0):
    import torch

    if arg == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", gpu_index if gpu_index < torch.cuda.device_count() else 0)
    return torch.device(arg)


def _autocast_layers(layers, device, dtype):
    """Each layer's forward under autocast (the backward and the optimizer step stay outside it)."""
    import torch
    from torch import nn

    class Autocast(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with torch.autocast(device.type, dtype=dtype):
                return self.inner(x)

    return [Autocast(layer) for layer in layers]


def check_engine(spec: RunSpec) -> None:
    """Refuse, before anything starts, what the real engine cannot run as the emulation does."""
    if spec.engine not in ENGINES:
        raise ValueError(f"{spec.name}: engine must be one of {ENGINES}, got {spec.engine!r}")
    if spec.engine != "deepspeed":
        return
    if spec.schedule == "2bw" and spec.micro_batches < spec.stages:
        raise ValueError(f"{spec.name}: the 2BW engine needs at least as many micro-batches as stages "
                         f"(m={spec.micro_batches} < p={spec.stages}); e.g. --batch {spec.stages}x"
                         f"{max(1, spec.micro_batch_size // spec.stages)}")
    if spec.eval_batch_size != spec.micro_batch_size:
        raise ValueError(f"{spec.name}: the pipeline sizes its activation buffers by the training micro-batch, so "
                         f"an engine run validates on micro-batches of the same shape: set eval_batch_size = "
                         f"micro_batch_size ({spec.micro_batch_size}), got {spec.eval_batch_size}")


def _precision(spec: RunSpec, device) -> str:
    return spec.precision if spec.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")


def _warmup_steps(spec: RunSpec) -> int:
    return int(spec.warmup if spec.warmup >= 1 else max(1, round(spec.warmup * spec.steps)))


def _lr_scheduler(optimizer, spec: RunSpec):
    """The run's LR schedule on ``optimizer`` (stepped once after each optimizer step, by either engine)."""
    import torch

    warmup = _warmup_steps(spec)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, spec.steps, warmup, spec.min_lr_ratio))


def _data(spec: RunSpec, data_dir: Path | None, cache_dir: Path, memo: dict | None, device):
    """``(train batches, validation batches, manifest data section)``. Training micro-batch ``j`` is rows
    ``j*B .. j*B+B-1`` of the seed's stream; validation batch ``k`` rows ``k*E .. k*E+E-1`` of the held-out stream
    (``E = eval_batch_size``, ``eval_batches`` of them): the same rows for a run and its engine twin."""
    train_stream, train_info = token_stream(spec, "train", spec.tokens + 1, data_dir, cache_dir, memo)
    val_tokens = spec.eval_batches * spec.eval_batch_size * spec.seq_len + 1
    val_stream, val_info = token_stream(spec, "validation", val_tokens, data_dir, cache_dir, memo)
    info = {"train": {**train_info, "tokens": spec.tokens + 1}, "validation": {**val_info, "tokens": val_tokens},
            "data_dir": str(data_dir) if data_dir else None}
    return (Batches(train_stream, spec.seq_len, spec.micro_batch_size, device),
            Batches(val_stream, spec.seq_len, spec.eval_batch_size, device), info)


def _manifest(log, spec: RunSpec, card: str, device, precision: str, section: dict, n_params: int, n_embedding: int,
              data_info: dict, commit: str | None, **extra) -> None:
    import torch

    log.manifest(
        card=card, device=str(device), seed=spec.seed,
        run={**dataclasses.asdict(spec), "variant": spec.variant, "warmup_steps": _warmup_steps(spec),
             "precision": precision},
        model={**section, "parameters": n_params, "embedding_parameters": n_embedding,
               "flops_per_token": model_flops_per_token(spec, n_params, n_embedding)},
        optimizer=optimizer_block(spec), correction=correction_block(spec), data=data_info,
        host={"python": platform.python_version(), "torch_threads": torch.get_num_threads(), "argv": sys.argv},
        provenance={"commit": commit, "source": "--commit / DS_ASYNC_COMMIT"} if commit else {}, **extra)


def _summary(log, out_dir: Path, spec: RunSpec, steps_done: int, diverged: bool, card: str, n_params: int,
             n_embedding: int, train_s: float, t_start: float, **extra) -> dict:
    log.close(steps_done, plot=False)
    summary_path = Path(out_dir) / "summary.json"
    doc = json.loads(summary_path.read_text())
    doc.update(diverged=diverged, card=card, seed=spec.seed, variant=spec.variant, engine=spec.engine,
               parameters=n_params, train_seconds=round(train_s, 3),
               wall_seconds=round(time.perf_counter() - t_start, 3),
               seconds_per_step=round(train_s / max(1, steps_done), 5),
               model_tflops_per_s=round(model_flops_per_token(spec, n_params, n_embedding) * spec.tokens_per_step
                                        * steps_done / max(train_s, 1e-9) / 1e12, 3), **extra)
    summary_path.write_text(json.dumps(doc, indent=1))
    return doc


def _clear(run_dir: Path) -> None:
    """An interrupted run's folder: start it again from scratch."""
    if run_dir.exists():
        for f in run_dir.iterdir():
            f.unlink()


def train_run(spec: RunSpec, out_dir: Path, data_dir: Path | None, cache_dir: Path, device, memo: dict | None = None,
              verbose: bool = True, commit: str | None = None) -> dict:
    """Train one run into ``out_dir`` (tensorboard events, manifest.json, summary.json); returns the summary.

    Through the single-process emulation; a spec with ``engine="deepspeed"`` goes to :func:`train_run_engine`
    (which must run on every rank of a launched process group)."""
    import torch

    from ds_async.emulate import DelayedTrainer, build_layers, uniform_stages
    from ds_async.metrics import RunLogger
    from ds_async.optim import build_optimizer

    spec = spec.resolved()
    check_engine(spec)
    if spec.engine == "deepspeed":
        return train_run_engine(spec, out_dir, data_dir, cache_dir, device, memo, verbose, commit)
    t_start = time.perf_counter()
    torch.manual_seed(spec.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    precision = _precision(spec, device)
    train_batches, val_batches, data_info = _data(spec, data_dir, cache_dir, memo, device)

    section = model_section(spec)
    layers, loss_fn, hf_config = build_layers(section, seed=spec.seed)
    layers.to(device)
    n_params = sum(p.numel() for p in layers.parameters())
    n_embedding = layers[0].embed_tokens.weight.numel()
    stage_of = uniform_stages(len(layers), spec.stages)
    block, corr = optimizer_block(spec), correction_block(spec)
    optimizer = build_optimizer(block, layers if spec.optimizer == "muon" else layers.parameters(), corr)
    scheduler = _lr_scheduler(optimizer, spec)
    run_layers = (_autocast_layers(layers, device, torch.bfloat16) if precision == "bf16" else list(layers))
    trainer = DelayedTrainer(run_layers, stage_of, loss_fn, optimizer, spec.schedule, spec.micro_batches,
                             spec.stages, clip=spec.clip, after_step=scheduler.step)

    @torch.no_grad()
    def validate() -> float:
        total = torch.zeros((), device=device)
        for k in range(spec.eval_batches):
            x, y = val_batches[k]
            for layer in run_layers:
                x = layer(x)
            total += loss_fn(x, y)
        return (total / spec.eval_batches).item()

    card = card_name(device)
    log = RunLogger(out_dir, spec.steps, spec.tokens_per_step, enabled=True, progress=False)
    _manifest(log, spec, card, device, precision, section, n_params, n_embedding, data_info, commit)
    group_names = [g.get("name", f"group{i}") for i, g in enumerate(optimizer.param_groups)]
    diverged = False
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_train = time.perf_counter()
    for step in range(spec.steps):
        lrs = [g["lr"] for g in optimizer.param_groups]
        loss = trainer.train_batch([train_batches[step * spec.micro_batches + i]
                                    for i in range(spec.micro_batches)])
        log.train_step(step + 1, loss, lrs[0])
        log.scalars(step + 1, {f"lr/{name}": lr for name, lr in zip(group_names, lrs)})
        if not math.isfinite(loss):
            diverged = True
            log.validation(step + 1, float("nan"))
            break
        if (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps:
            val = validate()
            log.validation(step + 1, val)
            if verbose:
                print(f"[{spec.name}] step {step + 1}/{spec.steps} train {loss:.4f} val {val:.4f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return _summary(log, out_dir, spec, trainer.step_count, diverged, card, n_params, n_embedding,
                    time.perf_counter() - t_train, t_start)


# ---------------------------------------------------------------------------------------------------------------
# One run through the real engine (ds_async.initialize -> AsyncPipelineEngine), on `stages` processes


def engine_device(arg: str):
    """This rank's device: ``cuda:LOCAL_RANK`` (of the visible GPUs) under ``auto``/``cuda``, else ``arg``."""
    import torch

    local = int(os.environ.get("LOCAL_RANK", 0))
    if arg == "auto":
        return torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if arg == "cuda":
        return torch.device("cuda", local)
    return torch.device(arg)


def engine_ds_config(spec: RunSpec, precision: str) -> dict:
    """The DeepSpeed config of an engine run: the emulation's batch split, clipping and optimizer block, ZeRO-0.

    bf16 is autocast compute over fp32 weights (``torch_autocast``), as the emulation's per-layer autocast: Muon
    needs whole fp32 matrices, which DeepSpeed's bf16 optimizer would hand it as flat partitions."""
    config = {"train_micro_batch_size_per_gpu": spec.micro_batch_size,
              "gradient_accumulation_steps": spec.micro_batches, "steps_per_print": 10 ** 9,
              "wall_clock_breakdown": False, "gradient_clipping": spec.clip, "optimizer": optimizer_block(spec),
              "zero_optimization": {"stage": 0}}
    if precision == "bf16":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif precision != "fp32":
        raise ValueError(f"{spec.name}: precision {precision!r}: the engine runs bf16 (autocast) or fp32")
    return config


def train_run_engine(spec: RunSpec, out_dir: Path, data_dir: Path | None, cache_dir: Path, device,
                     memo: dict | None = None, verbose: bool = True, commit: str | None = None) -> dict | None:
    """Train one run through the real pipeline engine: ``ds_async.initialize`` builds an ``AsyncPipelineEngine``
    over ``spec.stages`` processes (launched by torchrun or the deepspeed launcher; one pipeline, no data
    parallelism) from the same model section, seed, optimizer block, correction, clipping and LR schedule as
    :func:`train_run`, and trains on the same micro-batches in the same order. Flush-free schedules drain only
    before each validation and at the end (``engine.drain_after``), as ``ds_async.trainer`` does.

    Collective: every rank calls it. The reporting rank (last stage: it holds the loss) writes ``out_dir`` in the
    emulation's format (manifest with ``engine``, ``world_size`` and the DeepSpeed config added) and returns the
    summary; the other ranks return ``None``. In fp32 on CPU it reproduces :func:`train_run` of the same spec
    (``tests/test_study.py``).
    """
    import torch
    import torch.distributed as tdist

    from ds_async import config as cfgmod
    from ds_async.initialize import init_distributed, initialize
    from ds_async.metrics import RunLogger
    from ds_async.models import build_pipeline, model_config
    from ds_async.optim import ROLES

    spec = spec.resolved()
    check_engine(spec)
    if spec.engine != "deepspeed":
        raise ValueError(f"{spec.name}: engine {spec.engine!r} is not the deepspeed engine")
    t_start = time.perf_counter()
    if not verbose:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    init_distributed()
    world = tdist.get_world_size()
    if world != spec.stages:
        raise ValueError(f"{spec.name}: an engine run is one pipeline of {spec.stages} stages, launched on "
                         f"{world} processes; launch it with --nproc_per_node {spec.stages}")
    torch.manual_seed(spec.seed)
    precision = _precision(spec, device)
    section = model_section(spec)
    corr = correction_block(spec)
    cfg = cfgmod.parse({"model": section, "pipeline_stages": spec.stages, "schedule": spec.schedule,
                        "partition": {"method": "uniform"}, "train": {"steps": spec.steps}, "seed": spec.seed,
                        "p2p": "deepspeed", "correction": corr or {"type": "none"}})
    ds_config = engine_ds_config(spec, precision)
    engine = initialize(build_pipeline(cfg, model_config(cfg)), ds_config, schedule=spec.schedule, p2p=cfg.p2p,
                        correction=cfg.correction, lr_scheduler=lambda optimizer: _lr_scheduler(optimizer, spec))
    reporting = engine.is_reporting_rank
    needs_data = engine.is_first_stage() or engine.is_last_stage()
    if needs_data:
        train_batches, val_batches, data_info = _data(spec, data_dir, cache_dir, memo, device)

    # Whole-model figures, once: parameter counts and every stage's param groups (name, initial LR) for the logs.
    local_params = sum(p.numel() for p in engine.module.parameters())
    local_embedding = sum(p.numel() for n, p in engine.module.named_parameters() if n.endswith("embed_tokens.weight"))
    groups = [(g.get("name", f"group{i}"), g.get("initial_lr", g["lr"]))
              for i, g in enumerate(engine.optimizer.param_groups)]
    gathered = [None] * world
    tdist.all_gather_object(gathered, (local_params, local_embedding, groups))
    n_params, n_embedding = sum(g[0] for g in gathered), sum(g[1] for g in gathered)
    base_lrs: dict[str, float] = {}
    for _, _, stage_groups in gathered:
        for name, lr in stage_groups:
            base_lrs.setdefault(name, lr)
    base_lrs = dict(sorted(base_lrs.items(), key=lambda kv: ROLES.index(kv[0]) if kv[0] in ROLES else len(ROLES)))
    warmup = _warmup_steps(spec)

    card = f"{world}x {card_name(device)}"
    if reporting:
        _clear(Path(out_dir))
    log = RunLogger(out_dir, spec.steps, spec.tokens_per_step, enabled=reporting, progress=False)
    _manifest(log, spec, card, device, precision, section, n_params, n_embedding, data_info if reporting else {},
              commit, world_size=world, engine={"type": "AsyncPipelineEngine", "schedule": spec.schedule,
                                                "stages": spec.stages, "data_parallel": 1, "p2p": cfg.p2p,
                                                "partition": "uniform"},
              deepspeed=ds_config)

    def validate() -> float:
        it = iter([val_batches[k] for k in range(spec.eval_batches)]) if needs_data else None
        return engine.eval_batch(it, num_micro_batches=spec.eval_batches).item()  # broadcast to every rank

    train_iter = (iter([train_batches[j] for j in range(spec.steps * spec.micro_batches)])
                  if needs_data else None)
    diverged = False
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tdist.barrier()
    t_train = time.perf_counter()
    for step in range(1, spec.steps + 1):
        evaluating = step % spec.eval_every == 0 or step == spec.steps
        # Flush-free schedules drain only where the pipeline must be empty: before a validation and at the end.
        next_drain = min(spec.steps, -(-step // spec.eval_every) * spec.eval_every)
        engine.drain_after(next_drain - 1)
        loss = engine.train_batch(train_iter)  # the batch's mean loss on the last stage (None elsewhere on 2bw)
        if reporting:
            value = loss.item()
            factor = lr_factor(step - 1, spec.steps, warmup, spec.min_lr_ratio)  # what LambdaLR gave this step
            lrs = {name: lr * factor for name, lr in base_lrs.items()}
            log.train_step(step, value, next(iter(lrs.values())))
            log.scalars(step, {f"lr/{name}": lr for name, lr in lrs.items()})
            diverged |= not math.isfinite(value)
        if evaluating:
            val = validate()
            log.validation(step, val)
            if reporting and verbose:
                print(f"[{spec.name}] step {step}/{spec.steps} train {value:.4f} val {val:.4f}", flush=True)
            if not math.isfinite(val):  # every rank has it: all stop here, on a drained pipeline
                diverged = True
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_s = time.perf_counter() - t_train
    steps_done = engine.global_steps
    doc = (_summary(log, out_dir, spec, steps_done, diverged, card, n_params, n_embedding, train_s, t_start,
                    world_size=world) if reporting else None)
    tdist.barrier()
    return doc


# ---------------------------------------------------------------------------------------------------------------
# Matrices

# The main table's configuration (also the reference point every extras sweep varies one axis of).
MAIN = dict(model="20m", seq_len=256, micro_batches=1, micro_batch_size=48, steps=300, eval_every=30,
            eval_batches=8, eval_batch_size=64)
TINY = dict(model="tiny", seq_len=32, micro_batches=1, micro_batch_size=4, steps=30, eval_every=10, eval_batches=2,
            eval_batch_size=4, shuffle_buffer=64)
VARIANTS = {"sync": dict(schedule="1f1b"), "2bw": dict(schedule="2bw"),
            "2bw+ef": dict(schedule="2bw", correction="ef", ef_lambda=1.0)}
# The engine comparison: MAIN's configuration with its 48 sequences per step as 2 micro-batches of 24 (the 2BW engine
# needs m >= p; micro-batch j is rows 24j..24j+23, so a step sees the same 48 rows in the same order), validated on
# 21 micro-batches of 24 (504 held-out sequences; the engine validates on micro-batches of the training shape). Each
# point runs twice, through the real engine on 2 GPUs and through the emulation, everything else equal.
ENGINE_BASE = dict(MAIN, micro_batches=2, micro_batch_size=24, eval_batches=21, eval_batch_size=24, stages=2)
TINY_ENGINE = dict(TINY, micro_batches=2, micro_batch_size=2, eval_batches=4, eval_batch_size=2, stages=2)
ENGINE_POINTS = (("muon", "2bw+ef"), ("adamw", "2bw"), ("adamw", "sync"))
# Depth 8 (the eight-GPU issue's loss-curve pair): Muon sync vs 2BW+EF through an 8-stage engine, m = 8. On 8 GPUs
# with the main configuration (48 rows as 8 micro-batches of 6); on 8 CPU ranks with the 6-layer tiny model.
DEPTH8_POINTS = (("muon", "sync"), ("muon", "2bw+ef"))
DEPTH8_BASE = dict(MAIN, micro_batches=8, micro_batch_size=6, eval_batches=84, eval_batch_size=6, stages=8)
DEPTH8_CPU = dict(TINY, model="tiny6", micro_batches=8, micro_batch_size=1, eval_batches=8, eval_batch_size=1,
                  stages=8, steps=200, eval_every=20)


def _name(**kw) -> str:
    return "-".join(str(v) for v in kw.values())


def _extras(base: dict, optimizers=("adamw", "muon"), token_scales=(0.5, 2.0), lr_scales=(0.5, 2.0),
            batches=(96, 192), batch_optimizers=("adamw",), depths=(2, 4, 8), lambdas=(0.5, 1.5)) -> list[RunSpec]:
    """Sweeps of one axis of ``base`` each, one seed (``base``'s); ``base``'s own point comes from the main matrix."""
    runs, steps = [], base["steps"]
    for opt in optimizers:
        for variant in ("sync", "2bw"):
            kw = dict(optimizer=opt, **VARIANTS[variant])
            for scale in token_scales:  # training length (token budget), same batch
                n = int(steps * scale)
                runs.append(RunSpec(name=f"{opt}-{variant}-tokens{scale:g}x", group="tokens", **kw,
                                    **{**base, "steps": n, "eval_every": max(1, n // 10)}))
            for scale in lr_scales:  # peak learning rate (Muon: both its rates)
                runs.append(RunSpec(name=f"{opt}-{variant}-lr{scale:g}x", group="lr", lr_scale=scale, **kw, **base))
            for b in batches if opt in batch_optimizers else ():  # batch size at the same token budget
                n = steps * base["micro_batch_size"] // b
                runs.append(RunSpec(name=f"{opt}-{variant}-batch{b}", group="batch", **kw,
                                    **{**base, "micro_batch_size": b, "steps": n, "eval_every": max(1, n // 10)}))
        for p in depths:  # variable delay: PipeDream, one micro-batch per step, stage s lags p-1-s steps
            runs.append(RunSpec(name=f"{opt}-pipedream-p{p}", group="depth", optimizer=opt, schedule="pipedream",
                                stages=p, **base))
        for lam in lambdas:  # EF strength; 0 is plain 2bw, 1 is the main matrix
            runs.append(RunSpec(name=f"{opt}-2bw+ef-lambda{lam:g}", group="ef_lambda", optimizer=opt,
                                schedule="2bw", correction="ef", ef_lambda=lam, **base))
        runs.append(RunSpec(name=f"{opt}-2bw+nesterov", group="nesterov", optimizer=opt, schedule="2bw",
                            correction="nesterov", **base))
    return runs


def engine_pairs(base: dict, seeds=(0,), points=ENGINE_POINTS) -> list[RunSpec]:
    """Each (optimizer, variant) point of ``points`` per seed as a pair of runs in group ``engine``:
    ``<opt>-<variant>-s<seed>-deepspeed`` through the real engine and ``...-emulation``, the same spec otherwise."""
    return [RunSpec(name=f"{opt}-{variant}-s{seed}-{engine}", group="engine", optimizer=opt, seed=seed, engine=engine,
                    **VARIANTS[variant], **base)
            for seed in seeds for opt, variant in points for engine in ("deepspeed", "emulation")]


def matrix(name: str) -> list[RunSpec]:
    """The named list of runs (see ``launch/results/study/README.md``).

    ``tiny`` (CPU, CI): AdamW & Muon x {sync, 2bw, 2bw+ef} x 2 seeds of a 0.55M-parameter model for 30 steps,
    plus one AdamW point of each sweep. ``main`` (GPU): AdamW & Muon x {sync, 2bw, 2bw+ef} x 3 seeds of the 20M
    model. ``extras`` (GPU, seed 0 only): token budget x0.5/x2, peak LR x0.5/x2 (sync and 2bw, both optimizers),
    batch 96/192 sequences at the same tokens (AdamW only), PipeDream at p = 2/4/8, EF lambda 0.5/1.5 and the
    Nesterov look-ahead correction (both optimizers). ``engine`` (GPU): Muon 2bw+ef, AdamW 2bw and AdamW sync x 3
    seeds of the main configuration (as 2 micro-batches of 24), each through the real 2BW engine on 2 GPUs and
    through the emulation; ``engine-tiny`` (CPU, CI): the same points, seed 0, on the tiny model.
    ``engine-depth8`` (8 GPUs) and ``engine-depth8-cpu`` (8 CPU ranks): Muon sync vs 2bw+ef through an 8-stage
    engine (m = 8) and through the emulation, seed 0 (CPU: seeds 0 and 1).
    """
    if name == "tiny":
        runs = [RunSpec(name=f"{opt}-{variant}-s{seed}", group="main", optimizer=opt, seed=seed, **kw, **TINY)
                for opt in ("adamw", "muon") for variant, kw in VARIANTS.items() for seed in (0, 1)]
        return runs + _extras(dict(TINY, seed=0), optimizers=("adamw",), token_scales=(0.5,), lr_scales=(2.0,),
                              batches=(8,), depths=(2,), lambdas=(0.5,))
    if name == "main":
        return [RunSpec(name=f"{opt}-{variant}-s{seed}", group="main", optimizer=opt, seed=seed, **kw, **MAIN)
                for seed in (0, 1, 2) for opt in ("adamw", "muon") for variant, kw in VARIANTS.items()]
    if name == "extras":
        return _extras(dict(MAIN, seed=0))
    if name == "engine":
        return engine_pairs(ENGINE_BASE, seeds=(0, 1, 2))
    if name == "engine-tiny":
        return engine_pairs(TINY_ENGINE, seeds=(0,))
    if name == "engine-depth8":
        return engine_pairs(DEPTH8_BASE, seeds=(0,), points=DEPTH8_POINTS)
    if name == "engine-depth8-cpu":
        return engine_pairs(DEPTH8_CPU, seeds=(0, 1), points=DEPTH8_POINTS)
    raise ValueError(f"unknown matrix {name!r}; known: tiny, main, extras, engine, engine-tiny, engine-depth8, "
                     "engine-depth8-cpu")


def split(runs: list[RunSpec], index: int, of: int) -> list[RunSpec]:
    """Share ``index`` of ``of``: runs dealt longest first to the least loaded share (by estimated time), so the
    shares take about the same time; each share keeps the list's order (main's runs before extras')."""
    if not 0 <= index < of:
        raise ValueError(f"--gpu-index {index} is outside --of {of}")
    loads, shares = [0.0] * of, [[] for _ in range(of)]
    for k, run in sorted(enumerate(runs), key=lambda kr: (-estimated_seconds(kr[1]), kr[1].seed, kr[0])):
        i = min(range(of), key=lambda s: (loads[s], s))
        loads[i] += estimated_seconds(run)
        shares[i].append((k, run))
    return [run for _, run in sorted(shares[index], key=lambda kr: kr[0])]


def run_matrix(runs: list[RunSpec], out: Path, args) -> int:
    import torch

    torch.set_num_threads(args.threads or torch.get_num_threads())
    device = pick_device(args.device, args.gpu_index)
    memo: dict = {}
    failed = []
    t0 = time.perf_counter()
    for k, spec in enumerate(runs):
        run_dir = out / spec.group / spec.name
        if (run_dir / "summary.json").exists() and not args.force:
            print(f"[skip] {run_dir} is done", flush=True)
            continue
        _clear(run_dir)
        print(f"[run {k + 1}/{len(runs)}] {run_dir} on {device}", flush=True)
        try:
            doc = train_run(spec, run_dir, args.data_dir, args.token_cache, device, memo, verbose=args.verbose,
                            commit=args.commit)
            print(f"[done] {spec.name}: val {doc['final_validation_loss']} in {doc['wall_seconds']}s "
                  f"({doc['seconds_per_step'] * 1000:.1f} ms/step, {doc['model_tflops_per_s']} TFLOP/s)", flush=True)
        except Exception:  # noqa: BLE001 - one failed run must not stop the others
            traceback.print_exc()
            failed.append(spec.name)
    print(f"[matrix] {len(runs) - len(failed)}/{len(runs)} runs in {time.perf_counter() - t0:.1f}s"
          + (f"; failed: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


def run_engine_matrix(runs: list[RunSpec], out: Path, args) -> int:
    """Every rank of the launched group trains the engine runs one after the other (each a new engine over all
    ranks). Which runs are left is decided before anything is written, so the ranks agree; a failed run stops the
    group (the launcher ends every rank), and launching it again resumes after the finished runs."""
    import torch
    import torch.distributed as tdist

    from ds_async.initialize import init_distributed

    if args.threads:
        torch.set_num_threads(args.threads)
    device = engine_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_distributed()
    rank, world = tdist.get_rank(), tdist.get_world_size()
    wrong = [spec.name for spec in runs if spec.stages != world]
    if wrong:
        raise SystemExit(f"launched on {world} processes, but these engine runs have another number of stages: {wrong}")
    todo = [spec for spec in runs if args.force or not (out / spec.group / spec.name / "summary.json").exists()]
    if rank == 0:
        for spec in runs:
            if spec not in todo:
                print(f"[skip] {out / spec.group / spec.name} is done", flush=True)
        prepare(todo, args)  # the token cache: nothing to do where it holds the streams already
    tdist.barrier()
    memo: dict = {}
    t0 = time.perf_counter()
    for k, spec in enumerate(todo):
        run_dir = out / spec.group / spec.name
        if rank == 0:
            print(f"[run {k + 1}/{len(todo)}] {run_dir} through the engine on {world} ranks ({device.type})",
                  flush=True)
        doc = train_run_engine(spec, run_dir, args.data_dir, args.token_cache, device, memo, verbose=args.verbose,
                               commit=args.commit)
        if doc is not None:
            print(f"[done] {spec.name}: val {doc['final_validation_loss']} in {doc['wall_seconds']}s "
                  f"({doc['seconds_per_step'] * 1000:.1f} ms/step, {doc['model_tflops_per_s']} TFLOP/s)", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"[matrix] {len(todo)} engine runs in {time.perf_counter() - t0:.1f}s"
              + (f" ({len(runs) - len(todo)} done before)" if len(todo) < len(runs) else ""), flush=True)
    return 0


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a launched group (torchrun, the deepspeed launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def prepare(runs: list[RunSpec], args) -> None:
    """Tokenize every stream the runs need (the longest prefix per seed) into the cache."""
    need: dict = {}
    for spec in runs:
        r = spec.resolved()
        for split, n in (("train", r.tokens + 1), ("validation", r.eval_batches * r.eval_batch_size * r.seq_len + 1)):
            key = _cache_key(r, split)[0]
            if n > need.get(key, (0, None, None))[0]:
                need[key] = (n, r, split)
    for n, r, split in need.values():
        token_stream(r, split, n, args.data_dir, args.token_cache)


# ---------------------------------------------------------------------------------------------------------------
# CLI


def _parse_batch(text: str) -> tuple[int, int]:
    m, _, b = text.lower().partition("x")
    return int(m), int(b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--matrix", help="run named lists of runs: tiny, main, extras, engine, engine-tiny, or several "
                   "joined by commas (main,extras: one list, split as a whole, main's runs first)")
    p.add_argument("--gpu-index", type=int, default=0, help="with --matrix: run share i of --of (and use GPU i)")
    p.add_argument("--of", type=int, default=1, help="with --matrix: number of shares (one process per GPU)")
    p.add_argument("--engine", choices=("auto",) + ENGINES, default="auto",
                   help="emulation: one process (python launch/study.py); deepspeed: the real engine, one process per "
                        "stage (torchrun --nproc_per_node STAGES launch/study.py ...). With --matrix it picks that "
                        "engine's runs; auto: deepspeed's under torchrun (WORLD_SIZE > 1), else emulation's (with "
                        "--list / --prepare-data: all)")
    p.add_argument("--list", action="store_true", help="print the runs (of this share) and their estimated cost")
    p.add_argument("--prepare-data", action="store_true", help="only tokenize the streams the runs need")
    p.add_argument("--force", action="store_true", help="re-run runs whose folder already has summary.json")
    p.add_argument("--out", type=Path, default=None,
                   help="run folder (single run; default runs/study/<name>) or matrix root (default "
                        "launch/results/study): runs land in <out>/<group>/<name>")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_CORPUS if DEFAULT_CORPUS.exists() else None,
                   help="the shared corpus folder (enwiki shards, tokenizers/)")
    p.add_argument("--token-cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", dest="verbose", action="store_false")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    p.add_argument("--commit", default=os.environ.get("DS_ASYNC_COMMIT"),
                   help="the commit to record where the checkout has no .git (a copied working tree); "
                        "default $DS_ASYNC_COMMIT")
    run = p.add_argument_group("a single run")
    run.add_argument("--name", default=None)
    run.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    run.add_argument("--schedule", choices=("1f1b", "2bw", "pipedream"), default="1f1b")
    run.add_argument("--stages", type=int, default=2, help="pipeline depth p (changes only pipedream's delays)")
    run.add_argument("--correction", choices=("none", "ef", "nesterov"), default="none")
    run.add_argument("--ef-lambda", type=float, default=1.0)
    run.add_argument("--nesterov-momentum", type=float, default=0.9)
    run.add_argument("--correction-delay", type=int, default=1, help="the nesterov correction's look-ahead tau")
    run.add_argument("--lr", type=float, default=None, help="peak LR (Muon: hidden matrices); default per optimizer")
    run.add_argument("--adam-lr", type=float, default=None, help="Muon's AdamW groups' peak LR")
    run.add_argument("--lr-scale", type=float, default=1.0, help="multiplies the default LRs")
    run.add_argument("--weight-decay", type=float, default=None)
    run.add_argument("--model", choices=sorted(MODELS), default=MAIN["model"])
    run.add_argument("--seq-len", type=int, default=MAIN["seq_len"])
    run.add_argument("--batch", type=_parse_batch, default=(MAIN["micro_batches"], MAIN["micro_batch_size"]),
                     help="MxB: M micro-batches of B sequences per optimizer step (default 1x48)")
    length = run.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, help=f"default {MAIN['steps']}")
    length.add_argument("--tokens", type=int, default=None)
    run.add_argument("--warmup", type=float, default=0.1, help="warm-up steps, or a fraction of the steps if < 1")
    run.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine ends at this fraction of the peak")
    run.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clipping (0: none)")
    run.add_argument("--eval-every", type=int, default=None, help="default: a tenth of the steps")
    run.add_argument("--eval-batches", type=int, default=MAIN["eval_batches"])
    run.add_argument("--eval-batch-size", type=int, default=MAIN["eval_batch_size"])
    run.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    run.add_argument("--tokenizer", choices=sorted(VOCAB), default="bpe8192.json")
    run.add_argument("--shuffle-buffer", type=int, default=1000)
    run.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                     help="auto: bf16 autocast on CUDA, fp32 on CPU")
    args = p.parse_args(argv)

    engine = args.engine
    if engine == "auto":
        engine = "deepspeed" if launched_by_torchrun() else None if args.list or args.prepare_data else "emulation"
    if args.matrix:
        runs = [r for name in args.matrix.split(",") for r in matrix(name.strip())]
        runs = split([r for r in runs if engine is None or r.engine == engine], args.gpu_index, args.of)
        out = args.out or ROOT / "launch" / "results" / "study"
    else:
        m, b = args.batch
        spec = RunSpec(optimizer=args.optimizer, schedule=args.schedule, stages=args.stages,
                       correction=args.correction, ef_lambda=args.ef_lambda, nesterov_momentum=args.nesterov_momentum,
                       correction_delay=args.correction_delay, lr=args.lr, adam_lr=args.adam_lr,
                       lr_scale=args.lr_scale, weight_decay=args.weight_decay, model=args.model,
                       seq_len=args.seq_len, micro_batches=m, micro_batch_size=b,
                       steps=args.steps if args.steps or args.tokens else MAIN["steps"], tokens=args.tokens,
                       warmup=args.warmup, min_lr_ratio=args.min_lr_ratio, clip=args.clip, eval_every=args.eval_every,
                       eval_batches=args.eval_batches, eval_batch_size=args.eval_batch_size, seed=args.seed,
                       tokenizer=args.tokenizer, shuffle_buffer=args.shuffle_buffer, precision=args.precision,
                       engine=engine or "emulation")
        spec.name = args.name or f"{spec.optimizer}-{spec.variant}-s{spec.seed}" + (
            f"-{spec.engine}" if spec.engine != "emulation" else "")
        runs = [spec]
        out = args.out or ROOT / "runs" / "study" / spec.name

    if args.list:
        total = 0.0
        for spec in runs:
            r = spec.resolved()
            secs = estimated_seconds(spec)
            total += secs * (r.stages if r.engine == "deepspeed" else 1)
            where = f"on {r.stages} GPUs" if r.engine == "deepspeed" else "GPU-s"
            print(f"{spec.group:>10}/{spec.name:<34} {r.variant:<14} steps={r.steps:<5} tokens={r.tokens:>10,} "
                  f"~{secs:5.1f} {where}")
        print(f"{len(runs)} runs, ~{total / 60:.1f} GPU-min planned (model FLOPs at {PLAN_FLOPS_PER_S / 1e12:.0f} "
              f"TFLOP/s, >= {PLAN_HOST_S_PER_LAYER * 1e3:.0f} ms host time per layer and step, "
              f"{PLAN_START_S:.0f} s start-up per run; an engine run counts its wall time on each of its GPUs)")
        return 0
    if args.prepare_data:
        prepare(runs, args)
        return 0
    if args.matrix:
        if engine == "deepspeed":
            return run_engine_matrix(runs, out, args)
        return run_matrix(runs, out, args)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if runs[0].engine == "deepspeed":
        device = engine_device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        train_run_engine(runs[0], out, args.data_dir, args.token_cache, device, verbose=args.verbose,
                         commit=args.commit)
        return 0
    train_run(runs[0], out, args.data_dir, args.token_cache, pick_device(args.device), verbose=args.verbose,
              commit=args.commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
