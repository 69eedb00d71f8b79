"""Your runs side by side: any run folders of ``launch/train.py`` or ``python -m ds_async.emulate``.

    python -m ds_async.report runs/demo-1f1b runs/demo-2bw [--plot runs/compare.png]

:func:`read_run` reads a folder's ``manifest.json`` and ``summary.json`` into one plain dict (what ran, its final
losses, its speed, its curves against step, tokens and training seconds); :func:`table` lays runs out for a person;
:func:`pairs` finds, for each flush-free run (2BW), the synchronous run of the same job (same model, data, tokens per
step, stages and seed: the schedule, optimizer and correction may differ) and :func:`compare` says how much faster
its steps were and how much sooner it reached the synchronous run's final validation loss; :func:`plot` draws loss
against step, tokens and seconds. Plain Python and matplotlib: the notebook (``notebooks/your_runs.ipynb``) shows
the same through pandas.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .pipe import version_rule
from .pipe.simulate import simulate


class RunError(ValueError):
    """A folder that is not a finished run of ``launch/train.py`` or the emulation."""


def read_run(folder: str | Path) -> dict:
    """One run folder as a plain dict (see the module docstring)."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        summary = json.loads((folder / "summary.json").read_text())
    except FileNotFoundError as e:
        raise RunError(f"{folder}: no {Path(e.filename).name} (not a run folder, or the run has not finished)") \
            from None
    cfg, ds = manifest["ds_async"], manifest["deepspeed"]
    history = summary.get("history", {})
    correction = cfg.get("correction") or {"type": "none"}
    optimizer = (ds.get("optimizer") or {}).get("type", "none")
    if correction["type"] != "none":
        optimizer += f" + {correction['type'].upper()}"
    tokens_per_step = manifest["tokens_per_step"]
    train = history.get("train", [])
    tail = [loss for _, loss in train[-10:]]
    return {
        "name": folder.name, "path": str(folder), "schedule": cfg["schedule"], "optimizer": optimizer,
        "flush_free": version_rule.get(cfg["schedule"]).flush_free,
        "runner": "emulation" if manifest.get("emulation") else "engine",
        "card": (manifest.get("emulation") or {}).get("card") or manifest.get("card"),
        "stages": manifest["pipeline_stages"], "micro_batches": manifest["micro_batches"],
        "data_parallel": manifest.get("data_parallel", 1), "tokens_per_step": tokens_per_step,
        "job": _job(manifest), "steps": summary["steps"], "tokens": summary["tokens"],
        "seconds": summary["seconds"], "tokens_per_s": summary["tokens_per_s"],
        "steady_tokens_per_s": summary.get("train_tokens_per_s"), "step_time_s": summary.get("step_time_s"),
        "final_train_loss": summary.get("final_train_loss"),
        "train_loss_last10": sum(tail) / len(tail) if tail else None,
        "final_validation_loss": summary.get("final_validation_loss"),
        "bubble": grid_bubble(cfg["schedule"], manifest["pipeline_stages"], manifest["micro_batches"],
                              summary["steps"], cfg["eval"]["every"] if cfg["data"].get("validation") else 0),
        "idle": {name: figures.get("idle_fraction") for name, figures in (summary.get("stages") or {}).items()},
        "train": train, "train_seconds": history.get("train_seconds", []),
        "validation": history.get("validation", []), "validation_seconds": history.get("validation_seconds", []),
    }


def _job(manifest: dict) -> str:
    """What two runs must share to be compared as the same job under another schedule."""
    cfg = manifest["ds_async"]
    data = {k: cfg["data"].get(k) for k in ("train", "validation", "seq_len", "text_field", "min_chars")}
    return json.dumps({"model": manifest["model"], "data": data, "tokenizer": cfg.get("tokenizer"),
                       "tokens_per_step": manifest["tokens_per_step"], "stages": manifest["pipeline_stages"],
                       "seed": cfg.get("seed")}, sort_keys=True)


