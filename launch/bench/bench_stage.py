"""One pipeline stage's passes on one GPU: host issue time vs GPU time, per compile scope.

    python launch/bench/bench_stage.py --layers 4 --out rows.jsonl

A flush-free pipeline keeps the GPU busy only if the host issues each forward and backward faster than the GPU
runs it. This times both for one stage of the benchmark LLaMA (bf16, two weight versions swapped in as the 2BW
engine does, micro-batches interleaved 1F1B-style with two in flight):

- ``host_ms``: wall time of the host thread inside the pass while the GPU is held busy by a sleep kernel, so the
  host does not wait for the device: issue cost (Python, dispatch, guards, kernel launches). The median over
  passes. ``*_host_max_ms`` shows a pass that waited for the device anyway: measured, one pass per repeat waits
  out the whole sleep while ``synchronising_calls`` (torch's sync debug mode) names none, i.e. the launch queue
  filled up (a repeat issues ~1,000 kernels), not a synchronisation.
- ``gpu_ms``: CUDA-event time of the same passes, issued back to back.

Scopes: ``eager``; ``layer`` (``torch.compile`` per decoder layer, ``performance.compile``); ``stage`` (one
compiled region over all the stage's layers, ``performance.compile_scope = "stage"``); ``graphs`` (that region's
passes replayed as CUDA graphs, ``performance.cuda_graphs``); ``graphs-eager`` (uncompiled layers replayed).
``--fp8 RECIPE`` converts the layers' products as ``performance.fp8`` does. Results:
``launch/bench/RESULTS.md``; scopes tried and dropped (C++ wrapper, CUDA graphs, Triton GEMMs, fused projections):
``CHANGELOG.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings

import torch
import torch._functorch.config
import torch._inductor.config
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig

from ds_async import fp8 as fp8_products
from ds_async.metrics import code_version
from ds_async.models import compile_layers, compiled_stage, llama
from ds_async.pipe.graphs import GraphedStage
from ds_async.pipe.versions import WeightVersions


def build(args, scope: str, fp8: str | None = None):
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads or args.heads, num_hidden_layers=args.layers,
                      vocab_size=32000, max_position_embeddings=args.seq_len, tie_word_embeddings=False)
    llama.check_supported(cfg)
    layers = [llama.DecoderLayerPipe(cfg, i) for i in range(args.layers)]
    stage = torch.nn.ModuleList(layers).to("cuda", torch.bfloat16)
    if fp8 is not None:  # as the pipeline converts them: before compiling, parameters unchanged
        for layer in layers:
            fp8_products.convert(layer, fp8)
    if scope == "layer":
        compile_layers(layers)
    forward = torch.nn.Sequential(*layers)  # layer by layer, as DeepSpeed's PipelineModule runs them
    if scope in ("stage", "graphs"):
        forward = compiled_stage(layers)
    if scope in ("graphs", "graphs-eager"):
        forward = GraphedStage(layers, forward)
    versions = WeightVersions(stage, 2)
    versions.publish(1, needed_from=0)
    return forward, versions


def passes(forward, versions, x, grad, n: int):
    """n micro-batches, 1F1B with two in flight, alternating weight versions; yields ('F'|'B', thunk)."""
    outs = {}
    for k in range(n + 1):
        if k < n:
            def fwd(k=k):
                versions.activate(k % 2)
                outs[k] = forward(x)
            yield "F", fwd
        if k >= 1:
            def bwd(k=k - 1):
                outs.pop(k).backward(grad)
                versions.backward_done(k % 2)
            yield "B", bwd


def sdpa_choice(args) -> str:
    """The SDPA backend torch picks for this stage's attention shapes (under the active backend restriction)."""
    hd = args.hidden // args.heads
    q = torch.randn(args.micro_batch_size, args.heads, args.seq_len, hd, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name


def host_profile(forward, versions, x, grad, args) -> dict:
    """Host-side op table of one repeat of passes (GPU held busy), heaviest self CPU time first, and the number of
    kernels a micro-batch (forward + backward) launches."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(int(args.sleep_cycles))
        for _, thunk in passes(forward, versions, x, grad, args.micro_batches):
            thunk()
        torch.cuda.synchronize()
    events = prof.key_averages()
    n = args.micro_batches
    top = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)[:25]
    return {"kernels_per_mb": round(sum(e.count for e in events if e.device_type == DeviceType.CUDA) / n, 1),
            "ops": [{"op": e.key[:80], "calls_per_mb": round(e.count / n, 1),
                     "self_ms_per_mb": round(e.self_cpu_time_total / 1000 / n, 3)} for e in top]}


def measure(args, scope: str, fp8: str | None = None) -> dict:
    torch.manual_seed(0)
    forward, versions = build(args, scope, fp8)
    shape = (args.micro_batch_size, args.seq_len, args.hidden)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    for _, thunk in passes(forward, versions, x, grad, 4):
        thunk()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0

    host = {"F": [], "B": []}
    torch.cuda.set_sync_debug_mode("warn")  # names any synchronising torch call in the passes
    with warnings.catch_warnings(record=True) as syncs:
        warnings.simplefilter("always")
        for _ in range(args.repeats):
            torch.cuda._sleep(int(args.sleep_cycles))  # the device is busy: the host does not wait for it below
            for kind, thunk in passes(forward, versions, x, grad, args.micro_batches):
                t = time.perf_counter()
                thunk()
                host[kind].append(time.perf_counter() - t)
            torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)

    gpu = {"F": [], "B": []}
    for _ in range(args.repeats):
        for kind, thunk in passes(forward, versions, x, grad, args.micro_batches):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            thunk()
            end.record()
            gpu[kind].append((start, end))
    torch.cuda.synchronize()
    n = args.repeats * args.micro_batches
    row = {"scope": scope, "sdpa": sdpa_choice(args), "first_passes_s": round(warm_s, 2),
           "synchronising_calls": sorted({str(w.message)[:200] for w in syncs})[:5]}
    for kind, name in (("F", "forward"), ("B", "backward")):
        row[f"{name}_host_ms"] = round(1000 * statistics.median(host[kind]), 3)
        row[f"{name}_host_max_ms"] = round(1000 * max(host[kind]), 3)
        row[f"{name}_gpu_ms"] = round(sum(s.elapsed_time(e) for s, e in gpu[kind]) / n, 3)
    if args.host_profile:
        row["host_ops"] = host_profile(forward, versions, x, grad, args)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scopes", default="eager,layer,stage",
                    help="comma list of eager, layer, stage, graphs (the stage region replayed as CUDA graphs: "
                    "performance.cuda_graphs), graphs-eager (uncompiled layers replayed)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers in the stage")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    ap.add_argument("--fp8", default="none",
                    help="comma list of performance.fp8 recipes (rowwise, tensorwise, ...) or none, each a run")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sleep-cycles", type=float, default=2e9, help="GPU clock cycles the host measurement hides")
    ap.add_argument("--sdpa", default="auto",
                    help="comma list of SDPA backends to restrict attention to, each a run: auto (torch's choice), "
                         "flash, cudnn, efficient")
    ap.add_argument("--blas", default="default",
                    help="comma list of torch.backends.cuda.preferred_blas_library values, each a run")
    ap.add_argument("--host-profile", action="store_true", help="add the host's op table (torch.profiler, CPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if args.sdpa != "auto":
        # The compile caches do not key on the SDPA restriction: a cached graph would keep the first backend.
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    unknown = set(args.scopes.split(",")) - {"eager", "layer", "stage", "graphs", "graphs-eager"}
    if unknown:
        ap.error(f"unknown scopes {sorted(unknown)}")
    runs = [(s, b, lib, f) for s in args.scopes.split(",") for b in args.sdpa.split(",")
            for lib in args.blas.split(",") for f in args.fp8.split(",")]
    for scope, sdpa, blas, fp8 in runs:
        if blas != "default":
            torch.backends.cuda.preferred_blas_library(blas)
        try:
            with sdpa_kernel(backends[sdpa]) if sdpa != "auto" else contextlib.nullcontext():
                result = measure(args, scope, None if fp8 == "none" else fp8)
        except Exception as e:  # a restricted SDPA backend may not support these shapes: say so in the row
            result = {"scope": scope, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row = {"bench": "stage_passes", **result, "fp8": None if fp8 == "none" else fp8, "sdpa_restricted_to": sdpa,
               "blas": str(torch.backends.cuda.preferred_blas_library()), "layers": args.layers,
               "seq_len": args.seq_len,
               "hidden": args.hidden, "ffn": args.ffn, "heads": args.heads, "kv_heads": args.kv_heads or args.heads,
               "micro_batch_size": args.micro_batch_size, "command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "code": code_version()}
        print("STAGE " + json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
