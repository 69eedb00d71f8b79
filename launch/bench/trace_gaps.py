"""Where a pipeline stage's GPU waits: the gaps on its compute stream in a torch.profiler chrome trace.

    python launch/bench/trace_gaps.py PROFILE_DIR/trace_rank*.json

``bench_pipeline.py --profile DIR`` writes one trace per rank with every pipeline instruction marked
(``pipe:ForwardPass``, ``pipe:RecvGrad``, ...). For each rank this reports the compute stream's kernel time and its
gaps, each gap charged to the instruction during which the host launched the kernel that ended it, and split by
cause: ``host`` when that kernel was launched after the stream ran dry (the host was late), ``wait`` when it was
launched in time and the stream waited on something else (a receive, another stream, a peer's send). It also sums
the host's blocking CUDA calls (synchronizes, synchronous copies, allocations) per instruction: why a host is late.
"""
from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
PREFIX = "pipe:"
STALLS = ("cudaMemcpy", "cudaMalloc", "cudaFree")  # synchronous copy, allocation (slow), free (waits for the GPU)


def _stalls_host(name: str) -> bool:
    return "Synchronize" in name or name in STALLS


def _spans(events):
    return sorted((e["ts"], e["ts"] + e.get("dur", 0), e) for e in events)


def gap_report(trace: dict, min_gap_us: float = 2.0) -> dict:
    """Summarise one rank's trace; times in milliseconds over the compute stream's active window."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    busy_by_stream = defaultdict(float)
    for e in gpu:
        if "nccl" not in e["name"].lower():
            busy_by_stream[e["args"]["stream"]] += e["dur"]
    compute = max(busy_by_stream, key=busy_by_stream.get)
    kernels = _spans(e for e in gpu if e["args"]["stream"] == compute)
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    marks = _spans(e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(PREFIX))
    mark_starts = [s for s, _, _ in marks]

    def label(ts: float) -> str:
        # innermost instruction span containing ts (instructions do not nest, so the last one starting before it)
        i = bisect.bisect_right(mark_starts, ts) - 1
        while i >= 0:
            s, e, ev = marks[i]
            if s <= ts <= e:
                return ev["name"][len(PREFIX):]
            if e < ts:
                break
            i -= 1
        return "(outside instructions)"

    gaps = defaultdict(float)
    end = kernels[0][1]
    for start, stop, ev in kernels[1:]:
        if start - end > min_gap_us:
            launched = launches.get(ev["args"].get("correlation"))
            cause = "host" if launched is not None and launched > end else "wait"
            gaps[(label(launched) if launched is not None else "(unknown)", cause)] += start - end
        end = max(end, stop)
    # Host calls that wait for the device, by instruction: a host that blocks inside a pass falls behind the GPU.
    blocking = defaultdict(float)
    for e in events:
        if e.get("cat") in LAUNCH_CATS and _stalls_host(e["name"]):
            blocking[f"{label(e['ts'])}/{e['name']}"] += e.get("dur", 0)
    window = end - kernels[0][0]
    busy = busy_by_stream[compute]
    others = {s: round(t / 1e3, 3) for s, t in busy_by_stream.items() if s != compute}
    nccl = defaultdict(float)
    for e in gpu:
        if "nccl" in e["name"].lower():
            nccl[e["args"]["stream"]] += e["dur"]
    return {"compute_stream": compute, "window_ms": round(window / 1e3, 3), "kernel_ms": round(busy / 1e3, 3),
            "gap_ms": round(sum(gaps.values()) / 1e3, 3),
            "gaps_ms": {f"{k[0]}/{k[1]}": round(v / 1e3, 3) for k, v in sorted(gaps.items(), key=lambda kv: -kv[1])},
            "host_blocking_ms": {k: round(v / 1e3, 3) for k, v in sorted(blocking.items(), key=lambda kv: -kv[1])},
            "other_streams_kernel_ms": others, "nccl_kernel_ms_by_stream": {s: round(t / 1e3, 3) for s, t in nccl.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=8, help="largest gap buckets shown per rank")
    a = ap.parse_args()
    for path in a.traces:
        with open(path) as f:
            r = gap_report(json.load(f))
        top = list(r["gaps_ms"].items())[:a.top]
        print(f"{path}: window {r['window_ms']} ms, compute-stream kernels {r['kernel_ms']} ms, "
              f"gaps {r['gap_ms']} ms; other streams {r['other_streams_kernel_ms']}; nccl {r['nccl_kernel_ms_by_stream']}")
        for k, v in top:
            print(f"    {v:8.2f} ms  {k}")
        for k, v in list(r["host_blocking_ms"].items())[:a.top]:
            print(f"    {v:8.2f} ms  host blocked in {k}")


if __name__ == "__main__":
    main()
