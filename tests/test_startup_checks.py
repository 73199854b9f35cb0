"""Start-up checks (issue 28, items 6 and 11): what would fail hours in, or after Ray started, fails in
seconds before it, in one line naming the key or the row; the dry run runs the same checks."""

from __future__ import annotations

import pytest

from verl_async.config import ConfigError, compose, validate

A = "actor_rollout_ref"


def check(*overrides: str):
    return validate(compose("fully_async_ppo_trainer", list(overrides)))


# --------------------------------------------------------------------------- token budgets (config only)
@pytest.mark.parametrize(
    "overrides,key,words",
    [
        (["data.max_prompt_length=4000", "data.max_response_length=200", f"{A}.actor.ppo_max_token_len_per_gpu=4096"],
         f"{A}.actor.ppo_max_token_len_per_gpu",
         "4096 tokens per update micro-batch cannot hold one sequence of up to data.max_prompt_length + "
         "data.max_response_length = 4000 + 200 = 4200 tokens"),
        (["async_training.use_rollout_log_probs=false", f"{A}.rollout.log_prob_max_token_len_per_gpu=191"],
         f"{A}.rollout.log_prob_max_token_len_per_gpu", "= 128 + 64 = 192 tokens"),
        ([f"{A}.actor.use_kl_loss=true", f"{A}.ref.log_prob_max_token_len_per_gpu=1000", "data.max_prompt_length=999",
          "data.max_response_length=2"], f"{A}.ref.log_prob_max_token_len_per_gpu", "raise it to at least 1001"),
        ([f"{A}.rollout.response_length=100"], f"{A}.actor.ppo_max_token_len_per_gpu", None),  # fits: no error
    ],
)
def test_longest_sequence_must_fit_every_token_budget_in_use(overrides, key, words):
    """The trainer packs whole sequences into micro-batches of at most the budget: a longer one fails the update."""
    if words is None:
        check(*overrides, f"{A}.actor.ppo_max_token_len_per_gpu=228")  # 128 + 100: exactly fits
        with pytest.raises(ConfigError, match=r"128 \+ 100 = 228 tokens"):
            check(*overrides, f"{A}.actor.ppo_max_token_len_per_gpu=227")
        return
    with pytest.raises(ConfigError) as info:
        check(*overrides)
    assert info.value.key == key and words in info.value.reason, str(info.value)


def test_a_null_budget_on_cpu_is_4096_tokens(tmp_path, tiny_model_dir):
    """null sizes the budget to the device on an accelerator (never below the longest sequence), but means 4096 on
    CPU: the preflight applies validate()'s rule to that value."""
    from verl_async.config.preflight import check_cpu_token_budgets

    cfg = check("data.max_prompt_length=4000", "data.max_response_length=200")  # null: validate() cannot know
    with pytest.raises(ConfigError) as info:
        check_cpu_token_budgets(cfg)
    assert info.value.key == f"{A}.actor.ppo_max_token_len_per_gpu"
    assert info.value.reason.startswith("null (4096 tokens on CPU) per update micro-batch cannot hold one sequence of "
                                        "up to data.max_prompt_length + data.max_response_length = 4000 + 200 = 4200")
    check_cpu_token_budgets(check("data.max_prompt_length=4000", "data.max_response_length=96"))  # 4096: fits
    check_cpu_token_budgets(check("data.max_prompt_length=4000", "data.max_response_length=200", "trainer.device=cuda",
                                  "async_training.sync_transport=object_store"))


def test_budgets_not_in_use_are_not_checked():
    # bypass mode (no old log-prob recompute), no KL (no reference), fixed micro-batches: nothing packs by tokens
    check("data.max_prompt_length=5000", f"{A}.actor.use_dynamic_bsz=false",
          f"{A}.rollout.log_prob_max_token_len_per_gpu=10", f"{A}.ref.log_prob_max_token_len_per_gpu=10")
    check("data.max_prompt_length=5000", "debug.rollout_only=true")  # no trainer at all


# --------------------------------------------------------------------------- preflight (in-process)
def row(content: str = "Natalia sold 48 clips. How many?", data_source: str = "openai/gsm8k") -> dict:
    return {"prompt": [{"role": "user", "content": content}], "data_source": data_source, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "train", "index": 0}}


def parquet(path, rows: list) -> str:
    from verl_async.data import write_rows

    return write_rows(rows, str(path))


def cfg_for(tmp_path, model, train, *overrides: str):
    return check(f"{A}.model.path={model}", f"data.train_files={train}", "data.val_files=null",
                 f"trainer.default_local_dir={tmp_path / 'run'}", *overrides)


def preflight_error(cfg) -> ConfigError:
    from verl_async.config.preflight import preflight

    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    return info.value


