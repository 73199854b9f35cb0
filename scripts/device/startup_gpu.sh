#!/usr/bin/env bash
# Issue 37 item 6: where a run's start-up goes on the lent GPUs (the breakdown of verl_async/utils/startup.py), by
# phase; results under $OUT. Repo root:
#   bash scripts/device/startup_gpu.sh PHASE [PHASE ...]
# Phases:
#   probe    scripts/startup_probe.py on the random Qwen2.5-0.5B shape (built in /tmp/probe_model_05b): each piece of
#            the start-up alone, with the bytecode as the machine has it, then again after session.sh's precompile
#            -> $OUT/probe_asis.json, probe_compiled.json, startup_probe.md (~3 min; Ray & co installed first)
#   one      the real model (SmolLM2-135M) on one GPU: scripts/device/real_model_gpu.sh setup (the model's carried
#            parts stashed first, as for that script), then its train:ipc-async-1 (weights by CUDA IPC, a reference
#            model for the KL loss, the validation before training) of STARTUP_STEPS (4) steps three times: the
#            default (no prestarted Ray workers on this many cores), ray_init.prestart_workers=true (Ray's one per
#            CPU, as before), and that with ray_init.preload_modules=[torch];
#            -> $OUT/ipc-async-1-st*.tar.gz (console.log with the breakdown, timeline.jsonl), $OUT/startup_135m.md
#   readme   the README's real-model block verbatim (real_model_gpu.sh readme:real-model; 32 steps, validations)
#            -> $OUT/readme-real-model.tar.gz, .console.log, $OUT/startup_readme.md
#   report   the table of every archive under $OUT (scripts/startup_report.py) -> $OUT/startup_all.md
# The 7B shape on two GPUs is scripts/device/scale_gpu.sh's bench phase (bench_async's JSON carries startup/*;
# its runs' archive the timelines): see docs/troubleshooting.md "Start-up" for the commands.
set -uo pipefail
cd "$(dirname "$0")/../.."
RM_STORE=/tmp/real_model_store
status=0

one_run() {  # one_run TAG EXTRA: train:ipc-async-1 as ipc-async-1-TAG with EXTRA overrides, archived to $OUT
  RUN_TAG=$1 TRAIN_EXTRA=$2 STEPS=${STARTUP_STEPS:-4} TEST_FREQ=-1 OUT=$OUT \
    bash scripts/device/real_model_gpu.sh train:ipc-async-1 || status=1
  cp "$RM_STORE/ipc-async-1-$1.tar.gz" "$OUT/" 2>/dev/null || status=1
}

report() {  # report OUTFILE ARCHIVE... [--labels ...]: the breakdown table (scripts/startup_report.py)
  local out=$1; shift
  PYTHONPATH=/tmp/site:$PWD python3 scripts/startup_report.py "$@" | tee "$out"
}

OUT=${OUT:-/tmp/startup_out}
mkdir -p "$OUT"
for phase in "$@"; do
  case "$phase" in
    probe)
      bash scripts/device/install_on_device.sh base >/dev/null || status=1
      export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
      python3 -c "import sys, json; sys.path.insert(0, 'scripts'); import bench_train as b, bench_async as a
b.build_model_dir('/tmp/probe_model_05b', {**a.SHAPES['0.5b'], **a.SHAPE_COMMON})" > "$OUT/probe_model.log" 2>&1 \
        || { status=1; tail -n 5 "$OUT/probe_model.log"; }
      timeout 600 python3 scripts/startup_probe.py --model /tmp/probe_model_05b --out "$OUT/probe_asis.json" \
        > "$OUT/startup_probe.md" 2>&1 || status=1
      # shellcheck source=scripts/device/session.sh
      (source scripts/device/session.sh && precompile)
      echo >> "$OUT/startup_probe.md"; echo "## after precompile" >> "$OUT/startup_probe.md"
      timeout 600 python3 scripts/startup_probe.py --model /tmp/probe_model_05b --out "$OUT/probe_compiled.json" \
        --skip importtime,profile,concurrent >> "$OUT/startup_probe.md" 2>&1 || status=1
      grep -E "^\| |^environment" "$OUT/startup_probe.md" | cut -c1-220 ;;
    one)
      OUT=$OUT bash scripts/device/real_model_gpu.sh setup > "$OUT/setup_135m.log" 2>&1 || status=1
      tail -n 3 "$OUT/setup_135m.log"
      one_run st ""
      one_run st-prestart "ray_init.prestart_workers=true"
      one_run st-preload "ray_init.prestart_workers=true ray_init.preload_modules=[torch]"
      report "$OUT/startup_135m.md" "$OUT"/ipc-async-1-st.tar.gz "$OUT"/ipc-async-1-st-prestart.tar.gz \
        "$OUT"/ipc-async-1-st-preload.tar.gz --labels "135m default,135m prestart,135m prestart+preload [torch]" ;;
    readme)
      OUT=$OUT README_LIMIT=${README_LIMIT:-540} bash scripts/device/real_model_gpu.sh readme:real-model || status=1
      cp "$RM_STORE/readme-real-model.tar.gz" "$RM_STORE/readme-real-model.console.log" "$OUT/" 2>/dev/null || status=1
      tr '\r' '\n' < "$OUT/readme-real-model.console.log" | grep -A8 "^start-up:" | head -n 9
      report "$OUT/startup_readme.md" "$OUT/readme-real-model.tar.gz" --labels "README block" ;;
    report)
      report "$OUT/startup_all.md" "$OUT"/*.tar.gz ;;
    *) echo "unknown phase $phase (probe | one | readme | report)" >&2; status=2 ;;
  esac
done
exit $status
