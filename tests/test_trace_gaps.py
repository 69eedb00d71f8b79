"""``launch/bench/trace_gaps.py`` on a hand-written chrome trace: every gap charged to the right instruction and cause."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("trace_gaps", ROOT / "launch" / "bench" / "trace_gaps.py")
trace_gaps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_gaps)


def _kernel(name, ts, dur, stream, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": corr}}


def _launch(ts, corr, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "args": {"correlation": corr}}


def _mark(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "args": {}}


def test_gaps_are_charged_to_the_launching_instruction_and_split_by_cause():
    events = [
        _mark("pipe:ForwardPass", 0, 22.5), _mark("pipe:RecvGrad", 23, 2.5), _mark("pipe:BackwardPass", 26, 100),
        _mark("other:not_ours", 50, 5),
        _kernel("fwd_a", 10, 10, 7, 1), _launch(1, 1),
        _kernel("fwd_b", 24, 6, 7, 2), _launch(22, 2),              # launched after the stream ran dry at 20: host, 4
        _kernel("bwd_a", 60, 20, 7, 3), _launch(27, 3, "cuda_driver"),  # launched before fwd_b ended: the stream waited, 30
        _kernel("bwd_b", 81, 9, 7, 4), _launch(41, 4),              # 1 us gap: below the threshold
        _kernel("ncclDevKernel_SendRecv", 30, 29, 20, 5), _launch(32, 5),
        _kernel("adam", 70, 40, 9, 6), _launch(52, 6),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 37, "dur": 12, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 5, "dur": 3, "args": {}},  # no stall
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpy", "ts": 6, "dur": 2, "args": {}},
    ]
    r = trace_gaps.gap_report({"traceEvents": events})
    assert r["compute_stream"] == 7
    assert r["window_ms"] == pytest.approx(0.080)
    assert r["kernel_ms"] == pytest.approx(0.045)
    assert r["gaps_ms"] == {"BackwardPass/wait": pytest.approx(0.030), "ForwardPass/host": pytest.approx(0.004)}
    assert r["host_blocking_ms"] == {"BackwardPass/cudaStreamSynchronize": pytest.approx(0.012),
                                     "ForwardPass/cudaMemcpy": pytest.approx(0.002)}
    assert r["other_streams_kernel_ms"] == {9: pytest.approx(0.04)}
    assert r["nccl_kernel_ms_by_stream"] == {20: pytest.approx(0.029)}
