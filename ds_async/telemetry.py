"""What the trainer measures beyond the loss: step time, time in forward/backward passes, peak memory, the gradient
norm and the peak FLOP rate MFU is quoted against. CPU-safe; on ordinary steps nothing here makes a host wait for
its GPU (the pipeline relies on the host running ahead).

- **Step time** (:class:`StageClock`): per train step, the span between two marks on the current stream, one
  before ``engine.train_step`` and one after it (on GPUs CUDA events: the span is the GPU's time for the call's
  work, since the engine's compute stream waits for the caller's stream on entry and the caller's stream for it on
  exit; on CPU ``time.perf_counter``). Evaluations, saves and logging between steps fall outside every span.
  Spans are read only once their end event has completed (``query()``, never a wait) or after a value that was
  queued behind it reached the host (the loss).
- **Idle fraction** of a stage: ``1 - (time inside forward and backward passes) / (sum of step spans)`` over a
  window of steps, the benchmark's definition (``launch/bench/bench_pipeline.py``): p2p waits, the batch reduce,
  the optimizer step on the compute stream and pipeline bubbles all count as idle. The passes are timed
  through the engine's ``set_pass_timer`` hook (:func:`time_passes`).
- **Optimizer fraction** of a stage: the optimizer step's time (the engine's ``_take_model_step``: clipping and the
  update, on the stream it runs on) over the same sum of step spans, through the same hook. It tells how much of
  the idle time the GPU spent on the update rather than waiting: under ``1f1b`` the step runs between the passes
  on the compute stream, so ``idle - optimizer`` is the time the stage waited (for the host, p2p or the bubble);
  under flush-free rules it runs on a side stream, overlapping the next batch's passes.
- The first ``warmup`` steps of a process (compilation, allocator growth) are left out of both.
- **Start** (:class:`StartClock`): where a process's start went, from its launch to the end of its first step,
  in wall-clock seconds on the host: imports, then the spans between the trainer's marks.
- **Gradient norm** (:class:`GradNormTap`): the pipeline's global norm that the engine clips by, on every rank
  (the stages all-gather their squared norms ahead of the step).

Cost per step, on every rank: two CUDA events around ``train_step`` and two around each forward and backward pass,
and event queries; on the reporting rank a pinned-memory copy of the norm, read once it has landed (at the latest
one step later). No host waits for its GPU. Collectives: the per-stage figures are an object all-gather over all
ranks, on ``logging.stages_every`` steps, at evaluations and at the end only (the trainer gathers them).
"""
from __future__ import annotations

import contextlib
import os
import resource
import time
from collections import deque

import torch

from .metrics import HostValue

# Dense bf16 peak of one card, TFLOP/s, matched in order against the device name (first match wins).
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
                    ("A100", 312.0))


