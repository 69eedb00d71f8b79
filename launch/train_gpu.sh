#!/usr/bin/env bash
# Train on this host's GPUs: bash launch/train_gpu.sh CONFIG.json [NUM_GPUS] [train.py flags...]
# pipeline_stages in the config must divide NUM_GPUS; the remaining factor becomes data parallelism.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?DeepSpeed JSON config}; shift
# NUM_GPUS only where given: "train_gpu.sh C.json --set K=V" takes every GPU and passes the flags on.
if [[ ${1:-} =~ ^[0-9]+$ ]]; then
  ngpu=$1; shift
else
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
fi
exec deepspeed --num_gpus "$ngpu" launch/train.py --config "$config" "$@"
