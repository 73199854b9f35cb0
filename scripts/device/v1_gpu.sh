#!/usr/bin/env bash
# Issue 38 on the lent GPUs: verl's V1 keys, a reward model (judge) and on-policy distillation with the real model
# (SmolLM2-135M-Instruct) on the arithmetic task. Run `bash scripts/device/real_model_gpu.sh setup` first (Ray & co,
# the model, the data under /tmp/data/arith); then, from the repo root:
#   bash scripts/device/v1_gpu.sh PHASE [PHASE ...]
# Phases (each run: $STORE/NAME.tar.gz with console.log, tensorboard/, timeline, config.yaml):
#   v1:colocate-SEED   verl's V1 keys on one GPU: trainer.v1.trainer_mode=colocate_async, num_warmup_batches=1,
#                      train_batch_size=16 = one mini-batch update per version (the README task, STEPS versions)
#   v1:separate-SEED   trainer_mode=separate_async on 2 GPUs (1 trainer + 1 rollout, checkpoint_engine nccl),
#                      parameter_sync_step=4 x ppo_mini_batch_size=4 = train_batch_size 16
#   judge:MODE-SEED    a generative judge (the same SmolLM2 served by a native engine of its own, beside the policy's
#                      on the one GPU) scoring every response: MODE add = the rule reward + 0.5 x the judge's score,
#                      only = the judge's score alone; reward/rm_* counts, rm_score, timing per step
#   teacher-SEED       the README's one-GPU RL run (2 x STEPS steps) saving its HF model: the teacher
#   opd:MODE-SEED      SmolLM2-135M distilled from that teacher (distillation.*; the teacher beside the engine):
#                      MODE topk = forward_kl_topk (k=32) as a supervised loss, no task reward;
#                           k1pg = verl's OPD e2e loss (k1 as the policy-gradient advantage, clamps), no task reward;
#                           rl   = the same job without a teacher (plain RL, the baseline the curves compare with)
#   queue:P1,P2,... / wait:SECONDS   as in real_model_gpu.sh (scripts/device/queue.sh)
# STEPS (32), TEST_FREQ (8), LR (1e-5), TRAIN_LIMIT (900 s per run).
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/device/session.sh
source scripts/device/session.sh && device_session v1
MODEL=builtin://smollm2-135m-instruct
DATA=/tmp/data/arith
STEPS=${STEPS:-32}
TEST_FREQ=${TEST_FREQ:-8}
LR=${LR:-1e-5}
status=0

job() {  # job NAME KEY=VALUE...: one run on the arithmetic task (the README's real-model settings) plus the overrides
  local name=$1 dir t0=$SECONDS
  shift
  dir=$(run_dir "$name")
  echo "=== $name (limit ${TRAIN_LIMIT:-900}s): $*"
  timeout --kill-after=15 "${TRAIN_LIMIT:-900}" python3 -m recipe.fully_async_main \
    data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet \
    data.max_prompt_length=256 data.max_response_length=256 reward_model.gsm8k_method=flexible \
    trainer.device=cuda actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=0.7 \
    actor_rollout_ref.rollout.max_num_seqs=256 actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.optim.lr=$LR trainer.test_freq=$TEST_FREQ trainer.val_before_train=true \
    'trainer.logger=[console,tensorboard]' trainer.project_name=v1 trainer.experiment_name=$name \
    trainer.default_local_dir=$dir hydra.run.dir=$dir/hydra "$@" > "$dir/console.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
  tr '\r' '\n' < "$dir/console.log" | grep -aE "validation|done in|run failed|Error|config error" | tail -n 10
  (cd "$dir" && tar czf "$STORE/$name.tar.gz" --ignore-failed-read console.log tensorboard timeline.jsonl \
      timeline.html rollout config.yaml metrics.jsonl 2>/dev/null)
  [ $rc -eq 0 ] || status=1
}

base() {  # the README's one-GPU layout and length
  echo "actor_rollout_ref.model.path=$MODEL rollout.colocate=true async_training.trigger_parameter_sync_step=1" \
       "rollout.total_rollout_steps=$((${1:-$STEPS} * 16)) data.seed=$2 trainer.seed=$2"
}

teacher_dir() {  # the HF model the teacher-SEED run saved (its last checkpoint)
  ls -d "$RUNS/teacher-$1"/global_step_*/actor/huggingface 2>/dev/null | sort -V | tail -1
}

