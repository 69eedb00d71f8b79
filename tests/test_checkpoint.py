"""Checkpoints, exact resume, export and bad input (issue 5).

Real 2-stage training jobs (torchrun, gloo, the trainer of ``launch/train.py``) on the Lee corpus with a tiny
LLaMA (attention dropout on, so the RNG state matters) and a warm-up/cosine LR schedule:

- killed with SIGKILL in the middle of training (the job is made to hang inside a step, then its process group
  is killed), resumed with ``--resume``, the final parameters, the 2BW older weight version and the optimizer
  state are bit-equal to those of an uninterrupted run of the same length, which saved no checkpoint and so never
  drained: 1f1b and 2bw, with AdamW and with Muon + error feedback;
- a save interrupted part-way (a leftover ``.tmp`` folder) is passed over by ``--resume``, and a truncated
  checkpoint is refused naming the file;
- NaN/inf loss: ``stop`` ends the run at that step with the last good checkpoint intact, ``skip`` drops the update;
- the export of a checkpoint loads with ``AutoModelForCausalLM.from_pretrained`` (LLaMA and Mixtral).

Process starts dominate the time, so one job runs several trainer runs in sequence (``tests/ckpt_jobs.py``), in the
tests' job server unless it is to be killed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from ds_async import checkpoint
from ds_async.checkpoint import CheckpointError
from ds_async.config import ConfigError, check_batch, parse
from ds_async.data import LEE_CORPUS, DataError, PackedBatches, load_text_stream, load_tokenizer
from ds_async.export import export
from ds_async.export import main as export_main
from ds_async.models import check_vocab
from ds_async.optim import build_optimizer
from ds_async.optim.sharded import ShardedOptimizer
from ds_async.resume import checkpoint_to_resume as _resume_from
from ds_async.tokenizer import train_bpe

from distributed import checkpoint_weights, free_port, job_env, run_job, train_py_error

ROOT = Path(__file__).resolve().parents[1]
TINY = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64, "attention_dropout": 0.1}
TINY_MIXTRAL = {**TINY, "num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": None}
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}}
MUON = {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "adam_lr": 3e-3,
                                   "adam_weight_decay": 0.1}}
EF = {"type": "ef", "lambda": 1.0}
STEPS, EVERY, STALL = 10, 2, 6  # killed inside step 6: checkpoints 2 and 4 exist, step 5 is lost and redone
# bf16 weights with DeepSpeed's bf16 optimizer, whose AdamW step runs in one pass per tensor (its step count and
# moments live in torch's AdamW state all the same, and a resume must pick them up).
BF16_FUSED = {"bf16": {"enabled": True}, "performance": {"fused_optimizer_step": True}}
CASES = {  # name: (schedule, optimizer, correction, extra keys: DeepSpeed's; "performance" and "checkpoint" ds_async's)
    "1f1b-adamw": ("1f1b", ADAMW, None, {}),
    "2bw-adamw": ("2bw", ADAMW, None, {}),
    "1f1b-muon-ef": ("1f1b", MUON, EF, {}),
    "2bw-muon-ef": ("2bw", MUON, EF, {}),
    "2bw-adamw-bf16-fused": ("2bw", ADAMW, None, BF16_FUSED),
    # bf16 weights with ds_async's fp32 masters, Muon + EF in a few passes per tensor: masters, momentum, EF buffer.
    "2bw-muon-ef-bf16-fused": ("2bw", MUON, EF, BF16_FUSED),
    # The training stream tokenized and packed in a reader process per rank, a step at a time (the GPU default).
    "2bw-adamw-reader": ("2bw", ADAMW, None, {"performance": {"data_reader": "process"}}),
}


# --------------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder with a small BPE tokenizer trained on the Lee corpus."""
    path = tmp_path_factory.mktemp("ckpt")
    texts = [row["text"] for row in load_text_stream(LEE_CORPUS, "train")]
    train_bpe(iter(texts), TINY["vocab_size"], str(path / "tokenizer.json"))
    return path


def write_config(work: Path, name: str, schedule="1f1b", optimizer=ADAMW, correction=None, extra=None, steps=STEPS,
                 every=0, final=True, family="llama", data="gensim:lee", **section) -> Path:
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
          "gradient_clipping": 1.0, "optimizer": optimizer,
          "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 3}},  # as long as train.steps
          "ds_async": {"model": {"family": family, "config": TINY_MIXTRAL if family == "mixtral" else TINY},
                       "tokenizer": str(work / "tokenizer.json"), "pipeline_stages": 2,
                       "partition": {"method": "uniform"}, "schedule": schedule,
                       "data": {"train": data, "validation": None, "seq_len": 32, "shuffle_buffer": 50},
                       "train": {"steps": steps}, "eval": {"every": 0},
                       "logging": {"dir": str(work / "runs"), "run_name": name, "progress": False, "plot": False},
                       "checkpoint": {"every": every, "keep": 2, "final": final},
                       "correction": correction or {"type": "none"}, **section}}
    for key, value in (extra or {}).items():
        if key == "checkpoint":
            ds["ds_async"]["checkpoint"].update(value)
        else:
            (ds["ds_async"] if key == "performance" else ds)[key] = value
    path = work / f"{name}.json"
    path.write_text(json.dumps(ds))
    return path


def ckpt_root(work: Path, name: str) -> Path:
    return work / "runs" / name / "checkpoints"


