"""Newton-Schulz of one pipeline stage's hidden matrices, alone on one GPU (tiny on CPU): how fast each variant runs.

    python launch/bench/bench_newton_schulz.py --out ns.jsonl

The stage: ``--layers`` (4) decoder layers of the ~0.9B LLaMA that launch/bench/bench_pipeline.py trains by default
(hidden 2048, ffn 5632, 16 heads, as many KV heads): per layer q, k, v, o (2048 x 2048), gate, up (5632 x 2048),
down (2048 x 5632); ``--steps`` (5) iterations. Random bf16 directions; each variant runs ``--warmup`` times
untimed, then ``--iters`` times, each timed with CUDA events (``perf_counter`` on CPU); one JSON line per variant
with the median ms and TFLOP/s by :func:`ds_async.flops.newton_schulz_flops`, and whether its result is bit-equal
to the eager batched one.

Variants (``--variants``, comma-separated):
  eager      ``ds_async.optim.muon.orthogonalise_batched``: one batched Newton-Schulz per shape (what Muon runs: on
             GPUs the symmetric products by ``ds_async.optim.ns_triton``, one triangle each, ~31% fewer FLOPs here;
             ``tflops`` counts the whole products, as for the others).
  matmul     the same with every product whole by cuBLAS (``ds_async.optim.muon.zeropower_matmul``); ``bit_equal``
             compares it with ``eager``.
  compiled   the same under ``torch.compile`` (Inductor fuses the norm, casts and transposes around the products).
  merged     tall matrices transposed and stacked with the wide ones of that shape (gate, up with down): one batch
             of 12 instead of 8 + 4.
  splitD     what each of D data-parallel replicas computes under ``ds_async.optim.ns_split.assign`` (its own
             matrices, batched by shape): the slowest replica's ms; the all-gather is not included (``gather_mb``
             says what it moves). ``split_bit_equal``: every replica's matrices equal the unsplit result bit for bit
             on this device (the split's contract).
  muon_step  the class step ``Muon.step()`` + ErrorFeedback on fp32 matrices (momentum, Newton-Schulz, update).
  muon_pass  ``ds_async.optim.muon_pass.muon_pass_`` + EF from bf16 gradients, writing two bf16 outputs (the module's
             weights and a weight-version slot): the bf16 fast path's Muon step.
Under ``torchrun --nproc_per_node D`` (one GPU a process, NCCL) the variant is ``split_dist``: the real
``ds_async.optim.ns_split.orthogonalise_split`` (one all-gather per shape, overlapping the next shape's
Newton-Schulz), every rank checked bit-equal to the unsplit ``orthogonalise_batched`` (rank 0 reports the slowest
rank's median ms).
Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from ds_async.flops import newton_schulz_flops
from ds_async.optim import ErrorFeedback, Muon
from ds_async.optim.muon import orthogonalise_batched, zeropower_matmul
from ds_async.optim.muon_pass import muon_hyper, muon_pass_
from ds_async.optim.ns_split import assign, orthogonalise_split


def stage_shapes(hidden: int, ffn: int, heads: int, kv_heads: int, layers: int) -> list[tuple[int, int]]:
    """nn.Linear weights (out, in) of ``layers`` LLaMA decoder layers, in module order."""
    kv = hidden // heads * kv_heads
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden),
             (hidden, ffn)]
    return layer * layers


def timed_ms(fn, iters: int, warmup: int, cuda: bool) -> float:
    """Median ms of ``fn`` over ``iters`` runs after ``warmup`` untimed ones (CUDA events on GPUs)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def merged(directions: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Newton-Schulz with tall matrices transposed first, so that they batch with the wide ones of that shape."""
    oriented = [d.mT if d.size(-2) > d.size(-1) else d for d in directions]
    return [o.mT if d.size(-2) > d.size(-1) else o
            for d, o in zip(directions, orthogonalise_batched(oriented, steps))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    # launch/bench/bench_pipeline.py's defaults (hidden 2048, ffn 5632, 16 heads); tiny on CPU
    ap.add_argument("--hidden", type=int, default=2048 if cuda else 128)
    ap.add_argument("--ffn", type=int, default=5632 if cuda else 352)
    ap.add_argument("--heads", type=int, default=16 if cuda else 4)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (bench_pipeline.py has no GQA)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers per stage")
    ap.add_argument("--steps", type=int, default=5, help="Newton-Schulz iterations")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default="eager,matmul,compiled,merged,split2,split4,split8,muon_step,muon_pass")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    a = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    shapes = stage_shapes(a.hidden, a.ffn, a.heads, a.kv_heads or a.heads, a.layers)
    flops = newton_schulz_flops(shapes, a.steps)
    gen = torch.Generator(device=device).manual_seed(0)
    directions = [torch.randn(s, generator=gen, device=device).bfloat16() for s in shapes]
    want = orthogonalise_batched(directions, a.steps)
    base = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__, hidden=a.hidden,
                ffn=a.ffn, heads=a.heads, kv_heads=a.kv_heads or a.heads, layers=a.layers, matrices=len(shapes),
                ns_steps=a.steps, ns_tflop=flops / 1e12, iters=a.iters)
    rows = []

    def report(variant: str, ms: float, got=None, **extra):
        row = dict(base, variant=variant, ms=round(ms, 3), tflops=round(flops / (ms * 1e-3) / 1e12, 2), **extra)
        if got is not None:
            row["bit_equal"] = all(torch.equal(g, w) for g, w in zip(got, want))
            row["max_abs_diff"] = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
        print(json.dumps(row), flush=True)
        rows.append(row)

    if world > 1:
        dist = torch.distributed
        got = orthogonalise_split(directions, a.steps)
        ms = torch.tensor(timed_ms(lambda: orthogonalise_split(directions, a.steps), a.iters, a.warmup, cuda),
                          device=device)
        equal = torch.tensor(float(all(torch.equal(g, w) for g, w in zip(got, want))), device=device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)
        if dist.get_rank() == 0:
            report("split_dist", ms.item(), replicas=world, split_bit_equal=bool(equal.item()))
        dist.destroy_process_group()
        a.variants = ""
    for variant in filter(None, a.variants.split(",")):
        if variant == "eager":
            report(variant, timed_ms(lambda: orthogonalise_batched(directions, a.steps), a.iters, a.warmup, cuda),
                   orthogonalise_batched(directions, a.steps))
        elif variant == "compiled":
            fn = torch.compile(orthogonalise_batched, dynamic=False)
            t0 = time.perf_counter()
            got = fn(directions, a.steps)
            compile_s = time.perf_counter() - t0
            report(variant, timed_ms(lambda: fn(directions, a.steps), a.iters, a.warmup, cuda), got,
                   compile_s=round(compile_s, 1))
        elif variant == "matmul":
            report(variant, timed_ms(lambda: orthogonalise_batched(directions, a.steps, zeropower=zeropower_matmul),
                                     a.iters, a.warmup, cuda),
                   orthogonalise_batched(directions, a.steps, zeropower=zeropower_matmul))
        elif variant == "merged":
            report(variant, timed_ms(lambda: merged(directions, a.steps), a.iters, a.warmup, cuda),
                   merged(directions, a.steps))
        elif variant.startswith("split"):
            d = int(variant.removeprefix("split"))
            owners = assign(shapes, d, a.steps)
            per_rank, equal = [], True
            for r in range(d):
                idx = [i for i, o in enumerate(owners) if o == r]
                mine = [directions[i] for i in idx]
                if not mine:
                    per_rank.append(0.0)
                    continue
                per_rank.append(timed_ms(lambda: orthogonalise_batched(mine, a.steps), a.iters, a.warmup, cuda))
                equal &= all(torch.equal(g, want[i]) for i, g in zip(idx, orthogonalise_batched(mine, a.steps)))
            widest = max(sum(directions[i].numel() for i, o in enumerate(owners) if o == r) for r in range(d))
            report(variant, max(per_rank), replicas=d, split_bit_equal=equal,
                   replica_ms=[round(t, 3) for t in per_rank], gather_mb=round(d * widest * 2 / 2 ** 20, 1),
                   ideal_ms=round(per_rank and sum(per_rank) / d, 3))
        elif variant in ("muon_step", "muon_pass"):
            ms, check = muon_step_ms(variant, shapes, a, device, cuda)
            report(variant, ms, **check)
        else:
            raise SystemExit(f"unknown variant {variant!r}")
        if cuda:
            torch.cuda.empty_cache()
    if a.out and rows:
        with open(a.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def muon_step_ms(variant: str, shapes, a, device, cuda: bool) -> tuple[float, dict]:
    """One Muon + EF step of the stage's matrices, timed: the class on fp32 parameters, or the bf16 fast path's
    pass. For the pass also how far its first step lands from the class's (compiled on GPUs: last-bit rounding;
    bf16 Newton-Schulz can amplify a flipped bit of a direction)."""
    gen = torch.Generator(device=device).manual_seed(1)
    init = [torch.randn(s, generator=gen, device=device) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen, device=device).bfloat16() for s in shapes]
    group = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, lr_rule="original")
    params = [torch.nn.Parameter(m.clone()) for m in init]
    for p, g in zip(params, grads):
        p.grad = g.float()
    opt = Muon([dict(params=params, use_muon=True, **group)], ns_steps=a.steps, correction=ErrorFeedback(1.0))
    if variant == "muon_step":
        return timed_ms(opt.step, a.iters, a.warmup, cuda), {}
    masters = [m.clone() for m in init]
    momenta = [torch.zeros_like(m) for m in masters]
    prevs = [torch.zeros_like(m) for m in masters]
    outs = [[torch.empty_like(m, dtype=torch.bfloat16) for m in masters] for _ in range(2)]
    scale = torch.tensor(1.0, device=device)
    hyper = muon_hyper(group, shapes, device, 1.0)

    def step():
        muon_pass_(masters, grads, momenta, prevs, outs, hyper, scale, torch.float32, ns_steps=a.steps)
    step()
    opt.step()
    moved = [(m - p.detach()).norm() / (p.detach() - i).norm() for m, p, i in zip(masters, params, init)]
    check = dict(first_step_rel_diff_vs_class=max(x.item() for x in moved),
                 first_step_bit_equal=all(torch.equal(m, p.detach()) for m, p in zip(masters, params)))
    return timed_ms(step, a.iters, a.warmup, cuda), check


if __name__ == "__main__":
    main()
