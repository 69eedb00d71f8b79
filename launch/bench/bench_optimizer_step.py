"""Optimizer step of one pipeline stage, alone on one GPU: where Muon+EF's time goes.

    python launch/bench/bench_optimizer_step.py --out rows.jsonl

A stage of the ~0.9B LLaMA (``--layers`` decoder layers of hidden 2048, ffn 5632, fp32 weights as under
autocast) gets random gradients; each optimizer steps it ``--steps`` times. Per optimizer one JSON row: the GPU
time of a whole ``step()`` (CUDA events, median), the host time to issue it (the thread that also issues the
pipeline's forward and backward kernels), and for Muon the Newton-Schulz part alone with its rate in TFLOP/s.
``--experts E`` makes the layers Mixtral's (E experts of ffn each, fused ``gate_up_proj``); there ``muon`` and
``muon-ef`` split each expert's gate and up (the default) and ``muon-fused`` / ``muon-ef-fused`` orthogonalise
them as one matrix (``split_gate_up = false``). A ``-pass`` suffix (``muon-ef-pass``, ``muon-ef-fused-pass``) steps
the same optimizer the way the engine's ``fused_optimizer_step`` does: ``hybrid_muon_step_`` from bf16 gradients
into two bf16 outputs (the module's weights and a weight-version slot).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, MixtralConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from ds_async.flops import newton_schulz_flops
from ds_async.metrics import code_version
from ds_async.models.mixtral import MoeDecoderLayerPipe
from ds_async.optim.corrections import ErrorFeedback
from ds_async.optim.muon import (Muon, momentum_directions, muon_param_groups, orthogonalise_batched,
                                 orthogonalise_blocks, row_blocks, split_rows)
from ds_async.optim.muon_pass import hybrid_muon_step_
from ds_async.optim.optimizers import AdamW


def median_ms(fn, steps: int, warmup: int) -> tuple[float, float]:
    """(median ms until the device finished, median ms for the host to issue) of ``fn``."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    done, host = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        sync()
        done.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(done), statistics.median(host)


def print_host_profile(name: str, fn, rows: int = 15) -> None:
    """One call of ``fn`` under torch's profiler (CPU and, on a GPU, the CUDA runtime's calls): its top ``rows``
    calls by self CPU time, the host's share of the step (a wait for the device shows as the runtime call that
    blocks, e.g. cudaStreamSynchronize or cudaFree, or as "Command Buffer Full" when the launch queue is full)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    print(f"PROFILE {name}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows),
          flush=True)


def build_stage(a) -> torch.nn.Module:
    if a.experts:  # the library's layer: it declares the router's and the expert stacks' roles
        Layer = MoeDecoderLayerPipe
        cfg = MixtralConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_attention_heads=a.heads,
                            num_key_value_heads=a.heads, vocab_size=a.vocab, num_hidden_layers=a.layers,
                            num_local_experts=a.experts, num_experts_per_tok=2)
    else:
        Layer = LlamaDecoderLayer
        cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_attention_heads=a.heads,
                          num_key_value_heads=a.heads, vocab_size=a.vocab, num_hidden_layers=a.layers)
    mods = [Layer(cfg, i) for i in range(a.layers)]
    if a.embedding:
        mods.insert(0, torch.nn.Embedding(a.vocab, a.hidden))
    return torch.nn.Sequential(*mods).to("cuda" if torch.cuda.is_available() else "cpu")


def make_optimizer(name: str, model: torch.nn.Module):
    if name == "torch-adamw-fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    if name == "adamw":
        return AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    flags = muon_flags(name)
    correction = ErrorFeedback(1.0) if "ef" in flags else None
    groups = muon_param_groups(model, lr=0.02, weight_decay=0.01, adam_lr=1e-4, split_gate_up="fused" not in flags)
    return Muon(groups, correction=correction)


def muon_flags(name: str) -> set[str]:
    """The words after ``muon`` in a Muon variant's name (``muon-ef-fused-pass`` -> ef, fused, pass)."""
    base, *flags = name.split("-")
    unknown = set(flags) - {"ef", "fused", "pass"}
    if base != "muon" or unknown:
        raise SystemExit(f"unknown optimizer {name!r}")
    return set(flags)


def step_function(name: str, opt):
    """What one step of optimizer ``name`` runs: the class's ``step()``, or for ``-pass`` the bf16 fast path's."""
    if not name.startswith("muon") or "pass" not in muon_flags(name):
        return opt.step
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad.bfloat16() for p in params]
    outs = [[torch.empty_like(p, dtype=torch.bfloat16) for p in params] for _ in range(2)]
    scale = torch.ones((), device=params[0].device)
    return lambda: hybrid_muon_step_(opt, grads, scale, outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--embedding", action="store_true", help="add the embedding (pipeline stage 0)")
    ap.add_argument("--experts", type=int, default=0, help="Mixtral layers of this many experts (0: LLaMA's)")
    ap.add_argument("--optimizers", default="torch-adamw-fused,adamw,muon,muon-ef")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="after timing each optimizer, profile one more step and print its host's top calls "
                         "(self CPU time: a host wait shows as the runtime call it waits in)")
    a = ap.parse_args()

    torch.manual_seed(0)
    model = build_stage(a)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    base = {"layers": a.layers, "hidden": a.hidden, "ffn": a.ffn, "experts": a.experts, "embedding": a.embedding,
            "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "code": code_version()}
    rows = []
    for name in a.optimizers.split(","):
        opt = make_optimizer(name, model)
        step = step_function(name, opt)
        done, host = median_ms(step, a.steps, a.warmup)
        if a.profile:
            print_host_profile(name, step)
        row = dict(base, optimizer=name, step_ms=round(done, 2), issue_ms=round(host, 2))
        if name.startswith("muon"):
            groups = [(g, row_blocks(g)) for g in opt.param_groups if g["use_muon"]]  # matrix, then gate_up
            dirs = [momentum_directions([p.grad for p in g["params"]],
                                        [opt.state[p]["momentum_buffer"].clone() for p in g["params"]],
                                        momentum=0.95, nesterov=True) for g, _ in groups]
            flops = sum(newton_schulz_flops([split_rows(d, k).shape for d in ds], 5)
                        for ds, (_, k) in zip(dirs, groups))

            def newton_schulz():
                for ds, (_, k) in zip(dirs, groups):
                    orthogonalise_blocks(orthogonalise_batched, ds, k)

            ns, _ = median_ms(newton_schulz, a.steps, a.warmup)
            row.update(newton_schulz_ms=round(ns, 2), newton_schulz_tflops=round(flops / ns / 1e9, 1))
        del opt
        print("OPTSTEP " + json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