def launch(work: Path, tag: str, runs: list[dict], wait: bool = True):
    """``tests/ckpt_jobs.py``'s trainer runs on 2 ranks, their log in ``work/<tag>.log``: with ``wait``, in the tests'
    job server (a failed job fails the test), returning each run's rank results; else as a torchrun job of its own,
    returning its process (its own process group, to be killed as a whole)."""
    out = work / tag
    out.mkdir(exist_ok=True)
    if wait:
        results = run_job(2, "trainer_runs", out, runs=runs)
        shutil.copyfile(out / "log.txt", work / f"{tag}.log")
        return results
    (work / f"{tag}.runs.json").write_text(json.dumps(runs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
           str(ROOT / "tests" / "ckpt_jobs.py"), str(work / f"{tag}.runs.json"), str(out)]
    log = open(work / f"{tag}.log", "w")
    return subprocess.Popen(cmd, env=job_env(), cwd=work, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill_job(proc: subprocess.Popen, out: Path) -> None:
    """SIGKILL a job started by :func:`launch`: its ranks (torchrun gives each a session of its own, so killing
    the launcher's group alone would leave them hanging) and then the launcher's group."""
    for pid_file in out.glob("pid.rank*"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def final_state(folder: Path) -> dict:
    """Everything a checkpoint holds that the math depends on, as flat name -> tensor."""
    out = checkpoint_weights(folder)
    for file in sorted(folder.iterdir()):
        if file.name.startswith(("versions-", "state-")):
            def walk(prefix, obj):
                if torch.is_tensor(obj):
                    out[prefix] = obj
                elif isinstance(obj, dict):
                    for k, v in obj.items():
                        if k != "extra":
                            walk(f"{prefix}/{k}", v)
                elif isinstance(obj, (list, tuple)):
                    for i, v in enumerate(obj):
                        walk(f"{prefix}/{i}", v)
                elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
                    out[prefix] = torch.tensor(obj, dtype=torch.float64)
            walk(file.name, checkpoint.load_file(file))
    return out


def assert_bit_equal(have: dict, want: dict, what: str) -> None:
    assert have.keys() == want.keys(), f"{what}: {sorted(set(have) ^ set(want))[:5]}"
    bad = [k for k in want if not torch.equal(have[k], want[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


# ------------------------------------------------------------------------------ SIGKILL and exact resume
@pytest.fixture(scope="module")
def references(work) -> dict:
    """Uninterrupted runs of every case (no checkpoint before the final one, so 2BW never drains) and a Mixtral
    run for the export, all in one job."""
    runs = [{"name": f"ref-{case}", "config": str(write_config(work, f"ref-{case}", s, o, c, x))}
            for case, (s, o, c, x) in CASES.items()]
    runs.append({"name": "ref-mixtral", "config": str(write_config(work, "ref-mixtral", "2bw", steps=3,
                                                                   family="mixtral"))})
    # Saves at steps 2 and 4: in the foreground, in the background (checkpoint.async_save), and in the background
    # written as late as can be (step 2's files once step 4 has trained).
    # The foreground run's preemption grace is shorter than any save, which it says once.
    for name, background, defer in (("saves-foreground", False, False), ("saves-background", True, False),
                                    ("saves-deferred", True, True)):
        grace = {} if background else {"preempt_grace_s": 0.001}
        config = write_config(work, name, "2bw", MUON, EF,
                              {"checkpoint": {"keep": 0, "async_save": background, **grace}}, steps=4, every=2)
        runs.append({"name": name, "config": str(config), "defer_writes": defer})
    results = launch(work, "references", runs)
    for name, ranks in results.items():
        assert all(r["error"] is None for r in ranks), (name, ranks)
    assert [r["deferred_writes"] for r in results["saves-deferred"]] == [2, 2]  # both saves went to the writer
    return {r["name"]: checkpoint.step_dir(ckpt_root(work, r["name"]), 3 if "mixtral" in r["name"] else STEPS)
            for r in runs if r["name"].startswith("ref-")}


def test_sigkill_and_resume_equals_uninterrupted(work, references):
    resumes = []
    for case, (schedule, optimizer, correction, extra) in CASES.items():
        name = f"killed-{case}"
        config = write_config(work, name, schedule, optimizer, correction, extra, every=EVERY)
        proc = launch(work, name, [{"name": name, "config": str(config), "stall_at": STALL}], wait=False)
        try:
            deadline = time.time() + 300
            while not (checkpoint.step_dir(ckpt_root(work, name), 4) / checkpoint.MANIFEST).exists():
                assert proc.poll() is None, (work / f"{name}.log").read_text()[-4000:]
                assert time.time() < deadline, "no checkpoint appeared"
                time.sleep(0.05)
            time.sleep(0.5)  # into step 5 or the hang in step 6
        finally:
            kill_job(proc, work / name)
        assert [s for s, _ in checkpoint.complete_checkpoints(ckpt_root(work, name))] == [2, 4]
        resumes.append({"name": name, "config": str(config), "resume": "latest"})

    # A save that was interrupted part-way leaves a .tmp folder (here: a half-copied step 6); --resume passes it by.
    partial = checkpoint.step_dir(ckpt_root(work, "killed-2bw-adamw"), 6).with_suffix(".tmp")
    partial.mkdir()
    (partial / "state-stage00-dp000.pt").write_bytes(b"\0" * 100)
    # A truncated file in an otherwise complete checkpoint is refused, naming the file, on every rank.
    corrupt = work / "corrupt"
    shutil.copytree(checkpoint.step_dir(ckpt_root(work, "killed-1f1b-adamw"), 4), corrupt / "step_00000004")
    victim = corrupt / "step_00000004" / "state-stage01-dp000.pt"
    victim.write_bytes(victim.read_bytes()[:-10])
    # A finished run has nothing left to train: refused, naming the checkpoint, rather than saved again.
    finished = {"name": "finished", "config": str(work / "ref-1f1b-adamw.json"), "resume": "latest"}
    results = launch(work, "resumes", [{"name": "corrupt", "config": resumes[0]["config"],
                                        "resume": str(corrupt)}, finished] + resumes)

    for rank in results["corrupt"]:
        assert rank["error"].startswith("CheckpointError") and str(victim) in rank["error"], rank
    for rank in results["finished"]:
        assert rank["error"] == (f"ConfigError: --resume: {references['ref-1f1b-adamw']} is at step {STEPS}, and "
                                 f"the run's {STEPS} steps end there or before: nothing is left to train"), rank
    assert not partial.exists(), "the next save removes leftovers of interrupted saves"
    for case in CASES:
        name = f"killed-{case}"
        summary = results[name][1]["summary"]  # the reporting rank (last stage)
        assert summary["resumed_from"].endswith("step_00000004"), summary
        # The curves go on from the checkpoint: steps 1-4 as the first process logged them, then the resumed ones.
        curves, reference = (json.loads((work / "runs" / run / "summary.json").read_text())["history"]
                             for run in (name, f"ref-{case}"))
        assert curves["train"] == reference["train"], case
        got = final_state(checkpoint.step_dir(ckpt_root(work, name), STEPS))
        want = final_state(references[f"ref-{case}"])
        assert_bit_equal(got, want, case)
        if case.startswith("2bw"):
            assert any(k.startswith("versions-") for k in want), "2BW saves its older weight version"


def test_reader_process_trains_on_the_same_micro_batches(references):
    """A run whose stream is read by a reader process ends with the weights and optimizer state of one read in the
    training process (their saved stream positions differ in form only: chunk start plus micro-batches taken)."""
    def trained(case):
        return {k: v for k, v in final_state(references[f"ref-{case}"]).items() if "/data/" not in k}

    assert_bit_equal(trained("2bw-adamw-reader"), trained("2bw-adamw"), "reader process vs in-process reading")


def test_a_checkpoint_written_in_the_background_holds_what_a_foreground_save_holds(work, references):
    """``checkpoint.async_save``: each checkpoint, written on the writer's thread from the host copy taken at its
    step, holds the same tensors (weights, older version, optimizer, RNG, stream position) as the same run's
    foreground save, and the last one is complete and verified when the run's summary is written. Written as late as
    a background write can run (step 2's files once step 4 has trained), the same: the save wrote its own copy."""
    for name in ("saves-background", "saves-deferred"):
        for step in (2, 4):
            late, now = (checkpoint.step_dir(ckpt_root(work, run), step) for run in (name, "saves-foreground"))
            checkpoint.verify(late, checkpoint.read_manifest(late)["files"])
            assert_bit_equal(final_state(late), final_state(now), f"{name}, step {step}: against a foreground save")


def test_a_save_that_takes_most_of_the_preemption_grace_is_said_once(work, references):
    """A save longer than 80% of ``checkpoint.preempt_grace_s`` (a preempted job's drain and save must fit in it):
    one warning line, from one rank, at the first such save, naming the step, the time and the key."""
    log = (work / "references.log").read_text()
    lines = [line for line in log.splitlines() if "ds_async: warning: saving step" in line]
    assert len(lines) == 1 and re.search(r"ds_async: warning: saving step 2 took [\d.e-]+ s, more than "
                                         r"ds_async\.checkpoint\.preempt_grace_s = 0\.001 s, ", lines[0]), lines


# -------------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("name", ["ref-2bw-muon-ef", "ref-mixtral"])
def test_export_loads_with_from_pretrained(work, references, name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export_main([str(ckpt_root(work, name)), str(tmp_path / "hf")])  # a folder of checkpoints: the newest
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == ("MixtralForCausalLM" if "mixtral" in name else "LlamaForCausalLM")
    saved = {}
    for shard in sorted(references[name].glob("model-*.safetensors")):
        saved.update(load_file(shard))
    have = model.state_dict()
    if "mixtral" in name:  # transformers fuses the saved per-expert tensors on load; compare through its saver
        model.save_pretrained(tmp_path / "again")
        have = {}
        for shard in (tmp_path / "again").glob("*.safetensors"):
            have.update(load_file(shard))
    assert_bit_equal({k: have[k] for k in saved}, saved, name)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "hf")) == TINY["vocab_size"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3, 4]])).logits).all()


def test_export_refuses_a_corrupt_checkpoint(work, references, tmp_path):
    folder = tmp_path / "step_00000003"
    shutil.copytree(references["ref-mixtral"], folder)
    shard = folder / "model-stage02-of-02.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard}: contents do not match"):
        export(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------- NaN / inf loss
def test_nonfinite_loss_stop_and_skip(work):
    # Training text with documents to skip: empty, too short (min_chars 3) and not UTF-8.

    texts = [row["text"] for row in load_text_stream(LEE_CORPUS, "train")]
    lines = b"".join(t.encode() + b"\n" + (b"\n" if i % 10 == 0 else b"") + (b"ok\n" if i % 10 == 1 else b"")
                     + (b"caf\xe9 au lait\n" if i % 10 == 2 else b"") for i, t in enumerate(texts))
    (work / "mixed.txt").write_bytes(lines)
    data = dict(data=str(work / "mixed.txt"))
    runs = [
        {"name": "skip-2bw", "poison": {"step": 3, "kind": "nan"},
         "config": str(write_config(work, "skip-2bw", "2bw", steps=6, train={"steps": 6, "on_nonfinite": "skip"},
                                    **data))},
        {"name": "stop-1f1b", "poison": {"step": 4, "kind": "inf"},
         "config": str(write_config(work, "stop-1f1b", "1f1b", steps=6, every=2, **data))},
        # 2BW learns of step 3's NaN one step late, but before the save at step 4.
        {"name": "stop-2bw", "poison": {"step": 3, "kind": "nan"},
         "config": str(write_config(work, "stop-2bw", "2bw", steps=6, every=2, **data))},
    ]
    data_cfg = json.loads(Path(runs[0]["config"]).read_text())
    data_cfg["ds_async"]["data"]["min_chars"] = 3
    Path(runs[0]["config"]).write_text(json.dumps(data_cfg))
    results = launch(work, "nonfinite", runs)

    skip = results["skip-2bw"][1]
    assert skip["error"] is None and skip["summary"]["skipped_steps"] == 1, skip
    assert skip["summary"]["skipped_docs"]["empty"] > 0 and skip["summary"]["skipped_docs"]["short"] > 0
    assert skip["summary"]["skipped_docs"]["non_utf8"] > 0, skip["summary"]
    params = load_file(checkpoint.step_dir(ckpt_root(work, "skip-2bw"), 6) / "model-stage01-of-02.safetensors")
    assert all(torch.isfinite(t).all() for t in params.values())

    for name, step, kind in (("stop-1f1b", 4, "inf"), ("stop-2bw", 3, "NaN")):
        root = ckpt_root(work, name)
        for rank in results[name]:
            assert rank["error"].startswith(f"NonFiniteLoss: step {step}: the training loss is {kind}"), rank
            assert str(checkpoint.step_dir(root, 2)) in rank["error"]
        assert [s for s, _ in checkpoint.complete_checkpoints(root)] == [2]
        folder = checkpoint.step_dir(root, 2)
        # The run's summary covers the steps it logged and says why it stopped (a diverged run is a result).
        summary = json.loads((work / "runs" / name / "summary.json").read_text())
        assert summary["stopped"] == results[name][1]["error"] and summary["checkpoint"] == str(folder), summary
        assert 0 < summary["steps"] <= step + 1 and summary["history"]["train"][-1][0] == summary["steps"]
        checkpoint.verify(folder, checkpoint.read_manifest(folder)["files"])  # intact


# ------------------------------------------------------------------------- interrupted and corrupt saves
def _write(root: Path, step: int, kill_at: str | None = None) -> None:
    """Save a small checkpoint in a forked child that SIGKILLs itself at ``kill_at``."""
    pid = os.fork()
    if pid == 0:  # child
        try:
            real_replace = os.replace

            def files(tmp):
                torch.save({"w": torch.arange(1000.0) * step}, tmp / "state.pt")
                if kill_at == "files":
                    os.kill(os.getpid(), signal.SIGKILL)
                return ["state.pt"]

            def replace(src, dst):
                if kill_at == "rename" and Path(dst).name == f"step_{step:08d}":
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_replace(src, dst)

            os.replace = replace
            checkpoint.write(root, step, files, {"note": "test"}, keep=2)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) == (kill_at is not None)


