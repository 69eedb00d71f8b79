"""Pipeline throughput benchmark: stock-equivalent 1F1B vs flush-free 2BW on the same model and machine.

    torchrun --nproc_per_node 4 launch/bench/bench_pipeline.py --schedule 1f1b --micro-batches 4 --out rows.jsonl
    torchrun --nproc_per_node 4 launch/bench/bench_pipeline.py --schedule 2bw  --micro-batches 4 --out rows.jsonl

Prints and appends one JSON row per run: step time, tokens/s, MFU (model FLOPs over the card's dense bf16 peak),
peak memory per stage, and the measured idle fraction per stage (1 - time inside forward/backward passes, timed
with CUDA events, over the wall time of the timed steps). Data are random tokens (speed only);
the model is a LLaMA built exactly as in training (``ds_async.models``); FLOPs are ``ds_async.flops``'s.
Current numbers and the command behind each: ``launch/bench/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import tempfile
import time

import torch
from deepspeed import comm as dist
from model_flags import add_model_flags, model_of
from torch.profiler import ProfilerActivity, profile, record_function
from trace_gaps import PREFIX, gap_report

from ds_async import config as cfgmod
from ds_async import data, init_distributed, initialize
from ds_async.config import DataConfig, override, parse_set
from ds_async.flops import model_flops_per_token
from ds_async.metrics import code_version
from ds_async.models import build_pipeline, model_config
from ds_async.pipe.engine import AsyncPipelineEngine
from ds_async.plan import plan, to_json

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


class ComputeTimer:
    """Busy time of this stage: CUDA events around every forward and backward instruction (no host syncs), and
    the host's own time inside every instruction (``time.perf_counter``; it includes any wait the host makes).

    Benchmark-only instrumentation: it wraps the engine's instruction table entries.
    """

    PASSES = ("ForwardPass", "BackwardPass")

    def __init__(self, engine_cls):
        self.pairs, self.on = [], False
        self.host = {}  # instruction name -> host seconds
        for table in (engine_cls._INSTRUCTION_MAP, engine_cls._ASYNC_INSTRUCTIONS):
            for kind, fn in table.items():
                table[kind] = self._wrap(kind.__name__, fn)

    def _wrap(self, name, fn):
        timed_on_gpu = name in self.PASSES

        def timed(engine, *args, **kwargs):
            if not self.on:
                return fn(engine, *args, **kwargs)
            if timed_on_gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            out = fn(engine, *args, **kwargs)
            self.host[name] = self.host.get(name, 0.0) + time.perf_counter() - t0
            if timed_on_gpu:
                end.record()
                self.pairs.append((start, end))
            return out
        return timed

    def busy_seconds(self) -> float:
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in self.pairs) / 1000


class GcPauses:
    """Wall time the host spends in Python's garbage collector while open (``gc.callbacks``)."""

    def __init__(self):
        self.seconds, self._start = 0.0, None
        gc.callbacks.append(self._on)

    def _on(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def close(self):
        gc.callbacks.remove(self._on)


def param_digest(engine) -> str:
    """SHA-1 of this stage's trained weights (the fp32 master where DeepSpeed keeps one): runs of the same
    settings must agree bit for bit whatever the overlap, so a race between streams shows up here."""
    master = getattr(engine.optimizer, "fp32_groups_flat_partition", None)
    tensors = master if master is not None else [p.detach() for p in engine.module.parameters()]
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def profile_steps(engine, it, folder: str, schedule: str) -> None:
    """Two steady steps on this rank under torch.profiler, every pipeline instruction marked: a kernel and
    host-op table, a chrome trace, and its compute-stream gaps (``trace_gaps.py``, next to this file)."""
    def marked(name, fn):
        def run(engine, *args, **kwargs):
            with record_function(PREFIX + name):
                return fn(engine, *args, **kwargs)
        return run

    cls = type(engine)
    saved = {id(t): dict(t) for t in (cls._INSTRUCTION_MAP, cls._ASYNC_INSTRUCTIONS)}
    for table in (cls._INSTRUCTION_MAP, cls._ASYNC_INSTRUCTIONS):
        for kind, fn in table.items():
            table[kind] = marked(kind.__name__, fn)
    os.makedirs(folder, exist_ok=True)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                engine.train_batch(it)
            torch.cuda.synchronize()
    finally:
        for table in (cls._INSTRUCTION_MAP, cls._ASYNC_INSTRUCTIONS):
            table.update(saved[id(table)])
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    rank = engine.global_rank
    with open(os.path.join(folder, f"profile_rank{rank}.txt"), "w") as f:
        f.write(table + "\n\n" + host)
    trace = os.path.join(folder, f"trace_rank{rank}.json")
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        report = gap_report(json.load(f))
    with open(os.path.join(folder, f"gaps_rank{rank}.json"), "w") as f:
        json.dump({"stage": engine.stage_id, "schedule": schedule, **report}, f, indent=1)


def skip_optimizer_step(engine) -> None:
    """``--skip-step``: the batch boundary keeps its bookkeeping (gradient gather, norm, version labels) but does no
    optimizer work and copies no weights. Benchmark-only; the weights never change."""
    if not engine.is_async:
        raise SystemExit("--skip-step applies to 2bw only")
    params = [p for _, _, p in engine.versions.entries]

    def drop_grads():
        for p in params:
            p.grad = None
        engine.global_steps += 1  # what DeepSpeed's step counts, which the engine reads as the batch index
        engine.global_samples += engine.train_batch_size()
    engine.versions.publish = engine.versions.claim
    engine._exec_optimizer_step = drop_grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None,
                    help="a ds_async DeepSpeed JSON (e.g. ds_configs/llama3_8b_4gpu_2bw_adamw.json): its model, "
                         "partition, batch, precision, optimizer and performance levers instead of the flags below "
                         "(--schedule and --micro-batches still override); the row adds the memory planner's "
                         "per-stage figures (python -m ds_async.plan) beside the measured peaks")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="with --config: set a dotted key of it (JSON value), as launch/study/run.py's --set, e.g. "
                         "--set ds_async.schedule=2bw --set 'ds_async.correction={\"type\": \"ef\"}'")
    ap.add_argument("--schedule", choices=["1f1b", "2bw"], default=None, help="required without --config")
    ap.add_argument("--stages", type=int, default=None, help="pipeline depth (default: world size)")
    ap.add_argument("--micro-batches", type=int, default=None, help="m (default 4, or the config's)")
    add_model_flags(ap)
    ap.add_argument("--optimizer", choices=["adamw", "muon", "muon-ef"], default="adamw",
                    help="muon / muon-ef (ds_async's hybrid Muon, with error feedback) need --precision autocast")
    ap.add_argument("--precision", choices=["bf16", "autocast"], default="bf16",
                    help="bf16: DeepSpeed's bf16 weights + fp32 master; autocast: fp32 weights, bf16 compute")
    ap.add_argument("--partition", default="parameters",
                    help="'parameters', 'uniform', or explicit stage boundaries over [embedding, layers..., head], "
                         "e.g. 0,5,9,13,17")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (performance.compile)")
    ap.add_argument("--compile-scope", choices=["layer", "stage"], default="layer",
                    help="with --compile: one compiled region per layer or per stage (performance.compile_scope)")
    ap.add_argument("--loss-chunk", type=int, default=0,
                    help="chunked cross-entropy with this many tokens per chunk (performance.loss_chunk; 0: off)")
    ap.add_argument("--activation-checkpoint-interval", type=int, default=0,
                    help="recompute every this many decoder layers in backward (0: off)")
    ap.add_argument("--activation-checkpoint-layers", default=None,
                    help="decoder layers each stage recomputes, one count or one per stage, e.g. 2,0,0,0 "
                         "(performance.activation_checkpoint_layers; with --config it replaces the config's "
                         "checkpointing, e.g. what python -m ds_async.plan suggests)")
    ap.add_argument("--adamw", choices=["foreach", "fused"], default="foreach",
                    help="torch AdamW implementation (DeepSpeed passes the flag through to torch.optim.AdamW)")
    ap.add_argument("--host-batches", action="store_true",
                    help="feed micro-batches from CPU memory (as the trainer does) instead of a pool on the GPU")
    ap.add_argument("--text", default=None, metavar="GLOB",
                    help="feed micro-batches of real text (parquet or text files), tokenized on each data-reading "
                         "rank's main thread as launch/train.py reads them, instead of random tokens")
    ap.add_argument("--tokenizer", default="../shared/corpus/tokenizers/bpe16384.json",
                    help="the tokenizer for --text (its ids must fit the model's vocabulary)")
    ap.add_argument("--fused-step", action="store_true",
                    help="the bf16 AdamW step in one pass per tensor (performance.fused_optimizer_step; 2bw, bf16)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: off, no global-norm all-reduce)")
    ap.add_argument("--skip-step", action="store_true",
                    help="ablation (2bw only, wrong results): drop each batch's gradients instead of stepping, and "
                         "relabel the free slot instead of copying the weights into it; what any faster step could "
                         "gain at most")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", default=None,
                    help="write a torch.profiler kernel table per rank of two steady steps into this folder")
    ap.add_argument("--out", default=None, help="append the result row to this JSON-lines file")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None)
    a = ap.parse_args()

    init_distributed()
    world = dist.get_world_size()
    if a.config:
        return bench_config(a, world)
    if a.sets:
        ap.error("--set needs --config")
    if a.schedule is None:
        ap.error("--schedule is required without --config")
    stages = a.stages or world
    model, hf = model_of(a)
    partition = ({"method": "explicit", "boundaries": [int(x) for x in a.partition.split(",")]}
                 if "," in a.partition else {"method": a.partition})
    cfg = cfgmod.parse({"model": {"config": model}, "pipeline_stages": stages, "schedule": a.schedule,
                        "train": {"steps": a.steps}, "partition": partition, "data": {"seq_len": a.seq_len},
                        "correction": {"type": "ef" if a.optimizer == "muon-ef" else "none"},
                        "performance": {"compile": a.compile, "compile_scope": a.compile_scope,
                                        "loss_chunk": a.loss_chunk,
                                        "activation_checkpoint_interval": a.activation_checkpoint_interval,
                                        "activation_checkpoint_layers": recompute_counts(a),
                                        "fused_optimizer_step": a.fused_step}})
    ds_config = {"train_micro_batch_size_per_gpu": a.micro_batch_size,
                 "gradient_accumulation_steps": a.micro_batches or 4, "steps_per_print": 10 ** 9,
                 "gradient_clipping": a.clip, "wall_clock_breakdown": False,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": True,
                                                           a.adamw: True}}}
    if a.optimizer != "adamw":
        ds_config["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.01, "adam_lr": 1e-4}}
    if a.precision == "bf16":
        ds_config["bf16"] = {"enabled": True}
    else:
        ds_config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    measure(a, cfg, hf, ds_config, model, world, stages)


def recompute_counts(a) -> int | list[int]:
    """``--activation-checkpoint-layers`` as the config takes it (0 when not given)."""
    counts = [int(x) for x in (a.activation_checkpoint_layers or "0").split(",")]
    return counts if len(counts) > 1 else counts[0]


def bench_config(a, world: int) -> None:
    """``--config``: the shipped job's model and levers, random tokens, the planner's figures in the row."""
    raw = json.loads(open(a.config).read())
    if a.sets:
        raw = override(raw, dict(parse_set(x) for x in a.sets))
    if a.schedule:
        raw["ds_async"]["schedule"] = a.schedule
    if raw["ds_async"].get("schedule", "1f1b") == "1f1b" and raw["optimizer"]["type"].lower() in ("adam", "adamw"):
        # the one-pass AdamW step exists for flush-free schedules only: 1F1B keeps its other levers (the row's
        # "performance" records what ran)
        raw["ds_async"].setdefault("performance", {})["fused_optimizer_step"] = False
    if a.micro_batches:
        raw["gradient_accumulation_steps"] = a.micro_batches
    if a.activation_checkpoint_layers is not None:
        perf = raw["ds_async"].setdefault("performance", {})
        perf.update(activation_checkpoint_interval=0, activation_checkpoint_layers=recompute_counts(a))
    raw.pop("train_batch_size", None)
    # the LR schedule spans the benchmark's steps, whatever length the job itself would train for
    (raw.get("scheduler") or {}).get("params", {}).pop("total_num_steps", None)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(raw, f)
    ds_config, cfg = cfgmod.load(f.name)
    hf = model_config(cfg)
    planned = to_json(plan(f.name, gpus=world))
    ds_config = cfgmod.with_schedule_length({k: v for k, v in ds_config.items() if k != "ds_async"},
                                            a.warmup + a.steps + (2 if a.profile else 0))
    ds_config.update(steps_per_print=10 ** 9, wall_clock_breakdown=False)
    extra = {"config": a.config, "sets": a.sets, "family": cfg.model.family,
             "planned_GiB_by_stage": {f"s{x['stage']}": round(x["total"] / 2 ** 30, 2) for x in planned["stages_detail"]},
             "planned_fits": planned["fits"]}
    measure(a, cfg, hf, ds_config, hf.to_dict(), world, cfg.pipeline_stages, extra)


def described(cfg, ds_config: dict) -> dict:
    """What a row measures, read off the job's configs (flag runs and ``--config`` runs alike)."""
    opt = ds_config["optimizer"]
    adamw = opt["type"].lower() in ("adam", "adamw")
    bounds = cfg.partition.boundaries
    return {"schedule": cfg.schedule, "partition": ",".join(map(str, bounds)) if bounds else cfg.partition.method,
            "micro_batches": ds_config["gradient_accumulation_steps"],
            "micro_batch_size": ds_config["train_micro_batch_size_per_gpu"], "seq_len": cfg.data.seq_len,
            "precision": "bf16" if (ds_config.get("bf16") or {}).get("enabled") else "autocast",
            "optimizer": opt["type"].lower() + ("-ef" if cfg.correction.type == "ef" else ""),
            # torch's AdamW kernel: fused when asked, else foreach (its default on GPUs); none for other optimizers
            "adamw": ("fused" if opt.get("params", {}).get("fused") else "foreach") if adamw else None,
            "clip": ds_config.get("gradient_clipping", 0.0)}


def text_batches(a, engine, job: dict, vocab_size: int):
    """This rank's micro-batches of ``--text``, as the trainer opens its training stream (``ds_async.data``:
    shuffled, packed, read and tokenized on this thread when the engine asks for the next one)."""
    tokenizer = data.load_tokenizer(a.tokenizer, key="--tokenizer")
    if len(tokenizer) > vocab_size:
        raise SystemExit(f"--tokenizer {a.tokenizer}: {len(tokenizer)} tokens, more than the model's vocabulary "
                         f"({vocab_size})")
    return data.open_batches(DataConfig(train=a.text, seq_len=job["seq_len"]), "train", tokenizer,
                             job["micro_batch_size"], dp_rank=engine.grid.data_parallel_id,
                             dp_world_size=engine.grid.data_parallel_size)


def measure(a, cfg, hf, ds_config: dict, model: dict, world: int, stages: int, extra: dict | None = None) -> None:
    """Build the engine, run ``--warmup`` + ``--steps`` batches of random tokens, print and append the row. ``a``
    gives only how to run (warm-up, steps, profile, ``--skip-step``, ``--host-batches``, ``--out``); what runs is
    ``cfg``, ``hf`` and ``ds_config``."""
    job = described(cfg, ds_config)
    timer = ComputeTimer(AsyncPipelineEngine)
    engine = initialize(build_pipeline(cfg, hf), ds_config, schedule=cfg.schedule, correction=cfg.correction,
                        fused_optimizer_step=cfg.performance.fused_optimizer_step)
    step_events = engine.record_step_events()
    if a.skip_step:
        skip_optimizer_step(engine)
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device="cpu").manual_seed(0)

    # A pool of micro-batches, by default already on the GPU (host-to-device copies are not what is measured);
    # --host-batches keeps them in CPU memory as a data loader hands them over, so the engine copies each one in.
    pool = [torch.randint(0, hf.vocab_size, (job["micro_batch_size"], job["seq_len"] + 1), generator=gen)
            for _ in range(8)]
    if not a.host_batches:
        pool = [ids.to(dev) for ids in pool]

    def batches():
        while True:
            for ids in pool:
                yield ids[:, :-1], ids[:, 1:]

    it = text_batches(a, engine, job, hf.vocab_size) if a.text else batches()
    total = a.warmup + a.steps + (2 if a.profile else 0)
    engine.drain_after(total - 1)
    for _ in range(a.warmup):
        engine.train_batch(it)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.reset_peak_memory_stats()
    timer.on = True
    pauses = GcPauses()
    t0 = time.perf_counter()
    for _ in range(a.steps - 1):
        engine.train_batch(it)
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    dist.barrier()
    elapsed = time.perf_counter() - t0  # steady state: the last step (with the final drain) is timed apart
    pauses.close()
    timer.on = False
    busy = timer.busy_seconds()
    step_ms = [s.elapsed_time(e) for s, e in step_events[a.warmup:]]
    if a.profile:
        profile_steps(engine, it, a.profile, job["schedule"])
    engine.train_batch(it)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    peaks = [None] * world
    host_ms = {k: round(v * 1e3 / (a.steps - 1), 2) for k, v in sorted(timer.host.items(), key=lambda kv: -kv[1])}
    # Host time per step outside every instruction (schedule, loop, train_batch itself), in GC pauses, and the wait
    # for the GPU (and the other stages) after the last step was issued: how far the host ran ahead.
    host_ms["(outside instructions)"] = round((issued - sum(timer.host.values())) * 1e3 / (a.steps - 1), 2)
    host_ms["(final wait, whole run)"] = round((elapsed - issued) * 1e3, 2)
    host_ms["(gc pauses, anywhere)"] = round(pauses.seconds * 1e3 / (a.steps - 1), 2)
    dist.all_gather_object(peaks, (engine.stage_id, engine.grid.data_parallel_id, round(peak, 2),
                                   round(1 - busy / elapsed, 4),
                                   round(sum(step_ms) / len(step_ms), 2) if step_ms else None, host_ms,
                                   param_digest(engine)))

    step_time = elapsed / (a.steps - 1)
    tokens = engine.train_batch_size() * job["seq_len"]
    name = torch.cuda.get_device_name()
    card = next((k for k in PEAK_BF16 if k in name), None)
    flops = model_flops_per_token(hf, job["seq_len"]) * tokens / step_time
    mfu = flops / (world * PEAK_BF16[card]) if card else None
    p, m = stages, job["micro_batches"]
    row = {"schedule": job["schedule"], "stages": p, "partition": job["partition"], "data_parallel": world // p,
           "micro_batches": m,
           "micro_batch_size": job["micro_batch_size"], "seq_len": job["seq_len"], "precision": job["precision"],
           "step_time_s": round(step_time, 4), "tokens_per_s": round(tokens / step_time, 1),
           "mfu": None if mfu is None else round(mfu, 4), "ideal_1f1b_bubble": round((p - 1) / (m + p - 1), 4),
           "optimizer": job["optimizer"], "adamw": job["adamw"], "clip": job["clip"], "skip_step": a.skip_step,
           "host_batches": a.host_batches, "text": a.text,
           "performance": dataclasses.asdict(cfg.performance),
           "peak_mem_GiB_by_stage": {f"s{s}": g for s, d, g, *_ in sorted(peaks) if d == 0},
           "measured_idle_by_stage": {f"s{s}": b for s, d, _, b, *_ in sorted(peaks) if d == 0},
           "optimizer_step_ms_by_stage": {f"s{s}": o for s, d, _, _, o, *_ in sorted(peaks) if d == 0},
           # host time per step inside each instruction: when its sum nears the step time, the host is the limit
           "host_ms_per_step_by_stage": {f"s{s}": h for s, d, *_, h, _ in sorted(peaks) if d == 0},
           "param_digest_by_stage": {f"s{s}": x for s, d, *_, x in sorted(peaks) if d == 0},
           "card": f"{world}x {name}", "model": model, "code": code_version(), **(extra or {})}
    n_params = torch.tensor([sum(x.numel() for x in engine.module.parameters())], device=dev)
    dist.all_reduce(n_params, group=engine.grid.get_pipe_parallel_group())
    row["params_M"] = round(n_params.item() / 1e6, 1)
    if dist.get_rank() == 0:
        print("BENCH " + json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
