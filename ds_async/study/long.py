"""The study at a real length (``long.json``: 20 tokens per parameter): its tables (the gap against length, the LR
sweeps, each variant at its own best LR, EF's strength against the LR and at the full length, PipeDream's variable
delay, the MoE, steps against tokens), with paired intervals over seeds, and the numbers the page's hand-written
reading quotes (the extrapolation of the gap, each variant at its own LR on seed 0, the MoE's fused-vs-split choice,
the training clocks) as tables. Input: the rows of :mod:`ds_async.study.rows`; the definitions are
:mod:`ds_async.study.tables`'.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .rows import PAPER
from .tables import (at_reference, formatted, gap_stats, gap_with_interval, markdown, paired_diff, paired_gap_cell,
                     ran_line, recovered_share, reference, reference_parameters, share_cell,
                     share_text, sweep)


# ---------------------------------------------------------------------------------------------------------------
# The study at a real length (long.json: 20 tokens per parameter)

LONG_GROUPS = ("long", "long-tuned", "long-lr", "long-async-lr", "long-own-lr", "long-lengths", "long-lambda",
               "long-delay", "long-moe", "long-moe-ns", "long-batch", "long-adamw-lambda")
LR_GROUPS = ("long", "long-tuned", "long-lr", "long-async-lr", "long-own-lr")
"""The groups whose runs sit on long.json's LR axis at its full length."""
MAIN_GROUPS = ("long", "long-tuned")
"""The multi-seed points at full length: long.json's own peak LRs, and Muon at its sync-tuned one."""
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


def loss_cell(seeds: pd.DataFrame, column: str) -> str:
    """A final loss's cell from per-seed losses (a frame by seed): ``mean (n)``, or a dash without the column."""
    return f"{seeds[column].mean():.3f} ({int(seeds[column].count())})" if column in seeds else "—"


def variant_cells(runs: pd.DataFrame) -> dict[str, str]:
    """One point's sync, 2bw and 2bw+ef as table cells: each final loss (mean over seeds, n), the gaps to sync paired
    by seed with their 95% intervals, and the share of the gap EF recovers with its 95% interval (over the seeds that
    have all three; :func:`~ds_async.study.tables.share_cell`)."""
    table = runs.pivot_table(index="seed", columns="label", values="final_val", aggfunc="mean")
    row = {label: loss_cell(table, label) for label in ("sync", "2bw", "2bw+ef")}
    for label in ("2bw", "2bw+ef"):
        row[f"{label} − sync"] = paired_gap_cell(table, label)
    row["recovered by ef"] = share_cell(table) if {"sync", "2bw", "2bw+ef"} <= set(table.columns) else "—"
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


def moe_choice_table(runs: pd.DataFrame) -> pd.DataFrame:
    """What the fused-vs-split choice is read from, by the rule docs/DESIGN.md fixed before the runs ("Muon on fused
    expert matrices": split unless fused trains better, for sync and for 2bw+ef alike, by more than the spread, max −
    min, of fused's own seeds): per variant, seed 0's loss each way, split − fused, and fused's seeds and their
    spread (NaN where a run is missing)."""
    fused, split = (runs[(runs["group"] == g) & ~runs["diverged"].astype(bool)] for g in MOE_GROUPS)  # that order
    rows = []
    for label in ("sync", "2bw+ef"):
        seed0 = {name: part.loc[(part["label"] == label) & (part["seed"] == 0), "final_val"].mean()
                 for name, part in (("fused", fused), ("split", split))}
        seeds = fused.loc[fused["label"] == label, "final_val"]
        rows.append({"variant": label, "fused, seed 0": seed0["fused"], "split, seed 0": seed0["split"],
                     "split − fused": seed0["split"] - seed0["fused"], "fused seeds": len(seeds),
                     "fused seeds' spread": seeds.max() - seeds.min() if len(seeds) >= 2 else math.nan})
    return pd.DataFrame(rows)


