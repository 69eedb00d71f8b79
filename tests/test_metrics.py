"""Training metrics (issue 22): gradient norm, step time, windowed tokens/s, MFU, peak memory and idle fraction per
stage, optimizer figures, in ``summary.json``, tensorboard and DeepSpeed's monitor blocks, under 1f1b and 2bw.

One torchrun job (2 CPU ranks, gloo, ``tests/ckpt_jobs.py``) trains a tiny LLaMA over 2 stages under each schedule
with DeepSpeed's ``csv_monitor`` block on; the gradient norms are checked against the single-process emulation of
the same JSON (``ds_async.emulate``, bit-equal to the engine on CPU in fp32), recorded where it clips.
"""
from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ds_async import checkpoint, emulate, metrics, telemetry
from ds_async.config import ConfigError, parse
from ds_async.data import LEE_CORPUS, load_text_stream
from ds_async.flops import model_flops_per_token
from ds_async.pipe import delayed
from ds_async.tokenizer import train_bpe
from distributed import run_ckpt_jobs

ROOT = Path(__file__).resolve().parents[1]
TINY = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
STEPS, SEQ, PEAK_TFLOPS = 8, 32, 1e-3
SCHEDULES = ("2bw", "1f1b")
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}}
MUON = {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "adam_lr": 3e-3,
                                   "adam_weight_decay": 0.1}}
# 2bw with ds_async's Muon + EF (update RMS, EF buffer norm and staleness in the optimizer figures), 1f1b with
# torch's AdamW (DeepSpeed steps it; staleness only).
OPTIMIZERS = {"2bw": (MUON, {"type": "ef", "lambda": 1.0}), "1f1b": (ADAMW, {"type": "none"})}


