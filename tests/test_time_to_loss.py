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
from ds_async.study import time_to_loss as driver

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
        "ds_async.data.shuffle_buffer": 10,  # the shipped 1000 documents are read at every start, to no use here
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



def test_the_driver_adds_the_tuned_adamw_run_and_earlier_targets(tmp_path):
    """``--variants sync,sync-adamw --adamw-lr LR1,LR2 --targets 3``: an AdamW run per LR, synchronous 1F1B with an
    unfused step, both timed by one calibration; the lower final loss makes the AdamW run. The targets are three
    points of the sync run's curve with its final loss last, and every run is also timed to the AdamW run's final
    loss; each crossing is the one its own curve gives."""
    if not (SHARED / "corpus" / "tokenizers" / "bpe8192.json").exists():
        pytest.skip("shared corpus not found next to the repository")
    # Longer than the other test's: a loaded box's calibration can leave 2 s only the 2 warm-up steps, after which
    # both LRs end at the same loss.
    budget, out = 4.0, tmp_path / "ttl"
    sets = [a for k, v in TINY.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    subprocess.run([sys.executable, str(ROOT / "launch" / "study" / "time_to_loss.py"), "--budget", str(budget),
                    "--gpus", "2", "--out", str(out), "--calibrate-steps", "4", "--evals", "4", "--targets", "3",
                    "--variants", "sync,sync-adamw", "--adamw-lr", "0.002,0.004", "--port", str(free_port()), *sets],
                   cwd=ROOT, env=job_env(), check=True, timeout=600)
    doc = json.loads((out / "time_to_loss.json").read_text())
    assert list(doc["runs"]) == ["sync", "sync-adamw@0.002", "sync-adamw@0.004"]
    assert doc["adamw_lrs"] == {"sync-adamw@0.002": 0.002, "sync-adamw@0.004": 0.004}
    for name, lr in doc["adamw_lrs"].items():
        adamw = json.loads((out / name / "manifest.json").read_text())
        assert adamw["ds_async"]["schedule"] == "1f1b" and adamw["ds_async"]["correction"]["type"] == "none"
        assert not adamw["ds_async"]["performance"]["fused_optimizer_step"]
        assert json.loads((out / f"{name}.json").read_text())["optimizer"] == {
            "type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                        "torch_adam": True, "fused": True}}
    assert sorted(p.name for p in out.iterdir() if p.name.endswith("-calibrate")) == ["sync-adamw@0.002-calibrate",
                                                                                      "sync-calibrate"]
    finals = {name: doc["runs"][name]["final_validation_loss"] for name in doc["adamw_lrs"]}
    assert finals["sync-adamw@0.002"] != finals["sync-adamw@0.004"]
    best = min(finals, key=finals.get)
    assert (doc["adamw_run"], doc["adamw_lr"]) == (best, doc["adamw_lrs"][best])
    sync_val = doc["runs"]["sync"]["validation"]
    assert len(sync_val) >= 3
    assert doc["targets"][-1] == doc["target"] == doc["runs"]["sync"]["final_validation_loss"]
    assert doc["targets"][:2] == [sync_val[round(len(sync_val) / 3) - 1][1], sync_val[round(2 * len(sync_val) / 3) - 1][1]]
    assert doc["adamw_target"] == finals[best]
    for name, run in doc["runs"].items():
        assert run["steps"] == max(1, math.floor(budget / doc["calibration_step_time_s"][name]))
        losses, clock = [v for _, v in run["validation"]], [t for _, t in run["validation_seconds"]]
        for target, at in zip([*doc["targets"], doc["adamw_target"]], [*run["time_to_targets"],
                                                                        run["time_to_adamw_target"]]):
            want = runs.time_to_loss(clock, losses, target)
            assert at == (None if want is None else round(want, 1))
        assert (run["time_to_loss"], run["tokens_to_loss"]) == (run["time_to_targets"][-1], run["tokens_to_targets"][-1])
    block = runs.time_to_loss_block(doc)
    assert f"AdamW at peak LR {doc['adamw_lr']:g}, the best of 2 runs at peak LRs 0.002, 0.004" in block
    assert "(AdamW's)" in block


def test_the_variants_and_the_adamw_lr_go_together():
    adamw = ["--variants", "sync,sync-adamw"]
    for argv in (["--variants", "2bw+ef,sync"], adamw, ["--adamw-lr", "1e-3"], ["--variants", "sync,sync"],
                 ["--variants", "sync,adamw"], ["--targets", "0"], [*adamw, "--adamw-lr", "1e-3,x"],
                 [*adamw, "--adamw-lr", "1e-3,1e-3"]):
        with pytest.raises(SystemExit) as stop:
            driver.main(["--budget", "1", "--gpus", "2", *argv])
        assert stop.value.code == 2, argv


def _run(curve: list[tuple[int, float]], step_time: float, start: float) -> dict:
    """A time-to-loss run of hand-made numbers: validations at ``curve``'s steps, its clock its steps at
    ``step_time`` after ``start`` seconds."""
    return {"card": "1x test", "commit": "0" * 7, "steps": curve[-1][0], "tokens": curve[-1][0] * 100,
            "step_time_s": step_time, "seconds": start + curve[-1][0] * step_time,
            "final_validation_loss": curve[-1][1], "validation": [list(p) for p in curve],
            "validation_seconds": [[s, start + s * step_time] for s, _ in curve]}


def test_time_to_every_target_after_start_up_by_hand():
    doc = {"target": 3.0, "targets": [4.0, 3.0],
           "adamw_target": 3.5, "adamw_lr": 3e-4,
           "runs": {"sync": _run([(10, 5.0), (20, 4.0), (30, 3.0)], 1.0, 5.0),  # 4.0 at 20 s, 3.0 at 30 s
                    "2bw+ef": _run([(10, 4.5), (20, 3.5), (30, 2.5)], 0.5, 2.0),  # 4.0 at 7.5 s, 3.0 at 12.5 s
                    "sync-adamw": _run([(10, 5.5), (20, 4.5), (30, 3.5)], 1.0, 5.0)}}  # 4.0 at 25 s, 3.5 at 30 s
    table = runs.time_to_targets_table(doc).set_index("run")
    assert list(table.columns) == ["to 4.0000 (s)", "speed-up at 4.0000", "to 3.0000 (s)", "speed-up at 3.0000",
                                   "to 3.5000 (AdamW's) (s)", "speed-up at 3.5000 (AdamW's)"]
    assert table.loc["sync", "to 4.0000 (s)"] == 20.0 and table.loc["sync", "to 3.0000 (s)"] == 30.0
    assert table.loc["2bw+ef", "to 4.0000 (s)"] == 7.5 and table.loc["2bw+ef", "to 3.0000 (s)"] == 12.5
    assert table.loc["2bw+ef", "speed-up at 3.0000"] == 30.0 / 12.5
    assert math.isnan(table.loc["sync-adamw", "to 3.0000 (s)"])  # never reached: no speed-up either
    assert math.isnan(table.loc["sync-adamw", "speed-up at 3.0000"])
    assert table.loc["sync-adamw", "to 3.5000 (AdamW's) (s)"] == 30.0
    assert table.loc["2bw+ef", "to 3.5000 (AdamW's) (s)"] == 10.0  # 3.5 at step 20: 2 + 10 s, less 2 s start-up
    assert table.loc["2bw+ef", "speed-up at 3.5000 (AdamW's)"] == 3.0
    assert table.loc["sync", "speed-up at 3.5000 (AdamW's)"] == 30.0 / 25.0  # 3.5 halfway from step 20 to 30
