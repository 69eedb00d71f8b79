"""The study's figures, drawn from the rows of :mod:`runs` (beside this file): loss curves over seeds, the sweeps,
PipeDream's depth, EF's λ, steps against tokens, the engine next to its emulation and time to loss. Each function
returns its matplotlib figure."""
from __future__ import annotations

import pandas as pd

from ds_async.study import runs as study



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
                ref: dict | None = None, free: str | None = None):
    """One column per optimizer. Top: validation loss vs training tokens per label (mean over seeds, band ± std).
    Bottom: each label minus the synchronous run of the same seed (paired). The runs drawn sit at ``ref`` on every
    axis but ``free`` (``"lr_scale"``: each optimizer's runs may be at their own LR). Returns the figure."""
    import matplotlib.pyplot as plt

    ref = ref or study.reference(runs)
    sub = study.at_reference(runs, ref, free=free)
    sub = sub[sub["label"].isin(labels)]
    loss, diff = study.curves(sub), study.gap_curves(sub)
    optimizers = list(dict.fromkeys(sub["optimizer"])) or ["(no runs)"]
    fig, axes = plt.subplots(2, len(optimizers), figsize=(5 * len(optimizers), 6), squeeze=False,
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

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for opt, part in table.groupby("optimizer"):
        part = part.sort_values(x)
        for label, style in zip(labels, ("-", "--")):
            left.plot(part[x], part[label], style, marker="o", label=f"{opt} {label}")
        if "gap" in part:
            right.plot(part[x], part["gap"], marker="o", label=opt)
    right.axhline(0, color="k", lw=0.8)
    left.set_ylabel("final validation loss")
    right.set_ylabel(f"gap: {labels[1]} − {labels[0]}")
    for ax in (left, right):
        ax.set_xlabel(xlabel)
        if logx:
            ax.set_xscale("log")
    _grid_and_legend((left, right), fontsize=8)
    fig.tight_layout()
    return fig


def plot_depth(table: pd.DataFrame):
    """Gap vs pipeline depth: PipeDream (variable delay) per P, 2BW (constant delay) as a flat line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for opt, part in table.groupby("optimizer"):
        line = ax.plot(part["stages"], part["gap pipedream"], marker="o", label=f"{opt} PipeDream")[0]
        ax.plot(part["stages"], part["gap 2bw"], "--", color=line.get_color(), label=f"{opt} 2BW")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pipeline stages p")
    ax.set_ylabel("gap vs sync (final validation loss)")
    _grid_and_legend((ax,), fontsize=8)
    fig.tight_layout()
    return fig


def plot_lambda(table: pd.DataFrame):
    """Share of the 2BW gap recovered by EF vs λ (0 = no correction)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for opt, part in table.groupby("optimizer"):
        ax.plot(part["lambda"], 100 * part["recovered"], marker="o", label=opt)
    ax.axhline(100, color="k", lw=0.8, ls=":")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("EF λ")
    ax.set_ylabel("gap recovered (%)")
    _grid_and_legend((ax,), fontsize=8)
    fig.tight_layout()
    return fig


def plot_lambda_grid(grid: pd.DataFrame):
    """One panel per optimizer of a ``lambda_grid``: final loss against EF λ (0 = plain 2BW), a line per peak LR,
    sync at that LR dotted in the same colour; a diverged run leaves its point out."""
    import matplotlib.pyplot as plt

    opts = sorted(grid["optimizer"].unique())
    fig, axes = plt.subplots(1, len(opts), figsize=(5 * len(opts), 3.5), squeeze=False)
    columns = ["λ=0 (2bw)", *(f"λ={lam:g}" for lam in study.LAMBDAS)]
    for ax, opt in zip(axes[0], opts):
        for _, row in grid[grid["optimizer"] == opt].sort_values("lr").iterrows():
            line = ax.plot([0.0, *study.LAMBDAS], [row[c] for c in columns], marker="o", label=f"lr {row['lr']:g}")[0]
            ax.axhline(row["sync"], color=line.get_color(), lw=0.8, ls=":")
        ax.set_title(f"{opt} (dotted: sync)", fontsize=9)
        ax.set_xlabel("EF λ (0: plain 2BW)")
        ax.set_ylabel("final validation loss")
    _grid_and_legend(axes[0], fontsize=8)
    fig.tight_layout()
    return fig


def plot_batch(gaps: pd.DataFrame):
    """Steps against tokens (a ``batch_gaps`` frame): each delayed variant's gap to sync at one token count against
    the optimizer steps it took (left) and against the tokens a step (right), a line per optimizer and variant, bars
    the 95% interval where there are two or more seeds; both axes of steps and tokens logarithmic."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for (opt, variant), part in gaps.sort_values("steps").groupby(["optimizer", "variant"]):
        seeds = f"n={part['n'].min()}" if part["n"].nunique() == 1 else f"n={part['n'].min()}–{part['n'].max()}"
        for ax, x in zip(axes, ("steps", "tokens/step")):
            ax.errorbar(part[x], part["gap"], yerr=part["gap half"].fillna(0), marker="o", capsize=3,
                        label=f"{opt} {variant} ({seeds})")
    for ax, x, xlabel in zip(axes, ("steps", "tokens/step"), ("optimizer steps (the same tokens)", "tokens a step")):
        ax.set_xscale("log")
        ax.minorticks_off()  # ticks at the points run only: a log axis' minor labels overprint each other
        ax.set_xticks(sorted(set(gaps[x])), [f"{v:,.0f}" for v in sorted(set(gaps[x]))])
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("final validation loss − sync's")
    _grid_and_legend(axes, fontsize=8)
    fig.tight_layout()
    return fig


def plot_engine(runs: pd.DataFrame, ref: dict | None = None, group: str | None = None):
    """One column per (optimizer, label) of the engine pairs (of ``group`` if given). Top: validation loss of each
    seed through the engine (solid) and the emulation (dashed). Bottom: engine − emulation per seed, over ± the
    main matrix's seed std (grey) where the pairs sit at the main point. Returns the figure."""
    import matplotlib.pyplot as plt

    table = study.engine_table(runs, ref)
    if group is not None:
        table = table[table["group"] == group]
    points = list(dict.fromkeys(zip(table["optimizer"], table["label"]))) or [("(no engine runs)", "")]
    ref = ref or (study.reference(runs) if len(runs) else {})
    main = study.curves(study.at_reference(runs, ref)) if len(runs) else study.curves(runs)
    fig, axes = plt.subplots(2, len(points), figsize=(4.5 * len(points), 5.5), squeeze=False, sharex="col",
                             gridspec_kw={"height_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    by_path = runs.set_index("path") if len(runs) else runs
    for col, (opt, label) in enumerate(points):
        top, bottom = axes[0][col], axes[1][col]
        band = main[(main["optimizer"] == opt) & (main["label"] == label)].sort_values("tokens")
        part = table[(table["optimizer"] == opt) & (table["label"] == label)]
        if not band.empty and len(part) and part["source"].iloc[0] == "main matrix":
            bottom.fill_between(band["tokens"] / 1e6, -band["std"], band["std"], color="grey", alpha=0.25,
                                label="± seed std")
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


def plot_time_to_loss(doc: dict):
    """A time-to-loss comparison (``launch/study/time_to_loss.py``'s JSON): validation loss against wall-clock
    seconds (left) and training tokens (right) per run, the target (the sync run's final loss) as a line and each
    run's crossing of it marked; earlier targets and the AdamW run's final loss, where the comparison has them, as
    lines of their own. Returns the figure."""
    import matplotlib.pyplot as plt

    curves, table = study.time_to_loss_curves(doc), study.time_to_loss_table(doc).set_index("run")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (name, d) in enumerate(curves.groupby("run", sort=False)):
        for ax, x, at in ((axes[0], d["seconds"], table.loc[name, "time to target (s)"]),
                          (axes[1], d["tokens"] / 1e6, table.loc[name, "tokens to target (M)"])):
            ax.plot(x, d["loss"], color=colors[k], marker="o", ms=2.5, label=name)
            if pd.notna(at):
                ax.plot([at], [doc["target"]], color=colors[k], marker="x", ms=9, mew=2)
    low = curves["loss"].min()
    for ax, xlabel in zip(axes, ("seconds from the start of training", "training tokens (M)")):
        ax.axhline(doc["target"], color="k", lw=0.8, ls="--", label="target: sync's final loss")
        for k, earlier in enumerate(doc.get("targets", [])[:-1]):  # --targets: earlier points of sync's curve
            ax.axhline(earlier, color="0.5", lw=0.8, ls=":", label="earlier targets (sync's curve)" if k == 0 else None)
        if doc.get("adamw_target") is not None:
            ax.axhline(doc["adamw_target"], color="k", lw=0.8, ls="-.", label="the AdamW run's final loss")
        ax.set_xlabel(xlabel)
        ax.set_ylim(low - 0.05, low + 1.5)
    axes[0].set_ylabel("validation loss")
    fig.suptitle(f"time to loss, {doc['parameters'] / 1e6:.0f}M LLaMA on {doc['gpus']} GPUs "
                 f"({doc['budget_s']:g} s of steps each)")
    _grid_and_legend(axes, fontsize=8)
    fig.tight_layout()
    return fig


def plot_fp8_quality(rows: list[dict]):
    """The FP8 quality runs (``launch/bench/results/fp8_quality_1xH200.jsonl``, one row per run): validation loss
    against steps for every bf16 and FP8 run (left), and each FP8 run minus the mean of the bf16 runs at the same
    step, with the bf16 runs' own distance from their mean for scale (right). Returns the figure."""
    import matplotlib.pyplot as plt

    def curve(row):
        return sorted((int(s), v) for s, v in row["validation_loss"].items())

    bf16 = [curve(r) for r in rows if r["fp8"] is None]
    mean = pd.DataFrame([dict(c) for c in bf16]).mean()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    colors = {None: "tab:blue", "rowwise": "tab:orange", "tensorwise": "tab:green"}
    for row in (r for r in rows if r["validation_loss"]):
        steps, loss = zip(*curve(row))
        recipe = row["fp8"] or "bf16"
        left.plot(steps, loss, color=colors.get(row["fp8"], "k"), marker="o", ms=2.5, alpha=0.8,
                  label=f"{recipe} ({row['source'].replace('session ', 's')}, to step {row['steps_reached']})")
        right.plot(steps, [v - mean[s] for s, v in zip(steps, loss)], color=colors.get(row["fp8"], "k"),
                   marker="o", ms=2.5, alpha=0.8, label=recipe if row["fp8"] else "bf16 (its own spread)")
    right.axhline(0, color="k", lw=0.8)
    left.set_ylabel("validation loss")
    right.set_ylabel("minus the bf16 runs' mean")
    for ax in (left, right):
        ax.set_xlabel("step")
    left.set_ylim(mean.min() - 0.1, mean.min() + 2.2)
    handles, labels = right.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    right.legend(unique.values(), unique.keys(), fontsize=8)
    left.legend(fontsize=7)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle("FP8 (rowwise) against bf16: 239M LLaMA, 2BW + Muon + EF, same seed and data, 1x H200")
    fig.tight_layout()
    return fig
