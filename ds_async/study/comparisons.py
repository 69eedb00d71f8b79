"""Two comparisons beside the loss matrix: time to a target loss (sync against 2BW + EF on one card, from
``launch/study/time_to_loss.py``'s committed output) and the real engine against the emulation (each
``launch/train.py`` run paired with the emulation run of the same config, its difference set against the seed
noise of the main matrix), with the provenance of every result.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from ..report import time_to_loss
from .rows import AXES, RESULTS
from .tables import at_reference, formatted, markdown, pm, reference


TIME_TO_LOSS = "time_to_loss.json"  # launch/study/time_to_loss.py's output, committed beside runs.csv


def load_time_to_loss(folder: str | Path = RESULTS) -> dict | None:
    """The committed time-to-loss comparison (``launch/study/time_to_loss.py``'s JSON), None if there is none."""
    path = Path(folder) / TIME_TO_LOSS
    return json.loads(path.read_text()) if path.exists() else None


def find_time_to_loss(roots: Iterable[str | Path]) -> dict | None:
    """The first time-to-loss comparison (``OUT/time_to_loss.json``) below ``roots``, None if there is none."""
    for root in roots:
        for path in sorted(Path(root).rglob(TIME_TO_LOSS)):
            return json.loads(path.read_text())
    return None


def time_to_loss_curves(doc: dict) -> pd.DataFrame:
    """Every evaluation of every run of a time-to-loss comparison: run, step, tokens, seconds, validation loss."""
    rows = []
    for name, run in doc["runs"].items():
        per_step = run["tokens"] / run["steps"]
        for (step, loss), (_, seconds) in zip(run["validation"], run["validation_seconds"], strict=True):
            rows.append({"run": name, "step": step, "tokens": step * per_step, "seconds": seconds, "loss": loss})
    return pd.DataFrame(rows)


def time_to_loss_table(doc: dict) -> pd.DataFrame:
    """One row per run of a time-to-loss comparison, every crossing recomputed from the run's validation curve:
    seconds and tokens to reach the target (the sync run's final loss) and the wall-clock speed-up to it over sync.
    The seconds count from the start of training, so they include compiling and the evaluations; ``start-up`` is
    what the first evaluation's clock holds beyond its steps at the run's step time (compiling, warm-up), and the
    ``after start-up`` columns leave it out. Against sync, last: the extra tokens to the target (a fraction), and
    how many times as fast each step is, in the full run and in calibration."""
    runs = doc["runs"]
    per_step = runs["sync"]["tokens"] / runs["sync"]["steps"]
    rows = []
    for name, run in runs.items():
        losses = [v for _, v in run["validation"]]
        at = time_to_loss([t for _, t in run["validation_seconds"]], losses, doc["target"])
        step = time_to_loss([s for s, _ in run["validation"]], losses, doc["target"])
        start = start_up(run)
        rows.append({"run": name, "card": run["card"], "commit": str(run["commit"])[:7], "steps": run["steps"],
                     "tokens (M)": run["tokens"] / 1e6, "step (s)": run["step_time_s"],
                     "training (s)": run["seconds"], "final loss": run["final_validation_loss"],
                     "time to target (s)": math.nan if at is None else at,
                     "tokens to target (M)": math.nan if step is None else step * per_step / 1e6,
                     "start-up (s)": start, "after start-up (s)": math.nan if at is None else at - start})
    table = pd.DataFrame(rows)
    sync = table["run"] == "sync"
    table["speed-up to target"] = table.loc[sync, "time to target (s)"].iloc[0] / table["time to target (s)"]
    table["speed-up after start-up"] = table.loc[sync, "after start-up (s)"].iloc[0] / table["after start-up (s)"]
    table["tokens to target vs sync"] = (table["tokens to target (M)"] / table.loc[sync, "tokens to target (M)"].iloc[0]
                                         - 1)
    table["step speed-up"] = table.loc[sync, "step (s)"].iloc[0] / table["step (s)"]
    calibrated = doc["calibration_step_time_s"]
    table["step speed-up in calibration"] = [calibrated["sync"] / calibrated[name] for name in table["run"]]
    return table


def start_up(run: dict) -> float:
    """Seconds of a time-to-loss run's clock that are not its steps: what its first evaluation's clock holds beyond
    its steps at the run's step time (compiling, warm-up)."""
    first_step, first_seconds = run["validation"][0][0], run["validation_seconds"][0][1]
    return first_seconds - first_step * run["step_time_s"]


def time_to_targets_table(doc: dict) -> pd.DataFrame:
    """Every run's training seconds after its start-up (:func:`start_up`) to each of the comparison's targets (the
    sync run's curve at several points, its final loss last) and, with the AdamW run, to that run's final loss,
    each recomputed from the run's validation curve, with the speed-up over sync (over the AdamW run for its
    target). NaN where a run never reached the target."""
    runs = doc["runs"]
    targets = [(f"{t:.4f}", t, "sync") for t in doc.get("targets", [doc["target"]])]
    if doc.get("adamw_target") is not None:
        adamw = doc.get("adamw_run", "sync-adamw")
        targets.append((f"{doc['adamw_target']:.4f} (AdamW's)", doc["adamw_target"], adamw))
    seconds = {}
    for name, run in runs.items():
        losses, clock = [v for _, v in run["validation"]], [t for _, t in run["validation_seconds"]]
        start = start_up(run)
        for label, target, _ in targets:
            at = time_to_loss(clock, losses, target)
            seconds[name, label] = math.nan if at is None else at - start
    rows = []
    for name in runs:
        row = {"run": name}
        for label, _, against in targets:
            row[f"to {label} (s)"] = seconds[name, label]
            row[f"speed-up at {label}"] = seconds[against, label] / seconds[name, label]
        rows.append(row)
    return pd.DataFrame(rows)


def time_to_loss_block(doc: dict) -> str:
    """The results page's time-to-loss table and the line saying what ran (target, model, calibration, command)."""
    table = time_to_loss_table(doc)
    table["tokens to target vs sync"] = [f"{v:+.0%}" if math.isfinite(v) else "—"
                                         for v in table["tokens to target vs sync"]]
    table = formatted(table, {"tokens (M)": 1, "step (s)": 4, "training (s)": 1, "final loss": 4,
                              "time to target (s)": 1, "tokens to target (M)": 1, "start-up (s)": 1,
                              "after start-up (s)": 1, "speed-up to target": 3, "speed-up after start-up": 3,
                              "step speed-up": 2, "step speed-up in calibration": 2})
    return (markdown(table, index=False)
            + f"\nTarget: {doc['target']:.4f} (sync's final validation loss). "
            f"Model: {doc['parameters'] / 1e6:.1f}M parameters (`{doc['config']}`), {doc['gpus']} GPUs, "
            f"{doc['budget_s']:g} s of steady-state steps each ("
            + (f"as calibrated for `{doc['calibration_from']}`: " if doc.get("calibration_from") else "calibrated: ")
            + ", ".join(f"{k} {v:.4f} s a step" for k, v in doc["calibration_step_time_s"].items())
            + f"). Ran: `{doc['command']}`" + (f" ({doc['note']})" if doc.get("note") else "") + ".\n"
            + _targets_block(doc))


def _targets_block(doc: dict) -> str:
    """The table of every target, for a comparison run with several (``--targets``) or with AdamW's run."""
    if len(doc.get("targets", [])) < 2 and doc.get("adamw_target") is None:
        return ""
    table = time_to_targets_table(doc)
    text = (f"\nTraining seconds after each run's start-up to each target: sync's validation loss at "
            f"{len(doc['targets'])} points of its curve, its final loss last")
    if doc.get("adamw_target") is not None:
        lrs = doc.get("adamw_lrs", {})
        tuned = (f", the best of {len(lrs)} runs at peak LRs {', '.join(f'{lr:g}' for lr in lrs.values())}"
                 if len(lrs) > 1 else "")
        text += (f", and the AdamW run's final loss (synchronous 1F1B, AdamW at peak LR {doc['adamw_lr']:g}{tuned}), "
                 "its speed-up against that run")
    return ("\n" + markdown(formatted(table, {c: 1 if c.endswith("(s)") else 3 for c in table.columns[1:]}),
                            index=False) + text + ".\n")


# ---------------------------------------------------------------------------------------------------------------
# The real engine vs the emulation


def _max_rel(a_steps, a_vals, b_steps, b_vals) -> float:
    """Largest relative difference of two curves over their common steps (NaN when they share none)."""
    b = dict(zip(b_steps, b_vals))
    rel = [abs(v - b[s]) / abs(b[s]) for s, v in zip(a_steps, a_vals) if s in b and b[s] != 0]
    return max(rel) if rel else math.nan


def engine_pairs(runs: pd.DataFrame) -> pd.DataFrame:
    """Each engine run (``runner == "engine"``: ``launch/train.py``) next to the emulation run of the same config
    (equal ``config_key``): their final validation losses, the difference ``engine − emulation``, and how far
    apart the whole curves are (largest relative difference over the training steps and the validation points)."""
    cols = ["optimizer", "label", "seed", "group", "model", "batch", "micro_batches", "emulation", "engine", "diff",
            "train max rel", "val max rel", "complete", "engine card", "emulation card", "engine s/step",
            "emulation s/step", "engine path", "emulation path", "config_key"]
    if "runner" not in runs or runs.empty:
        return pd.DataFrame(columns=cols)
    emulated = runs[runs["runner"] == "emulation"]
    rows = []
    for _, run in runs[runs["runner"] == "engine"].iterrows():
        twins = emulated[emulated["config_key"] == run["config_key"]]
        if twins.empty:
            continue
        twin = twins.iloc[0]
        rows.append({
            "optimizer": run["optimizer"], "label": run["label"], "seed": run["seed"], "group": run["group"],
            "model": run["model"], "batch": run["batch"], "micro_batches": run["micro_batches"],
            "emulation": twin["final_val"], "engine": run["final_val"], "diff": run["final_val"] - twin["final_val"],
            "train max rel": _max_rel(run["train_steps"], run["train_loss"], twin["train_steps"], twin["train_loss"]),
            "val max rel": _max_rel(run["val_steps"], run["val_loss"], twin["val_steps"], twin["val_loss"]),
            "complete": bool(run["complete"] and twin["complete"]), "engine card": run["card"],
            "emulation card": twin["card"], "engine s/step": run["seconds_per_step"],
            "emulation s/step": twin["seconds_per_step"], "engine path": run["path"], "emulation path": twin["path"],
            "config_key": run["config_key"]})
    return pd.DataFrame(rows, columns=cols)


def seed_noise(runs: pd.DataFrame, pairs: pd.DataFrame, ref: dict | None = None) -> pd.DataFrame:
    """The seed noise of each (optimizer, label) of ``pairs``: the std over seeds (ddof 1) of the final validation
    loss of that variant in the main matrix (the runs at the reference), where the pairs sit at the reference too;
    otherwise the std over seeds of the pairs' own emulation runs (``source`` says which; NaN with one seed)."""
    rows = []
    ref = ref or (reference(runs) if len(runs) else {})
    main = at_reference(runs[runs["group"] == "main"], ref) if len(runs) else runs
    for (opt, label), part in pairs.groupby(["optimizer", "label"], sort=False):
        first = runs[runs["path"] == part.iloc[0]["engine path"]].iloc[0]
        same_point = all(first[axis] == ref.get(axis) if axis != "lr_scale"
                         else math.isclose(first[axis], ref.get(axis, math.nan)) for axis in AXES)
        base = main[(main["optimizer"] == opt) & (main["label"] == label)] if same_point else main.iloc[0:0]
        per_seed = base.groupby("seed")["final_val"].mean()
        if per_seed.count() >= 2:
            rows.append({"optimizer": opt, "label": label, "seed std": per_seed.std(ddof=1),
                         "noise seeds": int(per_seed.count()), "source": "main matrix"})
        else:
            own = part.groupby("seed")["emulation"].mean()
            rows.append({"optimizer": opt, "label": label,
                         "seed std": own.std(ddof=1) if own.count() >= 2 else math.nan,
                         "noise seeds": int(own.count()), "source": "the pairs' emulation runs"})
    return pd.DataFrame(rows, columns=["optimizer", "label", "seed std", "noise seeds", "source"])


def within_noise(diff: float, noise: float) -> str:
    """``identical``, ``within noise`` (|diff| ≤ σ), ``within 2σ``, ``outside noise`` (> 2σ), or ``no noise
    estimate``."""
    if diff is None or not math.isfinite(diff):
        return "—"
    if diff == 0:
        return "identical"
    if noise is None or not math.isfinite(noise) or noise <= 0:
        return "no noise estimate"
    ratio = abs(diff) / noise
    return "within noise" if ratio <= 1 else "within 2σ" if ratio <= 2 else "outside noise"


def engine_table(runs: pd.DataFrame, ref: dict | None = None) -> pd.DataFrame:
    """One row per engine/emulation pair (:func:`engine_pairs`) with the seed noise σ of its variant
    (:func:`seed_noise`), ``|diff| / σ`` and the verdict (:func:`within_noise`)."""
    pairs = engine_pairs(runs)
    if pairs.empty:
        return pairs.assign(**{"seed std": [], "noise seeds": [], "source": [], "|diff|/σ": [], "verdict": []})
    noise = seed_noise(runs, pairs, ref)
    out = pairs.merge(noise, on=["optimizer", "label"], how="left")
    out["|diff|/σ"] = out["diff"].abs() / out["seed std"]
    out["verdict"] = [within_noise(d, n) for d, n in zip(out["diff"], out["seed std"])]
    return out.sort_values(["optimizer", "label", "seed"], ascending=[False, True, True]).reset_index(drop=True)


VERDICTS = ("identical", "within noise", "within 2σ", "outside noise", "no noise estimate", "—")


def engine_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per (optimizer, label): the engine's and the emulation's final validation loss (mean ± std over seeds), the
    paired difference (mean, largest |diff|), the seed noise σ and the worst verdict over the seeds (strings)."""
    rows = {}
    for (opt, label), part in table.groupby(["optimizer", "label"], sort=False):
        worst = max(part["verdict"], key=VERDICTS.index)
        sigma = part["seed std"].iloc[0]
        rows[(opt, label)] = {
            "pairs": len(part), "engine": pm(part["engine"].mean(), part["engine"].std(ddof=1)),
            "emulation": pm(part["emulation"].mean(), part["emulation"].std(ddof=1)),
            "diff engine − emulation": f"{part['diff'].mean():+.4f}",
            "max |diff|": f"{part['diff'].abs().max():.4f}",
            "seed noise σ": "—" if not math.isfinite(sigma) else
            f"{sigma:.4f} ({part['source'].iloc[0]}, n={int(part['noise seeds'].iloc[0])})",
            "max |diff|/σ": "—" if not part["|diff|/σ"].notna().any() else f"{part['|diff|/σ'].max():.2f}",
            "verdict": worst, "train max rel": f"{part['train max rel'].max():.2g}",
            "card": "; ".join(dict.fromkeys(str(c) for c in part["engine card"]))}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis(["optimizer", "label"])


def provenance(runs: pd.DataFrame) -> pd.DataFrame:
    """Which cards and commits produced the runs (and whether the checkout was dirty), with run counts."""
    cols = ["runner", "group", "card", "commit", "dirty", "declared_commit", "note"]
    return (runs.assign(dirty=runs["dirty"].fillna(False)).groupby(cols, dropna=False).size().rename("runs")
            .reset_index())