@pytest.mark.parametrize("kill_at", ["files", "rename"])
def test_interrupted_save_leaves_previous_checkpoint_newest(tmp_path, kill_at):
    _write(tmp_path, 1)
    _write(tmp_path, 2, kill_at=kill_at)
    assert checkpoint.resolve(tmp_path) == checkpoint.step_dir(tmp_path, 1)
    assert (tmp_path / "step_00000002.tmp").exists()
    _write(tmp_path, 3)
    _write(tmp_path, 4)
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path)] == [3, 4]  # keep=2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        checkpoint.resolve(tmp_path / "step_00000002.tmp")


def test_process_groups_write_their_own_checkpoints_at_once(tmp_path):
    """``folder.write`` and ``folder.gather`` are collective over the group they are given, not over the world: two
    groups of 2 among 4 ranks each gather only their own ranks, and each group's first rank completes its
    checkpoint."""
    got = run_job(4, "checkpoint_groups", tmp_path)
    assert got["gathered"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for k, ranks in ((0, (0, 1)), (1, (2, 3))):
        final = tmp_path / f"group{k}" / "step_00000001"
        manifest = json.loads((final / "checkpoint.json").read_text())
        assert manifest["group"] == k and sorted(manifest["files"]) == [f"rank{r}.json" for r in ranks]
        assert [json.loads((final / f"rank{r}.json").read_text()) for r in ranks] == [list(ranks)] * 2
        checkpoint.verify(final, [f"rank{r}.json" for r in ranks])


def test_corrupt_or_truncated_checkpoint_is_refused_with_its_path(tmp_path):
    _write(tmp_path, 1)
    folder = checkpoint.step_dir(tmp_path, 1)
    file = folder / "state.pt"
    good = file.read_bytes()
    checkpoint.verify(folder, ["state.pt"])
    file.write_bytes(good[:-7])
    with pytest.raises(CheckpointError, match=f"{file}: .* bytes, the manifest says"):
        checkpoint.verify(folder, ["state.pt"])
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 1
    file.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=f"{file}: contents do not match"):
        checkpoint.verify(folder, ["state.pt"])
    file.write_bytes(b"not a torch file at all")
    with pytest.raises(CheckpointError, match=f"{file}: cannot be loaded"):
        checkpoint.load_file(file)
    file.unlink()
    with pytest.raises(CheckpointError, match=f"{file}: missing"):
        checkpoint.verify(folder, ["state.pt"])
    (folder / checkpoint.MANIFEST).write_text("{ truncated")
    with pytest.raises(CheckpointError, match=f"{folder / checkpoint.MANIFEST}: unreadable"):
        checkpoint.read_manifest(folder)


