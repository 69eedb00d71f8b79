#!/usr/bin/env bash
# Issue 7's levers, one at a time, on one GPU host: each line of the matrix is one bench_pipeline.py run.
# Usage: bash launch/bench/bench_levers.sh OUT.jsonl [MATRIX]
# MATRIX: headline | muon | muon4 | muon2x2 | muontargets | text | muon16 | muondp | big | levers | compiled | fused | scope | fusedstep | clip | scaling | optimizer |
# optimizer16;
# default levers; several: 'compiled scaling'.
# Every row records its flags ("performance", "adamw", ...) and the card; compare rows of one call only.
# REPEAT=n runs the whole list n times in order (1F1B and 2BW rows interleave): runs of the same code on one
# machine spread by up to 7% (measured on 4x H200), as much as some targets' margins.
set -uo pipefail
out=${1:?output JSON-lines file}
matrices=${2:-levers}
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
export OMP_NUM_THREADS=4
part=${PARTITION:-0,5,9,13,17}  # compute-balanced 4 stages of the 15-layer 0.9B LLaMA
# The rows issue 20's targets read, each pair for one call: m = 4 (one replica) and 2 x 2 at m = 8. Muon + EF rows
# take ~200 s each to report (compiling the stage and the fused step's passes), so one pair (~5 min) fits a
# 10-minute call with room to spare and both pairs (~10 min, muontargets) do not.
muon4=("--schedule 2bw --micro-batches 4 --compile --compile-scope stage --optimizer muon-ef --fused-step"
       "--schedule 2bw --micro-batches 4 --compile --compile-scope stage --adamw fused --fused-step")
muon2x2=("NPROC=4 --schedule 2bw --micro-batches 8 --stages 2 --compile --compile-scope stage --optimizer muon-ef --fused-step"
         "NPROC=4 --schedule 2bw --micro-batches 8 --stages 2 --compile --compile-scope stage --adamw fused")
runs=()
for matrix in $matrices; do
case $matrix in
  headline) runs+=(  # launch/bench/RESULTS.md's first table: stock 1F1B and 2BW, each with every lever it takes
    "--schedule 1f1b --micro-batches 4 --compile --compile-scope stage --adamw fused"
    "--schedule 2bw --micro-batches 4 --compile --compile-scope stage --adamw fused --fused-step"
    "--schedule 1f1b --micro-batches 8 --compile --compile-scope stage --adamw fused"
    "--schedule 2bw --micro-batches 8 --compile --compile-scope stage --adamw fused --fused-step") ;;
  muon) runs+=(  # the paper's recipe on the fast path: bf16 Muon + EF with the fused step, against the AdamW fast path
    "--schedule 2bw --micro-batches 8 --compile --compile-scope stage --optimizer muon-ef --fused-step"
    "--schedule 2bw --micro-batches 8 --compile --compile-scope stage --adamw fused --fused-step"
    "--schedule 2bw --micro-batches 4 --compile --compile-scope stage --optimizer muon-ef --fused-step"
    "--schedule 2bw --micro-batches 4 --compile --compile-scope stage --adamw fused --fused-step"
    "--schedule 2bw --micro-batches 8 --compile --compile-scope stage --optimizer muon-ef --precision autocast") ;;
  muon4) runs+=("${muon4[@]}") ;;
  muon2x2) runs+=("${muon2x2[@]}") ;;
  muontargets) runs+=("${muon4[@]}" "${muon2x2[@]}") ;;
  text) runs+=(  # the engine fed real text read on its main thread (as launch/train.py reads it) against host batches
    "--schedule 2bw --micro-batches 8 --compile --compile-scope stage --adamw fused --fused-step --host-batches"
    "--schedule 2bw --micro-batches 8 --compile --compile-scope stage --adamw fused --fused-step --text ../shared/corpus/enwiki-train-00000-of-00006.parquet") ;;
  muon16) runs+=(
    "--schedule 2bw --micro-batches 16 --compile --compile-scope stage --optimizer muon-ef --fused-step"
    "--schedule 2bw --micro-batches 16 --compile --compile-scope stage --adamw fused --fused-step") ;;
  muondp) runs+=(  # 2 stages x 2 replicas (Newton-Schulz split across the replicas) and 2 stages x 1 replica
    "NPROC=4 --schedule 2bw --micro-batches 8 --stages 2 --compile --compile-scope stage --optimizer muon-ef --fused-step"
    "NPROC=4 --schedule 2bw --micro-batches 8 --stages 2 --compile --compile-scope stage --adamw fused"
    "NPROC=2 --schedule 2bw --micro-batches 8 --stages 2 --compile --compile-scope stage --optimizer muon-ef --fused-step") ;;
  big) runs+=(  # issue 24: the shipped 8B and Mixtral configs (their own levers, partition and recompute), 1F1B
    # against 2BW; ~110-260 s a row on 4 GPUs
    "--config ds_configs/llama3_8b_4gpu_2bw_adamw.json --schedule 2bw --micro-batches 8"
    "--config ds_configs/llama3_8b_4gpu_2bw_adamw.json --schedule 1f1b --micro-batches 8"
    "--config ds_configs/llama3_8b_4gpu_2bw_muon_ef.json --schedule 2bw --micro-batches 8"
    "--config ds_configs/mixtral_8x1b_4gpu_2bw_muon_ef.json --schedule 2bw --micro-batches 8"
    "--config ds_configs/mixtral_8x1b_4gpu_2bw_muon_ef.json --schedule 1f1b --micro-batches 8"
    "--config ds_configs/llama3_8b_4gpu_2bw_adamw.json --schedule 2bw --micro-batches 16"
    "--config ds_configs/llama3_8b_4gpu_2bw_adamw.json --schedule 1f1b --micro-batches 16") ;;
  levers) runs+=(
    "--schedule 1f1b --micro-batches 4"
    "--schedule 2bw --micro-batches 4"
    "--schedule 2bw --micro-batches 4 --loss-chunk 4096"
    "--schedule 2bw --micro-batches 4 --compile"
    "--schedule 2bw --micro-batches 4 --activation-checkpoint-interval 1"
    "--schedule 2bw --micro-batches 4 --compile --loss-chunk 4096"
    "--schedule 1f1b --micro-batches 4 --compile --loss-chunk 4096"
    "--schedule 2bw --micro-batches 8 --compile --loss-chunk 4096"
    "--schedule 1f1b --micro-batches 8 --compile --loss-chunk 4096") ;;
  compiled) runs+=(  # the compile lever (decoder layers, head, loss) on both schedules
    "--schedule 1f1b --micro-batches 4 --compile"
    "--schedule 2bw --micro-batches 4 --compile"
    "--schedule 1f1b --micro-batches 8 --compile"
    "--schedule 2bw --micro-batches 8 --compile") ;;
  fused) runs+=(  # compile + torch's fused AdamW kernel (the step that 2BW overlaps with the next batch)
    "--schedule 1f1b --micro-batches 4 --compile --adamw fused"
    "--schedule 2bw --micro-batches 4 --compile --adamw fused"
    "--schedule 1f1b --micro-batches 8 --compile --adamw fused"
    "--schedule 2bw --micro-batches 8 --compile --adamw fused") ;;
  scope) runs+=(  # the fused rows with one compiled region per stage (performance.compile_scope "stage")
    "--schedule 1f1b --micro-batches 4 --compile --compile-scope stage --adamw fused"
    "--schedule 2bw --micro-batches 4 --compile --compile-scope stage --adamw fused"
    "--schedule 1f1b --micro-batches 8 --compile --compile-scope stage --adamw fused"
    "--schedule 2bw --micro-batches 8 --compile --compile-scope stage --adamw fused") ;;
  fusedstep) runs+=(  # the scope rows' 2BW with the bf16 AdamW step in one pass (performance.fused_optimizer_step)
    "--schedule 2bw --micro-batches 4 --compile --compile-scope stage --adamw fused --fused-step"
    "--schedule 2bw --micro-batches 8 --compile --compile-scope stage --adamw fused --fused-step") ;;
  clip) runs+=(  # without clipping (no global-norm all-reduce); the clip 1.0 rows are the fused matrix's
    "--schedule 2bw --micro-batches 4 --compile --adamw fused --clip 0"
    "--schedule 1f1b --micro-batches 4 --compile --adamw fused --clip 0") ;;
  scaling) runs+=(  # 2 stages x 1 replica on GPUs 0-1, then 2 stages x 2 replicas on 4 GPUs
    "NPROC=2 --schedule 2bw --micro-batches 8 --stages 2 --compile"
    "NPROC=4 --schedule 2bw --micro-batches 8 --stages 2 --compile") ;;
  optimizer) runs+=(
    "--schedule 2bw --micro-batches 8 --precision autocast --optimizer adamw"
    "--schedule 2bw --micro-batches 8 --precision autocast --optimizer muon-ef"
    "--schedule 2bw --micro-batches 16 --precision autocast --optimizer muon-ef") ;;
  optimizer16) runs+=("--schedule 2bw --micro-batches 16 --precision autocast --optimizer adamw") ;;
  *) echo "unknown matrix $matrix" >&2; exit 2 ;;