def write_config(work: Path, schedule: str) -> Path:
    name = f"metrics-{schedule}"
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
          "gradient_clipping": 1.0, "optimizer": OPTIMIZERS[schedule][0],
          "csv_monitor": {"enabled": True, "output_path": str(work / "csv"), "job_name": name},
          "ds_async": {"model": {"config": TINY}, "tokenizer": str(work / "tokenizer.json"), "pipeline_stages": 2,
                       "partition": {"method": "uniform"}, "schedule": schedule,
                       "correction": OPTIMIZERS[schedule][1],
                       "data": {"train": "gensim:lee", "validation": "gensim:lee", "seq_len": SEQ,
                                "shuffle_buffer": 50},
                       "train": {"steps": STEPS}, "eval": {"every": 4, "batches": 1},
                       "logging": {"dir": str(work / "runs"), "run_name": name, "progress": False, "plot": False,
                                   "window": 3, "warmup_steps": 1, "stages_every": 3, "optimizer_every": 4,
                                   "peak_tflops": PEAK_TFLOPS},
                       "checkpoint": {"final": False}}}
    path = work / f"{name}.json"
    path.write_text(json.dumps(ds))
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Both schedules trained in one torchrun job; the folder holds their configs, run folders and csv files."""
    path = tmp_path_factory.mktemp("metrics")
    texts = [row["text"] for row in load_text_stream(LEE_CORPUS, "train")]
    train_bpe(iter(texts), TINY["vocab_size"], str(path / "tokenizer.json"))
    runs = [{"name": s, "config": str(write_config(path, s))} for s in SCHEDULES]
    run_ckpt_jobs(path, runs)
    for s in SCHEDULES:
        results = [json.loads((path / "out" / f"{s}.rank{r}.json").read_text()) for r in range(2)]
        assert all(r["error"] is None for r in results), results
    return path


def summary(work: Path, schedule: str) -> dict:
    return json.loads((work / "runs" / f"metrics-{schedule}" / "summary.json").read_text())


# ------------------------------------------------------------------------------------------- the process after
def test_a_finished_run_leaves_its_process_as_it_found_it(work):
    """``ds_async.trainer.train`` in a process that goes on (a notebook, a sweep; here the job server's ranks): each
    run destroys the process groups it made (each gloo group keeps threads that wake all the time), so the second run
    ends with the threads the first one ended with."""
    for rank in range(2):
        first, second = (json.loads((work / "out" / f"{s}.rank{rank}.json").read_text()) for s in SCHEDULES)
        assert first["groups_left"] == second["groups_left"] == 0
        assert second["threads"] <= first["threads"]


# ------------------------------------------------------------------------------------------- the runs' logs
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_summary_and_tensorboard_hold_the_metrics(work, schedule):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from transformers import LlamaConfig

    got = summary(work, schedule)
    history = got["history"]
    assert [s for s, _ in history["grad_norm"]] == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) and v > 0 for _, v in history["grad_norm"]) and got["grad_norm"] > 0
    # Step time, tokens/s and MFU: from the step after the warm-up (1 step) on; the summary's over the run.
    assert [s for s, _ in history["tokens_per_s"]] == list(range(2, STEPS + 1))
    assert got["step_time_s"] > 0 and got["warmup_steps"] == 1
    # each evaluation with the training clock then, rising (time to loss)
    assert [s for s, _ in history["validation_seconds"]] == [s for s, _ in history["validation"]] == [4, 8]
    assert 0 < history["validation_seconds"][0][1] < history["validation_seconds"][1][1] <= got["seconds"]
    tokens_per_step = 2 * 2 * SEQ
    assert got["train_tokens_per_s"] == pytest.approx(tokens_per_step / got["step_time_s"])
    flops = model_flops_per_token(LlamaConfig(**TINY), SEQ) * tokens_per_step
    assert got["mfu"] == pytest.approx(flops / got["step_time_s"] / (2 * PEAK_TFLOPS * 1e12))
    for stage in ("stage0", "stage1"):
        figures = got["stages"][stage]
        assert figures["peak_memory_gib"] > 0 and 0.0 <= figures["idle_fraction"] < 1.0
        assert figures["steps"] == STEPS - 1
        # every stage steps its optimizer inside each train step, and that time is part of the idle time
        assert 0.0 < figures["optimizer_fraction"] < 1.0
        assert figures["optimizer_fraction"] <= figures["idle_fraction"]  # on CPU it runs between the passes
    figures = got["optimizer"]
    assert figures["step"] == STEPS
    if schedule == "2bw":  # the weights a batch's gradients came from are one step old
        assert figures["staleness"] > 0 and figures["ef_buffer_norm"] > 0
        assert [k for k in figures if k.startswith("update_rms/")] and all(
            v > 0 for k, v in figures.items() if k.startswith("update_rms/"))
    else:
        assert figures["staleness"] == 0.0

    events = EventAccumulator(str(work / "runs" / f"metrics-{schedule}")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens", "train/grad_norm", "train/step_time_s", "train/tokens_per_s",
            "train/mfu", "validation/loss", "optimizer/staleness", "stage0/idle_fraction", "stage1/idle_fraction",
            "stage0/peak_memory_gib", "stage1/peak_memory_gib", "stage0/optimizer_fraction"} <= tags
    assert [e.step for e in events.Scalars("train/grad_norm")] == list(range(1, STEPS + 1))
    # stages gathered at steps 3 and 6 (stages_every), 4 (evaluation) and at the end
    assert [e.step for e in events.Scalars("stage0/idle_fraction")] == [3, 4, 6, 8]

    log = (work / "log.txt").read_text()
    assert f"step {STEPS}/{STEPS}: loss" in log and "grad_norm" in log and "tokens/s" in log
    assert "stages s0 idle" in log and "staleness=" in log and "update_rms/" in log


def test_windowed_tokens_per_s_has_no_spike_under_2bw(work):
    """Per-step rates of a flush-free pipeline jumped with the host's lead (a 5-step run logged 935, 2563, 2503,
    2444, 898148 tokens/s: the drain at the end reports two steps at once). The windowed rate stays in a band."""
    rates = [v for _, v in summary(work, "2bw")["history"]["tokens_per_s"]]
    assert len(rates) == STEPS - 1 and min(rates) > 0
    assert max(rates) / min(rates) < 10, rates


def test_grad_norm_is_the_one_the_engine_clips_by(work, monkeypatch):
    """Every step's logged norm equals the norm the emulation clips by on the same JSON (bit-equal to the engine on
    CPU in fp32): under 2bw the pipeline's global norm of gradients taken on W(t-1), on the reporting rank. Both
    schedules' first steps see W(0) and the same batch: the same norm."""
    logged = {s: [v for _, v in summary(work, s)["history"]["grad_norm"]] for s in SCHEDULES}
    assert logged["2bw"][0] == pytest.approx(logged["1f1b"][0], rel=1e-6)
    assert logged["2bw"][1] != pytest.approx(logged["1f1b"][1], rel=1e-6)  # W(0) again vs W(1)
    original, norms = delayed.sum_in_stage_order, []

    def recording(parts):
        total = original(parts)
        norms.append(float(total.sqrt()))
        return total

    monkeypatch.setattr(delayed, "sum_in_stage_order", recording)
    for schedule in SCHEDULES:
        norms.clear()
        emulate.run(str(work / f"metrics-{schedule}.json"), run_name=f"emulated-{schedule}", device="cpu")
        assert len(norms) == STEPS
        assert logged[schedule] == norms, schedule


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_deepspeed_csv_monitor_gets_the_scalars(work, schedule):
    """DeepSpeed's monitor sinks live on rank 0 (stage 0, no loss under 2bw): the reporting rank's scalars reach
    them there, under every schedule; DeepSpeed's own events (x = samples, under 2bw only the LR) are off."""
    folder = work / "csv" / f"metrics-{schedule}"
    got = summary(work, schedule)

    def rows(name):
        with open(folder / f"{name}.csv") as f:
            header, *body = list(csv.reader(f))
        return header, [(int(s), float(v)) for s, v in body]

    header, loss = rows("train_loss")
    assert header == ["step", "loss"]
    assert loss == [(s, pytest.approx(v)) for s, v in got["history"]["train"]]
    assert [s for s, _ in rows("train_grad_norm")[1]] == list(range(1, STEPS + 1))
    assert rows("validation_loss")[1] == [(s, pytest.approx(v)) for s, v in got["history"]["validation"]]
    assert (folder / "train_tokens_per_s.csv").exists() and (folder / "stage1_idle_fraction.csv").exists()
    assert not (folder / "Train_Samples_lr.csv").exists()


