"""The short study's tables (the main matrix, its sweeps, depth, EF's lambda, Nesterov, curves) and the formatting
every table of the results page shares (:func:`markdown`, :func:`formatted`, :func:`ran_line`).

Definitions, per optimizer, with ``sync`` the synchronous run, ``2bw`` the delayed one and ``corr`` a delayed run
with a correction: gap = loss(2bw) − loss(sync), averaged over the seeds that have both (runs of a seed share
initial weights and data, so the difference is paired); recovered share = (loss(2bw) − loss(corr)) /
(loss(2bw) − loss(sync)) from the means over the seeds that have all three (1 closes the gap, 0 does nothing).

Intervals are 95% and paired by seed, with Student's t at n − 1 degrees of freedom (none below two seeds). A gap's
is the t interval of the mean of its per-seed differences. A recovered share's is the delta method's for the ratio
of the two paired means, R = mean(a) / mean(b) with a = loss(2bw) − loss(corr) and b = loss(2bw) − loss(sync) per
seed: the t interval of the mean of a − R·b, divided by |mean(b)| (:func:`share_interval`). It is centred on the
share the tables show (the ratio of the means, not a mean of per-seed ratios, which a seed with a small gap would
swing) and uses the same seeds and quantile as the gaps.
Input: the rows of :mod:`ds_async.study.rows`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

from .rows import AXES, ENGINE_GROUP

# Two-sided 95% quantiles of Student's t by degrees of freedom (1.96 beyond the table).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def paired_interval(diff: pd.Series) -> float:
    """Half-width of the 95% t interval of the mean of paired differences (NaN below two pairs)."""
    diff = diff.dropna()
    n = len(diff)
    if n < 2:
        return math.nan
    return T975.get(n - 1, 1.96) * diff.std(ddof=1) / math.sqrt(n)


def share_interval(sync: pd.Series, delayed: pd.Series, corrected: pd.Series) -> float:
    """Half-width of the 95% interval of the recovered share of per-seed losses (aligned by seed, all present): the
    delta method's for the ratio of paired means (module docstring); NaN below two seeds or without a gap."""
    a, b = delayed - corrected, delayed - sync
    share = recovered_share(sync.mean(), delayed.mean(), corrected.mean())
    if len(b) < 2 or not math.isfinite(share):
        return math.nan
    return paired_interval(a - share * b) / abs(b.mean())


def gap_stats(diff: pd.Series) -> tuple[float, float, int]:
    """Paired differences (NaN left out) as a gap: their mean, the 95% interval's half-width
    (:func:`paired_interval`) and n; the mean is NaN without a pair."""
    diff = diff.dropna()
    return diff.mean(), paired_interval(diff), len(diff)


def gap_with_interval(mean: float, half: float, n: int) -> str:
    """A gap's cell: ``+m ± h (n=N)``, or ``+m (n=N, no interval)``; a dash without a gap."""
    if not math.isfinite(mean):
        return "—"
    return f"{mean:+.3f} ± {half:.3f} (n={n})" if math.isfinite(half) else f"{mean:+.3f} (n={n}, no interval)"


def share_cell(seeds: pd.DataFrame, sync: str = "sync", delayed: str = "2bw", corrected: str = "2bw+ef") -> str:
    """A recovered share's cell from per-seed losses (a frame by seed with the three columns, rows without all three
    left out): ``S% ± H% (n=N)``, or ``S% (n=N, no interval)``; a dash without a share."""
    both = seeds[[sync, delayed, corrected]].dropna()
    share = recovered_share(*(both[c].mean() for c in (sync, delayed, corrected)))
    return share_text(share, share_interval(both[sync], both[delayed], both[corrected]), len(both))


def share_text(share: float, half: float, n: int) -> str:
    """A recovered share with its interval's half-width and n as a cell, in percent (a dash without a share)."""
    if not math.isfinite(share):
        return "—"
    return f"{100 * share:.0f}% ± {100 * half:.0f}% (n={n})" if math.isfinite(half) else \
        f"{100 * share:.0f}% (n={n}, no interval)"


# ---------------------------------------------------------------------------------------------------------------
# Tables


def reference(runs: pd.DataFrame, group: str = "main") -> dict:
    """The main matrix's value of each sweep axis (the most common one among the ``group`` runs)."""
    base = runs[runs["group"] == group] if (runs["group"] == group).any() else runs
    out = {}
    for axis in AXES:
        value = base[axis].mode().iloc[0]
        out[axis] = value.item() if hasattr(value, "item") else value
    return out


def reference_parameters(runs: pd.DataFrame, ref: dict) -> int:
    """The parameters of the reference's model (the long groups hold a Mixtral beside the dense model)."""
    return runs.loc[runs["model"] == ref["model"], "parameters"].dropna().iloc[0]


