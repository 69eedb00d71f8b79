#!/usr/bin/env bash
# The demo on GPUs: a 0.9B LLaMA over all of this host's GPUs (one pipeline stage each, 8 micro-batches a step),
# trained twice on the same data and tokens: synchronous 1F1B with Muon, then PipeDream-2BW with Muon + error
# feedback (ds_configs/demo_gpu.json with the schedule switched), then the side-by-side summary: how much faster
# 2BW's steps were, what the schedules' bubbles allow, and when each run reached the synchronous run's final loss.
# The text is Python's own documentation (python:docs, nothing to download): a speed demo, repeated over its data.
# Usage: bash launch/demo_gpu.sh [NUM_GPUS] [--max-steps N] [--run-name NAME] [--configs-only]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ngpu=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [[ ${1:-} =~ ^[0-9]+$ ]]; then ngpu=$1; shift; fi
name=demo-gpu
configs_only=0
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --run-name) name=$2; shift 2 ;;
    --configs-only) configs_only=1; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ "$configs_only" = 0 ] && [ "$ngpu" -lt 2 ]; then
  echo "demo_gpu: needs 2 or more GPUs (a pipeline stage each); this host has $ngpu. On CPU: bash launch/demo_cpu.sh" >&2
  exit 1
fi
mkdir -p "runs/$name-configs"
for schedule in 1f1b 2bw; do
  # One stage per GPU; 2BW adds error feedback, the paper's recipe. Everything else as in demo_gpu.json.
  "$PYTHON" - "$ngpu" "$schedule" "runs/$name-configs/$schedule.json" <<'PY'
import json, sys
gpus, schedule, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
config = json.load(open("ds_configs/demo_gpu.json"))
config["ds_async"].update(pipeline_stages=max(gpus, 1), schedule=schedule,
                          correction={"type": "ef", "lambda": 1.0} if schedule == "2bw" else {"type": "none"})
json.dump(config, open(out, "w"), indent=1)
PY
done
[ "$configs_only" = 1 ] && { echo "runs/$name-configs/1f1b.json runs/$name-configs/2bw.json"; exit 0; }
for schedule in 1f1b 2bw; do
  echo "== $schedule on $ngpu GPUs: runs/$name-configs/$schedule.json"
  "$PYTHON" -m deepspeed.launcher.runner --num_gpus "$ngpu" launch/train.py --config "runs/$name-configs/$schedule.json" \
    --run-name "$name-$schedule" ${args[@]+"${args[@]}"}
done
"$PYTHON" launch/demo_compare.py "runs/$name-1f1b" "runs/$name-2bw" --out "runs/$name-compare.png"