# ---------------------------------------------------------------------------------------------- in-process
def test_engine_run_resumed_from_a_checkpoint_continues_the_clock(work, tmp_path):
    """Through launch/train.py's trainer: a 2bw run of 4 steps saves its clock and curves with its checkpoint, and
    the run of 8 resumed from it keeps the evaluation at step 4 and evaluates at step 8 on a clock that goes on
    from there."""
    runs = []
    for steps, resume in ((4, None), (8, "latest")):
        raw = json.loads(write_config(tmp_path, "2bw").read_text())
        raw.pop("csv_monitor")
        raw["ds_async"].update(tokenizer=str(work / "tokenizer.json"), train={"steps": steps},
                               checkpoint={"dir": str(tmp_path / "ckpt")})
        raw["ds_async"]["logging"].update(dir=str(tmp_path / "runs"), run_name=f"clock{steps}")
        path = tmp_path / f"clock{steps}.json"
        path.write_text(json.dumps(raw))
        runs.append({"name": f"clock{steps}", "config": str(path), "resume": resume})
    first = json.loads(run_ckpt_jobs(tmp_path, runs).joinpath("clock4.rank1.json").read_text())
    second = json.loads((tmp_path / "out" / "clock8.rank1.json").read_text())
    assert first["error"] is None and second["error"] is None, (first, second)
    # the reporting rank (last stage, rank 1) saved the clock it had after the evaluation at step 4
    saved = checkpoint.load_file(checkpoint.step_dir(tmp_path / "ckpt", 4) / "state-stage01-dp000.pt")["extra"]
    clock = {steps: json.loads((tmp_path / "runs" / f"clock{steps}" / "summary.json").read_text())["history"]
             ["validation_seconds"] for steps in (4, 8)}
    assert [s for s, _ in clock[4]] == [4] and [s for s, _ in clock[8]] == [4, 8]
    assert clock[8][0] == clock[4][0]  # the resumed run's curve goes on from the checkpoint's
    assert second["summary"]["resumed_from"]
    assert 0 < clock[4][0][1] <= round(saved["seconds"], 3) < clock[8][1][1]  # the history keeps milliseconds


