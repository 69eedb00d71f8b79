#!/usr/bin/env bash
# The one script that re-runs the whole loss-curve study (issue 6): sync vs PipeDream-2BW vs 2BW + correction.
#
#   bash launch/study.sh [OUT] [NUM_GPUS] [MATRICES]
#
# OUT       where the run folders go (default launch/results/study): OUT/<group>/<run>/ with tensorboard events,
#           manifest.json (card, commit, resolved config, seed) and summary.json; logs in OUT/logs/.
# NUM_GPUS  one process per GPU, each running its share of the runs (default: all visible GPUs; 1 on CPU).
# MATRICES  comma-separated, default main,extras (tiny is the CPU/CI set); one list, split across the GPUs as a
#           whole, each GPU doing its main runs first.
#
# Runs already finished in OUT (summary.json present) are skipped, so an interrupted study resumes. The token
# streams are tokenized once beforehand (needs the corpus, ../shared/corpus or --data-dir, unless
# .data/study_tokens already holds them). At the end the table is printed and notebooks/loss_curves.ipynb is
# executed in place on OUT (set NOTEBOOK= to skip that). Where the checkout has no .git (a copied tree), set
# DS_ASYNC_COMMIT to the commit so the manifests record it.
#
# Every run here goes through the single-process emulation. The comparison with the real 2BW engine (the same
# specs through ds_async.initialize on 2 GPUs each, next to their emulation twins) is launch/study_engine.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
out=${1:-launch/results/study}
ngpu=${2:-$("$PYTHON" -c "import torch; print(max(1, torch.cuda.device_count()))")}
matrices=${3:-main,extras}
notebook=${NOTEBOOK-notebooks/loss_curves.ipynb}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
source launch/study_common.sh
prepare_study "$matrices" "$out"

pids=() what=() logs=()
for ((i = 0; i < ngpu; i++)); do
  "$PYTHON" launch/study.py --matrix "$matrices" --gpu-index "$i" --of "$ngpu" --out "$out" --quiet \
    >"$out/logs/gpu$i.log" 2>&1 &
  pids+=($!) what+=("GPU $i") logs+=("$out/logs/gpu$i.log")
done
status=0
wait_jobs || status=1

"$PYTHON" -m ds_async.study "$out" ${notebook:+--notebook "$notebook"}
exit $status
