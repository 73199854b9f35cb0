"""What `--help` shows before Hydra's own help and the full config dump: what a user needs first."""

from __future__ import annotations

from verl_async.models.names import BUILTIN_MODELS, SCHEME

BUILTIN_DATA = ("train", "val")  # verl_async.data.builtin (generated and cached on first use)


def usage() -> str:
    models = " | ".join(SCHEME + m for m in BUILTIN_MODELS)
    data = " | ".join(SCHEME + d for d in BUILTIN_DATA)
    return f"""\
verl_async: fully asynchronous RL post-training (GRPO/PPO) with verl's fully_async_policy config keys.

usage: python -m recipe.fully_async_main [--config-name=NAME] [key=value ...]

With no arguments it runs the CPU demo: {SCHEME}tiny on {SCHEME}train / {SCHEME}val (a few minutes, no hub).

Example, one GPU, a real model from a PyPI wheel (no hub needed):
  python -m data_preprocess.arithmetic --local_dir ~/data/arith
  python -m recipe.fully_async_main \\
      actor_rollout_ref.model.path={SCHEME}smollm2-135m-instruct \\
      data.train_files=$HOME/data/arith/train.parquet data.val_files=$HOME/data/arith/test.parquet \\
      data.max_prompt_length=256 data.max_response_length=256 \\
      trainer.device=cuda rollout.colocate=true trainer.save_freq=8

Main keys:
  actor_rollout_ref.model.path          HF id, local HF folder, *.gguf file, or {models}
  data.train_files, data.val_files      parquet (verl's schema), a list of them, or {data}
  data.max_prompt_length, data.max_response_length
  trainer.device                        cpu (default) | cuda | npu; trainer.n_gpus_per_node, rollout.n_gpus_per_node
  actor_rollout_ref.rollout.name        native (default) | vllm; actor_rollout_ref.rollout.n: responses per prompt
  actor_rollout_ref.actor.ppo_mini_batch_size   prompts per trainer step
  trainer.experiment_name               names the run folder trainer.default_local_dir (default outputs/verl_async/demo)
  trainer.save_freq                     checkpoint every N parameter versions (-1, the default: no checkpoint)
  trainer.resume_mode                   auto (default: continue the run folder's newest checkpoint) | disable
  --config-name=fully_async_ppo_megatron_trainer   the Megatron-core trainer (default: FSDP2)

Before a long run:
  VERL_ASYNC_DRY_RUN=1 python -m recipe.fully_async_main ...   checks the config, device, engine, model, reward
                                                                function, data (every prompt) and the resume; starts nothing
  python -m recipe.fully_async_main ... --cfg job              prints the composed config
Ctrl-C stops a run and prints the command that resumes it.

Everything else: README.md and docs/ (docs/configuration.md: every key), and the full configuration below (Hydra's help).
"""