def test_each_block_of_a_large_file_is_hashed_and_checked(tmp_path):
    """A file of several blocks: the manifest holds the sha256 of each block (checked here against hashlib on the
    file's slices), and a flipped bit in any block, the last one included, is refused."""
    block = checkpoint.folder.BLOCK
    data = os.urandom(2 * block + 1000)

    def files(tmp):
        (tmp / "big.bin").write_bytes(data)
        (tmp / "empty.bin").write_bytes(b"")
        return ["big.bin", "empty.bin"]

    folder = checkpoint.write(tmp_path, 1, files, {})
    entries = checkpoint.read_manifest(folder)["files"]
    assert checkpoint.read_manifest(folder)["format"] == 2
    assert entries["big.bin"] == {"size": len(data), "block_size": block,
                                  "block_sha256": [hashlib.sha256(data[at:at + block]).hexdigest()
                                                   for at in (0, block, 2 * block)]}
    assert entries["empty.bin"] == {"size": 0, "block_size": block, "block_sha256": []}
    checkpoint.verify(folder, ["big.bin", "empty.bin"])
    for at in (0, block + 5, len(data) - 1):
        flipped = bytearray(data)
        flipped[at] ^= 1
        (folder / "big.bin").write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match=f"{folder / 'big.bin'}: contents do not match"):
            checkpoint.verify(folder, ["big.bin"])


def test_format_1_checkpoints_are_still_verified(tmp_path):
    """A checkpoint whose manifest (format 1) holds one sha256 per file is read and checked as before."""
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    data = os.urandom(3000)
    (folder / "state.pt").write_bytes(data)
    (folder / checkpoint.MANIFEST).write_text(json.dumps(
        {"format": 1, "step": 1, "files": {"state.pt": {"size": 3000, "sha256": hashlib.sha256(data).hexdigest()}}}))
    checkpoint.verify(folder, ["state.pt"])
    (folder / "state.pt").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=f"{folder / 'state.pt'}: contents do not match"):
        checkpoint.verify(folder, ["state.pt"])
    (folder / checkpoint.MANIFEST).write_text(json.dumps({"format": 3, "files": {}}))
    with pytest.raises(CheckpointError, match="not a ds_async checkpoint manifest of a format this version reads"):
        checkpoint.read_manifest(folder)


