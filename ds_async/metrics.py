"""What a run leaves behind: tensorboard scalars, a progress bar or console line, a manifest, ``summary.json`` and
a loss plot; and DeepSpeed's monitor blocks fed under every schedule (:class:`DeepSpeedMonitor`).

Only the reporting rank (last stage, first data-parallel replica: it holds the loss) writes anything; rank 0
writes what the reporting rank sends it into DeepSpeed's monitor blocks. How each figure is measured:
:mod:`ds_async.telemetry`.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import platform
import subprocess
import time
from collections import deque
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as tdist

from . import __version__, console, jsonfile

ROOT = Path(__file__).resolve().parents[1]  # the checkout whose code runs


def card_name(device) -> str:
    """What ``device`` (a ``torch.device``) is, for the records: the GPU's name, or the CPU and its thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def code_version() -> dict:
    """The code that ran: the ds_async checkout's git commit, whether its tracked files differ from it
    (``dirty``), how that was known (``source``), and library versions.

    ``source`` "git": asked of ``git`` in the checkout (commit and ``dirty`` None where there is no repository).
    A copy of the tree whose ``.git`` is missing or another commit's (the GPU machine gets the working tree
    without it) names its commit in ``DS_ASYNC_COMMIT``: ``source`` "DS_ASYNC_COMMIT", ``dirty`` None (unknown).
    With ``DS_ASYNC_TREE`` also set, to a file holding that commit's ``git ls-tree -r [-z] COMMIT``, every file it
    lists is hashed as git would hash it and ``dirty`` says whether any differs (``source`` "DS_ASYNC_TREE").
    Untracked files count in none of them, as in ``git status --untracked-files=no``.
    """
    import deepspeed  # slow imports, which only the version strings need
    import transformers

    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            return None

    named, listing = os.environ.get("DS_ASYNC_COMMIT"), os.environ.get("DS_ASYNC_TREE")
    if not named:
        commit, source = git("rev-parse", "HEAD"), "git"
        dirty = None if commit is None else bool(git("status", "--porcelain", "--untracked-files=no"))
    elif listing:
        commit, source = named, "DS_ASYNC_TREE"
        dirty = bool(tree_differences(ROOT, Path(listing).read_bytes()))
    else:
        commit, dirty, source = named, None, "DS_ASYNC_COMMIT"
    return {"ds_async": __version__, "commit": commit, "dirty": dirty, "source": source,
            # torch's version is a str subclass (TorchVersion): recorded as the plain string it prints as
            "torch": str(torch.__version__), "deepspeed": str(deepspeed.__version__),
            "transformers": str(transformers.__version__), "python": platform.python_version()}


def tree_differences(root: Path, listing: bytes) -> list[str]:
    """The paths of ``listing`` (``git ls-tree -r`` output, newline- or, with ``-z``, NUL-separated) whose file
    below ``root`` is missing or does not hash to its blob id (a symlink: its target, as git stores it). Submodule
    entries are not files here and are passed over. Anything else (``git ls-files -s``, whose third field is a
    stage, or a listing without a single file) raises ``ValueError``: passing over it would call the copy clean."""
    differ, blobs = [], 0
    for entry in filter(None, listing.split(b"\0" if b"\0" in listing else b"\n")):
        meta, _, raw = entry.partition(b"\t")
        fields = meta.decode(errors="replace").split()
        if len(fields) != 3 or fields[1] not in ("blob", "commit") or not raw:
            raise ValueError(f"DS_ASYNC_TREE: {entry[:200]!r} is not a line of git ls-tree -r")
        mode, kind, blob = fields
        if kind != "blob":
            continue
        blobs += 1
        path = _unquote(raw.decode())
        file = root / path
        try:
            data = os.fsencode(os.readlink(file)) if mode == "120000" else file.read_bytes()
        except OSError:
            differ.append(path)
            continue
        digest = hashlib.sha256 if len(blob) == 64 else hashlib.sha1  # a SHA-256 repository's ids are longer
        if digest(b"blob %d\0" % len(data) + data).hexdigest() != blob:
            differ.append(path)
    if not blobs:
        raise ValueError("DS_ASYNC_TREE: the listing names no file (expected git ls-tree -r COMMIT)")
    return differ