def grid_bubble(schedule: str, stages: int, micro_batches: int, steps: int, drain_every: int) -> float:
    """Idle share of the stages' slots on DeepSpeed's step grid over the run: synchronous 1F1B drains every step,
    (p − 1)/(m + p − 1); a flush-free schedule warms up and drains once per segment between drains (evaluations)."""
    rule = version_rule.get(schedule)
    if not rule.flush_free:
        return (stages - 1) / (micro_batches + stages - 1)
    idle = busy = 0
    left = steps
    while left > 0:
        batches = min(left, drain_every or left)
        result = simulate(rule, stages, micro_batches, batches)
        idle, busy = idle + sum(result.idle_steps), busy + sum(result.busy_steps)
        left -= batches
    return idle / (idle + busy)


def pairs(runs: list[dict]) -> list[tuple[dict, dict]]:
    """(synchronous run, flush-free run) of the same job, every such pair."""
    return [(sync, run) for run in runs if run["flush_free"]
            for sync in runs if not sync["flush_free"] and sync["job"] == run["job"]]


def time_to_loss(seconds: list[float], losses: list[float], target: float) -> float | None:
    """Wall-clock seconds at which a validation curve first reaches ``target`` (linear between evaluation points;
    the first point counts as reached at its own time), or None if it never does. ``seconds`` may be any increasing
    x of the evaluations: given their steps it gives the (fractional) step of the same crossing."""
    for k, (t, loss) in enumerate(zip(seconds, losses)):
        if loss <= target:
            if k == 0:
                return float(t)
            t0, l0 = seconds[k - 1], losses[k - 1]
            return float(t0 + (t - t0) * (l0 - target) / (l0 - loss))
    return None


def first_reach(validation: list, clock: list, target: float) -> tuple[float, float] | None:
    """(step, seconds) at which a run's validation curve (``[step, loss]`` pairs, with ``clock`` its
    ``[step, seconds]``) first reaches ``target``, by :func:`time_to_loss`; None if it never does."""
    losses = [loss for _, loss in validation]
    step = time_to_loss([s for s, _ in validation], losses, target)
    if step is None:
        return None
    return step, time_to_loss([t for _, t in clock], losses, target)


def compare(sync: dict, run: dict) -> dict:
    """How the flush-free ``run`` did against ``sync``: its steady tokens/s over sync's, the final validation losses'
    difference, and the training seconds and steps each took to reach sync's final validation loss."""
    out = {"sync": sync["name"], "async": run["name"],
           "speed": (run["steady_tokens_per_s"] / sync["steady_tokens_per_s"]
                     if run["steady_tokens_per_s"] and sync["steady_tokens_per_s"] else None),
           "expected_speed": (1 - run["bubble"]) / (1 - sync["bubble"]),
           "validation_gap": (run["final_validation_loss"] - sync["final_validation_loss"]
                              if run["final_validation_loss"] is not None
                              and sync["final_validation_loss"] is not None else None)}
    target = sync["final_validation_loss"]
    if target is not None:
        mine, theirs = first_reach(run["validation"], run["validation_seconds"], target), \
            first_reach(sync["validation"], sync["validation_seconds"], target)
        out["target_loss"] = target
        out["sync_reached"] = theirs
        out["async_reached"] = mine
        out["sooner"] = theirs[1] / mine[1] if mine and theirs and mine[1] > 0 else None
    return out


