"""Read loss-curve runs and tabulate them: the study's analysis, for the notebook, the results page and the tests.

Two sources give the same rows (one per run, :data:`COLUMNS`):

- run folders written by ``launch/train.py`` or ``python -m ds_async.emulate`` (``manifest.json`` with the resolved
  ``ds_async`` config and the ``deepspeed`` block, ``summary.json`` with the loss history), anywhere below the
  given roots: :func:`load_runs`;
- the study's committed results, ``launch/study/results/runs.csv`` (a row per run) and ``curves.json`` (its
  validation curve and a subsampled training curve): :func:`load_results`; :func:`write_results` writes them.

Definitions, per optimizer, with ``sync`` the synchronous run, ``2bw`` the delayed one and ``corr`` a delayed run
with a correction: gap = loss(2bw) − loss(sync), averaged over the seeds that have both (runs of a seed share
initial weights and data, so the difference is paired); recovered share = (loss(2bw) − loss(corr)) /
(loss(2bw) − loss(sync)) from the means over the seeds that have all three (1 closes the gap, 0 does nothing).
The engine comparison pairs each ``launch/train.py`` run with the emulation run of the same config
(:func:`engine_table`) and sets the difference against the seed noise of the main matrix. The figures are
``plots.py``'s, beside this file.

    python -m ds_async.study.runs report [--check]      # (re)write or check the tables of launch/study/RESULTS.md
    python -m ds_async.study.runs table RUNS...         # the main table of the run folders below RUNS
    python -m ds_async.study.runs collect RUNS...       # add run folders to the committed results (replacing same ids)

pandas is needed here (``pip install ds_async[notebooks]``); nothing in ``ds_async`` outside :mod:`ds_async.study`
imports this.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from .. import report as your_runs  # `report` here is the results page's
from ..report import time_to_loss

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "launch" / "study" / "results"
PAGE = ROOT / "launch" / "study" / "RESULTS.md"

# The axes a sweep varies; the others stay at the main matrix's values ("the reference").
AXES = ("model", "seq_len", "batch", "tokens", "lr_scale")
PAPER = pd.DataFrame(  # arXiv 2606.30634, 360M LLaMA on FineWeb-Edu: final validation loss
    {"sync": [2.612, 2.578], "2bw": [2.890, 2.590], "2bw+ef": [2.640, 2.583]}, index=["adamw", "muon"])
ID = ["runner", "group", "name"]
COLUMNS = ["path", *ID, "optimizer", "schedule", "stages", "correction", "ef_lambda", "label", "model", "parameters",
           "seq_len", "batch", "micro_batches", "tokens", "steps", "tokens_per_step", "lr", "lr_scale", "seed",
           "precision", "world_size", "final_val", "final_train", "diverged", "complete", "card", "commit", "dirty",
           "declared_commit", "note", "driver", "command", "seconds_per_step", "config_key", "val_steps", "val_loss",
           "train_steps", "train_loss"]
CURVES = ("val", "train")
ENGINE_GROUP = "engine"  # the old runner's engine-vs-emulation pairs: their own table, left out of the others
TRAIN_EVERY = 10  # committed training curves keep steps 1, every k-th and the last: k the smallest multiple
TRAIN_POINTS = 100  # of TRAIN_EVERY that keeps about TRAIN_POINTS of them (a long run's curve stays small)


# ---------------------------------------------------------------------------------------------------------------
# Rows


def label_of(schedule: str, stages: int, correction: str, ef_lambda: float) -> str:
    """``sync``, ``2bw``, ``2bw+ef``, ``2bw+nesterov``, ``2bw+ef λ=0.5`` (λ ≠ 1), ``pipedream p=4``."""
    base = "sync" if schedule == "1f1b" else schedule
    if schedule == "pipedream":
        base += f" p={stages}"
    if correction != "none":
        base += f"+{correction}"
        if correction == "ef" and ef_lambda != 1.0:
            base += f" λ={ef_lambda:g}"
    return base


def model_key(hf: dict) -> str:
    """The model's shape in a few characters; a Mixtral's also names its experts (``e8k2``: 8 experts, top-2)."""
    key = f"h{hf['hidden_size']}-L{hf['num_hidden_layers']}-v{hf['vocab_size']}"
    return key + (f"-e{hf['num_local_experts']}k{hf['num_experts_per_tok']}" if hf.get("model_type") == "mixtral"
                  else "")


def llama_parameters(hf: dict) -> int:
    """Parameters of an untied LLaMA of this HF config (embedding, decoder layers, final norm, head)."""
    h, layers, v, f = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"], hf["intermediate_size"]
    head_dim = hf.get("head_dim") or h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim
    return 2 * v * h + layers * (2 * h * q + 2 * h * kv + 3 * h * f + 2 * h) + h


def model_parameters(hf: dict) -> int | None:
    """Parameters of an untied HF LLaMA or Mixtral config (a Mixtral's every expert and router counted, as its
    ``num_parameters()``); None for another family."""
    if hf.get("model_type") == "llama":
        return llama_parameters(hf)
    if hf.get("model_type") != "mixtral":
        return None
    h, layers, experts = hf["hidden_size"], hf["num_hidden_layers"], hf["num_local_experts"]
    dense_ffn = 3 * h * hf["intermediate_size"]
    moe_ffn = experts * dense_ffn + h * experts  # the experts and the router
    return llama_parameters(hf) + layers * (moe_ffn - dense_ffn)


def config_key(ds_async: dict, deepspeed: dict) -> str:
    """What makes two runs the same run whichever runner trained them: the config without its logging section."""
    ident = {"ds_async": {k: v for k, v in ds_async.items() if k != "logging"}, "deepspeed": deepspeed}
    return hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _finite(x) -> float:
    return float(x) if x is not None and math.isfinite(float(x)) else math.nan


def read_run(folder: str | Path) -> dict:
    """One run folder (``launch/train.py`` or the emulation) as a row of :data:`COLUMNS`; its group and name are
    the folder's parent's name and its own (the study driver's ``OUT/<runner>/<group>/<name>``)."""
    folder = Path(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
    ds, dsc, hf = manifest["ds_async"], manifest["deepspeed"], manifest["model"]
    emulation = manifest.get("emulation")
    corr = ds.get("correction") or {"type": "none"}
    optimizer = dsc.get("optimizer", {})
    history = summary.get("history", {})
    train, val = history.get("train", []), history.get("validation", [])
    steps, tps = manifest["total_steps"], manifest["tokens_per_step"]
    autocast = (dsc.get("torch_autocast") or {}).get("enabled") or (dsc.get("bf16") or {}).get("enabled")
    diverged = bool(summary) and (not math.isfinite(_finite(summary.get("final_validation_loss")))
                                  or not all(math.isfinite(v) for _, v in train))
    # A diverged run's last validation came before it diverged: it has no final loss.
    final_val = math.nan if diverged else _finite(summary.get("final_validation_loss"))
    lam = corr.get("lambda", corr.get("lam"))  # manifests before the config's JSON keys were kept say "lam"
    ef_lambda = (lam if lam is not None else 1.0) if corr["type"] == "ef" else math.nan
    runner = "emulation" if emulation else "engine"
    config_file = manifest.get("config_file")
    if config_file and Path(config_file).resolve().is_relative_to(ROOT):  # no machine's paths in the results
        config_file = str(Path(config_file).resolve().relative_to(ROOT))
    return {
        "path": str(folder), "runner": runner, "group": folder.parent.name, "name": folder.name,
        "optimizer": optimizer.get("type", "none").lower(), "schedule": ds["schedule"],
        "stages": ds["pipeline_stages"], "correction": corr["type"], "ef_lambda": ef_lambda,
        "label": label_of(ds["schedule"], ds["pipeline_stages"], corr["type"], ef_lambda),
        "model": model_key(hf), "parameters": model_parameters(hf),
        "seq_len": ds["data"]["seq_len"], "batch": tps // ds["data"]["seq_len"],
        "micro_batches": manifest["micro_batches"],
        "tokens": steps * tps, "steps": steps, "tokens_per_step": tps, "lr": optimizer.get("params", {}).get("lr"),
        "lr_scale": math.nan, "seed": ds["seed"],
        "precision": emulation["precision"] if emulation else ("bf16" if autocast else "fp32"),
        "world_size": manifest.get("world_size"), "final_val": final_val,
        "final_train": _finite(train[-1][1]) if train else math.nan,
        "diverged": diverged,
        "complete": bool(summary) and bool(train) and train[-1][0] >= steps,
        "card": emulation["card"] if emulation else manifest.get("card"), "commit": manifest["code"].get("commit"),
        "dirty": manifest["code"].get("dirty"), "declared_commit": None, "note": None,
        "driver": "ds_async.emulate" if emulation else "launch/train.py",
        "command": (f"python -m ds_async.emulate --config {config_file}" if emulation
                    else f"torchrun --nproc_per_node {manifest.get('world_size')} launch/train.py --config "
                         f"{config_file}"),
        "seconds_per_step": round(summary["seconds"] / max(1, steps), 5) if summary else None,
        "config_key": config_key(ds, dsc),
        "val_steps": [s for s, _ in val], "val_loss": [v for _, v in val],
        "train_steps": [s for s, _ in train], "train_loss": [v for _, v in train],
    }


def find_runs(root: str | Path) -> list[Path]:
    """Every folder below ``root`` (or ``root`` itself) holding a run's ``manifest.json``."""
    return sorted(p.parent for p in Path(root).rglob("manifest.json"))


def with_lr_scale(runs: pd.DataFrame) -> pd.DataFrame:
    """``lr_scale``: each run's peak LR over its optimizer's most common LR in the main matrix (``group ==
    "main"``; all runs if there is none)."""
    runs = runs.copy()
    base = runs[runs["group"] == "main"] if (runs["group"] == "main").any() else runs
    ref = {opt: part["lr"].mode().iloc[0] for opt, part in base.groupby("optimizer") if part["lr"].notna().any()}
    runs["lr_scale"] = [round(lr / ref[opt], 6) if opt in ref and lr == lr else math.nan
                        for opt, lr in zip(runs["optimizer"], runs["lr"])]
    return runs


def frame(rows: Iterable[dict]) -> pd.DataFrame:
    return with_lr_scale(pd.DataFrame(list(rows), columns=COLUMNS))


def load_runs(roots: str | Path | Iterable[str | Path]) -> pd.DataFrame:
    """All run folders below ``roots`` as rows (see :func:`read_run`)."""
    if isinstance(roots, (str, Path)):
        roots = [roots]
    return frame(read_run(p) for root in roots for p in find_runs(root))


def write_results(runs: pd.DataFrame, folder: str | Path = RESULTS) -> None:
    """``runs.csv`` (one row per run, curves left out) and ``curves.json`` (``"<runner>/<group>/<name>": {"val":
    [[step, loss], ...], "train": [...]}``, one run a line: every validation point; training steps 1, every
    :func:`train_stride`-th and the last)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    runs = runs.sort_values(ID).reset_index(drop=True)
    table = runs.drop(columns=["path", "lr_scale", *(f"{c}_{k}" for c in CURVES for k in ("steps", "loss"))])
    table.to_csv(folder / "runs.csv", index=False)
    lines = []
    for _, run in runs.iterrows():
        doc = {}
        for curve in CURVES:
            steps, losses = run[f"{curve}_steps"], run[f"{curve}_loss"]
            last = steps[-1] if steps else None
            every = train_stride(last or 0)
            doc[curve] = [[step, float(f"{loss:.6g}")] for step, loss in zip(steps, losses)
                          if curve == "val" or step == 1 or step % every == 0 or step == last]
        lines.append(json.dumps("/".join(run[ID])) + ": " + json.dumps(doc, separators=(",", ":")))
    (folder / "curves.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")


def train_stride(last_step: int) -> int:
    """Every how many steps a committed training curve keeps a point: :data:`TRAIN_EVERY`, or the smallest
    multiple of it that keeps at most about :data:`TRAIN_POINTS` points up to ``last_step``. It depends on the last
    step alone, so writing loaded results again keeps the same points."""
    return TRAIN_EVERY * max(1, math.ceil(last_step / (TRAIN_EVERY * TRAIN_POINTS)))


def load_results(folder: str | Path = RESULTS) -> pd.DataFrame:
    """The committed results as rows (``path`` is ``results:<runner>/<group>/<name>``)."""
    folder = Path(folder)
    table = pd.read_csv(folder / "runs.csv")
    curves = json.loads((folder / "curves.json").read_text())
    rows = []
    text = ("card", "declared_commit", "note", "command")  # empty cells: None, not NaN
    for rec in table.to_dict("records"):
        rec = {k: None if k in text and isinstance(v, float) and math.isnan(v) else v for k, v in rec.items()}
        run_id = "/".join(str(rec[k]) for k in ID)
        rec["path"] = "results:" + run_id
        for curve in CURVES:
            points = curves.get(run_id, {}).get(curve, [])
            rec[f"{curve}_steps"] = [int(s) for s, _ in points]
            rec[f"{curve}_loss"] = [float(v) for _, v in points]
        rows.append(rec)
    return frame(rows)


def collect(roots: Iterable[str | Path], folder: str | Path = RESULTS) -> pd.DataFrame:
    """Add the run folders below ``roots`` to the committed results, replacing rows of the same runner, group and
    name; returns the new table."""
    new = load_runs(list(roots))
    old = load_results(folder) if (Path(folder) / "runs.csv").exists() else frame([])
    keep = ~old.set_index(ID).index.isin(new.set_index(ID).index)
    both = frame(pd.concat([old[keep], new], ignore_index=True).to_dict("records"))
    write_results(both, folder)
    return both


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
    """Final loss of ``labels`` and the gap ``labels[1] − labels[0]`` along ``axis`` (``tokens``, ``lr_scale``,
    ``batch``), the other axes at the reference, over the seeds common to all points (:func:`common_seeds`); one
    row per (optimizer, axis value). ``x`` names the column to report as the x value (e.g. ``lr``)."""
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
    out = pd.DataFrame(index=table.index.rename("optimizer"))
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
    return markdown(moe_table(moe), index=False) + "\n" + moe_choice(moe) + "\n" + _ran(moe) + (
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
    return _fmt(t, {"tokens/param": 2, "sync": 3, "2bw": 3, "gap": "+3"})


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
    return _fmt(t, {"lr": "g", "sync": 3, "2bw": 3, "2bw+ef": 3, "gap": "+3", "seeds": "g"})


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
    shown = _fmt(grid, {"lr": "g", "sync": 3, "λ=0 (2bw)": 3, **{f"λ={x:g}": 3 for x in LAMBDAS}, "best λ": "g",
                        "closed at best λ": "%"})
    return (markdown(shown, index=False) + "\n" + lambda_findings(grid) + "\n"
            + _ran(runs[runs["group"] == "long-lambda"]))


def delay_block(runs: pd.DataFrame) -> str:
    """The results page's variable-against-constant delay table (:func:`delay_table`) and what ran."""
    if not (runs["group"] == "long-delay").any():
        return "Not run yet.\n"
    table = delay_table(runs)
    shown = _fmt(table, {c: "+3" if c.startswith("gap") or "−" in c else 3 for c in table.columns[2:]})
    return markdown(shown, index=False) + "\n" + _ran(runs[runs["group"] == "long-delay"])


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
    ``after start-up`` columns leave it out."""
    runs = doc["runs"]
    per_step = runs["sync"]["tokens"] / runs["sync"]["steps"]
    rows = []
    for name, run in runs.items():
        losses = [v for _, v in run["validation"]]
        at = time_to_loss([t for _, t in run["validation_seconds"]], losses, doc["target"])
        step = time_to_loss([s for s, _ in run["validation"]], losses, doc["target"])
        first_step, first_seconds = run["validation"][0][0], run["validation_seconds"][0][1]
        start = first_seconds - first_step * run["step_time_s"]
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
    return table


def time_to_loss_findings(doc: dict) -> str:
    """What a time-to-loss comparison shows, per asynchronous run against sync, in numbers computed from it: how much
    sooner it reaches the target, at what cost in tokens, how much faster its steps are, where it ends."""
    t = time_to_loss_table(doc).set_index("run")
    sync, calibrated = t.loc["sync"], doc["calibration_step_time_s"]
    lines = []
    for name, r in t.drop(index="sync").iterrows():
        if pd.isna(r["time to target (s)"]):
            reach = f"**{name} never reaches the target**"
        else:
            reach = (f"**{name} reaches the target {r['speed-up to target']:.3f}× sooner** on the wall clock "
                     f"({r['time to target (s)']:.1f} s against {sync['time to target (s)']:.1f} s), with "
                     f"{r['tokens to target (M)'] / sync['tokens to target (M)'] - 1:+.0%} tokens "
                     f"({r['tokens to target (M)']:.1f}M against {sync['tokens to target (M)']:.1f}M)")
        if not pd.isna(r["time to target (s)"]):
            reach += (f"; with each run's start-up left out ({r['start-up (s)']:.1f} s against "
                      f"{sync['start-up (s)']:.1f} s), {r['speed-up after start-up']:.3f}× "
                      f"({r['after start-up (s)']:.1f} s against {sync['after start-up (s)']:.1f} s)")
        lines.append(f"- {reach}; its steps are {sync['step (s)'] / r['step (s)']:.2f}× as fast in the full runs "
                     f"({calibrated['sync'] / calibrated[name]:.2f}× in calibration), and with the same training "
                     f"time it ends at {r['final loss']:.4f} against {sync['final loss']:.4f}.")
    return "\n".join(lines) + "\n"


def time_to_loss_block(doc: dict) -> str:
    """The results page's time-to-loss table, what it shows and the line saying what ran."""
    table = _fmt(time_to_loss_table(doc), {"tokens (M)": 1, "step (s)": 4, "training (s)": 1, "final loss": 4,
                                           "time to target (s)": 1, "tokens to target (M)": 1,
                                           "start-up (s)": 1, "after start-up (s)": 1, "speed-up to target": 3,
                                           "speed-up after start-up": 3})
    return (markdown(table, index=False) + "\n" + time_to_loss_findings(doc)
            + f"\nTarget: {doc['target']:.4f} (sync's final validation loss). "
            f"Model: {doc['parameters'] / 1e6:.1f}M parameters (`{doc['config']}`), {doc['gpus']} GPUs, "
            f"{doc['budget_s']:g} s of steady-state steps each ("
            + (f"as calibrated for `{doc['calibration_from']}`: " if doc.get("calibration_from") else "calibrated: ")
            + ", ".join(f"{k} {v:.4f} s a step" for k, v in doc["calibration_step_time_s"].items())
            + f"). Ran: `{doc['command']}`" + (f" ({doc['note']})" if doc.get("note") else "") + ".\n")


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


# ---------------------------------------------------------------------------------------------------------------
# The results page: tables generated between markers, the prose around them hand-written

BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end -->)", re.S)


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


def _ran(runs: pd.DataFrame) -> str:
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


def _fmt(table: pd.DataFrame, digits: dict) -> pd.DataFrame:
    out = table.copy()
    for col, d in digits.items():
        if col in out:
            out[col] = [("—" if not (isinstance(v, (int, float)) and math.isfinite(v)) else
                         f"{100 * v:.0f}%" if d == "%" else f"{v:+.{d[1:]}f}" if str(d).startswith("+") else
                         f"{v:.{d}f}" if isinstance(d, int) else f"{v:{d}}") for v in out[col]]
    return out


def report(runs: pd.DataFrame, ttl: dict | None = None) -> dict[str, str]:
    """The results page's generated blocks, by name, from the rows of the committed results and, with ``ttl``, the
    committed time-to-loss comparison."""
    study = runs[runs["group"].isin(["main", "tokens", "lr", "batch", "depth", "ef_lambda", "nesterov",
                                     ENGINE_GROUP])]
    ref = reference(study)
    main = at_reference(study, ref)
    blocks = {}
    core = main[main["label"].isin(["sync", "2bw", "2bw+ef"]) & (main["group"] == "main")]
    blocks["main"] = markdown(main_table(core, labels=("sync", "2bw", "2bw+ef"), ref=ref)) + "\n" + _ran(core)
    seed0 = main[(main["group"] == "main") & (main["seed"] == 0)]

    def sweep_block(axis: str, group: str, x: str | None = None, scale: float = 1.0, unit: str = "") -> str:
        t = sweep(study, axis, ref, x=x)
        col = x or axis
        t[col] = [f"{v / scale:.3g}{unit}" for v in t[col]]
        t = _fmt(t.drop(columns=[c for c in (axis,) if x and c != col]), {"sync": 3, "2bw": 3, "gap": "+3"})
        return markdown(t, index=False) + "\n" + _ran(study[study["group"] == group])

    blocks["tokens"] = sweep_block("tokens", "tokens", scale=1e6, unit="M")
    blocks["lr"] = sweep_block("lr_scale", "lr", x="lr")
    blocks["batch"] = sweep_block("batch", "batch")
    depth = _fmt(depth_table(study, ref), {"pipedream": 3, "gap pipedream": "+3", "gap 2bw": "+3"})
    blocks["depth"] = markdown(depth, index=False) + "\n" + _ran(study[study["group"] == "depth"])
    lam = _fmt(lambda_table(study, ref), {"lambda": "g", "loss": 3, "recovered": "%"})
    blocks["ef_lambda"] = markdown(lam, index=False) + "\n" + _ran(study[study["group"] == "ef_lambda"])
    nest = main_table(pd.concat([seed0, main[main["group"] == "nesterov"]]), ref=ref)
    nest = nest[[c for c in nest.columns if c.startswith(("2bw", "recovered"))]]
    blocks["nesterov"] = markdown(nest) + "\n" + _ran(study[study["group"] == "nesterov"])
    engine_cols = ["pairs", "engine", "emulation", "diff engine − emulation", "max |diff|", "seed noise σ",
                   "verdict", "train max rel"]
    for name, group in (("engine", ENGINE_GROUP), ("depth8-cpu", "depth8-cpu")):
        part = runs[runs["group"] == group]
        table = engine_table(pd.concat([part, study[study["group"] == "main"]]) if group == ENGINE_GROUP else part)
        blocks[name] = markdown(engine_summary(table)[engine_cols]) + "\n" + _ran(part)
    long = runs[runs["group"].isin(LONG_GROUPS)]
    if not long.empty:
        main_long = main_points(long)
        blocks["long"] = (markdown(long_table(long), index=False) + "\n" + _ran(main_long) + "\n"
                          + clock_line(main_long))
        lengths = long[long["group"].isin(["long", "long-lengths"])]
        blocks["long-lengths"] = (markdown(length_table(lengths), index=False) + "\n"
                                  + _ran(long[long["group"] == "long-lengths"]))
        blocks["long-seeds"] = seed_markdown(seed_table(lengths))
        lrs = long[long["group"].isin(LR_GROUPS)]
        blocks["long-lr"] = markdown(long_lr_table(lrs), index=False) + "\n" + _ran(
            long[long["group"].isin(["long-lr", "long-async-lr", "long-tuned"])])
        blocks["long-findings"] = long_findings(long, core)
        own = long[long["group"] == "long-own-lr"]
        blocks["long-own"] = markdown(own_best_table(long), index=False) + "\n" + (
            _ran(own) if len(own) else "Ran: no run of its own yet (`long-own-lr`): every point is another table's.\n")
        blocks["long-lambda"], blocks["long-delay"] = lambda_block(long), delay_block(long)
        blocks["long-moe"] = moe_block(long)
    paper = pd.DataFrame({"sync": PAPER["sync"], "2bw": PAPER["2bw"], "2bw+ef": PAPER["2bw+ef"],
                          "gap 2bw − sync": PAPER["2bw"] - PAPER["sync"],
                          "recovered by ef": [recovered_share(*PAPER.loc[o, ["sync", "2bw", "2bw+ef"]])
                                              for o in PAPER.index]}).rename_axis("optimizer")
    blocks["paper"] = markdown(_fmt(paper, {"gap 2bw − sync": "+3", "recovered by ef": "%"}))
    if ttl is not None:
        blocks["time-to-loss"] = time_to_loss_block(ttl)
    prov = provenance(runs).sort_values(["group", "runner"])
    prov["commit"] = [str(c)[:7] for c in prov["commit"]]
    blocks["provenance"] = markdown(prov.fillna("—"), index=False)
    return blocks


def render(page: str, blocks: dict[str, str]) -> str:
    """``page`` with each ``<!-- table: NAME -->`` ... ``<!-- end -->`` block's body replaced by ``blocks[NAME]``."""
    missing = set(blocks) - {m["name"] for m in BLOCK.finditer(page)}
    if missing:
        raise ValueError(f"the page has no block for {sorted(missing)}")
    return BLOCK.sub(lambda m: m[1] + blocks[m["name"]] + m[4], page)


def compact_images(nb, colors: int = 32) -> None:
    """Re-encode the notebook's PNG outputs with an adaptive palette of ``colors`` (line plots need few): about a
    quarter of the bytes, so that the executed notebook stays small enough to commit."""
    import base64
    import io

    from PIL import Image

    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "image/png" in data:
                image = Image.open(io.BytesIO(base64.b64decode(data["image/png"]))).convert("RGB")
                buf = io.BytesIO()
                image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(buf, "PNG", optimize=True)
                data["image/png"] = base64.b64encode(buf.getvalue()).decode()


def execute_notebook(path: str | Path, runs: str | None = None, timeout: int = 600) -> None:
    """Run the notebook at ``path`` top to bottom (on the run folders ``runs``, ``os.pathsep``-separated, else the
    committed results) and save it in place with its outputs (:func:`compact_images`)."""
    import nbclient
    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    old = os.environ.pop("DS_ASYNC_RUNS", None)
    if runs:
        os.environ["DS_ASYNC_RUNS"] = runs
    try:
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        os.environ.pop("DS_ASYNC_RUNS", None)
        if old is not None:
            os.environ["DS_ASYNC_RUNS"] = old
    compact_images(nb)
    nbformat.write(nb, path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ds_async.study.runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    rep = sub.add_parser("report", help="write the generated tables of the results page from the committed results")
    rep.add_argument("--check", action="store_true", help="only check that the page shows what the files give")
    rep.add_argument("--page", type=Path, default=PAGE)
    rep.add_argument("--results", type=Path, default=RESULTS)
    tab = sub.add_parser("table", help="print the main table and the engine pairs of run folders")
    tab.add_argument("roots", nargs="+")
    col = sub.add_parser("collect", help="add run folders to the committed results")
    col.add_argument("roots", nargs="+")
    col.add_argument("--results", type=Path, default=RESULTS)
    nb = sub.add_parser("notebook", help="execute the notebook in place (on run folders, else the results)")
    nb.add_argument("roots", nargs="*")
    nb.add_argument("--path", type=Path, default=ROOT / "notebooks" / "loss_curves.ipynb")
    args = parser.parse_args(argv)

    if args.cmd == "report":
        page = args.page.read_text()
        new = render(page, report(load_results(args.results), load_time_to_loss(args.results)))
        if args.check:
            if new != page:
                import difflib

                sys.stdout.writelines(difflib.unified_diff(page.splitlines(True), new.splitlines(True),
                                                           str(args.page), "regenerated"))
                print(f"{args.page}: its tables differ from what {args.results} gives", file=sys.stderr)
                return 1
            print(f"{args.page}: every table matches {args.results}")
            return 0
        args.page.write_text(new)
        print(f"wrote the tables of {args.page}")
    elif args.cmd == "table":
        runs = load_runs(args.roots)
        print(f"{len(runs)} runs")
        main = main_table(runs) if len(runs) else pd.DataFrame()
        if len(runs) and main.empty:  # no study matrix in them (e.g. a user's own runs): every run side by side
            mine = [your_runs.read_run(path) for path in runs["path"]]
            print(your_runs.table(mine))
            for sync, run in your_runs.pairs(mine):
                print("\n".join(your_runs.comparison_lines(your_runs.compare(sync, run))))
        elif len(runs):
            with pd.option_context("display.width", 200, "display.max_columns", 20):
                print(main.to_string())
                engine = engine_table(runs)
                if len(engine):
                    print("\nThe engine vs the emulation (final validation loss, same config):")
                    print(engine_summary(engine).to_string())
    elif args.cmd == "collect":
        both = collect(args.roots, args.results)
        print(f"{args.results}: {len(both)} runs")
    else:
        execute_notebook(args.path, os.pathsep.join(args.roots) or None)
        print(f"executed {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
