# Sourced by the study scripts. wait_jobs waits for the background jobs in the caller's arrays pids (process ids),
# what (a label each) and logs (a log file each); prints each job's [matrix] lines under its label; returns 1 if any
# job failed (all are waited for first).
wait_jobs() {
  local status=0 j
  for j in "${!pids[@]}"; do
    wait "${pids[$j]}" || { status=1; echo "${what[$j]}: failed, see ${logs[$j]}" >&2; }
    grep -h "^\[matrix\]" "${logs[$j]}" | sed "s/^/${what[$j]}: /" || true
  done
  return $status
}
