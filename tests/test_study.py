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


# ---------------------------------------------------------------------------------------------------------------
# The real engine vs the emulation


def test_engine_matrix_pairs_each_engine_run_with_its_emulation():
    launcher = _launcher()
    runs = launcher.matrix("engine")
    engine = [r for r in runs if r.engine == "deepspeed"]
    assert len(engine) == 9 and len(runs) == 18 and {r.group for r in runs} == {"engine"}
    assert {(r.optimizer, r.variant) for r in engine} == {("muon", "2bw+ef"), ("adamw", "2bw"), ("adamw", "sync")}
    assert {r.seed for r in engine} == {0, 1, 2}
    main = {(r.optimizer, r.variant, r.seed): r.resolved() for r in launcher.matrix("main")}
    twins = {r.name: r for r in runs if r.engine == "emulation"}
    for r in engine:
        twin = twins[r.name.replace("-deepspeed", "-emulation")]
        assert launcher.dataclasses.replace(r, name=twin.name, engine="emulation") == twin
        launcher.check_engine(r.resolved())  # the engine can run it as specified
        # the main matrix's step: the same 48 rows, LR schedule and length, split into 2 micro-batches of 24
        a, b = r.resolved(), main[(r.optimizer, r.variant, r.seed)]
        assert (a.micro_batches, a.micro_batch_size, a.stages) == (2, 24, 2)
        assert a.tokens_per_step == b.tokens_per_step and (a.steps, a.eval_every, a.lr, a.warmup) == (
            b.steps, b.eval_every, b.lr, b.warmup)
        assert a.eval_batch_size == a.micro_batch_size and a.eval_batches * a.eval_batch_size <= (
            b.eval_batches * b.eval_batch_size)
    shares = [launcher.split(engine, i, 2) for i in range(2)]
    assert sorted(r.name for s in shares for r in s) == sorted(r.name for r in engine)


def test_engine_refuses_what_it_cannot_run_like_the_emulation():
    launcher = _launcher()
    ok = launcher.RunSpec(name="x", schedule="2bw", engine="deepspeed", micro_batches=2, micro_batch_size=4,
                          eval_batch_size=4, steps=1)
    launcher.check_engine(ok)
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        launcher.check_engine(launcher.dataclasses.replace(ok, micro_batches=1))
    with pytest.raises(ValueError, match="eval_batch_size = micro_batch_size"):
        launcher.check_engine(launcher.dataclasses.replace(ok, eval_batch_size=8))
    with pytest.raises(ValueError, match="engine must be one of"):
        launcher.check_engine(launcher.dataclasses.replace(ok, engine="megatron"))
    launcher.check_engine(launcher.dataclasses.replace(ok, engine="emulation", micro_batches=1, eval_batch_size=8))


def _paired_runs(rows, noise_rows=()) -> pd.DataFrame:
    """Hand-made engine pairs (optimizer, label, seed, emulation loss, engine loss) in group ``engine``, plus main
    matrix runs (optimizer, label, seed, loss) for the seed noise."""
    base = {"model": "20m", "seq_len": 256, "batch": 48, "tokens": 1000, "lr_scale": 1.0, "diverged": False,
            "complete": True, "card": "card", "seconds_per_step": 0.1, "tokens_per_step": 100,
            "train_steps": [1, 2], "val_steps": [2]}
    out = []
    for opt, label, seed, emu, eng in rows:
        for engine, val in (("emulation", emu), ("deepspeed", eng)):
            out.append({**base, "path": f"engine/{opt}-{label}-s{seed}-{engine}", "group": "engine",
                        "optimizer": opt, "label": label, "seed": seed, "engine": engine, "micro_batches": 2,
                        "final_val": val, "train_loss": [9.0, val + 1], "val_loss": [val],
                        "config_key": f"{opt}/{label}/{seed}"})
    for opt, label, seed, val in noise_rows:
        out.append({**base, "path": f"main/{opt}-{label}-s{seed}", "group": "main", "optimizer": opt, "label": label,
                    "seed": seed, "engine": "emulation", "micro_batches": 1, "final_val": val,
                    "train_loss": [9.0, val + 1], "val_loss": [val], "config_key": f"main/{opt}/{label}/{seed}"})
    return pd.DataFrame(out)


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
    # the pairs stay out of the main table
    ref = study.reference(runs)
    assert set(study.at_reference(runs, ref)["group"]) == {"main"}


