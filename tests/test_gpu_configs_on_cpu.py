"""The shipped GPU configs as their users run them, on CPU: each trains through ``launch/train.py`` under torchrun
on one gloo rank per pipeline stage, with its own schedule, optimizer, correction, partition, precision, recompute,
loss chunks and fused optimizer step. For one config of each optimizer state (Muon + EF, bf16 AdamW, Mixtral's
Muon + EF), a second run resumed from the first one's mid-run checkpoint ends with the same weights and losses, bit
for bit. The other three train only: their state is of those kinds, and every launch is a whole multi-process start
on the test machine's two cores.

Only the model's width (its depth, head ratio, experts and vocabulary stay as shipped), the sequence length, the
run's length and cadences, where the corpus lies and the run folder differ from the shipped files. Not covered on
CPU: compiled code (the jobs run with ``TORCHDYNAMO_DISABLE``), Triton kernels, CUDA graphs and streams.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from distributed import SHARED, checkpoint_weights, job_env, torchrun_train_py

from ds_async import checkpoint

ROOT = Path(__file__).resolve().parents[1]
CORPUS = SHARED / "corpus"
SHIPPED_CORPUS = "data/corpus/"  # where the shipped configs expect the corpus (README, "Your data")
GPU_CONFIGS = sorted(p.name for p in (ROOT / "ds_configs").glob("*.json") if not p.name.startswith("demo_cpu"))
RESUMED = {"llama_0.9b_4gpu_2bw_muon_ef.json", "llama3_8b_4gpu_2bw_adamw.json", "mixtral_8x1b_4gpu_2bw_muon_ef.json"}
STEPS, SAVED = 4, 2


def toy(file: str, folder: Path, name: str) -> Path:
    """The shipped config at a toy width, ``STEPS`` long, saved every ``SAVED`` steps, reading the shared corpus."""
    config = json.loads((ROOT / "ds_configs" / file).read_text())
    section = config["ds_async"]
    model = section["model"]["config"]
    group = model["num_attention_heads"] // model.get("num_key_value_heads", model["num_attention_heads"])
    model.update(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4 // group,
                 max_position_embeddings=64)

    def local(path):
        return str(CORPUS / path[len(SHIPPED_CORPUS):]) if path.startswith(SHIPPED_CORPUS) else path

    section["tokenizer"] = local(section["tokenizer"])
    section["data"].update(train=local(section["data"]["train"]), validation=local(section["data"]["validation"]),
                           seq_len=64, shuffle_buffer=10)
    section["train"] = {"steps": STEPS}
    section["eval"] = {"every": SAVED, "batches": 1}
    section["checkpoint"] = {"every": SAVED, "keep": 2}
    section["logging"].update(dir=str(folder / "runs"), run_name=name, progress=False, plot=False)
    config["scheduler"]["params"].pop("total_num_steps", None)  # filled in from the run length
    config["scheduler"]["params"]["warmup_num_steps"] = 1
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def train(config: Path, folder: Path, stages: int, *args: str) -> str:
    proc = subprocess.run(torchrun_train_py(stages, config, *args), env=job_env(), cwd=folder, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def weights(run: Path, step: int) -> dict:
    return checkpoint_weights(checkpoint.step_dir(run / "checkpoints", step))


@pytest.mark.parametrize("file", GPU_CONFIGS)
def test_shipped_gpu_config_trains_on_cpu(tmp_path, file):
    if not (CORPUS / "tokenizers").exists():
        pytest.skip(f"shared corpus not found at {CORPUS} (the repo must be cloned next to shared/)")
    shipped = json.loads((ROOT / "ds_configs" / file).read_text())["ds_async"]
    stages = shipped["pipeline_stages"]
    config = toy(file, tmp_path, "run")
    train(config, tmp_path, stages)
    run = tmp_path / "runs" / "run"
    manifest = json.loads((checkpoint.step_dir(run / "checkpoints", STEPS) / checkpoint.MANIFEST).read_text())
    if shipped["partition"]["method"] == "explicit":
        assert manifest["parts"] == shipped["partition"]["boundaries"]
    history = json.loads((run / "summary.json").read_text())["history"]
    assert [s for s, _ in history["train"]] == list(range(1, STEPS + 1))
    if file not in RESUMED:
        return
    middle = checkpoint.step_dir(run / "checkpoints", SAVED)
    out = train(config, tmp_path, stages, "--run-name", "resumed", "--resume", str(middle))
    assert f"ds_async: resumed from {middle} (step {SAVED})" in out
    resumed = tmp_path / "runs" / "resumed"
    got, want = weights(resumed, STEPS), weights(run, STEPS)
    assert got.keys() == want.keys() and len(got) > 2 * stages
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    again = json.loads((resumed / "summary.json").read_text())["history"]
    assert again["train"] == history["train"]
    assert again["validation"][-1] == history["validation"][-1]
