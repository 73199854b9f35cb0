#!/usr/bin/env bash
# Issue 7 on the lent GPUs, by phase, everything written under $OUT. Run from the repo root:
#   bash scripts/device/run_all_gpu.sh PHASE [PHASE ...]
# Phases (see bench/RESULTS.md "GPU runs (issue 7)" for the call plan and the expected output):
#   stash      keep the carried vLLM part(s) in /root/.carry (call 1 carries .carry/p1 only)
#   setup      stash + install Ray & co (.whl) and vLLM (.carry parts) into /tmp/site; print versions
#   setup-base install Ray & co only (runs without vLLM: native engine)
#   check      weight-sync check (bit-exact + speed, scripts/check_sync_gpu.py) and the GPU tests
#              (tests/test_sync_collective.py, tests/test_vllm_engine.py, tests/trainer/test_trainer_gpu.py)
#   bench      scripts/bench_async.py on all GPUs (CONFIGS=..., ENGINE=vllm|native, BENCH_ARGS=...)
#   pipeline   one fully async run with the native engine on 2 GPUs (1 rollout + 1 train), s0.5_p1
#   others     the engine and trainer benchmarks of issues 4/5 (bench_engine.py, bench_train.py)
# Each phase's log is $OUT/<phase>.log; JSON next to it. At most 8 files come back per call.
# Time limits (per step, summed per phase) keep one call inside 600 s: setup+check ~ 9 min at most.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/verl_async_out}
mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RAY_DEDUP_LOGS=1
export VERL_ASYNC_CACHE=${VERL_ASYNC_CACHE:-/root/.cache/verl_async}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # keep multicast off (KINDS.md)
export VLLM_WORKER_MULTIPROC_METHOD=spawn
export VLLM_USE_FLASHINFER_SAMPLER=0   # the carried vLLM has no flashinfer (stripped); its sampler import would fail
ENGINE=${ENGINE:-vllm}
# shellcheck source=scripts/device/session.sh
source scripts/device/session.sh  # visible_gpus: CUDA_VISIBLE_DEVICES honoured
NGPU=$(visible_gpus)
PY=python3
status=0

has_vllm() { [ -f /tmp/site/VERL_ASYNC_CARRY_MANIFEST ]; }
engine() { if [ "$ENGINE" = vllm ] && ! has_vllm; then echo native; else echo "$ENGINE"; fi; }
run() {  # run NAME TIMEOUT_S CMD...: log to $OUT/NAME.log, remember failures, never stop the other steps
  local name=$1 limit=$2; shift 2
  echo "=== $name: $* (limit ${limit}s)" | tee -a "$OUT/$name.log"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/$name.log"
  tail -n 25 "$OUT/$name.log" | grep -E "^\||bit-exact|passed|failed|error|Error|GB/s|best|rc=" | tail -n 20
  [ $rc -eq 0 ] || status=1
}

for phase in "$@"; do
  case "$phase" in
    stash)
      bash scripts/device/install_on_device.sh stash .carry/p1 .carry/p2 ;;
    setup|setup-base)
      bash scripts/device/install_on_device.sh stash .carry/p1 .carry/p2
      bash scripts/device/install_on_device.sh base || status=1
      if [ "$phase" = setup ]; then bash scripts/device/install_on_device.sh vllm || status=1; fi
      nvidia-smi -L
      $PY - <<'PY' 2>&1 | tail -n 4 | tee "$OUT/setup.log"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for name in ("ray", "hydra", "tensordict", "vllm"):
    try:
        mod = importlib.import_module(name)
        if name == "vllm":
            from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401  the whole offline import path
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:  # noqa: BLE001
        print(name, "NOT importable:", type(exc).__name__, str(exc)[:300])
PY
      ;;
    check1)  # the 1 trainer GPU + 1 native replica sync check alone (bit-exact + speed), ~70 s
      run check_sync_1x1 150 $PY scripts/check_sync_gpu.py --trainer-gpus 1 --replicas 1 --out "$OUT/sync_gpu_1x1.json" ;;
    check)
      run check_sync_1x1 150 $PY scripts/check_sync_gpu.py --trainer-gpus 1 --replicas 1 --out "$OUT/sync_gpu_1x1.json"
      if [ "$NGPU" -ge 4 ]; then
        run check_sync_2x2 120 $PY scripts/check_sync_gpu.py --trainer-gpus 2 --replicas 2 --engine "$(engine)" \
          --bucket-mb 256 --repeats 3 --out "$OUT/sync_gpu_2x2_$(engine).json"
      fi
      # os._exit after pytest: vLLM's engine-core children kept the interpreter alive for minutes after the summary
      run gpu_tests 270 $PY -c 'import os, sys, pytest; rc = pytest.main(sys.argv[1:]); sys.stdout.flush(); sys.stderr.flush(); os._exit(int(rc))' \
        -q -rs -m "gpu or multigpu or vllm" --timeout 250 \
        tests/test_sync_collective.py tests/test_vllm_engine.py tests/trainer/test_trainer_gpu.py ;;
    bench)
      run "bench_${NGPU}gpu_$(engine)" "${BENCH_LIMIT:-580}" $PY scripts/bench_async.py --device cuda --gpus "$NGPU" --engine "$(engine)" \
        --configs "${CONFIGS:-sync,s0_p1,s0.5_p1,s1_p1,s0_p0,s0.5_p0,s1_p0}" --work-dir /tmp/bench_async_runs \
        --out "$OUT/bench_async_${NGPU}gpu_$(engine)_${CONFIGS_TAG:-all}.json" ${BENCH_ARGS:-}
      tar czf "$OUT/timelines_${NGPU}gpu_${CONFIGS_TAG:-all}.tar.gz" -C /tmp/bench_async_runs \
        $(cd /tmp/bench_async_runs 2>/dev/null && ls -d */timeline.html 2>/dev/null) 2>/dev/null || true ;;
    pipeline)
      run pipeline_native_2gpu 400 $PY scripts/bench_async.py --device cuda --gpus 2 --engine native \
        --configs s0.5_p1 --steps 4 --work-dir /tmp/pipeline_runs --out "$OUT/pipeline_native_2gpu.json" ;;
    others)
      run bench_engine 300 $PY scripts/bench_engine.py --device cuda --out "$OUT/engine_gpu.json"
      gpus="1"; [ "$NGPU" -ge 2 ] && gpus="1 2"
      run bench_train 300 $PY scripts/bench_train.py --device cuda --gpus $gpus --out "$OUT/train_gpu.json" ;;
    *)
      echo "unknown phase $phase (stash setup setup-base check bench pipeline others)" >&2; status=2 ;;
  esac
done
exit $status
