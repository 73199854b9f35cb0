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

# The GPUs this session may use, as CUDA and Ray count them: CUDA_VISIBLE_DEVICES' entries up to the first one
# CUDA would refuse (an index past the machine's GPUs, a negative one; "" is none) when it is set, else every GPU
# nvidia-smi lists. `nvidia-smi -L` alone counts the machine's: with CUDA_VISIBLE_DEVICES=0 on a 2-GPU machine a
# script chose the split layout that Ray, seeing one GPU, could not place.
visible_gpus() {
  local all n=0 dev
  all=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ -z "${CUDA_VISIBLE_DEVICES+set}" ]; then echo "$all"; return; fi
  IFS=',' read -ra devs <<< "$CUDA_VISIBLE_DEVICES"
  for dev in "${devs[@]}"; do
    dev=${dev//[[:space:]]/}
    case "$dev" in
      ''|-*) break ;;
      *[!0-9]*) ;;                            # a GPU-/MIG- UUID: CUDA resolves it
      *) [ "$dev" -lt "$all" ] || break ;;
    esac
    n=$((n + 1))
  done
  echo $((n < all ? n : all))
}

# Bytecode for the carried packages in /tmp/site and for this checkout, as a user's `pip install` leaves it: the
# carried wheels go in with --no-compile and the checkout comes fresh, so every process of a run would compile
# what it imports (each actor, rank and replica, at once). Up-to-date files are skipped: cheap on a later call.
precompile() {
  python3 -m compileall -q -j 0 /tmp/site verl_async recipe >/dev/null 2>&1 || true
}
