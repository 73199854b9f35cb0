"""The entry point and the reference launch script (../shared/reference/003, adapted)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from verl_async.config import ConfigError, compose, validate
from verl_async.config.cli import REPO_ROOT
from verl_async.config.preflight import preflight
from tests.entry_point import run_main

SCRIPT = REPO_ROOT / "scripts" / "run_qwen2.5_0.5b_gsm8k_fully_async_reference.sh"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_ASYNC_DRY_RUN", "HYDRA_FULL_ERROR")}
    env.update(PYTHONPATH=str(REPO_ROOT), TOKENIZERS_PARALLELISM="false", **extra)
    return env


def run_entry(*args, **env) -> subprocess.CompletedProcess:
    """The command in this process (tests/entry_point.py): exit status, stdout and stderr as a subprocess's."""
    return run_main(args, env=_env(**env), cwd=str(REPO_ROOT))


def write_parquet(path, rows: int, prompt_key: str = "prompt") -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {
        prompt_key: [{"role": "user", "content": "Natalia sold 48 clips. How many?"}],
        "data_source": "openai/gsm8k",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0},
    }
    pq.write_table(pa.Table.from_pylist([row] * rows), path)
    return str(path)


@pytest.fixture
def gsm8k_files(tmp_path):
    # the script trains 64 prompts per step (ppo_mini_batch_size=64, require_batches=1)
    return write_parquet(tmp_path / "train.parquet", 64), write_parquet(tmp_path / "test.parquet", 3)


def script_env(tmp_path, gsm8k_files, model_dir, **extra) -> dict:
    train, test = gsm8k_files
    return _env(MODEL_PATH=model_dir, TRAIN_FILE=train, TEST_FILE=test, TRAINER_DEVICE="cpu",
                LOG_FILE=str(tmp_path / "log.txt"), **extra)


