# shellcheck shell=bash
# The background queue of the device scripts (real_model_gpu.sh, verl_compare.sh), sourced by both.
# Why: one device call ends after 10 minutes, a run may take 25, and the machine goes back after 30 s idle.
# queue_start runs phases in a session of their own (they outlive the call while the machine is held); each
# wait: call then brings back what finished since the last one, and a snapshot of each run still going, so
# a machine taken back mid-run (device time spent) loses only what came after the last wait: call.
# The caller sets STORE (its finished archives, NAME.tar.gz), OUT (what comes back from the call) and RUNS
# (one folder per run, NAME/, holding a .run marker) before sourcing this file.

queue_start() {  # queue_start SCRIPT P1,P2,...: the phases one after another in the background; queues run side by side
  local n
  n=$(cat "$STORE"/queue.pids 2>/dev/null | wc -l)
  # shellcheck disable=SC2086
  setsid nohup bash "$1" ${2//,/ } > "$STORE/queue-$n.log" 2>&1 < /dev/null &
  echo $! >> "$STORE/queue.pids"
  echo "queued: $2 (pid $!, log queue-$n.log)"
}

queue_running() {  # true while a queued script is still going
  local pid
  for pid in $(cat "$STORE/queue.pids" 2>/dev/null); do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

queue_wait() {  # queue_wait SECONDS [LINES]: until every queue ended or SECONDS passed; then each queue log's last LINES
  local t0=$SECONDS
  while queue_running && [ $((SECONDS - t0)) -lt "$1" ]; do sleep "${QUEUE_POLL_S:-10}"; done
  tail -n "${2:-30}" "$STORE"/queue-*.log 2>/dev/null
}

run_dir() {  # run_dir NAME: a fresh folder for the run NAME under $RUNS, marked as this script's; prints its path
  local dir=$RUNS/$1
  rm -rf "$dir" && mkdir -p "$dir" && touch "$dir/.run"
  echo "$dir"
}

send_finished() {  # send_finished FILE...: copy each existing file to $OUT, each once over all wait: calls
  local f
  for f in "$@"; do
    [ -f "$f" ] && [ ! -f "$f.sent" ] && cp "$f" "$OUT/" && touch "$f.sent"
  done
  return 0
}

send_partial() {  # send_partial ITEM...: $OUT/NAME-partial.tar.gz (these items of it) of each run with no archive yet
  local dir name
  for dir in "$RUNS"/*/; do
    name=$(basename "$dir")
    [ -f "$dir/.run" ] && [ ! -f "$STORE/$name.tar.gz" ] || continue
    (cd "$dir" && tar czf "$OUT/$name-partial.tar.gz" --ignore-failed-read "$@" 2>/dev/null)
  done
  return 0
}
