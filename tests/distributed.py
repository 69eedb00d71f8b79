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
