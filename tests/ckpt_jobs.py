"""Trainer runs for ``tests/test_checkpoint.py``: several ``ds_async.trainer.train`` calls in sequence in the same
processes (one process start for many runs), optionally with a poisoned or stalling loss; :func:`run` in the ranks
of the tests' job server (``tests/jobs.py``'s ``trainer_runs``), or a torchrun job of its own, which a test can
kill:

    python -m torch.distributed.run --nproc_per_node 2 tests/ckpt_jobs.py RUNS.json OUT_DIR

``RUNS.json`` lists runs: ``{"name", "config", "resume": null | "latest" | path, "poison": {"step", "kind"} | null,
"stall_at": step | null, "defer_writes": bool}``. ``poison`` makes the loss of every micro-batch of that step NaN or
inf (on the last stage, which computes it); ``stall_at`` makes the last stage hang in that step's first loss, so
that the job can be killed in the middle of training at a known point; ``defer_writes`` makes a background save
(``checkpoint.async_save``) write its files only when the next save or the run's end waits for it, the latest a
background write can run. Each rank writes ``OUT_DIR/<name>.rank<r>.json``: ``{"summary": ..., "error":
"ExceptionType: message" | null, "deferred_writes": saves ``defer_writes`` held back, "groups_left": process groups
the run left, "threads": the process's threads after it and a collection}``; expected errors (ds_async's) do not end
the job.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from ds_async import trainer
from ds_async.builder import process_groups
from ds_async.checkpoint import CheckpointError, folder
from ds_async.config import ConfigError
from ds_async.data import DataError
from ds_async.models import llama, mixtral
from ds_async.nonfinite import NonFiniteLoss

EXPECTED = (ConfigError, DataError, CheckpointError, NonFiniteLoss, FileNotFoundError)  # launch/train.py's
_ORIGINAL = {llama: llama.loss_fn, mixtral: mixtral.loss_fn}
_WRITER = folder.BackgroundWriter


def _patch_loss(micro_batches: int, poison: dict | None, stall_at: int | None) -> None:
    """Wrap every family's loss: count training forwards on this (last) stage; step = count // m + 1."""
    calls = [0]

    def wrap(make):
        def loss_fn(config, *args):
            inner = make(config, *args)

            def loss(outputs, labels):
                value = inner(outputs, labels)
                step = calls[0] // micro_batches + 1
                calls[0] += 1
                if stall_at is not None and step == stall_at:
                    time.sleep(3600)
                if poison is not None and step == poison["step"]:
                    value = value * float(poison["kind"])  # nan or inf
                return value
            return loss
        return loss_fn

    for module, make in _ORIGINAL.items():
        module.loss_fn = wrap(make)


class _DeferredWriter(folder.BackgroundWriter):
    """A background writer whose write runs when it is waited for (the next save, the run's end), in the waiting
    thread: by then training has moved on, so the files show whether the save wrote its own copy of the state."""

    submitted = 0  # the saves handed to a writer of this kind in this process

    def __init__(self, group):
        super().__init__(group)
        self._deferred = None  # the write held back until the next wait

    def submit(self, write_with) -> None:
        self.wait()
        self._deferred = write_with
        _DeferredWriter.submitted += 1

    def wait(self):
        write_with, self._deferred = self._deferred, None
        return None if write_with is None else write_with(self.group)


def run(runs: list[dict], out: Path) -> None:
    """Each of ``runs`` in turn, each rank writing ``out/<name>.rank<r>.json``; the families' loss functions are put
    back afterwards."""
    try:
        for spec in runs:
            config = json.loads(Path(spec["config"]).read_text())
            _patch_loss(config["gradient_accumulation_steps"], spec.get("poison"), spec.get("stall_at"))
            folder.BackgroundWriter = _DeferredWriter if spec.get("defer_writes") else _WRITER
            result = {"summary": None, "error": None}
            before, deferred_before = process_groups(), _DeferredWriter.submitted
            try:
                result["summary"] = trainer.train(spec["config"], resume=spec.get("resume"))
            except EXPECTED as e:
                result["error"] = f"{type(e).__name__}: {e}"
            # the default group, which a first run in this process may have created, stays for the process
            result["deferred_writes"] = _DeferredWriter.submitted - deferred_before
            result["groups_left"] = len(process_groups() - before - {torch.distributed.group.WORLD})
            gc.collect()  # what the run left that nothing holds
            result["threads"] = len(os.listdir("/proc/self/task"))
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            (out / f"{spec['name']}.rank{rank}.json").write_text(json.dumps(result, default=str))
    finally:
        for module, make in _ORIGINAL.items():
            module.loss_fn = make
        folder.BackgroundWriter = _WRITER


def main(runs_file: str, out_dir: str) -> None:
    out = Path(out_dir)
    # torchrun starts each rank in a session of its own: a test that kills the job kills the ranks by these ids.
    (out / f"pid.rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
    run(json.loads(Path(runs_file).read_text()), out)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
