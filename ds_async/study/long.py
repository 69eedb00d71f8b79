"""The study at a real length (``long.json``: 20 tokens per parameter): its tables (the gap against length, the LR
sweeps, each variant at its own best LR, EF's strength against the LR, PipeDream's variable delay, the MoE), with
paired intervals over seeds, and the bullets that state their numbers. Input: the rows of
:mod:`ds_async.study.rows`; the definitions are :mod:`ds_async.study.tables`'.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .rows import PAPER
from .tables import (at_reference, formatted, gap_table, markdown, ran_line, recovered_share, reference,
                     reference_parameters, sweep)


# ---------------------------------------------------------------------------------------------------------------
# The study at a real length (long.json: 20 tokens per parameter)

LONG_GROUPS = ("long", "long-tuned", "long-lr", "long-async-lr", "long-own-lr", "long-lengths", "long-lambda",
               "long-delay", "long-moe", "long-moe-ns")
LR_GROUPS = ("long", "long-tuned", "long-lr", "long-async-lr", "long-own-lr")
"""The groups whose runs sit on long.json's LR axis at its full length."""
MAIN_GROUPS = ("long", "long-tuned")
"""The multi-seed points at full length: long.json's own peak LRs, and Muon at its sync-tuned one."""
# Two-sided 95% quantiles of Student's t by degrees of freedom (1.96 beyond the table).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def paired_interval(diff: pd.Series) -> float:
    """Half-width of the 95% t interval of the mean of paired differences (NaN below two pairs)."""
    diff = diff.dropna()
    n = len(diff)
    if n < 2:
        return math.nan
    return T975.get(n - 1, 1.96) * diff.std(ddof=1) / math.sqrt(n)


def gap_with_interval(mean: float, half: float, n: int) -> str:
    if not math.isfinite(mean):
        return "—"
    return f"{mean:+.3f} ± {half:.3f} (n={n})" if math.isfinite(half) else f"{mean:+.3f} (n={n}, no interval)"


def _lr_key(lr: float) -> float:
    return float(f"{lr:.6g}")


def lr_sweep(runs: pd.DataFrame) -> pd.DataFrame:
    """The full-length LR sweep (``LR_GROUPS``): sync, 2bw and 2bw+ef at each peak LR, seed 0, the sweeps' one seed
    (a main point's other seeds would mix in while some point lacks them)."""
    ref = reference(runs, group="long")
    sub = runs[runs["group"].isin(LR_GROUPS) & (runs["seed"] == 0)]
    return sweep(sub, "lr_scale", ref, labels=LR_LABELS, x="lr")


def sync_tuned_lr(runs: pd.DataFrame) -> dict[str, float]:
    """Each optimizer's best sync peak LR over the full-length LR sweep (:func:`lr_sweep`, seed 0), for the
    optimizers whose sweep has two or more LRs."""
    t = lr_sweep(runs)
    t = t.dropna(subset=["sync"]) if "sync" in t else t
    return {opt: _lr_key(part.loc[part["sync"].idxmin(), "lr"]) for opt, part in t.groupby("optimizer")
            if len(part) >= 2}


def lr_points(runs: pd.DataFrame) -> pd.DataFrame:
    """Every seed's run on long.json's LR axis at its full length (``LR_GROUPS``, at ``long``'s reference on the
    other axes), its ``lr`` keyed for comparing (:func:`_lr_key`)."""
    sub = at_reference(runs[runs["group"].isin(LR_GROUPS)], reference(runs, group="long"), free="lr_scale")
    return sub.assign(lr=[_lr_key(v) for v in sub["lr"]])