def test_overlong_prompt_names_the_file_the_row_and_its_length(tmp_path, tiny_model_dir):
    """data.truncation=error used to surface after Ray and the trainer started, inside an ActorDiedError."""
    train = parquet(tmp_path / "train.parquet", [row()] * 2 + [row("x" * 200)] + [row()] * 7)
    err = preflight_error(cfg_for(tmp_path, tiny_model_dir, train))
    # byte tokenizer: <|im_start|> + "user\n" (5) + 200 bytes + <|im_end|> + "\n" + <|im_start|> + "assistant\n" (10)
    assert err.key == "data.train_files"
    assert err.reason.startswith(f"{train}: row 2: prompt is 219 tokens, longer than data.max_prompt_length=128"), err


def test_overlong_prompts_filtered_or_truncated_pass_and_are_counted(tmp_path, tiny_model_dir):
    from verl_async.config.preflight import preflight
    from verl_async.config.summary import describe

    train = parquet(tmp_path / "train.parquet", [row()] * 8 + [row("x" * 200)] * 2)
    cfg = cfg_for(tmp_path, tiny_model_dir, train, "data.filter_overlong_prompts=true")
    facts = preflight(cfg)
    assert facts["rows"]["train"] == 10 and facts["prompts"]["train"] == 8
    assert "(10 rows, 8 used (skipped or filtered: 2))" in describe(cfg, facts)
    assert preflight(cfg_for(tmp_path, tiny_model_dir, train, "data.truncation=left"))["prompts"]["train"] == 10
    err = preflight_error(cfg_for(tmp_path, tiny_model_dir, train, "data.filter_overlong_prompts=true",
                                  f"{A}.actor.ppo_mini_batch_size=9"))
    assert err.key == f"{A}.actor.ppo_mini_batch_size" and "has only 8 rows (of 10 read" in err.reason, err


def test_missing_engine_package_is_named(tmp_path, tiny_model_dir):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed")
    train = parquet(tmp_path / "train.parquet", [row()] * 8)
    err = preflight_error(cfg_for(tmp_path, tiny_model_dir, train, f"{A}.rollout.name=vllm"))
    assert err.key == f"{A}.rollout.name" and err.reason.startswith("vllm needs vllm, which is not installed"), err
    assert err.reason.endswith(f"or use {A}.rollout.name=native (the built-in engine)"), err


def test_missing_megatron_core_is_named(tmp_path, tiny_model_dir, monkeypatch):
    import verl_async.optional as optional

    monkeypatch.setattr(optional, "is_installed", lambda dependency: dependency is not optional.MEGATRON)
    train = parquet(tmp_path / "train.parquet", [row()] * 8)
    cfg = validate(compose("fully_async_ppo_megatron_trainer", [f"{A}.model.path={tiny_model_dir}",
                                                                f"data.train_files={train}", "data.val_files=null"]))
    err = preflight_error(cfg)
    assert err.key == f"{A}.actor.strategy" and err.reason.startswith("megatron needs megatron.core, which is not"), err


def test_custom_reward_function_name_and_import_are_checked(tmp_path, tiny_model_dir):
    """A wrong custom_reward_function.name used to fail after Ray started."""
    train = parquet(tmp_path / "train.parquet", [row()] * 8)
    scorer = tmp_path / "my_reward.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    err = preflight_error(cfg_for(tmp_path, tiny_model_dir, train, f"custom_reward_function.path={scorer}",
                                  "custom_reward_function.name=compute_scor"))
    assert err.key == "custom_reward_function.name"
    assert err.reason == f"'compute_scor': no function of that name in '{scorer}'", err
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    err = preflight_error(cfg_for(tmp_path, tiny_model_dir, train, f"custom_reward_function.path={broken}"))
    assert err.key == "custom_reward_function.path" and "importing it failed" in err.reason
    assert "no_such_module_here" in err.reason, err
    from verl_async.config.preflight import preflight

    preflight(cfg_for(tmp_path, tiny_model_dir, train, f"custom_reward_function.path={scorer}"))  # the right name


def test_data_source_without_a_scorer_names_its_first_row(tmp_path, tiny_model_dir):
    train = parquet(tmp_path / "train.parquet", [row()] * 5 + [row(data_source="my/task")] * 3)
    err = preflight_error(cfg_for(tmp_path, tiny_model_dir, train))
    assert err.key == "data.train_files" and err.reason.startswith(f"{train}:5: no reward function for "
                                                                   "data_source='my/task'"), err


# --------------------------------------------------------------------------- an HF id without a hub
README_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