def test_a_load_that_fails_on_a_corrupt_file_reports_the_corruption(tmp_path):
    """``verifying`` hashes while its block loads; a file whose bytes were overwritten fails to load, and what is
    raised is the manifest's verdict on the file, not the loader's error."""
    _write(tmp_path, 1)
    folder = checkpoint.step_dir(tmp_path, 1)
    file = folder / "state.pt"
    file.write_bytes(b"x" * file.stat().st_size)
    with pytest.raises(CheckpointError, match=f"{file}: contents do not match"):
        with checkpoint.verifying(folder, ["state.pt"]):
            checkpoint.load_file(file)
    with pytest.raises(CheckpointError, match=f"{file}: cannot be loaded"):
        checkpoint.load_file(file)


def test_weights_only_refuses_pickled_code(tmp_path):
    file = tmp_path / "evil.pt"
    torch.save({"x": SimpleNamespace(a=1)}, file)  # an arbitrary object: weights_only=True will not unpickle it
    with pytest.raises(CheckpointError, match=f"{file}: cannot be loaded"):
        checkpoint.load_file(file)


def test_resume_needs_the_same_layout_and_tokenizer(tmp_path):
    """The manifest check of ``checkpoint.load`` (before any file is read), on a stand-in engine."""
    def stand_in(schedule):
        layout = {"schedule": schedule, "pipeline_stages": 2, "data_parallel": 1, "micro_batches": 4,
                  "micro_batch_size": 2, "parts": [0, 2, 4]}
        return SimpleNamespace(num_stages=2, stage_id=0, grid=SimpleNamespace(data_parallel_id=0),
                               layout=lambda: layout)

    engine = stand_in("2bw")
    manifest = {**engine.layout(), "tokenizer": {"size": 512, "sha256": "a"}}
    checkpoint.write(tmp_path, 5, lambda tmp: [], manifest)
    folder = checkpoint.step_dir(tmp_path, 5)
    with pytest.raises(CheckpointError, match="saved with tokenizer = .*this run has"):
        checkpoint.load(engine, folder, check={"tokenizer": {"size": 600, "sha256": "b"}})
    engine = stand_in("1f1b")
    with pytest.raises(CheckpointError, match=f"{folder}: saved with schedule = '2bw', this run has '1f1b'"):
        checkpoint.load(engine, folder)


# ------------------------------------------------------------------------------------------- bad input
def _train_cli(config: Path, capsys, *args: str) -> str:
    """``launch/train.py --config CONFIG [ARGS]`` in this process: must exit 1 with one error line."""
    return train_py_error(["--config", str(config), *args], capsys)


def test_malformed_or_missing_config_keys_fail_clearly(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 2,, }')
    assert f"{bad}: not valid JSON" in _train_cli(bad, capsys)
    assert f"{tmp_path / 'absent.json'}: config file not found" in _train_cli(tmp_path / "absent.json", capsys)
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    assert 'no "ds_async" section' in _train_cli(bad, capsys)
    bad.write_text(json.dumps({"ds_async": {"train": {"steps": 3}}}))
    assert "ds_async.model: set exactly one of 'config'" in _train_cli(bad, capsys)
    bad.write_text(json.dumps({"ds_async": {"model": {"config": TINY}, "train": {"steps": 3},
                                            "checkpoint": {"evry": 2}}}))
    assert "ds_async.checkpoint.evry: unknown key (did you mean 'ds_async.checkpoint.every'?)" in \
        _train_cli(bad, capsys)
    bad.write_text(json.dumps({"ds_async": {"model": {"config": TINY}, "train": {"steps": 3,
                                                                                 "on_nonfinite": "ignore"}}}))
    assert "ds_async.train.on_nonfinite: must be one of ['stop', 'skip']" in _train_cli(bad, capsys)
    bad.write_text(json.dumps({"ds_async": {"model": {"config": TINY}, "train": {}}}))
    assert "ds_async.train: set exactly one of 'steps' and 'tokens'" in _train_cli(bad, capsys)


def test_missing_batch_size_is_named():
    cfg = parse({"model": {"config": TINY}, "train": {"steps": 3}})
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu: required"):
        check_batch({"gradient_accumulation_steps": 2}, cfg, 2)


def test_missing_or_unreadable_data_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no data files match .*absent-"):
        load_text_stream(str(tmp_path / "absent-*.parquet"), "train")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match=f"{corrupt}: not a readable parquet file"):
        load_text_stream(str(corrupt), "train")
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    with pytest.raises(DataError, match=f"{folder}: is a directory"):
        load_text_stream(str(folder), "train")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": "cut off\n')
    batches = PackedBatches(load_text_stream(str(broken), "train"), _tokenizer(tmp_path), 4, 1,
                            shuffle_buffer=0, repeat=False, source=str(broken))
    with pytest.raises(DataError, match=f"{broken}: reading failed"):
        list(batches)


def _tokenizer(tmp_path):
    path = tmp_path / "tok" / "tokenizer.json"
    if not path.exists():
        train_bpe(iter(["some text to learn a few merges from", "and some more text"] * 20), 300, str(path))
    return load_tokenizer(str(path))


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_empty_short_and_non_utf8_documents_are_skipped_and_counted(tmp_path, suffix):
    docs = ["a first real document", "", "   ", "x", "ok", "a second real document", "third document here"]
    path = tmp_path / f"docs{suffix}"
    if suffix == ".txt":
        path.write_bytes(b"\n".join(d.encode() for d in docs) + b"\nnot utf-8: caf\xe9\n\xff\xfe\n")
    else:
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs)
                        + json.dumps({"text": None}) + "\n")
    tok = _tokenizer(tmp_path)
    batches = PackedBatches(load_text_stream(str(path), "train"), tok, 4, 1, shuffle_buffer=0, repeat=False,
                            min_chars=3)
    got = torch.cat([x.flatten() for x, _ in batches]).tolist()
    want = []
    for d in ("a first real document", "a second real document", "third document here"):
        want += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert got == want[:len(got)] and len(got) >= len(want) - 5
    expected = {"empty": 2, "short": 2, "non_utf8": 2, "not_text": 0} if suffix == ".txt" else \
        {"empty": 3, "short": 2, "non_utf8": 0, "not_text": 0}
    assert batches.skipped == expected
    state = batches.state_dict()
    assert state["skipped"] == expected and state["skipped_docs"] == sum(expected.values())


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    from transformers import LlamaConfig

    tok = _tokenizer(tmp_path)
    check_vocab(tok, LlamaConfig(vocab_size=len(tok)), "tok.json")
    with pytest.raises(ConfigError, match=rf"vocab_size 100 is smaller than the tokenizer's vocabulary \({len(tok)} "
                                          r"tokens from tok.json\); the tokenizer does not match the model"):
        check_vocab(tok, LlamaConfig(vocab_size=100), "tok.json")