def peak_flops(configured_tflops: float | None, device: torch.device) -> float | None:
    """One device's peak FLOP/s: ``configured_tflops`` if set, else the dense bf16 peak of a known GPU by name
    (:data:`PEAK_BF16_TFLOPS`); ``None`` on CPU and unknown cards (no MFU then)."""
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this rank so far, GiB: torch's peak allocated GPU memory on a GPU, the process's peak resident
    set size on CPU (``ru_maxrss``, KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def process_age() -> float:
    """Seconds since this process started (Linux: ``/proc/self/stat``'s start time, in clock ticks after boot,
    against the boot clock; to the clock tick, where a wall-clock start time is only as exact as the boot time's
    whole second)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after "pid (name)", whose name may hold spaces
    return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")


class StartClock:
    """Where this process's start went: ``imports`` from its launch to this clock's creation (the interpreter,
    torch, DeepSpeed, transformers and ds_async), then, for each :meth:`mark`, the seconds since the one before.
    Wall-clock seconds on the host; a mark taken right after queuing GPU work leaves that work's tail out."""

    def __init__(self):
        now = time.monotonic()
        self._launched = now - process_age()
        self._marks = [("imports", now)]

    def mark(self, phase: str) -> None:
        self._marks.append((phase, time.monotonic()))

    def spans(self) -> dict[str, float]:
        """Each phase's seconds, in order; they add up to the time from launch to the last mark."""
        out, before = {}, self._launched
        for phase, at in self._marks:
            out[phase] = round(at - before, 2)
            before = at
        return out


class StageClock:
    """Step spans and time in passes of one rank, folded in order as their events complete (see the module doc).

    ``begin(step)`` / ``end(step)`` bracket ``engine.train_batch``; ``pass_begin`` / ``pass_end`` bracket each
    forward and backward pass and ``optimizer_begin`` / ``optimizer_end`` each optimizer step (:func:`time_passes`);
    both count only inside a step. ``window_mean(step)`` is the mean
    span of the last ``window`` steps up to ``step`` after the warm-up; :meth:`take_window` the busy and wall time
    since its previous call; :attr:`total_busy`, :attr:`total_wall`, :attr:`total_optimizer`, :attr:`total_steps`
    those of the whole run.
    """

    def __init__(self, cuda: bool, warmup: int, window: int, start_step: int = 0):
        self.cuda, self.window = cuda, window
        self.first_counted = start_step + warmup + 1  # steps before this one are warm-up
        self._open: tuple[int, object, list, list] | None = None  # (step, start, pass pairs, optimizer pairs)
        self._pending: deque = deque()  # (step, start, end, pass pairs, optimizer pairs), not yet folded
        self.spans: deque = deque(maxlen=window + 4)  # (step, seconds), counted steps only
        self.busy = self.wall = self.optimizer = 0.0
        self.steps = 0
        self.total_busy = self.total_wall = self.total_optimizer = 0.0
        self.total_steps = 0

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1000 if self.cuda else b - a

    def begin(self, step: int) -> None:
        self._open = (step, self._mark(), [], [])

    def end(self, step: int) -> None:
        opened, start, pairs, optimizer_pairs = self._open
        self._open = None
        self._pending.append((opened, start, self._mark(), pairs, optimizer_pairs))
        self.fold()

    def pass_begin(self):
        return None if self._open is None else self._mark()

    def pass_end(self, start) -> None:
        if start is not None and self._open is not None:
            self._open[2].append((start, self._mark()))

    optimizer_begin = pass_begin

    def optimizer_end(self, start) -> None:
        if start is not None and self._open is not None:
            self._open[3].append((start, self._mark()))

    def fold(self, wait: bool = False) -> None:
        """Add the steps whose end mark has completed (``wait``: all of them, waiting for the GPU)."""
        while self._pending:
            step, start, end, pairs, optimizer_pairs = self._pending[0]
            if self.cuda:
                # a flush-free step's update runs on a side stream that the step's end mark does not wait for
                ends = [end] + [b for _, b in optimizer_pairs]
                if wait:
                    for e in ends:
                        e.synchronize()
                elif not all(e.query() for e in ends):
                    return
            self._pending.popleft()
            if step < self.first_counted:
                continue
            span = self._seconds(start, end)
            busy = sum(self._seconds(a, b) for a, b in pairs)
            optimizer = sum(self._seconds(a, b) for a, b in optimizer_pairs)
            self.spans.append((step, span))
            self.busy += busy
            self.wall += span
            self.optimizer += optimizer
            self.steps += 1
            self.total_busy += busy
            self.total_wall += span
            self.total_optimizer += optimizer
            self.total_steps += 1

    def window_mean(self, step: int) -> float | None:
        """Mean span of the last ``window`` counted steps up to ``step``; ``None`` before any."""
        self.fold()
        spans = [s for k, s in self.spans if k <= step][-self.window:]
        return sum(spans) / len(spans) if spans else None

    def take_window(self) -> dict:
        """Busy, wall and optimizer seconds and steps folded since the last call (then reset)."""
        self.fold()
        out = {"busy_s": self.busy, "wall_s": self.wall, "optimizer_s": self.optimizer, "steps": self.steps}
        self.busy = self.wall = self.optimizer = 0.0
        self.steps = 0
        return out

    def take_run(self) -> dict:
        """Busy, wall and optimizer seconds and steps of the whole run after the warm-up."""
        return {"busy_s": self.total_busy, "wall_s": self.total_wall, "optimizer_s": self.total_optimizer,
                "steps": self.total_steps}


def idle_fraction(busy: float, wall: float) -> float | None:
    return None if wall <= 0 else min(max(1.0 - busy / wall, 0.0), 1.0)


def optimizer_fraction(optimizer: float, wall: float) -> float | None:
    return None if wall <= 0 else min(max(optimizer / wall, 0.0), 1.0)


def time_passes(engine, clock: StageClock) -> None:
    """Time every forward and backward pass and every optimizer step of ``engine`` on ``clock`` (the engine's
    ``set_pass_timer`` hook)."""
    engine.set_pass_timer(clock)


class GradNormTap:
    """The pipeline's gradient norm of each step, as the engine clips by it, on its way to the host.

    ds_async's engine reports the pipeline's squared norm it computed in the step (``StepReport.grad_norm_sq``),
    under every schedule and for every optimizer whose norm it computes; after each ``train_step`` the tap starts a
    non-blocking copy of it on the stream that computes it (the side stream under 2BW). Where DeepSpeed's optimizer
    computes the norm itself (ZeRO, fp16) the engine's ``get_global_grad_norm()`` is taken instead. ``None`` with
    clipping off: no norm is computed then.
    """

    def __init__(self, engine):
        self.engine = engine

    def take(self, report):
        """The norm of the step that returned ``report`` (a :class:`~ds_async.pipe.engine.StepReport`): a
        :class:`HostValue`, a float or ``None``."""
        side = self.engine.streams.side
        if report.grad_norm_sq is not None:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                norm = report.grad_norm_sq.sqrt()  # on the stream that computes it
            return HostValue(norm, stream=side)
        norm = self.engine.get_global_grad_norm()
        if torch.is_tensor(norm):
            return HostValue(norm, stream=side)
        return None if norm is None else float(norm)
