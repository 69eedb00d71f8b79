"""Run a job from ``tests/jobs.py`` on N CPU processes (gloo) with torchrun and collect what rank 0 saved.

Each job is one real multi-process DeepSpeed run; tests compare what the jobs save against independent
references computed in the test process. The ranks of a size stay up between jobs (:class:`_JobServer`): starting
torchrun and importing torch, DeepSpeed and transformers on every rank cost more CPU than most jobs themselves.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from ds_async.builder import free_local_port
from ds_async.models import hf_state_dict
from ds_async.models.partition import build_layers, uniform_stages
from ds_async.optim import build_optimizer
from ds_async.pipe.delayed import DelayedTrainer
from ds_async.pipe.versions import WeightVersions

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
# What makes launch/train.py take its world from a launcher (its own LAUNCHER_ENV, and torchrun's LOCAL_RANK): a
# test of a run without one removes these from the environment it passes on.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def free_port() -> int:
    """A port to listen on, free now, outside the kernel's ephemeral range: every listening port of the tests comes
    from here (:func:`ds_async.builder.free_local_port`)."""
    return free_local_port()


class _JobServer:
    """``nproc`` ranks of ``tests/jobs.py serve`` that stay up between jobs: each job runs in the same processes
    (one torchrun start, one import of torch, DeepSpeed and transformers, one process group for many jobs).

    Requests are files in a private folder: ``request<n>.json`` in; ``done<n>`` (rank 0, after a barrier) or
    ``error<n>.rank<r>.txt`` out. A rank whose job raises writes its traceback and exits, torchrun ends the others,
    and the server is gone: the next job starts a fresh one. The ranks also exit when this process dies."""

    def __init__(self, nproc: int):
        self.nproc, self.count = nproc, 0
        self.folder = Path(tempfile.mkdtemp(prefix=f"ds_async_jobs{nproc}_"))
        (self.folder / "owner").write_text(str(os.getpid()))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
               str(free_port()), str(ROOT / "tests" / "jobs.py"), "serve", str(self.folder)]
        self.log = open(self.folder / "log.txt", "wb")
        self.proc = subprocess.Popen(cmd, env=job_env(), cwd=self.folder, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def run(self, job: str, out_dir: Path, kwargs: dict, timeout: float) -> None:
        """Run one job; raise AssertionError (with the failing ranks' tracebacks) if it fails or times out."""
        n, self.count = self.count, self.count + 1
        start = (self.folder / "log.txt").stat().st_size
        request = self.folder / f"request{n}.json"
        request.with_suffix(".tmp").write_text(json.dumps({"job": job, "out": str(out_dir), "kwargs": kwargs}))
        request.with_suffix(".tmp").rename(request)
        deadline, failure = time.monotonic() + timeout, None
        while not (self.folder / f"done{n}").exists():
            if self.proc.poll() is not None:
                failure = f"rc={self.proc.returncode}"
            elif time.monotonic() > deadline:
                failure = f"timed out after {timeout} s"
            if failure:
                break
            time.sleep(0.02)
        self.log.flush()
        text = (self.folder / "log.txt").read_bytes()[start:].decode(errors="replace")
        (out_dir / "log.txt").write_text(text)
        if failure:
            errors = "".join(f.read_text() for f in sorted(self.folder.glob(f"error{n}.rank*.txt")))
            self.stop()
            raise AssertionError(f"job {job} on {self.nproc} ranks failed ({failure}):\n{errors}\nlog tail:\n"
                                 + text[-6000:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def threads(self) -> int:
        """The most threads one of the ranks runs. The ranks destroy each job's process groups after it
        (``tests/jobs.py``), but an object a job left behind can still hold a group, and with it the group's gloo
        threads, which wake all the time."""
        counts = []
        for pid_file in self.folder.glob("pid.rank*"):
            try:
                counts.append(len(os.listdir(f"/proc/{int(pid_file.read_text())}/task")))
            except (OSError, ValueError):
                pass
        return max(counts, default=0)

    def stop(self) -> None:
        """End the ranks (each leads a session of its own under torchrun) and the launcher."""
        (self.folder / "stop").write_text("")
        for pid_file in self.folder.glob("pid.rank*"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)  # a failed job's log is in its own folder
        _servers.pop(self.nproc, None)


_servers: dict[int, _JobServer] = {}
# Kept at once per test process: the sizes most jobs use (2, 3 and 4 ranks) stay up across test files, which run
# them in turn. Each rank holds ~0.6 GB once torch and DeepSpeed are imported (~0.4 GB of it its own), so a larger
# server (6 or 8 ranks: a job or two) ends after its job instead of displacing one of them.
MAX_SERVERS = 3
MAX_KEPT_RANKS = 4
MAX_THREADS = 64  # a server one of whose ranks runs more after a job ends (see _JobServer.threads)


@atexit.register
def _stop_servers() -> None:
    for server in list(_servers.values()):
        server.stop()


def job_env() -> dict:
    """The environment of every multi-process test job: one thread per rank, no dynamo, one extension cache."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1",
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                   str(Path.home() / ".cache" / "ds_async_torch_extensions"))}


def run_job(nproc: int, job: str, out_dir: Path, timeout: int = 600, **kwargs) -> dict:
    """Run ``job`` on ``nproc`` ranks; returns the ``result.pt`` the job wrote (rank 0's view).

    The ranks are a :class:`_JobServer`, kept for later jobs of the same size up to ``MAX_KEPT_RANKS`` ranks (see
    ``MAX_SERVERS``). Each job starts as in a fresh process: torch's default generator re-seeded to its start-up
    seed, the job's folder as working directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    kept = nproc <= MAX_KEPT_RANKS
    server = _servers.pop(nproc, None)
    if server is None or not server.alive():
        while kept and len(_servers) >= MAX_SERVERS:
            next(iter(_servers.values())).stop()  # the least recently used
        server = _JobServer(nproc)
    _servers[nproc] = server  # most recently used last
    server.run(job, out_dir, kwargs, timeout)
    if not kept or server.threads() > MAX_THREADS:
        server.stop()
    return torch.load(out_dir / "result.pt", weights_only=True)


def run_ckpt_jobs(work: Path, runs: list[dict], timeout: int = 600) -> Path:
    """Run ``tests/ckpt_jobs.py``'s trainer runs on 2 ranks (the job server's) over ``runs`` in folder ``work``; the
    job must succeed. Returns the folder holding each run's per-rank results (``NAME.rankR.json``); the log is
    ``work/log.txt``."""
    out = work / "out"
    run_job(2, "trainer_runs", out, timeout, runs=runs)
    shutil.copyfile(out / "log.txt", work / "log.txt")
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


def torchrun_train_py(nproc: int, config: Path, *args: str) -> list[str]:
    """The command that runs ``launch/train.py --config CONFIG ARGS`` under torchrun on ``nproc`` CPU ranks."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
            str(free_port()), str(ROOT / "launch" / "train.py"), "--config", str(config), *args]


def checkpoint_weights(folder: Path) -> dict:
    """Every tensor of a checkpoint folder's ``*.safetensors`` files, keyed ``FILE:NAME``."""
    return {f"{f.name}:{k}": v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def train_py_exit(argv: list[str]) -> int:
    """``launch/train.py ARGV`` in this process, which must end by ``sys.exit``; returns its status. The environment
    is put back afterwards: a run without a launcher sets RANK, WORLD_SIZE and MASTER_PORT for its one-process group,
    which a later job this process starts would otherwise take for its launcher's."""
    import runpy

    import pytest

    saved, environ = sys.argv, dict(os.environ)
    sys.argv = ["train.py", *argv]
    try:
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(ROOT / "launch" / "train.py"), run_name="__main__")
    finally:
        sys.argv = saved
        os.environ.clear()
        os.environ.update(environ)
    return exit_info.value.code


def train_py_error(argv: list[str], capsys) -> str:
    """``launch/train.py ARGV`` in this process: it must exit 1 with ``ds_async: error: ...`` as its last stderr
    line, which is returned (``capsys``: pytest's fixture of the calling test)."""
    assert train_py_exit(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ds_async: error: "), err
    return err[-1]


def two_versions(stage):
    """``WeightVersions`` of ``stage`` with two slots whose version 1 differs from version 0 in every tensor (1.5x),
    the master swapped back in."""
    versions = WeightVersions(stage, 2)
    with torch.no_grad():
        for (_, _, p) in versions.entries:
            p.mul_(1.5)
    versions.publish(1, needed_from=0)
    versions.restore_master()
    return versions
