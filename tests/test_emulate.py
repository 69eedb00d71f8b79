"""The delay emulation on models small enough to follow by hand, and ``python -m ds_async.emulate``: a JSON
config's job in one process, partitioned, scheduled and batched as DeepSpeed would (its bit-equality with
``launch/train.py`` is ``tests/test_study.py``'s)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ds_async import config, emulate
from ds_async.config import data_parallel_degree
from ds_async.emulate import build_scheduler
from ds_async.models import llama, model_config
from ds_async.models.partition import build_layers, stage_bounds, stage_of_layers
from ds_async.pipe.delayed import DelayedTrainer
from ds_async.study import rows


def scalar_run(schedule: str, steps: int, lr: float = 0.5, w0: float = 1.0, stages: int = 1, stage: int = 0,
               micro_batches: int = 1):
    """f(w) = w^2 / 2 (a 1x1 linear layer fed x=1 against target 0, on pipeline stage ``stage``), plain SGD:
    gradient = w."""
    layer = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(w0)
    trainer = DelayedTrainer([layer], [stage], lambda out, y: 0.5 * ((out - y) ** 2).mean(),
                             torch.optim.SGD(layer.parameters(), lr=lr), schedule, micro_batches=micro_batches,
                             stages=stages)
    batch = [(torch.ones(1, 1), torch.zeros(1, 1))] * micro_batches
    ws = [w0]
    for _ in range(steps):
        trainer.train_batch(batch)
        ws.append(layer.weight.item())
    return ws


def test_sync_trajectory():
    assert scalar_run("1f1b", 4) == [1.0, 0.5, 0.25, 0.125, 0.0625]


def test_2bw_trajectory_by_hand():
    # w(t+1) = w(t) - 0.5 * w(t-1), with w(-1) = w(0) = 1:
    # w1 = 1 - .5*1 = .5;  w2 = .5 - .5*1 = 0;  w3 = 0 - .5*.5 = -.25;  w4 = -.25 - .5*0 = -.25;  w5 = -.25 + .125
    assert scalar_run("2bw", 5) == [1.0, 0.5, 0.0, -0.25, -0.25, -0.125]


def test_pipedream_first_stage_of_three_lags_two_steps():
    # Stage 0 of 3 with m = 1 runs on W(t-2): w(t+1) = w(t) - 0.5 * w(t-2), W(<0) = W(0) = 1:
    # w1 = .5, w2 = 0, w3 = 0 - .5*1 = -.5, w4 = -.5 - .5*.5 = -.75, w5 = -.75 - 0 = -.75
    assert scalar_run("pipedream", 5, stages=3) == [1.0, 0.5, 0.0, -0.5, -0.75, -0.75]


def test_constant_delay_trajectories_by_hand():
    """``delay<d>``: w(t+1) = w(t) - 0.5 * w(t-d), W(<0) = W(0) = 1, on every stage and at any m."""
    assert scalar_run("delay0", 4) == scalar_run("1f1b", 4)
    # delay1 is 2BW's recurrence (test above), here at p = 3 with m = 1, which 2BW itself refuses, and at m = 2
    assert scalar_run("delay1", 5, stages=3) == [1.0, 0.5, 0.0, -0.25, -0.25, -0.125]
    assert scalar_run("delay1", 5, stages=3, stage=2, micro_batches=2) == [1.0, 0.5, 0.0, -0.25, -0.25, -0.125]
    # w1 = 1 - .5*1 = .5, w2 = .5 - .5*1 = 0, w3 = 0 - .5*1 = -.5, w4 = -.5 - .5*w0 = -1, w5 = -1 - .5*w1 = -1.25,
    # w6 = -1.25 - .5*w2 = -1.25
    assert scalar_run("delay3", 6, stages=3) == [1.0, 0.5, 0.0, -0.5, -1.0, -1.25, -1.25]
    # PipeDream at p = 3 delays its stages 2, 1, 0; delay1 has their mean on each: on the last stage they part
    assert scalar_run("pipedream", 5, stages=3, stage=2) == scalar_run("1f1b", 5)
    assert scalar_run("delay1", 5, stages=3, stage=2) == [1.0, 0.5, 0.0, -0.25, -0.25, -0.125]
    assert scalar_run("delay2", 5, stages=3, stage=1) == scalar_run("pipedream", 5, stages=3, stage=0)


def test_wrong_micro_batch_count_is_refused():
    layer = nn.Linear(1, 1, bias=False)
    trainer = DelayedTrainer([layer], [0], lambda o, y: o.sum(), torch.optim.SGD(layer.parameters(), lr=0.1),
                             "2bw", micro_batches=2, stages=1)
    with pytest.raises(ValueError, match="needs 2 micro-batches, got 1"):
        trainer.train_batch([(torch.ones(1, 1), torch.zeros(1, 1))])


# ---------------------------------------------------------------------------------------------------------------
# The runner: a ds_async JSON config's job in one process

ROOT = Path(__file__).resolve().parents[1]


def test_stage_bounds_are_the_pipeline_modules():
    """The emulation splits layers as DeepSpeed's PipelineModule does: by count, by trainable parameters (counted
    as DeepSpeed counts them, from the same layer specs) or at the given boundaries."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.utils import partition_balanced

    section = {"config": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 5,
                          "num_attention_heads": 4, "num_key_value_heads": 2}}
    layers, _, hf = build_layers(section)
    specs = llama.layer_specs(model_config(config.parse({"model": section, "train": {"steps": 1}})))
    counts = PipelineModule._count_layer_params(SimpleNamespace(_layer_specs=specs))
    for stages in (2, 3, 4):
        assert stage_bounds("parameters", layers, stages) == list(partition_balanced(counts, stages))
    assert stage_bounds("uniform", layers, 3) == [0, 3, 5, 7]
    assert stage_of_layers([0, 3, 5, 7]) == [0, 0, 0, 1, 1, 2, 2]
    assert stage_bounds("explicit", layers, 2, [0, 1, 7]) == [0, 1, 7]
    with pytest.raises(config.ConfigError, match="ds_async.partition.boundaries"):
        stage_bounds("explicit", layers, 2, [0, 7, 7])