def python_on_path(tmp_path, env, body: str) -> dict:
    """`env` with a `python` first on PATH that runs `body` (a sh script)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").write_text("#!/bin/sh\n" + body + "\n")
    (bindir / "python").chmod(0o755)
    return dict(env, PATH=f"{bindir}:{env.get('PATH', '/usr/bin:/bin')}")


def script_argv(tmp_path, env) -> list:
    """The exact argv the reference script hands to python (captured by a stand-in)."""
    out = tmp_path / "argv"
    env = python_on_path(tmp_path, dict(env, ARGV_OUT=str(out)), 'printf "%s\\0" "$@" > "$ARGV_OUT"')
    subprocess.run(["bash", str(SCRIPT)], cwd=REPO_ROOT, env=env, check=True, capture_output=True, timeout=60)
    return out.read_text().split("\0")[:-1]


def test_reference_script_overrides_compose_and_validate(tmp_path, gsm8k_files, tiny_model_dir):
    argv = script_argv(tmp_path, script_env(tmp_path, gsm8k_files, tiny_model_dir))
    assert argv[:4] == ["-m", "recipe.fully_async_main", "--config-path=config",
                        "--config-name=fully_async_ppo_megatron_trainer.yaml"]
    overrides = argv[4:]
    assert "trainer.logger=[console,tensorboard]" in overrides
    assert "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null" in overrides
    assert sum(o.startswith("+") for o in overrides) == 18
    cfg = validate(compose("fully_async_ppo_megatron_trainer.yaml", overrides))
    arr = cfg.actor_rollout_ref
    assert arr.actor.strategy == "megatron" and arr.rollout.name == "vllm" and arr.rollout.n == 8
    assert arr.actor.megatron.virtual_pipeline_model_parallel_size is None
    assert arr.actor.megatron.override_transformer_config.use_flash_attn is True
    assert arr.model.override_config.model_config.max_position_embeddings == 6144
    assert arr.actor.clip_ratio_c == 3.0 and arr.actor.optim.lr == 5e-7
    assert cfg.reward_model.reward_kwargs.overlong_buffer_cfg.len == 512
    assert list(cfg.trainer.logger) == ["console", "tensorboard"]
    assert cfg.trainer.device == "cpu" and cfg.rollout.total_rollout_steps == 512000
    assert cfg.async_training.partial_rollout is False and cfg.async_training.staleness_threshold == 0.2


def test_reference_script_runs_to_the_end_of_checks(tmp_path, gsm8k_files, tiny_model_dir):
    env = script_env(tmp_path, gsm8k_files, tiny_model_dir, VERL_ASYNC_DRY_RUN="1")
    env = python_on_path(tmp_path, env, f'exec "{sys.executable}" "$@"')
    # the script's engine is vllm; the preflight refuses it where vllm is not installed (the next test)
    engine = [] if importlib.util.find_spec("vllm") else ["actor_rollout_ref.rollout.name=native"]
    proc = subprocess.run(["bash", str(SCRIPT), f"hydra.run.dir={tmp_path / 'hydra'}", *engine], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "megatron on 1x1 cpu" in proc.stdout and "64 groups (512 responses)" in proc.stdout
    assert "(64 rows)" in proc.stdout and "dry run" in proc.stdout
    # compatibility-only keys the script sets are named once each (the script sends stderr to stdout)
    assert proc.stdout.count("data.return_raw_chat=True is accepted for verl compatibility") == 1


def test_reference_script_without_vllm_stops_in_one_line(tmp_path, gsm8k_files, tiny_model_dir):
    """rollout.name=vllm without vllm installed used to fail 50-100 s later inside a Ray traceback."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed")
    env = script_env(tmp_path, gsm8k_files, tiny_model_dir, VERL_ASYNC_DRY_RUN="1")
    env = python_on_path(tmp_path, env, f'exec "{sys.executable}" "$@"')
    proc = subprocess.run(["bash", str(SCRIPT), f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:]
    line = proc.stdout.strip().splitlines()[-1]  # the script sends stderr to stdout
    assert line.startswith("config error: actor_rollout_ref.rollout.name: vllm needs vllm, which is not installed"), line
    assert "rollout.name=native" in line and "dry run" not in proc.stdout and "Traceback" not in proc.stdout


def test_cfg_job_prints_the_composed_config():
    proc = run_entry("--config-path=config", "--config-name=fully_async_ppo_megatron_trainer.yaml",
                     "actor_rollout_ref.rollout.n=3", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.actor_rollout_ref.actor.strategy == "megatron" and cfg.actor_rollout_ref.rollout.n == 3


def test_default_config_without_arguments(tmp_path):
    proc = run_entry(f"hydra.run.dir={tmp_path}", VERL_ASYNC_DRY_RUN="1", VERL_ASYNC_CACHE=str(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    assert "fsdp2 on 1x1 cpu" in proc.stdout and "builtin://train  (2000 rows)" in proc.stdout


def test_dry_run_key_stops_after_the_checks(tmp_path):
    proc = run_entry(f"hydra.run.dir={tmp_path}", "trainer.dry_run=true", VERL_ASYNC_CACHE=str(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    assert "dry run (trainer.dry_run=true" in proc.stdout and "nothing was started" in proc.stdout


@pytest.mark.parametrize(
    "arg,line",
    [
        ("+actor_rollout_ref.actor.no_such_key=1", "config error: actor_rollout_ref.actor.no_such_key: unknown key"),
        ("data.nope=1", "config error: data.nope: unknown key"),
        ("actor_rollout_ref.rollout.n=abc", "config error: actor_rollout_ref.rollout.n: expected an integer, got 'abc'"),
    ],
)
def test_bad_key_exits_2_with_one_line(tmp_path, arg, line):
    proc = run_entry(arg, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [line]
    assert "Traceback" not in proc.stdout


# --------------------------------------------------------------------------- preflight (in-process)
def _cfg(tmp_path, model_dir, train, extra=()):
    return validate(compose("fully_async_ppo_trainer", [f"actor_rollout_ref.model.path={model_dir}",
                                                        f"data.train_files={train}", "data.val_files=null", *extra]))


def test_preflight_counts_rows(tmp_path, tiny_model_dir):
    train = write_parquet(tmp_path / "t.parquet", 9)
    assert preflight(_cfg(tmp_path, tiny_model_dir, train))["rows"] == {"train": 9, "val": None}
    folder = tmp_path / "parts"
    folder.mkdir()
    write_parquet(folder / "a.parquet", 3), write_parquet(folder / "b.parquet", 4)
    assert preflight(_cfg(tmp_path, tiny_model_dir, f"[{folder},{train}]"))["rows"]["train"] == 16


@pytest.mark.parametrize(
    "case,key,words",
    [
        ("too_few_rows", "actor_rollout_ref.actor.ppo_mini_batch_size", "only 3 rows"),
        ("no_prompt_column", "data.train_files", "missing column 'prompt'"),
        ("not_parquet", "data.train_files", "not a readable parquet file"),
        ("empty_folder", "data.train_files", "holds no .parquet file"),
        ("unknown_builtin", "data.train_files", "unknown built-in dataset builtin://nope"),
        ("empty_model_folder", "actor_rollout_ref.model.path", "no config.json"),
        ("npu_missing", "trainer.device", "torch_npu"),
        # the README's one-GPU command on a CPU machine said "trainer.device: but no cuda device is available"
        ("cuda_missing", "trainer.device", "cuda is asked for, but this machine has no cuda device"),
    ],
)
def test_preflight_errors_name_the_key(tmp_path, tiny_model_dir, case, key, words):
    model, extra = tiny_model_dir, []
    train = write_parquet(tmp_path / "t.parquet", 3 if case == "too_few_rows" else 8,
                          prompt_key="question" if case == "no_prompt_column" else "prompt")
    if case == "not_parquet":
        (tmp_path / "t.parquet").write_text("not parquet")
    if case == "empty_folder":
        train = str(tmp_path / "nothing_here")
        os.makedirs(train)
    if case == "unknown_builtin":
        train = "builtin://nope"
    if case == "empty_model_folder":
        model = str(tmp_path / "empty")
        os.makedirs(model)
    if case == "npu_missing":
        pytest.importorskip("torch")
        if __import__("importlib").util.find_spec("torch_npu") is not None:
            pytest.skip("torch_npu is installed")
        extra = ["trainer.device=npu"]
    if case == "cuda_missing":
        if __import__("torch").cuda.is_available():
            pytest.skip("this machine has a CUDA device")
        extra = ["trainer.device=cuda"]
    with pytest.raises(ConfigError) as info:
        preflight(_cfg(tmp_path, model, train, extra))
    assert str(info.value).startswith(key + ": ") and words in str(info.value), str(info.value)
