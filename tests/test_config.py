"""Config composition and validation: every rule names the full key, in one line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from verl_async.config import (
    COMPAT_KEYS,
    ConfigError,
    compat_keys_set,
    compose,
    hydra_argv,
    max_required_samples,
    required_samples,
    reset_compat_warnings,
    trainer_dp_size,
    validate,
)
from verl_async.config.cli import REPO_ROOT
from verl_async.config import schema_rules as S

FSDP, MEGATRON = "fully_async_ppo_trainer", "fully_async_ppo_megatron_trainer"


@pytest.fixture
def parquet(tmp_path):
    """A real (tiny) parquet file; validation only checks that it exists."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "1+1?"}]]}), path)
    return str(path)


def check(overrides, name=FSDP):
    return validate(compose(name, overrides))


# --------------------------------------------------------------------------- composition
def test_both_configs_compose_and_validate():
    fsdp, meg = check([]), check([], MEGATRON)
    assert fsdp.actor_rollout_ref.actor.strategy == "fsdp2" and "megatron" not in fsdp.actor_rollout_ref.actor
    assert meg.actor_rollout_ref.actor.strategy == "megatron" == meg.actor_rollout_ref.ref.strategy
    assert meg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 1
    assert meg.actor_rollout_ref.actor.optim.lr_decay_style == "constant"
    # interpolations are resolved; the demo defaults
    assert fsdp.actor_rollout_ref.rollout.prompt_length == fsdp.data.max_prompt_length
    assert fsdp.actor_rollout_ref.actor.use_rollout_log_probs is True
    assert fsdp.trainer.device == "cpu" and fsdp.data.train_files == "builtin://train"


def test_values_are_converted_to_their_types():
    cfg = check(["actor_rollout_ref.actor.clip_ratio_c=3", "trainer.nnodes='1'", "trainer.logger=console"])
    assert cfg.actor_rollout_ref.actor.clip_ratio_c == 3.0 and isinstance(cfg.actor_rollout_ref.actor.clip_ratio_c, float)
    assert cfg.trainer.nnodes == 1 and isinstance(cfg.trainer.nnodes, int)
    assert list(cfg.trainer.logger) == ["console"]


def test_free_form_nodes_stay_open():
    cfg = check(
        [
            "+actor_rollout_ref.model.override_config.model_config.max_position_embeddings=4096",
            "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=16",
            "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",  # no + needed
            "+actor_rollout_ref.rollout.engine_kwargs.native.anything.nested=1",
            "critic.strategy=fsdp2",
        ]
    )
    arr = cfg.actor_rollout_ref
    assert arr.model.override_config.model_config.max_position_embeddings == 4096
    assert arr.rollout.engine_kwargs.vllm.swap_space == 4
    assert arr.rollout.engine_kwargs.native.anything.nested == 1
    assert cfg.reward_model.reward_kwargs.overlong_buffer_cfg.len == 16
    meg = check(["+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True"], MEGATRON)
    assert meg.actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion is True
    assert meg.actor_rollout_ref.ref.megatron.override_transformer_config.apply_rope_fusion is True


def test_verl_spellings_are_mapped():
    cfg = check(
        [
            "ray_kwargs.ray_init.num_cpus=3",
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
            "actor_rollout_ref.actor.clip_ratio_high=null",
            "actor_rollout_ref.actor.clip_ratio=0.3",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.use_dynamic_bsz=false",
            "actor_rollout_ref.actor.ppo_micro_batch_size=8",  # verl's global size -> 4 per GPU
        ]
    )
    assert cfg.ray_init.num_cpus == 3
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.3
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    with pytest.raises(ConfigError, match=r"^ray_kwargs\.ray_init\.num_cpus: .*ray_init\.num_cpus"):
        check(["ray_kwargs.ray_init.num_cpus=3", "ray_init.num_cpus=2"])


