"""Train from a DeepSpeed JSON config with a ``"ds_async"`` section.

    deepspeed --num_gpus 2 launch/train.py --config ds_configs/demo_cpu.json
    deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/demo_cpu.json   # DeepSpeed's flag name
    torchrun --nproc_per_node 2 launch/train.py --config ds_configs/demo_cpu.json
    torchrun --nproc_per_node 2 launch/train.py --config ... --run-name NAME --resume   # after a crash

Bad input (config, data, tokenizer, checkpoint folder) is found at start, before training, and a NaN/inf loss or
weights end the job at that step; either way with one line "ds_async: error: ..." on stderr and exit status 1.
"""
import argparse
import sys

import torch

from ds_async.checkpoint import CheckpointError
from ds_async.config import ConfigError
from ds_async.data import DataError
from ds_async.nonfinite import NonFiniteLoss
from ds_async.optim.client import OptimizerSetupError
from ds_async.trainer import train

EXPECTED = (ConfigError, DataError, CheckpointError, NonFiniteLoss, OptimizerSetupError, FileNotFoundError)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", "--deepspeed_config", "--deepspeed-config", dest="config", required=True,
                        help="DeepSpeed JSON with a \"ds_async\" section (DeepSpeed's own flag name works too)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    parser.add_argument("--run-name", default=None, help="override ds_async.logging.run_name")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                        help="continue from the newest complete checkpoint in the run's checkpoint folder (starting "
                             "afresh if there is none), or from PATH: a checkpoint folder, a folder of them, or a run "
                             "folder (its checkpoints/), which must hold one")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by the deepspeed launcher; the rank is read from the environment")
    args = parser.parse_args()
    try:
        if args.max_steps is not None and args.max_steps < 1:
            raise ConfigError(f"--max-steps: must be >= 1, got {args.max_steps}")
        train(args.config, max_steps=args.max_steps, run_name=args.run_name, resume=args.resume)
    except EXPECTED as e:
        print(f"ds_async: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
