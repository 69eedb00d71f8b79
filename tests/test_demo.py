"""The README's run command, shortened by a flag: it trains sync 1F1B and 2BW + Muon + EF on the same data, logs to
tensorboard, draws each loss curve and prints a side-by-side comparison with one plot."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "bash launch/demo_cpu.sh"


def test_readme_names_the_command():
    assert COMMAND in (ROOT / "README.md").read_text()


def test_demo_run_smoke():
    name = f"pytest-smoke-{os.getpid()}"
    runs = {schedule: ROOT / "runs" / f"{name}-{schedule}" for schedule in ("1f1b", "2bw")}
    plot = ROOT / "runs" / f"{name}-compare.png"
    env = {**os.environ, "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    try:
        proc = subprocess.run([*COMMAND.split(), "--max-steps", "3", "--run-name", name], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        assert proc.stdout.count("ds_async summary:") == 2
        assert len(re.findall(r"^  steps +3 \(", proc.stdout, re.M)) == 2
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        for schedule, run_dir in runs.items():
            summary = json.loads((run_dir / "summary.json").read_text())
            assert len(summary["history"]["train"]) == 3 and summary["final_validation_loss"] is not None
            assert list(run_dir.glob("events.out.tfevents.*")) and (run_dir / "loss.png").stat().st_size > 1000
            manifest = json.loads((run_dir / "manifest.json").read_text())
            assert manifest["ds_async"]["schedule"] == schedule and manifest["code"]["torch"]
            assert manifest["ds_async"]["data"]["train"] == "python:docs"  # ships with Python: no install
            assert manifest["deepspeed"]["optimizer"]["type"] == "Muon"
            assert manifest["ds_async"]["correction"]["type"] == ("ef" if schedule == "2bw" else "none")
            events = EventAccumulator(str(run_dir)).Reload()
            assert {"train/loss", "train/lr", "train/tokens_per_s", "train/tokens", "validation/loss"} <= set(
                events.Tags()["scalars"])
        # The side-by-side summary: both runs, their losses, speed and the bubble each schedule leaves.
        table = proc.stdout[proc.stdout.index("run "):]
        assert f"{name}-1f1b" in table and f"{name}-2bw" in table and "Muon + EF" in table
        bubble = next(line for line in table.splitlines() if line.startswith("bubble"))
        sync, async_ = (float(v) for v in bubble.split()[-2:])
        assert sync == 0.2 and async_ < sync  # (p - 1) / (m + p - 1) at p = 2, m = 4; 2BW warms up once
        assert plot.stat().st_size > 1000
    finally:
        for run_dir in runs.values():
            shutil.rmtree(run_dir, ignore_errors=True)
        plot.unlink(missing_ok=True)