def moe_block(runs: pd.DataFrame) -> str:
    """The results page's MoE table (:func:`moe_table`), what the fused-vs-split choice reads
    (:func:`moe_choice_table`), what ran and its training clock (:func:`clock_table`)."""
    moe = runs[runs["group"].isin(list(MOE_GROUPS))]
    if moe.empty:
        return "Not run yet.\n"
    choice = formatted(moe_choice_table(moe), {"fused, seed 0": 4, "split, seed 0": 4, "split − fused": "+4",
                                               "fused seeds' spread": 4})
    return (markdown(moe_table(moe), index=False) + "\n" + markdown(choice, index=False) + "\n" + ran_line(moe)
            + clock_markdown(moe))


def headline_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Per optimizer, the full-length point the page's reading quotes: its sync-tuned LR once that point has sync and
    2bw runs, else long.json's own LR (``long``'s runs)."""
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
    """The gap against training length: sync and 2bw at each length (own LR schedule each; mean and n), in tokens
    per parameter, and the gap paired by seed with its 95% interval, over the seeds common to the optimizer's lengths
    (:func:`length_sweep`); the long matrix's runs are the longest point."""
    ref = reference(runs, group="long")
    t = length_sweep(runs, ref)
    params = reference_parameters(runs, ref)
    t.insert(2, "tokens/param", [v / params for v in t["tokens"]])
    t["tokens"] = [f"{v / 1e6:.0f}M" for v in t["tokens"]]
    for label in ("sync", "2bw"):
        t[label] = [f"{v:.3f} (n={n})" if math.isfinite(v) else "—" for v, n in zip(t[label], t["seeds"])]
    t["gap"] = [gap_with_interval(g, h, n) for g, h, n in zip(t["gap"], t["gap half"], t["seeds"])]
    return formatted(t.drop(columns=["gap half", "seeds"]), {"tokens/param": 2})


def clock_table(runs: pd.DataFrame) -> pd.DataFrame:
    """What the runs' training clocks (``summary.json``'s ``seconds``, compiling included) give, per card: runs, the
    range of millions of tokens a second and of minutes a run (empty without a clock)."""
    rows = []
    for card, part in runs.dropna(subset=["seconds_per_step"]).groupby("card", sort=True):
        rate = part["tokens_per_step"] / part["seconds_per_step"] / 1e6
        minutes = part["seconds_per_step"] * part["steps"] / 60
        rows.append({"card": card, "runs": len(part), "M tokens/s": f"{rate.min():.2f}–{rate.max():.2f}",
                     "min a run": f"{minutes.min():.1f}–{minutes.max():.1f}"})
    return pd.DataFrame(rows, columns=["card", "runs", "M tokens/s", "min a run"])


def clock_markdown(runs: pd.DataFrame) -> str:
    """:func:`clock_table` as the results page shows it under a table's "Ran" line (nothing without a clock)."""
    table = clock_table(runs)
    return ("\nTraining clock (each run's summary `seconds`, compiling included):\n\n" + markdown(table, index=False)
            if len(table) else "")


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
    t = lr_sweep(runs).drop(columns=["lr_scale", "gap half"], errors="ignore")
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
        return gap_with_interval(*gap_stats(losses - sync))

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


