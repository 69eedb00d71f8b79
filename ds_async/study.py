"""Read the loss-curve study's runs (``launch/study.py``) and tabulate them: final validation loss per optimizer and
variant (mean ± std over seeds), the gap the delay opens, the share of it a correction recovers, and the sweeps.

A run is a folder with ``manifest.json`` and tensorboard events (``train/loss``, ``validation/loss``); every folder
below the given root that has both is read. Definitions, per optimizer, with ``sync`` the synchronous run, ``2bw``
the delayed one and ``corr`` a delayed run with a correction:

- gap = loss(2bw) − loss(sync), averaged over the seeds that have both (runs of a seed share initial weights and
  data, so the difference is paired);
- recovered share = (loss(2bw) − loss(corr)) / (loss(2bw) − loss(sync)), from the means over the seeds that have
  all three: 1 closes the gap, 0 does nothing, > 1 beats the synchronous run, < 0 makes things worse. It is noisy
  when the gap is small compared with the seed-to-seed spread of the difference (see ``gap_std``).

The engine comparison (group ``engine``, ``launch/study.py --matrix engine``): each point runs twice with the same
spec, once through the real 2BW engine (``engine = deepspeed``, one process per stage) and once through the
emulation; :func:`engine_table` pairs them by spec and sets the difference of their final validation losses against
the seed noise, the std over seeds of the same variant in the main matrix. Those runs stay out of every other table.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

# The axes a sweep varies; the others stay at the main matrix's values ("the reference").
AXES = ("model", "seq_len", "batch", "tokens", "lr_scale")
PAPER = pd.DataFrame(  # arXiv 2606.30634, 360M LLaMA on FineWeb-Edu: final validation loss
    {"sync": [2.612, 2.578], "2bw": [2.890, 2.590], "2bw+ef": [2.640, 2.583]}, index=["adamw", "muon"])


def _scalars(run_dir: Path, tag: str) -> tuple[list[int], list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return [], []
    events = acc.Scalars(tag)
    return [e.step for e in events], [e.value for e in events]


def label_of(run: dict) -> str:
    """``sync``, ``2bw``, ``2bw+ef``, ``2bw+nesterov``, ``2bw+ef λ=0.5`` (λ ≠ 1), ``pipedream p=4``."""
    base = "sync" if run["schedule"] == "1f1b" else run["schedule"]
    if run["schedule"] == "pipedream":
        base += f" p={run['stages']}"
    if run["correction"] != "none":
        base += f"+{run['correction']}"
        if run["correction"] == "ef" and run["ef_lambda"] != 1.0:
            base += f" λ={run['ef_lambda']:g}"
    return base


COLUMNS = ["path", "group", "name", "optimizer", "schedule", "stages", "correction", "ef_lambda", "label", "model",
           "seq_len", "batch", "micro_batches", "tokens", "steps", "tokens_per_step", "lr", "lr_scale", "seed",
           "engine", "world_size", "final_val", "final_train", "diverged", "complete", "card", "commit", "dirty",
           "parameters", "seconds_per_step", "val_steps", "val_loss", "train_steps", "train_loss", "config_key"]
ENGINE_GROUP = "engine"  # the engine-vs-emulation pairs: their own table, left out of the others
# What may differ between an engine run and its emulation twin; everything else in the manifest's ``run`` must match.
PAIR_FREE = ("name", "group", "engine")


def load_run(run_dir: str | Path) -> dict:
    """One run folder as a flat record: its configuration (from the manifest), provenance and curves."""
    run_dir = Path(run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    run = manifest["run"]
    val_steps, val_loss = _scalars(run_dir, "validation/loss")
    train_steps, train_loss = _scalars(run_dir, "train/loss")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    tokens_per_step = run["micro_batches"] * run["micro_batch_size"] * run["seq_len"]
    final = val_loss[-1] if val_loss else math.nan
    return {
        "path": str(run_dir), "group": run.get("group", ""), "name": run.get("name", run_dir.name),
        "optimizer": run["optimizer"], "schedule": run["schedule"], "stages": run["stages"],
        "correction": run["correction"], "ef_lambda": run["ef_lambda"], "label": label_of(run),
        "model": run["model"], "seq_len": run["seq_len"], "batch": run["micro_batches"] * run["micro_batch_size"],
        "micro_batches": run["micro_batches"], "tokens": run["tokens"], "steps": run["steps"],
        "tokens_per_step": tokens_per_step, "lr": run["lr"], "lr_scale": run["lr_scale"],
        "seed": manifest.get("seed", run["seed"]), "engine": run.get("engine", "emulation"),
        "world_size": manifest.get("world_size", 1),
        "final_val": final if math.isfinite(final) else math.nan,
        "final_train": train_loss[-1] if train_loss else math.nan,
        "diverged": bool(summary.get("diverged", not math.isfinite(final))),
        "complete": bool(summary) and (train_steps[-1] if train_steps else 0) >= run["steps"],
        "card": manifest.get("card"),
        "commit": (manifest.get("code") or {}).get("commit") or (manifest.get("provenance") or {}).get("commit"),
        "dirty": (manifest.get("code") or {}).get("dirty"), "parameters": manifest.get("model", {}).get("parameters"),
        "seconds_per_step": summary.get("seconds_per_step"),
        "val_steps": val_steps, "val_loss": val_loss, "train_steps": train_steps, "train_loss": train_loss,
        "config_key": json.dumps({k: v for k, v in run.items() if k not in PAIR_FREE}, sort_keys=True),
    }


def find_runs(root: str | Path) -> list[Path]:
    """Every folder below ``root`` (or ``root`` itself) holding ``manifest.json`` and tensorboard events."""
    root = Path(root)
    return sorted(p.parent for p in root.rglob("manifest.json") if any(p.parent.glob("events.out.tfevents.*")))


def load_runs(roots: str | Path | Iterable[str | Path]) -> pd.DataFrame:
    """All runs below ``roots`` as a DataFrame, one row per run (see :func:`load_run` for the columns)."""
    if isinstance(roots, (str, Path)):
        roots = [roots]
    rows = [load_run(p) for root in roots for p in find_runs(root)]
    return pd.DataFrame(rows, columns=COLUMNS)


def reference(runs: pd.DataFrame, group: str = "main") -> dict:
    """The main matrix's value of each sweep axis (the most common one among the ``group`` runs)."""
    base = runs[runs["group"] == group] if (runs["group"] == group).any() else runs
    return {axis: base[axis].mode().iloc[0].item() if hasattr(base[axis].mode().iloc[0], "item")
            else base[axis].mode().iloc[0] for axis in AXES}


