"""Train from a DeepSpeed JSON config with a ``"ds_async"`` section.

    deepspeed --num_gpus 2 launch/train.py --config ds_configs/demo_cpu.json
    deepspeed --num_gpus 2 launch/train.py --deepspeed --deepspeed_config ds_configs/demo_cpu.json  # DeepSpeed's flags
    torchrun --nproc_per_node 2 launch/train.py --config ds_configs/demo_cpu.json
    torchrun --nproc_per_node 2 launch/train.py --config ... --run-name NAME --resume   # after a crash

    python launch/train.py --config C.json      # no launcher: one process, for configs with pipeline_stages 1

Bad input (config, data, tokenizer, checkpoint folder) is found at start, before training, and a NaN/inf loss or
weights end the job at that step; either way with one line "ds_async: error: ..." on stderr (from the first rank:
every rank stops with the same error) and exit status 1. SIGTERM (preemption) ends the job after the step every
rank agrees on, with a checkpoint saved there, the line "ds_async: preempted at step N: saved FOLDER; resume with
--resume" and exit status 75 on every rank (``ds_async.checkpoint.preempt_grace_s``; the launcher reports its own
status).
"""
import argparse
import os
import shlex
import sys

import torch

from ds_async import console

console.quiet_imports()  # before DeepSpeed and transformers are imported, which the imports below do

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

from ds_async import config as cfgmod  # noqa: E402
from ds_async.builder import free_local_port, start_reader  # noqa: E402
from ds_async.checkpoint import CheckpointError  # noqa: E402
from ds_async.config import ConfigError  # noqa: E402
from ds_async.config_sections import DataError  # noqa: E402
from ds_async.nonfinite import NonFiniteLoss  # noqa: E402
from ds_async.optim.client import OptimizerSetupError  # noqa: E402
from ds_async.preempt import PREEMPTED_EXIT, Preempted  # noqa: E402
from ds_async.prefetch import ReaderProcess  # noqa: E402

EXPECTED = (ConfigError, DataError, CheckpointError, NonFiniteLoss, OptimizerSetupError, FileNotFoundError)
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def without_launcher(arguments: str, cfg: cfgmod.DsAsyncConfig) -> None:
    """Started as ``python launch/train.py ARGUMENTS`` (no deepspeed/torchrun/MPI environment; DeepSpeed would look
    for MPI and fail on a missing mpi4py): a config with one pipeline stage runs as a world of one process; any other
    is refused with the launcher line that runs it with the same arguments."""
    if any(k in os.environ for k in LAUNCHER_ENV):
        return
    p = cfg.pipeline_stages
    if p > 1:
        raise ConfigError(f"no launcher: ds_async.pipeline_stages is {p}, so the job needs {p} processes (or a "
                          f"multiple of {p}): deepspeed --num_gpus {p} launch/train.py {arguments} (or "
                          f"torchrun --nproc_per_node {p} launch/train.py {arguments})")
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_local_port())})


def early_reader(cfg: cfgmod.DsAsyncConfig) -> ReaderProcess | None:
    """This rank's reader process for the training stream, where it needs one (:func:`ds_async.builder.start_reader`),
    started before the trainer is imported: a spawned interpreter spends seconds importing torch, datasets and
    transformers, which then overlap this process's own imports rather than the first step's wait for data. None
    without the launcher's RANK and WORLD_SIZE (an MPI launch sets them later): the trainer starts it then."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return start_reader(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), get_accelerator().device_name())


def parse_args(argv=None) -> argparse.Namespace:
    """ds_async's flags and DeepSpeed's own (``deepspeed.add_config_arguments``: ``--deepspeed``,
    ``--deepspeed_config``), so the launch lines of DeepSpeed's examples work as they are."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--config", default=None,
                        help="DeepSpeed JSON with a \"ds_async\" section (or DeepSpeed's --deepspeed_config)")
    cfgmod.add_set_argument(parser)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    parser.add_argument("--run-name", default=None, help="override ds_async.logging.run_name")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                        help="continue from the newest complete checkpoint in the run's checkpoint folder (starting "
                             "afresh if there is none), or from PATH: a checkpoint folder, a folder of them, or a run "
                             "folder (its checkpoints/), which must hold one")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by the deepspeed launcher; the rank is read from the environment")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    named = {flag: value for flag, value in (("--config", args.config), ("--deepspeed_config", args.deepspeed_config),
                                             ("--deepscale_config", args.deepscale_config)) if value is not None}
    if not named:
        parser.error("the config is required: --config C.json (or DeepSpeed's --deepspeed_config C.json)")
    if len(set(named.values())) > 1:
        parser.error("two configs given: " + ", ".join(f"{k} {v}" for k, v in named.items()) + "; pass one")
    args.config = next(iter(named.values()))
    return args


def main() -> None:
    args = parse_args()
    try:
        if args.max_steps is not None and args.max_steps < 1:
            raise ConfigError(f"--max-steps: must be >= 1, got {args.max_steps}")
        overrides = dict(args.sets)
        _, cfg = cfgmod.load(args.config, overrides)  # checked here once; the trainer loads it itself
        without_launcher(shlex.join(sys.argv[1:]), cfg)
        reader = early_reader(cfg)
        # Imported once the reader process imports too: transformers and datasets, most of a start's imports.
        from ds_async.trainer import train

        train(args.config, max_steps=args.max_steps, run_name=args.run_name, resume=args.resume, reader=reader,
              overrides=overrides)
    except EXPECTED as e:
        line = console.error_line(e)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        sys.exit(1)
    except Preempted as e:
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"ds_async: {e}", file=sys.stderr, flush=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.exit(PREEMPTED_EXIT)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    console.exit_now()


if __name__ == "__main__":
    main()