@pytest.fixture
def empty_hf_cache(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    return constants


def test_hub_id_offline_and_not_cached_says_how_to_provide_a_folder(empty_hf_cache, monkeypatch):
    from verl_async.config.model_source import check_model_source

    monkeypatch.setattr(empty_hf_cache, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as info:
        check_model_source(README_MODEL)
    err = info.value
    assert err.key == f"{A}.model.path" and "not in the HF cache" in err.reason and "HF_HUB_OFFLINE=1" in err.reason
    assert f"hf download {README_MODEL} --local-dir DIR" in err.reason and f"{A}.model.path=DIR" in err.reason


def test_unreachable_hub_is_found_in_one_short_request(empty_hf_cache, monkeypatch):
    """transformers retries each file for ~50 s in every worker; the preflight asks once."""
    import time

    from verl_async.config.model_source import check_model_source

    monkeypatch.setattr(empty_hf_cache, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(empty_hf_cache, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        check_model_source(README_MODEL)
    assert time.monotonic() - t0 < 10
    assert "is not reachable" in info.value.reason and "Connection refused" in info.value.reason, info.value


def cache_repo(cache: str, repo_id: str, folder: str) -> None:
    """`folder` as the HF cache holds a downloaded `repo_id` (snapshots/<commit>, refs/main)."""
    import os
    import shutil

    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, os.path.join(repo, "snapshots", "0" * 40))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("0" * 40)


def test_hub_id_in_the_local_cache_needs_no_hub(empty_hf_cache, monkeypatch, tiny_model_dir):
    from verl_async.config.model_source import check_model_source, hub_problem

    monkeypatch.setattr(empty_hf_cache, "HF_HUB_OFFLINE", True)
    cache_repo(empty_hf_cache.HF_HUB_CACHE, "local/tiny", tiny_model_dir)
    assert hub_problem("local/tiny") is None
    check_model_source("local/tiny")
    assert hub_problem("local/other") is not None


def test_cached_hub_id_without_a_hub_goes_offline(empty_hf_cache, monkeypatch, tiny_model_dir, capsys):
    """Cached, but HF_HUB_OFFLINE unset and no hub: each from_pretrained retried the hub for minutes (148 s for a
    tokenizer and a config, measured) in the driver and again in every worker, before using the cache."""
    import os

    from verl_async.config.model_source import hub_problem

    monkeypatch.setattr(empty_hf_cache, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(empty_hf_cache, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    cache_repo(empty_hf_cache.HF_HUB_CACHE, "local/tiny", tiny_model_dir)
    assert hub_problem("local/tiny") is None
    assert os.environ["HF_HUB_OFFLINE"] == "1" and empty_hf_cache.HF_HUB_OFFLINE is True  # Ray workers inherit it
    assert "is not reachable" in capsys.readouterr().out


# --------------------------------------------------------------------------- the entry point: one line, no Ray
def entry(*args: str, **env: str):
    from tests.test_entry import run_entry

    return run_entry(*args, **env)


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_dry_run_does_the_checks_it_reports(tmp_path, tiny_model_dir):
    """The dry run said "config, device and data are valid" for data that then failed inside Ray."""
    train = parquet(tmp_path / "train.parquet", [row()] * 2 + [row("x" * 200)] + [row()] * 7)
    proc = entry(f"{A}.model.path={tiny_model_dir}", f"data.train_files={train}", "data.val_files=null",
                 f"hydra.run.dir={tmp_path / 'hydra'}", VERL_ASYNC_DRY_RUN="1")
    assert one_error_line(proc).startswith(f"config error: data.train_files: {train}: row 2: prompt is 219 tokens")
    assert "dry run" not in proc.stdout


def test_readme_model_without_hub_stops_before_anything_starts(tmp_path):
    """The README's quickstart id with no local copy and no hub: one line in seconds, no run folder, no Ray."""
    run_dir = tmp_path / "run"
    proc = entry(f"{A}.model.path={README_MODEL}", f"trainer.default_local_dir={run_dir}",
                 f"hydra.run.dir={tmp_path / 'hydra'}", HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    line = one_error_line(proc)
    assert line.startswith(f"config error: {A}.model.path: {README_MODEL} is not a local folder and not in the HF cache")
    assert not run_dir.exists()


# --------------------------------------------------------------------------- what the summary says (issue 42)
def test_a_command_without_async_keys_is_told_it_runs_fully_async_and_how_to_run_synchronously():
    """verl's ordinary GRPO scripts set no async_training key and silently ran with staleness 0.5, partial rollout
    and a sync every 2 steps."""
    from verl_async.config.summary import SYNC_HINT, describe

    cfg = check()
    assert SYNC_HINT in describe(cfg, {"async_keys_given": False}).splitlines()
    assert SYNC_HINT == ("schedule     fully async (no async_training.* key given); for verl's synchronous schedule "
                         "add async_training.staleness_threshold=0 async_training.trigger_parameter_sync_step=1")
    assert SYNC_HINT not in describe(cfg, {"async_keys_given": True})
    on_policy = check("async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1")
    assert SYNC_HINT not in describe(on_policy, {"async_keys_given": False})
