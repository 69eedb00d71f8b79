"""Time to loss through the real engine: synchronous 1F1B + Muon against 2BW + Muon + EF with the same wall-clock.

The number a user decides by: on the same GPUs, model and data, how soon does each schedule reach the loss the
synchronous run ends at? Every run gets the same training time, ``--budget`` seconds: each variant first runs
``--calibrate-steps`` steps to measure its steady step time (``summary.json``'s ``step_time_s``, warm-up left out),
then trains ``budget / step_time`` steps with its own LR schedule of that length (the config's warm-up, cosine to
the end). Each full run validates ``--evals`` times on the same held-out micro-batches, its manifest and summary
recording the wall-clock of every evaluation (``history["validation_seconds"]``).

Targets: the sync run's final validation loss and, with ``--targets N``, N - 1 earlier points of its curve (its
evaluations nearest each k/N of the run), so that a speed-up is read at several losses, not one crossing. With
``--variants sync,2bw+ef,sync-adamw --adamw-lr LR`` a third run is the one a DeepSpeed user makes today,
synchronous 1F1B with AdamW (torch's fused kernel) at its tuned peak LR; every run is then also timed to that run's
final loss. ``--adamw-lr LR1,LR2,...`` tunes it here: one AdamW run per LR (``sync-adamw@LR``), each with the same
training time, and the one with the lowest final validation loss is the AdamW run. A run that fails stops the
comparison; the same command without that LR goes on, finished runs are not run again.

    python launch/study/time_to_loss.py --budget 300 --gpus 4 --out runs/ttl
    python launch/study/time_to_loss.py --budget 300 --gpus 4 --out runs/ttl --set ds_async.data.train=...
    python launch/study/time_to_loss.py --budget 300 --gpus 4 --out runs/ttl-s1 --set ds_async.seed=1 \
        --calibration runs/ttl/time_to_loss.json      # another seed, the same steps: no calibration runs
    python launch/study/time_to_loss.py --budget 600 --gpus 4 --out runs/ttl-0.9b --config C.json --targets 3 \
        --variants sync,2bw+ef,sync-adamw --adamw-lr 3e-4,6e-4,1.2e-3    # three targets, AdamW tuned beside

``tests/test_time_to_loss.py`` runs it end to end on 2 CPU ranks with the model shrunk (``--set``).

Writes ``OUT/time_to_loss.json``: the command, the model's parameter count, the target (the sync run's final
validation loss), ``targets`` (all of them, the final last) and, with AdamW's runs, ``adamw_lrs`` (each run's LR),
``adamw_run`` (the best), ``adamw_lr`` (its LR) and ``adamw_target`` (its final validation loss); per run its card,
commit, steps, tokens, step time, final loss, ``time_to_loss`` (seconds from the start of training to the target,
linear between evaluations; null if never reached), ``tokens_to_loss``, the same to every target
(``time_to_targets``, ``tokens_to_targets``) and to AdamW's (``time_to_adamw_target``, ``tokens_to_adamw_target``),
and its validation curve against steps and seconds; the run folders are ``OUT/<variant>`` as ``launch/train.py``
writes them. The base config is ``engine_ttl.json`` beside this file (``--config`` for another).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

from ..config import override, parse_set
from ..report import time_to_loss
from .matrices import LONG_OPTIMIZERS
from .matrices import VARIANTS as STUDY_VARIANTS

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "launch" / "study"  # the base config beside the study's others

# The study's two variants; sync also says "no correction", for a job config that carries one (the shipped 2BW ones).
VARIANTS = {"sync": {**STUDY_VARIANTS["sync"], "ds_async.correction": {"type": "none"}},
            "2bw+ef": STUDY_VARIANTS["2bw+ef"]}
ADAMW = "sync-adamw"


def adamw_variant(lr: float) -> dict:
    """Synchronous 1F1B with AdamW at peak LR ``lr`` (the study's AdamW block on torch's fused kernel; the config's
    LR schedule). Its step runs unfused: the one-pass step is for flush-free schedules."""
    params = {**LONG_OPTIMIZERS["adamw"]["optimizer"]["params"], "lr": lr}
    return {**VARIANTS["sync"], "optimizer": {"type": "AdamW", "params": params},
            "ds_async.performance.fused_optimizer_step": False}


def adamw_runs(lrs: list[float]) -> dict[str, dict]:
    """The AdamW runs by name: ``sync-adamw`` for one peak LR, ``sync-adamw@LR`` for each of several."""
    if len(lrs) == 1:
        return {ADAMW: adamw_variant(lrs[0])}
    return {f"{ADAMW}@{lr:g}": adamw_variant(lr) for lr in lrs}


def sync_targets(summary: dict, count: int) -> list[float]:
    """``count`` losses of the sync run's validation curve, at its evaluations nearest each k/count of the run; the
    last is its final validation loss."""
    val = summary["history"]["validation"]
    earlier = [val[max(0, round(k * len(val) / count) - 1)][1] for k in range(1, count)]
    return [*earlier, summary["final_validation_loss"]]


def train(config: dict, out: Path, name: str, gpus: int, port: int = 29500) -> dict:
    """One ``launch/train.py`` run of ``config`` as ``out/name``; returns its summary.json. A run that already
    finished with this very config (its ``out/name.json`` and ``summary.json`` are there) is not run again, so the
    whole comparison can be spread over several calls of a time-limited machine: run the same command again."""
    folder = out / name
    config = override(config, {"ds_async.logging.dir": str(out), "ds_async.logging.run_name": name})
    out.mkdir(parents=True, exist_ok=True)
    path, text = out / f"{name}.json", json.dumps(config, indent=2) + "\n"
    done = folder / "summary.json"
    if done.exists() and path.exists() and path.read_text() == text:
        print(f"[done] {name}: {done}", flush=True)
        return json.loads(done.read_text())
    path.write_text(text)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus), "--master_port", str(port),
           str(ROOT / "launch" / "train.py"), "--config", str(path)]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads((folder / "summary.json").read_text())


def length(steps: int, evals: int) -> dict:
    return {"ds_async.train.steps": steps, "ds_async.eval.every": max(1, steps // evals)}


def reach(summary: dict, tokens_per_step: int, target: float) -> tuple[float | None, int | None]:
    """(seconds from the start of training, tokens) at which a run's validation curve first reaches ``target``,
    linear between evaluations; ``(None, None)`` if it never does."""
    history = summary["history"]
    val, seconds = history["validation"], history["validation_seconds"]
    losses = [v for _, v in val]
    at = time_to_loss([t for _, t in seconds], losses, target)
    step = time_to_loss([s for s, _ in val], losses, target)  # the same crossing, in steps
    return (None if at is None else round(at, 1)), (None if step is None else round(step * tokens_per_step))


def result(summary: dict, manifest: dict, tokens_per_step: int, targets: list[float],
           adamw_target: float | None = None) -> dict:
    """One run's entry: what it ran and reached, ``time_to_loss`` and ``tokens_to_loss`` for the last of
    ``targets`` (the sync run's final loss)."""
    crossings = [reach(summary, tokens_per_step, t) for t in targets]
    out = {"card": f"{manifest['world_size']}x {manifest.get('card')}", "commit": manifest["code"]["commit"],
           "steps": summary["steps"], "tokens": summary["tokens"], "step_time_s": summary["step_time_s"],
           "final_validation_loss": summary["final_validation_loss"], "seconds": summary["seconds"],
           "time_to_loss": crossings[-1][0], "tokens_to_loss": crossings[-1][1],
           "time_to_targets": [at for at, _ in crossings], "tokens_to_targets": [n for _, n in crossings]}
    if adamw_target is not None:
        out["time_to_adamw_target"], out["tokens_to_adamw_target"] = reach(summary, tokens_per_step, adamw_target)
    history = summary["history"]
    return {**out, "validation": history["validation"], "validation_seconds": history["validation_seconds"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=HERE / "engine_ttl.json")
    p.add_argument("--budget", type=float, required=True, help="training seconds each run gets")
    p.add_argument("--gpus", type=int, required=True, help="processes per run (pipeline stages x replicas)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "ttl")
    p.add_argument("--calibrate-steps", type=int, default=30)
    p.add_argument("--calibration", type=Path, default=None, metavar="JSON",
                   help="take each variant's step time from an earlier OUT/time_to_loss.json (the same config and "
                        "card, e.g. another seed: --set ds_async.seed=1) instead of calibrating again")
    p.add_argument("--evals", type=int, default=20, help="validations per full run")
    p.add_argument("--targets", type=int, default=1,
                   help="target losses read off the sync run's curve: its final one and N - 1 earlier ones")
    p.add_argument("--variants", default="sync,2bw+ef",
                   help=f"runs, comma-separated, sync first: sync, 2bw+ef, {ADAMW} (needs --adamw-lr)")
    p.add_argument("--adamw-lr", default=None, metavar="LR[,LR...]",
                   help=f"{ADAMW}'s peak LR, tuned for synchronous training of this model; several, comma-separated: "
                        "a run each, the lowest final loss is the AdamW run")
    p.add_argument("--set", dest="sets", type=parse_set, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--port", type=int, default=29500, help="torchrun's master port")
    args = p.parse_args(argv)
    names = args.variants.split(",")
    if names[0] != "sync" or len(set(names)) != len(names) or not set(names) <= {*VARIANTS, ADAMW}:
        p.error(f"--variants: distinct names of {', '.join([*VARIANTS, ADAMW])}, sync first; got {args.variants}")
    try:
        lrs = [float(x) for x in args.adamw_lr.split(",")] if args.adamw_lr is not None else []
    except ValueError:
        p.error(f"--adamw-lr: numbers, comma-separated; got {args.adamw_lr}")
    if (ADAMW in names) != bool(lrs) or len(set(lrs)) != len(lrs):
        p.error(f"--adamw-lr (distinct LRs) goes with the {ADAMW} variant, and it with the LRs")
    if args.targets < 1:
        p.error("--targets: at least 1 (the sync run's final loss)")
    variants = {}
    for name in names:
        variants.update(adamw_runs(lrs) if name == ADAMW else {name: VARIANTS[name]})

    base = override(json.loads(args.config.read_text()), dict(args.sets))
    # Each run's length sets its LR schedule's (ds_async fills it in); a length written there would be refused.
    base.get("scheduler", {}).get("params", {}).pop("total_num_steps", None)
    out = args.out.resolve()
    plans = {}
    earlier = json.loads(args.calibration.read_text())["calibration_step_time_s"] if args.calibration else {}
    for name, variant in variants.items():
        # AdamW's runs differ in their LR alone: one calibration times them all
        shared = next((step for other, (_, step) in plans.items() if other.startswith(ADAMW)), None)
        if name in earlier:
            step_time = earlier[name]
        elif name.startswith(ADAMW) and shared is not None:
            step_time = shared
        else:
            config = override(base, {**variant, **length(args.calibrate_steps, 1), "ds_async.eval.every": 0,
                                     "ds_async.data.validation": None})
            step_time = train(config, out, f"{name}-calibrate", args.gpus, args.port)["step_time_s"]
        steps = max(1, math.floor(args.budget / step_time))
        plans[name] = (steps, step_time)
        print(f"[calibrate] {name}: {step_time:.4f} s a step -> {steps} steps in {args.budget:g} s", flush=True)
    summaries = {}
    for name, variant in variants.items():
        steps, _ = plans[name]
        summaries[name] = train(override(base, {**variant, **length(steps, args.evals)}), out, name, args.gpus,
                                args.port)
    tokens_per_step = summaries["sync"]["tokens"] // summaries["sync"]["steps"]
    targets = sync_targets(summaries["sync"], args.targets)
    adamw_lrs = {name: variant["optimizer"]["params"]["lr"] for name, variant in variants.items()
                 if name.startswith(ADAMW)}
    best = min(adamw_lrs, key=lambda name: summaries[name]["final_validation_loss"], default=None)
    adamw_target = None if best is None else summaries[best]["final_validation_loss"]
    from .rows import model_parameters  # pandas: only when the comparison is made

    manifests = {name: json.loads((out / name / "manifest.json").read_text()) for name in summaries}
    config = args.config.resolve()
    command = ["python", "launch/study/time_to_loss.py", *(argv if argv is not None else sys.argv[1:])]
    doc = {"budget_s": args.budget, "gpus": args.gpus,
           "config": str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config),
           "sets": dict(args.sets), "command": shlex.join(command),
           "parameters": model_parameters(manifests["sync"]["model"]), "target": targets[-1], "targets": targets,
           **({"adamw_lrs": adamw_lrs, "adamw_run": best, "adamw_lr": adamw_lrs[best], "adamw_target": adamw_target}
              if best is not None else {}),
           "calibration_step_time_s": {k: v[1] for k, v in plans.items()},
           "calibration_from": str(args.calibration) if args.calibration else None,
           "runs": {name: result(s, manifests[name], tokens_per_step, targets, adamw_target)
                    for name, s in summaries.items()}}
    (out / "time_to_loss.json").write_text(json.dumps(doc, indent=1) + "\n")
    for name, r in doc["runs"].items():
        reached = ", ".join(f"{t:.4f} after {at} s" for t, at in zip(targets, r["time_to_targets"]))
        adamw = (f"; AdamW's final {adamw_target:.4f} after {r['time_to_adamw_target']} s"
                 if adamw_target is not None else "")
        print(f"[result] {name}: {r['steps']} steps, final {r['final_validation_loss']:.4f}, reaches {reached}"
              f"{adamw}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