def _sharded_reload_worker(rank, port, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        opt = ShardedOptimizer(build_optimizer(MUON, model, correction=EF))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        again = ShardedOptimizer(build_optimizer(MUON, model, correction=EF))
        again.load_state_dict(opt.state_dict())
        again.param_groups[0]["lr"] = 0.125  # what an LR scheduler does, on the wrapper
        torch.save({"lr": again.optimizer.param_groups[0]["lr"], "shared": again.state is again.optimizer.state},
                   out)
    finally:
        dist.destroy_process_group()


def test_sharded_optimizer_reload_keeps_the_lr_schedule_attached(tmp_path):
    """After ``load_state_dict`` the wrapper must still share the wrapped optimizer's groups, or an LR scheduler
    stepping the wrapper would no longer reach the optimizer (a resumed run would drift)."""
    import torch.multiprocessing as mp

    mp.start_processes(_sharded_reload_worker, args=(free_port(), str(tmp_path / "r.pt")), nprocs=1,
                       start_method="fork")
    got = torch.load(tmp_path / "r.pt", weights_only=True)
    assert got == {"lr": 0.125, "shared": True}


# ------------------------------------------------------------------- issue 23: data loss (found before training)
HUGE_LR = {"type": "AdamW", "params": {"lr": 1e6, "weight_decay": 0.1, "torch_adam": True}}


def _finite(folder: Path) -> bool:
    return all(torch.isfinite(t).all() for f in folder.glob("*.safetensors") for t in load_file(f).values())


def test_diverging_runs_never_save_nonfinite_weights(work):
    """AdamW at lr 1e6 overflows the weights in an update whose loss (computed before it) is still finite: no
    checkpoint may hold them, and the error names the newest checkpoint, a good one. ``skip`` ends with a warning
    line and an error when the last step was skipped, not silently with a NaN final loss."""
    runs = []
    for name, schedule, section in (("diverge-1f1b", "1f1b", {}), ("diverge-2bw", "2bw", {}),
                                    ("diverge-skip", "2bw", {"train": {"steps": 8, "on_nonfinite": "skip"}})):
        config = write_config(work, name, schedule, HUGE_LR, steps=8, every=1, **section)
        raw = json.loads(config.read_text())
        raw["ds_async"]["checkpoint"]["keep"] = 0
        config.write_text(json.dumps(raw))
        runs.append({"name": name, "config": str(config)})
    results = launch(work, "diverge", runs)
    log = (work / "diverge.log").read_text()
    for name in ("diverge-1f1b", "diverge-2bw", "diverge-skip"):
        saved = checkpoint.complete_checkpoints(ckpt_root(work, name))
        assert saved, name
        assert all(_finite(folder) for _, folder in saved), f"{name}: a checkpoint with non-finite weights"
        for rank in results[name]:
            assert rank["error"] is not None and rank["error"].startswith("NonFinite"), rank
            assert rank["error"].endswith(f"the newest checkpoint is {saved[-1][1]}"), rank
    assert [s for s, _ in checkpoint.complete_checkpoints(ckpt_root(work, "diverge-skip"))][-1] < 8
    assert "the last step's loss or gradient was not finite" in results["diverge-skip"][0]["error"]
    assert "ds_async: warning: " in log and "steps this job ran had a non-finite loss or gradient and their " \
        "updates were skipped" in log, log[-3000:]


def test_bad_checkpoint_folders_and_sources_stop_the_job_at_start(work):
    """One job of several trainer runs (plus a second job holding a checkpoint folder): each refusal happens at
    setup, names what is wrong and leaves the checkpoints that exist as they were."""
    base = write_config(work, "base", "1f1b", steps=4, every=2)
    longer = json.loads(base.read_text())
    longer["ds_async"]["train"]["steps"] = 6
    (work / "base6.json").write_text(json.dumps(longer))
    root = ckpt_root(work, "base")
    junk = checkpoint.step_dir(root, 6)  # a step folder without a manifest, in the way of the save of step 6
    junk.mkdir(parents=True)
    (junk / "model.safetensors").write_bytes(b"half")
    (work / "empty").mkdir()
    (work / "a-file").write_text("not a folder")
    val_missing = write_config(work, "val-missing", "1f1b", steps=2)
    raw = json.loads(val_missing.read_text())
    raw["ds_async"]["data"]["validation"] = str(work / "absent-validation.jsonl")
    val_missing.write_text(json.dumps(raw))
    file_dir = write_config(work, "ckdir-file", "1f1b", steps=2, checkpoint={"dir": str(work / "a-file")})
    log_file = write_config(work, "logdir-file", "1f1b", steps=2)
    raw = json.loads(log_file.read_text())
    raw["ds_async"]["logging"]["dir"] = str(work / "a-file")
    log_file.write_text(json.dumps(raw))
    sgd = write_config(work, "base-sgd", "1f1b", optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                       steps=4, every=2)
    # Muon with each expert's [gate; up] stack as one matrix (how optimizer state was laid out before split_gate_up
    # became the default), resumed with the default.
    moe_fused = write_config(work, "moe-fused", "1f1b", family="mixtral", steps=2, every=2,
                             optimizer={"type": "Muon", "params": {**MUON["params"], "split_gate_up": False}})
    moe_split = write_config(work, "moe-split", "1f1b", family="mixtral", steps=4, optimizer=MUON)
    # Data without usable text (an empty file, rows without data.text_field, binary bytes), and text with a share
    # of non-UTF-8 lines that trains with a warning.
    import random

    (work / "empty.txt").write_text("")
    (work / "body.jsonl").write_text("".join(json.dumps({"body": f"document {i} of some text"}) + "\n"
                                             for i in range(50)))
    (work / "binary.txt").write_bytes(random.Random(0).randbytes(50_000))
    lee = [row["text"].encode() for row in load_text_stream(LEE_CORPUS, "train")]
    (work / "mixed.txt").write_bytes(b"\n".join(sum(([t, b"\xff\xfe\x00 not text"] if i % 5 == 0 else [t]
                                                     for i, t in enumerate(lee)), [])) + b"\n")
    val_short = write_config(work, "val-short", "1f1b", steps=2)  # fewer micro-batches than eval.batches (4)
    raw = json.loads(val_short.read_text())
    (work / "short.jsonl").write_text("".join(json.dumps({"text": f"a short document, number {i}"}) + "\n"
                                              for i in range(12)))
    raw["ds_async"]["data"]["validation"] = str(work / "short.jsonl")
    val_short.write_text(json.dumps(raw))
    data_runs = {name: write_config(work, name, "1f1b", steps=2, data=str(work / file))
                 for name, file in (("data-empty", "empty.txt"), ("data-field", "body.jsonl"),
                                    ("data-binary", "binary.txt"), ("data-mixed", "mixed.txt"))}

    # A first job holds the checkpoint folder of "held" (it hangs in step 2): a second one must be refused.
    held = write_config(work, "held", "1f1b", steps=4)
    holder = launch(work, "holder", [{"name": "held", "config": str(held), "stall_at": 2}], wait=False)
    lock_file = ckpt_root(work, "held") / ".lock"
    try:
        deadline = time.time() + 300
        while not (lock_file.exists() and lock_file.read_text()):
            assert holder.poll() is None, (work / "holder.log").read_text()[-4000:]
            assert time.time() < deadline, "the first job did not lock its checkpoint folder"
            time.sleep(0.1)
        results = launch(work, "setup", [
            {"name": "base", "config": str(base)},
            {"name": "rerun", "config": str(base)},
            {"name": "resume-sgd", "config": str(sgd), "resume": str(work / "runs" / "base")},
            {"name": "moe-fused", "config": str(moe_fused)},
            {"name": "resume-moe-split", "config": str(moe_split), "resume": str(work / "runs" / "moe-fused")},
            *({"name": name, "config": str(config)} for name, config in data_runs.items()),
            {"name": "resume-empty", "config": str(base), "resume": str(work / "empty")},
            {"name": "resume-run-folder", "config": str(work / "base6.json"), "resume": str(work / "runs" / "base")},
            {"name": "val-missing", "config": str(val_missing)},
            {"name": "val-short", "config": str(val_short)},
            {"name": "ckdir-file", "config": str(file_dir)},
            {"name": "logdir-file", "config": str(log_file)},
            {"name": "second-job", "config": str(held)},
        ])
        holder_pid = int((work / "holder" / "pid.rank0").read_text())
    finally:
        kill_job(holder, work / "holder")
    log = (work / "setup.log").read_text()

    assert all(r["error"] is None for r in results["base"]), results["base"]
    for rank in results["rerun"]:  # re-running a run name without --resume: refused, nothing moved aside
        assert rank["error"].startswith(f"CheckpointError: {root}: holds checkpoints of an earlier run "
                                        "(newest step_00000004)") and "--resume" in rank["error"], rank
    for rank in results["resume-empty"]:
        assert rank["error"].startswith(f"CheckpointError: --resume {work / 'empty'}: no complete checkpoint"), rank
    # --resume of a run folder: its checkpoints/; the manifest-less step 6 folder is moved aside, not in the way.
    summary = results["resume-run-folder"][1]["summary"]
    assert summary is not None and summary["resumed_from"] == str(checkpoint.step_dir(root, 4)), results
    assert [s for s, _ in checkpoint.complete_checkpoints(root)] == [4, 6]
    aside = [p for p in root.iterdir() if p.name.startswith("step_00000006.incomplete-")]
    assert len(aside) == 1 and (aside[0] / "model.safetensors").read_bytes() == b"half"
    assert f"ds_async: warning: {junk} had no checkpoint.json" in log
    assert not [p for p in root.iterdir() if "superseded" in p.name]
    for rank in results["val-missing"]:  # found at setup: no step was trained or saved
        assert rank["error"].startswith("FileNotFoundError: ds_async.data.validation: ") and \
            "absent-validation.jsonl" in rank["error"], rank
    assert checkpoint.complete_checkpoints(ckpt_root(work, "val-missing")) == []
    for rank in results["val-short"]:  # was a StopIteration at the evaluation after training
        assert rank["error"].startswith(f"DataError: ds_async.data.validation: {work / 'short.jsonl'}: too little "
                                        "text for ds_async.eval.batches = 4 micro-batches of 2 x 32 tokens per "
                                        "replica (data-parallel rank 0 ran out after "), rank
    assert checkpoint.complete_checkpoints(ckpt_root(work, "val-short")) == []
    for rank in results["ckdir-file"]:
        assert rank["error"].startswith(f"ConfigError: ds_async.checkpoint.dir: {work / 'a-file'} cannot hold "
                                        "checkpoints"), rank
    for rank in results["logdir-file"]:
        assert rank["error"].startswith(f"ConfigError: ds_async.logging.dir: cannot create the run folder "
                                        f"{work / 'a-file' / 'logdir-file'}"), rank
    for rank in results["resume-sgd"]:  # AdamW's state would have loaded into SGD without a word
        assert rank["error"].startswith("ConfigError: optimizer.type: 'SGD', but the checkpoint "
                                        f"{checkpoint.step_dir(root, 4)} was saved with 'AdamW'"), rank
    assert all(r["error"] is None for r in results["moe-fused"]), results["moe-fused"]
    moe_step = checkpoint.step_dir(ckpt_root(work, "moe-fused"), 2)
    for rank in results["resume-moe-split"]:  # torch alone names no cause; every rank says stage 0's error
        assert rank["error"] == (
            f"CheckpointError: {moe_step}: rank 0 could not restore it (ValueError: Muon: the saved param groups are "
            "['matrix', 'embedding', 'vector'], this optimizer's are ['matrix', 'gate_up', 'embedding', 'vector']; "
            "it was saved with optimizer.params.split_gate_up = false: set that in the config to resume it)"), rank
    for name, message in (("data-empty", f"{work / 'empty.txt'} (split='train'): no documents (empty)"),
                          ("data-field", f"{work / 'body.jsonl'} (split='train'): no usable text: all 50 documents "
                                         "data-parallel rank 0 read in a whole pass were skipped (50 empty); the "
                                         "rows have no column 'text' (ds_async.data.text_field), they have 'body'"),
                          ("data-binary", f"{work / 'binary.txt'}")):
        for rank in results[name]:  # every rank, at start: nothing trained or saved
            assert rank["error"].startswith(f"DataError: ds_async.data.train: {message}"), rank
        assert checkpoint.complete_checkpoints(ckpt_root(work, name)) == []
    assert "this is not UTF-8 text" in results["data-binary"][0]["error"]
    assert all(r["error"] is None for r in results["data-mixed"]), results["data-mixed"]
    assert f"ds_async: warning: ds_async.data.train: {work / 'mixed.txt'}: " in log and \
        "documents are not valid UTF-8 and are skipped" in log, log[-3000:]
    for rank in results["second-job"]:
        assert rank["error"].startswith(f"CheckpointError: {ckpt_root(work, 'held')}: in use by another job "
                                        f"(pid {holder_pid} on host "), rank
    # The killed holder left no stale lock (once its processes are gone: SIGKILL takes effect asynchronously).
    from ds_async.checkpoint import folder
    deadline = time.time() + 60
    while True:
        try:
            folder.lock(ckpt_root(work, "held"))
            break
        except CheckpointError:
            assert time.time() < deadline, "the killed job's lock was not released"
            time.sleep(0.1)
    folder.release(ckpt_root(work, "held"))


def test_incomplete_step_folder_is_moved_aside_by_the_next_save(tmp_path, capsys):
    _write(tmp_path, 1)
    junk = checkpoint.step_dir(tmp_path, 2)
    junk.mkdir()
    (junk / "state.pt").write_bytes(b"partial")
    assert checkpoint.resolve(tmp_path) == checkpoint.step_dir(tmp_path, 1)
    def files(tmp):
        torch.save({"w": torch.ones(3)}, tmp / "state.pt")
        return ["state.pt"]

    for _ in range(2):  # the second save of step 2 supersedes the first; neither fails on the folder
        checkpoint.write(tmp_path, 2, files, {"note": "test"}, keep=0)
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path)] == [1, 2]
    aside = [p.name for p in tmp_path.iterdir() if ".incomplete-" in p.name]
    assert len(aside) == 1 and (tmp_path / aside[0] / "state.pt").read_bytes() == b"partial"
    assert f"ds_async: warning: {junk} had no checkpoint.json" in capsys.readouterr().out