def _loss(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _count(value) -> str:
    return "-" if value is None else f"{round(value):,}"


def _share(value) -> str:
    return "-" if value is None else f"{value:.1%}"


ROWS = (("schedule", "schedule", str), ("optimizer", "optimizer", str), ("steps", "steps", _count),
        ("tokens", "tokens", _count), ("train loss (last step)", "final_train_loss", _loss),
        ("train loss (mean of last 10)", "train_loss_last10", _loss),
        ("validation loss", "final_validation_loss", _loss),
        ("tokens/s (steady steps)", "steady_tokens_per_s", _count), ("tokens/s (whole run)", "tokens_per_s", _count),
        ("training seconds", "seconds", lambda v: f"{v:,.1f}"),
        ("bubble (schedule, step grid)", "bubble", _share),
        ("idle (measured, per stage)", "idle",
         lambda v: " ".join(f"{k.replace('stage', 's')} {_share(x)}" for k, x in v.items()) or "-"))


def table(runs: list[dict]) -> str:
    """The runs side by side, a row per figure."""
    cells = [[fmt(run[key]) for _, key, fmt in ROWS] for run in runs]
    width = max(len(label) for label, _, _ in ROWS)
    cols = [max(len(run["name"]), *map(len, column)) for run, column in zip(runs, cells)]
    lines = [f"{'run':<{width}}  " + "  ".join(f"{run['name']:>{c}}" for run, c in zip(runs, cols))]
    lines += [f"{label:<{width}}  " + "  ".join(f"{column[i]:>{c}}" for column, c in zip(cells, cols))
              for i, (label, _, _) in enumerate(ROWS)]
    return "\n".join(lines)


def comparison_lines(result: dict) -> list[str]:
    """A person's reading of :func:`compare`."""
    lines = [f"{result['async']} vs {result['sync']}:"]
    speed = "no steady steps to time" if result["speed"] is None else f"{result['speed']:.2f}x as fast"
    lines.append(f"  steps {speed} (steady tokens/s); the schedules' bubbles alone allow "
                 f"{result['expected_speed']:.2f}x")
    if result["validation_gap"] is not None:
        lines.append(f"  final validation loss {result['validation_gap']:+.4f} against the synchronous run's")
    if "target_loss" in result:
        mine, theirs = result["async_reached"], result["sync_reached"]
        if mine is None:
            lines.append(f"  did not reach the synchronous run's final validation loss {result['target_loss']:.4f}")
        else:
            lines.append(f"  reached the synchronous run's final validation loss {result['target_loss']:.4f} at step "
                         f"{mine[0]:,.0f} after {mine[1]:,.1f} s of training (the synchronous run: step "
                         f"{theirs[0]:,.0f}, {theirs[1]:,.1f} s)" + _sooner(result["sooner"]))
    return lines


def find_runs(roots: list[str | Path]) -> list[Path]:
    """Every finished run folder (``manifest.json`` and ``summary.json``) at or below ``roots``, sorted."""
    return sorted({p.parent for root in roots for p in Path(root).rglob("summary.json")
                   if (p.parent / "manifest.json").exists()})


def figure(runs: list[dict]):
    """Training (thin) and validation (markers) loss against step, tokens and training seconds, one panel each: a
    matplotlib Figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for run, color in zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4):
        label = f"{run['name']} ({run['schedule']}, {run['optimizer']})"
        train, val = dict(run["train"]), dict(run["validation"])
        axes_x = {"step": (list(train), list(val)),
                  "tokens": ([s * run["tokens_per_step"] for s in train], [s * run["tokens_per_step"] for s in val]),
                  "training seconds": ([dict(run["train_seconds"]).get(s) for s in train],
                                       [dict(run["validation_seconds"]).get(s) for s in val])}
        for ax, (xlabel, (tx, vx)) in zip(axes, axes_x.items()):
            keep = [(x, y) for x, y in zip(tx, train.values()) if x is not None]
            if keep:
                ax.plot(*zip(*keep), color=color, alpha=0.4, linewidth=0.8)
            keep = [(x, y) for x, y in zip(vx, val.values()) if x is not None]
            if keep:
                ax.plot(*zip(*keep), color=color, marker="o", label=f"{label}: validation")
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
    axes[0].set_ylabel("loss (thin: training, markers: validation)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _sooner(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return f": {ratio:.2f}x sooner" if ratio >= 1 else f": {1 / ratio:.2f}x later"


def plot(runs: list[dict], out: str | Path) -> Path:
    """:func:`figure` written to the PNG ``out``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(runs)
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (manifest.json and summary.json)")
    parser.add_argument("--plot", type=Path, default=None, help="write the loss curves to this PNG")
    args = parser.parse_args(argv)
    try:
        runs = [read_run(folder) for folder in args.runs]
    except RunError as e:
        parser.exit(1, f"ds_async.report: error: {e}\n")
    print(table(runs))
    for sync, run in pairs(runs):
        print("\n".join(comparison_lines(compare(sync, run))))
    if args.plot:
        print(f"plot: {plot(runs, args.plot)}")


if __name__ == "__main__":
    main()
