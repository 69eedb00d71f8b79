"""SIGTERM as preemption: every rank agrees on the step after which the job drains, saves and exits resumable.

SLURM and Kubernetes send SIGTERM some seconds before they kill a job; torchrun and the deepspeed launcher pass it
on to every rank. :class:`Preemption` turns the first SIGTERM of a rank into a request. The ranks share their
requests at the start of each step with one scalar all-reduce (MAX) over the trainer's gloo group, started
asynchronously and read at the start of the next step, so that no rank waits for another between steps (the
flush-free schedules' hosts run ahead of each other) and every rank reads the same answer at the same step: that
step is the last, the pipeline drains after it, the trainer saves a checkpoint and raises :class:`Preempted`,
which ``launch/train.py`` turns into one line and exit status :data:`PREEMPTED_EXIT`.

Bounds: the whole drain and save must finish within ``ds_async.checkpoint.preempt_grace_s`` of the signal, or the
process exits at once with :data:`KILLED_EXIT` (a timer thread: the main thread may be blocked in a collective).
A second SIGTERM does the same, unless it comes within :data:`DUPLICATE_S` of the first: a scheduler that signals
every process of a job and a launcher that passes the signal on deliver it twice to each rank.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as tdist

PREEMPTED_EXIT = 75
"""Exit status of a rank that saved a checkpoint on SIGTERM: EX_TEMPFAIL of sysexits.h, "try again later"."""
KILLED_EXIT = 128 + signal.SIGTERM
"""Exit status of a rank ended by a second SIGTERM or the grace period's end, without a checkpoint."""
DUPLICATE_S = 2.0
"""A SIGTERM this soon after the first is the same preemption delivered twice (scheduler and launcher)."""
TIGHT = 0.8
"""A save that takes this share of the grace period or more is warned about once (:meth:`Preemption.timed_save`)."""


class Preempted(Exception):
    """The job saved checkpoint ``folder`` after ``step`` on SIGTERM and stopped; ``--resume`` continues it."""

    def __init__(self, step: int, folder):
        super().__init__(f"preempted at step {step}: saved {folder}; resume with --resume")
        self.step, self.folder = step, folder


class Preemption:
    """This rank's SIGTERM handler (installed by the constructor; :meth:`close` puts the previous one back) and the
    ranks' agreement on it over ``group``. ``say``: whether this rank prints the lines (one rank does)."""

    def __init__(self, grace_s: float, group, say: bool):
        self.grace_s, self.group, self.say = grace_s, group, say
        self._warned = False  # timed_save has said that a save takes most of the grace period
        self.since: float | None = None  # time.monotonic() of this rank's first SIGTERM
        self._timer: threading.Timer | None = None
        self._flag: torch.Tensor | None = None
        self._work = None
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
            self._timer = threading.Timer(self.grace_s, self._exit,
                                          (f"ds_async.checkpoint.preempt_grace_s = {self.grace_s:g} s passed since "
                                           "SIGTERM before the checkpoint was saved",))
            self._timer.daemon = True
            self._timer.start()
            if self.say:
                # os.write, not print: a handler that prints while the main thread is printing raises.
                os.write(2, f"ds_async: SIGTERM: finishing the step, saving a checkpoint and exiting (within "
                            f"ds_async.checkpoint.preempt_grace_s = {self.grace_s:g} s)\n".encode())
        elif now - self.since > DUPLICATE_S:
            self._exit("a second SIGTERM")

    def _exit(self, why: str) -> None:
        if self.say:
            os.write(2, f"ds_async: error: {why}: exiting at once without a checkpoint\n".encode())
        os._exit(KILLED_EXIT)

    def last_step(self) -> bool:
        """Collective, at the start of every step: whether this step is the last (some rank had its SIGTERM when
        the previous step started). Every rank gets the same answer at the same step."""
        stop = False
        if self._work is not None:
            self._work.wait()
            stop = bool(self._flag[0])
        self._flag = torch.tensor([float(self.since is not None)])
        self._work = None
        if tdist.is_initialized() and tdist.get_world_size(self.group) > 1:
            self._work = tdist.all_reduce(self._flag, op=tdist.ReduceOp.MAX, group=self.group, async_op=True)
        return stop

    def timed_save(self, step: int, seconds: float) -> None:
        """A save took ``seconds``: the first one to take more than :data:`TIGHT` of the grace period is said (a
        preempted job drains and saves within it, and a save takes about as long then)."""
        if seconds < TIGHT * self.grace_s or self._warned:
            return
        self._warned = True
        if self.say:
            print(f"ds_async: warning: saving step {step} took {seconds:.3g} s, "
                  f"{'more than' if seconds > self.grace_s else 'close to'} ds_async.checkpoint.preempt_grace_s = "
                  f"{self.grace_s:g} s, within which a SIGTERM'd job must drain and save: raise it (and the time "
                  "the scheduler waits before SIGKILL), or the job may end without a checkpoint", flush=True)

    def saved(self) -> None:
        """The preempted job's checkpoint is saved and it is exiting: the grace period is over, and a later SIGTERM
        (a launcher ending its ranks once the first has exited) is ignored, so that each rank exits as preempted."""
        if self._timer is not None:
            self._timer.cancel()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._previous = signal.SIG_IGN

    def close(self) -> None:
        """The job is over, however it ended: stop the grace timer and put the previous SIGTERM handler back. The
        last agreement is not waited for: a job that ends normally has run collectives on the group after it (so it
        is done), and one that fails on some ranks must not wait for ranks that never reach it."""
        if self._timer is not None:
            self._timer.cancel()
        self._work = None
        signal.signal(signal.SIGTERM, self._previous)