def test_a_lock_file_that_cannot_be_opened_names_it_and_the_key(tmp_path):
    """(Root may open any file: a folder where the lock file belongs stands in for one of another user.)"""
    from ds_async.checkpoint import folder

    (tmp_path / folder.LOCK).mkdir()
    with pytest.raises(CheckpointError, match=f"{tmp_path / folder.LOCK}: cannot open the checkpoint folder's lock "
                                              r"file \(Is a directory\); .*\(ds_async.checkpoint.dir\)"):
        folder.lock(tmp_path)


def test_checkpoint_folder_lock_refuses_a_second_holder_until_it_dies(tmp_path):
    from ds_async.checkpoint import folder

    ready = tmp_path / "ready"
    pid = os.fork()
    if pid == 0:  # child: hold the lock, then wait to be killed
        try:
            folder.lock(tmp_path)
            ready.write_text("1")
            time.sleep(600)
        finally:
            os._exit(0)
    try:
        deadline = time.time() + 60
        while not ready.exists():
            assert time.time() < deadline
            time.sleep(0.02)
        with pytest.raises(CheckpointError, match=f"{tmp_path}: in use by another job \\(pid {pid} on host "):
            folder.lock(tmp_path)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    folder.lock(tmp_path)  # the OS released the killed holder's lock
    folder.lock(tmp_path)  # this process holds it already: fine
    folder.release(tmp_path)
    (tmp_path / "a-file").write_text("")
    for unusable in (tmp_path / "a-file", tmp_path / "a-file" / "below"):
        with pytest.raises(OSError):
            folder.prepare(unusable)