def test_validation_clock_continues_a_resumed_run(tmp_path, monkeypatch):
    """``history["validation_seconds"]``: the clock at each evaluation, from the logger's making on, plus the
    seconds of the processes a resumed run continues; ``history["validation"]`` keeps its (step, loss) pairs; the
    summary's ``seconds`` is that clock at the end."""
    now = [50.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    log = metrics.RunLogger(tmp_path / "run", 10, 1, enabled=True, progress=False, start_step=4,
                            seconds_before=120.0)
    now[0] += 3.0
    log.validation(5, 2.5)
    now[0] += 4.5
    log.validation(10, 2.25)
    assert log.history["validation"] == [(5, 2.5), (10, 2.25)]
    assert log.history["validation_seconds"] == [(5, 123.0), (10, 127.5)] and log.elapsed() == 127.5
    now[0] += 0.0004
    summary = log.close(10, plot=False)
    assert summary["seconds"] == 127.5  # the same clock at the end: earlier processes included, milliseconds
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())["history"]
    assert saved["validation_seconds"] == [[5, 123.0], [10, 127.5]]
    assert saved["validation"] == [[5, 2.5], [10, 2.25]]
    quiet = metrics.RunLogger(tmp_path / "other", 10, 1, enabled=False)  # not the reporting rank: nothing recorded
    quiet.validation(5, 2.5)
    assert quiet.history["validation_seconds"] == [] and quiet.elapsed() == 0.0


def test_config_keys_are_checked():
    base = {"model": {"config": TINY}}
    assert parse({**base, "logging": {"window": 5, "peak_tflops": 989}}).logging.window == 5
    for key, value in (("window", 0), ("warmup_steps", -1), ("stages_every", -1),
                       ("peak_tflops", 0)):
        with pytest.raises(ConfigError, match=f"ds_async.logging.{key}: must be"):
            parse({**base, "logging": {key: value}})


