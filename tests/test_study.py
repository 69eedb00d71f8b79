"""The loss-curve study: the tables' arithmetic on hand-made runs, the matrices as valid ds_async configs, the
committed results page against the committed results, and the whole chain on CPU (the ``tiny`` matrix through
``launch/study/run.py``, a run through ``launch/train.py`` next to its emulation, ``notebooks/loss_curves.ipynb``
executed on the run folders)."""
import base64
import importlib.util
import io
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

from distributed import free_port
from ds_async import config as cfgmod
from ds_async.config import data_parallel_degree
from ds_async.pipe.version_rule import get
from ds_async.study import driver, matrices
from ds_async.study import runs as study

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "corpus"


def _notebook_helper(name: str):
    """A module beside the notebooks (not a package module: the notebooks import it from their folder)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "notebooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plots = _notebook_helper("plots")


def _runs(rows) -> pd.DataFrame:
    """Hand-made runs: (optimizer, label, seed, final_val[, axis overrides])."""
    base = {"model": "m", "seq_len": 256, "batch": 48, "tokens": 1000, "lr_scale": 1.0, "group": "main",
            "runner": "emulation", "diverged": False, "card": "", "seconds_per_step": math.nan}  # no clock
    out = []
    for row in rows:
        opt, label, seed, val, *extra = row
        out.append({**base, "optimizer": opt, "label": label, "seed": seed, "final_val": val,
                    "schedule": "1f1b" if label == "sync" else label.split("+")[0].split(" ")[0],
                    "correction": label.split("+")[1].split(" ")[0] if "+" in label else "none",
                    **(extra[0] if extra else {})})
    return pd.DataFrame(out)


def test_gap_and_recovered_share_by_hand():
    runs = _runs([("adamw", "sync", 0, 2.0), ("adamw", "sync", 1, 2.2),
                  ("adamw", "2bw", 0, 2.3), ("adamw", "2bw", 1, 2.5),
                  ("adamw", "2bw+ef", 0, 2.1), ("adamw", "2bw+ef", 1, 2.3),
                  ("adamw", "2bw+nesterov", 0, 2.25),
                  ("muon", "sync", 0, 2.0), ("muon", "2bw", 0, 2.0)])
    table = study.gap_table(runs)
    a = table.loc["adamw"]
    assert a["sync"] == pytest.approx(2.1) and a["sync std"] == pytest.approx(math.sqrt(0.02))
    assert a["gap"] == pytest.approx(0.3) and a["gap std"] == pytest.approx(0.0, abs=1e-12) and a["gap n"] == 2
    # (2.4 - 2.2) / (2.4 - 2.1)
    assert a["recovered 2bw+ef"] == pytest.approx(2 / 3) and a["recovered 2bw+ef n"] == 2
    assert a["2bw+ef − sync"] == pytest.approx(0.1)
    # only seed 0 has the nesterov run: (2.3 - 2.25) / (2.3 - 2.0), not mixed with seed 1's sync and 2bw
    assert a["recovered 2bw+nesterov"] == pytest.approx(1 / 6) and a["recovered 2bw+nesterov n"] == 1
    assert table.loc["muon", "gap"] == 0.0 and "recovered 2bw+ef" not in table.columns[table.loc["muon"].notna()]
    assert math.isnan(study.recovered_share(2.0, 2.0, 1.9))
    # the paper's AdamW numbers: EF recovers (2.890 - 2.640) / (2.890 - 2.612) = 90%
    assert study.recovered_share(2.612, 2.890, 2.640) == pytest.approx(0.8993, abs=1e-4)

    shown = study.main_table(runs)
    assert shown.loc["adamw", "sync (n)"] == "2.100 ± 0.141 (2)"
    assert shown.loc["adamw", "gap 2bw − sync"] == "+0.300 ± 0.000 (n=2)"  # paired: both seeds' gaps are 0.3
    assert shown.loc["muon", "gap 2bw − sync"] == "+0.000 (n=1, no interval)"
    # both seeds recover 2/3 of their own gap: the interval of the ratio has no width
    assert shown.loc["adamw", "recovered by ef"] == "67% ± 0% (n=2)"
    assert shown.loc["adamw", "recovered by nesterov"] == "17% (n=1, no interval)"
    assert shown.loc["muon", "recovered by ef"] == "—"


def test_sweeps_use_the_reference_and_common_seeds():
    main = [(opt, label, seed, 2.0 + 0.1 * seed + d)
            for opt in ("adamw", "muon") for seed in (0, 1, 2)
            for label, d in (("sync", 0.0), ("2bw", 0.2 if opt == "adamw" else 0.02), ("2bw+ef", 0.05))]
    extra = [("adamw", "sync", 0, 1.8, {"tokens": 2000, "group": "tokens"}),
             ("adamw", "2bw", 0, 1.9, {"tokens": 2000, "group": "tokens"}),
             ("adamw", "sync", 0, 2.5, {"lr_scale": 2.0, "group": "lr"}),  # off-reference: not in the table
             ("adamw", "2bw+ef λ=0.5", 0, 2.1, {"group": "ef_lambda"}),
             ("adamw", "pipedream p=4", 0, 2.4, {"group": "depth"})]
    runs = _runs(main + extra)
    ref = study.reference(runs)
    assert ref == {"model": "m", "seq_len": 256, "batch": 48, "tokens": 1000, "lr_scale": 1.0}
    assert len(study.at_reference(runs, ref)) == 18 + 2
    tokens = study.sweep(runs, "tokens", ref)
    a = tokens[tokens["optimizer"] == "adamw"].set_index("tokens")
    assert a.loc[2000, "gap"] == pytest.approx(0.1) and a.loc[1000, "gap"] == pytest.approx(0.2)
    assert set(tokens["seeds"]) == {1}  # seed 0 is the only one every point has
    lam = study.lambda_table(runs, ref)
    lam = lam[lam["optimizer"] == "adamw"].set_index("lambda")
    assert list(lam.index) == [0.0, 0.5, 1.0]
    assert lam.loc[0.5, "recovered"] == pytest.approx(0.5) and lam.loc[1.0, "recovered"] == pytest.approx(0.75)
    depth = study.depth_table(runs, ref)
    assert depth.iloc[0]["stages"] == 4 and depth.iloc[0]["gap pipedream"] == pytest.approx(0.4)
    assert depth.iloc[0]["gap 2bw"] == pytest.approx(0.2)


def test_length_curve_pairs_seeds_per_optimizer():
    """The gap-against-length table takes, for each optimizer, the seeds all of its own lengths have: Muon's
    second seed counts although AdamW's longest point has only seed 0."""
    long = {"group": "long", "parameters": 1000, "tokens": 4000}
    short = {"group": "long-lengths", "parameters": 1000, "tokens": 1000}
    rows = [("muon", label, seed, 3.0 + d + 0.01 * seed + (0.5 if at is short else 0.0), at)
            for seed in (0, 1) for at in (long, short) for label, d in (("sync", 0.0), ("2bw", 0.04 + 0.02 * seed))]
    rows += [("adamw", label, 0, 3.2 + d, at) for at in (long, short) for label, d in (("sync", 0.0), ("2bw", 0.5))]
    rows += [("adamw", label, 1, 3.3 + d, short) for label, d in (("sync", 0.0), ("2bw", 0.9))]
    table = study.length_table(_runs(rows)).set_index(["optimizer", "tokens/param"])
    # muon's gaps are 0.04 and 0.06: mean 0.05, t(1) 12.706 x std 0.01414 / sqrt 2 = 0.127
    assert table.loc[("muon", "4.00"), "gap"] == "+0.050 ± 0.127 (n=2)"
    assert table.loc[("muon", "1.00"), "gap"] == "+0.050 ± 0.127 (n=2)"
    assert table.loc[("muon", "4.00"), "sync"] == "3.005 (n=2)"
    assert table.loc[("adamw", "1.00"), "gap"] == "+0.500 (n=1, no interval)"
    assert table.loc[("adamw", "1.00"), "2bw"] == "3.700 (n=1)"


def test_tokens_per_parameter_are_the_dense_models_with_a_moe_listed_first():
    """Tokens per parameter divide by the reference model's parameters, not the first run's: a Mixtral of the
    long groups, listed first, has more parameters than the dense model."""
    moe = {"group": "long-moe", "model": "m-e8k2", "parameters": 3000, "tokens": 4000}
    long = {"group": "long", "parameters": 1000, "tokens": 4000}
    rows = [("muon", label, 0, 3.0 + d, at) for at in (moe, long) for label, d in (("sync", 0.0), ("2bw", 0.1))]
    runs = _runs(rows)
    assert study.length_table(runs)["tokens/param"].tolist() == ["4.00"]
    assert study.seed_table(runs)["tokens/param"].tolist() == [4.0]


def test_seed_table_shows_each_seed_along_the_lengths():
    """The per-seed table: each seed's own 2bw − sync at every length and, where 2bw+ef ran, its remaining gap and
    the share EF recovers; a seed without a run there is NaN, not dropped."""
    long = {"group": "long", "parameters": 1000, "tokens": 4000}
    short = {"group": "long-lengths", "parameters": 1000, "tokens": 1000}
    rows = [("muon", "sync", 0, 3.00, long), ("muon", "2bw", 0, 3.04, long), ("muon", "2bw+ef", 0, 3.01, long),
            ("muon", "sync", 1, 3.10, long), ("muon", "2bw", 1, 3.12, long), ("muon", "2bw+ef", 1, 3.11, long),
            ("muon", "sync", 0, 3.5, short), ("muon", "2bw", 0, 3.9, short)]
    table = study.seed_table(_runs(rows)).set_index(["tokens/param", "figure"])
    assert list(table.columns) == ["optimizer", "seed 0", "seed 1"]
    assert table.loc[(4.0, "2bw − sync"), "seed 0"] == pytest.approx(0.04)
    assert table.loc[(4.0, "2bw − sync"), "seed 1"] == pytest.approx(0.02)
    assert table.loc[(4.0, "2bw+ef − sync"), "seed 1"] == pytest.approx(0.01)
    assert table.loc[(4.0, "recovered by ef"), "seed 0"] == pytest.approx(0.75)
    assert table.loc[(1.0, "2bw − sync"), "seed 0"] == pytest.approx(0.4)
    assert math.isnan(table.loc[(1.0, "2bw − sync"), "seed 1"]) and (1.0, "2bw+ef − sync") not in table.index
    shown = study.seed_markdown(study.seed_table(_runs(rows)))
    assert "| muon | 4.00 | recovered by ef | 75% | 50% |" in shown and "| muon | 1.00 | 2bw − sync | +0.400 | — |" in shown


def test_clock_table_per_card():
    runs = _runs([("muon", "sync", 0, 3.0, {"card": "A", "tokens_per_step": 1000, "seconds_per_step": 0.001,
                                             "steps": 60000}),
                  ("muon", "2bw", 0, 3.1, {"card": "A", "tokens_per_step": 1000, "seconds_per_step": 0.002,
                                            "steps": 60000}),
                  ("muon", "sync", 1, 3.0, {"card": "B", "tokens_per_step": 2000, "seconds_per_step": 0.001,
                                             "steps": 30000})])
    assert study.clock_table(runs).values.tolist() == [["A", 2, "0.50–1.00", "1.0–2.0"],
                                                       ["B", 1, "2.00–2.00", "0.5–0.5"]]