def _unquote(path: str) -> str:
    """A path as ``git ls-tree`` prints it without ``-z``: in double quotes with C escapes (octal bytes of UTF-8)
    where it holds unusual characters, else as is."""
    if not (path.startswith('"') and path.endswith('"')):
        return path
    return path[1:-1].encode("latin-1").decode("unicode_escape").encode("latin-1").decode("utf-8")


class HostValue:
    """A device scalar on its way to the host without stopping the host.

    ``float(t)`` on a GPU tensor waits for everything queued on the stream before it. Here the copy into pinned
    memory is queued behind the work that makes the value (on ``stream``, default the current one: it must be the
    stream that made it), and ``float(HostValue)`` waits for that copy alone: read a step later, it has long landed,
    and the host never loses its lead over the GPU (which a flush-free pipeline turns straight into idle time). On
    CPU it is the value itself.
    """

    def __init__(self, t, stream=None):
        t = t.detach()
        self._event = None
        if t.device.type == "cuda":
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
            t = host
        self._value = t

    def ready(self) -> bool:
        """Whether the value has reached the host (``float`` would not wait)."""
        return self._event is None or self._event.query()

    def __float__(self) -> float:
        if self._event is not None:
            self._event.synchronize()
        return float(self._value)


HOST_CLOCK = object()
"""``RunLogger.train_step``'s default ``step_time``: the logger times steps itself, on the host, between calls."""


