"""Point-to-point transfer time of one activation between neighbouring pipeline stages (NCCL send/recv).

    torchrun --nproc_per_node 2 launch/bench/bench_p2p.py --out rows.jsonl

With m = p micro-batches a flush-free 1F1B pipeline has no slack: each stage's cycle waits for the round trip of
a micro-batch through the later stages, so every transfer's latency adds to the step (stage 0: 2(p-1) transfers
per p micro-batches). This times what the pipeline sends: a ``micro_batch_size x seq_len x hidden`` bf16 tensor,
rank 2k to rank 2k+1, with ``dist.send``/``dist.recv`` as DeepSpeed's pipeline does. Reports the receiving GPU's
time per transfer (CUDA events around ``--iters`` back-to-back receives, median of ``--repeats``) and the implied
bandwidth; NCCL settings come from the environment and are recorded in the row.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from ds_async.metrics import code_version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    x = torch.randn(a.micro_batch_size, a.seq_len, a.hidden, device="cuda").to(torch.bfloat16)
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    times = []
    for r in range(a.repeats + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.iters):
            if rank % 2 == 0:
                dist.send(x, peer)
            else:
                dist.recv(x, peer)
        end.record()
        torch.cuda.synchronize()
        if r:  # the first repeat sets up the communicator
            times.append(start.elapsed_time(end) / a.iters)
    ms = statistics.median(times)
    row = {"bench": "p2p", "bytes": x.numel() * x.element_size(), "ms_per_transfer": round(ms, 4),
           "GB_per_s": round(x.numel() * x.element_size() / ms / 1e6, 1), "pair": [peer, rank],
           "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "card": torch.cuda.get_device_name(),
           "code": code_version()}
    if rank % 2 == 1:
        print("P2P " + json.dumps(row), flush=True)
        if a.out and rank == 1:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