def extrapolation_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per optimizer, a power law through the gap's two longest points (long and long-lengths; :func:`length_sweep`)
    carried to the paper's gap: the two points' tokens per parameter and gaps, the exponent k of gap ∝ length^k,
    the paper's gap and the tokens per parameter where the law would reach it (NaN unless the gap falls and stays
    positive). An extrapolation, not a measurement."""
    ref = reference(runs, group="long")
    lengths = length_sweep(runs[runs["group"].isin(["long", "long-lengths"])], ref)
    params = reference_parameters(runs, ref)
    rows = []
    for opt, part in lengths.dropna(subset=["gap"]).sort_values("tokens").groupby("optimizer"):
        if len(part) < 2 or opt not in PAPER.index:
            continue
        (l0, g0), (l1, g1) = zip(part["tokens"].iloc[-2:] / params, part["gap"].iloc[-2:])
        target = PAPER.loc[opt, "2bw"] - PAPER.loc[opt, "sync"]
        k = math.log(g1 / g0) / math.log(l1 / l0) if g0 > g1 > 0 else math.nan
        rows.append({"optimizer": opt, "from tokens/param": l0, "to tokens/param": l1, "gap from": g0, "gap to": g1,
                     "exponent": k, "paper's gap": target,
                     "reaches it at tokens/param": l1 * (target / g1) ** (1 / k) if math.isfinite(k) else math.nan})
    return pd.DataFrame(rows)


def own_lr_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Each optimizer's sync, 2bw and 2bw+ef at the best peak LR each has run on seed 0's sweep (:func:`own_best_lr`):
    the LR, the loss, how many LRs it tried and whether the best lies inside them; the same variant's loss at sync's
    best LR and how much lower its own LR ends; the gap to sync's best; on the 2bw+ef row, the share of the gap EF
    recovers at the variants' own best LRs and at sync's; and the number of seeds (1: seed 0's sweep)."""
    own, sweep_at = own_best_lr(runs), lr_sweep(runs).set_index(["optimizer", "lr"])
    rows = []
    for opt, part in own.groupby("optimizer"):
        best = part.set_index("label")
        if "sync" not in best.index:
            continue
        sync_lr, sync = best.loc["sync", "lr"], best.loc["sync", "loss"]
        at_sync = sweep_at.loc[(opt, sync_lr)]
        for label, r in best.iterrows():
            there = at_sync.get(label, math.nan)
            row = {"optimizer": opt, "variant": label, "lr": r["lr"], "loss": r["loss"], "lrs": r["lrs"],
                   "inside": "inside" if r["inside"] else "edge", "at sync's lr": there,
                   "lower than at sync's lr": math.nan if label == "sync" else there - r["loss"],
                   "gap to sync's best": math.nan if label == "sync" else r["loss"] - sync,
                   "recovered by ef, own lrs": math.nan, "recovered by ef, sync's lr": math.nan, "seeds": 1}
            if label == "2bw+ef" and "2bw" in best.index:
                row["recovered by ef, own lrs"] = recovered_share(sync, best.loc["2bw", "loss"], r["loss"])
                row["recovered by ef, sync's lr"] = recovered_share(sync, at_sync.get("2bw", math.nan), there)
            rows.append(row)
    return pd.DataFrame(rows)


def own_lr_block(runs: pd.DataFrame) -> str:
    """The results page's :func:`own_lr_table` (seed 0) and what ran."""
    shown = formatted(own_lr_table(runs), {"lr": "g", "loss": 3, "at sync's lr": 3, "lower than at sync's lr": 3,
                                           "gap to sync's best": "+3", "recovered by ef, own lrs": "%",
                                           "recovered by ef, sync's lr": "%"})
    return markdown(shown, index=False)


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


def delay_table(runs: pd.DataFrame) -> pd.DataFrame:
    """PipeDream's variable delay against the constant delay of its mean (long-delay, seed 0, m = 1): per optimizer
    and depth, the final loss of sync, 2bw, pipedream and the constant delay, each delayed run's gap to sync, and the
    number of seeds (1)."""
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
                         "gap constant": constant - sync, "pipedream − constant": variable - constant,
                         "seeds": 1})  # seed 0 alone
    return pd.DataFrame(rows)


def batch_points(runs: pd.DataFrame) -> pd.DataFrame:
    """Steps against tokens at long.json's token count and each optimizer's sync-tuned LR (:func:`sync_tuned_lr`):
    ``long-batch``'s runs at half and twice long.json's batch, with long.json's own batch there (its
    :func:`main_points` at that LR, every seed)."""
    tuned, main = sync_tuned_lr(runs), main_points(runs)
    own = main[[tuned.get(opt) == lr for opt, lr in zip(main["optimizer"], main["lr"])]]
    other = runs[runs["group"] == "long-batch"]
    return pd.concat([own, other.assign(lr=[_lr_key(v) for v in other["lr"]])], ignore_index=True)


