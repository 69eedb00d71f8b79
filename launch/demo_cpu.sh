#!/usr/bin/env bash
# The demo: one small LLaMA (2 pipeline stages on this machine's CPU) trained twice on the same data and tokens,
# once under synchronous 1F1B with Muon and once under PipeDream-2BW with Muon + error feedback (the paper's recipe),
# then a side-by-side summary (final losses, tokens/s, the pipeline bubble each schedule leaves) and one plot.
# The text is Python's own documentation (the embedded corpus "python:docs": nothing to download).
# Usage: bash launch/demo_cpu.sh [--max-steps N] [--run-name NAME]   (runs land in runs/NAME-1f1b, runs/NAME-2bw)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Installed, not merely importable: from the repository root "import ds_async" finds the source folder anyway.
if ! "$PYTHON" -c "import importlib.metadata as m; m.version('ds_async')" 2>/dev/null; then
  if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    # Without a GPU take PyTorch's CPU build: the default wheel from PyPI is the multi-GB CUDA build.
    if command -v nvidia-smi >/dev/null 2>&1; then
      "$PYTHON" -m pip install "torch>=2.11,<2.14"
    else
      "$PYTHON" -m pip install "torch>=2.11,<2.14" --index-url https://download.pytorch.org/whl/cpu
    fi
  fi
  "$PYTHON" -m pip install -e .
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# DeepSpeed's accelerator named up front: a CPU run is what this demo is, not a fallback to warn about.
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
name=demo
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --run-name) name=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
for schedule in 1f1b 2bw; do
  config=ds_configs/demo_cpu.json
  [ $schedule = 2bw ] && config=ds_configs/demo_cpu_2bw.json
  echo "== $schedule: $config"
  # DeepSpeed's `deepspeed` launcher, run by the Python it was installed into (a fresh console script may not be on
  # PATH yet, e.g. under pyenv until its shims are rehashed).
  "$PYTHON" -m deepspeed.launcher.runner --num_gpus 2 launch/train.py --config $config --run-name "$name-$schedule" \
    ${args[@]+"${args[@]}"}
done
"$PYTHON" launch/demo_compare.py "runs/$name-1f1b" "runs/$name-2bw" --out "runs/$name-compare.png"
