"""Run a verl entry point's own `main` up to `ray.init` and stop: its config checks without a GPU (issue 37 item 3).

    python scripts/device/verl_validate.py verl.trainer.main_ppo KEY=VALUE ...
    python scripts/device/verl_validate.py verl.experimental.fully_async_policy.fully_async_main KEY=VALUE ...

`--cfg job` shows that the overrides compose; this goes further. verl's `main` composes the config, runs its
checks (main_ppo: `validate_config`, which builds the actor's dataclass config and checks the batch sizes
against the GPUs; the fully async main: its own edits of the config) and then calls
`verl.trainer.main_ppo.run_ppo`, which starts Ray. Here `run_ppo` is replaced by a function that resolves the
config (every interpolation), builds the dataclass configs verl's workers build from it (actor,
rollout, checkpoint engine, algorithm) and prints the settings that decide the schedule. Nothing starts.
Used by `CHECK=1 bash scripts/device/verl_compare.sh PHASE` (its check_only).
"""

from __future__ import annotations

import importlib
import sys
import tempfile

from omegaconf import DictConfig, OmegaConf

SCHEDULE_KEYS = (
    "trainer.use_v1", "trainer.v1.trainer_mode", "trainer.v1.separate_async.parameter_sync_step",
    "trainer.v1.separate_async.num_warmup_batches", "actor_rollout_ref.hybrid_engine", "trainer.n_gpus_per_node",
    "rollout.n_gpus_per_node", "actor_rollout_ref.rollout.n_gpus_per_node", "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "rollout.total_rollout_steps", "trainer.total_training_steps",
    "async_training.staleness_threshold", "async_training.trigger_parameter_sync_step",
    "async_training.require_batches", "async_training.partial_rollout", "async_training.concurrent_samples_per_replica",
    "actor_rollout_ref.rollout.checkpoint_engine.backend", "algorithm.rollout_correction.bypass_mode",
    "actor_rollout_ref.actor.use_rollout_log_probs", "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.model.enable_gradient_checkpointing", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.agent.default_agent_loop",
)
DATACLASS_SECTIONS = ("actor_rollout_ref.actor", "actor_rollout_ref.rollout",
                      "actor_rollout_ref.rollout.checkpoint_engine", "algorithm")


def checked(config: DictConfig, task_runner_class=None) -> None:
    """Stands in for run_ppo: what verl would hand to Ray, resolved and built, then stop."""
    from verl.utils.config import omega_conf_to_dataclass

    OmegaConf.resolve(config)
    built = []
    for section in DATACLASS_SECTIONS:
        node = OmegaConf.select(config, section)
        if isinstance(node, DictConfig) and "_target_" in node:
            omega_conf_to_dataclass(node)
            built.append(section)
    runner = getattr(task_runner_class, "__name__", None) or type(task_runner_class).__name__
    print(f"verl_validate: task runner {runner}; dataclass configs built: {', '.join(built)}")
    v1 = "V1" in runner  # the V1 keys are in every composed config; only TaskRunnerV1 reads them
    for key in SCHEDULE_KEYS:
        if key.startswith("trainer.v1.") and not v1:
            continue
        value = OmegaConf.select(config, key, default="<absent>")
        if value != "<absent>":
            print(f"  {key} = {value}")
    print("verl_validate: ok (nothing started)")


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    module = importlib.import_module(argv[0])
    import verl.trainer.main_ppo as main_ppo

    main_ppo.run_ppo = checked  # fully_async_main imports it from there inside its main()
    if hasattr(module, "run_ppo"):
        module.run_ppo = checked
    task = module.main
    while hasattr(task, "__wrapped__"):
        task = task.__wrapped__
    task.__module__ = "__main__"  # Hydra then finds config_path beside the module's file, as under `python -m`
    with tempfile.TemporaryDirectory() as scratch:  # Hydra's run folder, not in the caller's tree
        sys.argv = [module.__file__, *argv[1:], f"hydra.run.dir={scratch}", "hydra.output_subdir=null"]
        module.main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
