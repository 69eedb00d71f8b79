"""The loss-curve study: the table's arithmetic on hand-made runs, the run matrices, and the whole chain on CPU
(the ``tiny`` matrix through ``launch/study.py``, then ``notebooks/loss_curves.ipynb`` executed on its runs)."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from ds_async import study

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "corpus"


def _launcher():
    """``launch/study.py`` as a module (it imports nothing heavy at the top)."""
    if "study_launcher" not in sys.modules:
        spec = importlib.util.spec_from_file_location("study_launcher", ROOT / "launch" / "study.py")
        module = sys.modules["study_launcher"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["study_launcher"]


def _runs(rows) -> pd.DataFrame:
    """Hand-made runs: (optimizer, label, seed, final_val[, axis overrides])."""
    base = {"model": "20m", "seq_len": 256, "batch": 48, "tokens": 1000, "lr_scale": 1.0, "group": "main",
            "diverged": False}
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
    assert shown.loc["adamw", "gap 2bw − sync"] == "0.300 ± 0.000"
    assert shown.loc["adamw", "recovered by ef"] == "67% (n=2)"
    assert shown.loc["adamw", "recovered by nesterov"] == "17% (n=1)"
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
    assert ref == {"model": "20m", "seq_len": 256, "batch": 48, "tokens": 1000, "lr_scale": 1.0}
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


def test_matrices_and_split():
    launcher = _launcher()
    main = launcher.matrix("main")
    assert len(main) == 18 and {(r.optimizer, r.variant) for r in main} == {
        (o, v) for o in ("adamw", "muon") for v in ("sync", "2bw", "2bw+ef")}
    assert {r.seed for r in main} == {0, 1, 2}
    extras = launcher.matrix("extras")
    assert {r.group for r in extras} == {"tokens", "lr", "batch", "depth", "ef_lambda", "nesterov"}
    assert {r.stages for r in extras if r.schedule == "pipedream"} == {2, 4, 8}
    for runs in (main, extras):
        shares = [launcher.split(runs, i, 2) for i in range(2)]
        names = [f"{r.group}/{r.name}" for share in shares for r in share]
        assert sorted(names) == sorted(f"{r.group}/{r.name}" for r in runs)
        loads = [sum(launcher.estimated_seconds(r) for r in share) for share in shares]
        assert max(loads) <= 1.1 * min(loads)
    # the planned GPU budget of the brief: main <= ~4 min, extras ~6 min
    assert sum(launcher.estimated_seconds(r) for r in main) <= 4 * 60
    assert sum(launcher.estimated_seconds(r) for r in extras) <= 6.5 * 60


def test_lr_schedule():
    f = _launcher().lr_factor
    assert [f(s, 100, 10, 0.1) for s in (0, 9)] == [0.1, 1.0]
    assert f(10, 100, 10, 0.1) == pytest.approx(1.0) and f(55, 100, 10, 0.1) == pytest.approx(0.55)
    assert f(100, 100, 10, 0.1) == pytest.approx(0.1)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    if not (CORPUS / "tokenizers" / "bpe8192.json").exists():
        pytest.skip(f"shared corpus not found at {CORPUS} (the repo must be cloned next to shared/)")
    out = tmp_path_factory.mktemp("study")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "study.py"), "--matrix", "tiny", "--out",
                           str(out / "runs"), "--token-cache", str(out / "tokens"), "--data-dir", str(CORPUS),
                           "--device", "cpu", "--threads", "1", "--quiet"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert "[matrix] 21/21 runs" in proc.stdout
    return out / "runs"


def test_tiny_matrix_run_folders(tiny_runs):
    folders = study.find_runs(tiny_runs)
    assert len(folders) == 21
    for folder in folders:
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("events.")) == [
            "manifest.json", "summary.json"]
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["card"].startswith("cpu") and manifest["code"]["commit"]
        assert manifest["run"]["seed"] == manifest["seed"] and manifest["run"]["steps"] >= 15
        assert manifest["optimizer"]["type"] in ("AdamW", "Muon")
    runs = study.load_runs(tiny_runs)
    assert runs["complete"].all() and not runs["diverged"].any()
    assert runs["val_steps"].map(len).min() >= 2 and runs["train_steps"].map(len).min() >= 15
    table = study.gap_table(study.at_reference(runs, study.reference(runs)))
    assert list(table.index) == ["adamw", "muon"]
    for col in ("sync", "2bw", "2bw+ef", "gap", "recovered 2bw+ef"):
        assert table[col].map(math.isfinite).all(), col
    assert (table["sync n"] == 2).all() and table.loc["adamw", "2bw+nesterov n"] == 1
    # same seed, same initial weights and data: the variants' first losses agree (no delay at step 1)
    first = runs[runs["group"] == "main"].groupby("seed")["train_loss"].apply(lambda s: {round(x[0], 5) for x in s})
    assert first.map(len).max() == 1


def test_notebook_executes_on_the_tiny_runs(tiny_runs):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "notebooks" / "loss_curves.ipynb", as_version=4)
    old = os.environ.get("DS_ASYNC_RUNS")
    os.environ["DS_ASYNC_RUNS"] = str(tiny_runs)
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    finally:
        if old is None:
            os.environ.pop("DS_ASYNC_RUNS")
        else:
            os.environ["DS_ASYNC_RUNS"] = old
    text, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", f"{out.get('ename')}: {out.get('evalue')}"
            text.append(out.get("text", "") + out.get("data", {}).get("text/plain", ""))
            images += "image/png" in out.get("data", {})
    text = "\n".join(text)
    assert "21 runs under" in text and "recovered by ef" in text
    for absent in ("no token-budget", "no LR", "no batch-size", "no PipeDream", "no λ", "no nesterov"):
        assert absent not in text, absent
    assert images >= 6  # curves, tokens, LR, batch, depth, λ
