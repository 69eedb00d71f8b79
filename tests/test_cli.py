"""``launch/train.py`` as users launch it: DeepSpeed's own launch line, what the console shows, one error line.

Real runs under DeepSpeed's ``deepspeed`` launcher (``python -m deepspeed.launcher.runner``, what the console script
runs) on 2 CPU ranks with the shipped default config, shortened by ``--max-steps``.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from distributed import LAUNCHER_ENV, free_port, job_env, train_py_error, train_py_exit

ROOT = Path(__file__).resolve().parents[1]


def deepspeed_launch(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in job_env().items() if k != "DS_ACCELERATOR"}
    return subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                           "--master_port", str(free_port()), str(ROOT / "launch" / "train.py"), *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def test_deepspeed_examples_launch_line_runs_quietly_and_errors_print_once(tmp_path):
    """``deepspeed launch/train.py --deepspeed --deepspeed_config C.json`` (DeepSpeedExamples' form) trains; the
    ranks print none of DeepSpeed's start-up chatter (topology, seed settings, scheduler warnings, the CPU
    accelerator fallback) and end with a short aligned summary; a config error is printed once, not once per
    rank."""
    config = json.loads((ROOT / "ds_configs" / "demo_cpu.json").read_text())
    config["ds_async"]["logging"].update(dir=str(tmp_path / "runs"), run_name="demo", progress=False, plot=False)
    config["ds_async"]["eval"]["batches"] = 2
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(config))
    proc = deepspeed_launch(tmp_path, "--deepspeed", "--deepspeed_config", str(path), "--max-steps", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    summary = json.loads((tmp_path / "runs" / "demo" / "summary.json").read_text())
    assert summary["steps"] == 2
    # What the ranks print (the launcher's own lines name runner.py and launch.py, and its accelerator check).
    ranks = [line for line in out.splitlines() if not re.search(r"\] \[\w+\] \[(runner|launch)\.py:", line)]
    chatter = [line for line in ranks if re.search(r"SEED_LAYERS|Using topology|lr_schedules\.py|DecoderLayerPipe|"
                                                   r"\[INFO\]", line)]
    assert not chatter, chatter
    assert sum("real_accelerator.py" in line for line in ranks) <= 2  # the runner's and launch.py's imports
    block = out[out.index("ds_async summary:"):].splitlines()
    body = [line for line in block[1:] if line.startswith("  ")]
    assert 5 <= len(body) <= 12 and max(map(len, body)) < 160, block
    assert re.match(r"  steps +2 \(", body[1]), body
    columns = {len(re.match(r"  (\S+( \S+)? +)", line).group(1)) for line in body}
    assert len(columns) == 1, body  # the values start in one column
    assert f"train {summary['final_train_loss']:.4g} (last step)" in "\n".join(body)

    config["ds_async"]["data"]["seq_lenght"] = 8
    path.write_text(json.dumps(config))
    proc = deepspeed_launch(tmp_path, "--deepspeed", "--deepspeed_config", str(path))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    errors = [line for line in out.splitlines() if line.startswith("ds_async: error:")]
    assert errors == ["ds_async: error: ds_async.data.seq_lenght: unknown key (did you mean "
                      "'ds_async.data.seq_len'?); known keys: ['min_chars', 'seq_len', 'shuffle_buffer', "
                      "'text_field', 'train', 'validation']"], out[-3000:]


def test_two_different_configs_are_refused(tmp_path, capsys):
    """``--config`` and DeepSpeed's ``--deepspeed_config`` naming two files: refused by the argument parser."""
    assert train_py_exit(["--config", "a.json", "--deepspeed_config", "b.json"]) == 2
    assert "two configs given: --config a.json, --deepspeed_config b.json; pass one" in capsys.readouterr().err


def test_python_m_commands_start_as_quietly_as_train_py(tmp_path):
    """``python -m ds_async.plan`` (as every ``python -m ds_async.<command>``) prints its own lines only: not
    DeepSpeed's notice that it fell back to the CPU, nor torchao's lines about the optional kernel libraries it
    could not load (transformers imports torchao where it is installed) and torch's notes on how it registers its
    enums. ``import ds_async`` in a script of one's own leaves the accelerator choice to DeepSpeed."""
    env = {k: v for k, v in job_env().items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-m", "ds_async.plan", str(ROOT / "ds_configs" / "demo_cpu.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ds_async plan: ") and proc.stderr == "", proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-c", "import os, ds_async; print(os.environ.get('DS_ACCELERATOR'))"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout == "None\n", proc.stderr[-3000:]


def test_set_overrides_keys_of_a_shipped_config_for_one_run(tmp_path, capsys, monkeypatch):
    """``--set KEY=VALUE`` sets a dotted key of the JSON for this run only: the shipped demo config as one stage,
    so without a launcher, at another LR and length. The manifest records each ``--set`` beside the file and the
    config that resulted. A key the config does not know stops the run with the strict parser's line naming it,
    a key through a value with one naming the ``--set``; without a launcher, two stages are refused with the
    launcher line that runs the same arguments."""
    env = {k: v for k, v in job_env().items() if k not in LAUNCHER_ENV}
    demo = ROOT / "ds_configs" / "demo_cpu.json"
    sets = {"ds_async.pipeline_stages": 1, "ds_async.train.steps": 3, "optimizer.params.lr": 0.001,
            "ds_async.logging.dir": str(tmp_path / "runs"), "ds_async.logging.progress": False,
            "ds_async.eval.batches": 1}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v if isinstance(v, str) else json.dumps(v)}")]
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(demo), *args,
                           "--run-name", "set"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    manifest = json.loads((tmp_path / "runs" / "set" / "manifest.json").read_text())
    assert manifest["config_file"] == str(demo) and manifest["overrides"] == sets
    assert manifest["ds_async"]["pipeline_stages"] == 1 and manifest["world_size"] == 1
    assert manifest["deepspeed"]["optimizer"]["params"]["lr"] == 0.001 and manifest["total_steps"] == 3
    assert json.loads((tmp_path / "runs" / "set" / "summary.json").read_text())["steps"] == 3

    assert train_py_error(["--config", str(demo), "--set", "ds_async.data.seq_lenght=8"], capsys).startswith(
        "ds_async: error: ds_async.data.seq_lenght: unknown key (did you mean 'ds_async.data.seq_len'?)")
    assert train_py_error(["--config", str(demo), "--set", "optimizer.params.lr.peak=1"], capsys) == (
        "ds_async: error: --set optimizer.params.lr.peak: 'lr' is not an object in the config")
    assert train_py_exit(["--config", str(demo), "--set", "optimizer.params.lr"]) == 2
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    arguments = f"--config {demo} --set ds_async.train.steps=5"
    assert train_py_error(arguments.split(), capsys) == (
        f"ds_async: error: no launcher: ds_async.pipeline_stages is 2, so the job needs 2 processes (or a multiple "
        f"of 2): deepspeed --num_gpus 2 launch/train.py {arguments} (or torchrun --nproc_per_node 2 launch/train.py "
        f"{arguments})")
