#!/usr/bin/env bash
# Issue 44's one-GPU rows in one command (launch/bench/RESULTS.md, "The command line's host path"): the 31M model
# through the command line against its emulation (long.json, p = 1, Muon's fused step; the CLI with CUDA graphs),
# then the 0.9B config at p = 1 under compile_scope layer: one start with an empty compile cache, then WARM starts
# with it filled, then RESUMED starts from the checkpoint a run of 8 steps saves at step 4, then SAVES pairs of
# 72-step runs saving at steps 36 and 72 in the foreground and with checkpoint.async_save. PAIR=0 and COLD=0 leave
# out the 31M pair and the cold start (to split the blocks across device calls on one warm machine). Every row is
# appended to OUT and summarised on one line.
# Usage: [CORPUS=../shared/corpus] [PAIR=1] [COLD=1] [WARM=4] [RESUMED=2] [SAVES=0]
#        bash launch/bench/bench_start.sh OUT.jsonl [LABEL]
set -uo pipefail
out=${1:?output JSON-lines file}; label=${2:-}
corpus=${CORPUS:-../shared/corpus}
muon='optimizer={"type":"Muon","params":{"lr":0.02,"momentum":0.95,"nesterov":true,"weight_decay":0.0,"adam_lr":0.003,"adam_betas":[0.9,0.95],"adam_weight_decay":0.1}}'
small=(--config launch/study/long.json --set ds_async.pipeline_stages=1 --set "$muon"
       --set ds_async.performance.fused_optimizer_step=true --set ds_async.train.steps=200
       --set scheduler.params.total_num_steps=200 --set scheduler.params.warmup_num_steps=30 --set ds_async.eval.every=0
       --set ds_async.performance.compile_scope=stage
       --set "ds_async.tokenizer=$corpus/tokenizers/bpe8192.json" --set "ds_async.data.train=$corpus/enwiki-train-*.parquet"
       --set "ds_async.data.validation=$corpus/enwiki-validation.parquet")
big=(--config ds_configs/llama_0.9b_4gpu_2bw_muon_ef.json --set ds_async.pipeline_stages=1
     --set 'ds_async.partition={"method":"uniform"}' --set "ds_async.tokenizer=$corpus/tokenizers/bpe32768.json"
     --set "ds_async.data.train=$corpus/enwiki-train-*.parquet"
     --set "ds_async.data.validation=$corpus/enwiki-validation.parquet" --set ds_async.train.steps=24
     --set scheduler.params.total_num_steps=24 --set scheduler.params.warmup_num_steps=2
     --set 'ds_async.checkpoint={"every":0,"final":false}' --set ds_async.performance.compile_scope=layer
     --cache-dir "${TMPDIR:-/tmp}/ds_async_bench_start_cache")
saved="${TMPDIR:-/tmp}/ds_async_bench_start_checkpoints"
summary='import json, sys
for line in sys.stdin:
    if line.startswith("{"):
        r = json.loads(line)
        print(r["runner"], r["cache"], r["commit"], "tok/s %.0f" % (r["tokens_per_s"] or 0), "idle", r["idle_fraction"],
              "first step", r["time_to_first_step_s"], r["start_s"], "eval", r["final_eval_s"], "exit",
              r["exit_after_summary_s"], "rc", r["rc"], flush=True)'
run() { python3 launch/bench/bench_run.py "$@" --out "$out" 2>&1 | python3 -c "$summary"; }
if [ "${PAIR:-1}" -gt 0 ]; then
  run --runner cli "${small[@]}" --set ds_async.performance.cuda_graphs=true --label "31m-p1-muon-fused-graphs $label"
  run --runner emulation "${small[@]}" --label "31m-p1-muon-fused $label"
fi
if [ "${COLD:-1}" -gt 0 ]; then
  run --runner cli "${big[@]}" --cache cold --label "0.9b-p1 layer $label"
fi
for _ in $(seq "${WARM:-4}"); do
  run --runner cli "${big[@]}" --cache warm --label "0.9b-p1 layer $label"
done
if [ "${RESUMED:-2}" -gt 0 ]; then  # 8 steps saved at step 4 (and 8); each resumed start runs steps 5-8 again
  eight=(--set ds_async.train.steps=8 --set scheduler.params.total_num_steps=8)
  rm -rf "$saved"
  run --runner cli "${big[@]}" "${eight[@]}" \
      --set "ds_async.checkpoint={\"every\":4,\"final\":false,\"dir\":\"$saved\"}" \
      --label "0.9b-p1 layer, saves at steps 4 and 8 $label"
  for _ in $(seq "${RESUMED:-2}"); do
    run --runner cli "${big[@]}" "${eight[@]}" --resume "$saved/step_00000004" \
        --label "0.9b-p1 layer, resumed at step 4 $label"
  done
  rm -rf "$saved"
fi
if [ "${SAVES:-0}" -gt 0 ]; then  # 72 steps saving at 36 and 72 (keep 1), foreground then background, SAVES times
  long=(--set ds_async.train.steps=72 --set scheduler.params.total_num_steps=72)
  for _ in $(seq "${SAVES}"); do
    for background in false true; do
      rm -rf "$saved"
      run --runner cli "${big[@]}" "${long[@]}" \
          --set "ds_async.checkpoint={\"every\":36,\"final\":false,\"keep\":1,\"dir\":\"$saved\",\"async_save\":$background}" \
          --label "0.9b-p1 layer, 72 steps saving at 36 and 72, async_save $background $label"
    done
  done
  rm -rf "$saved"
fi
