"""``ds_async.initialize``: ``deepspeed.initialize`` for pipelines, building ds_async's engine.

``deepspeed.initialize`` hard-codes ``PipelineEngine`` for a ``PipelineModule``; this is its pipeline branch with
our class. Everything else (config parsing, optimizer and scheduler construction from the JSON) is DeepSpeed's.
"""
from __future__ import annotations

import os
import random
import socket
from typing import NamedTuple

import deepspeed
import torch
import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe import p2p
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from deepspeed.utils import groups as ds_groups
from torch.distributed import distributed_c10d

from .config import DsAsyncConfig
from .optim.client import client_optimizer
from .pipe.engine import AsyncPipelineEngine
from .pipe.version_rule import SYNC
from .prefetch import ReaderProcess, reads_in_background


def free_local_port() -> int:
    """A local port free now for a process group's store (``MASTER_PORT``), outside the kernel's ephemeral range
    (32768-60999 on Linux): a port the kernel hands out (``bind(0)``) it may hand out again, as the source port of any
    of the many connections gloo opens, before the store listens on it; ports below the range are only taken by
    explicit binds."""
    rng = random.Random(os.urandom(8))
    for _ in range(100):
        port = rng.randrange(20000, 29000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # every try taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_reader(cfg: DsAsyncConfig, rank: int, world: int, device_type: str) -> ReaderProcess | None:
    """On a rank that will read the training stream in a reader process (``performance.data_reader`` on a
    ``device_type`` device, and a first or last stage): that process, started now so that its imports overlap
    whatever the caller does next; else None. A world that ``pipeline_stages`` does not divide gets None: the job's
    own checks refuse it."""
    if world % cfg.pipeline_stages or not reads_in_background(cfg.performance.data_reader, torch.device(device_type)):
        return None
    return ReaderProcess(imports=("ds_async.data", "datasets")) if place_of(cfg, rank, world).reads_data else None


class Place(NamedTuple):
    """Where a rank sits in the pipeline-and-replica grid."""
    stage: int
    stages: int
    replica: int  # its data-parallel rank
    replicas: int  # the data-parallel degree

    @property
    def reads_data(self) -> bool:
        """The first stage reads the inputs, the last the labels."""
        return self.stage in (0, self.stages - 1)


def place_of(cfg: DsAsyncConfig, rank: int, world: int) -> Place:
    """``rank``'s place as the engine's grid will have it, for what must know it before any module exists: DeepSpeed's
    topology for a pipeline module of ``pipeline_stages`` stages on ``world`` ranks (stages outermost), the one its
    ``PipelineModule`` builds."""
    stages = cfg.pipeline_stages
    coord = PipeDataParallelTopology(num_pp=stages, num_dp=world // stages).get_coord(rank)
    return Place(coord.pipe, stages, coord.data, world // stages)


def check_place(engine: AsyncPipelineEngine, place: Place) -> None:
    """Raise if the built engine put this rank elsewhere than :func:`place_of` said before it existed: what was
    read or started for that place (the data stream of a replica, a reader process) would be another's."""
    grid = engine.grid
    built = Place(engine.stage_id, engine.num_stages, grid.data_parallel_id, grid.data_parallel_size)
    if built != place:
        raise RuntimeError(f"the engine's grid puts this rank at {built}, DeepSpeed's topology before the engine was "
                           f"built at {place}: data read for one place would feed another")


def init_distributed() -> None:
    """Join the process group the launcher (deepspeed, torchrun) described; gloo on CPU. Idempotent.

    On CPU, DeepSpeed's communication backend would first JIT-compile its shared-memory all-reduce op, which sits
    silent for minutes on a machine's first run; only DeepSpeed's inference tensor parallelism calls that op (the
    process group's all-reduce serves training), so it is marked unavailable here and never built.

    On an accelerator each process takes the device of its ``LOCAL_RANK``, as the launchers lay them out, before
    anything is placed on "the current device": DeepSpeed's engine sets it only when it is built, after the client
    optimizer has put its fp32 masters and state there (every rank's on device 0 otherwise)."""
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not tdist.is_initialized():
        shm = accelerator.create_op_builder("ShareMemCommBuilder")
        if shm is not None:
            deepspeed.ops.__compatible_ops__[shm.NAME] = False  # DeepSpeed keeps this dict; it reads it to decide
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())


def process_groups() -> set:
    """The process groups this process holds now, the default one included (torch lists them only privately)."""
    return set(distributed_c10d._world.pg_names)


def destroy_groups(keep: set) -> None:
    """Destroy every process group but those in ``keep`` (from :func:`process_groups`), newest first: the groups a
    finished job made (its engine's grid, the trainer's own). Each gloo group keeps three threads that wake all the
    time until its last reference goes, so a process that runs job after job (a notebook, a sweep, the tests' job
    server) would idle at a cost that grows with every job. DeepSpeed's destroy also drops the groups it caches; its
    pipeline's point-to-point module and ``groups.mpu`` hold the last engine's grid and let go of it here (the next
    engine sets both again)."""
    world = distributed_c10d._world
    for pg in reversed([pg for pg in world.pg_names if pg not in keep]):
        deepspeed.comm.destroy_process_group(pg)
    p2p._groups = p2p._grid = None
    ds_groups.mpu = None


def without_throughput_sync(config: dict) -> dict:
    """``config`` with DeepSpeed's throughput timer off unless it sets ``timers.throughput`` itself. The pipeline
    engine starts that timer at every forward pass, and by default (``synchronized``) each start waits for the
    device to finish all queued work, so the host could never run ahead of its GPU; ds_async measures rates and
    idle time itself (:mod:`ds_async.telemetry`) without waiting."""
    if "throughput" in (config.get("timers") or {}):
        return config
    return {**config, "timers": {**(config.get("timers") or {}), "throughput": {"enabled": False}}}


def initialize(model: PipelineModule, config: dict, schedule: str = SYNC.name, correction=None, optimizer=None,
               lr_scheduler=None, model_parameters=None, fused_optimizer_step: bool = False,
               stats_every: int = 0) -> AsyncPipelineEngine:
    """Build the engine for ``model`` from a DeepSpeed config dict (without its ``ds_async`` section).

    ``schedule`` (a name or :class:`~ds_async.pipe.version_rule.VersionRule`) and ``correction`` are the
    ``ds_async`` section's keys of the same names,
    ``fused_optimizer_step`` its ``performance`` key, ``stats_every`` its ``logging.optimizer_every`` (measure the
    weights' staleness at every this many steps; 0: never). ds_async's optimizers (``Muon``, ``Lion``, or any type
    with a correction) are built here from the JSON block and handed to DeepSpeed as client optimizers, under
    bf16 with fp32 master weights of their own (:mod:`ds_async.optim.client`); combinations they cannot honour
    are refused.
    """
    if not isinstance(model, PipelineModule):
        raise TypeError(f"ds_async.initialize needs a deepspeed PipelineModule, got {type(model).__name__}")
    init_distributed()
    mpu = model.mpu()
    if optimizer is None:
        config, optimizer = client_optimizer(model, config, correction, mpu.get_data_parallel_group(),
                                             mpu.get_data_parallel_world_size(), fused=fused_optimizer_step,
                                             device=get_accelerator().current_device_name())
    config = without_throughput_sync(config)
    config_class = DeepSpeedConfig(config, mpu)
    deepspeed.set_optimizer_flags(config_class, model)
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    return AsyncPipelineEngine(schedule=schedule, fused_optimizer_step=fused_optimizer_step, stats_every=stats_every,
                               args=None,
                               model=model, optimizer=optimizer, model_parameters=model_parameters,
                               lr_scheduler=lr_scheduler, mpu=mpu, config=config, config_class=config_class)
