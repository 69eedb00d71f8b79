"""The study's rows: one per run (:data:`COLUMNS`), read from run folders or from the committed results.

- run folders written by ``launch/train.py`` or ``python -m ds_async.emulate`` (``manifest.json`` with the resolved
  ``ds_async`` config and the ``deepspeed`` block, ``summary.json`` with the loss history), anywhere below the
  given roots: :func:`load_runs`;
- the study's committed results, ``launch/study/results/runs.csv`` (a row per run) and ``curves.json`` (its
  validation curve and a subsampled training curve): :func:`load_results`; :func:`write_results` writes them,
  :func:`collect` adds run folders to them.

Also the constants the tables share: where the results live, the sweep axes, the paper's figures. pandas is needed
(``pip install ds_async[notebooks]``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import shlex
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from ..config import override
from .matrices import MATRICES, Run, matrix


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
        "dirty": manifest["code"].get("dirty"), "declared_commit": None,
        "note": provenance_note(manifest["code"], summary),
        "driver": "ds_async.emulate" if emulation else "launch/train.py",
        "command": study_command(folder, runner) or job_command(manifest, config_file),
        "seconds_per_step": round(summary["seconds"] / max(1, steps), 5) if summary else None,
        "config_key": config_key(ds, dsc),
        "val_steps": [s for s, _ in val], "val_loss": [v for _, v in val],
        "train_steps": [s for s, _ in train], "train_loss": [v for _, v in train],
    }


def job_command(manifest: dict, config_file: str) -> str:
    """The job's own command line that ran: its JSON file and the ``--set`` overrides the manifest records."""
    if manifest.get("emulation"):
        line = f"python -m ds_async.emulate --config {config_file}"
    else:
        line = f"torchrun --nproc_per_node {manifest.get('world_size')} launch/train.py --config {config_file}"
    return line + "".join(f" --set {shlex.quote(f'{key}={json.dumps(value)}')}"
                          for key, value in manifest.get("overrides", {}).items())


@functools.cache
def matrix_runs() -> dict[tuple[str, str], list[tuple[str, Run]]]:
    """Every matrix's runs by (group, name), each with the matrices that list it, in ``MATRICES``' order (``tiny``
    names its runs as ``main`` does, on another base)."""
    found = {}
    for name in MATRICES:
        for run in matrix(name):
            found.setdefault((run.group, run.name), []).append((name, run))
    return found


def study_command(folder: Path, runner: str) -> str | None:
    """The study driver's command that trains the run in ``folder`` again, where the folder is the driver's
    (``OUT/<runner>/<group>/<name>/``) and its ``config.json`` is the run as a matrix defines it now (no ``--set``,
    no matrix changed since): the first such matrix's; else None."""
    config = folder / "config.json"
    if folder.parent.parent.name != runner or not config.exists():
        return None
    written = json.loads(config.read_text())
    logging = written.get("ds_async", {}).get("logging", {})
    if "dir" not in logging or "run_name" not in logging:
        return None
    for name, run in matrix_runs().get((folder.parent.name, folder.name), []):
        # what the driver writes (``driver.write_config``): the run's JSON, logging into its folder
        defined = override(run.config(), {"ds_async.logging.dir": logging["dir"],
                                          "ds_async.logging.run_name": logging["run_name"]})
        if json.loads(json.dumps(defined)) == written:
            return f"python launch/study/run.py {name} --only '{run.group}/{run.name}'" + (
                " --runner engine" if runner == "engine" else "")
    return None


# How a row's commit and dirty flag were known where git in the checkout did not say (``metrics.code_version``).
SOURCES = {
    "DS_ASYNC_COMMIT": "a copy of the tree (no usable .git): the commit as DS_ASYNC_COMMIT named it, its files not "
                       "checked",
    "DS_ASYNC_TREE": "a copy of the tree (no usable .git): the commit as DS_ASYNC_COMMIT named it, every tracked file "
                     "hashed against its git ls-tree (DS_ASYNC_TREE)",
}


def provenance_note(code: dict, summary: dict) -> str | None:
    """The row's ``note``: how its commit was known, unless git in the checkout said it, and whether the run
    resumed from a saved state (its manifest, commit included, is the last call's)."""
    parts = [SOURCES[code["source"]]] if code.get("source", "git") != "git" else []
    if summary.get("resumed_from"):
        parts.append("resumed from a saved state: the manifest is the last call's")
    return "; ".join(parts) or None


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
    {"steps": [...], "loss": [...]}, "train": {...}}``, one run a line: every validation point; training steps 1,
    every :func:`train_stride`-th and the last; losses to 6 significant digits). Steps and losses are columns, not
    ``[step, loss]`` pairs, since the file is committed and grows with every run."""
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
            kept = [(step, float(f"{loss:.6g}")) for step, loss in zip(steps, losses)
                    if curve == "val" or step == 1 or step % every == 0 or step == last]
            doc[curve] = {"steps": [step for step, _ in kept], "loss": [loss for _, loss in kept]}
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
            points = curves.get(run_id, {}).get(curve, {"steps": [], "loss": []})
            rec[f"{curve}_steps"] = [int(s) for s in points["steps"]]
            rec[f"{curve}_loss"] = [float(v) for v in points["loss"]]
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