def test_resume_path_takes_a_run_folder_and_refuses_one_without_checkpoints(tmp_path):
    cfg = parse({"model": {"config": TINY}, "train": {"steps": 3}})
    run = tmp_path / "runs" / "R"
    for step in (2, 4):
        checkpoint.write(run / "checkpoints", step, lambda tmp: [], {"note": "test"})
    for spec in (run, run / "checkpoints", checkpoint.step_dir(run / "checkpoints", 4)):
        assert _resume_from(str(spec), cfg, tmp_path / "elsewhere") == checkpoint.step_dir(run / "checkpoints", 4)
    (tmp_path / "none").mkdir()
    with pytest.raises(CheckpointError, match=f"--resume {tmp_path / 'none'}: no complete checkpoint there"):
        _resume_from(str(tmp_path / "none"), cfg, tmp_path / "elsewhere")
    assert _resume_from("latest", parse({"model": {"config": TINY}, "train": {"steps": 3},
                                         "logging": {"run_name": "R"}}), tmp_path / "fresh") is None


@pytest.mark.parametrize("section, message", [
    ({"train": {"steps": 0}}, "ds_async.train.steps: must be >= 1, got 0"),
    ({"train": {"steps": -3}}, "ds_async.train.steps: must be >= 1, got -3"),
    ({"train": {"tokens": 0}}, "ds_async.train.tokens: must be >= 1, got 0"),
    ({"train": {"steps": 3}, "eval": {"every": -1}}, "ds_async.eval.every: must be >= 0, got -1"),
    ({"train": {"steps": 3}, "eval": {"batches": 0}}, "ds_async.eval.batches: must be >= 1, got 0"),
    ({"train": {"steps": 3}, "logging": {"every": 0}}, "ds_async.logging.every: must be >= 1, got 0"),
    ({"train": {"steps": 3}, "data": {"shuffle_buffer": -5}}, "ds_async.data.shuffle_buffer: must be >= 0, got -5"),
])
def test_nonsense_run_lengths_and_cadences_are_refused(section, message):
    with pytest.raises(ConfigError, match=message):
        parse({"model": {"config": TINY}, **section})


def test_max_steps_below_one_is_refused(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"ds_async": {"model": {"config": TINY}, "train": {"steps": 3}}}))
    assert _train_cli(config, capsys, "--max-steps", "0") == "ds_async: error: --max-steps: must be >= 1, got 0"
