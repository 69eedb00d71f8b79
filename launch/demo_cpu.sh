#!/usr/bin/env bash
# The embedded default: a small LLaMA trained over 2 pipeline stages on this machine's CPU, on the Lee news
# corpus that ships inside gensim's wheel (no hub access needed). Extra arguments go to launch/train.py,
# e.g. --max-steps 3. Logs land in runs/<run name>/ (tensorboard events, loss.png, manifest.json).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import ds_async, gensim" 2>/dev/null; then
  # Install a CPU build of torch first if you have no GPU (TORCH_SPEC, e.g. torch==2.13.0+cpu): an unpinned
  # torch from PyPI is the multi-GB CUDA build.
  "$PYTHON" -c "import torch" 2>/dev/null || "$PYTHON" -m pip install "${TORCH_SPEC:-torch>=2.11}"
  "$PYTHON" -m pip install -e ".[demo]"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec deepspeed --num_gpus 2 launch/train.py --config ds_configs/demo_cpu.json "$@"
