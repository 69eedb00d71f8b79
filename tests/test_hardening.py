"""Preemption, config changes on resume, huge documents, NUL text, a full disk, a symlinked lock (issue 43; the
run-length rule of issue 42, item 4).

Real 2-rank jobs on CPU (torchrun, gloo) with ``tests/test_checkpoint.py``'s tiny LLaMA and warm-up/cosine LR:

- SIGTERM to ``launch/train.py``'s launcher: the ranks agree on a step, save it, print one line and exit 75;
  ``--resume`` ends bit-equal to an uninterrupted run;
- one job of trainer runs (``tests/ckpt_jobs.py``, the trainer of ``launch/train.py``) for the rest: the LR logged
  after ``--resume`` is what the resume policy says (a new peak LR applied; a longer run keeping or re-stretching
  its schedule), a changed ``rope_theta`` is refused naming it, a NUL-filled ``.txt`` is refused at start, a
  checkpoint folder on a full disk (a small tmpfs; skipped where one cannot be mounted) says so, and a planted
  ``.lock`` symlink is refused without touching its target;
- a huge single-line document is tokenized in pieces: a subprocess's peak memory stays flat, the saved stream
  state small.
"""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from ds_async import checkpoint
from ds_async.checkpoint import CheckpointError
from ds_async.checkpoint.state import data_state_from_file, data_state_to_file
from ds_async.data import PIECE_CHARS, PackedBatches, document_encoder, load_text_stream, load_tokenizer

from distributed import free_port, job_env
from test_checkpoint import (ADAMW, ROOT, assert_bit_equal, ckpt_root, final_state, launch,  # noqa: F401 - work
                             work, write_config)

PEAK = 3e-3  # ADAMW's lr
WARMUP = 3  # write_config's scheduler


def _mount_tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


def _umount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], capture_output=True)


def _config(work: Path, name: str, edit=None, **kwargs) -> str:
    path = write_config(work, name, **kwargs)
    if edit is not None:
        raw = json.loads(path.read_text())
        edit(raw)
        path.write_text(json.dumps(raw))
    return str(path)


@pytest.fixture(scope="module")
def job(work) -> dict:
    """One job of trainer runs; returns each run's rank results, and the log and tmpfs state."""
    base = ckpt_root(work, "lr-base")
    nosched = ckpt_root(work, "nosched-base")

    def no_scheduler(raw):
        del raw["scheduler"]

    def peak_lr(raw):
        raw["optimizer"]["params"]["lr"] = 2 * PEAK

    def peak_lr_alone(raw):
        del raw["scheduler"]
        peak_lr(raw)

    def rope(raw):
        raw["ds_async"]["model"]["config"]["rope_theta"] = 500.0

    (work / "nul.txt").write_bytes(b"\0" * 200_000)
    planted = work / "planted"
    planted.mkdir()
    (work / "victim.txt").write_text("precious")
    os.symlink(work / "victim.txt", planted / ".lock")
    full = work / "full"
    mounted = _mount_tmpfs(full, "256k")
    runs = [
        {"name": "lr-base", "config": _config(work, "lr-base", steps=6, every=2)},  # keeps steps 4 and 6
        {"name": "lr-keep", "config": _config(work, "lr-keep", steps=8),
         "resume": str(checkpoint.step_dir(base, 6))},
        {"name": "lr-restretch", "config": _config(work, "lr-restretch", steps=8,
                                                   train={"steps": 8, "on_resume_length": "restretch"}),
         "resume": str(checkpoint.step_dir(base, 6))},
        {"name": "lr-peak", "config": _config(work, "lr-peak", peak_lr, steps=6),
         "resume": str(checkpoint.step_dir(base, 4))},
        {"name": "rope", "config": _config(work, "rope", rope, steps=8), "resume": str(checkpoint.step_dir(base, 6))},
        {"name": "nosched-base", "config": _config(work, "nosched-base", no_scheduler, steps=4)},
        {"name": "nosched-peak", "config": _config(work, "nosched-peak", peak_lr_alone, steps=6),
         "resume": str(checkpoint.step_dir(nosched, 4))},
        {"name": "nul", "config": _config(work, "nul", steps=2, data=str(work / "nul.txt"))},
        {"name": "lock", "config": _config(work, "lock", steps=2, checkpoint={"dir": str(planted), "keep": 2})},
        *([{"name": "full", "config": _config(work, "full", steps=2, checkpoint={"dir": str(full), "keep": 2})}]
          if mounted else []),
        {"name": "ref-2bw", "config": _config(work, "ref-2bw", schedule="2bw")},  # for the SIGTERM test
    ]
    try:
        results = launch(work, "hardening", runs)
        full_left = sorted(p.name for p in full.iterdir()) if mounted else None
    finally:
        if mounted:
            _umount(full)
    return {"results": results, "log": (work / "hardening.log").read_text(), "mounted": mounted,
            "full_left": full_left}


