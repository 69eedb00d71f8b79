#!/usr/bin/env bash
# The loss-curve study's engine comparison (issue 6): points of the main configuration trained through the real
# PipeDream-2BW engine on 2 GPUs and, with the same spec, through the single-process emulation, so that the
# notebook can set the engine's curve against the emulation's and the seed noise of the main matrix.
#
#   bash launch/study_engine.sh [OUT] [NUM_GPUS] [MATRIX]
#
# OUT       where the run folders go (default launch/results/study, next to the main matrix whose seed spread is
#           the noise the comparison is judged against): OUT/engine/<opt>-<variant>-s<seed>-{deepspeed,emulation}/;
#           logs in OUT/logs/engine*.log and OUT/logs/emulation*.log.
# NUM_GPUS  default: all visible. Engine runs are one pipeline of 2 stages each: NUM_GPUS/2 torchrun groups on
#           disjoint GPU pairs (CUDA_VISIBLE_DEVICES, distinct --master_port), each taking a share of the engine
#           runs one after the other; at the same time one emulation process per GPU takes a share of the
#           emulation runs (the 20M model leaves the GPUs mostly idle, so they share them).
# MATRIX    default engine (Muon 2bw+ef, AdamW 2bw, AdamW sync x seeds 0-2: 9 pairs); engine-tiny is the CPU set.
#
# Needs no corpus when .data/study_tokens holds the token cache (python launch/study.py --matrix engine
# --prepare-data fills it where the corpus is). Where the checkout has no .git (a copied tree), set
# DS_ASYNC_COMMIT so the manifests record the commit. Finished runs (summary.json present) are skipped, so
# re-running resumes. At the end the table is printed and notebooks/loss_curves.ipynb is executed in place on OUT
# (NOTEBOOK= to skip). TORCHRUN overrides the launcher command (default: torchrun, else python -m
# torch.distributed.run); MASTER_PORT_BASE the first rendezvous port (default 29610).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ -z "${TORCHRUN:-}" ]]; then
  if command -v torchrun >/dev/null; then TORCHRUN=torchrun; else TORCHRUN="$PYTHON -m torch.distributed.run"; fi
fi
out=${1:-launch/results/study}
ngpu=${2:-$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")}
matrix=${3:-engine}
stages=${STAGES:-2}  # pipeline depth of the matrix's engine runs (8 for engine-depth8*)
port=${MASTER_PORT_BASE:-29610}
notebook=${NOTEBOOK-notebooks/loss_curves.ipynb}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
if ((ngpu < stages)); then
  echo "the engine runs need $stages GPUs per pipeline; $ngpu visible" >&2
  exit 1
fi
groups=$((ngpu / stages))
source launch/study_common.sh
prepare_study "$matrix" "$out"

pids=() what=() logs=()
for ((k = 0; k < groups; k++)); do
  gpus=$(seq -s, $((k * stages)) $((k * stages + stages - 1)))
  CUDA_VISIBLE_DEVICES=$gpus $TORCHRUN --nproc_per_node "$stages" --master_port $((port + k)) \
    launch/study.py --matrix "$matrix" --engine deepspeed --gpu-index "$k" --of "$groups" --out "$out" --quiet \
    >"$out/logs/engine$k.log" 2>&1 &
  pids+=($!) what+=("engine runs on GPUs $gpus") logs+=("$out/logs/engine$k.log")
done
for ((i = 0; i < ngpu; i++)); do
  "$PYTHON" launch/study.py --matrix "$matrix" --engine emulation --gpu-index "$i" --of "$ngpu" --out "$out" --quiet \
    >"$out/logs/emulation$i.log" 2>&1 &
  pids+=($!) what+=("emulation runs on GPU $i") logs+=("$out/logs/emulation$i.log")
done
status=0
wait_jobs || status=1

# The table (pandas, tensorboard) and the notebook (nbclient, a python3 kernel) may be missing on a bare GPU host:
# the runs are done either way, and `python -m ds_async.study OUT --notebook ...` can run wherever they are.
"$PYTHON" -m ds_async.study "$out" ${notebook:+--notebook "$notebook"} ||
  echo "the table/notebook step failed (see above); the run folders in $out are complete" >&2
exit $status
