"""Kill + ``--resume`` through the command line users run, with the layouts they run.

``launch/train.py`` under torchrun on 2 CPU ranks (gloo), for the shipped CPU configs as they are (every one
partitions by ``parameters``, the default) and for the other partition methods: a run is SIGKILLed once a periodic
checkpoint exists, then ``--resume`` continues it from the newest checkpoint to the end. The shipped config's run
resumed this way ends bit-equal to one that was never interrupted. Only the run's length, its cadences and the run
folder differ from the shipped files.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from distributed import checkpoint_weights, job_env, torchrun_train_py

from ds_async import checkpoint, jsonfile

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, END = 40, 2, 8  # a 40-step schedule, saved every 2 steps, killed mid-run, resumed up to step 8
CASES = {  # name: (shipped config, ds_async.partition to set, or None to keep the shipped one)
    "demo_cpu": ("demo_cpu.json", None),
    "demo_cpu_2bw": ("demo_cpu_2bw.json", None),
    "demo_cpu_mixtral": ("demo_cpu_mixtral.json", None),
    "uniform": ("demo_cpu.json", {"method": "uniform"}),
    "explicit": ("demo_cpu.json", {"method": "explicit", "boundaries": [0, 2, 6]}),
}


def shipped(file: str, folder: Path, name: str, partition: dict | None) -> Path:
    """The shipped config with a run length, cadences and run folder for a test."""
    config = json.loads((ROOT / "ds_configs" / file).read_text())
    section = config["ds_async"]
    assert section["partition"]["method"] == "parameters", "every shipped CPU config uses the default partition"
    if partition is not None:
        section["partition"] = partition
    section["train"]["steps"] = STEPS
    section["eval"] = {"every": 0, "batches": 2}
    section["checkpoint"] = {"every": EVERY, "keep": 2}
    section["logging"].update(dir=str(folder / "runs"), run_name=name, progress=False, plot=False)
    config["scheduler"]["params"].pop("total_num_steps", None)  # filled in from the run length
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def start(config: Path, folder: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(torchrun_train_py(2, config, *args), env=job_env(), cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    return out


def kill_after_checkpoint(jobs: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    """SIGKILL each job's launcher and ranks once its step ``EVERY * 2`` checkpoint is complete, watching all of
    them at once: a job left running while another is awaited could finish (and drop that checkpoint, ``keep: 2``)
    before it is killed."""
    deadline = time.time() + 300
    waiting = dict(jobs)
    while waiting:
        for name, (proc, root) in list(waiting.items()):
            if not (checkpoint.step_dir(root, 2 * EVERY) / checkpoint.MANIFEST).exists():
                assert proc.poll() is None, proc.stdout.read()[-5000:]
                continue
            family = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            for pid in family:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.communicate(timeout=60)
            del waiting[name]
        assert time.time() < deadline, f"no checkpoint appeared: {sorted(waiting)}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every case killed after a checkpoint and resumed to step ``END``, and the default config uninterrupted.
    Two jobs at a time (one per core)."""
    folder = tmp_path_factory.mktemp("cli_resume")
    configs = {name: shipped(file, folder, name, partition) for name, (file, partition) in CASES.items()}
    configs["reference"] = shipped("demo_cpu.json", folder, "reference", None)
    out = {}
    names = list(CASES)
    reference = start(configs["reference"], folder, "--max-steps", str(END))
    for first in range(0, len(names), 2):
        batch = names[first:first + 2]
        procs = {n: start(configs[n], folder) for n in batch}
        kill_after_checkpoint({n: (proc, folder / "runs" / n / "checkpoints") for n, proc in procs.items()})
        procs = {n: start(configs[n], folder, "--resume", "--max-steps", str(END)) for n in batch}
        out.update({n: finish(proc) for n, proc in procs.items()})
    out["reference"] = finish(reference)
    return {"folder": folder, "out": out}


@pytest.mark.parametrize("case", list(CASES))
def test_killed_run_resumes_with_its_layout(runs, case):
    run = runs["folder"] / "runs" / case
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == END and summary["resumed_from"] is not None, runs["out"][case][-3000:]
    resumed_at = int(Path(summary["resumed_from"]).name.split("_")[1])
    assert 2 * EVERY <= resumed_at < END
    assert f"ds_async: resumed from {summary['resumed_from']} (step {resumed_at})" in runs["out"][case]
    # The curve goes on from the checkpoint: one entry per step, the killed process's steps then the resumed ones.
    assert [s for s, _ in summary["history"]["train"]] == list(range(1, END + 1))
    manifest = json.loads((checkpoint.step_dir(run / "checkpoints", END) / checkpoint.MANIFEST).read_text())
    assert all(type(p) is int for p in manifest["parts"]), manifest["parts"]
    if case == "explicit":
        assert manifest["parts"] == CASES[case][1]["boundaries"]


def test_resumed_default_config_equals_an_uninterrupted_run(runs):
    """The shipped default config, killed and resumed: the same weights at step ``END`` as a run never stopped."""
    got = checkpoint_weights(checkpoint.step_dir(runs["folder"] / "runs" / "demo_cpu" / "checkpoints", END))
    want = checkpoint_weights(checkpoint.step_dir(runs["folder"] / "runs" / "reference" / "checkpoints", END))
    assert got.keys() == want.keys() and got
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_manifest_values_that_are_not_plain_json_are_refused_naming_where():
    """No value is stringified behind the writer's back: a numpy integer (what DeepSpeed's partition returns) or a
    str subclass is refused with its path, the builtin types are written as themselves."""
    import numpy as np

    with pytest.raises(TypeError, match=r"\$\.parts\[1\]: np.int64\(3\) \(numpy.int64\) is not plain JSON"):
        jsonfile.dumps({"parts": [0, np.int64(3), 6]})
    with pytest.raises(TypeError, match=r"\$\.code\.torch: .*torch.torch_version.TorchVersion"):
        jsonfile.dumps({"code": {"torch": torch.__version__}})
    with pytest.raises(TypeError, match=r"\$\.id2label: key 0 \(int\) is not a JSON string"):
        jsonfile.dumps({"id2label": {0: "a"}})
    doc = {"parts": [0, 3, 6], "lr": 1e-3, "nan": float("nan"), "name": "x", "none": None, "pair": (1, 2)}
    assert json.loads(jsonfile.dumps(doc))["parts"] == [0, 3, 6]