def batch_gaps(runs: pd.DataFrame) -> pd.DataFrame:
    """Per optimizer and batch (sequences a step) of :func:`batch_points`: its steps and tokens a step, and each
    delayed variant's gap to sync paired by seed: mean, the 95% interval's half-width (NaN below two seeds), n."""
    rows = []
    for (opt, batch), part in batch_points(runs).groupby(["optimizer", "batch"], sort=True):
        table = part.pivot_table(index="seed", columns="label", values="final_val", aggfunc="mean")
        for label in ("2bw", "2bw+ef"):
            if not {"sync", label} <= set(table):
                continue
            rows.append({"optimizer": opt, "batch": int(batch), "steps": int(part["steps"].max()),
                         "tokens/step": int(part["tokens_per_step"].max()), "variant": label,
                         **dict(zip(("gap", "gap half", "n"), gap_stats(paired_diff(table, label))))})
    return pd.DataFrame(rows, columns=["optimizer", "batch", "steps", "tokens/step", "variant", "gap", "gap half",
                                       "n"])


def batch_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per optimizer and batch of :func:`batch_points`: the LR, the steps that batch takes to long.json's tokens,
    and the :func:`variant_cells` (losses with n, gaps paired by seed with their intervals, EF's share)."""
    rows = [{"optimizer": opt, "lr": f"{lr:g}", "batch": int(batch), "steps": int(part["steps"].max()),
             **variant_cells(part)}
            for (opt, lr, batch), part in batch_points(runs).groupby(["optimizer", "lr", "batch"], sort=True)]
    return pd.DataFrame(rows, columns=["optimizer", "lr", "batch", "steps", *VARIANT_CELLS])


RULE_SEEDS = 3
"""The seeds (0-2) the results page's decision rules read, fixed before those seeds ran."""


def steps_rule(half: tuple[float, float, int], own: tuple[float, float, int],
               double: tuple[float, float, int]) -> str:
    """The results page's rule for steps against tokens, fixed before the seeds ran, on plain 2BW's gap at half,
    long.json's own and twice its batch (each ``(mean, 95% half-width, n)``): "the steps" if the half-batch
    interval lies wholly below long.json's and the double-batch one wholly above it, "the tokens a step" if the
    half-batch interval reaches long.json's mean gap, "undecided" otherwise; "open" until each batch has
    ``RULE_SEEDS`` seeds."""
    if min(n for _, _, n in (half, own, double)) < RULE_SEEDS:
        return f"open (seeds {half[2]}, {own[2]}, {double[2]}; needs {RULE_SEEDS} each)"
    low, high = (lambda g: g[0] - g[1]), (lambda g: g[0] + g[1])
    if high(half) < low(own) and low(double) > high(own):
        return "the steps"
    if high(half) >= own[0]:
        return "the tokens a step"
    return "undecided"


def steps_rule_table(runs: pd.DataFrame) -> pd.DataFrame:
    """:func:`steps_rule` per optimizer with ``long-batch`` runs: plain 2BW's gap to sync at half, long.json's own
    and twice its batch (:func:`batch_gaps`' cells, a dash where none ran) and what the rule says."""
    own = int(reference(runs, group="long")["batch"])
    gaps = batch_gaps(runs)
    gaps = gaps[gaps["variant"] == "2bw"].set_index(["optimizer", "batch"])
    rows = []
    for opt in sorted(set(runs.loc[runs["group"] == "long-batch", "optimizer"])):
        at = {b: tuple(gaps.loc[(opt, b), ["gap", "gap half", "n"]]) if (opt, b) in gaps.index
              else (math.nan, math.nan, 0) for b in (own // 2, own, own * 2)}
        rows.append({"optimizer": opt, **{f"batch {b}": gap_with_interval(m, h, int(n)) for b, (m, h, n) in at.items()},
                     "the rule says": steps_rule(*((m, h, int(n)) for m, h, n in at.values()))})
    return pd.DataFrame(rows)


def ruled_block(own: pd.DataFrame, table: pd.DataFrame, rule: str, applied: pd.DataFrame) -> str:
    """A results page block whose question a rule fixed before its seeds ran decides: the table, ``rule`` (the
    caption) over the rule's reading of it (``applied``), what ran (``own``, the block's runs) and its clock."""
    return (markdown(table, index=False) + f"\n{rule}:\n\n" + markdown(applied, index=False) + "\n" + ran_line(own)
            + clock_markdown(own))


def batch_block(runs: pd.DataFrame) -> str:
    """The results page's steps-against-tokens table (:func:`batch_table`), the rule's reading of it
    (:func:`steps_rule_table`), what ran and its training clock."""
    batch = runs[runs["group"] == "long-batch"]
    if batch.empty:
        return "Not run yet.\n"
    return ruled_block(batch, batch_table(runs), "The rule fixed before the seeds ran, on 2BW's gap",
                       steps_rule_table(runs))


def lambda_block(runs: pd.DataFrame) -> str:
    """The results page's lambda grid (:func:`lambda_grid`) and the line saying what ran."""
    if not (runs["group"] == "long-lambda").any():
        return "Not run yet.\n"
    grid = lambda_grid(runs)
    shown = formatted(grid, {"lr": "g", "sync": 3, "λ=0 (2bw)": 3, **{f"λ={x:g}": 3 for x in LAMBDAS},
                             "best λ": "g"})
    shown["closed at best λ"] = [share_text(v, math.nan, 1) for v in grid["closed at best λ"]]  # seed 0 alone
    return markdown(shown, index=False) + "\n" + ran_line(runs[runs["group"] == "long-lambda"])


FULL_LAMBDA_CELLS = ("sync", "2bw", "2bw+ef", "2bw+ef − sync", "recovered by ef", "− λ=1")


def _full_lambda_seeds(runs: pd.DataFrame) -> dict[str, tuple[float, pd.DataFrame, list[float]]]:
    """Per optimizer ``long-adamw-lambda`` ran: its sync-tuned LR, the final losses there by seed (columns sync,
    2bw and ``λ=X`` for every EF strength, λ = 1 being the :func:`main_points` run) and the lambdas, sorted."""
    own = runs[runs["group"] == "long-adamw-lambda"]
    tuned, main = sync_tuned_lr(runs), main_points(runs)
    out = {}
    for opt in sorted(set(own["optimizer"])):
        lr = tuned[opt]
        point = pd.concat([main[(main["optimizer"] == opt) & (main["lr"] == lr)],
                           own[(own["optimizer"] == opt) & (own["lr"].map(_lr_key) == lr)]])
        ef = point["correction"] == "ef"
        column = [f"λ={float(lam):g}" if is_ef else label
                  for is_ef, lam, label in zip(ef, point["ef_lambda"], point["label"])]
        table = point.assign(column=column).pivot_table(index="seed", columns="column", values="final_val",
                                                         aggfunc="mean")
        out[opt] = (lr, table, sorted({float(v) for v in point.loc[ef, "ef_lambda"]}))
    return out


def full_lambda_table(runs: pd.DataFrame) -> pd.DataFrame:
    """EF's strength at the full length (``long-adamw-lambda``) per optimizer it ran, at that optimizer's sync-tuned
    LR (:func:`sync_tuned_lr`): per lambda, the 2bw + EF loss (mean over seeds, n), its gap to sync paired by seed with
    the 95% interval, the share of the 2bw gap it recovers with its interval, and its loss minus lambda 1's paired by
    seed with the interval (what the page's rule for advising a lambda reads); sync, 2bw and lambda 1 are that
    point's :func:`main_points` runs (long's), so every lambda pairs with the same seeds' sync and 2bw."""
    rows = []
    for opt, (lr, table, lambdas) in _full_lambda_seeds(runs).items():
        base = {label: loss_cell(table, label) for label in ("sync", "2bw")}
        for lam in lambdas:
            col = f"λ={lam:g}"
            rows.append({"optimizer": opt, "lr": f"{lr:g}", "λ": f"{lam:g}", **base,
                         "2bw+ef": loss_cell(table, col),
                         "2bw+ef − sync": paired_gap_cell(table, col),
                         "recovered by ef": share_cell(table, corrected=col) if {"sync", "2bw"} <= set(table)
                         else "—",
                         "− λ=1": "—" if lam == 1.0 else paired_gap_cell(table, col, sync="λ=1")})
    return pd.DataFrame(rows, columns=["optimizer", "lr", "λ", *FULL_LAMBDA_CELLS])


def lambda_rule(diffs: dict[float, tuple[float, float, int]]) -> tuple[dict[float, str], str]:
    """The results page's rule for advising an EF strength above 1, fixed before the seeds ran, on each lambda's
    loss minus lambda 1's paired by seed (``(mean, 95% half-width, n)`` by lambda): with ``RULE_SEEDS`` seeds a
    lambda is "below λ = 1" if its interval lies wholly below zero, "not below" otherwise, "open" before. The
    advice: of the lambdas below, the lowest mean, once every lambda is decided; λ = 1 if none is below."""
    says = {lam: (f"open (seeds {n}; needs {RULE_SEEDS})" if n < RULE_SEEDS else
                  "below λ = 1" if m + h < 0 else "not below") for lam, (m, h, n) in diffs.items()}
    if any(v.startswith("open") for v in says.values()):
        return says, "open"
    below = [lam for lam, v in says.items() if v == "below λ = 1"]
    return says, f"λ = {min(below, key=lambda lam: diffs[lam][0]):g}" if below else "λ = 1"


def lambda_rule_table(runs: pd.DataFrame) -> pd.DataFrame:
    """:func:`lambda_rule` per optimizer ``long-adamw-lambda`` ran, at its sync-tuned LR: per lambda above 1, its
    loss minus lambda 1's (:func:`full_lambda_table`'s last column), what the rule says of it and the advice."""
    rows = []
    for opt, (lr, table, lambdas) in _full_lambda_seeds(runs).items():
        diffs = {lam: gap_stats(paired_diff(table, f"λ={lam:g}", sync="λ=1")) for lam in lambdas if lam != 1.0}
        says, advice = lambda_rule(diffs)
        rows += [{"optimizer": opt, "lr": f"{lr:g}", "λ": f"{lam:g}", "− λ=1": gap_with_interval(*diffs[lam]),
                  "the rule says": says[lam], "advice": advice} for lam in diffs]
    return pd.DataFrame(rows, columns=["optimizer", "lr", "λ", "− λ=1", "the rule says", "advice"])


def full_lambda_block(runs: pd.DataFrame) -> str:
    """The results page's full-length lambda table (:func:`full_lambda_table`), the rule's reading of it
    (:func:`lambda_rule_table`), what ran and its training clock."""
    own = runs[runs["group"] == "long-adamw-lambda"]
    if own.empty:
        return "Not run yet.\n"
    return ruled_block(own, full_lambda_table(runs), "The rule fixed before the seeds ran", lambda_rule_table(runs))


def delay_block(runs: pd.DataFrame) -> str:
    """The results page's variable-against-constant delay table (:func:`delay_table`) and what ran."""
    if not (runs["group"] == "long-delay").any():
        return "Not run yet.\n"
    table = delay_table(runs)
    shown = formatted(table, {c: "+3" if c.startswith("gap") or "−" in c else 3 for c in table.columns[2:]
                              if c != "seeds"})
    return markdown(shown, index=False) + "\n" + ran_line(runs[runs["group"] == "long-delay"])
