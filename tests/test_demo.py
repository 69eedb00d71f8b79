"""The README's run command, shortened by a flag: it trains, logs to tensorboard and draws the loss curve."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "bash launch/demo_cpu.sh"


def test_readme_names_the_command():
    assert COMMAND in (ROOT / "README.md").read_text()


def test_demo_run_smoke():
    run_name = f"pytest-smoke-{os.getpid()}"
    run_dir = ROOT / "runs" / run_name
    env = {**os.environ, "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    try:
        proc = subprocess.run([*COMMAND.split(), "--max-steps", "3", "--run-name", run_name], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        assert "ds_async summary: steps=3" in proc.stdout
        summary = json.loads((run_dir / "summary.json").read_text())
        assert len(summary["history"]["train"]) == 3 and summary["final_validation_loss"] is not None
        assert list(run_dir.glob("events.out.tfevents.*")) and (run_dir / "loss.png").stat().st_size > 1000
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["ds_async"]["schedule"] == "1f1b" and manifest["code"]["torch"]
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(str(run_dir)).Reload()
        assert {"train/loss", "train/lr", "train/tokens_per_s", "train/tokens", "validation/loss"} <= set(
            events.Tags()["scalars"])
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
