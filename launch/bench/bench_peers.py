"""2BW's strongest synchronous peers, like for like: torchtitan's pipeline schedules on ds_async's model.

    torchrun --nproc_per_node 4 launch/bench/bench_peers.py --schedules 1F1B,Interleaved1F1B,ZBVZeroBubble,DualPipeV \\
        --micro-batches 8 --compile --adamw fused --out rows.jsonl

torchtitan runs pipeline parallelism through ``torch.distributed.pipelining``: a ``PipelineStage`` per model chunk and
a schedule class named as its ``parallelism.pipeline_parallel_schedule`` names it. This script sets them up as
torchtitan's ``pipeline_llm`` does: one stage per rank for single-stage schedules (``1F1B``, ``GPipe``), two per rank
by default for the others (``--stages-per-rank``), placed round-robin (rank r holds stages r, r + p, ...) except for
``ZBVZeroBubble`` and ``DualPipeV``, whose two stages per rank form a V (rank r holds r and 2p - 1 - r). The loss is
the mean over a micro-batch's tokens and the gradients are scaled by 1/m (torch's ``scale_grads``), which is
torchtitan's loss over the batch's tokens when micro-batches hold equal token counts, as here.

What runs is what ``bench_pipeline.py`` runs for DeepSpeed's engine, so that a row here pairs with one there on the
same machine: the same model flags and defaults (``model_flags.py``: the 0.9B LLaMA at 2 x 2048 tokens a
micro-batch), ds_async's LLaMA layers seeded alike and split over the virtual stages by DeepSpeed's balance of their
training FLOPs (``--partition``; at p = 4 the split of ``bench_pipeline.py``'s first table), each decoder layer and
the head compiled (``--compile``, from the second warm-up step on; ``--compile-scope stage``: one region a stage),
bf16 weights with fp32 master weights (``ds_async.optim.MasterWeights``; DeepSpeed's bf16 keeps its masters flat,
which an elementwise AdamW steps alike), torch's AdamW (``--adamw fused``), and the gradient clipped by the whole
model's norm. Batches are random tokens already on the device.

Appends one JSON row per schedule: step time, tokens/s, MFU, peak memory and measured idle fraction per rank (time
outside the stages' forward and backward chunks, timed with CUDA events on GPUs), and the loss of every step
(the mean over its micro-batches), which must not depend on the schedule. On CPU (gloo) it runs as well, which the
tests use; ``--precision fp32`` there trains without bf16 anywhere.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch._functorch.config
import torch.distributed as tdist
from deepspeed.runtime.utils import partition_balanced, partition_uniform
from model_flags import add_model_flags, model_of
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (PipelineScheduleSingle, ScheduleDualPipeV,
                                                    ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
                                                    get_schedule_class)

from ds_async import init_distributed
from ds_async.flops import layer_flops_per_token, model_flops_per_token
from ds_async.metrics import card_name, code_version
from ds_async.config import ConfigError, check_boundaries
from ds_async.models import compile_layers, compiled_stage, llama, trainable_counts
from ds_async.optim.clip import clip_coefficient, squared_norm
from ds_async.optim.master import MasterWeights
from ds_async.telemetry import peak_flops, peak_memory_gib

V_SHAPED = (ScheduleZBVZeroBubble, ScheduleDualPipeV)
SPLIT_BACKWARD = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)
"""Schedules that run a backward's input and weight gradients apart, through the autograd graph twice: a compiled
backward must then keep the buffers it would otherwise donate to its outputs (pytorch/pytorch#161904)."""


def stages_of_rank(rank: int, ranks: int, per_rank: int, v_shaped: bool) -> list[int]:
    """The virtual stages ``rank`` holds, as torchtitan places them: a V, or round-robin."""
    if v_shaped:
        if per_rank != 2:
            raise SystemExit("--stages-per-rank: ZBVZeroBubble and DualPipeV take exactly 2")
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(per_rank)]


def bounds_of(partition: str, specs: list, stages: int, hf, seq_len: int) -> list[int]:
    """``stages + 1`` indices into ``[embedding, decoder x L, head]``: DeepSpeed's balance of the layers' training
    FLOPs (``flops``; for the 902M model over 4 stages the first table's ``0,5,9,13,17``) or parameter counts
    (``parameters``), its split by count (``uniform``), or explicit boundaries ``0,5,9,...``."""
    if partition in ("flops", "parameters"):
        weights = layer_flops_per_token(hf, seq_len) if partition == "flops" else trainable_counts(specs)
        return [int(b) for b in partition_balanced(weights=weights, num_parts=stages)]
    if partition == "uniform":
        return [int(b) for b in partition_uniform(len(specs), stages)]
    try:
        return check_boundaries([int(x) for x in partition.split(",")], stages, len(specs))
    except (ValueError, ConfigError) as e:
        raise SystemExit(f"--partition {partition}: {e}") from None