def test_scheduler_and_batch_split_as_deepspeed_builds_them():
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = build_scheduler({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2,
                                                                  "warmup_type": "linear", "cos_min_ratio": 0.1}}, opt)
    assert isinstance(sched, WarmupCosineLR)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(10):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    # DeepSpeed's schedule: 0 before its first step, then the linear warm-up, then cosine down to 10%
    cosine = 0.1 * (0.1 + 0.9 * (1 + math.cos(math.pi / 8)) / 2)
    assert lrs[:4] == pytest.approx([0.0, 0.0, 0.05, cosine]) and lrs[-1] == pytest.approx(0.01)
    assert isinstance(build_scheduler({"type": "StepLR", "params": {"step_size": 2}}, opt),
                      torch.optim.lr_scheduler.StepLR)
    with pytest.raises(config.ConfigError, match="scheduler.type: unknown scheduler 'Warmup'"):
        build_scheduler({"type": "Warmup"}, opt)
    assert data_parallel_degree({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                 "gradient_accumulation_steps": 4}) == 2
    assert data_parallel_degree({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}) == 1


def test_cli_trains_the_demo_config(tmp_path, monkeypatch):
    """``python -m ds_async.emulate --config ds_configs/demo_cpu.json --max-steps 3``: the run folder holds what a
    launch/train.py run writes, the manifest adding the emulation's device and precision, the summary where the
    start went."""
    pytest.importorskip("gensim")

    monkeypatch.chdir(tmp_path)
    assert emulate.main(["--config", str(ROOT / "ds_configs" / "demo_cpu.json"), "--max-steps", "3",
                         "--run-name", "smoke", "--device", "cpu"]) == 0
    run = tmp_path / "runs" / "smoke"
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith("events.")) == [
        "loss.png", "manifest.json", "summary.json", "tokenizer.json"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["ds_async"]["partition"]["method"] == "parameters" and manifest["total_steps"] == 3
    assert manifest["deepspeed"]["scheduler"]["type"] == "WarmupCosineLR" and manifest["micro_batches"] == 4
    assert manifest["emulation"]["precision"] == "fp32" and manifest["world_size"] == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and len(summary["history"]["train"]) == 3
    assert [s for s, _ in summary["history"]["validation"]] == [3] and math.isfinite(summary["final_validation_loss"])
    assert list(summary["start_s"]) == ["imports", "model", "data", "first step"]
    assert all(v >= 0 for v in summary["start_s"].values())


def test_cli_set_overrides_keys_and_the_row_command_repeats_them(tmp_path, monkeypatch):
    """``python -m ds_async.emulate --config ds_configs/demo_cpu.json --set ...``: the run trains the config with
    those keys set (its manifest records them beside the file), and its study row's command, this run's own line,
    carries them, so that it runs the same job again."""
    monkeypatch.chdir(tmp_path)
    demo = ROOT / "ds_configs" / "demo_cpu.json"
    assert emulate.main(["--config", str(demo), "--max-steps", "2", "--run-name", "set", "--device", "cpu",
                         "--set", "optimizer.params.lr=0.001", "--set", "ds_async.schedule=2bw",
                         "--set", "ds_async.logging.plot=false"]) == 0
    manifest = json.loads((tmp_path / "runs" / "set" / "manifest.json").read_text())
    assert manifest["overrides"] == {"optimizer.params.lr": 0.001, "ds_async.schedule": "2bw",
                                     "ds_async.logging.plot": False}
    assert manifest["deepspeed"]["optimizer"]["params"]["lr"] == 0.001 and manifest["ds_async"]["schedule"] == "2bw"
    assert rows.read_run(tmp_path / "runs" / "set")["command"] == (
        "python -m ds_async.emulate --config ds_configs/demo_cpu.json --set optimizer.params.lr=0.001 "
        "--set 'ds_async.schedule=\"2bw\"' --set ds_async.logging.plot=false")


def test_cli_errors_name_the_key(tmp_path, capsys):
    raw = json.loads((ROOT / "ds_configs" / "demo_cpu.json").read_text())
    raw["ds_async"]["schedule"], raw["gradient_accumulation_steps"] = "2bw", 1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    assert emulate.main(["--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ds_async: error: gradient_accumulation_steps: schedule '2bw' needs at least"), err


def test_time_limit_and_resume_equal_an_uninterrupted_run(tmp_path, monkeypatch):
    """Stopped by the time limit after every step (mid-way through the prefetched chunk each time) and resumed:
    2BW + Muon + EF with clipping, an LR schedule and evaluations gives the same training and validation losses,
    bit for bit, as the run that never stopped; the state file is gone once the run is complete. Each evaluation's
    training clock (``history["validation_seconds"]``) rises, and the resumed run's continues from the seconds its
    last process saved: the run's clock is the sum of its processes'."""
    pytest.importorskip("gensim")

    monkeypatch.chdir(tmp_path)
    raw = json.loads((ROOT / "ds_configs" / "demo_cpu_2bw.json").read_text())
    raw["ds_async"].update(train={"steps": 4}, eval={"every": 2, "batches": 2},
                           logging={"dir": "runs", "progress": False, "plot": False})
    raw["ds_async"]["model"]["config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    whole = emulate.run(str(path), run_name="whole", device="cpu")
    stops, saved = [], {}  # saved: step -> the clock the stopped process left in its state
    while True:
        try:
            cut = emulate.run(str(path), run_name="cut", device="cpu", resume=True, time_limit=0)
            break
        except emulate.Stopped as e:
            stops.append(e.step)
            saved[e.step] = round(torch.load(e.state_file, weights_only=True)["seconds"], 3)  # as the history's
    assert stops == [1, 2, 3]
    want = json.loads((tmp_path / "runs" / "whole" / "summary.json").read_text())["history"]
    got = json.loads((tmp_path / "runs" / "cut" / "summary.json").read_text())["history"]
    assert got["train"] == want["train"] and got["validation"] == want["validation"] and len(got["train"]) == 4
    assert cut["final_validation_loss"] == whole["final_validation_loss"]
    assert not (tmp_path / "runs" / "cut" / emulate.STATE_FILE).exists()
    for clock in (want["validation_seconds"], got["validation_seconds"]):
        assert [s for s, _ in clock] == [s for s, _ in want["validation"]] == [2, 4]
        assert 0 < clock[0][1] < clock[1][1]
    # the evaluation at step 2 ran in the process resumed from step 1 and stopped after step 2, the one at step 4
    # in the process resumed from step 3
    assert 0 < saved[1] < got["validation_seconds"][0][1] <= saved[2] < saved[3] < got["validation_seconds"][1][1]
    manifest = json.loads((tmp_path / "runs" / "cut" / "manifest.json").read_text())
    assert manifest["resumed_from"].endswith(emulate.STATE_FILE)


def tiny_config(tmp_path, gas: int, steps: int) -> dict:
    """A one-layer LLaMA on the Python docs with a tokenizer trained at start: a command-line run of seconds."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
            "ds_async": {"model": {"config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                                              "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 300,
                                              "max_position_embeddings": 16}},
                         "tokenizer": "train:300", "pipeline_stages": 1,
                         "data": {"train": "python:docs", "validation": None, "seq_len": 16},
                         "train": {"steps": steps},
                         "logging": {"dir": str(tmp_path / "runs"), "progress": False, "plot": False}}}


def test_cli_reads_the_same_batches_in_a_reader_process(tmp_path):
    """``python -m ds_async.emulate`` (the module is ``__main__``, which the reader process does not import) with
    ``performance.data_reader`` ``process`` trains on the micro-batches of ``main``: the same losses."""
    cfg = tiny_config(tmp_path, gas=2, steps=3)
    history = {}
    for mode in ("main", "process"):
        cfg["ds_async"]["logging"]["run_name"] = mode
        cfg["ds_async"]["performance"] = {"data_reader": mode}
        path = tmp_path / f"{mode}.json"
        path.write_text(json.dumps(cfg))
        proc = subprocess.run([sys.executable, "-m", "ds_async.emulate", "--config", str(path), "--device", "cpu"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        history[mode] = json.loads((tmp_path / "runs" / mode / "summary.json").read_text())["history"]["train"]
    assert len(history["main"]) == 3 and history["process"] == history["main"]


def test_cli_prints_none_of_deepspeeds_scheduler_warnings(tmp_path):
    """Like ``launch/train.py``, the emulation holds back DeepSpeed's lines while it builds its parts: DeepSpeed's
    ``WarmupCosineLR`` warns when built ("Attempting to get learning rate from scheduler before it has started")."""
    cfg = tiny_config(tmp_path, gas=1, steps=2)
    cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 1}}
    cfg["ds_async"]["logging"]["run_name"] = "quiet"
    path = tmp_path / "quiet.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "ds_async.emulate", "--config", str(path), "--device", "cpu"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "ds_async summary:" in out and "lr_schedules.py" not in out, out[-3000:]
    cfg["ds_async"]["logging"].update(run_name="shown", deepspeed_log=True)  # asked for: shown
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "ds_async.emulate", "--config", str(path), "--device", "cpu"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "lr_schedules.py" in proc.stdout + proc.stderr
