"""Time to loss: ``runs.time_to_loss`` (when a validation curve first reaches a target loss) by hand, and the driver
``launch/study/time_to_loss.py`` end to end on 2 gloo ranks."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import SHARED, free_port, job_env

from ds_async.study import runs

ROOT = Path(__file__).resolve().parents[1]


def test_first_crossing_interpolated_between_evaluations():
    seconds, losses = [10.0, 20.0, 30.0, 40.0], [5.0, 4.0, 3.0, 2.5]
    assert runs.time_to_loss(seconds, losses, 3.5) == 25.0  # halfway from 4.0 at 20 s to 3.0 at 30 s
    assert runs.time_to_loss(seconds, losses, 3.0) == 30.0
    assert runs.time_to_loss(seconds, losses, 6.0) == 10.0  # reached at the first evaluation
    assert runs.time_to_loss(seconds, losses, 2.0) is None


def test_a_later_rise_does_not_undo_the_first_crossing():
    assert runs.time_to_loss([1.0, 2.0, 3.0], [4.0, 2.0, 5.0], 3.0) == 1.5


TINY = {"ds_async.pipeline_stages": 2, "bf16.enabled": False, "ds_async.performance.compile": False,
        "ds_async.performance.compile_scope": "layer", "ds_async.performance.fused_optimizer_step": False,
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "ds_async.data.seq_len": 64,
        "ds_async.model.config.hidden_size": 64, "ds_async.model.config.intermediate_size": 128,
        "ds_async.model.config.num_hidden_layers": 2, "ds_async.model.config.num_attention_heads": 4,
        "ds_async.model.config.num_key_value_heads": 4, "ds_async.model.config.vocab_size": 8192,
        "ds_async.tokenizer": "../shared/corpus/tokenizers/bpe8192.json", "ds_async.eval.batches": 2,
        "scheduler.params.warmup_num_steps": 2,
        "scheduler.params.total_num_steps": 20000,  # a job config's own length: each run's replaces it
        "ds_async.correction": {"type": "ef", "lambda": 0.5}}  # a 2BW job config's correction: sync runs without


def test_the_driver_gives_both_schedules_the_same_training_time(tmp_path):
    """The shipped engine_ttl.json shrunk to a 2-stage CPU model, 2 s each: every variant trains floor(budget / its
    calibrated step time) steps under its own schedule, the target is the sync run's final loss, and each reported
    crossing is the one its own evaluation clock gives."""
    if not (SHARED / "corpus" / "tokenizers" / "bpe8192.json").exists():
        pytest.skip("shared corpus not found next to the repository")
    budget, out = 2.0, tmp_path / "ttl"
    sets = [a for k, v in TINY.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    subprocess.run([sys.executable, str(ROOT / "launch" / "study" / "time_to_loss.py"), "--budget", str(budget),
                    "--gpus", "2", "--out", str(out), "--calibrate-steps", "4", "--evals", "3",
                    "--port", str(free_port()), *sets], cwd=ROOT, env=job_env(), check=True, timeout=600)
    doc = json.loads((out / "time_to_loss.json").read_text())
    assert set(doc["runs"]) == {"sync", "2bw+ef"}
    assert doc["command"].startswith("python launch/study/time_to_loss.py --budget 2.0 --gpus 2")
    assert doc["parameters"] == runs.llama_parameters(json.loads((out / "sync" / "manifest.json").read_text())["model"])
    assert doc["target"] == doc["runs"]["sync"]["final_validation_loss"]
    for name, run in doc["runs"].items():
        assert run["steps"] == max(1, math.floor(budget / doc["calibration_step_time_s"][name]))
        manifest = json.loads((out / name / "manifest.json").read_text())
        ds = manifest["ds_async"]
        assert manifest["card"].startswith("cpu") and run["card"] == f"2x {manifest['card']}"
        assert run["commit"] == manifest["code"]["commit"]
        assert (ds["schedule"], ds["correction"]["type"]) == {"sync": ("1f1b", "none"), "2bw+ef": ("2bw", "ef")}[name]
        history = json.loads((out / name / "summary.json").read_text())["history"]  # the run's own clock
        assert (run["validation"], run["validation_seconds"]) == (history["validation"], history["validation_seconds"])
        losses = [v for _, v in run["validation"]]
        at = runs.time_to_loss([t for _, t in run["validation_seconds"]], losses, doc["target"])
        assert run["time_to_loss"] == (None if at is None else round(at, 1))
    sync = doc["runs"]["sync"]
    assert sync["time_to_loss"] is not None and sync["time_to_loss"] <= sync["validation_seconds"][-1][1] + 0.05
    assert 0 < sync["tokens_to_loss"] <= sync["tokens"]

    # Another seed with the first comparison's step times: no calibration runs, the same steps, its own curves.
    again = tmp_path / "ttl-s1"
    subprocess.run([sys.executable, str(ROOT / "launch" / "study" / "time_to_loss.py"), "--budget", str(budget),
                    "--gpus", "2", "--out", str(again), "--evals", "3", "--port", str(free_port()), *sets,
                    "--set", "ds_async.seed=1", "--calibration", str(out / "time_to_loss.json")],
                   cwd=ROOT, env=job_env(), check=True, timeout=600)
    second = json.loads((again / "time_to_loss.json").read_text())
    assert sorted(p.name for p in again.iterdir() if p.is_dir()) == ["2bw+ef", "sync"]
    assert second["calibration_step_time_s"] == doc["calibration_step_time_s"]
    assert second["calibration_from"] == str(out / "time_to_loss.json")
    assert {k: r["steps"] for k, r in second["runs"].items()} == {k: r["steps"] for k, r in doc["runs"].items()}
    assert json.loads((again / "sync" / "manifest.json").read_text())["ds_async"]["seed"] == 1
    assert second["runs"]["sync"]["validation"] != sync["validation"]

