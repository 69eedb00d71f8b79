"""One training run through the command line (``launch/train.py``) or the emulation, timed from its launch.

    python launch/bench/bench_run.py --runner cli --config launch/study/long.json --set ds_async.pipeline_stages=1 \
        --set ds_async.train.steps=300 --cache cold --out rows.jsonl

Appends one JSON row: ``runner`` (``cli``/``emulation``), the summary's ``tokens_per_s`` (steady steps after the
warm-up: ``train_tokens_per_s``), the whole run's rate, each stage's ``idle_fraction`` and ``optimizer_fraction`` (the
CLI's), and the times seen from outside the process, in seconds after launch: ``time_to_first_step_s`` (step 1's
console line, printed once its loss and norm reached the host), ``final_eval_s`` (from the last step's line to the
final validation line: the drain and the evaluation), ``exit_after_summary_s`` (from the summary line to the process's
end), with ``start_s`` (the summary's phases from launch to the end of step 1: imports, process group, model, engine,
data, first step for the CLI; imports, model, data, first step for the emulation), the card, commit and command.
``performance.compile_cache`` is ``--cache-dir``: ``--cache cold`` empties it first, ``warm`` uses what an earlier run
left there. ``--resume PATH`` times a resumed run's start (``resume`` in the row: its first step is the first after
the checkpoint's). ``--set KEY=VALUE`` sets a key of the config (a JSON value, else a string; ``ds_async.`` keys
inside its section). ``--py-spy-dump S`` dumps every thread's stack (``py-spy dump``, subprocesses too) S seconds
after the summary line if the process is still alive, to show what holds it; ``--py-spy-record FILE`` samples the
training process's stacks for a while from a given step (folded stacks; ``--py-spy-idle``: waiting threads too, so
that time spent waiting on the GPU or a compile worker shows; ``--py-spy-format speedscope``: each thread's samples in
time order; ``--py-spy-flags``: py-spy's own, such as ``--threads --gil``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ds_async.config import override, parse_set

ROOT = Path(__file__).resolve().parents[2]


def card() -> str | None:
    try:
        import torch
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a row without a card name rather than no row
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runner", choices=("cli", "emulation"), required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="sets", type=parse_set, action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--cache", choices=("cold", "warm"), default="warm")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/ds_async/compile"))
    ap.add_argument("--label", default="")
    ap.add_argument("--resume", default=None, metavar="PATH",
                    help="the command line's --resume PATH: a resumed run's start (a checkpoint an earlier run saved)")
    ap.add_argument("--py-spy-dump", type=float, default=None, metavar="S")
    ap.add_argument("--py-spy-record", default=None, metavar="FILE",
                    help="sample the run's stacks (py-spy record, folded, without pausing it) into FILE")
    ap.add_argument("--py-spy-at", type=int, default=100, metavar="STEP", help="from this step's line (0: from launch)")
    ap.add_argument("--py-spy-seconds", type=float, default=10)
    ap.add_argument("--py-spy-idle", action="store_true",
                    help="sample threads that wait too (on the GPU, a lock, a compile worker), not only running ones")
    ap.add_argument("--py-spy-format", default="raw", choices=("raw", "speedscope"),
                    help="raw: folded stacks; speedscope: every thread's samples in time order (a timeline)")
    ap.add_argument("--py-spy-flags", default="", metavar="FLAGS",
                    help="more py-spy record flags, e.g. \"--threads --gil\" (only the thread holding the GIL); one "
                         "flag alone as --py-spy-flags=--threads")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.resume and args.runner != "cli":
        ap.error("--resume: the command line's (--runner cli)")

    cache = args.cache_dir
    if args.cache == "cold":  # emptied: this run compiles everything and fills it for the next
        shutil.rmtree(cache, ignore_errors=True)
    config = override(json.loads(Path(args.config).read_text()),
                      {**dict(args.sets), "ds_async.performance.compile_cache": cache})
    work = Path(tempfile.mkdtemp(prefix="ds_async_bench_run_"))
    config["ds_async"].setdefault("logging", {}).update({"every": 1, "progress": False, "plot": False,
                                                         "dir": str(work / "runs")})
    derived = work / "config.json"
    derived.write_text(json.dumps(config))
    run_name = f"bench-{args.runner}-{os.getpid()}"
    cmd = ([sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(derived), "--run-name", run_name]
           + (["--resume", args.resume] if args.resume else [])
           if args.runner == "cli" else
           [sys.executable, "-m", "ds_async.emulate", "--config", str(derived), "--run-name", run_name])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the config's compile_cache decides
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    marks: dict[str, float] = {}
    summary_line = None
    dump = []

    def dump_later():
        time.sleep(args.py_spy_dump)
        if proc.poll() is None and shutil.which("py-spy"):
            out = subprocess.run(["py-spy", "dump", "--subprocesses", "--pid", str(proc.pid)], capture_output=True,
                                 text=True)
            dump.append(out.stdout + out.stderr)

    def record():
        subprocess.run(["py-spy", "record", "--nonblocking", "--rate", "500" if args.py_spy_at else "50", "--format",
                        args.py_spy_format, "--duration", str(int(args.py_spy_seconds)), "--output",
                        args.py_spy_record, "--pid", str(proc.pid)] + (["--idle"] if args.py_spy_idle else [])
                       + args.py_spy_flags.split(), capture_output=True)

    if args.py_spy_record and args.py_spy_at == 0 and shutil.which("py-spy"):
        threading.Thread(target=record, daemon=True).start()
    steps = None
    for line in proc.stdout:
        now = time.monotonic() - start
        sys.stdout.write(f"[{now:8.2f}] {line}")
        m = re.match(r"step (\d+)/(\d+):", line)
        if m:
            steps = int(m.group(2))
            marks.setdefault("first_step", now)
            if args.py_spy_record and int(m.group(1)) == args.py_spy_at and shutil.which("py-spy"):
                threading.Thread(target=record, daemon=True).start()
            marks["last_step_line"] = now
        if re.match(r"step \d+: validation loss", line) and steps is not None and f"step {steps}:" in line:
            marks["final_eval_line"] = now
        if line.startswith("ds_async summary:"):
            marks["summary"] = now
            summary_line = line
            if args.py_spy_dump is not None:
                threading.Thread(target=dump_later, daemon=True).start()
    rc = proc.wait(timeout=args.timeout)
    marks["exit"] = time.monotonic() - start
    summary = {}
    run_dirs = list((work / "runs").glob("*/summary.json"))
    if run_dirs:
        summary = json.loads(run_dirs[0].read_text())
    elif summary_line:
        summary = {k: v for k, _, v in (p.partition("=") for p in summary_line.split()[2:])}
    stages = summary.get("stages") or {}
    row = {"runner": args.runner, "label": args.label, "rc": rc, "card": card(),
           "commit": os.environ.get("DS_ASYNC_COMMIT") or subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
           "command": " ".join(sys.argv), "cache": args.cache, "resume": args.resume,
           "tokens_per_s": summary.get("train_tokens_per_s"), "run_tokens_per_s": summary.get("tokens_per_s"),
           "step_time_s": summary.get("step_time_s"), "steps": summary.get("steps"),
           "idle_fraction": {s: f.get("idle_fraction") for s, f in stages.items()} or None,
           "optimizer_fraction": {s: f.get("optimizer_fraction") for s, f in stages.items()} or None,
           "time_to_first_step_s": round(marks["first_step"], 2) if "first_step" in marks else None,
           "start_s": summary.get("start_s"),
           "final_eval_s": round(marks["final_eval_line"] - marks["last_step_line"], 2)
           if "final_eval_line" in marks else None,
           "exit_after_summary_s": round(marks["exit"] - marks["summary"], 2) if "summary" in marks else None,
           "wall_s": round(marks["exit"], 2)}
    if dump:
        row["py_spy_dump"] = dump[0][-6000:]
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
