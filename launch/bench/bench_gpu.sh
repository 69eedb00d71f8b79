#!/usr/bin/env bash
# The 1F1B-vs-2BW matrix on one GPU host: ~0.9B LLaMA, seq 2048, mbs 2, bf16, p = number of GPUs.
# Usage: [MICRO_BATCHES='4 8'] [SCHEDULES='1f1b 2bw'] bash launch/bench/bench_gpu.sh OUT.jsonl [bench_pipeline flags]
set -uo pipefail
out=${1:?output JSON-lines file}; shift
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
export OMP_NUM_THREADS=4
for m in ${MICRO_BATCHES:-4 8}; do
  for sched in ${SCHEDULES:-1f1b 2bw}; do
    torchrun --nproc_per_node "$ngpu" launch/bench/bench_pipeline.py --schedule $sched --micro-batches $m \
      --out "$out" "$@" 2>&1 | grep -E "^BENCH|Error|error:" | tail -3
  done
done
