# shellcheck shell=bash
# What every device script starts with (real_model_gpu.sh, scale_gpu.sh, v1_gpu.sh), sourced from the repo root:
#   source scripts/device/session.sh && device_session NAME
# sets OUT (what comes back from the call; $OUT of the device tool), STORE (finished archives, /tmp/NAME_store),
# RUNS (one folder per run, /tmp/runs/NAME), loads the background queue (queue.sh) and exports the environment
# the carried packages and the lent machines need.
device_session() {
  OUT=${OUT:-/tmp/$1_out}
  STORE=/tmp/$1_store
  RUNS=/tmp/runs/$1
  mkdir -p "$OUT" "$STORE" "$RUNS"
  # shellcheck source=scripts/device/queue.sh
  source scripts/device/queue.sh
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RAY_DEDUP_LOGS=1
  export VERL_ASYNC_CACHE=${VERL_ASYNC_CACHE:-/root/.cache/verl_async}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # keep multicast off (KINDS.md)
}