for phase in "$@"; do
  case "$phase" in
    v1:colocate-*)
      seed=${phase##*-}
      # shellcheck disable=SC2046
      job "v1-colocate-$seed" actor_rollout_ref.model.path=$MODEL data.seed=$seed trainer.seed=$seed \
        trainer.use_v1=true trainer.v1.trainer_mode=colocate_async trainer.v1.colocate_async.num_warmup_batches=1 \
        data.train_batch_size=16 trainer.total_training_steps=$STEPS 'trainer.logger=[console,tensorboard,file]' ;;
    v1:separate-*)
      seed=${phase##*-}
      [ "$(visible_gpus)" -ge 2 ] || { echo "v1:separate needs 2 GPUs" >&2; status=2; continue; }
      job "v1-separate-$seed" actor_rollout_ref.model.path=$MODEL data.seed=$seed trainer.seed=$seed \
        trainer.use_v1=true trainer.v1.trainer_mode=separate_async trainer.v1.separate_async.num_warmup_batches=1 \
        trainer.v1.separate_async.parameter_sync_step=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
        data.train_batch_size=16 trainer.n_gpus_per_node=1 actor_rollout_ref.rollout.nnodes=1 \
        actor_rollout_ref.rollout.n_gpus_per_node=1 actor_rollout_ref.rollout.checkpoint_engine.backend=nccl \
        trainer.total_training_steps=$STEPS 'trainer.logger=[console,tensorboard,file]' ;;
    judge:*)
      spec=${phase#judge:}; mode=${spec%-*} seed=${spec##*-}
      case $mode in
        add)  rm="reward.reward_model.use_task_rewards=true reward.reward_model.reward_model_coef=0.5" ;;
        only) rm="reward.reward_model.use_task_rewards=false" ;;
        *) echo "unknown judge mode $mode (add | only)" >&2; status=2; continue ;;
      esac
      # shellcheck disable=SC2046,SC2086
      job "judge-$mode-$seed" $(base "$STEPS" "$seed") reward.reward_model.enable=true \
        reward.reward_model.model_path=$MODEL reward.reward_model.rollout.max_num_seqs=256 \
        reward.reward_model.rollout.prompt_length=768 reward.reward_model.rollout.response_length=16 \
        reward_model.max_error_rate=1.0 $rm 'trainer.logger=[console,tensorboard,file]' ;;
    teacher-*)
      seed=${phase##*-}
      # shellcheck disable=SC2046
      job "teacher-$seed" $(base $((STEPS * 2)) "$seed") trainer.save_freq=$((STEPS * 2)) \
        'actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]' ;;
    opd:*)
      spec=${phase#opd:}; mode=${spec%-*} seed=${spec##*-}
      teacher=${TEACHER:-$(teacher_dir "$seed")}
      [ -n "$teacher" ] || teacher=$(ls -d "$RUNS"/teacher-*/global_step_*/actor/huggingface 2>/dev/null | sort -V | tail -1)
      case $mode in
        topk) dist="distillation.distillation_loss.loss_mode=forward_kl_topk distillation.distillation_loss.topk=32" ;;
        k1pg) dist="distillation.distillation_loss.loss_mode=k1 distillation.distillation_loss.use_policy_gradient=true
                    distillation.distillation_loss.loss_max_clamp=10.0 distillation.distillation_loss.log_prob_min_clamp=-10.0" ;;
        rl) dist="" ;;
        *) echo "unknown opd mode $mode (topk | k1pg | rl)" >&2; status=2; continue ;;
      esac
      if [ "$mode" != rl ]; then
        [ -n "$teacher" ] || { echo "opd: no teacher (run teacher-SEED first, or TEACHER=HF folder)" >&2; status=2; continue; }
        dist="distillation.enabled=true distillation.teacher_models.teacher_model.model_path=$teacher
              distillation.distillation_loss.use_task_rewards=false $dist"
      fi
      # shellcheck disable=SC2046,SC2086
      job "opd-$mode-$seed" $(base "$STEPS" "$seed") $dist 'trainer.logger=[console,tensorboard,file]' ;;
    queue:*) queue_start scripts/device/v1_gpu.sh "${phase#queue:}" ;;
    wait:*)
      queue_wait "${phase#wait:}" 40
      for d in "$RUNS"/*/; do
        [ -f "$d/console.log" ] || continue
        echo "--- $(basename "$d"): $(tr '\r' '\n' < "$d/console.log" | grep -a "training:" | tail -n 1 | cut -c1-150)"
        tr '\r' '\n' < "$d/console.log" | grep -aE "val/mean@1/acc|run failed|Error" | tail -n 3 | cut -c1-300
      done
      send_finished "$STORE"/*.tar.gz
      send_partial console.log tensorboard timeline.jsonl config.yaml metrics.jsonl
      ls "$OUT" ;;
    *)
      echo "unknown phase $phase (v1:colocate-SEED v1:separate-SEED judge:add|only-SEED teacher-SEED opd:topk|k1pg|rl-SEED queue:A,B wait:S)" >&2
      status=2 ;;
  esac
done
exit $status