def _scalars(run_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def cosine_lr(peak: float, total: int, iteration: int) -> float:
    """DeepSpeed's WarmupCosineLR over ``total`` steps at ``iteration``, as write_config's scheduler sets it."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    schedule = WarmupCosineLR(opt, total_num_steps=total, warmup_num_steps=WARMUP)
    schedule.last_batch_iteration = iteration
    return schedule.get_lr()[0]


def _errors(job, name) -> list:
    return [rank["error"] for rank in job["results"][name]]


# ------------------------------------------------------------------------------------------ resume policy
def test_resume_applies_the_new_lr_and_the_run_length_policy(work, job):
    """The LR after ``--resume`` is the policy's: a new peak LR applies from the first resumed step (it ran at the
    checkpoint's LR; without a scheduler, for good), with one warning line; a run extended from 6 to 8 steps keeps
    the 6-step cosine at its final LR (``keep_schedule``, the default) or takes the 8-step one (``restretch``),
    saying so in one line at start."""
    runs = work / "runs"
    base = _scalars(runs / "lr-base", "train/lr")
    # The reference: the logged LR of step s is the schedule's at iteration s - 1 (after the step's update).
    assert base == {s: pytest.approx(cosine_lr(PEAK, 6, s - 1), rel=1e-6) for s in range(1, 7)}
    for name, total in (("lr-keep", 6), ("lr-restretch", 8)):
        assert all(e is None for e in _errors(job, name)), job["results"][name]
        lrs = _scalars(runs / name, "train/lr")
        assert lrs == {s: pytest.approx(cosine_lr(PEAK, total, s - 1), rel=1e-6) for s in (7, 8)}, name
    log = job["log"]
    assert ("ds_async: resuming at step 6 a run now 8 steps long (the checkpoint's: 6); "
            "ds_async.train.on_resume_length = 'keep_schedule': WarmupCosineLR stays the 6-step schedule, holding "
            f"its final LR past step 6; the LR goes from {cosine_lr(PEAK, 6, 5):.4g} (step 6) to "
            f"{cosine_lr(PEAK, 6, 5):.4g}") in log, log[-4000:]
    # What step 7 trains with (the optimizer's LR after the restore), not only what is logged after its update.
    assert ("ds_async.train.on_resume_length = 'restretch': WarmupCosineLR is recomputed for 8 steps, as a run of "
            f"that length has it; the LR goes from {cosine_lr(PEAK, 6, 5):.4g} (step 6) to "
            f"{cosine_lr(PEAK, 8, 5):.4g}") in log, log[-4000:]

    # A doubled peak under the cosine: the step after the checkpoint already runs at the new schedule's LR.
    assert all(e is None for e in _errors(job, "lr-peak")), job["results"]["lr-peak"]
    assert _scalars(runs / "lr-peak", "train/lr") == {s: pytest.approx(cosine_lr(2 * PEAK, 6, s - 1), rel=1e-6)
                                                      for s in (5, 6)}
    assert ("ds_async: warning: changed since the checkpoint and applied from this config from the first resumed "
            f"step: optimizer.params.lr {PEAK!r} -> {2 * PEAK!r} (the LR goes from {cosine_lr(PEAK, 6, 3):.4g} at "
            f"step 4 to {cosine_lr(2 * PEAK, 6, 3):.4g})") in log, log[-4000:]

    assert all(e is None for e in _errors(job, "nosched-peak")), job["results"]["nosched-peak"]
    assert _scalars(runs / "nosched-base", "train/lr") == {s: pytest.approx(PEAK) for s in range(1, 5)}
    assert _scalars(runs / "nosched-peak", "train/lr") == {s: pytest.approx(2 * PEAK) for s in (5, 6)}
    assert ("ds_async: warning: changed since the checkpoint and applied from this config from the first resumed "
            f"step: optimizer.params.lr {PEAK!r} -> {2 * PEAK!r} (the LR goes from {PEAK:.4g} at step 4 to "
            f"{2 * PEAK:.4g})") in log, log[-4000:]
    assert ("a run now 6 steps long (the checkpoint's: 4); ds_async.train.on_resume_length = 'keep_schedule': no LR "
            "schedule depends on the run's length") in log


def test_resume_refuses_a_changed_model_architecture(work, job):
    for error in _errors(job, "rope"):
        assert error is not None and error.startswith("ConfigError: model.rope_parameters.rope_theta: 500.0, but the "
                                                      "checkpoint "), error
        assert "was saved with 10000.0" in error and "a resume cannot change it" in error, error
    assert not ckpt_root(work, "rope").exists() or checkpoint.complete_checkpoints(ckpt_root(work, "rope")) == []


# ---------------------------------------------------------------------------------------- bad input, disk
def test_nul_filled_text_is_refused_at_start(work, job):
    for error in _errors(job, "nul"):
        assert error == (f"DataError: ds_async.data.train: {work / 'nul.txt'} (split='train'): no usable text: all 1 "
                         "documents data-parallel rank 0 read in a whole pass were skipped (1 not-text); the "
                         "documents hold no text (only NUL or other control characters, or values that are not "
                         "strings)"), error


def test_a_symlinked_lock_is_refused_and_its_target_untouched(work, job):
    planted = work / "planted"
    for error in _errors(job, "lock"):
        assert error == (f"CheckpointError: {planted / '.lock'}: a symbolic link (to {work / 'victim.txt'}), not a "
                         "lock file; ds_async does not follow it (the job would write over its target): remove it"), \
            error
    assert (work / "victim.txt").read_text() == "precious"


def test_a_full_disk_is_named_with_the_folder_and_the_need(work, job):
    if not job["mounted"]:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    full = work / "full"
    for error in _errors(job, "full"):
        m = re.fullmatch(rf"CheckpointError: {re.escape(str(full))}: the disk is full \((\d+\.\d) MiB free, the "
                         r"checkpoint needs about (\d+\.\d) MiB\); step_00000002 was not saved and the checkpoints "
                         r"before it are intact: .*", error or "")
        assert m and float(m[1]) < float(m[2]), error
    assert job["full_left"] == [".lock"], job["full_left"]  # nothing half-written left behind


def test_a_save_that_runs_out_of_space_midway_says_the_disk_is_full(tmp_path):
    """The size check passes (the writer claims to need nothing), the write itself fails: the same line, and the
    half-written folder is removed."""
    folder = tmp_path / "small"
    if not _mount_tmpfs(folder, "256k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        def files(tmp):
            torch.save({"w": torch.zeros(200_000)}, tmp / "state.pt")  # 800 kB
            return ["state.pt"]

        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(folder))}: the disk is full \(0\.\d MiB free, "
                                                  r"the checkpoint needs about 0\.0 MiB\); step_00000003 was not "
                                                  "saved"):
            checkpoint.write(folder, 3, files, {"note": "test"})
        assert list(folder.iterdir()) == []
    finally:
        _umount(folder)


# ------------------------------------------------------------------------------------------------ SIGTERM
def _train_py(work: Path, tag: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
           str(ROOT / "launch" / "train.py"), *args]
    log = open(work / f"{tag}.log", "w")
    return subprocess.Popen(cmd, env=job_env(), cwd=work, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_sigterm_saves_exits_resumable_and_resumes_bit_equal(work, job):
    """SIGTERM to every rank once the job is under way (it holds its checkpoint folder), as SLURM sends it to every
    task (torchrun passes a SIGTERM of its own on to the ranks the same way, and then reports its own status
    instead of theirs): every rank finishes an agreed step, the pipeline drains, a checkpoint is saved there, one
    line says so and the ranks exit 75; the resumed run's final checkpoint is bit-equal to an uninterrupted run's."""
    config = write_config(work, "preempted", "2bw")  # as ref-2bw: 10 steps, a final save only
    root = ckpt_root(work, "preempted")
    proc = _train_py(work, "preempted", "--config", str(config))
    try:
        deadline = time.time() + 300
        while not ((root / ".lock").exists() and (root / ".lock").read_text()):
            assert proc.poll() is None, (work / "preempted.log").read_text()[-4000:]
            assert time.time() < deadline, "the job did not start"
            time.sleep(0.05)
        for rank in psutil.Process(proc.pid).children():  # as SLURM signals every task of a job
            os.kill(rank.pid, signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    log = (work / "preempted.log").read_text()
    m = re.search(r"ds_async: preempted at step (\d+): saved (\S+); resume with --resume\n", log)
    assert m, log[-4000:]
    step = int(m[1])
    assert rc != 0 and 1 <= step < 10 and m[2] == str(checkpoint.step_dir(root, step)), (rc, log[-4000:])
    assert log.count("ds_async: preempted at step") == 1
    # torchrun's report of its ranks' exit statuses
    assert re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", log, re.M) == ["75", "75"], log[-4000:]
    assert [s for s, _ in checkpoint.complete_checkpoints(root)] == [step]

    again = _train_py(work, "preempted-resume", "--config", str(config), "--resume")
    assert again.wait(timeout=600) == 0, (work / "preempted-resume.log").read_text()[-4000:]
    assert all(e is None for e in _errors(job, "ref-2bw"))
    assert_bit_equal(final_state(checkpoint.step_dir(root, 10)),
                     final_state(checkpoint.step_dir(ckpt_root(work, "ref-2bw"), 10)), "preempted 2bw")


# ------------------------------------------------------------------------------------------ huge documents
_READ_HUGE = """
import io, json, sys
import torch
from ds_async.checkpoint.state import data_state_to_file
from ds_async.data import PackedBatches, load_text_stream, load_tokenizer


def status(key):  # KiB
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))


