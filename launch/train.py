"""Train from a DeepSpeed JSON config with a ``"ds_async"`` section.

    deepspeed --num_gpus 2 launch/train.py --config ds_configs/demo_cpu.json
    torchrun --nproc_per_node 2 launch/train.py --config ds_configs/demo_cpu.json
"""
import argparse

import torch

from ds_async.trainer import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="DeepSpeed JSON with a \"ds_async\" section")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    parser.add_argument("--run-name", default=None, help="override ds_async.logging.run_name")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by the deepspeed launcher; the rank is read from the environment")
    args = parser.parse_args()
    train(args.config, max_steps=args.max_steps, run_name=args.run_name)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