def test_each_variant_at_its_own_best_lr():
    """The LR table and the own-LR table: sync, 2bw and 2bw+ef each at the lowest loss over the LRs it ran (seed 0),
    inside the sweep or at its edge, with its gap to sync's best; a variant at one LR has tried one."""
    at = {0.5: {"lr_scale": 0.5, "lr": 0.01}, 1.0: {"lr": 0.02}, 2.0: {"lr_scale": 2.0, "lr": 0.04}}
    losses = {"sync": (2.99, 2.97, 2.96), "2bw": (3.05, 3.00, 2.98), "2bw+ef": (3.00, 2.98, 2.99)}
    rows = [("muon", label, 0, loss, {"group": "long", "parameters": 1000, **at[x]})
            for label, values in losses.items() for x, loss in zip(at, values)]
    runs = _runs(rows)
    table = study.long_lr_table(runs).set_index("lr")
    assert table.loc["0.04", "2bw+ef"] == "2.990" and table.loc["0.02", "gap"] == "+0.030"
    own = study.own_best_lr(runs).set_index("label")
    assert own.loc["sync", "lr"] == 0.04 and not own.loc["sync", "inside"]
    assert own.loc["2bw+ef", "lr"] == 0.02 and own.loc["2bw+ef", "inside"] and own["lrs"].tolist() == [3, 3, 3]
    shown = study.formatted(study.own_lr_table(runs), {"lr": "g", "loss": 3, "gap to sync's best": "+3"})
    assert shown[["variant", "lr", "loss", "lrs", "inside", "gap to sync's best"]].values.tolist() == [
        ["sync", "0.04", "2.960", 3, "edge", "—"], ["2bw", "0.04", "2.980", 3, "edge", "+0.020"],
        ["2bw+ef", "0.02", "2.980", 3, "inside", "+0.020"]]
    one = _runs([r for r in rows if r[1] == "sync" or r[4]["lr"] == 0.02])
    assert study.own_lr_table(one).set_index("variant")["lrs"].to_dict() == {"sync": 3, "2bw": 1, "2bw+ef": 1}
    assert study.own_lr_table(one)["seeds"].tolist() == [1, 1, 1]  # seed 0's sweep


def test_the_own_lr_table_says_what_each_async_variant_gains_at_its_own_lr():
    """What each async variant gains at its own best LR over its loss at sync's best LR (seed 0), and EF's share of
    the gap at both, once both variants ran at sync's LR."""
    at = {0.5: {"lr_scale": 0.5, "lr": 0.01}, 1.0: {"lr": 0.02}, 2.0: {"lr_scale": 2.0, "lr": 0.04}}
    losses = {"sync": (2.99, 2.97, 2.96), "2bw": (3.05, 3.00, 3.02), "2bw+ef": (3.00, 2.98, None)}
    rows = [("muon", label, 0, loss, {"group": "long", "parameters": 1000, **at[x]})
            for label, values in losses.items() for x, loss in zip(at, values) if loss is not None]
    cols = ["lr", "lower than at sync's lr", "recovered by ef, own lrs", "recovered by ef, sync's lr"]
    digits = {"lr": "g", "lower than at sync's lr": 3, "recovered by ef, own lrs": "%",
              "recovered by ef, sync's lr": "%"}
    table = study.formatted(study.own_lr_table(_runs(rows)), digits).set_index("variant")
    assert table.loc["sync", "lr"] == "0.04"
    assert table.loc["2bw", cols].tolist() == ["0.02", "0.020", "—", "—"]
    assert table.loc["2bw+ef", cols].tolist() == ["0.02", "—", "50%", "—"]  # not run at sync's LR
    rows.append(("muon", "2bw+ef", 0, 2.99, {"group": "long", "parameters": 1000, **at[2.0]}))
    table = study.formatted(study.own_lr_table(_runs(rows)), digits).set_index("variant")
    assert table.loc["2bw", cols].tolist() == ["0.02", "0.020", "—", "—"]
    assert table.loc["2bw+ef", cols].tolist() == ["0.02", "0.010", "50%", "50%"]


def test_the_own_best_table_pairs_every_seed_at_each_variants_own_lr():
    """Each async variant at its own best LR (picked on seed 0's sweep) with every seed it has there, long-own-lr's
    included, paired by seed with sync at its best; beside it the variant's gap at sync's LR; an own LR at the
    sweep's edge is marked."""
    def at(x, group="long"):
        return {"group": group, "parameters": 1000, "lr_scale": x, "lr": 0.02 * x}

    rows = [("muon", "sync", 0, loss, at(x)) for x, loss in ((0.5, 2.99), (1.0, 2.97), (2.0, 2.98))]
    rows += [("muon", "sync", k, 2.97 + k / 100, at(1.0)) for k in (1, 2)]
    rows += [("muon", "2bw", 0, loss, at(x)) for x, loss in ((0.5, 3.00), (1.0, 3.02))]
    rows += [("muon", "2bw", k, loss, at(0.5, "long-own-lr")) for k, loss in ((1, 3.02), (2, 3.01))]
    rows += [("muon", "2bw+ef", 0, loss, at(x)) for x, loss in ((0.5, 3.00), (1.0, 2.98), (2.0, 2.99))]
    rows.append(("muon", "2bw+ef", 1, 2.986, at(1.0)))
    table = study.own_best_table(_runs(rows)).set_index("variant")
    assert table.loc["sync"].tolist() == ["muon", "0.02", "2.980 (3)", "—", "—"]
    assert table.loc["2bw"].tolist() == ["muon", "0.01 (×0.5, edge)", "3.010 (3)", "+0.030 ± 0.025 (n=3)",
                                         "+0.050 (n=1, no interval)"]
    assert table.loc["2bw+ef"].tolist() == ["muon", "0.02 (×1)", "2.983 (2)", "+0.008 ± 0.025 (n=2)",
                                            "+0.008 ± 0.025 (n=2)"]


def test_main_table_at_each_optimizers_sync_tuned_lr():
    """The full-length table holds long.json's own LRs and each optimizer's sync-tuned one, whose seed 0 is the LR
    sweeps' run; the headline point is the tuned one once it has sync and 2bw, long.json's LR until then."""
    def at(group, x, lr):
        return {"group": group, "parameters": 1000, "lr_scale": x, "lr": lr}

    rows = [("adamw", v, 0, loss, at("long", 1.0, 0.003)) for v, loss in (("sync", 3.0), ("2bw", 3.5))]
    rows += [("muon", v, k, loss + k / 100, at("long", 1.0, 0.02)) for v, loss in (("sync", 2.97), ("2bw", 3.0))
             for k in (0, 1)]
    rows += [("muon", "sync", 0, loss, at("long-lr", x, 0.02 * x)) for x, loss in ((0.5, 2.99), (2.0, 2.96),
                                                                                     (4.0, 2.98))]
    runs = _runs(rows)
    assert study.sync_tuned_lr(runs) == {"muon": 0.04}  # AdamW has one LR: no sweep to tune by
    table = study.long_table(runs).set_index(["optimizer", "lr"])
    assert list(table.index) == [("adamw", "0.003"), ("muon", "0.02"), ("muon", "0.04 (sync's best)")]
    assert table.loc[("muon", "0.04 (sync's best)"), "sync"] == "2.960 (1)"
    assert table.loc[("muon", "0.04 (sync's best)"), "2bw"] == "—"
    assert table.loc[("muon", "0.02"), "2bw − sync"] == "+0.030 ± 0.000 (n=2)"
    head = study.headline_runs(runs)
    muon = head[head["optimizer"] == "muon"]
    assert muon["lr"].round(6).eq(0.02).all() and study.sync_tuned_lr(runs)["muon"] == 0.04
    assert f"{study.gap_table(muon).loc['muon', 'gap']:+.3f}" == "+0.030"
    assert f"{study.PAPER.loc['muon', '2bw'] - study.PAPER.loc['muon', 'sync']:+.3f}" == "+0.012"

    tuned = [("muon", "2bw", 0, 2.97, at("long-async-lr", 2.0, 0.04)),
             ("muon", "sync", 1, 2.965, at("long-tuned", 2.0, 0.04)),
             ("muon", "2bw", 1, 2.985, at("long-tuned", 2.0, 0.04)),
             ("muon", "2bw+ef", 1, 2.975, at("long-tuned", 2.0, 0.04))]  # its seed 0 not run yet
    runs = _runs(rows + tuned)
    table = study.long_table(runs).set_index(["optimizer", "lr"])
    assert table.loc[("muon", "0.04 (sync's best)"), "sync"] == "2.962 (2)"
    assert table.loc[("muon", "0.04 (sync's best)"), "2bw − sync"] == "+0.015 ± 0.064 (n=2)"
    assert table.loc[("muon", "0.04 (sync's best)"), "2bw+ef − sync"] == "+0.010 (n=1, no interval)"
    sweep = study.long_lr_table(runs).set_index("lr")  # seed 0 alone: seed 1 of one point does not mix in
    assert sweep.loc["0.04", "sync"] == "2.960" and sweep.loc["0.04", "2bw+ef"] == "—"
    head = study.headline_runs(runs)
    muon = head[head["optimizer"] == "muon"]
    assert muon["lr"].round(6).eq(0.04).all()
    assert f"{study.gap_table(muon).loc['muon', 'gap']:+.3f}" == "+0.015"


def test_full_length_curves_are_the_headline_points():
    """The notebook's full-length curves are each optimizer's headline point from the committed results: Muon's at
    its sync-tuned LR with every seed, not long.json's LR."""
    runs = study.load_results()
    long = runs[runs["group"].isin(study.LONG_GROUPS)]
    head = study.headline_runs(long)
    fig = plots.plot_curves(head, labels=("sync", "2bw", "2bw+ef"), ref=study.reference(long, group="long"),
                            free="lr_scale")
    panel = next(ax for ax in fig.axes if ax.get_title() == "muon")
    sync = head[(head["optimizer"] == "muon") & (head["label"] == "sync")]
    assert sync["lr"].round(6).eq(0.04).all() and len(sync) == 3
    line = next(ln for ln in panel.lines if ln.get_label() == "sync (n=3)")
    assert line.get_ydata()[-1] == pytest.approx(sync["val_loss"].map(lambda v: v[-1]).mean())