def test_peak_flops_by_card_name(monkeypatch):
    cpu = torch.device("cpu")
    assert telemetry.peak_flops(None, cpu) is None and telemetry.peak_flops(2.5, cpu) == 2.5e12
    gpu = torch.device("cuda", 0)
    for name, tflops in (("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H200", 989),
                         ("NVIDIA A100-SXM4-80GB", 312), ("Tesla V100-SXM2-16GB", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert telemetry.peak_flops(None, gpu) == (None if tflops is None else tflops * 1e12), name
        assert telemetry.peak_flops(100.0, gpu) == 100e12


def test_stage_clock_window_and_warmup(monkeypatch):
    """Spans of the steps after the warm-up, a running mean over the window; passes count only inside a step."""
    now = [0.0]
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: now[0])
    clock = telemetry.StageClock(cuda=False, warmup=1, window=2, start_step=10)
    for step, (span, busy, step_s) in enumerate([(100.0, 50.0, 10.0), (1.0, 0.5, 0.25), (2.0, 1.0, 0.5),
                                                 (4.0, 1.0, 0.0)], start=11):
        clock.begin(step)
        token = clock.pass_begin()
        now[0] += busy
        clock.pass_end(token)
        token = clock.optimizer_begin()
        now[0] += step_s
        clock.optimizer_end(token)
        now[0] += span - busy - step_s
        clock.end(step)
        now[0] += 1000.0  # between steps (evaluation, logging): in no span
    assert clock.pass_begin() is None  # outside a step (evaluation): not timed
    assert clock.window_mean(11) is None and clock.window_mean(12) == 1.0
    assert clock.window_mean(14) == 3.0 and clock.window_mean(13) == 1.5
    window = clock.take_window()
    assert window == {"busy_s": 2.5, "wall_s": 7.0, "optimizer_s": 0.75, "steps": 3}
    assert clock.take_window()["steps"] == 0
    assert (clock.total_busy, clock.total_wall, clock.total_steps) == (2.5, 7.0, 3)
    assert clock.take_run() == {"busy_s": 2.5, "wall_s": 7.0, "optimizer_s": 0.75, "steps": 3}
    assert telemetry.idle_fraction(2.5, 7.0) == pytest.approx(1 - 2.5 / 7.0)
    assert telemetry.optimizer_fraction(0.75, 7.0) == pytest.approx(0.75 / 7.0)
    assert clock.optimizer_begin() is None  # outside a step: not timed


def _git(root: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True).stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_tree_differences_hashes_files_as_git_does(tmp_path):
    """A copy of a commit's files is checked against ``git ls-tree -r`` in both of its forms (quoted paths, and
    ``-z``): nothing differs until a file changes, a tracked file goes or a symlink points elsewhere; an untracked
    file is not looked at."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "dir" / "b c.py").write_text("print('b')\n")
    (tmp_path / "é\ttab.txt").write_bytes(b"\x00\xff binary")
    (tmp_path / "link").symlink_to("dir/b c.py")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "c")
    quoted, nul = _git(tmp_path, "ls-tree", "-r", "HEAD"), _git(tmp_path, "ls-tree", "-r", "-z", "HEAD")
    assert b'"' in quoted  # git quotes the non-ASCII, tab-holding name: the unquoting is exercised
    for listing in (quoted, nul):
        assert metrics.tree_differences(tmp_path, listing) == []
    (tmp_path / "untracked.py").write_text("x = 1\n")
    assert metrics.tree_differences(tmp_path, quoted) == []
    (tmp_path / "a.txt").write_text("alphA\n")  # same length, other bytes
    (tmp_path / "link").unlink()
    (tmp_path / "link").symlink_to("a.txt")
    (tmp_path / "é\ttab.txt").unlink()
    for listing in (quoted, nul):
        assert sorted(metrics.tree_differences(tmp_path, listing)) == ["a.txt", "link", "é\ttab.txt"]
    # a listing of another kind, or of nothing, is refused rather than taken for a clean copy
    with pytest.raises(ValueError, match="is not a line of git ls-tree -r"):
        metrics.tree_differences(tmp_path, _git(tmp_path, "ls-files", "-s"))
    with pytest.raises(ValueError, match="names no file"):
        metrics.tree_differences(tmp_path, b"")


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs this checkout's git")
def test_code_version_of_a_copy_names_its_commit_and_checks_its_files(tmp_path, monkeypatch):
    """Where the checkout has no usable ``.git``: ``DS_ASYNC_COMMIT`` names the commit (whether clean: unknown), and
    with ``DS_ASYNC_TREE`` the files are checked against that commit's listing, so a changed blob id makes the
    copy dirty. Without either, git is asked."""
    head = _git(ROOT, "rev-parse", "HEAD").decode().strip()
    dirty = bool(_git(ROOT, "status", "--porcelain", "--untracked-files=no"))
    monkeypatch.delenv("DS_ASYNC_COMMIT", raising=False)
    monkeypatch.delenv("DS_ASYNC_TREE", raising=False)
    assert {k: metrics.code_version()[k] for k in ("commit", "dirty", "source")} == {
        "commit": head, "dirty": dirty, "source": "git"}
    monkeypatch.setenv("DS_ASYNC_COMMIT", "c0ffee")
    assert {k: metrics.code_version()[k] for k in ("commit", "dirty", "source")} == {
        "commit": "c0ffee", "dirty": None, "source": "DS_ASYNC_COMMIT"}
    listing = _git(ROOT, "ls-tree", "-r", "HEAD")
    (tmp_path / "tree").write_bytes(listing)
    monkeypatch.setenv("DS_ASYNC_TREE", str(tmp_path / "tree"))
    version = metrics.code_version()
    assert (version["commit"], version["dirty"]) == ("c0ffee", dirty)
    assert version["source"] == "DS_ASYNC_TREE"
    line = next(x for x in listing.split(b"\n") if x.endswith(b"\tds_async/metrics.py"))
    mode, kind, blob = line.split(b"\t")[0].split()
    (tmp_path / "tree").write_bytes(listing.replace(line, b"%s %s %s\tds_async/metrics.py" % (mode, kind, b"0" * 40)))
    assert metrics.code_version()["dirty"] is True