esac
done
all=()
for _ in $(seq "${REPEAT:-1}"); do all+=("${runs[@]}"); done
row=
trap '[ -n "$row" ] && kill -TERM -- -$row 2>/dev/null; exit 143' TERM INT  # the running row's process group
for r in "${all[@]}"; do
  n=$ngpu; [[ $r == NPROC=* ]] && { n=${r%% *}; n=${n#NPROC=}; r=${r#* }; }
  flags=$r; [[ $r == *--stages* || $r == *--config* ]] || flags="$r --partition $part"
  t0=$(date +%s)
  # In the background, so that a TERM to this script (an outer timeout) stops the row too: timeout leads a process
  # group of its own, which an outer kill does not reach, and a row left running skews the next one's timings.
  timeout ${RUN_TIMEOUT:-300} torchrun --nproc_per_node "$n" launch/bench/bench_pipeline.py $flags --out "$out" \
    --warmup ${WARMUP:-3} --steps ${STEPS:-8} > /tmp/bench_run.log 2>&1 &
  row=$!
  wait $row
  rc=$?
  echo "[$(( $(date +%s) - t0 ))s rc=$rc] n=$n $flags"
  grep -h "^BENCH" /tmp/bench_run.log | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line[6:])
    print('   step', r['step_time_s'], 'mfu', r['mfu'], 'idle', list(r['measured_idle_by_stage'].values()),
          'mem', list(r['peak_mem_GiB_by_stage'].values()), 'opt_ms', list(r['optimizer_step_ms_by_stage'].values()),
          'host_ms', [round(sum(h.values()), 1) for h in r.get('host_ms_per_step_by_stage', {}).values()])"
  grep -h -m2 -E "Error|error:" /tmp/bench_run.log
  [ $rc -eq 0 ] || { cp /tmp/bench_run.log "${FAILED_LOGS:-/tmp}/failed_$(date +%s).log" 2>/dev/null; tail -4 /tmp/bench_run.log; }
done