def test_lambda_grid_and_delay_table_by_hand():
    """long-lambda's grid: per LR, sync and 2bw (x1's from long-lengths at that length), each lambda's loss, the
    best lambda, those beating 2bw and those that diverged; long-delay's variable against constant delay."""
    def at(group, x, lam=None, tokens=100, **extra):
        return {"group": group, "lr_scale": x, "lr": 0.02 * x, "tokens": tokens, "ef_lambda": lam, **extra}

    rows = [("muon", "sync", 0, 3.0, at("long-lengths", 1.0)), ("muon", "2bw", 0, 3.3, at("long-lengths", 1.0)),
            ("muon", "sync", 0, 2.0, at("long-lengths", 1.0, tokens=900)),  # another length: left out
            ("muon", "sync", 0, 3.1, at("long-lambda", 2.0)), ("muon", "2bw", 0, 3.6, at("long-lambda", 2.0))]
    rows += [("muon", "2bw+ef" + ("" if lam == 1 else f" λ={lam:g}"), 0, loss, at("long-lambda", 1.0, lam))
             for lam, loss in ((0.5, 3.2), (1.0, 3.1), (2.0, 3.15), (3.0, 3.4))]
    rows += [("muon", "2bw+ef λ=0.5", 0, 3.5, at("long-lambda", 2.0, 0.5)),
             ("muon", "2bw+ef λ=3", 0, math.nan, at("long-lambda", 2.0, 3.0, diverged=True))]
    grid = study.lambda_grid(_runs(rows)).set_index("lr")
    assert grid.loc[0.02, "sync"] == 3.0 and grid.loc[0.02, "λ=0 (2bw)"] == 3.3 and grid.loc[0.02, "best λ"] == 1.0
    assert grid.loc[0.02, "beat 2bw"] == "0.5, 1, 2" and grid.loc[0.02, "diverged"] == "—"
    assert grid.loc[0.04, "beat 2bw"] == "0.5" and grid.loc[0.04, "diverged"] == "3"
    assert math.isnan(grid.loc[0.04, "λ=3"]) and math.isnan(grid.loc[0.04, "λ=1"])
    # which lambda trained where (a loss), beat 2bw where, and the best by LR
    assert {lam: grid[f"λ={lam:g}"].map(math.isfinite).tolist() for lam in study.LAMBDAS} == {
        0.5: [True, True], 1.0: [True, False], 2.0: [True, False], 3.0: [True, False]}
    assert grid.loc[0.04, "best λ"] == 0.5 and "3" not in grid.loc[0.02, "beat 2bw"].split(", ")
    assert grid.loc[0.02, "closed at best λ"] == pytest.approx(2 / 3)  # (3.3 - 3.1) / (3.3 - 3.0)
    assert grid.loc[0.04, "closed at best λ"] == pytest.approx(0.2)  # (3.6 - 3.5) / (3.6 - 3.1)
    high = [("muon", "sync", 0, math.nan, at("long-lambda", 8.0, diverged=True)),
            ("muon", "2bw", 0, math.nan, at("long-lambda", 8.0, diverged=True)),
            ("muon", "2bw+ef", 0, 3.9, at("long-lambda", 8.0, 1.0)),
            ("muon", "2bw+ef λ=3", 0, math.nan, at("long-lambda", 8.0, 3.0, diverged=True))]
    top = study.lambda_grid(_runs(rows + high)).set_index("lr").loc[0.16]  # where 2bw diverged, EF beat it
    assert top["beat 2bw"] == "1" and top["diverged"] == "sync, 0, 3" and top["best λ"] == 1.0
    both = study.lambda_grid(_runs(rows + high)).set_index("lr")
    assert both["λ=1"].map(math.isfinite).tolist() == [True, False, True]  # trained at 0.02 and 0.16
    assert ["1" in b.split(", ") for b in both["beat 2bw"]] == [True, False, True]  # beat 2bw there
    # the committed grid, as the page's prose reads it: every lambda trained and beat 2bw at every LR
    committed = study.lambda_grid(study.load_results())
    assert committed["beat 2bw"].eq("0.5, 1, 2, 3").all() and committed["diverged"].eq("—").all()
    assert {o: part["best λ"].tolist() for o, part in committed.groupby("optimizer")} == {
        "adamw": [2.0, 3.0, 2.0, 1.0, 1.0], "muon": [1.0, 1.0, 1.0, 1.0, 2.0]}
    fig = plots.plot_lambda_grid(grid.reset_index())
    assert len(fig.axes) == 1 and len(fig.axes[0].lines) == 4  # a line per LR and its sync level
    assert [v if math.isfinite(v) else None for v in fig.axes[0].lines[2].get_ydata()] == [3.6, 3.5, None, None,
                                                                                           None]  # lr 0.04
    shown = study.lambda_block(_runs(rows).assign(command="c", card="card", commit="abc", declared_commit=None,
                                                  dirty=False))
    assert "| muon | 0.04 | 3.100 | 3.600 | 3.500 | — | — | — | 0.5 | 0.5 | 3 | 20% (n=1, no interval) |" in shown

    delay = [("adamw", label, 0, loss, {"group": "long-delay", "schedule": sched, "stages": p})
             for label, sched, p, loss in (("sync", "1f1b", 1, 3.0), ("2bw", "2bw", 1, 3.2),
                                           ("pipedream p=3", "pipedream", 3, 3.25), ("delay1", "delay1", 3, 3.21),
                                           ("pipedream p=5", "pipedream", 5, 3.5), ("delay2", "delay2", 5, 3.4))]
    table = study.delay_table(_runs(delay)).set_index("stages")
    assert table.loc[3, "pipedream − constant"] == pytest.approx(0.04)
    assert table.loc[5, "gap constant"] == pytest.approx(0.4) and table.loc[5, "gap 2bw"] == pytest.approx(0.2)
    assert table["seeds"].tolist() == [1, 1]  # seed 0 alone, said in the table
    shown = study.delay_block(_runs(delay).assign(command="c", card="card", commit="abc", declared_commit=None,
                                                  dirty=False))
    assert "| adamw | 3 | 3.000 | 3.200 | 3.250 | 3.210 | +0.200 | +0.250 | +0.210 | +0.040 |" in shown
    assert study.delay_block(_runs(rows)) == "Not run yet.\n"


def test_steps_against_tokens_by_hand():
    """long-batch's half and twice the batch at the same tokens sit beside long.json's own batch, at each optimizer's
    sync-tuned LR: steps, the gaps paired by seed, EF's share; the page's block waits for its runs."""
    def at(group, batch, lr, x=1.0):
        return {"group": group, "parameters": 1000, "lr_scale": x, "lr": lr, "batch": batch, "steps": 256 * 10 // batch,
                "tokens_per_step": batch * 4}

    own = [("adamw", v, k, loss + k / 100, at("long", 256, 0.003)) for v, loss in (("sync", 3.0), ("2bw", 3.6),
                                                                                    ("2bw+ef", 3.3)) for k in (0, 1)]
    sweep = [("adamw", "sync", 0, loss, at("long-lr", 256, 0.003 * x, x)) for x, loss in ((0.5, 3.02), (2.0, 3.04))]
    other = [("adamw", v, 0, loss, at("long-batch", b, 0.003)) for b, losses in ((128, (3.1, 3.9, 3.5)),
                                                                                  (512, (3.05, 3.35, 3.2)))
             for v, loss in zip(("sync", "2bw", "2bw+ef"), losses)]
    off_lr = [("adamw", "2bw", 0, 9.0, at("long-lr", 256, 0.0015, 0.5))]  # not at sync's best LR: left out
    runs = _runs(own + sweep + other + off_lr)
    table = study.batch_table(runs).set_index("batch")
    assert table.index.tolist() == [128, 256, 512] and table["steps"].tolist() == [20, 10, 5]
    assert table["lr"].eq("0.003").all()
    assert table.loc[256, "sync"] == "3.005 (2)" and table.loc[256, "2bw − sync"] == "+0.600 ± 0.000 (n=2)"
    assert table.loc[128, "2bw − sync"] == "+0.800 (n=1, no interval)"
    assert table.loc[512, "2bw+ef − sync"] == "+0.150 (n=1, no interval)"
    assert table.loc[512, "recovered by ef"] == "50% (n=1, no interval)"
    gaps = study.batch_gaps(runs).set_index(["batch", "variant"])
    assert gaps.loc[(128, "2bw"), ["steps", "tokens/step", "n"]].tolist() == [20, 512, 1]
    assert gaps.loc[(256, "2bw+ef"), "gap"] == pytest.approx(0.3) and gaps.loc[(256, "2bw+ef"), "n"] == 2
    assert math.isnan(gaps.loc[(512, "2bw"), "gap half"])
    assert study.batch_block(_runs(own + sweep)) == "Not run yet.\n"
    block = study.batch_block(runs.assign(command="c", card="card", commit="abc", declared_commit=None, dirty=False))
    assert "| adamw | 0.003 | 512 | 5 | 3.050 (1) |" in block and "6 emulation runs on card" in block
    fig = plots.plot_batch(study.batch_gaps(runs))
    assert [ax.get_xscale() for ax in fig.axes] == ["log", "log"]
    assert len(fig.axes[0].get_lines()) >= 2  # a line per variant (and the zero line)


