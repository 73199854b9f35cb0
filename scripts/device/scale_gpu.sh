#!/usr/bin/env bash
# Issue 37 on a lent two-GPU machine (nvidia-h100-x2 / nvidia-h200-x2), by phase; results under $OUT. Repo root:
#   bash scripts/device/scale_gpu.sh PHASE [PHASE ...]
# Phases:
#   setup                  Ray & co from the carried .whl into /tmp/site (carry .whl), their bytecode and this
#                          checkout's (session.sh precompile); GPUs and versions
#   bench:TAG:SHAPE:CFGS   scripts/bench_async.py on every GPU, native engine, the forced long tail (mean 512, cap 2048):
#                          SHAPE = 0.5b | 1.5b | 3b | 7b (random weights of the Qwen2.5 shape), CFGS = configs joined
#                          by '+' (sync | sS_pP[_tT] split | cS_pP[_tT] colocated async, e.g. sync+s0.5_p1_t1+s2_p1_t1);
#                          BENCH_ARGS adds arguments (e.g. --steps 12), EXTRA_TAG (TAG upper-cased) adds
#                          key=value overrides (space-separated) to every run of that phase, ARGS_TAG more arguments.
#                          -> $STORE/bench_TAG.json, bench_TAG.log, bench_TAG-runs.tar.gz (timelines, tensorboard)
#                          The colocated configs (sync, cS_pP) sync with sync_transport=auto: cuda_ipc from each trainer
#                          rank to the native replica on its GPU (ARGS_TAG="--colocated-transport object_store": the
#                          object store, as before issue 37's colocated cuda_ipc), e.g. bench:i:3b:sync+c1_p1_t2
#   ipctest                tests/test_sync_ipc_gpu.py: cuda_ipc bit-exact on one GPU and 2 ranks -> 2 replicas on two
#                          GPUs, each timed against the object store (-> $STORE/ipc_test.log)
#   queue:P1,P2,...        the phases one after another in the background (scripts/device/queue.sh)
#   wait:SECONDS           wait for the queue, then copy what finished to $OUT (and a snapshot of runs still going)
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/device/session.sh
source scripts/device/session.sh && device_session scale
NGPU=$(visible_gpus)  # CUDA_VISIBLE_DEVICES honoured (session.sh)
status=0

bench() {  # bench TAG SHAPE CFGS
  local tag=$1 shape=$2 cfgs=${3//+/,} extra_var t0=$SECONDS extra=()
  extra_var="EXTRA_$(echo "$tag" | tr '[:lower:].-' '[:upper:]__')"
  for kv in ${!extra_var:-}; do extra+=(--extra "$kv"); done
  local args_var="ARGS_${extra_var#EXTRA_}"  # ARGS_TAG: more bench_async arguments for this phase alone
  local dir
  dir=$(run_dir "bench_$tag")
  echo "=== bench $tag: shape $shape, configs $cfgs, ${#extra[@]} extra args (limit ${BENCH_LIMIT:-1500}s)"
  # shellcheck disable=SC2086
  timeout --kill-after=15 "${BENCH_LIMIT:-1500}" python3 scripts/bench_async.py --device cuda --gpus "$NGPU" \
    --engine native --shape "$shape" --configs "$cfgs" --work-dir "$dir" --out "$STORE/bench_$tag.json" \
    ${BENCH_ARGS:-} ${!args_var:-} "${extra[@]}" > "$STORE/bench_$tag.log" 2>&1
  local rc=$?
  echo "=== bench $tag: rc=$rc in $((SECONDS - t0))s"
  grep -E "^\|" "$STORE/bench_$tag.log" | tail -n 12
  grep -aE "Error|error:" "$STORE/bench_$tag.log" | tail -n 5 | cut -c1-300
  (cd "$dir" && tar czf "$STORE/bench_$tag-runs.tar.gz" --ignore-failed-read */timeline.jsonl */timeline.html \
      */tensorboard */config.yaml 2>/dev/null)
  [ $rc -eq 0 ] || status=1
}

for phase in "$@"; do
  case "$phase" in
    setup)
      bash scripts/device/install_on_device.sh base >/dev/null || status=1
      precompile
      nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
      python3 -c "import torch, transformers, ray; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__, 'ray', ray.__version__)" ;;
    bench:*)
      IFS=: read -r _ tag shape cfgs <<< "$phase"
      bench "$tag" "$shape" "$cfgs" ;;
    ipctest)  # colocated CUDA-IPC weight sync: 1 GPU and 2 ranks + 2 replicas, bit-exact, timed against the object store
      timeout 500 python3 -m pytest -q -s -p no:cacheprovider tests/test_sync_ipc_gpu.py > "$STORE/ipc_test.log" 2>&1 \
        || status=1
      tail -n 25 "$STORE/ipc_test.log"
      cp "$STORE/ipc_test.log" "$OUT/" 2>/dev/null ;;
    queue:*) queue_start scripts/device/scale_gpu.sh "${phase#queue:}" ;;
    wait:*)
      queue_wait "${phase#wait:}" 30
      send_finished "$STORE"/bench_*.json "$STORE"/bench_*.log "$STORE"/bench_*-runs.tar.gz
      ls "$OUT" ;;
    *) echo "unknown phase $phase" >&2; status=2 ;;
  esac
done
exit $status