path, tokenizer, out = sys.argv[1:]
tok = load_tokenizer(tokenizer)
# The peak from here on: the imports' own transient peak (transformers, and torchao where installed) is not the
# stream's.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
batches = PackedBatches(load_text_stream(path, "train"), tok, 64, 4, shuffle_buffer=0, repeat=False)
got = [next(batches)[0] for _ in range(3)]
state = batches.state_dict()
file = io.BytesIO()
torch.save(data_state_to_file(state), file)
peak = status("VmHWM:")
batches.close()
json.dump({"growth_mib": (peak - before) / 1024, "state_bytes": file.tell(), "buffered": len(state["buffer"]),
           "tokens": torch.cat(got).flatten().tolist()}, open(out, "w"))
"""


def test_a_huge_document_is_tokenized_in_pieces_with_flat_memory(tmp_path):
    """One line of 8 MB and one of 32 MB of real text: reading three micro-batches of either grows the process by
    a few times the text's size, not by what tokenizing it whole takes (gigabytes); the tokens are the whole
    document's, and the stream's state buffers a piece's tokens, not the document's."""
    import pyarrow.parquet as pq

    corpus = ROOT.parent / "shared" / "corpus"
    if not (corpus / "gutenberg-validation.parquet").exists():
        pytest.skip("needs ../shared/corpus")
    tokenizer = str(corpus / "tokenizers" / "bpe8192.json")
    books = pq.read_table(corpus / "gutenberg-validation.parquet", columns=["text"]).column("text").to_pylist()
    text = " ".join(" ".join(books).split())  # one line
    found = {}
    for mb in (8, 32):
        doc = (text * (mb * 2 ** 20 // len(text) + 1))[: mb * 2 ** 20]
        path = tmp_path / f"huge{mb}.txt"
        path.write_text(doc + "\n")
        out = tmp_path / f"huge{mb}.json"
        # Fewer malloc arenas and arrow on the system allocator: less of the run-to-run spread of freed memory kept.
        subprocess.run([sys.executable, "-c", _READ_HUGE, str(path), tokenizer, str(out)], check=True,
                       env={**job_env(), "MALLOC_ARENA_MAX": "2", "ARROW_DEFAULT_MEMORY_POOL": "system"}, timeout=600)
        found[mb] = json.loads(out.read_text())
        assert found[mb]["buffered"] < 2 ** 18, found[mb]["buffered"]  # at most about a piece's tokens
    head = document_encoder(load_tokenizer(tokenizer))([text[:100_000]])[0]
    assert found[8]["tokens"] == found[32]["tokens"] == head[:len(found[8]["tokens"])]
    # Flat: 24 MB more text costs some times that (the line as datasets reads and converts it, the state's copy
    # and its serialised form here: about 11x), not what tokenizing it at once takes (1.1 GiB for the 8 MB line
    # alone). Opening the stream costs about 0.2 GiB of its own (datasets' and arrow's readers).
    assert found[32]["growth_mib"] - found[8]["growth_mib"] < 16 * 24, found
    assert found[32]["growth_mib"] < 1024, found
    # The state holds the document being read (it is what resumes it), not its tokens at 8 bytes each.
    assert found[32]["state_bytes"] < 33 * 2 ** 20 + 2 ** 20, found[32]["state_bytes"]


_SIGTERMS = """
import os, signal, sys, time
from ds_async.preempt import Preemption

