"""What a training run prints on the console, apart from its step lines.

- :func:`deepspeed_quiet`: DeepSpeed's start-up output (its INFO and WARNING log lines, the topology and layer
  listing it prints) held back while the pipeline and engine are built, unless ``ds_async.logging.deepspeed_log``
  asks for it; DeepSpeed's errors and ds_async's own lines still show.
- :func:`summary_block`: the end-of-run summary as a short aligned block (``summary.json`` keeps every figure).
- :func:`error_line`: the one line an expected error prints, on one rank only.
- :func:`exit_now`: a finished job's end, without the interpreter's teardown.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys

import torch

PREFIX = "ds_async"


@contextlib.contextmanager
def deepspeed_quiet(show: bool):
    """Hold back DeepSpeed's log lines below ERROR and whatever is printed inside (``show``: let all through).
    Printed lines of ds_async's own (``ds_async...``) are passed on as they come, in order."""
    if show:
        yield
        return
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    held = _OwnLines(sys.stdout)
    try:
        with contextlib.redirect_stdout(held):
            yield
    finally:
        held.flush_line()
        logger.setLevel(level)


class _OwnLines(io.TextIOBase):
    """A stdout stand-in that passes on complete lines starting with ``ds_async`` and drops the others."""

    def __init__(self, out):
        self.out, self.partial = out, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            if line.startswith(PREFIX):
                self.out.write(line + "\n")
        self.out.flush()
        return len(text)

    def flush_line(self) -> None:
        if self.partial.startswith(PREFIX):
            self.out.write(self.partial + "\n")
        self.partial = ""


def quiet_imports() -> None:
    """Before DeepSpeed and transformers are imported: name DeepSpeed's accelerator where no GPU is visible, so that
    its import does not warn, on every rank, that it fell back to the CPU (a CPU run is what the user asked for);
    and keep torchao's import-time warnings about its optional kernel libraries (MX formats, CUTLASS builds for
    other Pythons, which ds_async does not use; transformers imports torchao whenever it is installed) to errors, with
    torch's deprecation notes on how torchao registers its enums."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    if "DS_ACCELERATOR" in os.environ:
        return
    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def error_line(error: BaseException) -> str | None:
    """The line ``launch/train.py`` prints for an expected error, or None on ranks other than the first: every
    expected error is raised alike on every rank (config checks read the same file; the job's agreements hand one
    rank's failure to all), so one copy says it."""
    return f"{PREFIX}: error: {error}" if int(os.environ.get("RANK", "0")) == 0 else None


def _num(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value != value:
        return "nan"
    return f"{value:,.{digits}g}" if isinstance(value, float) else f"{value:,}"


def summary_block(summary: dict, run_dir) -> str:
    """The end-of-run summary for a person: run length, speed, losses, stages and where things were written."""
    rows = [("run", f"{run_dir} (every figure: summary.json)")]
    rows.append(("steps", f"{summary['steps']:,} ({summary['tokens']:,} tokens) in {summary['seconds']:,.1f} s"
                 + (f", resumed from {summary['resumed_from']}" if summary.get("resumed_from") else "")))
    steady = summary.get("train_tokens_per_s")
    speed = f"{round(summary['tokens_per_s']):,} tokens/s over the run"
    if steady is not None:
        speed = (f"{round(steady):,} tokens/s, {summary['step_time_s'] * 1e3:,.1f} ms a step (after "
                 f"{summary['warmup_steps']} warm-up steps); {speed}")
    rows.append(("speed", speed + (f", MFU {summary['mfu']:.1%}" if summary.get("mfu") is not None else "")))
    rows.append(("loss", f"train {_num(summary['final_train_loss'])} (last step), validation "
                 f"{_num(summary['final_validation_loss'])}"))
    if summary.get("grad_norm") is not None:
        rows.append(("grad norm", _num(summary["grad_norm"])))
    stages = summary.get("stages") or {}
    if stages:
        rows.append(("stages", " | ".join(
            f"{name.replace('stage', 's')} idle {_pct(v.get('idle_fraction'))} (optimizer "
            f"{_pct(v.get('optimizer_fraction'))}), peak {v['peak_memory_gib']:.2f} GiB"
            for name, v in stages.items())))
    if summary.get("start_s"):
        rows.append(("start", start_line(summary["start_s"])))
    skipped = {k: v for k, v in (summary.get("skipped_docs") or {}).items() if v}
    if skipped:
        rows.append(("skipped docs", ", ".join(f"{k} {v:,}" for k, v in skipped.items())))
    if summary.get("skipped_steps"):
        rows.append(("skipped steps", f"{summary['skipped_steps']:,} (non-finite)"))
    if summary.get("stopped"):
        rows.append(("stopped", summary["stopped"]))
    rows.append(("checkpoint", summary.get("checkpoint") or "none saved"))
    width = max(len(k) for k, _ in rows)
    return f"{PREFIX} summary:\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def start_line(spans: dict[str, float]) -> str:
    """A process's start for a person: the total from launch to the end of its first step, then each phase."""
    return (f"started in {sum(spans.values()):.1f} s (" + ", ".join(f"{phase} {s:.1f}" for phase, s in spans.items())
            + ")")


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def exit_now() -> None:
    """End the process once its results are written (summary, logs, checkpoints) and its output flushed, without
    the interpreter's teardown, which held a finished run for seconds: the exit handlers shut Inductor's compile
    worker pool down (waiting for each worker process to end) and wait out the grace period arrow's reader threads
    need after a stream was read (``ds_async.data``); neither has anything left to do once training is over. The
    compile workers end on their own when this process's pipe to them closes, a reader process when it sees its
    parent gone."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