def main_points(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs at the full length's multi-seed points (each optimizer and peak LR that ``MAIN_GROUPS`` ran, and
    each optimizer's sync-tuned LR), from every LR group: an LR sweep's seed-0 run at such a point is that point's
    seed 0."""
    sub = lr_points(runs)
    main = sub[sub["group"].isin(MAIN_GROUPS)]
    keys = set(zip(main["optimizer"], main["lr"])) | set(sync_tuned_lr(runs).items())
    return sub[[k in keys for k in zip(sub["optimizer"], sub["lr"])]]


def long_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per optimizer and peak LR at the full length's multi-seed points (:func:`main_points`; the LR sync's sweep
    puts best is marked): each variant's final validation loss (mean over seeds, n), the gaps of 2bw and 2bw+ef to
    sync paired by seed with their 95% intervals, and the share of the gap EF recovers."""
    tuned = sync_tuned_lr(runs)
    rows = [{"optimizer": opt, "lr": f"{lr:g}" + (" (sync's best)" if tuned.get(opt) == lr else ""),
             **variant_cells(part)}
            for (opt, lr), part in main_points(runs).groupby(["optimizer", "lr"], sort=True)]
    return pd.DataFrame(rows, columns=["optimizer", "lr", *VARIANT_CELLS])


VARIANT_CELLS = ("sync", "2bw", "2bw+ef", "2bw − sync", "2bw+ef − sync", "recovered by ef")


def variant_cells(runs: pd.DataFrame) -> dict[str, str]:
    """One point's sync, 2bw and 2bw+ef as table cells: each final loss (mean over seeds, n), the gaps to sync paired
    by seed with their 95% intervals, and the share of the gap EF recovers (over the seeds that have all three)."""
    table = runs.pivot_table(index="seed", columns="label", values="final_val", aggfunc="mean")
    row = {label: f"{table[label].mean():.3f} ({int(table[label].count())})" if label in table else "—"
           for label in ("sync", "2bw", "2bw+ef")}
    for label in ("2bw", "2bw+ef"):
        diff = (table[label] - table["sync"]).dropna() if {"sync", label} <= set(table) else pd.Series([])
        row[f"{label} − sync"] = (gap_with_interval(diff.mean(), paired_interval(diff), len(diff)) if len(diff)
                                  else "—")
    row["recovered by ef"] = "—"
    if {"sync", "2bw", "2bw+ef"} <= set(table.columns):
        both = table[["sync", "2bw", "2bw+ef"]].dropna()
        share = recovered_share(*(both[c].mean() for c in ("sync", "2bw", "2bw+ef")))
        if math.isfinite(share):
            row["recovered by ef"] = f"{100 * share:.0f}% (n={len(both)})"
    return row


MOE_GROUPS = {"long-moe": "one matrix per expert", "long-moe-ns": "gate and up apart"}
"""The MoE study's groups by how Muon orthogonalises each expert's fused ``gate_up_proj`` (``split_gate_up``)."""
PAPER_MOE = {"sync": 1.906, "2bw": 1.911, "2bw+ef": 1.906}  # arXiv 2606.30634's 10B MoE, final validation loss


def moe_table(runs: pd.DataFrame) -> pd.DataFrame:
    """The Mixtral study (long_moe.json, Muon) per way of orthogonalising the experts' ``gate_up_proj``: the
    :func:`variant_cells` of sync, 2bw and 2bw+ef; then the paper's 10B MoE for comparison."""
    rows = [{"gate_up_proj": mode, **variant_cells(runs[runs["group"] == group])}
            for group, mode in MOE_GROUPS.items() if (runs["group"] == group).any()]
    paper = {**{k: f"{v:.3f}" for k, v in PAPER_MOE.items()},
             "2bw − sync": f"{PAPER_MOE['2bw'] - PAPER_MOE['sync']:+.3f}",
             "2bw+ef − sync": f"{PAPER_MOE['2bw+ef'] - PAPER_MOE['sync']:+.3f}",
             "recovered by ef": f"{100 * recovered_share(*PAPER_MOE.values()):.0f}%"}
    return pd.DataFrame([*rows, {"gate_up_proj": "paper, 10B MoE", **paper}], columns=["gate_up_proj", *VARIANT_CELLS])


def moe_choice(runs: pd.DataFrame) -> str:
    """The fused-vs-split choice by the rule docs/DESIGN.md fixed before the runs ("Muon on fused expert matrices"):
    split unless fused trains better, for sync and for 2bw+ef alike, by more than the spread (max − min) of fused's
    own seeds; seed 0 of each compared. Undecided while either side lacks those runs or fused has one seed."""
    fused, split = (runs[(runs["group"] == g) & ~runs["diverged"].astype(bool)] for g in MOE_GROUPS)  # that order
    labels = ("sync", "2bw+ef")
    loss = {(name, label): part.loc[(part["label"] == label) & (part["seed"] == 0), "final_val"].mean()
            for name, part in (("fused", fused), ("split", split)) for label in labels}
    seeds = {label: fused.loc[fused["label"] == label, "final_val"] for label in labels}
    if not all(math.isfinite(v) for v in loss.values()) or min(len(v) for v in seeds.values()) < 2:
        return ("- **gate_up_proj:** undecided until both ways have sync and 2BW + EF at seed 0 and fused has 2+ "
                "seeds.\n")
    margin = {label: loss[("split", label)] - loss[("fused", label)] for label in labels}
    spread = {label: seeds[label].max() - seeds[label].min() for label in labels}
    fused_wins = all(margin[label] > spread[label] for label in labels)
    said = "; ".join(f"{label} {margin[label]:+.3f} (fused seeds' spread {spread[label]:.3f})" for label in labels)
    return (f"- **gate_up_proj:** split − fused at seed 0: {said}. By the rule fixed before the runs: "
            + ("fused (one matrix per expert) stays the default" if fused_wins else
               "split (gate and up apart) becomes the default") + ".\n")


def moe_block(runs: pd.DataFrame) -> str:
    """The results page's MoE table (:func:`moe_table`), the fused-vs-split choice (:func:`moe_choice`), what ran
    and its training clock (:func:`clock_line`)."""
    moe = runs[runs["group"].isin(list(MOE_GROUPS))]
    if moe.empty:
        return "Not run yet.\n"
    clock = clock_line(moe)
    return markdown(moe_table(moe), index=False) + "\n" + moe_choice(moe) + "\n" + ran_line(moe) + (
        "\n" + clock if clock else "")


def headline_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Per optimizer, the full-length point the findings quote: its sync-tuned LR once that point has sync and 2bw
    runs, else long.json's own LR (``long``'s runs)."""
    tuned, points = sync_tuned_lr(runs), main_points(runs)
    parts = []
    for opt, own in runs[runs["group"] == "long"].groupby("optimizer", sort=False):
        at = points[(points["optimizer"] == opt) & (points["lr"] == tuned.get(opt))]
        parts.append(at if {"sync", "2bw"} <= set(at["label"]) else own)
    return pd.concat(parts) if parts else runs.iloc[0:0]


def length_sweep(runs: pd.DataFrame, ref: dict) -> pd.DataFrame:
    """:func:`sweep` along ``tokens`` for each optimizer on its own: the seeds common to all of one optimizer's
    lengths, so that one optimizer's missing seed does not drop the other's from its curve."""
    parts = [sweep(part, "tokens", ref) for _, part in runs.groupby("optimizer", sort=True)]
    return pd.concat(parts, ignore_index=True) if parts else sweep(runs, "tokens", ref)


def length_table(runs: pd.DataFrame) -> pd.DataFrame:
    """The gap against training length: sync and 2bw at each length (own LR schedule each), in tokens per
    parameter, paired by seed over the seeds common to the optimizer's lengths (:func:`length_sweep`); the long
    matrix's runs are the longest point."""
    ref = reference(runs, group="long")
    t = length_sweep(runs, ref)
    params = reference_parameters(runs, ref)
    t.insert(2, "tokens/param", [v / params for v in t["tokens"]])
    t["tokens"] = [f"{v / 1e6:.0f}M" for v in t["tokens"]]
    return formatted(t, {"tokens/param": 2, "sync": 3, "2bw": 3, "gap": "+3"})