def _fmt(value, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


class RunLogger:
    """Scalars to tensorboard (and DeepSpeed's monitor blocks), a progress bar or console line, a manifest, a
    summary line, ``summary.json`` and ``loss.png``.

    Per train step: loss, lr, tokens, gradient norm, step time, tokens/s and MFU; step time, tokens/s and MFU are
    running averages over the last ``window`` steps, never counting the first ``warmup`` steps of this process
    (compilation, allocator growth), so a single fast or slow step does not make a spike. Per validation: the loss
    (``history["validation"]``: ``(step, loss)``) and the run's training clock then (``history["validation_seconds"]``:
    ``(step, seconds)``), for loss against wall-clock and time to a target loss: :meth:`elapsed`, seconds since this
    logger was made (set-up before it, such as tokenizer training and model building, is not counted) plus those of
    the processes a resumed run continues. Per gather (the trainer's
    ``stages``): peak memory and idle fraction per pipeline stage; per optimizer-figures step: update RMS, delay
    correction buffer norm, staleness.
    """

    def __init__(self, run_dir: Path, total_steps: int, tokens_per_step: int, enabled: bool, progress: bool = True,
                 every: int = 1, start_step: int = 0, window: int = 20, warmup: int = 2,
                 flops_per_step: float | None = None, peak_flops: float | None = None, monitor=None,
                 seconds_before: float = 0.0):
        """``start_step``: steps done before this process started (a resumed run); rates count only the rest.
        ``seconds_before``: :meth:`elapsed` as the run's previous process saved it with its state (a resumed run), so
        that a run's clock is the sum of its processes' training time.
        ``flops_per_step``: model FLOPs of one step over all replicas; ``peak_flops``: the peak FLOP/s of all the
        job's devices together; MFU needs both. ``monitor``: also gets every scalar (:class:`DeepSpeedMonitor`)."""
        self.run_dir, self.enabled, self.every, self.start_step = Path(run_dir), enabled, every, start_step
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.window, self.warmup = window, warmup
        self.flops_per_step, self.peak_flops = flops_per_step, peak_flops
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self.history = {"train": [], "train_seconds": [], "validation": [], "validation_seconds": [], "grad_norm": [],
                        "step_time_s": [], "tokens_per_s": []}
        self.seconds_before = seconds_before
        self.last: dict = {}
        self.last_optimizer: dict | None = None
        self.last_stages: dict | None = None
        self.start_s: dict[str, float] | None = None
        self.writer = self.bar = None
        self._t0 = self._t_last = time.perf_counter()
        self._host_spans: deque = deque(maxlen=window)
        self._host_sum, self._host_steps = 0.0, 0
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.run_dir))
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def manifest(self, **sections) -> None:
        """Write ``manifest.json`` (code version, resolved config, ...) once at start."""
        if not self.enabled:
            return
        doc = {"code": code_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **sections}
        text = jsonfile.dumps(doc, indent=2)
        (self.run_dir / "manifest.json").write_text(text)
        self.writer.add_text("manifest", "```\n" + text + "\n```")

    def _scalar(self, tag: str, value, step: int) -> None:
        if value is None:
            return
        self.writer.add_scalar(tag, value, step)
        if self.monitor is not None:
            self.monitor.write(tag, value, step)

    def _say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def rates(self, step_time: float | None) -> dict:
        """Step time (s), tokens/s and MFU for a mean step time (``None``: not measured yet)."""
        if not step_time:
            return {"step_time_s": None, "tokens_per_s": None, "mfu": None}
        mfu = None
        if self.flops_per_step and self.peak_flops:
            mfu = self.flops_per_step / step_time / self.peak_flops
        return {"step_time_s": step_time, "tokens_per_s": self.tokens_per_step / step_time, "mfu": mfu}

    def train_step(self, step: int, loss: float, lr: float, grad_norm: float | None = None,
                   step_time=HOST_CLOCK) -> None:
        """Step ``step``'s figures. ``step_time``: the mean step time over the window ending at ``step``, as the
        caller measured it (``None``: none yet); by default the logger times its own calls on the host."""
        now = time.perf_counter()
        if step_time is HOST_CLOCK:
            if step > self.start_step + self.warmup:
                self._host_spans.append(now - self._t_last)
                self._host_sum += now - self._t_last
                self._host_steps += 1
            step_time = sum(self._host_spans) / len(self._host_spans) if self._host_spans else None
        self._t_last = now
        if not self.enabled:
            return
        rates = self.rates(step_time)
        self.last = {"loss": loss, "lr": lr, "grad_norm": grad_norm, **rates}
        self.history["train"].append((step, loss))
        # The training clock when the step's loss reached the host (under a flush-free schedule up to a step after
        # the step ended): loss against wall-clock.
        self.history["train_seconds"].append((step, round(self.elapsed(), 3)))
        for key in ("grad_norm", "step_time_s", "tokens_per_s"):
            if self.last[key] is not None:
                self.history[key].append((step, self.last[key]))
        if step % self.every == 0:
            for tag, value in (("train/loss", loss), ("train/lr", lr), ("train/tokens", step * self.tokens_per_step),
                               ("train/grad_norm", grad_norm), ("train/step_time_s", rates["step_time_s"]),
                               ("train/tokens_per_s", rates["tokens_per_s"]), ("train/mfu", rates["mfu"])):
                self._scalar(tag, value, step)
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{loss:.4f}", "gnorm": _fmt(grad_norm, ".3g"),
                    "tok_s": _fmt(rates["tokens_per_s"], ",.0f")}
            if rates["mfu"] is not None:
                post["mfu"] = f"{rates['mfu']:.1%}"
            self.bar.set_postfix(post)
        elif step % self.every == 0:
            mfu = "" if rates["mfu"] is None else f" mfu {rates['mfu']:.1%}"
            step_ms = None if rates["step_time_s"] is None else rates["step_time_s"] * 1000
            print(f"step {step}/{self.total_steps}: loss {loss:.4f} lr {lr:.3g} grad_norm {_fmt(grad_norm, '.4g')} "
                  f"step {_fmt(step_ms, '.1f')} ms tokens/s {_fmt(rates['tokens_per_s'], ',.0f')}{mfu}", flush=True)

    def elapsed(self) -> float:
        """The run's training clock: seconds since this logger was made, plus ``seconds_before``."""
        return self.seconds_before + time.perf_counter() - self._t0

    def validation(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        self.history["validation"].append((step, loss))
        # A key of its own: readers of ``validation`` keep their (step, loss) pairs.
        self.history["validation_seconds"].append((step, round(self.elapsed(), 3)))
        self._scalar("validation/loss", loss, step)
        self._say(f"step {step}: validation loss {loss:.4f}")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.enabled:
            for tag, value in values.items():
                self._scalar(tag, value, step)

    def optimizer(self, step: int, stats: dict[str, float]) -> None:
        """The optimizer figures (:func:`ds_async.optim.stats.optimizer_stats`): ``optimizer/...`` scalars, a
        console line (all but the learning rates) and the summary's ``optimizer`` (the last ones)."""
        if not self.enabled:
            return
        self.scalars(step, {f"optimizer/{k}": v for k, v in stats.items()})
        self.last_optimizer = {"step": step, **stats}
        shown = " ".join(f"{k}={v:.4g}" for k, v in stats.items() if not k.startswith("lr/"))
        if shown:
            self._say(f"step {step}: optimizer {shown}")

    def stages(self, step: int, per_stage: dict[int, dict]) -> None:
        """Peak memory, idle and optimizer fractions per pipeline stage (``stage<s>/...`` scalars, a console line)."""
        if not self.enabled:
            return
        for s, figures in sorted(per_stage.items()):
            for key in ("peak_memory_gib", "idle_fraction", "optimizer_fraction"):
                self._scalar(f"stage{s}/{key}", figures.get(key), step)
        self.last_stages = {f"stage{s}": figures for s, figures in sorted(per_stage.items())}
        self._say(f"step {step}: stages " + " | ".join(
            f"s{s} idle {_fmt(f.get('idle_fraction'), '.1%')} (optimizer {_fmt(f.get('optimizer_fraction'), '.1%')}) "
            f"peak mem {_fmt(f.get('peak_memory_gib'), '.2f')} GiB"
            for s, f in sorted(per_stage.items())))

    def start(self, step: int, spans: dict[str, float]) -> None:
        """Where this process's start went, up to the end of ``step`` (its first): a console line and the summary's
        ``start_s`` (:class:`ds_async.telemetry.StartClock`'s spans)."""
        self.start_s = spans
        if self.enabled:
            self._say(f"step {step}: {console.start_line(spans)}")

    def suspend(self) -> None:
        """Close the tensorboard writer and the progress bar without a summary: the run stops here, to be resumed
        by another process."""
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()

    def close(self, steps: int, plot: bool = True, extra: dict | None = None, step_time=HOST_CLOCK) -> dict:
        """Print the summary line, write ``summary.json`` and ``loss.png``; returns the summary (``extra`` added).
        ``step_time``: the mean step time over the run after the warm-up, as the caller measured it (default: this
        logger's own host timing)."""
        elapsed = time.perf_counter() - self._t0
        run = steps - self.start_step
        if step_time is HOST_CLOCK:
            step_time = self._host_sum / self._host_steps if self._host_steps else None
        rates = self.rates(step_time)
        # "seconds" is the run's training clock, as history["validation_seconds"] reads it (a resumed run's includes
        # its earlier processes; milliseconds, so that the last evaluation's clock is never past the end's).
        summary = {"steps": steps, "tokens": steps * self.tokens_per_step, "seconds": round(self.elapsed(), 3),
                   "tokens_per_s": round(run * self.tokens_per_step / max(elapsed, 1e-9), 1),
                   "step_time_s": rates["step_time_s"], "train_tokens_per_s": rates["tokens_per_s"],
                   "mfu": rates["mfu"], "warmup_steps": self.warmup,
                   "final_train_loss": self.history["train"][-1][1] if self.history["train"] else None,
                   "final_validation_loss": self.history["validation"][-1][1] if self.history["validation"] else None,
                   "grad_norm": self.last.get("grad_norm"), "optimizer": self.last_optimizer,
                   "stages": self.last_stages, "start_s": self.start_s, **(extra or {})}
        if not self.enabled:
            return summary
        if self.bar is not None:
            self.bar.close()
        self.writer.flush()
        self.writer.close()
        (self.run_dir / "summary.json").write_text(json.dumps({**summary, "history": self.history}, indent=2))
        if plot:
            self._plot()
        print(console.summary_block(summary, self.run_dir), flush=True)
        return summary

    def _plot(self) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name in ("train", "validation"):
            points = self.history[name]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=name, marker="o" if name == "validation" else None)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(self.run_dir.name)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.run_dir / "loss.png", dpi=100)
        plt.close(fig)