def at_reference(runs: pd.DataFrame, ref: dict, free: str | None = None) -> pd.DataFrame:
    """The runs that sit at the reference on every axis but ``free`` (emulation runs only, outside the engine
    comparison's group)."""
    keep = np.ones(len(runs), dtype=bool)
    if "runner" in runs:
        keep &= (runs["runner"].fillna("emulation") == "emulation").to_numpy()
    if "group" in runs:
        keep &= (runs["group"] != ENGINE_GROUP).to_numpy()
    for axis, value in ref.items():
        if axis != free:
            keep &= np.isclose(runs[axis].astype(float), float(value)) if axis in ("lr_scale",) else \
                (runs[axis] == value).to_numpy()
    return runs[keep]


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
                row[f"{corr} − sync"] = both[corr].mean() - both[sync].mean()
                row[f"recovered {corr}"] = recovered_share(both[sync].mean(), both[delayed].mean(), both[corr].mean())
                row[f"recovered {corr} n"] = len(both)
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
    """Final loss of ``labels`` and the gap ``labels[1] − labels[0]`` (with its interval's half-width, ``gap half``)
    along ``axis`` (``tokens``, ``lr_scale``, ``batch``), the other axes at the reference, over the seeds common to
    all points (:func:`common_seeds`); one row per (optimizer, axis value). ``x`` names the column to report as the x
    value (e.g. ``lr``)."""
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
            row["gap"], row["gap half"], row["seeds"] = gap_stats(table[labels[1]] - table[labels[0]])
        rows.append(row)
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=["optimizer", axis])


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
    """EF strength: final loss and recovered share per λ (λ = 0 is plain 2BW) with its interval's half-width
    (:func:`share_interval`), paired by seed with sync/2bw, over the seeds common to all points."""
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
                         "recovered half": share_interval(both["sync"], both["2bw"], both[label]),
                         "seeds": len(both)})
    return pd.DataFrame(rows)


def pm(mean: float, std: float, digits: int = 3) -> str:
    """``mean ± std`` (just the mean when std is unknown)."""
    if mean is None or not math.isfinite(mean):
        return "—"
    if std is None or not math.isfinite(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def paired_diff(seeds: pd.DataFrame, delayed: str = "2bw", sync: str = "sync") -> pd.Series:
    """``delayed`` − ``sync`` per seed from per-seed losses (a frame by seed with those columns), over the seeds that
    have both; empty without such a seed."""
    if not {sync, delayed} <= set(seeds):
        return pd.Series(dtype=float)
    return (seeds[delayed] - seeds[sync]).dropna()


def paired_gap_cell(seeds: pd.DataFrame, delayed: str = "2bw", sync: str = "sync") -> str:
    """:func:`paired_diff` as :func:`gap_with_interval`'s cell; a dash without a seed that has both."""
    return gap_with_interval(*gap_stats(paired_diff(seeds, delayed, sync)))


def main_table(runs: pd.DataFrame, labels: tuple[str, ...] = ("sync", "2bw", "2bw+ef", "2bw+nesterov"),
               ref: dict | None = None) -> pd.DataFrame:
    """The study's headline table at the reference point: final validation loss ``mean ± std (n)`` per label, the gap
    paired by seed with its 95% interval and n, and the share of it each correction recovers with its interval, one
    row per optimizer (strings, ready to print)."""
    ref = ref or reference(runs)
    sub = at_reference(runs, ref)
    sub = sub[sub["label"].isin(labels)]
    table = gap_table(sub)
    out = pd.DataFrame(index=table.index.rename("optimizer"))
    for label in labels:
        if label in table:
            out[f"{label} (n)"] = [f"{pm(m, s)} ({int(n)})" if n == n and n > 0 else "—" for m, s, n in
                                   zip(table[label], table[f"{label} std"], table[f"{label} n"])]
    seeds = {opt: part.pivot_table(index="seed", columns="label", values="final_val", aggfunc="mean")
             for opt, part in sub.groupby("optimizer", sort=False)}
    if "gap" in table:
        out["gap 2bw − sync"] = [paired_gap_cell(seeds[opt]) for opt in out.index]
    for label in labels[2:]:
        if f"recovered {label}" in table:
            out[f"recovered by {label.split('+', 1)[1]}"] = [
                share_cell(seeds[opt], corrected=label) if {"sync", "2bw", label} <= set(seeds[opt]) else "—"
                for opt in out.index]
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
    g = pd.DataFrame(rows).groupby(["optimizer", "label", "tokens"])["loss"]
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


def markdown(table: pd.DataFrame, index: bool = True) -> str:
    """A pipe table of ``table``'s cells as strings (floats with 3 decimals)."""
    t = table.reset_index() if index else table

    def cell(v) -> str:
        if isinstance(v, float):
            return "—" if not math.isfinite(v) else f"{v:.3f}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(str(c) for c in t.columns) + " |", "|" + "---|" * len(t.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in t.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def ran_line(runs: pd.DataFrame) -> str:
    """One line saying which runs a table rests on: count, runner, card, commits and the command that ran them (one
    process per GPU shown as ``--gpu-index i``)."""
    parts = []
    command = runs["command"].fillna("").str.replace(r"--gpu-index \d+ ", "--gpu-index i ", regex=True)
    keys = ["runner", "card", "commit", "declared_commit", "dirty"]
    for (runner, card, commit, declared, dirty, cmd), part in runs.assign(command=command).groupby(
            keys + ["command"], dropna=False, sort=False):
        what = f"{len(part)} {runner} run{'s' if len(part) > 1 else ''} on {card}, commit {str(commit)[:7]}"
        if dirty:
            what += " (dirty tree)"
        if isinstance(declared, str) and declared and not str(commit).startswith(declared):
            what += f" declared as {declared}"
        parts.append(f"{what}: `{cmd}`")
    return "Ran: " + "; ".join(parts) + ".\n"


def formatted(table: pd.DataFrame, digits: dict) -> pd.DataFrame:
    """``table`` with the columns of ``digits`` as strings: an int is decimals, ``"+3"`` signed, ``"%"`` a share,
    anything else a format spec; "—" where a value is missing or not finite."""
    out = table.copy()
    for col, d in digits.items():
        if col in out:
            out[col] = [("—" if not (isinstance(v, (int, float)) and math.isfinite(v)) else
                         f"{100 * v:.0f}%" if d == "%" else f"{v:+.{d[1:]}f}" if str(d).startswith("+") else
                         f"{v:.{d}f}" if isinstance(d, int) else f"{v:{d}}") for v in out[col]]
    return out