p = Preemption(float(sys.argv[1]), None, say=True)
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)  # the same preemption from the scheduler and from the launcher
time.sleep(0.3)
print("requested", p.since is not None, flush=True)
if sys.argv[2] == "again":
    time.sleep(2.5)
    os.kill(os.getpid(), signal.SIGTERM)
time.sleep(20)
"""


@pytest.mark.parametrize("grace, then, why", [
    (60, "again", "a second SIGTERM"),
    (2, "wait", "ds_async.checkpoint.preempt_grace_s = 2 s passed since SIGTERM before the checkpoint was saved"),
])
def test_a_second_sigterm_or_the_grace_period_ends_the_process_at_once(grace, then, why):
    """SIGTERM twice at once is one request; one more later, or the grace period's end, exits 143 with one line."""
    proc = subprocess.run([sys.executable, "-c", _SIGTERMS, str(grace), then], env=job_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 143 and proc.stdout == "requested True\n", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.splitlines()[-1] == f"ds_async: error: {why}: exiting at once without a checkpoint"


def test_a_stream_saved_inside_a_long_document_resumes_exactly(tmp_path):
    """A state taken between two pieces of a long document, through a checkpoint file's form, continues with the
    same micro-batches as the stream that was not interrupted."""
    corpus = ROOT.parent / "shared" / "corpus"
    if not (corpus / "tokenizers" / "bpe8192.json").exists():
        pytest.skip("needs ../shared/corpus")
    tok = load_tokenizer(str(corpus / "tokenizers" / "bpe8192.json"))
    words = [f"word{i % 97} and text {i}" for i in range(PIECE_CHARS // 8)]
    path = tmp_path / "docs.txt"
    path.write_text("a short first document\n" + " ".join(words) + "\nand a short last one\n")

    def stream():
        return PackedBatches(load_text_stream(str(path), "train"), tok, 64, 4, shuffle_buffer=0, repeat=True)

    whole = stream()
    for _ in range(70):  # into the long document (~650k characters): its first piece tokenized, the rest not
        next(whole)
    state = whole.state_dict()
    assert state["long"] and 0 < state["long_at"] < len(state["long"]), "not inside the long document"
    saved = io.BytesIO()
    torch.save(data_state_to_file(state), saved)
    assert saved.tell() < len(state["long"]) + 2 ** 20  # the document's rest and a piece's tokens at most
    want = [next(whole)[0] for _ in range(300)]
    again = stream()
    again.load_state_dict(data_state_from_file(torch.load(io.BytesIO(saved.getvalue()), weights_only=True)))
    assert all(torch.equal(a, b) for a, b in zip((next(again)[0] for _ in range(300)), want))
    whole.close()
    again.close()