class DeepSpeedMonitor:
    """The DeepSpeed JSON's monitor blocks (``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``) fed with
    ds_async's scalars, under every schedule.

    DeepSpeed opens those sinks on global rank 0 alone (``MonitorMaster``), a first-stage rank, which under a
    flush-free schedule never sees a loss; ds_async's scalars are made on the reporting rank (last stage). So the
    reporting rank ships them to rank 0, which writes them with DeepSpeed's ``engine.monitor.write_events``: the
    tags of ds_async's own tensorboard (``train/loss``, ``train/grad_norm``, ``validation/loss``, ``stage0/...``),
    x = the optimizer step. DeepSpeed's own events (``Train/Samples/...``, x = samples; under 2BW only the LR) are
    switched off, so each sink gets one x axis (wandb drops steps that go back) and the same scalars under every
    schedule.

    Transport: one message per :meth:`flush` (each train step, and :meth:`close`) over a gloo group of the two
    ranks. The reporting rank sends without waiting; rank 0 receives each message one flush later, so it waits at
    most for the reporting rank's previous step (which the loss's NaN check already makes it do). Other ranks do
    nothing; without monitor blocks nothing is created or sent.
    """

    def __init__(self, engine, reporting_rank: int):
        self.monitor = engine.monitor
        self.enabled = bool(getattr(self.monitor, "enabled", False))
        self.rank, self.reporting_rank = tdist.get_rank(), reporting_rank
        self.group = None
        self.outbox: list[tuple[str, float, int]] = []
        self.sends: deque = deque()
        self.owed = 0  # messages rank 0 has yet to receive
        if not self.enabled:
            return
        self.monitor.enabled = False  # DeepSpeed's own events off; its write_events still writes ds_async's
        if reporting_rank != 0:
            self.group = tdist.new_group([0, reporting_rank], backend="gloo")  # every rank creates it

    def write(self, tag: str, value, step: int) -> None:
        if self.enabled and self.rank == self.reporting_rank:
            self.outbox.append((tag, float(value), int(step)))

    def flush(self) -> None:
        """Every rank, at the same points of the run (see the class doc)."""
        if not self.enabled:
            return
        if self.group is None:  # rank 0 reports
            if self.outbox:
                self.monitor.write_events(self.outbox)
            self.outbox = []
        elif self.rank == self.reporting_rank:
            payload = torch.frombuffer(bytearray(pickle.dumps(self.outbox)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
            self.sends.append((tdist.isend(size, 0, group=self.group), tdist.isend(payload, 0, group=self.group),
                               size, payload))
            self.outbox = []
            while self.sends and self.sends[0][0].is_completed() and self.sends[0][1].is_completed():
                self.sends.popleft()
        elif self.rank == 0:
            self.owed += 1
            while self.owed > 1:
                self._receive()

    def _receive(self) -> None:
        size = torch.zeros(1, dtype=torch.int64)
        tdist.recv(size, self.reporting_rank, group=self.group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        tdist.recv(payload, self.reporting_rank, group=self.group)
        self.owed -= 1
        events = pickle.loads(payload.numpy().tobytes())
        if events:
            self.monitor.write_events(events)

    def close(self) -> None:
        """The last flush; rank 0 writes everything still owed, the reporting rank waits for its sends."""
        if not self.enabled:
            return
        self.flush()
        if self.group is not None and self.rank == 0:
            while self.owed:
                self._receive()
        for size_work, payload_work, *_ in self.sends:
            size_work.wait()
            payload_work.wait()
        self.sends.clear()