def clock_line(runs: pd.DataFrame) -> str:
    """What the runs' training clocks (``summary.json``'s ``seconds``, compiling included) give, per card:
    runs, the range of tokens/s and of minutes a run; empty when no run has a clock."""
    parts = []
    for card, part in runs.dropna(subset=["seconds_per_step"]).groupby("card", sort=True):
        rate = part["tokens_per_step"] / part["seconds_per_step"] / 1e6
        minutes = part["seconds_per_step"] * part["steps"] / 60
        parts.append(f"{card}, {len(part)} run{'s' if len(part) > 1 else ''}: {rate.min():.2f}–{rate.max():.2f}M "
                     f"tokens/s, {minutes.min():.1f}–{minutes.max():.1f} min a run")
    return ("Training clock (each run's summary `seconds`, compiling included): " + "; ".join(parts) + ".\n"
            if parts else "")


def seed_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Each seed's own figures along the gap-against-length curve (long.json's point and its lengths, the other
    axes at the reference), which the length and long tables average: per optimizer and length, ``2bw − sync`` and,
    where the length has 2bw+ef runs, ``2bw+ef − sync`` and the share EF recovers; one column per seed (numbers,
    NaN where a seed lacks a run)."""
    ref = reference(runs, group="long")
    sub = at_reference(runs, ref, free="tokens")
    params = reference_parameters(runs, ref)
    seeds = sorted(int(s) for s in sub["seed"].unique())
    rows = []
    for (opt, tokens), part in sub.groupby(["optimizer", "tokens"]):
        t = part.pivot_table(index="seed", columns="label", values="final_val", aggfunc="mean")
        if not {"sync", "2bw"} <= set(t.columns):
            continue
        figures = {"2bw − sync": t["2bw"] - t["sync"]}
        if "2bw+ef" in t:
            figures["2bw+ef − sync"] = t["2bw+ef"] - t["sync"]
            figures["recovered by ef"] = pd.Series({k: recovered_share(*t.loc[k, ["sync", "2bw", "2bw+ef"]])
                                                    for k in t.index})
        for figure, values in figures.items():
            rows.append({"optimizer": opt, "tokens/param": tokens / params, "figure": figure,
                         **{f"seed {s}": values.get(s, math.nan) for s in seeds}})
    return pd.DataFrame(rows, columns=["optimizer", "tokens/param", "figure", *(f"seed {s}" for s in seeds)])


def seed_markdown(table: pd.DataFrame) -> str:
    """:func:`seed_table` as the results page shows it: gaps to 3 decimals, shares in percent."""
    out = table.astype(object)
    for col in [c for c in table.columns if c.startswith("seed ")]:
        out[col] = [("—" if not math.isfinite(v) else f"{100 * v:.0f}%" if fig.startswith("recovered")
                     else f"{v:+.3f}") for v, fig in zip(table[col], table["figure"])]
    out["tokens/param"] = [f"{v:.2f}" for v in table["tokens/param"]]
    return markdown(out, index=False)


LR_LABELS = ("sync", "2bw", "2bw+ef")


def long_lr_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Final loss against the peak LR at long.json's point (Muon: both of its rates scaled) for sync, 2BW and
    2BW + EF, seed 0 (:func:`lr_sweep`); the gap is 2BW − sync at the same LR."""
    t = lr_sweep(runs).drop(columns=["lr_scale"])
    return formatted(t, {"lr": "g", "sync": 3, "2bw": 3, "2bw+ef": 3, "gap": "+3", "seeds": "g"})