def test_derived_quantities():
    cfg = check(["actor_rollout_ref.actor.ppo_mini_batch_size=64", "async_training.staleness_threshold=0.2",
                 "async_training.trigger_parameter_sync_step=4", "actor_rollout_ref.rollout.n=8"])
    assert required_samples(cfg) == 64 and max_required_samples(cfg) == 307  # int(64 * 4 * 1.2)
    meg = check(["trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                 "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"], MEGATRON)
    assert trainer_dp_size(meg) == 2


def test_colocated_device_ids():
    from verl_async.config.derived import colocated_device_ids
    from verl_async.rollout.replica import replica_actor_options

    base = ["rollout.colocate=true", "trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=2"]
    assert colocated_device_ids(check(base + ["trainer.device=cuda"])) == ["0", "1"]
    assert colocated_device_ids(check(base)) is None  # cpu: nothing to share
    assert colocated_device_ids(check(["trainer.device=cuda"])) is None
    assert replica_actor_options("cuda", 1, colocated=True) == {"num_cpus": 1}  # the trainer holds the GPU
    assert replica_actor_options("cuda", 2) == {"num_gpus": 2, "num_cpus": 1}


def test_cuda_ipc_is_accepted_for_colocated_native_replicas():
    ok = ["async_training.sync_transport=cuda_ipc", "trainer.device=cuda", "rollout.colocate=true"]
    assert check(ok).async_training.sync_transport == "cuda_ipc"
    # the trainer may have more ranks than the one GPU the engine shares with rank 0
    assert check(ok + ["trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=1"]).rollout.colocate
    # one replica per trainer GPU, each served by the rank on its GPU (issue 37)
    assert check(ok + ["trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=2"]).async_training.sync_transport \
        == "cuda_ipc"
    with pytest.raises(ConfigError, match=r"^async_training\.sync_transport: .*megatron"):
        check(ok, MEGATRON)


def test_verl_fsdp_runs_as_fsdp2(caplog):
    reset_compat_warnings()
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        cfg = check(["actor_rollout_ref.actor.strategy=fsdp"])
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2" == cfg.actor_rollout_ref.ref.strategy
    assert [r.getMessage() for r in caplog.records] == [
        "actor_rollout_ref.actor.strategy=fsdp runs as fsdp2 (FSDP1 is not supported)"
    ]


def test_verl_fsdp2_script_overrides(parquet, tmp_path):
    """Keys that verl's fully-async FSDP2 scripts set (DAPO-style) are accepted as written."""
    cfg = check(
        [
            f"data.train_files={parquet}", f"data.val_files={parquet}", "data.truncation=left", "data.gen_batch_size=1",
            "data.train_batch_size=0", "data.return_raw_chat=True", "actor_rollout_ref.rollout.n=16",
            "actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2", "actor_rollout_ref.hybrid_engine=False",
            "+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True", "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
            "actor_rollout_ref.actor.fsdp_config.param_offload=False", "actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.80", "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.actor.optim.clip_grad=1.0",
            'trainer.logger=["console","tensorboard"]',  # what Hydra gets from trainer.logger='["console",...]' "trainer.test_freq=-1", "trainer.n_gpus_per_node=4",
            f"trainer.default_local_dir={tmp_path}/ckpt", "rollout.n_gpus_per_node=4", "rollout.total_rollout_steps=819200",
            "rollout.total_epochs=10", "async_training.staleness_threshold=1", "async_training.partial_rollout=True",
        ]
    )
    assert cfg.actor_rollout_ref.rollout.n == 16 and cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size == 2
    assert list(cfg.trainer.logger) == ["console", "tensorboard"] and cfg.critic.strategy == "fsdp2"


def test_debug_load_implies_train_only(tmp_path):
    cfg = check([f"debug.load_rollout_data='{tmp_path}/r_{{rollout_id}}.pt'"])
    assert cfg.debug.train_only is True


def test_debug_fail_replicas_accepts_all_or_existing_indices():
    assert check([]).debug.fail_replicas is None
    assert check(["debug.fail_replicas=all"]).debug.fail_replicas == "all"
    assert list(check(["rollout.n_gpus_per_node=2", "debug.fail_replicas=[0,1]"]).debug.fail_replicas) == [0, 1]


# --------------------------------------------------------------------------- errors
BAD = [
    # (overrides, full key, words in the reason)
    (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n", ">= 1"),
    (["actor_rollout_ref.rollout.n=abc"], "actor_rollout_ref.rollout.n", "expected an integer"),
    (["actor_rollout_ref.actor.clip_ratio_c=1"], "actor_rollout_ref.actor.clip_ratio_c", "> 1"),
    (["actor_rollout_ref.actor.clip_ratio_c=0.5"], "actor_rollout_ref.actor.clip_ratio_c", "> 1"),
    (["actor_rollout_ref.actor.clip_ratio_low=-0.1"], "actor_rollout_ref.actor.clip_ratio_low", ">= 0"),
    (["actor_rollout_ref.actor.clip_ratio_high=-1"], "actor_rollout_ref.actor.clip_ratio_high", ">= 0"),
    (["actor_rollout_ref.actor.loss_agg_mode=sum"], "actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator", "grpo"),
    (["actor_rollout_ref.actor.kl_loss_type=k4"], "actor_rollout_ref.actor.kl_loss_type", "low_var_kl"),
    (["algorithm.kl_penalty=foo"], "algorithm.kl_penalty", "unknown value 'foo'"),
    (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name", "native, vllm"),
    (["data.truncation=middle-out"], "data.truncation", "error"),
    (["trainer.device=tpu"], "trainer.device", "cuda, npu, cpu"),
    (["trainer.resume_mode=latest"], "trainer.resume_mode", "resume_path"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=0"], "actor_rollout_ref.actor.ppo_mini_batch_size", "> 0"),
    (["trainer.n_gpus_per_node=3"], "actor_rollout_ref.actor.ppo_mini_batch_size", "data-parallel size 3"),
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=3", "actor_rollout_ref.rollout.n=5"],
     "actor_rollout_ref.actor.ppo_mini_batch_size", "40 responses"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"],
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "does not divide the 64 responses"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"],
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "must be set"),
    (["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size=3"],
     "actor_rollout_ref.actor.ppo_micro_batch_size", "not divisible"),
    (["async_training.staleness_threshold=-0.1"], "async_training.staleness_threshold", ">= 0"),
    (["async_training.trigger_parameter_sync_step=0"], "async_training.trigger_parameter_sync_step", ">= 1"),
    (["async_training.require_batches=0"], "async_training.require_batches", ">= 1"),
    (["data.max_prompt_length=0"], "data.max_prompt_length", "> 0"),
    (["data.max_response_length=-5"], "data.max_response_length", "> 0"),
    (["data.train_files=/no/such/train.parquet"], "data.train_files", "no such file"),
    (["data.train_files=[builtin://train,missing.parquet]"], "data.train_files", "missing.parquet"),
    (["data.val_files=/no/such/test.parquet"], "data.val_files", "no such file"),
    (["data.train_files=hdfs://x/train.parquet"], "data.train_files", "remote"),
    (["data.train_files=[]"], "data.train_files", "no file"),
    (["actor_rollout_ref.model.path=/no/such/model"], "actor_rollout_ref.model.path", "no such folder"),
    (["actor_rollout_ref.model.path=./models/nope"], "actor_rollout_ref.model.path", "no such folder"),
    (["actor_rollout_ref.model.path='~/no_such_model_here'"], "actor_rollout_ref.model.path", "no such folder"),
    (["actor_rollout_ref.model.path=builtin://huge"], "actor_rollout_ref.model.path", "builtin://tiny"),
    (["data.tokenizer=/no/such/tokenizer"], "data.tokenizer", "no such folder"),
    (["debug.load_rollout_data='/tmp/r_{rollout_id}.pt'", "debug.rollout_only=true"], "debug.load_rollout_data", "rollout_only"),
    (["debug.rollout_only=true", "debug.train_only=true"], "debug.train_only", "rollout_only"),
    (["debug.save_train_output='/tmp/o_{rollout_id}.pt'"], "debug.save_train_output", "{rank}"),
    (["debug.fail_replicas=[1]"], "debug.fail_replicas", "replica 1 does not exist: this run has 1 engine replica"),
    (["debug.fail_replicas='0,1'"], "debug.fail_replicas", "expected null, all or a list of entries such as [0]"),
    (["debug.fail_replicas=first"], "debug.fail_replicas", "expected null, all or a list of entries such as [0]"),
    (["rollout.n_gpus_per_node=2", "debug.fail_replicas=['0:explode']"], "debug.fail_replicas",
     "'0:explode': unknown kind 'explode'; available: error, die, crash, hang, slow"),
    (["debug.fail_replicas=['1:die@2']"], "debug.fail_replicas", "replica 1 does not exist: this run has 1 engine"),
    (["debug.fail_trainer=[rank1:die@update2]"], "debug.fail_trainer", "trainer rank 1 does not exist"),
    (["debug.fail_trainer=[actor:die@update2]"], "debug.fail_trainer", "a rank dies in an update"),
    (["rollout.max_replica_restarts=-1"], "rollout.max_replica_restarts", ""),
    (["trainer.max_restarts=-1"], "trainer.max_restarts", ""),
    (["trainer.cpu_threads_per_worker=0"], "trainer.cpu_threads_per_worker", ">= 1"),
    (["trainer.dry_run=maybe"], "trainer.dry_run", "true or false"),
    (["async_training.sync_transport=nccl"], "async_training.sync_transport", "trainer.device=cuda"),
    (["async_training.sync_transport=hccl", "trainer.device=cuda"], "async_training.sync_transport", "trainer.device=npu"),
    (["rollout.colocate=true", "trainer.device=cuda", "async_training.sync_transport=nccl"],
     "async_training.sync_transport", "use object_store"),
    (["async_training.sync_transport=cuda_ipc"], "async_training.sync_transport", "trainer.device=cuda"),
    (["async_training.sync_transport=cuda_ipc", "trainer.device=cuda"], "async_training.sync_transport",
     "cuda_ipc needs rollout.colocate=true"),
    (["async_training.sync_transport=cuda_ipc", "trainer.device=cuda", "rollout.colocate=true",
      "actor_rollout_ref.rollout.name=vllm"], "async_training.sync_transport", "use object_store"),
    (["async_training.sync_transport=cuda_ipc", "trainer.device=cuda", "rollout.colocate=true",
      "rollout.n_gpus_per_node=2"], "async_training.sync_transport",
     "rollout.n_gpus_per_node=2 replicas need as many trainer GPUs, trainer.n_gpus_per_node=1"),
    (["rollout.colocate=true", "trainer.device=cuda", "rollout.n_gpus_per_node=2"], "rollout.colocate",
     "rollout.n_gpus_per_node=2 must be <= trainer.n_gpus_per_node=1"),
    (["rollout.colocate=true", "trainer.device=cuda", "trainer.nnodes=2"], "rollout.colocate", "single-node"),
    (["rollout.colocate=maybe"], "rollout.colocate", "true or false"),
    (["actor_rollout_ref.actor.foo=1"], "actor_rollout_ref.actor.foo", "unknown key"),
    (["+data.bar=1"], "data.bar", "unknown key"),
    (["nosuchsection.x=1"], "nosuchsection", "unknown key"),
    (["actor_rollout_ref.actor.ppo_mini_batchsize=2"], "actor_rollout_ref.actor.ppo_mini_batchsize",
     "did you mean actor_rollout_ref.actor.ppo_mini_batch_size"),
    (["actor_rollout_ref.actor.fsdp_config.nope=1"], "actor_rollout_ref.actor.fsdp_config.nope", "unknown key"),
    (["data.nope=1", "actor_rollout_ref.actor.megatron_x=2", "trainer.zz=3"], "data.nope",
     "unknown key; also unknown: actor_rollout_ref.actor.megatron_x, trainer.zz"),
    (["trainer.nnodes=x"], "trainer.nnodes", "expected an integer"),
    (["actor_rollout_ref.rollout.temperature=hot"], "actor_rollout_ref.rollout.temperature", "expected a number"),
    (["trainer.val_before_train=maybe"], "trainer.val_before_train", "true or false"),
    (["actor_rollout_ref.actor.optim.betas=0.9"], "actor_rollout_ref.actor.optim.betas", "expected a list"),
    (["trainer.logger=[console,clearml]"], "trainer.logger", "clearml is a verl logger that verl_async does not support"),
    (["~trainer.device"], "trainer.device", "no value"),
    (["trainer.default_local_dir=${trainer.nope}"], "trainer.default_local_dir", "trainer.nope"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.strategy=megatron"],
     "actor_rollout_ref.actor.megatron", "fully_async_ppo_megatron_trainer"),
    (["reward_model.enable=true"], "reward_model.enable", "not supported"),
    (["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n", "n >= 2"),
    (["async_training.queue_capacity=2"], "async_training.queue_capacity", "one trainer step of 8"),
    (["trainer.resume_mode=resume_path"], "trainer.resume_from_path", "must be set"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "actor_rollout_ref.rollout.tensor_model_parallel_size",
     "rollout's 1 devices"),
    (["actor_rollout_ref.rollout.max_model_len=100"], "actor_rollout_ref.rollout.max_model_len", "prompt_length"),
    (["custom_reward_function.path=/no/such/reward.py"], "custom_reward_function.path", "no such file"),
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], "actor_rollout_ref.actor.megatron",
     "fully_async_ppo_megatron_trainer"),
    (["actor_rollout_ref.actor.optim.lr_decay_style=cosine"], "actor_rollout_ref.actor.optim.lr_decay_style",
     "Megatron optimizer key"),
    (["actor_rollout_ref.actor.strategy=megatron"], "actor_rollout_ref.actor.megatron", "fully_async_ppo_megatron_trainer"),
]


MEGATRON_BAD = [
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"],
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "does not divide the trainer's 4 devices"),
    (["trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
      "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3"],
     "actor_rollout_ref.actor.ppo_mini_batch_size", "divided by the model-parallel size 2"),
    (["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=0"],
     "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size", ">= 1"),
    (["actor_rollout_ref.actor.optim.lr_decay_style=exp"], "actor_rollout_ref.actor.optim.lr_decay_style", "cosine"),
    (["actor_rollout_ref.ref.strategy=fsdp2"], "actor_rollout_ref.ref.strategy", "must equal"),
]


CASES = [(FSDP, *case) for case in BAD] + [(MEGATRON, *case) for case in MEGATRON_BAD]


@pytest.mark.parametrize("name,overrides,key,words", CASES, ids=[f"{c[0][-16:]}: {' '.join(c[1])}" for c in CASES])
def test_bad_config_names_the_key(name, overrides, key, words):
    with pytest.raises(ConfigError) as info:
        check(overrides, name)
    msg = str(info.value)
    assert msg.startswith(key + ": "), msg
    assert words in msg, msg
    assert "\n" not in msg and info.value.key == key


def test_paths_that_are_accepted(parquet, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for path in ["Qwen/Qwen2.5-0.5B-Instruct", "builtin://tiny", str(model_dir)]:
        assert check([f"actor_rollout_ref.model.path={path}"]).actor_rollout_ref.model.path == path
    cfg = check([f"data.train_files=[{parquet},builtin://train]", f"data.val_files={parquet}"])
    assert list(cfg.data.train_files) == [parquet, "builtin://train"]
    assert check(["data.val_files=null"]).data.val_files is None


def test_a_file_is_not_a_model_folder(parquet):
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.path: .* is a file"):
        check([f"actor_rollout_ref.model.path={parquet}"])


# --------------------------------------------------------------------------- compat keys
def test_compat_key_warns_once_by_name(caplog):
    reset_compat_warnings()
    overrides = ["data.return_raw_chat=True", "actor_rollout_ref.rollout.mode=sync",
                 "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=True"]
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        check(overrides)
        check(overrides)
    text = [r.getMessage() for r in caplog.records]
    for key in ["data.return_raw_chat", "actor_rollout_ref.rollout.mode",
                "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload"]:
        assert sum(m.startswith(key + "=") for m in text) == 1, text
    assert len(text) == 3


def test_compat_keys_at_default_are_silent(caplog):
    reset_compat_warnings()
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        check(["data.return_raw_chat=False", "actor_rollout_ref.hybrid_engine=False"])
        check([], MEGATRON)
    assert caplog.records == []


def test_compat_defaults_match_the_yaml():
    """Each listed key exists in a composed config, with the listed default."""
    configs = [check([]), check([], MEGATRON)]
    for key, compat in COMPAT_KEYS.items():
        found = [OmegaConf.select(c, key, default="<absent>") for c in configs]
        values = [OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for v in found if v != "<absent>"]
        assert values, f"{key} is in COMPAT_KEYS but in no config"
        assert all(v == compat.default for v in values), (key, values, compat.default)
    assert compat_keys_set(configs[0]) == compat_keys_set(configs[1]) == []


# --------------------------------------------------------------------------- helpers
def test_hydra_argv_rewrites(tmp_path):
    (tmp_path / "myconf").mkdir()
    (tmp_path / "myconf" / "x.yaml").write_text("a: {b: 0}\n")
    argv = ["--config-path=config", "--config-name=x.yaml", "a.b=1", "+c.d=2", "~e.f", "++g.h=3", "top=1",
            "actor@actor_rollout_ref.actor=megatron_actor", "hydra.run.dir=/tmp/x", "--cfg", "job", "-cp", "myconf"]
    out = hydra_argv(argv, cwd=str(tmp_path))
    assert out == ["--config-name=x", f"--config-path={REPO_ROOT / 'config'}", "++a.b=1", "++c.d=2", "~e.f",
                   "++g.h=3", "top=1", "actor@actor_rollout_ref.actor=megatron_actor", "hydra.run.dir=/tmp/x",
                   "--cfg", "job", "-cp", str(tmp_path / "myconf")]


@pytest.mark.parametrize("argv,name", [
    (["--config-name", "ppo_megatron_trainer", "a.b=1"], MEGATRON),
    (["--config-name=ppo_trainer.yaml"], FSDP),
    (["model_engine=megatron", "a.b=1"], MEGATRON),
    (["--config-name=ppo_megatron_trainer", "model_engine=dp"], FSDP),
    (["--config-path=config", "--config-name='fully_async_ppo_megatron_trainer.yaml'".replace("'", "")], MEGATRON),
])
def test_verls_trainer_choices_name_ours(argv, name):
    out = hydra_argv(argv)
    assert out[0] == f"--config-name={name}" and not any(a.startswith("model_engine") for a in out)


@pytest.mark.parametrize("argv,line", [
    (["model_engine=veomni"], "model_engine: veomni: not a verl_async trainer; use model_engine=dp (FSDP2) or "
                              "model_engine=megatron"),
    (["--config-name=fully_async_dapo_trainer"], "--config-name: fully_async_dapo_trainer: no such config in "
                                                 f"{REPO_ROOT / 'config'} (verl_async's: {FSDP}, {MEGATRON}; verl's "
                                                 "ppo_trainer and ppo_megatron_trainer name them)"),
])
def test_verls_trainer_choices_refused_in_one_line(argv, line, tmp_path):
    with pytest.raises(ConfigError) as err:
        hydra_argv(argv)
    assert str(err.value) == line
    env = {k: v for k, v in os.environ.items() if k != "VERL_ASYNC_DRY_RUN"}
    proc = subprocess.run([sys.executable, "-m", "recipe.fully_async_main", *argv], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"config error: {line}"]


def test_choice_lists_match_the_implementations():
    """schema_rules.py repeats the registries (it may not import torch); they must agree."""
    import importlib

    from verl_async import algos, data, reward
    from verl_async.utils import device

    rollout_correction = importlib.import_module("verl_async.algos.rollout_correction")

    assert S.DEVICES == tuple(device.DEVICE_KINDS)
    assert S.ADV_ESTIMATORS == tuple(algos.ADVANTAGE_ESTIMATORS)
    assert S.LOSS_AGG_MODES == tuple(algos.LOSS_AGG_MODES)
    assert S.POLICY_LOSS_MODES == tuple(importlib.import_module("verl_async.algos.policy_losses").POLICY_LOSSES)
    assert S.VERL_CORRECTION_LOSSES == importlib.import_module("verl_async.algos.policy_losses").BYPASS_LOSS_TYPES
    assert set(S.KL_TYPES) == set(algos.KL_KINDS)
    assert S.CORRECTION_LEVELS == rollout_correction.LEVELS and S.CORRECTION_MODES == rollout_correction.MODES
    assert S.CORRECTION_VETO_RULES == rollout_correction.VETO_RULES
    assert S.TRUNCATIONS == tuple(data.TRUNCATION_MODES)
    assert S.REWARD_MANAGERS == tuple(reward.REWARD_MANAGERS)


def test_validate_accepts_a_plain_dict():
    cfg = OmegaConf.to_container(compose(FSDP), resolve=True)
    assert validate(cfg).actor_rollout_ref.rollout.n == 8


def test_auto_sync_transport_picks_cuda_ipc_only_where_it_applies():
    one_gpu = ["trainer.device=cuda", "rollout.colocate=true"]
    assert check([]).async_training.sync_transport == "object_store"  # the CPU demo
    assert check(one_gpu).async_training.sync_transport == "cuda_ipc"
    assert check(one_gpu + ["actor_rollout_ref.rollout.name=vllm"]).async_training.sync_transport == "object_store"
    assert check(one_gpu, MEGATRON).async_training.sync_transport == "object_store"
    two = ["trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=2"]  # 2 FSDP2 ranks + 2 replicas, colocated
    assert check(one_gpu + two).async_training.sync_transport == "cuda_ipc"
    assert check(one_gpu + two + ["actor_rollout_ref.rollout.name=vllm"]).async_training.sync_transport \
        == "object_store"
    # separate GPUs: the collective broadcast (0.09 s per 0.5B sync on 2 H200s; the object store took 3.5 s)
    assert check(["trainer.device=cuda"]).async_training.sync_transport == "nccl"
    assert check(["trainer.device=npu"]).async_training.sync_transport == "object_store"  # hccl: an explicit choice
    # the Megatron trainer's collective sender has run on CPU only: nccl is its user's explicit choice for now
    assert check(["trainer.device=cuda"], MEGATRON).async_training.sync_transport == "object_store"
    assert check(["trainer.device=cuda", "async_training.sync_transport=nccl"], MEGATRON
                 ).async_training.sync_transport == "nccl"
    # an explicit choice is kept as given
    assert check(one_gpu + ["async_training.sync_transport=object_store"]).async_training.sync_transport == "object_store"
    assert check(["trainer.device=cuda", "async_training.sync_transport=object_store"]
                 ).async_training.sync_transport == "object_store"


def test_auto_trigger_is_verls_default_on_a_split_layout_only():
    """null: 4 where the rollout has accelerators of its own (verl's default; measured best on 2 H200s), else 2."""
    trigger = lambda *o: check(list(o)).async_training.trigger_parameter_sync_step  # noqa: E731
    assert trigger() == 2  # the CPU demo
    assert trigger("trainer.device=cuda") == 4
    assert trigger("trainer.device=npu") == 4
    assert trigger("trainer.device=cuda", "rollout.colocate=true") == 2
    assert trigger("trainer.device=cuda", "async_training.trigger_parameter_sync_step=1") == 1  # given: kept
    from verl_async.config.derived import max_required_samples

    # the staleness formula sees the resolved value
    cfg = check(["trainer.device=cuda", "actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    assert max_required_samples(cfg) == 16 * 4 * 1.5


def test_engine_and_strategy_tables_match_the_schema():
    """The registries are plain tables of classes now; the schema's choice lists must name the same keys."""
    from verl_async.pipeline import WORKER_GROUPS
    from verl_async.rollout.registry import ENGINES

    assert S.ROLLOUT_NAMES == tuple(ENGINES)
    assert S.STRATEGIES == tuple(WORKER_GROUPS)


def test_the_entry_point_and_validation_import_no_torch_ray_or_engines():
    """A config error must print before the heavy imports (the pipeline is imported after validation)."""
    import subprocess
    import sys

    code = ("import sys, recipe.fully_async_main; from verl_async.config import compose, validate; "
            f"validate(compose({FSDP!r})); validate(compose({MEGATRON!r})); "
            "print(sorted(m for m in ('torch', 'ray', 'transformers', 'vllm', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
