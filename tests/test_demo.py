"""The README's run command, shortened by a flag: it trains sync 1F1B and 2BW + Muon + EF on the same data, logs to
tensorboard, draws each loss curve and prints a side-by-side comparison with one plot."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ds_async import plan
from ds_async import config as cfgmod

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
        table = proc.stdout[proc.stdout.index("\nrun "):]
        assert f"{name}-1f1b" in table and f"{name}-2bw" in table and "Muon + EF" in table
        bubble = next(line for line in table.splitlines() if line.startswith("bubble"))
        sync, async_ = (float(v.rstrip("%")) / 100 for v in bubble.split()[-2:])
        assert sync == 0.2 and async_ < sync  # (p - 1) / (m + p - 1) at p = 2, m = 4; 2BW warms up once
        assert plot.stat().st_size > 1000
        # The table's training loss is summary.json's (the last step's), named so; the comparison and what a CPU
        # run can show follow it.
        summaries = [json.loads((run_dir / "summary.json").read_text()) for run_dir in runs.values()]
        last = next(line for line in table.splitlines() if line.startswith("train loss (last step)"))
        assert last.split()[-2:] == [f"{s['final_train_loss']:.4f}" for s in summaries]
        assert f"{name}-2bw vs {name}-1f1b:" in table and "the schedules' bubbles alone allow" in table
        assert "What a CPU run shows, and what it does not:" in table and "bash launch/demo_gpu.sh" in table
        _notebooks_read_the_demo_runs(list(runs.values()))
    finally:
        for run_dir in runs.values():
            shutil.rmtree(run_dir, ignore_errors=True)
        plot.unlink(missing_ok=True)


def _notebooks_read_the_demo_runs(run_dirs: list[Path]) -> None:
    """Both notebooks on a user's runs (``DS_ASYNC_RUNS``): your_runs.ipynb shows the table, the curves and the
    2BW-vs-sync comparison; the study's notebook runs without an error and points at it."""
    import nbclient
    import nbformat

    env = os.pathsep.join(map(str, run_dirs))
    text = {}
    for name in ("your_runs", "loss_curves"):
        nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
        os.environ["DS_ASYNC_RUNS"] = env
        try:
            nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                    resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
        finally:
            del os.environ["DS_ASYNC_RUNS"]
        outputs = [out for cell in nb.cells for out in cell.get("outputs", [])]
        errors = [f"{out.get('ename')}: {out.get('evalue')}" for out in outputs if out.output_type == "error"]
        assert not errors, (name, errors)
        text[name] = "\n".join(out.get("text", "") + "".join(out.get("data", {}).get(k, "") for k in
                                                              ("text/plain", "text/markdown")) for out in outputs)
        if name == "your_runs":
            assert sum("image/png" in out.get("data", {}) for out in outputs) == 1
    mine = text["your_runs"]
    assert "2 finished runs" in mine and all(d.name in mine for d in run_dirs), mine
    assert "validation loss" in mine and "tokens/s (steady steps)" in mine
    assert f"{run_dirs[1].name} vs {run_dirs[0].name}:" in mine and "as fast (steady tokens/s)" in mine
    assert "notebooks/your_runs.ipynb compares any runs" in text["loss_curves"]


def test_gpu_demo_configs_are_valid_and_it_needs_gpus(tmp_path):
    """``bash launch/demo_gpu.sh``: without GPUs one line saying what it needs; its two configs (one stage per GPU)
    load under the strict config, differ only in schedule and correction, and the planner finds them fitting an
    80 GiB card at 4 GPUs."""
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", "launch/demo_gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "demo_gpu: needs 2 or more GPUs (a pipeline stage each); this host has 0. On CPU: bash launch/demo_cpu.sh")
    name = f"pytest-gpu-{os.getpid()}"
    try:
        proc = subprocess.run(["bash", "launch/demo_gpu.sh", "4", "--configs-only", "--run-name", name], cwd=ROOT,
                              env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        paths = [ROOT / p for p in proc.stdout.split()]
        (ds_sync, sync), (ds_2bw, async_) = (cfgmod.load(str(p)) for p in paths)
        assert (sync.schedule, sync.correction.type, async_.schedule, async_.correction.type) == \
            ("1f1b", "none", "2bw", "ef")
        assert sync.pipeline_stages == async_.pipeline_stages == 4 and ds_sync == ds_2bw
        assert cfgmod.resolved(sync)["model"] == cfgmod.resolved(async_)["model"]
        assert plan.main([str(paths[1]), "--gpus", "4"]) == 0
    finally:
        shutil.rmtree(ROOT / "runs" / f"{name}-configs", ignore_errors=True)