@pytest.fixture(scope="module")
def engine_tiny_runs(tmp_path_factory):
    """``--matrix engine-tiny``: its emulation runs (one process, tokenizing into a fresh cache), then its engine
    runs on 2 gloo ranks under torchrun, which read only the token cache (their --data-dir does not exist)."""
    if not (CORPUS / "tokenizers" / "bpe8192.json").exists():
        pytest.skip(f"shared corpus not found at {CORPUS} (the repo must be cloned next to shared/)")
    out = tmp_path_factory.mktemp("engine_study")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  str(Path.home() / ".cache" / "ds_async_torch_extensions"))}
    common = ["--matrix", "engine-tiny", "--out", str(out / "runs"), "--token-cache", str(out / "tokens"),
              "--device", "cpu", "--threads", "1", "--quiet"]
    emulation = subprocess.run([sys.executable, str(ROOT / "launch" / "study.py"), *common, "--engine", "emulation",
                                "--data-dir", str(CORPUS)], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300)
    assert emulation.returncode == 0, (emulation.stdout + emulation.stderr)[-5000:]
    assert "[matrix] 3/3 runs" in emulation.stdout
    engine = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(31000 + os.getpid() % 2000), str(ROOT / "launch" / "study.py"), *common,
                             "--data-dir", str(out / "no-corpus")],
                            cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert engine.returncode == 0, (engine.stdout + engine.stderr)[-5000:]
    assert "[matrix] 3 engine runs" in engine.stdout
    return out / "runs"


def test_engine_runs_equal_their_emulation_on_cpu(engine_tiny_runs):
    """fp32 on CPU: the real engine on 2 processes trains exactly as the emulation of the same spec: identical
    validation losses at every validation point, per-step training losses within 1e-6 (the engine averages the
    micro-batch losses in fp32, the emulation in float64), the same logged learning rates."""
    runs = study.load_runs(engine_tiny_runs)
    assert len(runs) == 6 and (runs["group"] == "engine").all() and runs["complete"].all()
    assert sorted(runs["engine"]) == ["deepspeed"] * 3 + ["emulation"] * 3
    for _, run in runs[runs["engine"] == "deepspeed"].iterrows():
        eng_dir = Path(run["path"])
        emu_dir = eng_dir.with_name(eng_dir.name.replace("-deepspeed", "-emulation"))
        assert sorted(p.name for p in eng_dir.iterdir() if not p.name.startswith("events.")) == [
            "manifest.json", "summary.json"]
        m_eng, m_emu = (json.loads((d / "manifest.json").read_text()) for d in (eng_dir, emu_dir))
        assert m_eng["card"].startswith("2x cpu") and m_eng["world_size"] == 2 and m_eng["code"]["commit"]
        assert m_eng["run"]["engine"] == "deepspeed" and m_emu["run"]["engine"] == "emulation"
        assert {k: v for k, v in m_eng["run"].items() if k not in ("name", "engine")} == {
            k: v for k, v in m_emu["run"].items() if k not in ("name", "engine")}
        assert m_eng["deepspeed"]["optimizer"] == m_emu["optimizer"] and m_eng["correction"] == m_emu["correction"]
        assert m_eng["engine"]["schedule"] == m_eng["run"]["schedule"] and m_eng["run"]["precision"] == "fp32"
        s_eng, s_emu = (json.loads((d / "summary.json").read_text()) for d in (eng_dir, emu_dir))
        assert s_eng["history"]["validation"] == s_emu["history"]["validation"], run["name"]  # bit-equal
        assert len(s_eng["history"]["validation"]) == 3
        train_eng, train_emu = s_eng["history"]["train"], s_emu["history"]["train"]
        assert [s for s, _ in train_eng] == [s for s, _ in train_emu] == list(range(1, 31))
        for (_, a), (_, b) in zip(train_eng, train_emu):
            assert a == pytest.approx(b, rel=1e-6, abs=0)
        lr_eng, lr_emu = (study._scalars(d, "train/lr") for d in (eng_dir, emu_dir))
        assert lr_eng == lr_emu and len(lr_eng[0]) == 30
    table = study.engine_table(runs)
    assert len(table) == 3 and (table["diff"] == 0).all() and (table["verdict"] == "identical").all()
    assert set(zip(table["optimizer"], table["label"])) == {("muon", "2bw+ef"), ("adamw", "2bw"), ("adamw", "sync")}
    assert list(study.engine_summary(table)["verdict"]) == ["identical"] * 3
    fig = study.plot_engine(runs)
    assert len(fig.axes) == 6
    # none of them is a main-matrix run
    assert study.at_reference(runs, study.reference(runs)).empty
