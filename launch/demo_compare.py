"""The demos' side by side: two run folders of ``launch/train.py``, the synchronous run and the 2BW one.

    python launch/demo_compare.py runs/demo-1f1b runs/demo-2bw [--out runs/demo-compare.png]

Prints :mod:`ds_async.report`'s table (final losses, speed, the bubble each schedule leaves on DeepSpeed's step grid
next to each stage's measured idle time), how much faster 2BW's steps were and how much sooner it reached the
synchronous run's final validation loss, and what the machine it ran on can show of that; draws loss against step,
tokens and training seconds into one PNG.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ds_async import report

CPU_NOTE = """\
What a CPU run shows, and what it does not:
  - the loss: the same math as on GPUs, so 2BW's one-step delay costs what it costs there (against steps and tokens
    2BW + EF trails synchronous 1F1B a little; the study measures how much at real length);
  - not the speed: the stages are processes sharing this machine's cores, and each waits on its own Python and on the
    other stage's far more than on the pipeline bubble that 2BW removes ({bubble:.0%} of 1F1B's step here). The
    measured idle counts all of that waiting; the bubble column counts only the schedule's empty slots.
On GPUs, where a stage's work outweighs its host's, 2BW's steps approach 1 / (1 - bubble) of 1F1B's:
  {gpu}
  Run `bash launch/demo_gpu.sh` on a machine with 2 or more GPUs to see it there."""


def expected_on_gpus() -> str:
    """The step speed-up the schedules' bubbles allow at a few shapes, and the project's measured one."""
    shapes = [(2, 4), (4, 4), (4, 8), (8, 16)]
    allowed = ", ".join(f"p = {p}, m = {m}: {(m + p - 1) / m:.2f}x" for p, m in shapes)
    return (f"{allowed}\n  (measured: a 0.9B LLaMA on 4 H200s at p = m = 4 stepped 1.8x faster under 2BW than "
            "under\n  DeepSpeed's 1F1B; launch/bench/RESULTS.md)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (with manifest.json and summary.json)")
    parser.add_argument("--out", type=Path, default=None, help="the comparison plot (default: beside the runs)")
    args = parser.parse_args(argv)
    runs = [report.read_run(folder) for folder in args.runs]
    print(report.table(runs))
    for sync, run in report.pairs(runs):
        print("\n".join(report.comparison_lines(report.compare(sync, run))))
    sync = next((run for run in runs if not run["flush_free"]), None)
    if sync is not None and all(str(run["card"]).lower().startswith("cpu") for run in runs):
        print(CPU_NOTE.format(bubble=sync["bubble"], gpu=expected_on_gpus()))
    out = report.plot(runs, args.out or args.runs[0].parent / "demo-compare.png")
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