def own_best_lr(runs: pd.DataFrame) -> pd.DataFrame:
    """Each optimizer's sync, 2BW and 2BW + EF at the best peak LR each has run (``LR_GROUPS``, seed 0 where
    the sweep is): the LR, the loss, how many LRs were tried and whether the best lies inside them."""
    t = lr_sweep(runs)
    rows = []
    for opt, part in t.groupby("optimizer"):
        for label in LR_LABELS:
            tried = part.dropna(subset=[label]).sort_values("lr") if label in part else part.iloc[0:0]
            if tried.empty:
                continue
            best = tried.loc[tried[label].idxmin()]
            rows.append({"optimizer": opt, "label": label, "lr": best["lr"], "loss": best[label],
                         "lrs": len(tried), "inside": tried["lr"].iloc[0] < best["lr"] < tried["lr"].iloc[-1]})
    return pd.DataFrame(rows, columns=["optimizer", "label", "lr", "loss", "lrs", "inside"])


OWN_BEST_CELLS = ("optimizer", "variant", "lr", "loss", "gap to sync's best", "gap at sync's lr")


def own_best_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Sync at its best peak LR and each async variant at its own (:func:`own_best_lr`: seed 0's sweep), with every
    seed each has there (``LR_GROUPS``): the LR (with its multiple of sync's, and ``edge`` where the sweep does not
    bracket it), the final loss (mean, n), the gap to sync's best paired by seed with its 95% interval, and beside
    it the same variant's gap at sync's LR (the paper's protocol)."""
    sub = lr_points(runs)

    def at(opt: str, label: str, lr: float) -> pd.Series:
        part = sub[(sub["optimizer"] == opt) & (sub["label"] == label) & (sub["lr"] == _lr_key(lr))]
        return part.groupby("seed")["final_val"].mean()

    def gap(losses: pd.Series, sync: pd.Series) -> str:
        diff = (losses - sync).dropna()
        return gap_with_interval(diff.mean(), paired_interval(diff), len(diff)) if len(diff) else "—"

    rows = []
    for opt, part in own_best_lr(runs).groupby("optimizer"):
        best = part.set_index("label")
        if "sync" not in best.index:
            continue
        sync_lr = best.loc["sync", "lr"]
        sync = at(opt, "sync", sync_lr)
        for label, r in best.iterrows():
            own = at(opt, label, r["lr"])
            marks = [f"×{r['lr'] / sync_lr:g}"] if label != "sync" else []
            marks += [] if r["inside"] else ["edge"]
            rows.append({"optimizer": opt, "variant": label,
                         "lr": f"{r['lr']:g}" + (f" ({', '.join(marks)})" if marks else ""),
                         "loss": f"{own.mean():.3f} ({len(own)})",
                         "gap to sync's best": "—" if label == "sync" else gap(own, sync),
                         "gap at sync's lr": "—" if label == "sync" else gap(at(opt, label, sync_lr), sync)})
    return pd.DataFrame(rows, columns=list(OWN_BEST_CELLS))


def long_findings(runs: pd.DataFrame, short: pd.DataFrame | None = None) -> str:
    """The results page's reading of the real-length runs as bullets, every number computed from ``runs`` (the
    long groups), ``short`` (the short study's main matrix, for its gap) and :data:`PAPER`."""
    ref = reference(runs, group="long")
    lengths = length_sweep(runs[runs["group"].isin(["long", "long-lengths"])], ref)
    params = reference_parameters(runs, ref)
    full = headline_runs(runs)
    table = gap_table(full)
    tuned = sync_tuned_lr(runs)
    at_lr = {opt: _lr_key(part["lr"].iloc[0]) for opt, part in full.groupby("optimizer")}
    lines = []
    gaps = {opt: part.sort_values("tokens") for opt, part in lengths.groupby("optimizer")}
    if gaps:
        per = ", ".join(f"{t / params:.2g}" for t in next(iter(gaps.values()))["tokens"])
        series = "; ".join(f"{opt} " + ", ".join(f"{g:+.3f}" for g in part["gap"]) for opt, part in gaps.items())
        lines.append(f"- **The gap against length** (2BW − sync at {per} tokens per parameter): {series}.")
        ahead = []
        for opt, part in gaps.items():  # a power law through the two longest points, carried to the paper's gap
            if len(part) < 2:
                continue
            (l0, g0), (l1, g1) = zip(part["tokens"].iloc[-2:] / params, part["gap"].iloc[-2:])
            target = PAPER.loc[opt, "2bw"] - PAPER.loc[opt, "sync"] if opt in PAPER.index else math.nan
            if g0 > g1 > 0 and math.isfinite(target):
                k = math.log(g1 / g0) / math.log(l1 / l0)
                ahead.append(f"{opt}'s gap falls as length^{k:.2f} over the last tripling, which would reach the "
                             f"paper's {target:.3f} near {l1 * (target / g1) ** (1 / k):.0f} tokens per parameter")
        if ahead:
            lines.append("- **Extrapolated, not measured:** " + "; ".join(ahead) + ".")
    if {"muon", "adamw"} <= set(table.index) and "gap" in table:
        short_gap = ""
        if short is not None and len(short):
            sg = gap_table(short[short["label"].isin(["sync", "2bw"])])
            short_gap = "; the short study's: " + ", ".join(f"{o} {sg.loc[o, 'gap']:+.3f}" for o in sg.index)

        def at(o: str) -> str:
            note = "" if tuned.get(o) == at_lr[o] or o not in tuned else f", not yet at its sync-tuned {tuned[o]:g}"
            return f"peak LR {at_lr[o]:g}{note}; paper {PAPER.loc[o, '2bw'] - PAPER.loc[o, 'sync']:+.3f}"

        lines.append("- **At 20 tokens per parameter** the delay costs " + ", ".join(
            f"{o} {table.loc[o, 'gap']:+.3f} ({at(o)})" for o in ("muon", "adamw")) + short_gap + ".")
    for opt in table.index:
        col = "recovered 2bw+ef"
        if col in table and math.isfinite(table.loc[opt, col]):
            paper = recovered_share(*PAPER.loc[opt, ["sync", "2bw", "2bw+ef"]])
            lines.append(f"- **EF on {opt}** recovers {100 * table.loc[opt, col]:.0f}% of the gap (paper "
                         f"{100 * paper:.0f}%): 2BW + EF {table.loc[opt, '2bw+ef']:.3f} against sync "
                         f"{table.loc[opt, 'sync']:.3f} and 2BW {table.loc[opt, '2bw']:.3f}.")
    lr = lr_sweep(runs).dropna(subset=["sync"])
    for opt, part in lr.groupby("optimizer"):
        if len(part) < 2:
            continue
        part = part.sort_values("lr")
        best = part.loc[part["sync"].idxmin()]
        where = ("inside the sweep" if part["lr"].iloc[0] < best["lr"] < part["lr"].iloc[-1]
                 else "at the sweep's edge: not bracketed yet")
        points = ", ".join(f"{x:g}: {v:.3f}" for x, v in zip(part["lr"], part["sync"]))
        lines.append(f"- **{opt}'s sync LR** ({points}): the best, {best['lr']:g}, is {where}.")
    own, by_lr = own_best_lr(runs), lr.set_index(["optimizer", "lr"])
    for opt, part in own.groupby("optimizer"):
        best = part.set_index("label")
        if len(part) < 2 or "sync" not in best.index or (best["lrs"] < 2).any():
            continue  # a variant at one LR has no "own best" yet
        lines.append(own_lr_moves(opt, best, by_lr))
        each = "; ".join(f"{label} {r['loss']:.3f} at {r['lr']:g} (of {r['lrs']} LRs"
                         f"{'' if r['inside'] else ', at the edge'})" for label, r in best.iterrows())
        gaps = ", ".join(f"{label} {best.loc[label, 'loss'] - best.loc['sync', 'loss']:+.3f}"
                         for label in best.index if label != "sync")
        lines.append(f"- **{opt}, each at its own best LR:** {each}; gaps to sync's best: {gaps}.")
    return "\n".join(lines) + "\n"


def own_lr_moves(opt: str, best: pd.DataFrame, sweep: pd.DataFrame) -> str:
    """The findings' bullet on what each async variant gains at its own best LR (``best``: :func:`own_best_lr`'s rows
    of ``opt`` by label) over sync's best LR (``sweep``: :func:`lr_sweep` by optimizer and LR), and EF's share of
    the gap at both."""
    sync_lr = best.loc["sync", "lr"]
    at_sync = sweep.loc[(opt, sync_lr)]
    moves = []
    for label in (x for x in best.index if x != "sync"):
        own = best.loc[label]
        if own["lr"] == sync_lr:
            moves.append(f"{label} is best at sync's")
        elif math.isfinite(at_sync.get(label, math.nan)):
            moves.append(f"{label} ends {at_sync[label] - own['loss']:.3f} lower at {own['lr']:g}")
        else:
            moves.append(f"{label} has not run at sync's")
    line = f"- **{opt}'s async variants at their own LR against sync's {sync_lr:g}:** " + "; ".join(moves)
    if {"2bw", "2bw+ef"} <= set(best.index):
        sync = best.loc["sync", "loss"]
        shares = [recovered_share(sync, best.loc["2bw", "loss"], best.loc["2bw+ef", "loss"]),
                  recovered_share(sync, at_sync.get("2bw", math.nan), at_sync.get("2bw+ef", math.nan))]
        if all(math.isfinite(x) for x in shares):
            line += (f"; EF recovers {100 * shares[0]:.0f}% of the gap at their own best LRs, {100 * shares[1]:.0f}%"
                     f" at sync's")
    return line + "."


LAMBDAS = (0.5, 1.0, 2.0, 3.0)


def _short_point(runs: pd.DataFrame, group: str) -> pd.DataFrame:
    """``group``'s runs with the long-lengths runs of the same length and seed 0 (the x1 LR's sync and 2bw)."""
    own = runs[runs["group"] == group]
    if own.empty:
        return own
    tokens = own["tokens"].mode().iloc[0]
    ref = runs[(runs["group"] == "long-lengths") & (runs["tokens"] == tokens) & (runs["seed"] == 0)]
    return pd.concat([own[own["tokens"] == tokens], ref])


def lambda_grid(runs: pd.DataFrame) -> pd.DataFrame:
    """EF strength against peak LR at long-lambda's length (seed 0): per optimizer and LR, the final loss of sync,
    2bw (lambda 0) and 2bw + EF at each lambda (NaN where a run diverged or is missing), the best lambda, the
    lambdas that beat plain 2bw there (trained where it diverged, or to a lower loss), the runs that diverged
    (``sync``, ``0`` for plain 2bw, each lambda) and the share of the 2bw − sync gap the best lambda closes."""
    sub = _short_point(runs, "long-lambda")
    rows = []
    for (opt, lr), part in sub.assign(lr=[_lr_key(v) for v in sub["lr"]]).groupby(["optimizer", "lr"], sort=True):
        diverged = part["diverged"].astype(bool)
        loss = {label: part.loc[~diverged & (part["label"] == label), "final_val"].mean() for label in ("sync", "2bw")}
        row = {"optimizer": opt, "lr": lr, "sync": loss["sync"], "λ=0 (2bw)": loss["2bw"]}
        at = {lam: (part["correction"] == "ef") & np.isclose(part["ef_lambda"].astype(float), lam) for lam in LAMBDAS}
        ef = {lam: part.loc[~diverged & mask, "final_val"].mean() for lam, mask in at.items()}
        row.update({f"λ={lam:g}": v for lam, v in ef.items()})
        ran = {lam: v for lam, v in ef.items() if math.isfinite(v)}
        row["best λ"] = min(ran, key=ran.get) if ran else math.nan
        lost = {label: bool((diverged & (part["label"] == label)).any()) for label in ("sync", "2bw")}
        row["beat 2bw"] = ", ".join(f"{lam:g}" for lam, v in ran.items() if lost["2bw"] or v < loss["2bw"]) or "—"
        row["diverged"] = ", ".join(["sync"] * lost["sync"] + ["0"] * lost["2bw"] + [
            f"{lam:g}" for lam, mask in at.items() if (diverged & mask).any()]) or "—"
        row["closed at best λ"] = ((loss["2bw"] - ran[row["best λ"]]) / (loss["2bw"] - loss["sync"]) if ran
                                    else math.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def lambda_findings(grid: pd.DataFrame) -> str:
    """Per optimizer and lambda: the peak LRs where 2BW + EF trained without diverging and where it beat plain 2BW
    (one sentence when every lambda trained and beat it at every LR), and the best lambda at each LR."""
    def lrs(values) -> str:
        return ", ".join(f"{x:g}" for x in values)

    lines = []
    for opt, part in grid.groupby("optimizer"):
        each, uniform = [], True
        for lam in LAMBDAS:
            col = f"λ={lam:g}"
            ran = part[np.isfinite(part[col].astype(float))]
            if ran.empty:
                continue
            better = ran[[f"{lam:g}" in beat.split(", ") for beat in ran["beat 2bw"]]]
            uniform &= len(better) == len(part)
            each.append(f"λ={lam:g} trained at {lrs(ran['lr'])}, beat 2BW at {lrs(better['lr']) or 'none'}")
        if each and uniform and len(each) == len(LAMBDAS):  # one sentence says it all
            each = [f"every λ ({lrs(LAMBDAS)}) trained and beat 2BW at every peak LR ({lrs(part['lr'])})"]
        if each:
            best = ", ".join(f"{x:g}: λ={b:g}" for x, b in zip(part["lr"], part["best λ"]) if math.isfinite(b))
            lines.append(f"- **{opt}:** " + "; ".join(each) + f". Best λ by peak LR: {best}.")
    return "\n".join(lines) + ("\n" if lines else "")


def delay_table(runs: pd.DataFrame) -> pd.DataFrame:
    """PipeDream's variable delay against the constant delay of its mean (long-delay, seed 0, m = 1): per optimizer
    and depth, the final loss of sync, 2bw, pipedream and the constant delay, and each delayed run's gap to sync."""
    sub = runs[(runs["group"] == "long-delay") & (runs["seed"] == 0)]
    rows = []
    for opt, part in sub.groupby("optimizer"):
        loss = {(r["schedule"], int(r["stages"])): r["final_val"] for _, r in part.iterrows()}
        sync = next((v for (sched, _), v in loss.items() if sched == "1f1b"), math.nan)
        two = next((v for (sched, _), v in loss.items() if sched == "2bw"), math.nan)
        for p in sorted({st for sched, st in loss if sched == "pipedream"}):
            variable = loss[("pipedream", p)]
            constant = next((v for (sched, st), v in loss.items() if st == p and sched.startswith("delay")), math.nan)
            rows.append({"optimizer": opt, "stages": p, "sync": sync, "2bw": two, "pipedream": variable,
                         "constant (mean delay)": constant, "gap 2bw": two - sync, "gap pipedream": variable - sync,
                         "gap constant": constant - sync, "pipedream − constant": variable - constant})
    return pd.DataFrame(rows)


def lambda_block(runs: pd.DataFrame) -> str:
    """The results page's lambda grid (:func:`lambda_grid`), what it shows and the line saying what ran."""
    if not (runs["group"] == "long-lambda").any():
        return "Not run yet.\n"
    grid = lambda_grid(runs)
    shown = formatted(grid, {"lr": "g", "sync": 3, "λ=0 (2bw)": 3, **{f"λ={x:g}": 3 for x in LAMBDAS}, "best λ": "g",
                        "closed at best λ": "%"})
    return (markdown(shown, index=False) + "\n" + lambda_findings(grid) + "\n"
            + ran_line(runs[runs["group"] == "long-lambda"]))


def delay_block(runs: pd.DataFrame) -> str:
    """The results page's variable-against-constant delay table (:func:`delay_table`) and what ran."""
    if not (runs["group"] == "long-delay").any():
        return "Not run yet.\n"
    table = delay_table(runs)
    shown = formatted(table, {c: "+3" if c.startswith("gap") or "−" in c else 3 for c in table.columns[2:]})
    return markdown(shown, index=False) + "\n" + ran_line(runs[runs["group"] == "long-delay"])
