# Sourced by the study scripts (launch/study.sh, launch/study_engine.sh); both set PYTHON first.

# prepare_study MATRIX OUT: the log folder, the token streams (tokenized once) and a line saying how many runs.
prepare_study() {
  mkdir -p "$2/logs"
  "$PYTHON" launch/study.py --matrix "$1" --prepare-data
  "$PYTHON" launch/study.py --matrix "$1" --list | tail -1
}

# wait_jobs: wait for the background jobs in the caller's arrays pids (process ids), what (a label each) and logs (a
# log file each); print each job's [matrix] lines under its label; return 1 if any job failed (all are waited for).
wait_jobs() {
  local status=0 j
  for j in "${!pids[@]}"; do
    wait "${pids[$j]}" || { status=1; echo "${what[$j]}: failed, see ${logs[$j]}" >&2; }
    grep -h "^\[matrix\]" "${logs[$j]}" | sed "s/^/${what[$j]}: /" || true
  done
  return $status
}