def test_steps_rule_by_hand():
    """The page's rule for steps against tokens, fixed before the seeds ran: three seeds at every batch decide; the
    half-batch interval wholly below long.json's and the double-batch one wholly above say the steps, a half-batch
    interval reaching long.json's mean says the tokens a step, anything else is undecided."""
    own = (0.055, 0.008, 3)
    assert study.steps_rule((0.029, 0.01, 3), own, (0.096, 0.012, 3)) == "the steps"
    assert study.steps_rule((0.029, 0.01, 3), own, (0.07, 0.012, 3)) == "undecided"  # 0.058 < 0.063: overlaps
    assert study.steps_rule((0.050, 0.006, 3), own, (0.096, 0.012, 3)) == "the tokens a step"  # 0.056 >= 0.055
    assert study.steps_rule((0.040, 0.010, 3), own, (0.096, 0.012, 3)) == "undecided"  # 0.050: below the mean only
    assert study.steps_rule((0.029, 0.0, 1), own, (0.096, 0.012, 2)) == "open (seeds 1, 3, 2; needs 3 each)"

    def at(group, batch, lr=0.04, x=1.0):
        return {"group": group, "parameters": 1000, "lr_scale": x, "lr": lr, "batch": batch,
                "steps": 256 * 10 // batch, "tokens_per_step": batch * 4}

    # Muon's 2BW gaps over seeds 0-2 at batch 128, 256 (long.json's, at its sync-tuned LR 0.04 of a sweep of two)
    # and 512; AdamW at long.json's batch and twice it, seed 0 alone.
    gap = {128: (0.028, 0.03, 0.032), 256: (0.05, 0.055, 0.06), 512: (0.098, 0.1, 0.102)}
    muon = [("muon", label, k, 3.0 + k / 10 + (g[k] if label == "2bw" else 0.0),
             at("long" if b == 256 else "long-batch", b)) for b, g in gap.items() for label in ("sync", "2bw")
            for k in range(3)]
    sweep = [("muon", "sync", 0, 3.2, at("long-lr", 256, 0.02, 0.5)),
             ("adamw", "sync", 0, 3.2, at("long-lr", 256, 0.006, 2.0))]
    adamw = [("adamw", "sync", 0, 3.0, at("long", 256, 0.003)), ("adamw", "2bw", 0, 3.5, at("long", 256, 0.003)),
             ("adamw", "sync", 0, 3.1, at("long-batch", 512, 0.003)),
             ("adamw", "2bw", 0, 4.3, at("long-batch", 512, 0.003))]
    table = study.steps_rule_table(_runs(muon + sweep + adamw)).set_index("optimizer")
    assert table.columns.tolist() == ["batch 128", "batch 256", "batch 512", "the rule says"]
    # t(2) 4.303 x sd / sqrt 3: sd 0.002 -> 0.005, sd 0.005 -> 0.012; 0.035 < 0.043 and 0.095 > 0.067
    assert table.loc["muon"].tolist() == ["+0.030 ± 0.005 (n=3)", "+0.055 ± 0.012 (n=3)", "+0.100 ± 0.005 (n=3)",
                                          "the steps"]
    assert table.loc["adamw"].tolist() == ["—", "+0.500 (n=1, no interval)", "+1.200 (n=1, no interval)",
                                           "open (seeds 0, 1, 1; needs 3 each)"]


def test_full_length_lambda_by_hand():
    """long-adamw-lambda's runs at sync's tuned LR pair by seed with that point's sync, 2bw and lambda-1 runs: each
    lambda's loss with its n, its gap to sync, EF's share and its difference to lambda 1 over the seeds it has; the
    page's block waits for them."""
    def at(group, lr, x=1.0, lam=None):
        return {"group": group, "parameters": 1000, "lr_scale": x, "lr": lr,
                **({"ef_lambda": lam} if lam is not None else {})}

    own = [("adamw", v, k, loss + k / 100, at("long", 0.003, lam=lam))
           for v, loss, lam in (("sync", 3.0, None), ("2bw", 3.6, None), ("2bw+ef", 3.3, 1.0)) for k in (0, 1)]
    sweep = [("adamw", "sync", 0, loss, at("long-lr", 0.003 * x, x)) for x, loss in ((0.5, 3.02), (2.0, 3.04))]
    lam = [("adamw", "2bw+ef λ=2", 0, 3.15, at("long-adamw-lambda", 0.003, lam=2.0)),
           ("adamw", "2bw+ef λ=3", 0, 3.2, at("long-adamw-lambda", 0.003, lam=3.0)),
           ("adamw", "2bw+ef λ=3", 1, 3.25, at("long-adamw-lambda", 0.003, lam=3.0)),
           ("adamw", "2bw+ef λ=2", 0, 9.0, at("long-adamw-lambda", 0.0015, 0.5, lam=2.0))]  # off sync's LR: left out
    runs = _runs(own + sweep + lam)
    table = study.full_lambda_table(runs).set_index("λ")
    assert table.index.tolist() == ["1", "2", "3"] and table["lr"].eq("0.003").all()
    assert table["sync"].eq("3.005 (2)").all() and table["2bw"].eq("3.605 (2)").all()
    assert table.loc["1", "2bw+ef − sync"] == "+0.300 ± 0.000 (n=2)" and table.loc["1", "recovered by ef"] == (
        "50% ± 0% (n=2)")
    assert table.loc["2", "2bw+ef"] == "3.150 (1)" and table.loc["2", "2bw+ef − sync"] == "+0.150 (n=1, no interval)"
    assert table.loc["2", "recovered by ef"] == "75% (n=1, no interval)"  # (3.6 - 3.15) / (3.6 - 3.0), seed 0 alone
    # seed 0: 3.2 - 3.0, seed 1: 3.25 - 3.01; shares over both seeds (3.605 - 3.225) / (3.605 - 3.005)
    assert table.loc["3", "2bw+ef − sync"].startswith("+0.220 ± ") and table.loc["3", "2bw+ef − sync"].endswith(
        "(n=2)")
    assert table.loc["3", "recovered by ef"].startswith("63% ± ")
    # each lambda against lambda 1, paired by seed: seed 0 alone for lambda 2, both seeds for lambda 3
    assert table.loc["1", "− λ=1"] == "—" and table.loc["2", "− λ=1"] == "-0.150 (n=1, no interval)"
    assert table.loc["3", "− λ=1"] == "-0.080 ± 0.254 (n=2)"  # -0.1 and -0.06: t(1) 12.706 x sd 0.0283 / sqrt 2
    assert study.full_lambda_block(_runs(own + sweep)) == "Not run yet.\n"
    block = study.full_lambda_block(runs.assign(command="c", card="card", commit="abc", declared_commit=None,
                                                dirty=False))
    assert "| adamw | 0.003 | 2 | 3.005 (2) | 3.605 (2) | 3.150 (1) |" in block and "4 emulation runs on card" in block


def test_lambda_rule_by_hand():
    """The page's rule for advising an EF strength above 1, fixed before the seeds ran: with three seeds, a lambda
    whose loss minus lambda 1's has its interval wholly below zero is below; the advice is the lowest such mean once
    every lambda is decided, lambda 1 if none is below."""
    below, above, close = (-0.05, 0.01, 3), (0.02, 0.01, 3), (-0.05, 0.06, 3)
    assert study.lambda_rule({2.0: below, 3.0: close}) == ({2.0: "below λ = 1", 3.0: "not below"}, "λ = 2")
    assert study.lambda_rule({2.0: below, 3.0: (-0.07, 0.01, 3)})[1] == "λ = 3"  # both below: the lower mean
    assert study.lambda_rule({2.0: above, 3.0: close}) == ({2.0: "not below", 3.0: "not below"}, "λ = 1")
    assert study.lambda_rule({2.0: below, 3.0: (-0.2, math.nan, 1)}) == (
        {2.0: "below λ = 1", 3.0: "open (seeds 1; needs 3)"}, "open")

    def at(group, lr, x=1.0, lam=None):
        return {"group": group, "parameters": 1000, "lr_scale": x, "lr": lr,
                **({"ef_lambda": lam} if lam is not None else {})}

    # lambda 1 at 3.30, 3.31, 3.32 (seeds 0-2); lambda 2 0.05 +- 0.005 below it; lambda 3 at seed 0 alone
    own = [("adamw", v, k, loss + k / 100, at("long", 0.003, lam=lam))
           for v, loss, lam in (("sync", 3.0, None), ("2bw", 3.6, None), ("2bw+ef", 3.3, 1.0)) for k in range(3)]
    sweep = [("adamw", "sync", 0, 3.02, at("long-lr", 0.0015, 0.5))]
    lam = [("adamw", "2bw+ef λ=2", k, 3.3 + k / 100 - d, at("long-adamw-lambda", 0.003, lam=2.0))
           for k, d in enumerate((0.048, 0.05, 0.052))] + [
        ("adamw", "2bw+ef λ=3", 0, 3.2, at("long-adamw-lambda", 0.003, lam=3.0))]
    table = study.lambda_rule_table(_runs(own + sweep + lam)).set_index("λ")
    assert table.index.tolist() == ["2", "3"] and table["lr"].eq("0.003").all()
    # t(2) 4.303 x sd 0.002 / sqrt 3
    assert table.loc["2"].tolist() == ["adamw", "0.003", "-0.050 ± 0.005 (n=3)", "below λ = 1", "open"]
    assert table.loc["3"].tolist() == ["adamw", "0.003", "-0.100 (n=1, no interval)", "open (seeds 1; needs 3)",
                                       "open"]


def test_moe_table_by_hand():
    """The Mixtral study's table: per way of orthogonalising the experts' gate_up_proj, sync / 2bw / 2bw+ef with
    the gaps paired by seed and EF's share, then the paper's 10B MoE."""
    fused = [("muon", label, k, loss + k / 100, {"group": "long-moe"})
             for label, loss in (("sync", 3.0), ("2bw", 3.02), ("2bw+ef", 3.01)) for k in (0, 1)]
    split = [("muon", label, 0, loss, {"group": "long-moe-ns"}) for label, loss in (("sync", 2.99), ("2bw+ef", 3.0))]
    table = study.moe_table(_runs(fused + split)).set_index("gate_up_proj")
    assert table.loc["one matrix per expert", "2bw − sync"] == "+0.020 ± 0.000 (n=2)"
    assert table.loc["one matrix per expert", "recovered by ef"] == "50% ± 0% (n=2)"  # each seed recovers half
    assert table.loc["gate and up apart", "sync"] == "2.990 (1)" and table.loc["gate and up apart", "2bw"] == "—"
    assert table.loc["gate and up apart", "2bw+ef − sync"] == "+0.010 (n=1, no interval)"
    assert table.loc["paper, 10B MoE"].tolist() == ["1.906", "1.911", "1.906", "+0.005", "+0.000", "100%"]
    assert study.moe_block(_runs(fused).assign(group="long")) == "Not run yet.\n"
    # what the choice reads: split - fused at seed 0 is -0.010 (sync) and -0.010 (2bw+ef), fused's seeds spread 0.010
    digits = {"split − fused": "+3", "fused seeds' spread": 3}
    choice = study.formatted(study.moe_choice_table(_runs(fused + split)), digits).set_index("variant")
    assert choice[["split − fused", "fused seeds", "fused seeds' spread"]].values.tolist() == [
        ["-0.010", 2, "0.010"], ["-0.010", 2, "0.010"]]
    worse = [(o, label, k, loss + 0.05, extra) for o, label, k, loss, extra in split]  # fused better beyond spread
    choice = study.moe_choice_table(_runs(fused + worse)).set_index("variant")
    assert (choice["split − fused"] > choice["fused seeds' spread"]).all()
    choice = study.moe_choice_table(_runs(fused + worse[:1])).set_index("variant")  # split's 2bw+ef missing
    assert math.isnan(choice.loc["2bw+ef", "split − fused"]) and math.isfinite(choice.loc["sync", "split − fused"])
    choice = study.moe_choice_table(_runs([r for r in fused if r[2] == 0] + split))  # fused has one seed
    assert choice["fused seeds"].tolist() == [1, 1] and choice["fused seeds' spread"].isna().all()
    assert "| sync | 3.0000 | 2.9900 | -0.0100 | 2 | 0.0100 |" in study.moe_block(_runs(fused + split).assign(
        command="c", card="card", commit="abc", declared_commit=None, dirty=False))
    timed = _runs(fused + split).assign(command="c", card="card", commit="abc", declared_commit=None, dirty=False,
                                        seconds_per_step=0.5, tokens_per_step=1e6, steps=120)
    assert study.moe_block(timed).endswith("\nTraining clock (each run's summary `seconds`, compiling included):\n\n"
                                           "| card | runs | M tokens/s | min a run |\n|---|---|---|---|\n"
                                           "| card | 8 | 2.00–2.00 | 1.0–1.0 |\n")


def _paired_runs(rows, noise_rows=()) -> pd.DataFrame:
    """Hand-made engine pairs (optimizer, label, seed, emulation loss, engine loss), plus main matrix runs
    (optimizer, label, seed, loss) for the seed noise."""
    base = {"model": "m", "seq_len": 256, "batch": 48, "tokens": 1000, "lr_scale": 1.0, "diverged": False,
            "complete": True, "card": "card", "seconds_per_step": 0.1, "tokens_per_step": 100,
            "train_steps": [1, 2], "val_steps": [2]}
    out = []
    for opt, label, seed, emu, eng in rows:
        for runner, val in (("emulation", emu), ("engine", eng)):
            out.append({**base, "path": f"{runner}/pairs/{opt}-{label}-s{seed}", "group": "pairs",
                        "optimizer": opt, "label": label, "seed": seed, "runner": runner, "micro_batches": 2,
                        "final_val": val, "train_loss": [9.0, val + 1], "val_loss": [val],
                        "config_key": f"{opt}/{label}/{seed}"})
    for opt, label, seed, val in noise_rows:
        out.append({**base, "path": f"emulation/main/{opt}-{label}-s{seed}", "group": "main", "optimizer": opt,
                    "label": label, "seed": seed, "runner": "emulation", "micro_batches": 1, "final_val": val,
                    "train_loss": [9.0, val + 1], "val_loss": [val], "config_key": f"main/{opt}/{label}/{seed}"})
    return pd.DataFrame(out)


def test_model_parameters_count_as_hf_does():
    """The results' parameter count of a LLaMA and of a Mixtral (every expert and router) is HF's own count, and a
    Mixtral's model key names its experts, so that it never reads as the dense model of its shape."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    shape = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    moe = json.loads((ROOT / "launch" / "study" / "long_moe.json").read_text())["ds_async"]["model"]["config"]
    for cls, config in ((LlamaForCausalLM, LlamaConfig(**shape)),
                        (MixtralForCausalLM, MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)),
                        (MixtralForCausalLM, MixtralConfig(**moe))):
        with torch.device("meta"):
            model = cls(config)
        assert study.model_parameters(config.to_dict()) == model.num_parameters()
    assert study.model_parameters(MixtralConfig(**moe).to_dict()) == 43_290_112  # long_moe.json: 43.3M
    assert study.model_key(MixtralConfig(**moe).to_dict()) == "h512-L7-v8192-e8k2"
    assert study.model_key(LlamaConfig(**shape).to_dict()) == "h32-L3-v96"
    assert study.model_parameters({"model_type": "gpt2"}) is None


def test_engine_table_judges_the_difference_against_the_main_matrix_seed_noise():
    runs = _paired_runs([("muon", "2bw+ef", 0, 5.20, 5.21), ("muon", "2bw+ef", 1, 5.22, 5.25),
                         ("adamw", "2bw", 0, 6.5, 6.5), ("adamw", "sync", 0, 6.0, 6.1)],
                        noise_rows=[("muon", "2bw+ef", s, v) for s, v in ((0, 5.20), (1, 5.21), (2, 5.22))]
                        + [("adamw", "2bw", s, 6.5 + 0.2 * s) for s in (0, 1, 2)])
    table = study.engine_table(runs).set_index(["optimizer", "label", "seed"]).sort_index()
    assert len(table) == 4
    muon = table.loc[("muon", "2bw+ef")]
    assert muon["seed std"].tolist() == pytest.approx([0.01, 0.01]) and set(muon["source"]) == {"main matrix"}
    assert muon["diff"].tolist() == pytest.approx([0.01, 0.03])
    assert muon["|diff|/σ"].tolist() == pytest.approx([1.0, 3.0])
    assert muon["verdict"].tolist() == ["within noise", "outside noise"]
    assert table.loc[("adamw", "2bw", 0), "verdict"] == "identical"
    # no main-matrix runs of adamw sync and a single seed of its own: no noise estimate
    sync = table.loc[("adamw", "sync", 0)]
    assert math.isnan(sync["seed std"]) and sync["verdict"] == "no noise estimate"
    assert sync["train max rel"] == pytest.approx(0.1 / 7.0)
    summary = study.engine_summary(study.engine_table(runs))
    assert summary.loc[("muon", "2bw+ef"), "verdict"] == "outside noise"
    assert summary.loc[("muon", "2bw+ef"), "max |diff|/σ"] == "3.00"
    assert summary.loc[("adamw", "2bw"), "verdict"] == "identical"
    assert study.within_noise(0.015, 0.01) == "within 2σ"
    # the engine runs stay out of the main table
    ref = study.reference(runs)
    assert set(study.at_reference(runs, ref)["runner"]) == {"emulation"}


# ---------------------------------------------------------------------------------------------------------------
# The matrices


def test_every_run_of_every_matrix_is_a_valid_config():
    """Each run's JSON parses as strictly as launch/train.py parses it, with a batch split the engine accepts."""
    for name in matrices.MATRICES:
        for run in matrices.matrix(name):
            config = run.config()
            section = config.pop("ds_async")
            cfg = cfgmod.parse(section)
            cfgmod.check_batch(config, cfg, cfg.pipeline_stages * data_parallel_degree(config))
            assert config["scheduler"]["params"]["total_num_steps"] == cfg.train.steps, (name, run.name)


def test_matrices_and_split():
    main = matrices.matrix("main")
    assert len(main) == 18 and len({r.name for r in main}) == 18
    configs = {r.name: r.config() for r in main}
    assert {(c["optimizer"]["type"], c["ds_async"]["schedule"], c["ds_async"].get("correction", {}).get("type"))
            for c in configs.values()} == {(o, s, c) for o in ("AdamW", "Muon")
                                           for s, c in (("1f1b", None), ("2bw", None), ("2bw", "ef"))}
    assert {c["ds_async"]["seed"] for c in configs.values()} == {0, 1, 2}
    extras = matrices.matrix("extras")
    assert len(extras) == 32 and {r.group for r in extras} == {"tokens", "lr", "batch", "depth", "ef_lambda",
                                                                "nesterov"}
    depth = [r.config() for r in extras if r.group == "depth"]
    assert {c["ds_async"]["pipeline_stages"] for c in depth} == {2, 4, 8}
    assert {(c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) for c in depth} == {(48, 1)}
    # every sweep validates on the same held-out sequences and sees the same tokens per step or in all
    for run in extras + main:
        c = run.config()
        assert c["train_micro_batch_size_per_gpu"] * c["ds_async"]["eval"]["batches"] == 480, run.name
    batch = {r.name: r.config() for r in extras if r.group == "batch"}
    assert {n: (c["gradient_accumulation_steps"], c["ds_async"]["train"]["steps"]) for n, c in batch.items()} == {
        "adamw-sync-batch96": (4, 150), "adamw-2bw-batch96": (4, 150), "adamw-sync-batch192": (8, 75),
        "adamw-2bw-batch192": (8, 75)}
    lr = {r.name: r.config()["optimizer"]["params"] for r in extras if r.group == "lr"}
    assert lr["muon-2bw-lr2x"]["lr"] == pytest.approx(0.04) and lr["muon-2bw-lr2x"]["adam_lr"] == pytest.approx(6e-3)
    # the engine comparison's points are main's own runs, config for config
    pairs = matrices.matrix("pairs")
    assert len(pairs) == 9 and all(r.config() == configs[r.name] for r in pairs)
    for runs in (main, extras):
        shares = [driver.split(runs, i, 2) for i in range(2)]
        names = [f"{r.group}/{r.name}" for share in shares for r in share]
        assert sorted(names) == sorted(f"{r.group}/{r.name}" for r in runs)
        clock = driver.step_clock()
        loads = [sum(driver.cost(r, clock=clock) for r in share) for share in shares]
        assert max(loads) <= 1.1 * min(loads)
    assert len(matrices.matrix("tiny")) == 21 and len(matrices.matrix("tiny-pairs")) == 3


def test_long_lr_matrices_sweep_around_each_optimizers_tuned_point():
    """Sync's LR sweep brackets each optimizer's tuned scale; Muon's main point at its tuned LR is long's runs with
    both rates scaled, seed 0 trained once (long-lr's and long-async-lr's folders); the async variants' own sweep."""
    long = {r.name: r.config() for r in matrices.matrix("long")}
    lr = {r.name: r.config() for r in matrices.matrix("long-lr")}
    assert sorted(lr) == sorted(f"{o}-sync-lr{x:g}x-s0" for o, xs in matrices.SYNC_LR_SCALES.items() for x in xs)
    for opt, x in matrices.TUNED_LR.items():
        assert min(matrices.SYNC_LR_SCALES[opt]) < x < max(matrices.SYNC_LR_SCALES[opt])
    tuned = matrices.matrix("long-tuned")
    assert len(tuned) == 9 and {r.group for r in tuned} == {"long-lr", "long-async-lr", "long-tuned"}
    assert sorted(r.name for r in tuned if r.group != "long-tuned") == [
        "muon-2bw+ef-lr2x-s0", "muon-2bw-lr2x-s0", "muon-sync-lr2x-s0"]
    for r in tuned:
        variant, seed = r.name.split("-")[1], r.name.rsplit("-", 1)[1]
        assert r.config() == matrices.override(long[f"muon-{variant}-{seed}"], matrices.lr_scaled("muon", 2.0)), r.name
    asynchronous = {r.name for r in matrices.matrix("long-async-lr")}
    assert asynchronous == {f"{o}-{v}-lr{x:g}x-s0" for o, xs in matrices.ASYNC_LR_SCALES.items() for x in xs
                            for v in ("2bw", "2bw+ef")}


def test_the_own_lr_matrix_trains_each_async_variant_at_its_committed_own_best():
    """long-own-lr: sync at its tuned LR and each async variant at its own best (``OWN_LR``, inside the sweep planned
    for it), seeds 0-2, as long's runs with the LR scaled; a point another long matrix holds is that matrix's run;
    ``OWN_LR`` is the own best the committed results give, as a multiple of sync's best."""
    own = matrices.matrix("long-own-lr")
    assert len({(r.group, r.name) for r in own}) == len(own) == 18
    held = {(r.group, r.name) for m in ("long", "long-tuned", "long-async-lr") for r in matrices.matrix(m)}
    assert sorted((r.group, r.name) for r in own if (r.group, r.name) not in held) == [
        ("long-own-lr", f"adamw-{v}-s{k}") for v in ("2bw+ef-lr0.25x", "2bw-lr0.125x") for k in (1, 2)]
    long = {r.name: r.config() for r in matrices.matrix("long")}
    for r in own:
        opt, variant, seed = r.name.split("-")[0], r.name.split("-")[1], r.name.rsplit("-", 1)[1]
        x = {"sync": matrices.TUNED_LR[opt], **matrices.OWN_LR[opt]}[variant]
        assert r.config() == matrices.override(long[f"{opt}-{variant}-{seed}"], matrices.lr_scaled(opt, x)), r.name
    best = study.own_best_lr(study.load_results()).set_index(["optimizer", "label"])["lr"]
    for opt, scales in matrices.OWN_LR.items():
        planned = {1.0, matrices.TUNED_LR[opt], *matrices.ASYNC_LR_SCALES[opt]}
        for variant, x in scales.items():
            assert min(planned) < x < max(planned), (opt, variant)
            assert math.isclose(best[opt, variant] / best[opt, "sync"], x / matrices.TUNED_LR[opt]), (opt, variant)


def test_long_lambda_and_long_delay_matrices():
    """EF lambda x peak LR at 1/9 of long's length, with sync and 2bw at the LRs long-lengths lacks there; PipeDream
    at m = 1 against the constant delay of its mean on the same stages, with sync and 2bw at m = 1, at 1/3."""
    long = {r.name: r.config() for r in matrices.matrix("long")}
    lengths = {r.name: r.config() for r in matrices.matrix("long-lengths")}
    lam = {r.name: r.config() for r in matrices.matrix("long-lambda")}
    assert len(lam) == 56 == len(matrices.matrix("long-lambda"))
    assert all(c["ds_async"]["train"]["steps"] == 524 and c["ds_async"]["seed"] == 0 for c in lam.values())
    points = {(c["optimizer"]["type"], c["ds_async"]["correction"]["lambda"],
               c["optimizer"]["params"]["lr"] / long[f"{o}-sync-s0"]["optimizer"]["params"]["lr"])
              for n, c in lam.items() for o in [n.split("-")[0]] if "correction" in c["ds_async"]}
    assert points == {(t, x, y) for t in ("AdamW", "Muon") for x in (0.5, 1.0, 2.0, 3.0)
                      for y in (0.5, 1.0, 2.0, 4.0, 8.0)}
    references = {n for n, c in lam.items() if "correction" not in c["ds_async"]}
    assert references == {f"{o}-{v}-lr{x:g}x-len524-s0" for o in ("adamw", "muon") for v in ("sync", "2bw")
                          for x in (0.5, 2.0, 4.0, 8.0)}
    muon = lam["muon-2bw+ef-lambda3-lr2x-len524-s0"]
    assert muon["optimizer"]["params"]["adam_lr"] == pytest.approx(2 * long["muon-2bw+ef-s0"]["optimizer"]["params"]
                                                                   ["adam_lr"])
    # everything else is long-lengths' 2bw run at that length: lambda 0 at x1 is that run itself
    same = lam["muon-2bw+ef-lambda2-lr1x-len524-s0"]
    del same["ds_async"]["correction"]
    assert same == lengths["muon-2bw-len524-s0"]
    assert matrices.override(lam["muon-sync-lr2x-len524-s0"], matrices.lr_scaled("muon", 1.0)) == \
        lengths["muon-sync-len524-s0"]

    delay = {r.name: r.config() for r in matrices.matrix("long-delay")}
    assert len(delay) == 12 and {n.split("-", 1)[1] for n in delay} == {
        f"{k}-len1571-s0" for k in ("pipedream-p3", "delay1-p3", "pipedream-p5", "delay2-p5", "sync", "2bw")}
    assert all(c["ds_async"]["train"]["steps"] == c["scheduler"]["params"]["total_num_steps"] == 1571
               for c in delay.values())
    base = long["adamw-sync-s0"]
    for name, c in delay.items():
        # one micro-batch per step holding the step's sequences; validation on the same held-out sequences
        assert c["gradient_accumulation_steps"] == 1 and c["ds_async"]["seed"] == 0, name
        assert c["train_micro_batch_size_per_gpu"] == base["train_micro_batch_size_per_gpu"] * \
            base["gradient_accumulation_steps"]
        assert c["train_micro_batch_size_per_gpu"] * c["ds_async"]["eval"]["batches"] == \
            base["train_micro_batch_size_per_gpu"] * base["ds_async"]["eval"]["batches"]
    for opt in ("adamw", "muon"):
        for p in (3, 5):
            pd, const = (delay[f"{opt}-pipedream-p{p}-len1571-s0"],
                         delay[f"{opt}-delay{(p - 1) // 2}-p{p}-len1571-s0"])
            assert pd["ds_async"]["pipeline_stages"] == const["ds_async"]["pipeline_stages"] == p
            assert matrices.override(const, {"ds_async.schedule": "pipedream"}) == pd  # only the rule differs
            variable = [get("pipedream").delay(s, p, 1) for s in range(p)]
            assert [get(const["ds_async"]["schedule"]).delay(s, p, 1) for s in range(p)] == \
                [sum(variable) / p] * p


def test_long_batch_and_adamw_lambda_matrices():
    """long-batch: long's tokens at half and twice its batch (steps x2 and /2, warm-up 10% of them, validation at the
    same token points), sync / 2bw / 2bw+ef at each optimizer's sync-tuned LR, seed 0, seeds 1-2 apart;
    long-adamw-lambda: AdamW 2bw + EF at lambda 1-3, full length, sync's LR, seeds 0-2, lambda 1 being long's runs."""
    long = {r.name: r.config() for r in matrices.matrix("long")}
    batch = {r.name: r.config() for r in matrices.matrix("long-batch")}
    assert len(batch) == 12 == len(matrices.matrix("long-batch"))
    assert {r.group for r in matrices.matrix("long-batch") + matrices.matrix("long-batch-seeds")} == {"long-batch"}
    assert {(c["ds_async"]["seed"]) for c in batch.values()} == {0}
    assert sorted({r.config()["ds_async"]["seed"] for r in matrices.matrix("long-batch-seeds")}) == [1, 2]
    assert len(matrices.matrix("long-batch-seeds")) == 24
    shape = {(c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["ds_async"]["train"]["steps"],
              c["scheduler"]["params"]["total_num_steps"], c["scheduler"]["params"]["warmup_num_steps"],
              c["ds_async"]["eval"]["every"], c["ds_async"]["eval"]["batches"]) for c in batch.values()}
    # half the batch as 4 micro-batches of 32 (2bw needs m >= 4 stages); validation on the same 1280 sequences
    assert shape == {(32, 4, 9424, 9424, 942, 472, 40), (64, 8, 2356, 2356, 236, 118, 20)}
    base = long["adamw-sync-s0"]
    assert (base["gradient_accumulation_steps"], base["ds_async"]["train"]["steps"],
            base["scheduler"]["params"]["warmup_num_steps"], base["ds_async"]["eval"]["every"]) == (4, 4712, 471, 236)
    for name, c in batch.items():
        sequences = c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"]
        assert sequences * c["ds_async"]["train"]["steps"] == 64 * 4 * 4712, name
        params = c["optimizer"]["params"]
        assert (params["lr"], params.get("adam_lr")) == ((0.04, 6e-3) if name.startswith("muon") else (3e-3, None))
    assert {n.split("-batch")[0] for n in batch} == {f"{o}-{v}" for o in ("adamw", "muon")
                                                     for v in ("sync", "2bw", "2bw+ef")}
    assert matrices.override(batch["muon-2bw+ef-batch128-s0"], {
        "train_micro_batch_size_per_gpu": 64, "ds_async.eval.batches": 20, **matrices.length(4712),
        "ds_async.eval.every": 236}) == \
        {r.name: r.config() for r in matrices.matrix("long-tuned")}["muon-2bw+ef-lr2x-s0"]

    lam = matrices.matrix("long-adamw-lambda")
    assert len(lam) == 9 and sorted((r.group, r.name) for r in lam if r.group == "long") == [
        ("long", f"adamw-2bw+ef-s{k}") for k in (0, 1, 2)]
    configs = [r.config() for r in lam]
    assert sorted((c["ds_async"]["correction"]["lambda"], c["ds_async"]["seed"]) for c in configs) == [
        (lam_, k) for lam_ in (1.0, 2.0, 3.0) for k in (0, 1, 2)]
    assert all(c["ds_async"]["train"]["steps"] == 4712 and c["optimizer"]["params"]["lr"] == 3e-3 and
               c["ds_async"]["schedule"] == "2bw" for c in configs)
    same = {r.name: r.config() for r in lam}["adamw-2bw+ef-lambda2-s1"]
    same["ds_async"]["correction"]["lambda"] = 1.0
    assert same == long["adamw-2bw+ef-s1"]  # only lambda differs from long's EF run
    moe = {r.name for r in matrices.matrix("long-moe")}
    assert {f"muon-{v}-s2" for v in ("sync", "2bw", "2bw+ef")} <= moe


def test_override_sets_dotted_keys_and_names_what_is_not_an_object():
    config = {"a": {"b": 1}, "c": 2}
    assert matrices.override(config, {"a.b": 3, "a.d.e": [4], "f": {"g": 5}}) == {
        "a": {"b": 3, "d": {"e": [4]}}, "c": 2, "f": {"g": 5}}
    assert config == {"a": {"b": 1}, "c": 2}
    with pytest.raises(ValueError, match="c.x: 'c' is not an object"):
        matrices.override(config, {"c.x": 1})


# ---------------------------------------------------------------------------------------------------------------
# The committed results


def test_results_page_shows_what_the_committed_results_give():
    """Every table of launch/study/RESULTS.md is what ``python -m ds_async.study.runs report`` computes from
    launch/study/results/, and the main table is the study's headline (AdamW and Muon, 3 seeds each)."""
    assert study.main(["report", "--check"]) == 0
    runs = study.load_results()
    assert len(runs) == 266 and runs["complete"].all() and not runs["diverged"].any()
    assert (runs.groupby("group").size()[["main", "tokens", "lr", "batch", "depth", "ef_lambda", "nesterov"]].sum()
            == 18 + 32)
    assert runs.groupby("group").size()[["long", "long-lr", "long-lengths", "long-tuned", "long-async-lr", "long-own-lr",
                                         "long-lambda", "long-delay", "long-moe", "long-moe-ns"]].tolist() == [
        18, 5, 32, 6, 13, 4, 56, 12, 6, 2]
    long = runs[runs["group"] == "long"]
    assert (long["tokens"] / long["parameters"]).round(2).eq(20.0).all() and long["steps"].eq(4712).all()
    table = study.main_table(runs[runs["group"] == "main"], labels=("sync", "2bw", "2bw+ef"))
    assert table.loc["muon", "sync (n)"] == "5.091 ± 0.006 (3)"
    assert table.loc["adamw", "recovered by ef"] == "49% ± 43% (n=3)"
    sizes = {p.name: p.stat().st_size for p in (ROOT / "launch" / "study" / "results").iterdir()}
    # small enough to commit as the study grows: at most 1.5 kB a run (curves subsampled, losses to 6 digits)
    assert set(sizes) == {"runs.csv", "curves.json", "time_to_loss.json"} and sum(sizes.values()) < 1_500 * len(runs)


def test_the_pages_prose_states_only_figures_its_tables_hold():
    """The hand-written reading quotes numbers; every interval and percentage in it is a generated table's, so that
    ``report --check`` guards them; a figure no table holds is named."""
    page = study.PAGE.read_text()
    assert study.unquoted(page) == []
    assert study.unquoted(page + "\nEF recovers 99% here, +0.123 ± 0.045 there; warm-up over 10%.\n") == [
        "99%", "+0.123 ± 0.045"]


def test_recovered_share_interval_recomputed_from_runs_csv():
    """The long table's EF share for AdamW at 0.003 and its 95% interval, recomputed here from runs.csv alone: the
    delta method for the ratio of paired means, R = mean(2bw − ef) / mean(2bw − sync), half-width t(n−1) x
    std(a − R b) / sqrt(n) / |mean(b)|."""
    import csv
    import statistics

    with open(study.RESULTS / "runs.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["group"] == "long" and r["optimizer"] == "adamw"]
    loss = {(r["label"], int(r["seed"])): float(r["final_val"]) for r in rows}
    seeds = sorted({k for _, k in loss})
    a = [loss["2bw", k] - loss["2bw+ef", k] for k in seeds]
    b = [loss["2bw", k] - loss["sync", k] for k in seeds]
    share = statistics.mean(a) / statistics.mean(b)
    z = [x - share * y for x, y in zip(a, b)]
    half = {2: 4.303}[len(seeds) - 1] * statistics.stdev(z) / math.sqrt(len(seeds)) / abs(statistics.mean(b))
    cell = f"{100 * share:.0f}% ± {100 * half:.0f}% (n={len(seeds)})"
    assert cell == "58% ± 5% (n=3)"
    runs = study.load_results()
    table = study.long_table(runs[runs["group"].isin(study.LONG_GROUPS)]).set_index(["optimizer", "lr"])
    assert table.loc[("adamw", "0.003 (sync's best)"), "recovered by ef"] == cell
    # every cell of the long tables that is a mean over seeds says its n
    long = runs[runs["group"].isin(study.LONG_GROUPS)]
    lengths = long[long["group"].isin(["long", "long-lengths"])]
    moe = study.moe_table(long)
    for table, cols in ((study.long_table(long), study.VARIANT_CELLS),
                        (study.length_table(lengths), ("sync", "2bw", "gap")),
                        (study.own_best_table(long), ("loss", "gap to sync's best", "gap at sync's lr")),
                        (moe[moe["gate_up_proj"] != "paper, 10B MoE"], study.VARIANT_CELLS)):
        for col in cols:
            assert table[col].str.fullmatch(r"—|.* \((n=)?\d+(, no interval)?\)").all(), (col, table[col].tolist())


def test_results_round_trip(tmp_path):
    runs = study.load_results()
    study.write_results(runs, tmp_path)
    again = study.load_results(tmp_path)
    assert (tmp_path / "runs.csv").read_bytes() == (study.RESULTS / "runs.csv").read_bytes()
    assert (tmp_path / "curves.json").read_bytes() == (study.RESULTS / "curves.json").read_bytes()
    pd.testing.assert_frame_equal(again.drop(columns="path"), runs.drop(columns="path"))


# ---------------------------------------------------------------------------------------------------------------
# The whole chain on CPU


def _corpus():
    if not (CORPUS / "tokenizers" / "bpe8192.json").exists():
        pytest.skip(f"shared corpus not found at {CORPUS} (the repo must be cloned next to shared/)")


# The engine comparison's point CI runs (``tiny-pairs --runner engine`` runs all three, equally bit-equal).
PAIR = ["--only", "engine/muon-2bw+ef-s0"]


@pytest.fixture(scope="module")
def study_out(tmp_path_factory):
    """The ``tiny`` matrix and the CI pair's emulation side through the emulation runner, in this process (one
    thread, as the engine's ranks)."""
    _corpus()
    out = tmp_path_factory.mktemp("study")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert driver.main(["tiny", "--device", "cpu", "--out", str(out)]) == 0
        assert driver.main(["tiny-pairs", *PAIR, "--device", "cpu", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def engine_run(study_out):
    """The CI pair's engine side: ``launch/train.py`` on 2 gloo ranks under torchrun."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("TORCHDYNAMO_DISABLE", "1")
        mp.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", str(
            Path.home() / ".cache" / "ds_async_torch_extensions")))
        assert driver.main(["tiny-pairs", *PAIR, "--runner", "engine", "--out", str(study_out), "--port",
                            str(free_port())]) == 0
    return study_out / "engine" / "engine" / "muon-2bw+ef-s0"


def test_workers_share_the_host_cores_for_tokenizing(tmp_path, monkeypatch):
    """``--gpus 2`` starts two workers, each with half the host's cores for its tokenizer's thread pool, which the
    run's manifest records."""
    _corpus()
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert driver.main(["tiny", "--only", "main/adamw-sync-s0", "--gpus", "2", "--device", "cpu",
                        "--out", str(tmp_path)]) == 0
    manifest = json.loads((tmp_path / "emulation" / "main" / "adamw-sync-s0" / "manifest.json").read_text())
    assert manifest["emulation"]["tokenizer_threads"] == str(max(1, (os.cpu_count() or 1) // 2))


def test_a_diverging_emulation_run_is_a_result_not_a_failure(tmp_path, monkeypatch):
    """AdamW at lr 1e6 turns the loss NaN within a few steps: the run stops there as on the engine, but first its
    summary.json records the steps it ran and why it stopped; the driver counts it as done, skips it on the next
    call, and the results read it as diverged and incomplete (the lambda grid's "diverged")."""
    _corpus()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["tiny", "--only", "main/adamw-sync-s0", "--device", "cpu", "--out", str(tmp_path),
            "--set", "optimizer.params.lr=1e6", "--set", "ds_async.eval.every=3"]
    assert driver.main(args) == 0
    folder = tmp_path / "emulation" / "main" / "adamw-sync-s0"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["stopped"].startswith("NonFiniteLoss: step ") and 1 <= summary["steps"] < 20
    assert math.isfinite(summary["final_validation_loss"])  # an evaluation before the loss turned NaN
    assert summary["history"]["train"][-1][0] == summary["steps"]
    assert not math.isfinite(summary["history"]["train"][-1][1])
    row = study.read_run(folder)
    assert row["diverged"] and not row["complete"] and math.isnan(row["final_val"])  # no final loss
    # its JSON is not the matrix's (--set): the command that reproduces it is the job's on that JSON
    assert row["command"] == f"python -m ds_async.emulate --config {folder / 'config.json'}"
    written = (folder / "summary.json").stat().st_mtime_ns
    assert driver.main(args) == 0 and (folder / "summary.json").stat().st_mtime_ns == written


def test_a_run_from_a_copied_tree_resumed_in_a_second_call_says_so_in_its_row(tmp_path, monkeypatch):
    """The GPU machine's way: a copy of the tree without its ``.git`` names its commit (``DS_ASYNC_COMMIT``) and
    that commit's file listing (``DS_ASYNC_TREE``); the run stops at its call's time limit and the next call resumes
    it. Its row holds that commit, ``dirty`` as the files' hashes give it, and a note saying both."""
    _corpus()
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs this checkout's git")

    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True).stdout

    (tmp_path / "tree").write_bytes(git("ls-tree", "-r", "HEAD"))
    head, dirty = git("rev-parse", "HEAD").decode().strip(), bool(git("status", "--porcelain", "--untracked-files=no"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DS_ASYNC_COMMIT", head)
    monkeypatch.setenv("DS_ASYNC_TREE", str(tmp_path / "tree"))
    args = ["tiny", "--only", "main/adamw-sync-s0", "--device", "cpu", "--out", str(tmp_path / "out")]
    folder = tmp_path / "out" / "emulation" / "main" / "adamw-sync-s0"
    assert driver.main([*args, "--time-limit", "0.05"]) == 0  # starts, then stops after its first step
    assert (folder / "emulation_state.pt").exists() and not (folder / "summary.json").exists()
    assert driver.main(args) == 0
    row = study.read_run(folder)
    assert row["complete"] and (row["commit"], row["dirty"]) == (head, dirty)
    assert row["command"] == "python launch/study/run.py tiny --only 'main/adamw-sync-s0'"
    assert row["note"] == ("a copy of the tree (no usable .git): the commit as DS_ASYNC_COMMIT named it, every tracked "
                           "file hashed against its git ls-tree (DS_ASYNC_TREE); resumed from a saved state: the "
                           "manifest is the last call's")


def test_tiny_matrix_run_folders(study_out):
    folders = study.find_runs(study_out / "emulation")
    assert len(folders) == 21 + 1
    for folder in folders:
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("events.")) == [
            "config.json", "manifest.json", "summary.json"]
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["emulation"]["card"].startswith("cpu") and manifest["code"]["commit"]
        config = json.loads((folder / "config.json").read_text())
        assert manifest["ds_async"]["seed"] == config["ds_async"]["seed"] and manifest["total_steps"] >= 10
        assert manifest["deepspeed"]["optimizer"]["type"] in ("AdamW", "Muon")
    runs = study.load_runs(study_out / "emulation")
    assert runs["complete"].all() and not runs["diverged"].any()
    assert list(runs["command"]) == [f"python launch/study/run.py {'tiny-pairs' if group == 'engine' else 'tiny'} "
                                     f"--only '{group}/{name}'" for group, name in zip(runs["group"], runs["name"])]
    assert runs["val_steps"].map(len).min() >= 1 and runs["train_steps"].map(len).min() >= 10
    tiny = runs[runs["group"] != "engine"]
    table = study.gap_table(study.at_reference(tiny, study.reference(tiny)))
    assert list(table.index) == ["adamw", "muon"]
    for col in ("sync", "2bw", "2bw+ef", "gap", "recovered 2bw+ef"):
        assert table[col].map(math.isfinite).all(), col
    assert (table["sync n"] == 2).all() and table.loc["adamw", "2bw+nesterov n"] == 1
    # same seed, same initial weights and data: the variants' first losses agree (no delay at step 1)
    first = tiny[tiny["group"] == "main"].groupby("seed")["train_loss"].apply(lambda s: {round(x[0], 5) for x in s})
    assert first.map(len).max() == 1


def test_train_py_and_the_emulation_runner_are_bit_equal_under_2bw(engine_run, study_out):
    """fp32 on CPU: launch/train.py on 2 processes and ``ds_async.emulate`` on one, given the same JSON (Muon, EF,
    2BW, clipping, DeepSpeed's WarmupCosineLR, the ``parameters`` partition), log the same validation losses at
    every validation point, the same training loss at every step and the same learning rates."""
    twin = study_out / "emulation" / "engine" / "muon-2bw+ef-s0"
    assert sorted(p.name for p in engine_run.iterdir() if not p.name.startswith("events.")) == [
        "config.json", "manifest.json", "summary.json"]
    m_eng, m_emu = (json.loads((d / "manifest.json").read_text()) for d in (engine_run, twin))
    assert m_eng["world_size"] == 2 and "emulation" not in m_eng and m_emu["emulation"]["precision"] == "fp32"
    assert study.read_run(engine_run)["command"] == (
        "python launch/study/run.py tiny-pairs --only 'engine/muon-2bw+ef-s0' --runner engine")
    assert m_eng["deepspeed"] == m_emu["deepspeed"] and m_eng["ds_async"]["schedule"] == "2bw"
    assert {k: v for k, v in m_eng["ds_async"].items() if k != "logging"} == {
        k: v for k, v in m_emu["ds_async"].items() if k != "logging"}
    s_eng, s_emu = (json.loads((d / "summary.json").read_text()) for d in (engine_run, twin))
    assert s_eng["history"]["validation"] == s_emu["history"]["validation"]  # bit-equal
    assert len(s_eng["history"]["validation"]) == 2
    assert s_eng["history"]["train"] == s_emu["history"]["train"] and len(s_eng["history"]["train"]) == 20
    lr_eng, lr_emu = (_scalars(d, "train/lr") for d in (engine_run, twin))
    assert lr_eng == lr_emu and len(lr_eng) == 20
    runs = study.load_runs(study_out)
    table = study.engine_table(runs)
    assert len(table) == 1 and table["diff"].tolist() == [0.0] and table["verdict"].tolist() == ["identical"]
    assert list(study.engine_summary(table)["verdict"]) == ["identical"]
    assert len(plots.plot_engine(runs).axes) == 2


def _scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_the_saved_notebook_drops_only_the_reprs_beside_markdown_and_figures():
    """``compact_outputs``: a Markdown or PNG output loses its ``text/plain`` (only the object's repr), a table keeps
    its plain-text form beside its HTML, and a figure comes back a (re-encoded) PNG of the same size in pixels."""
    nbformat = pytest.importorskip("nbformat")
    from PIL import Image

    buf = io.BytesIO()
    Image.linear_gradient("L").convert("RGB").save(buf, "PNG")
    png = base64.b64encode(buf.getvalue()).decode()
    outputs = [nbformat.v4.new_output("display_data", data=data) for data in (
        {"text/markdown": "| a |\n|---|\n| 1 |", "text/plain": "<IPython.core.display.Markdown object>"},
        {"text/html": "<table></table>", "text/plain": "   a\n0  1"},
        {"image/png": png, "text/plain": "<Figure size 600x210 with 2 Axes>"})]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("", outputs=outputs)])
    study.compact_outputs(nb)
    markdown, table, figure = (out["data"] for out in nb.cells[0].outputs)
    assert markdown == {"text/markdown": "| a |\n|---|\n| 1 |"}
    assert table == {"text/html": "<table></table>", "text/plain": "   a\n0  1"}
    assert list(figure) == ["image/png"]
    assert Image.open(io.BytesIO(base64.b64decode(figure["image/png"]))).size == (256, 256)
    nbformat.validate(nb)


def test_notebook_executes_on_the_run_folders(study_out, engine_run):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    path = ROOT / "notebooks" / "loss_curves.ipynb"
    nb = nbformat.read(path, as_version=4)
    # committed executed, so kept compact as sections are added: each figure (60 dpi, 32 colours) and the rest
    pngs = [out["data"]["image/png"] for cell in nb.cells for out in cell.get("outputs", [])
            if "image/png" in out.get("data", {})]
    assert max(map(len, pngs)) < 32_000 and path.stat().st_size - sum(map(len, pngs)) < 64_000
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ASYNC_RUNS", str(study_out))
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    text, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", f"{out.get('ename')}: {out.get('evalue')}"
            text.append(out.get("text", "") + out.get("data", {}).get("text/plain", ""))
            images += "image/png" in out.get("data", {})
    text = "\n".join(text)
    assert "23 runs under the given folders" in text and "recovered by ef" in text
    assert str(study_out) not in text and str(ROOT) not in text  # no absolute paths printed
    for absent in ("no token-budget", "no LR", "no batch-size", "no PipeDream", "no λ", "no nesterov",
                   "no engine runs"):
        assert absent not in text, absent
    assert images >= 7  # curves, tokens, LR, batch, depth, λ, engine


def test_the_committed_comparison_is_what_its_curves_give():
    """launch/study/results/time_to_loss.json: the table the results page shows recomputes every crossing from the
    runs' validation curves, and they agree with what the driver wrote."""
    doc = study.load_time_to_loss()
    table = study.time_to_loss_table(doc).set_index("run")
    assert list(table.index) == ["sync", "2bw+ef"]
    assert doc["target"] == doc["runs"]["sync"]["final_validation_loss"]
    for name, run in doc["runs"].items():
        assert round(table.loc[name, "time to target (s)"], 1) == run["time_to_loss"]
        assert round(table.loc[name, "tokens to target (M)"] * 1e6) == run["tokens_to_loss"]
    assert table.loc["sync", "speed-up to target"] == 1.0
    curves = study.time_to_loss_curves(doc)
    assert len(curves) == sum(len(r["validation"]) for r in doc["runs"].values())
    # what the page's prose states: 1.085x sooner (175.8 s against 190.7 s), +17% tokens (99.4M against 84.9M),
    # 1.020x after start-up, steps 1.16x as fast (1.22x in calibration)
    shown = table.round({"speed-up to target": 3, "time to target (s)": 1, "tokens to target (M)": 1,
                         "speed-up after start-up": 3, "step speed-up": 2, "step speed-up in calibration": 2})
    assert shown.loc["2bw+ef", ["speed-up to target", "time to target (s)", "tokens to target (M)",
                                "speed-up after start-up", "step speed-up", "step speed-up in calibration"]].tolist() \
        == [1.085, 175.8, 99.4, 1.020, 1.16, 1.22]
    assert shown.loc["sync", ["time to target (s)", "tokens to target (M)"]].tolist() == [190.7, 84.9]
    assert f"{table.loc['2bw+ef', 'tokens to target vs sync']:+.0%}" == "+17%"
    assert "(calibrated: sync 0.1158 s a step, 2bw+ef 0.0949 s a step)" in study.time_to_loss_block(doc)
    doc["calibration_from"] = "runs/ttl/time_to_loss.json"  # another seed's comparison, with these step times
    assert "(as calibrated for `runs/ttl/time_to_loss.json`: sync 0.1158" in study.time_to_loss_block(doc)


def test_a_run_that_never_reaches_the_target_says_so():
    doc = study.load_time_to_loss()
    doc["runs"]["2bw+ef"]["validation"] = [[s, v + 1.0] for s, v in doc["runs"]["2bw+ef"]["validation"]]
    table = study.time_to_loss_table(doc).set_index("run")
    assert pd.isna(table.loc["2bw+ef", "time to target (s)"]) and pd.isna(table.loc["2bw+ef", "tokens to target (M)"])
    assert pd.isna(table.loc["2bw+ef", "speed-up to target"])
    assert pd.isna(table.loc["2bw+ef", "tokens to target vs sync"])
    assert "| 2bw+ef | " in study.time_to_loss_block(doc) and table.loc["2bw+ef", "step speed-up"] > 1


def test_the_comparison_plots_loss_against_seconds_and_tokens():
    fig = plots.plot_time_to_loss(study.load_time_to_loss())
    left, right = fig.axes
    assert left.get_xlabel().startswith("seconds") and right.get_xlabel().startswith("training tokens")
    assert len(left.get_lines()) == len(right.get_lines()) == 5  # two curves, two crossings, the target


def test_the_fp8_quality_plot_differences_each_run_from_the_bf16_mean():
    """The FP8 quality figure on the study's page: a curve per run with validation points, and on the right each
    run minus the bf16 runs' mean at the same step (so the bf16 differences sum to zero at every step)."""
    rows = [json.loads(line) for line in (ROOT / "launch/bench/results/fp8_quality_1xH200.jsonl").open()]
    drawn = [r for r in rows if r["validation_loss"]]
    fig = plots.plot_fp8_quality(rows)
    left, right = fig.axes
    assert len(left.get_lines()) == len(drawn) and len(right.get_lines()) == len(drawn) + 1  # and the zero line
    by_step: dict[float, float] = {}
    for row, line in zip(drawn, right.get_lines()):
        assert list(line.get_xdata()) == sorted(int(s) for s in row["validation_loss"])
        if row["fp8"] is None:
            for step, d in zip(line.get_xdata(), line.get_ydata()):
                by_step[step] = by_step.get(step, 0.0) + d
    assert by_step and all(abs(v) < 1e-9 for v in by_step.values())


def test_the_driver_leaves_out_what_the_committed_results_hold(capsys):
    """``--skip-committed``: the runs of a matrix that launch/study/results/runs.csv already holds are not run again
    on a machine whose run folders are empty. Read on a matrix the committed results hold part of (the first such;
    matrices fill up as the study runs)."""
    done = driver.committed()
    name, long = next((name, runs) for name in matrices.MATRICES for runs in [matrices.matrix(name)]
                      if 0 < sum(("emulation", r.group, r.name) in done for r in runs) < len(runs))
    held = [r for r in long if ("emulation", r.group, r.name) in done]
    assert 0 < len(held) < len(long)
    assert driver.main([name, "--skip-committed", "--list", "--out", "/nonexistent"]) == 0
    listed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert listed[:-1] == [f"{r.group}/{r.name}" for r in long if r not in held]
    assert listed[-1].startswith(f"{len(long) - len(held)} runs")


def test_the_driver_packs_by_the_committed_clock(tmp_path):
    """A step's time is read from the committed runs of the same runner, base config, optimizer and micro-batches:
    the median of that key's longest runs (shorter ones carry more compiling a step); a kind of run no committed run
    has timed is planned at PASS_SECONDS a micro-batch pass. Workers then deal by those seconds."""
    header = "runner,group,name,optimizer,micro_batches,steps,seconds_per_step\n"
    rows = ["emulation,long-moe,muon-sync-s0,muon,4,6606,0.12", "emulation,long-moe,muon-2bw-s0,muon,4,6606,0.14",
            "emulation,long-moe,muon-2bw+ef-s0,muon,4,6606,0.11",
            "emulation,long,muon-sync-s0,muon,4,4712,0.08", "emulation,long-lengths,muon-sync-len58-s0,muon,4,58,0.9",
            "engine,long,muon-sync-s1,muon,4,4712,0.5", "emulation,nowhere,muon-sync-s9,muon,4,4712,9.0"]
    csv_path = tmp_path / "runs.csv"
    csv_path.write_text(header + "\n".join(rows) + "\n")
    clock = driver.step_clock(csv_path)
    assert clock == {("emulation", "long_moe.json", "muon", 4): 0.12, ("emulation", "long.json", "muon", 4): 0.08,
                     ("engine", "long.json", "muon", 4): 0.5}
    moe = {r.name: r for r in matrices.matrix("long-moe")}["muon-sync-s2"]
    dense = {r.name: r for r in matrices.matrix("long")}
    assert driver.cost(moe, clock=clock) == pytest.approx(6606 * 0.12 + driver.START_SECONDS)
    assert driver.cost(dense["adamw-sync-s0"], clock=clock) == pytest.approx(
        4712 * 4 * driver.PASS_SECONDS + driver.START_SECONDS)
    assert driver.cost(dense["muon-sync-s0"], runner="engine", clock=clock) == pytest.approx(
        4712 * 0.5 + driver.START_SECONDS)


def test_listing_with_gpus_shows_each_workers_share(capsys):
    """``--gpus N --list`` starts no worker: it prints what each would run and its minutes at the committed clock,
    the shares together being the runs listed without ``--gpus``."""
    assert driver.main(["long-moe", "--gpus", "2", "--list", "--out", "/nonexistent"]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [line for line in lines if line.startswith("worker ")]
    assert [h.split(":")[0] for h in heads] == ["worker 0 (GPUs 0)", "worker 1 (GPUs 1)"]
    assert all(h.endswith("min planned") for h in heads)
    listed = sorted(line.strip() for line in lines if line.startswith("    "))
    assert listed == sorted(f"{r.group}/{r.name}" for r in matrices.matrix("long-moe"))
    assert not Path("/nonexistent").exists()


def test_only_globs_add_up(capsys):
    """``--only`` repeated keeps the runs that match any of its globs, in the matrices' order."""
    assert driver.main(["long-moe", "long", "--only", "long-moe/*-s1", "--only", "long/adamw-sync-s[12]", "--list",
                        "--out", "/nonexistent"]) == 0
    listed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert listed[:-1] == ["long-moe/muon-sync-s1", "long-moe/muon-2bw-s1", "long-moe/muon-2bw+ef-s1",
                           "long/adamw-sync-s1", "long/adamw-sync-s2"]
