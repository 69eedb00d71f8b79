"""Throughput of the delay emulation (``python -m ds_async.emulate``) on one device, for the study's configs.

Each row trains one config for ``--steps`` steps through :func:`ds_async.emulate.run` and reports what its summary
measured after the logger's warm-up: step time, tokens/s and MFU (model FLOPs of ``ds_async.flops``), with the
card, the commit and the command; ``steady_step_time_s`` is the mean step after :data:`STEADY_FROM`, once the
steps read ahead during compilation are used up, which is what a long run gets. Rows go to stdout and, with
``--out``, to a JSON-lines file.

    python launch/bench/bench_emulation.py --out runs/bench_emulation.jsonl \\
        launch/study/long.json:adamw-sync launch/study/long.json:muon-2bw+ef launch/study/base.json:adamw-sync

A row is ``CONFIG[:OPTIMIZER-VARIANT]``: the variant applies ``launch/study/run.py``'s overrides (the long study's
optimizers for ``long.json``); ``--set KEY=VALUE`` overrides a key of every row's JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
from pathlib import Path

from ds_async.config import override, parse_set
from ds_async.study.matrices import LONG_OPTIMIZERS, OPTIMIZERS, VARIANTS

ROOT = Path(__file__).resolve().parents[2]


def row_config(spec: str, sets: dict) -> tuple[str, dict]:
    path, _, variant = spec.partition(":")
    config = json.loads((ROOT / path).read_text())
    if variant:
        opt, _, schedule = variant.partition("-")
        optimizers = LONG_OPTIMIZERS if Path(path).name == "long.json" else OPTIMIZERS
        config = override(config, {**optimizers[opt], **VARIANTS[schedule]})
    return spec, override(config, sets)


STEADY_FROM = 100
"""Steps after which a run trains at the rate its data are read: the first ~32-48 steps train from chunks the
reader read while the model compiled (16-step chunks, two queued), so they show the GPU alone."""


def steady_step_time(history: list, window: int, start: int = STEADY_FROM) -> float | None:
    """Mean step time over steps ``start + 1`` up to the last multiple of ``window`` past it, from the logger's
    running means over ``window`` steps (``summary["history"]["step_time_s"]``): taken at every ``window``-th step
    past ``start`` they are the means of disjoint windows. None for a run too short for one window."""
    means = dict(history)
    points = [means[s] for s in range(start + window, max(means, default=0) + 1, window) if s in means]
    return sum(points) / len(points) if points else None


def main(argv: list[str] | None = None) -> int:
    import torch

    from ds_async import emulate
    from ds_async.metrics import code_version

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="+", metavar="CONFIG[:OPTIMIZER-VARIANT]")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--set", dest="sets", type=parse_set, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    sets = dict(args.sets)
    sets.setdefault("ds_async.logging.progress", False)
    sets.setdefault("ds_async.eval.every", 0)
    sets.setdefault("ds_async.data.validation", None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, spec in enumerate(args.rows):
            name, config = row_config(spec, {**sets, "ds_async.logging.dir": tmp,
                                             "ds_async.logging.run_name": f"row{k}"})
            path = Path(tmp) / f"row{k}.json"
            path.write_text(json.dumps(config))
            with contextlib.chdir(ROOT):
                summary = emulate.run(str(path), max_steps=args.steps, device=args.device)
            manifest = json.loads((Path(tmp) / f"row{k}" / "manifest.json").read_text())
            history = json.loads((Path(tmp) / f"row{k}" / "summary.json").read_text())["history"]
            model = config["ds_async"]["model"]["config"]
            row = {"row": name, "params": manifest["emulation"]["parameters"], "model": model,
                   "micro_batch_size": manifest["micro_batch_size"], "micro_batches": manifest["micro_batches"],
                   "seq_len": config["ds_async"]["data"]["seq_len"], "tokens_per_step": manifest["tokens_per_step"],
                   "steps": args.steps, "warmup_steps": summary["warmup_steps"],
                   "step_time_s": summary["step_time_s"], "tokens_per_s": summary["train_tokens_per_s"],
                   "steady_step_time_s": steady_step_time(history["step_time_s"],
                                                          manifest["ds_async"]["logging"]["window"]),
                   "mfu": summary["mfu"], "precision": manifest["emulation"]["precision"],
                   "card": manifest["emulation"]["card"], "torch": torch.__version__,
                   "commit": code_version().get("commit"), "command": shlex.join([sys.argv[0], *sys.argv[1:]]),
                   "sets": sets}
            rows.append(row)
            print("BENCH " + json.dumps(row), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
