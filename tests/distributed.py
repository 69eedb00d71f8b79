"""Run a job from ``tests/jobs.py`` on N CPU processes (gloo) with torchrun and collect what rank 0 saved.

Each job is one real multi-process DeepSpeed run; tests compare what the jobs save against independent
references computed in the test process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def run_job(nproc: int, job: str, out_dir: Path, timeout: int = 600, **kwargs) -> dict:
    """Run ``job`` on ``nproc`` ranks; returns the ``result.pt`` the job wrote (rank 0's view)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  str(Path.home() / ".cache" / "ds_async_torch_extensions"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
           str(29500 + (os.getpid() % 2000)), str(ROOT / "tests" / "jobs.py"), job, str(out_dir),
           json.dumps(kwargs)]
    proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=timeout)
    (out_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(f"job {job} on {nproc} ranks failed (rc={proc.returncode}); log tail:\n"
                             + (proc.stdout + proc.stderr)[-6000:])
    return torch.load(out_dir / "result.pt", weights_only=True)


def run_ckpt_jobs(work: Path, runs: list[dict], timeout: int = 600) -> Path:
    """Run ``tests/ckpt_jobs.py`` (trainer runs) on 2 ranks over ``runs`` in folder ``work``; the job must succeed.
    Returns the folder holding each run's per-rank results (``NAME.rankR.json``); the log is ``work/log.txt``."""
    (work / "runs.json").write_text(json.dumps(runs))
    out = work / "out"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  str(Path.home() / ".cache" / "ds_async_torch_extensions"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
           str(31000 + os.getpid() % 1000), str(ROOT / "tests" / "ckpt_jobs.py"), str(work / "runs.json"), str(out)]
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=timeout)
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return out


def stage_params(out_dir: Path, stages: int) -> dict:
    """All stages' parameters of a job, by Hugging Face name."""
    merged = {}
    for s in range(stages):
        merged.update(torch.load(out_dir / f"params_stage{s}.pt", weights_only=True))
    return merged


def emulate_run(schedule: str, stages: int, steps: int, micro_batches: int, data_parallel: int, optimizer: dict,
                seq_len: int, mbs: int, clip: float = 1.0, data_seed: int = 0, seed: int = 1234,
                model: dict | None = None, correction: dict | None = None, bf16: bool = False,
                with_masters: bool = False):
    """The single-process emulation of a ``jobs.job_train`` run: (per-step losses, final parameters by HF name).
    ``model`` is the job's ``ds_async.model`` section (default: the tiny LLaMA); ``bf16``: bf16 weights with the
    optimizer's fp32 masters (:class:`~ds_async.optim.master.MasterWeights`), as the engine runs ds_async's
    optimizers under ``"bf16": {"enabled": true}``; ``with_masters``: also return those masters flattened, in the
    order of ``master_stage<s>.pt`` concatenated over the stages."""
    from ds_async.emulate import DelayedTrainer, build_layers, uniform_stages
    from ds_async.models import hf_state_dict
    from ds_async.optim import build_optimizer
    from jobs import TINY_LLAMA, global_micro_batches

    torch.set_num_threads(1)  # as the job's ranks (OMP_NUM_THREADS=1): the same kernels, the same rounding
    layers, loss_fn, _ = build_layers(model or {"config": TINY_LLAMA}, seed=seed)
    stage_of = uniform_stages(len(layers), stages)
    opt = build_optimizer(optimizer, layers, correction)
    if bf16:
        from ds_async.optim.master import MasterWeights
        opt = MasterWeights(opt, layers)
    trainer = DelayedTrainer(layers, stage_of, loss_fn, opt, schedule, micro_batches, stages,
                             data_parallel=data_parallel, clip=clip)
    g = micro_batches * data_parallel
    batches = global_micro_batches(data_seed, seq_len, mbs, steps * g)
    losses = [trainer.train_batch(batches[t * g:(t + 1) * g]) for t in range(steps)]

    class _Stage:
        forward_funcs = layers

    params = {k: v.detach().clone() for k, v in hf_state_dict(_Stage).items()}
    if with_masters:
        masters = torch.cat([opt.master_of(p).detach().flatten() for p in layers.parameters()])
        return torch.tensor(losses, dtype=torch.float64), params, masters
    return torch.tensor(losses, dtype=torch.float64), params


def assert_params_close(have: dict, want: dict, rel: float) -> None:
    """Every tensor within ``rel`` of the reference in relative L2 norm (``rel=0``: bit-equal); on failure name
    the tensor with its error and how many entries differ."""
    assert have.keys() == want.keys(), sorted(set(have) ^ set(want))
    for name, w in want.items():
        err = (have[name] - w).norm() / w.norm()
        if err > rel or (rel == 0 and not torch.equal(have[name], w)):
            diff = (have[name] - w).abs()
            raise AssertionError(f"{name}: relative error {err.item():.3g} > {rel}; {int((diff > 0).sum())}/"
                                 f"{w.numel()} entries differ, max abs {diff.max().item():.3g}")


def train_py_error(argv: list[str], capsys) -> str:
    """``launch/train.py ARGV`` in this process: it must exit 1 with ``ds_async: error: ...`` as its last stderr
    line, which is returned (``capsys``: pytest's fixture of the calling test)."""
    import runpy

    import pytest

    saved = sys.argv
    sys.argv = ["train.py", *argv]
    try:
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(ROOT / "launch" / "train.py"), run_name="__main__")
    finally:
        sys.argv = saved
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ds_async: error: "), err
    return err[-1]
