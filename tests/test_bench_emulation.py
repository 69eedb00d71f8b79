"""``launch/bench/bench_emulation.py``: its steady step time (from the logger's running means to the exact mean step
after the read-ahead phase) and the configs of its rows."""
import importlib.util
from pathlib import Path

from ds_async.study.matrices import LONG_OPTIMIZERS, OPTIMIZERS

spec = importlib.util.spec_from_file_location(
    "bench_emulation", Path(__file__).resolve().parents[1] / "launch" / "bench" / "bench_emulation.py")
bench_emulation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_emulation)


def running_means(spans: list[float], window: int, warmup: int) -> list[tuple[int, float]]:
    """``summary["history"]["step_time_s"]`` as ``ds_async.metrics.MetricsLogger`` logs it: at each step after the
    warm-up, the mean of the last ``window`` step spans (fewer at first)."""
    out = []
    for step in range(warmup + 1, len(spans) + 1):
        last = spans[max(warmup, step - window):step]
        out.append((step, sum(last) / len(last)))
    return out


def test_steady_step_time_is_the_mean_step_after_the_read_ahead():
    spans = [0.07] * 40 + [0.1 + 0.001 * (i % 7) for i in range(300)]  # 40 fast steps, then slower, uneven ones
    history = running_means(spans, window=20, warmup=2)
    last = 100 + (len(spans) - 100) // 20 * 20
    want = sum(spans[100:last]) / (last - 100)
    assert abs(bench_emulation.steady_step_time(history, 20) - want) < 1e-12
    assert abs(bench_emulation.steady_step_time(history, 20) - sum(spans[2:]) / len(spans[2:])) > 1e-3
    assert bench_emulation.steady_step_time(history[:110], 20) is None  # no whole window past step 100


def test_a_row_named_by_optimizer_and_variant_is_the_studys_run_config():
    """``CONFIG:OPTIMIZER-VARIANT`` rows take the study's optimizer blocks (the long table's for ``long.json``) and
    its schedule variants, then the ``--set`` keys."""
    _, long = bench_emulation.row_config("launch/study/long.json:muon-2bw+ef", {"ds_async.train.steps": 5})
    assert long["optimizer"] == LONG_OPTIMIZERS["muon"]["optimizer"]
    assert long["ds_async"]["performance"]["fused_optimizer_step"] is True
    assert long["ds_async"]["schedule"] == "2bw" and long["ds_async"]["correction"] == {"type": "ef", "lambda": 1.0}
    assert long["ds_async"]["train"] == {"steps": 5}
    _, base = bench_emulation.row_config("launch/study/base.json:adamw-sync", {})
    assert base["optimizer"] == OPTIMIZERS["adamw"]["optimizer"] and base["ds_async"]["schedule"] == "1f1b"