class Chunk(nn.Module):
    """One virtual stage's layers in sequence: each layer compiled on its own, or the chunk as one region."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.region = None

    def compile_layers(self, scope: str) -> None:
        if scope == "stage":
            self.region = compiled_stage(self.layers)
            return
        compile_layers(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.region is not None:
            return self.region(x)
        for layer in self.layers:
            x = layer(x)
        return x


class PassTimer:
    """Time inside this rank's forward and backward chunks while :attr:`on`: CUDA events on GPUs (no host syncs),
    the host's clock on CPU, where a pass runs synchronously."""

    def __init__(self, stages: list[PipelineStage], cuda: bool):
        self.cuda, self.on, self.pairs, self.seconds = cuda, False, [], 0.0
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self.pairs.append((start, end))
                return out
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            return out
        return run

    def busy_seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.pairs) / 1000
        return self.seconds


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    tdist.barrier()


def run_schedule(name: str, a, hf, device: torch.device) -> dict:
    """Build this rank's stages for schedule ``name``, train ``--warmup`` + ``--steps`` steps, return the row."""
    rank, ranks = tdist.get_rank(), tdist.get_world_size()
    cls = get_schedule_class(name)
    single = issubclass(cls, PipelineScheduleSingle)
    per_rank = 1 if single else (a.stages_per_rank or 2)
    if single and per_rank != 1:
        raise SystemExit(f"--stages-per-rank: {name} holds one stage per rank")
    total = ranks * per_rank
    specs = llama.layer_specs(hf, seed=a.seed)
    bounds = bounds_of(a.partition, specs, total, hf, a.seq_len)
    mine = stages_of_rank(rank, ranks, per_rank, cls in V_SHAPED)

    scope = a.compile_scope if a.compile else None
    chunks = [Chunk(llama.build_all(specs[bounds[s]:bounds[s + 1]])) for s in mine]
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, **{a.adamw: True})
    if a.precision == "bf16":  # each chunk's weights become bf16 copies of the fp32 masters the optimizer holds
        optimizer = MasterWeights(optimizer, nn.ModuleList(chunks), device=device)
    for chunk in chunks:
        chunk.to(device)
    weights = [p for chunk in chunks for p in chunk.parameters()]  # the trained ones: bf16 copies under bf16
    stages = [PipelineStage(chunk, s, total, device) for chunk, s in zip(chunks, mine)]
    loss_fn = llama.loss_fn(hf)
    if a.compile:
        loss_fn = torch.compile(loss_fn)
    m = a.micro_batches
    schedule = cls(stages[0] if single else stages, n_microbatches=m, loss_fn=loss_fn)
    timer = PassTimer(stages, device.type == "cuda")

    # Every rank in one collective before the schedule's first batched send and receive: NCCL leaves a batch of
    # point-to-point operations undefined as a group's first communication unless all its ranks take part.
    tdist.barrier()
    steps = a.warmup + a.steps
    gen = torch.Generator().manual_seed(a.seed)
    batches = torch.randint(0, hf.vocab_size, (steps, m * a.micro_batch_size, a.seq_len + 1), generator=gen)
    batches = batches.to(device)
    first, last = 0 in mine, total - 1 in mine
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "autocast")
    losses: list[torch.Tensor] = []

    def train_step(k: int) -> None:
        out: list[torch.Tensor] = []
        with autocast:
            schedule.step(*((batches[k, :, :-1],) if first else ()),
                          target=batches[k, :, 1:] if last else None, losses=out)
        if last:
            losses.append(torch.stack(out).float().mean().detach())
        scale = None
        if a.clip:
            sq = squared_norm([p.grad for p in weights if p.grad is not None]).to(device)
            tdist.all_reduce(sq)
            scale = clip_coefficient(sq, a.clip)[1]
        if a.precision == "bf16":
            optimizer.step_with(scale)
        else:
            if scale is not None:
                torch._foreach_mul_([p.grad for p in weights if p.grad is not None], scale)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for k in range(a.warmup):
        train_step(k)
        # Compiled after the first step: its first forward is torch's inference of the shapes the stages exchange,
        # which compiled code need not see.
        if k == 0 and scope is not None:
            for chunk in chunks:
                chunk.compile_layers(scope)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timer.on = True
    t0 = time.perf_counter()
    for k in range(a.warmup, steps):
        train_step(k)
    synchronize(device)
    elapsed = time.perf_counter() - t0
    timer.on = False
    busy = timer.busy_seconds()

    per_rank_rows = [None] * ranks
    tdist.all_gather_object(per_rank_rows, (rank, mine, round(peak_memory_gib(device), 2),
                                            round(1 - busy / elapsed, 4),
                                            [x.item() for x in losses] if last else None))
    step_time = elapsed / a.steps
    tokens = m * a.micro_batch_size * a.seq_len
    peak = peak_flops(None, device)
    flops = model_flops_per_token(hf, a.seq_len) * tokens / step_time
    return {"bench": "peers", "schedule": name, "stages": ranks, "virtual_stages": total,
            "stages_by_rank": {f"r{r}": s for r, s, *_ in per_rank_rows},
            "partition": ",".join(map(str, bounds)), "micro_batches": m, "micro_batch_size": a.micro_batch_size,
            "seq_len": a.seq_len, "precision": a.precision, "optimizer": "adamw", "adamw": a.adamw, "clip": a.clip,
            "compile": scope, "warmup": a.warmup, "steps": a.steps,
            "step_time_s": round(step_time, 4), "tokens_per_s": round(tokens / step_time, 1),
            "mfu": None if peak is None else round(flops / (ranks * peak), 4),
            "ideal_1f1b_bubble": round((ranks - 1) / (m + ranks - 1), 4),
            "peak_mem_GiB_by_rank": {f"r{r}": g for r, _, g, *_ in per_rank_rows},
            "measured_idle_by_rank": {f"r{r}": i for r, _, _, i, _ in per_rank_rows},
            "losses": next(x for *_, x in per_rank_rows if x is not None),
            "card": f"{ranks}x {card_name(device)}"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", default="1F1B,Interleaved1F1B,ZBVZeroBubble,DualPipeV",
                    help="comma-separated schedule names as torchtitan's pipeline_parallel_schedule takes them "
                         "(torch.distributed.pipelining's get_schedule_class), each run in turn with a fresh model")
    ap.add_argument("--stages-per-rank", type=int, default=None,
                    help="virtual stages per rank for multi-stage schedules (default 2, as torchtitan's)")
    ap.add_argument("--micro-batches", type=int, default=4, help="m, torch's n_microbatches")
    add_model_flags(ap)
    ap.add_argument("--partition", default="flops",
                    help="'flops' (balanced training FLOPs), 'parameters', 'uniform', or explicit boundaries over "
                         "[embedding, layers..., head] for all virtual stages, e.g. 0,3,5,7,9,11,13,15,17")
    ap.add_argument("--precision", choices=["bf16", "autocast", "fp32"], default="bf16",
                    help="bf16: bf16 weights, fp32 masters (as bench_pipeline.py's default); autocast: fp32 weights, "
                         "bf16 compute (torchtitan's without FSDP); fp32: no bf16 anywhere")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer, the head and the loss")
    ap.add_argument("--compile-scope", choices=["layer", "stage"], default="layer",
                    help="with --compile: one compiled region per layer or per virtual stage")
    ap.add_argument("--adamw", choices=["foreach", "fused"], default="foreach", help="torch AdamW implementation")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping by the model's norm (0: off)")
    ap.add_argument("--seed", type=int, default=0, help="the layers' initialisation and the random tokens")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="append each schedule's row to this JSON-lines file")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None)
    a = ap.parse_args(argv)
    if a.compile and a.warmup < 1:
        ap.error("--compile needs --warmup 1 or more: the layers compile after the first step")

    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model, hf = model_of(a)
    llama.check_supported(hf)
    for name in a.schedules.split(","):
        donate = get_schedule_class(name) not in SPLIT_BACKWARD
        with torch._functorch.config.patch(donated_buffer=donate):
            row = run_schedule(name, a, hf, device)
        row.update(donated_buffer=donate, model=model, code=code_version())
        if tdist.get_rank() == 0:
            print("BENCH " + json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
