#!/usr/bin/env bash
# Checks of GPU code that the CPU tests cannot see (issue 41's Triton kernels, true on-policy), by phase; results
# under $OUT. Repo root, after real_model_gpu.sh setup (Ray & co and SmolLM2 in place):
#   bash scripts/device/checks_gpu.sh PHASE [PHASE ...]
# Phases:
#   triton       the Triton attention / log-prob kernels (bit-equality over shapes, and their price), the linear and
#                RMSNorm kernels re-checked without their price, then their pytest files and the invariant ops'
#                -> invariant_triton_softmax.json, invariant_triton_recheck.json, triton_pytest.log
#   tonp-tests   scripts/check_true_on_policy_gpu.py --skip-bench: the true on-policy equality tests under -m gpu
#   tonp-bench   scripts/check_true_on_policy_gpu.py --skip-tests: engine and FSDP2 tokens/s, mode on vs off
# Each phase has its own time limit (CHECK_LIMIT, default 280 s) so one hang does not eat the call. Each phase's
# files are written to $STORE/PHASE and come back as one $OUT/checks_PHASE.tar.gz (a call returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/device/session.sh
source scripts/device/session.sh && device_session checks
LIMIT=${CHECK_LIMIT:-280}
status=0

limited() {  # limited LOG CMD...: run CMD under the phase limit, its output to $DIR/LOG, the tail shown
  local log=$1; shift
  local t0=$SECONDS
  timeout --kill-after=10 "$LIMIT" "$@" > "$DIR/$log" 2>&1
  local rc=$?
  echo "=== $log: rc=$rc in $((SECONDS - t0))s"
  tail -n 14 "$DIR/$log"
  [ $rc -eq 0 ] || status=1
}

for phase in "$@"; do
  DIR=$STORE/$phase
  mkdir -p "$DIR"
  case "$phase" in
    triton)
      limited triton_softmax_bench.log python3 scripts/bench_invariant_triton_softmax.py \
        --out "$DIR/invariant_triton_softmax.json"
      limited triton_recheck.log python3 scripts/bench_invariant_triton.py --skip-bench \
        --out "$DIR/invariant_triton_recheck.json"
      limited triton_pytest.log python3 -m pytest -q -p no:cacheprovider tests/test_invariant_triton.py \
        tests/test_invariant_triton_softmax.py tests/test_invariant_ops.py ;;
    tonp-tests)
      limited tonp_tests.log python3 scripts/check_true_on_policy_gpu.py --skip-bench \
        --out "$DIR/true_on_policy_gpu_tests.json" ;;
    tonp-bench)
      limited tonp_bench.log python3 scripts/check_true_on_policy_gpu.py --skip-tests \
        --out "$DIR/true_on_policy_gpu_bench.json" ;;
    *) echo "unknown phase $phase (triton | tonp-tests | tonp-bench)" >&2; status=2 ;;
  esac
  tar czf "$OUT/checks_$phase.tar.gz" -C "$STORE" "$phase" 2>/dev/null
done
exit $status
