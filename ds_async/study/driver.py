"""The loss-curve study's driver: it writes each run's JSON (the runs are :mod:`ds_async.study.matrices`') and trains
it, one after the other or spread over GPUs:

- ``--runner emulation`` (default): ``ds_async.emulate.run`` in this process, one run after the other, the same as
  ``python -m ds_async.emulate --config CONFIG.json``;
- ``--runner engine``: ``torchrun --nproc_per_node P launch/train.py --config CONFIG.json`` (P = stages x
  replicas; GPUs if present, else gloo on CPU).

    python launch/study/run.py main --list                      # the runs, and what each would run
    python launch/study/run.py main extras --gpus 4             # a share of the runs per GPU (main's first)
    python launch/study/run.py pairs --runner engine --gpus 4   # the engine side of the comparison, 2 GPUs a run
    python launch/study/run.py long long-lr --skip-committed --gpus 4   # what the committed results lack
    python launch/study/run.py long-moe --skip-committed --gpus 2 --list  # each GPU's share, minutes planned
    python launch/study/run.py tiny --device cpu --out /tmp/study

The configs' data and tokenizer paths are relative to the repository root (``../shared/corpus``): every run
starts there. A run's folder is ``OUT/<runner>/<group>/<name>/``: ``config.json`` (the JSON it ran) and what the
runner writes (``manifest.json``, tensorboard events, ``summary.json``). A folder with ``summary.json`` is finished
(an emulation run that diverged too: its summary says at which step) and skipped (``--force`` re-runs it); an
unfinished one resumes from its ``emulation_state.pt`` (left by ``--time-limit``), else starts again from scratch.
``--set KEY=VALUE`` overrides a key in every run (a JSON value, else a string), e.g. the data paths on another
machine. The emulation job is imported at module level: it imports nothing of :mod:`ds_async.study`, so there is no
circle to break.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import fnmatch
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from .. import emulate
from ..config import data_parallel_degree, override, parse_set
from ..nonfinite import NonFiniteLoss
from .matrices import HERE, MATRICES, ROOT, Run, lookup, matrix

RESULTS_CSV = HERE / "results" / "runs.csv"
RUNNERS = ("emulation", "engine")


# ---------------------------------------------------------------------------------------------------------------
# Running


def processes(config: dict) -> int:
    """Processes an engine launch of ``config`` needs: stages x replicas (from the JSON's batch keys)."""
    return config["ds_async"].get("pipeline_stages", 2) * data_parallel_degree(config)


# For a kind of run no committed run has timed: a micro-batch pass's seconds (long.json's on one H200, 0.08 s a step
# of 4; a small model's step is launch-bound). For every run: its start (the driver, the data reader, compiling).
PASS_SECONDS, START_SECONDS = 0.02, 40.0


def clock_key(runner: str, base: str, config: dict) -> tuple[str, str, str, int]:
    """What a step's time is read by: runner, base config, optimizer, micro-batches a step."""
    return runner, base, config["optimizer"]["type"].lower(), config.get("gradient_accumulation_steps", 1)


def step_clock(path: Path = RESULTS_CSV) -> dict[tuple[str, str, str, int], float]:
    """Seconds a step by ``clock_key``, from the committed runs: the median over each key's longest runs, whose
    compiling is spread thinnest. A step's time at the study's sizes follows neither its FLOPs nor its micro-batches:
    the MoE's step takes 1.4x the dense model's with fewer FLOPs a token, so the driver packs by the clock."""
    bases = {(r.group, r.name): r.base for name in MATRICES for r in matrix(name)}
    longest: dict[tuple, tuple[int, list[float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            base = bases.get((row["group"], row["name"]))
            if base is None or not row["seconds_per_step"]:
                continue
            key = (row["runner"], base, row["optimizer"], int(row["micro_batches"]))
            steps, times = longest.get(key, (0, []))
            if int(row["steps"]) > steps:
                steps, times = int(row["steps"]), []
            if int(row["steps"]) == steps:
                longest[key] = (steps, times + [float(row["seconds_per_step"])])
    return {key: statistics.median(times) for key, (_, times) in longest.items()}


def cost(run: Run, sets: dict | None = None, runner: str = "emulation", clock: dict | None = None) -> float:
    """Planned seconds of a run: its steps at ``clock``'s time for its key (``step_clock``), else at
    ``PASS_SECONDS`` a micro-batch pass; plus ``START_SECONDS``."""
    config = run.config(sets)
    steps, passes = config["ds_async"]["train"]["steps"], config.get("gradient_accumulation_steps", 1)
    step = (clock or {}).get(clock_key(runner, run.base, config), passes * PASS_SECONDS)
    return steps * step + START_SECONDS


def split(runs: list[Run], index: int, of: int, sets: dict | None = None, runner: str = "emulation",
          clock: dict | None = None) -> list[Run]:
    """Share ``index`` of ``of``: runs dealt longest first (by ``cost`` at ``clock``, default the committed
    ``step_clock()``) to the least loaded share, each share in list order."""
    if not 0 <= index < of:
        raise ValueError(f"share {index} is outside 0..{of - 1}")
    loads, shares = [0.0] * of, [[] for _ in range(of)]
    clock = step_clock() if clock is None else clock
    costs = [cost(r, sets, runner, clock) for r in runs]
    for k in sorted(range(len(runs)), key=lambda k: (-costs[k], k)):
        i = min(range(of), key=lambda s: (loads[s], s))
        loads[i] += costs[k]
        shares[i].append(k)
    return [runs[k] for k in sorted(shares[index])]


def committed(path: Path = RESULTS_CSV) -> set[tuple[str, str, str]]:
    """(runner, group, name) of every run the committed results hold."""
    with open(path, newline="") as f:
        return {(row["runner"], row["group"], row["name"]) for row in csv.DictReader(f)}


def run_dir(out: Path, runner: str, run: Run) -> Path:
    return out / runner / run.group / run.name


def write_config(run: Run, folder: Path, sets: dict) -> Path:
    """The run's JSON, logging into ``folder``, written as ``folder/config.json``."""
    config = override(run.config(sets), {"ds_async.logging.dir": str(folder.parent),
                                         "ds_async.logging.run_name": folder.name})
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def command(runner: str, config_path: Path, nproc: int, port: int) -> list[str]:
    if runner == "emulation":
        return [sys.executable, "-m", "ds_async.emulate", "--config", str(config_path)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
            str(ROOT / "launch" / "train.py"), "--config", str(config_path)]


def train(runs: list[Run], out: Path, runner: str, sets: dict, force: bool, device: str | None, port: int,
          time_limit: float | None = None) -> int:
    """Train the runs one after the other; returns how many failed (each failure is reported, the rest go on).
    ``time_limit`` (emulation): seconds for all of them; the run going at the limit saves its state and the rest
    wait; a later call resumes it."""
    failed = []
    t0 = time.perf_counter()
    for k, run in enumerate(runs):
        folder = run_dir(out, runner, run)
        if (folder / "summary.json").exists() and not force:
            print(f"[skip] {folder} is done", flush=True)
            continue
        left = None if time_limit is None else time_limit - (time.perf_counter() - t0)
        if left is not None and left <= 0:
            print(f"[time limit] {len(runs) - k} runs left for a later call", flush=True)
            break
        resume = runner == "emulation" and not force and (folder / "emulation_state.pt").exists()
        if not resume:
            shutil.rmtree(folder, ignore_errors=True)
        config_path = write_config(run, folder, sets)
        print(f"[run {k + 1}/{len(runs)}] {folder} ({runner}{', resumed' if resume else ''})", flush=True)
        t = time.perf_counter()
        try:
            if runner == "emulation":
                with contextlib.chdir(ROOT):  # the configs' data and tokenizer paths are relative to it
                    try:
                        emulate.run(str(config_path), device=device, resume=resume, time_limit=left)
                    except emulate.Stopped as e:
                        print(f"[stopped] {run.group}/{run.name}: {e}", flush=True)
                        break
                    except NonFiniteLoss as e:  # a result, not a failure: its summary.json says where it stopped
                        print(f"[diverged] {run.group}/{run.name}: {e}", flush=True)
                _release_memory()
            else:
                nproc = processes(json.loads(config_path.read_text()))
                subprocess.run(command(runner, config_path, nproc, port), cwd=ROOT, check=True)
            print(f"[done] {run.group}/{run.name} in {time.perf_counter() - t:.1f}s", flush=True)
        except Exception:  # noqa: BLE001 - one failed run must not stop the others
            traceback.print_exc()
            failed.append(f"{run.group}/{run.name}")
    print(f"[matrix] {len(runs) - len(failed)}/{len(runs)} runs ({runner}) in {time.perf_counter() - t0:.1f}s"
          + (f"; failed: {failed}" if failed else ""), flush=True)
    return len(failed)


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def worker_layout(runs: list[Run], runner: str, gpus: int, sets: dict) -> tuple[int, int]:
    """(GPUs a worker gets, workers) for spreading ``runs`` over ``gpus``: one GPU a worker for emulation runs, as
    many as the largest engine run's processes for engine runs."""
    per_run = max((processes(r.config(sets)) for r in runs), default=1) if runner == "engine" else 1
    if gpus // per_run < 1:
        raise SystemExit(f"--gpus {gpus}: a run needs {per_run} GPUs")
    return per_run, gpus // per_run


def list_shares(runs: list[Run], runner: str, gpus: int, sets: dict) -> None:
    """What ``--gpus`` would give each worker, and its minutes planned at the committed clock (``cost``)."""
    per_run, workers = worker_layout(runs, runner, gpus, sets)
    clock = step_clock()
    for k in range(workers):
        share = split(runs, k, workers, sets, runner, clock)
        planned = sum(cost(r, sets, runner, clock) for r in share)
        visible = ",".join(str(g) for g in range(k * per_run, (k + 1) * per_run))
        print(f"worker {k} (GPUs {visible}): {len(share)} runs, {planned / 60:.0f} min planned")
        for run in share:
            print(f"    {run.group}/{run.name}")


def spread(argv: list[str], runs: list[Run], out: Path, runner: str, gpus: int, sets: dict) -> int:
    """Start one worker (this script with ``--share k/W``) per group of GPUs a run needs, wait for all. Each worker's
    tokenizer thread pool gets ``1/W`` of the host's cores (``RAYON_NUM_THREADS``, unless set), as torchrun sets
    ``OMP_NUM_THREADS``: left alone, every worker's pool starts one thread per core, and W of them compete with the
    workers' training loops for the cores."""
    per_run, workers = worker_layout(runs, runner, gpus, sets)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    jobs = []
    for k in range(workers):
        visible = ",".join(str(g) for g in range(k * per_run, (k + 1) * per_run))
        log = out / "logs" / f"{runner}-{k}.log"
        env = {"RAYON_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // workers)), **os.environ,
               "CUDA_VISIBLE_DEVICES": visible}
        cmd = [sys.executable, "-m", "ds_async.study.driver", *argv, "--share", f"{k}/{workers}", "--port",
               str(29600 + 10 * k)]
        jobs.append((k, log, subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)))
        print(f"worker {k}: GPUs {visible}, log {log}", flush=True)
    status = 0
    for k, log, proc in jobs:
        status |= proc.wait() != 0
        lines = [line for line in log.read_text().splitlines() if line.startswith("[matrix]")]
        print(f"worker {k}: " + ("; ".join(lines) or f"no summary line, see {log}"), flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("matrices", nargs="+", choices=MATRICES, metavar="MATRIX",
                   help=f"one or more of {', '.join(MATRICES)} (one list, in this order)")
    p.add_argument("--runner", choices=RUNNERS, default="emulation")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "study")
    p.add_argument("--only", action="append", default=[], metavar="GLOB",
                   help="only the runs whose GROUP/NAME matches this glob (repeatable: those matching any)")
    p.add_argument("--set", dest="sets", type=parse_set, action="append", default=[], metavar="KEY=VALUE",
                   help="override a dotted key in every run's JSON (repeatable)")
    p.add_argument("--gpus", type=int, default=0, help="spread the runs over this many GPUs (one worker per GPU, "
                                                       "or per group of GPUs an engine run needs)")
    p.add_argument("--share", default=None, metavar="K/N", help="run only share K of N (what --gpus gives a worker)")
    p.add_argument("--device", default=None, help="emulation runs: cuda, cuda:N or cpu (default: cuda if present)")
    p.add_argument("--port", type=int, default=29600, help="engine runs: torchrun's master port")
    p.add_argument("--force", action="store_true", help="re-run finished runs")
    p.add_argument("--skip-committed", action="store_true",
                   help="leave out the runs launch/study/results/runs.csv already holds (finished on another machine)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="emulation: seconds for this call; the run going then saves its state, and the next call "
                        "resumes it (unfinished runs with a saved state always resume)")
    p.add_argument("--list", action="store_true",
                   help="print the runs and their commands (with --gpus: each worker's runs and minutes planned); "
                        "run nothing")
    args = p.parse_args(argv)

    sets = dict(args.sets)
    # A run two matrices share (long-moe-ns holds long-moe's fused runs) once: two workers must not train one folder.
    runs = list({(r.group, r.name): r for name in args.matrices for r in matrix(name)}.values())
    if args.only:
        runs = [r for r in runs if any(fnmatch.fnmatch(f"{r.group}/{r.name}", glob) for glob in args.only)]
    if args.skip_committed:
        done = committed()
        runs = [r for r in runs if (args.runner, r.group, r.name) not in done]
    out = args.out.resolve()
    if args.gpus and not args.share:
        if args.list:
            list_shares(runs, args.runner, args.gpus, sets)
            return 0
        return spread(argv, runs, out, args.runner, args.gpus, sets)
    clock = step_clock() if args.share or args.list else None  # packing and listing read the committed clock
    if args.share:
        k, _, of = args.share.partition("/")
        runs = split(runs, int(k), int(of), sets, args.runner, clock)
    if args.list:
        for run in runs:
            config = run.config(sets)
            folder = run_dir(out, args.runner, run)
            print(f"{run.group}/{run.name}: {run.base} + {json.dumps(run.overrides)}\n    "
                  + " ".join(command(args.runner, folder / "config.json", processes(config), args.port)))
        planned = sum(cost(r, sets, args.runner, clock) for r in runs)
        print(f"{len(runs)} runs, {sum(lookup(r.config(sets), 'ds_async.train.steps') for r in runs)} steps, "
              f"{planned / 60:.0f} min planned at the committed clock")
        return 0
    return 1 if train(runs, out, args.runner, sets, args.force, args.device, args.port, args.time_limit) else 0


if __name__ == "__main__":
    sys.exit(main())