def at_reference(runs: pd.DataFrame, ref: dict, free: str | None = None) -> pd.DataFrame:
    """The runs that sit at the reference on every axis but ``free`` (emulation runs only, outside the engine
    comparison's group)."""
    keep = np.ones(len(runs), dtype=bool)
    if "engine" in runs:
        keep &= (runs["engine"].fillna("emulation") == "emulation").to_numpy()
    if "group" in runs:
        keep &= (runs["group"] != ENGINE_GROUP).to_numpy()
    for axis, value in ref.items():
        if axis != free:
            keep &= np.isclose(runs[axis].astype(float), float(value)) if axis in ("lr_scale",) else \
                (runs[axis] == value).to_numpy()
    return runs[keep]


def final_losses(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean, std and count over seeds of the final validation loss per (optimizer, label)."""
    g = runs.groupby(["optimizer", "label"])["final_val"]
    out = pd.DataFrame({"mean": g.mean(), "std": g.std(ddof=1), "n": g.count(),
                        "diverged": runs.groupby(["optimizer", "label"])["diverged"].sum()})
    return out


def gap_table(runs: pd.DataFrame, sync: str = "sync", delayed: str = "2bw",
              corrections: Iterable[str] | None = None) -> pd.DataFrame:
    """Per optimizer: each label's mean ± std final loss, the gap ``delayed − sync`` (paired by seed) and, for each
    correction label (default: every ``delayed+...`` label present), what is left of the gap and the share
    recovered (see the module docstring)."""
    rows = {}
    for opt, sub in runs.groupby("optimizer", sort=False):
        table = sub.pivot_table(index="seed", columns="label", values="final_val", aggfunc="mean")
        row: dict = {}
        for label in table.columns:
            row[f"{label}"] = table[label].mean()
            row[f"{label} std"] = table[label].std(ddof=1)
            row[f"{label} n"] = int(table[label].count())
        if sync in table and delayed in table:
            diff = (table[delayed] - table[sync]).dropna()
            row["gap"], row["gap std"], row["gap n"] = diff.mean(), diff.std(ddof=1), int(diff.count())
            corr_labels = corrections if corrections is not None else [
                c for c in table.columns if c.startswith(delayed + "+")]
            for corr in corr_labels:
                if corr not in table:
                    continue
                both = table[[sync, delayed, corr]].dropna()
                if both.empty:
                    continue
                gap = both[delayed].mean() - both[sync].mean()
                row[f"{corr} − sync"] = both[corr].mean() - both[sync].mean()
                row[f"recovered {corr}"] = recovered_share(both[sync].mean(), both[delayed].mean(), both[corr].mean())
                row[f"recovered {corr} n"] = len(both)
                row[f"gap@{corr}"] = gap
        rows[opt] = row
    return pd.DataFrame.from_dict(rows, orient="index")


def recovered_share(sync: float, delayed: float, corrected: float) -> float:
    """(delayed − corrected) / (delayed − sync); NaN when there is no gap to recover."""
    gap = delayed - sync
    if not math.isfinite(gap) or gap == 0:
        return math.nan
    return (delayed - corrected) / gap


def common_seeds(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs of the seeds that every (optimizer, label, axis point) in ``runs`` has, so that a sweep compares
    like with like (the main point has more seeds than the sweep's); all runs if no seed is common."""
    keys = ["optimizer", "label", *AXES]
    per_point = [set(part["seed"]) for _, part in runs.groupby(keys)]
    common = set.intersection(*per_point) if per_point else set()
    return runs[runs["seed"].isin(common)] if common else runs


def sweep(runs: pd.DataFrame, axis: str, ref: dict | None = None, labels: tuple[str, ...] = ("sync", "2bw"),
          x: str | None = None) -> pd.DataFrame:
    """Final loss of ``labels`` and the gap ``labels[1] − labels[0]`` along ``axis`` (``tokens``, ``lr_scale``,
    ``batch``), the other axes at the reference, over the seeds common to all points (:func:`common_seeds`); one
    row per (optimizer, axis value). ``x`` names the column to report as the x value (e.g. ``lr`` for
    ``lr_scale``)."""
    ref = ref or reference(runs)
    sub = at_reference(runs, ref, free=axis)
    sub = common_seeds(sub[sub["label"].isin(labels)])
    rows = []
    for (opt, value), part in sub.groupby(["optimizer", axis]):
        table = part.pivot_table(index="seed", columns="label", values="final_val", aggfunc="mean")
        row = {"optimizer": opt, axis: value}
        if x and x != axis:
            row[x] = part[x].iloc[0]
        for label in labels:
            row[label] = table[label].mean() if label in table else math.nan
        if all(label in table for label in labels[:2]):
            diff = (table[labels[1]] - table[labels[0]]).dropna()
            row["gap"], row["seeds"] = diff.mean(), int(diff.count())
        rows.append(row)
    return pd.DataFrame(rows)


def depth_table(runs: pd.DataFrame, ref: dict | None = None) -> pd.DataFrame:
    """Gap vs pipeline depth: PipeDream's variable delay (``pipedream p=P``) per P next to 2BW's constant one
    (which does not depend on P); gaps against ``sync``, paired by seed, over the seeds common to all points."""
    ref = ref or reference(runs)
    sub = at_reference(runs, ref)
    sub = common_seeds(sub[sub["label"].isin(["sync", "2bw"]) | sub["label"].str.fullmatch(r"pipedream p=\d+")])
    rows = []
    for opt, part in sub.groupby("optimizer"):
        table = part.pivot_table(index="seed", columns="label", values="final_val", aggfunc="mean")
        if "sync" not in table:
            continue
        gap_2bw = (table["2bw"] - table["sync"]).dropna().mean() if "2bw" in table else math.nan
        for label in table.columns:
            if label.startswith("pipedream p=") and "+" not in label:
                diff = (table[label] - table["sync"]).dropna()
                rows.append({"optimizer": opt, "stages": int(label.split("=")[1]), "pipedream": table[label].mean(),
                             "gap pipedream": diff.mean(), "gap 2bw": gap_2bw, "seeds": int(diff.count())})
    return pd.DataFrame(rows).sort_values(["optimizer", "stages"]) if rows else pd.DataFrame(rows)


def lambda_table(runs: pd.DataFrame, ref: dict | None = None) -> pd.DataFrame:
    """EF strength: final loss and recovered share per λ (λ = 0 is plain 2BW), paired by seed with sync/2bw, over
    the seeds common to all points."""
    ref = ref or reference(runs)
    sub = at_reference(runs, ref)
    sub = sub[(sub["schedule"] == "2bw") | (sub["schedule"] == "1f1b")]
    sub = common_seeds(sub[sub["correction"].isin(["none", "ef"])])
    rows = []
    for opt, part in sub.groupby("optimizer"):
        table = part.pivot_table(index="seed", columns="label", values="final_val", aggfunc="mean")
        if not {"sync", "2bw"} <= set(table.columns):
            continue
        lams = {"2bw": 0.0, **{c: (float(c.split("=")[1]) if "λ=" in c else 1.0)
                               for c in table.columns if c.startswith("2bw+ef")}}
        for label, lam in sorted(lams.items(), key=lambda kv: kv[1]):
            both = table[["sync", "2bw", label]].dropna() if label != "2bw" else table[["sync", "2bw"]].dropna()
            rows.append({"optimizer": opt, "lambda": lam, "loss": both[label].mean(),
                         "recovered": recovered_share(both["sync"].mean(), both["2bw"].mean(), both[label].mean()),
                         "seeds": len(both)})
    return pd.DataFrame(rows)


def pm(mean: float, std: float, digits: int = 3) -> str:
    """``mean ± std`` (just the mean when std is unknown)."""
    if mean is None or not math.isfinite(mean):
        return "—"
    if std is None or not math.isfinite(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def main_table(runs: pd.DataFrame, labels: tuple[str, ...] = ("sync", "2bw", "2bw+ef", "2bw+nesterov"),
               ref: dict | None = None) -> pd.DataFrame:
    """The study's headline table at the reference point: final validation loss ``mean ± std`` per label, the gap
    and the share of it each correction recovers, one row per optimizer (strings, ready to print)."""
    ref = ref or reference(runs)
    sub = at_reference(runs, ref)
    sub = sub[sub["label"].isin(labels)]
    table = gap_table(sub)
    out = pd.DataFrame(index=table.index)
    for label in labels:
        if label in table:
            out[f"{label} (n)"] = [f"{pm(m, s)} ({int(n)})" if n == n and n > 0 else "—" for m, s, n in
                                   zip(table[label], table[f"{label} std"], table[f"{label} n"])]
    if "gap" in table:
        out["gap 2bw − sync"] = [pm(m, s) for m, s in zip(table["gap"], table["gap std"])]
    for label in labels[2:]:
        col = f"recovered {label}"
        if col in table:
            out[f"recovered by {label.split('+', 1)[1]}"] = [
                "—" if not math.isfinite(v) else f"{100 * v:.0f}% (n={int(n)})"
                for v, n in zip(table[col], table[f"{col} n"])]
    return out


def curves(runs: pd.DataFrame, metric: str = "val") -> pd.DataFrame:
    """Long table of (optimizer, label, tokens, mean, std, n) over seeds of the validation (``val``) or training
    (``train``) loss curve."""
    rows = []
    for _, run in runs.iterrows():
        for step, value in zip(run[f"{metric}_steps"], run[f"{metric}_loss"]):
            rows.append({"optimizer": run["optimizer"], "label": run["label"], "seed": run["seed"],
                         "tokens": step * run["tokens_per_step"], "loss": value})
    if not rows:
        return pd.DataFrame(columns=["optimizer", "label", "tokens", "mean", "std", "n"])
    long = pd.DataFrame(rows)
    g = long.groupby(["optimizer", "label", "tokens"])["loss"]
    return pd.DataFrame({"mean": g.mean(), "std": g.std(ddof=1), "n": g.count()}).reset_index()


def gap_curves(runs: pd.DataFrame, sync: str = "sync") -> pd.DataFrame:
    """Long table of (optimizer, label, tokens, mean, std, n): each label's validation loss minus the ``sync`` run of
    the same seed at the same step, over seeds (paired, so seed-to-seed offsets cancel)."""
    rows = []
    for (opt, seed), part in runs.groupby(["optimizer", "seed"]):
        base = part[part["label"] == sync]
        if base.empty:
            continue
        ref = dict(zip(base.iloc[0]["val_steps"], base.iloc[0]["val_loss"]))
        for _, run in part[part["label"] != sync].iterrows():
            for step, value in zip(run["val_steps"], run["val_loss"]):
                if step in ref:
                    rows.append({"optimizer": opt, "label": run["label"], "seed": seed,
                                 "tokens": step * run["tokens_per_step"], "diff": value - ref[step]})
    if not rows:
        return pd.DataFrame(columns=["optimizer", "label", "tokens", "mean", "std", "n"])
    g = pd.DataFrame(rows).groupby(["optimizer", "label", "tokens"])["diff"]
    return pd.DataFrame({"mean": g.mean(), "std": g.std(ddof=1), "n": g.count()}).reset_index()


def _grid_and_legend(axes, fontsize: int) -> None:
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=fontsize)


def _finish_pair(top, bottom, title: str, difference: str, fontsize: int) -> None:
    """Labels of a curves-over-difference panel pair (validation loss on top, a difference below, vs tokens)."""
    top.set_title(title)
    top.set_ylabel("validation loss")
    bottom.set_ylabel(difference)
    bottom.set_xlabel("training tokens (M)")
    _grid_and_legend((top, bottom), fontsize=fontsize)


def _band(ax, x, d, color, label):
    n = int(d["n"].max())
    ax.plot(x, d["mean"], color=color, marker="o", ms=2.5, label=f"{label} (n={n})")
    if n > 1:
        ax.fill_between(x, d["mean"] - d["std"], d["mean"] + d["std"], color=color, alpha=0.2)


def plot_curves(runs: pd.DataFrame, labels: tuple[str, ...] = ("sync", "2bw", "2bw+ef", "2bw+nesterov"),
                ref: dict | None = None):
    """One column per optimizer. Top: validation loss vs training tokens per label (mean over seeds, band ± std).
    Bottom: each label minus the synchronous run of the same seed (paired), where the delay's cost and the
    corrections' effect show without the seed-to-seed spread. Returns the figure."""
    import matplotlib.pyplot as plt

    ref = ref or reference(runs)
    sub = at_reference(runs, ref)
    sub = sub[sub["label"].isin(labels)]
    loss, diff = curves(sub), gap_curves(sub)
    optimizers = list(dict.fromkeys(sub["optimizer"])) or ["(no runs)"]
    fig, axes = plt.subplots(2, len(optimizers), figsize=(6 * len(optimizers), 7.5), squeeze=False,
                             sharex="col", gridspec_kw={"height_ratios": [3, 2]})
    colors = dict(zip(labels, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for col, opt in enumerate(optimizers):
        top, bottom = axes[0][col], axes[1][col]
        for label in labels:
            d = loss[(loss["optimizer"] == opt) & (loss["label"] == label)].sort_values("tokens")
            if not d.empty:
                _band(top, d["tokens"] / 1e6, d, colors[label], label)
            d = diff[(diff["optimizer"] == opt) & (diff["label"] == label)].sort_values("tokens")
            if not d.empty:
                _band(bottom, d["tokens"] / 1e6, d, colors[label], f"{label} − sync")
        bottom.axhline(0, color=colors.get("sync", "k"), lw=1)
        _finish_pair(top, bottom, opt, "Δ validation loss vs sync (same seed)", fontsize=8)
    fig.tight_layout()
    return fig


def plot_sweep(table: pd.DataFrame, x: str, xlabel: str, logx: bool = True, labels: tuple[str, ...] = ("sync", "2bw")):
    """Two panels for a :func:`sweep` table: final loss of ``labels`` vs ``x`` and the gap vs ``x``, per
    optimizer (its own x values: Muon's LRs differ from AdamW's)."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for opt, part in table.groupby("optimizer"):
        part = part.sort_values(x)
        for label, style in zip(labels, ("-", "--")):
            left.plot(part[x], part[label], style, marker="o", label=f"{opt} {label}")
        if "gap" in part:
            right.plot(part[x], part["gap"], marker="o", label=opt)
            for xv, gap, n in zip(part[x], part["gap"], part.get("seeds", [None] * len(part))):
                if n and n > 1:
                    right.annotate(f"n={n}", (xv, gap), fontsize=7, textcoords="offset points", xytext=(4, 4))
    right.axhline(0, color="k", lw=0.8)
    left.set_ylabel("final validation loss")
    right.set_ylabel(f"gap: {labels[1]} − {labels[0]}")
    for ax in (left, right):
        ax.set_xlabel(xlabel)
        if logx:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_depth(table: pd.DataFrame):
    """Gap vs pipeline depth: PipeDream (variable delay) per P, 2BW (constant delay) as a flat line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for opt, part in table.groupby("optimizer"):
        line = ax.plot(part["stages"], part["gap pipedream"], marker="o", label=f"{opt} PipeDream")[0]
        ax.plot(part["stages"], part["gap 2bw"], "--", color=line.get_color(), label=f"{opt} 2BW")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pipeline stages p")
    ax.set_ylabel("gap vs sync (final validation loss)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_lambda(table: pd.DataFrame):
    """Share of the 2BW gap recovered by EF vs λ (0 = no correction)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for opt, part in table.groupby("optimizer"):
        ax.plot(part["lambda"], 100 * part["recovered"], marker="o", label=opt)
    ax.axhline(100, color="k", lw=0.8, ls=":")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("EF λ")
    ax.set_ylabel("gap recovered (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------------------
# The real engine vs the emulation


def _max_rel(a_steps, a_vals, b_steps, b_vals) -> float:
    """Largest relative difference of two curves over their common steps (NaN when they share none)."""
    b = dict(zip(b_steps, b_vals))
    rel = [abs(v - b[s]) / abs(b[s]) for s, v in zip(a_steps, a_vals) if s in b and b[s] != 0]
    return max(rel) if rel else math.nan


def engine_pairs(runs: pd.DataFrame) -> pd.DataFrame:
    """Each engine run (``engine != "emulation"``) next to the emulation run of the same spec (equal manifest
    ``run`` sections but for name, group and engine): their final validation losses, the difference
    ``engine − emulation``, and how far apart the whole curves are (largest relative difference over the training
    steps and the validation points)."""
    cols = ["optimizer", "label", "seed", "model", "batch", "micro_batches", "emulation", "engine", "diff",
            "train max rel", "val max rel", "complete", "engine card", "emulation card", "engine s/step",
            "emulation s/step", "engine path", "emulation path", "config_key"]
    if "engine" not in runs or runs.empty:
        return pd.DataFrame(columns=cols)
    emulated = runs[runs["engine"] == "emulation"]
    rows = []
    for _, run in runs[runs["engine"] != "emulation"].iterrows():
        twins = emulated[emulated["config_key"] == run["config_key"]]
        if twins.empty:
            continue
        twin = twins.iloc[0]
        rows.append({
            "optimizer": run["optimizer"], "label": run["label"], "seed": run["seed"], "model": run["model"],
            "batch": run["batch"], "micro_batches": run["micro_batches"], "emulation": twin["final_val"],
            "engine": run["final_val"], "diff": run["final_val"] - twin["final_val"],
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
    main = at_reference(runs, ref) if len(runs) else runs
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


def plot_engine(runs: pd.DataFrame, ref: dict | None = None):
    """One column per (optimizer, label) of the engine pairs. Top: validation loss of each seed through the engine
    (solid) and the emulation (dashed), over the main matrix's mean ± std band of that variant (grey). Bottom:
    engine − emulation per seed against ± the main matrix's seed std at each point (grey). Returns the figure."""
    import matplotlib.pyplot as plt

    table = engine_table(runs, ref)
    points = list(dict.fromkeys(zip(table["optimizer"], table["label"]))) or [("(no engine runs)", "")]
    ref = ref or (reference(runs) if len(runs) else {})
    main = curves(at_reference(runs, ref)) if len(runs) else curves(runs)
    fig, axes = plt.subplots(2, len(points), figsize=(5.5 * len(points), 7), squeeze=False, sharex="col",
                             gridspec_kw={"height_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    by_path = runs.set_index("path") if len(runs) else runs
    for col, (opt, label) in enumerate(points):
        top, bottom = axes[0][col], axes[1][col]
        band = main[(main["optimizer"] == opt) & (main["label"] == label)].sort_values("tokens")
        part = table[(table["optimizer"] == opt) & (table["label"] == label)]
        if not band.empty and len(part) and part["source"].iloc[0] == "main matrix":
            x, lo, hi = band["tokens"] / 1e6, band["mean"] - band["std"], band["mean"] + band["std"]
            top.fill_between(x, lo, hi, color="grey", alpha=0.25,
                             label=f"main matrix ± std (n={int(band['n'].max())})")
            bottom.fill_between(x, -band["std"], band["std"], color="grey", alpha=0.25, label="± seed std")
        for k, (_, pair) in enumerate(part.iterrows()):
            color = colors[k % len(colors)]
            eng, emu = by_path.loc[pair["engine path"]], by_path.loc[pair["emulation path"]]
            tps = eng["tokens_per_step"] / 1e6
            top.plot([s * tps for s in eng["val_steps"]], eng["val_loss"], "-", color=color, marker="o", ms=3,
                     label=f"seed {pair['seed']} engine")
            top.plot([s * tps for s in emu["val_steps"]], emu["val_loss"], "--", color=color, marker="x", ms=4,
                     label=f"seed {pair['seed']} emulation")
            twin = dict(zip(emu["val_steps"], emu["val_loss"]))
            steps = [s for s in eng["val_steps"] if s in twin]
            bottom.plot([s * tps for s in steps],
                        [v - twin[s] for s, v in zip(eng["val_steps"], eng["val_loss"]) if s in twin],
                        color=color, marker="o", ms=3, label=f"seed {pair['seed']}")
        bottom.axhline(0, color="k", lw=0.8)
        _finish_pair(top, bottom, f"{opt} {label}", "engine − emulation", fontsize=7)
    fig.tight_layout()
    return fig


def provenance(runs: pd.DataFrame) -> pd.DataFrame:
    """Which cards and commits produced the runs (and whether the checkout was dirty), with run counts."""
    return (runs.assign(dirty=runs["dirty"].fillna(False)).groupby(["card", "commit", "dirty"], dropna=False)
            .size().rename("runs").reset_index())


def execute_notebook(path: str | Path, runs_dir: str | Path, timeout: int = 600) -> None:
    """Run ``path`` top to bottom on the runs under ``runs_dir`` and save it in place with its outputs."""
    import os

    import nbclient
    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    old = os.environ.get("DS_ASYNC_RUNS")
    os.environ["DS_ASYNC_RUNS"] = str(Path(runs_dir).resolve())
    try:
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if old is None:
            os.environ.pop("DS_ASYNC_RUNS", None)
        else:
            os.environ["DS_ASYNC_RUNS"] = old
    nbformat.write(nb, path)


def main(argv: list[str] | None = None) -> None:
    """``python -m ds_async.study RUNS [--notebook notebooks/loss_curves.ipynb]``: print the table of the runs under
    RUNS and, with ``--notebook``, execute the notebook on them in place."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ds_async.study", description=main.__doc__)
    parser.add_argument("runs", help="folder holding the run folders (searched recursively)")
    parser.add_argument("--notebook", help="execute this notebook on RUNS and save it with its outputs")
    args = parser.parse_args(argv)
    runs = load_runs(args.runs)
    print(f"{len(runs)} runs under {args.runs}")
    if len(runs):
        with pd.option_context("display.width", 200, "display.max_columns", 20):
            table = main_table(runs)
            if len(table.columns):
                print(table.to_string())
            engine = engine_table(runs)
            if len(engine):
                print("\nThe real engine vs the emulation (final validation loss, same spec and seed):")
                print(engine_summary(engine).to_string())
    if args.notebook:
        execute_notebook(args.notebook, args.runs)
        print(f"executed {args.notebook} on {args.runs}")


if __name__ == "__main__":
    main()
