"""actor_rollout_ref.rollout.multi_turn.*: verl's names and defaults, one-line errors naming key and file,
and verl's ReTool launch script (dapo_7b_async_retool.sh) composing here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_async.config import ConfigError, compose, validate
from verl_async.config.cli import REPO_ROOT

KEY = "actor_rollout_ref.rollout.multi_turn"
CALCULATOR = str(REPO_ROOT / "config" / "tool_config" / "calculator_tool_config.yaml")


def check(*overrides: str):
    return validate(compose(overrides=list(overrides)))


def test_defaults_are_verls():
    mt = check().actor_rollout_ref.rollout.multi_turn
    assert dict(mt) == {
        "enable": False, "max_assistant_turns": None, "max_user_turns": None, "max_parallel_calls": 1,
        "max_tool_response_length": 256, "tool_response_truncate_side": "middle", "tool_config_path": None,
        "function_tool_path": None, "format": "hermes", "tool_timeout_s": 60.0,
        "use_inference_chat_template": False, "tokenization_sanity_check_mode": "strict", "num_repeat_rollouts": None,
    }


def test_enabled_with_the_shipped_tool_configs():
    mt = check(f"{KEY}.enable=true", f"{KEY}.tool_config_path=config/tool_config/python_tool_config.yaml",
               f"{KEY}.max_assistant_turns=4").actor_rollout_ref.rollout.multi_turn
    assert mt.tool_config_path == str(REPO_ROOT / "config/tool_config/python_tool_config.yaml")  # made absolute
    assert mt.max_assistant_turns == 4


@pytest.mark.parametrize("override, line", [
    (f"{KEY}.format=gpt-oss", f"{KEY}.format: unknown value 'gpt-oss'; expected one of: hermes"),
    (f"{KEY}.tool_response_truncate_side=top", f"{KEY}.tool_response_truncate_side: unknown value 'top'"),
    (f"{KEY}.max_assistant_turns=0", f"{KEY}.max_assistant_turns: must be >= 1, got 0"),
    (f"{KEY}.max_tool_respons_length=9", f"{KEY}.max_tool_respons_length: unknown key (did you mean "
                                         f"{KEY}.max_tool_response_length?)"),
])
def test_bad_values_name_the_key(override, line):
    with pytest.raises(ConfigError) as err:
        check(override)
    assert str(err.value).startswith(line)


def test_missing_tool_config_names_key_and_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        check(f"{KEY}.enable=true", f"{KEY}.tool_config_path={tmp_path}/tools.yaml")
    assert str(err.value) == f"{KEY}.tool_config_path: no such file: {tmp_path}/tools.yaml"


def test_unknown_tool_class_names_key_file_and_entry(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: my_pkg.tools.WeatherTool\n    config: {type: native}\n")
    with pytest.raises(ConfigError) as err:
        check(f"{KEY}.enable=true", f"{KEY}.tool_config_path={path}")
    assert str(err.value).startswith(f"{KEY}.tool_config_path: {path}: tools[0].class_name: unknown tool class "
                                     "'my_pkg.tools.WeatherTool' (ModuleNotFoundError")
    assert "\n" not in str(err.value)


def test_duplicate_tool_name_across_files_names_both(tmp_path):
    functions = tmp_path / "fns.py"
    functions.write_text(textwrap.dedent('''
        from verl_async.tools import function_tool

        @function_tool("calculator")
        def calc(expression: str) -> str:
            """Another calculator.

            Args:
                expression: what to compute.
            """
            return expression
    '''))
    try:
        with pytest.raises(ConfigError) as err:
            check(f"{KEY}.enable=true", f"{KEY}.tool_config_path={CALCULATOR}", f"{KEY}.function_tool_path={functions}")
    finally:
        from verl_async.tools.function_tool import FUNCTION_TOOL_REGISTRY

        FUNCTION_TOOL_REGISTRY.pop("calculator", None)
    assert str(err.value).startswith(f"{KEY}.function_tool_path: duplicate tool name 'calculator': "
                                     f"{CALCULATOR}: tools[0] and {functions}: calc")


def test_tool_files_are_not_read_while_multi_turn_is_off(tmp_path):
    cfg = check(f"{KEY}.tool_config_path={tmp_path}/absent.yaml")
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable is False


def test_pdsr_is_refused_with_multi_turn():
    with pytest.raises(ConfigError, match=r"^async_training\.long_tail\.enable: P-DSR .*multi_turn\.enable=true"):
        check(f"{KEY}.enable=true", f"{KEY}.tool_config_path={CALCULATOR}", "async_training.long_tail.enable=true",
              "rollout.n_gpus_per_node=2")


def test_verls_newer_reward_spelling_is_copied(tmp_path):
    fn = tmp_path / "score.py"
    fn.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    cfg = check(f"reward.custom_reward_function.path={fn}", "reward.custom_reward_function.name=my_score",
                "reward.reward_manager.name=dapo", "reward.num_workers=2")
    assert cfg.custom_reward_function.path == str(fn) and cfg.custom_reward_function.name == "my_score"
    assert cfg.reward_model.reward_manager == "dapo" and cfg.reward_model.num_workers == 2


# ------------------------------------------------------------------ verl's ReTool launch script
RETOOL = REPO_ROOT / "scripts" / "dapo_7b_async_retool.sh"


def retool_argv(tmp_path, model_dir) -> list[str]:
    """The argv the script hands to python3 (a stand-in records it), with its data and model folders made."""
    row = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "1+1? Use the code interpreter."}],
           "ability": "MATH", "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0},
           "agent_name": "tool_agent"}
    for folder in ("BytedTsinghua-SIA/DAPO-Math-17k", "Maxwell-Jia/AIME_2024", "yentinglin/aime_2025"):
        (tmp_path / "dataset" / folder).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist([row] * 16), tmp_path / "dataset" / folder / "train.parquet")
    ckpt = tmp_path / "checkpoint" / "multiturn-sft-qwen-2.5-7b-instruct"
    ckpt.mkdir(parents=True)
    (ckpt / "global_step_372").symlink_to(model_dir)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGV_OUT"\n')
    (bindir / "python3").chmod(0o755)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "DATA_ROOT": str(tmp_path), "HDFS_ROOT": str(tmp_path),
           "ARGV_OUT": str(tmp_path / "argv")}
    subprocess.run(["bash", str(RETOOL)], cwd=REPO_ROOT, env=env, check=True, capture_output=True, timeout=60)
    return (tmp_path / "argv").read_text().split("\0")[:-1]


def test_retool_script_composes_and_asks_only_for_what_we_lack(tmp_path, tiny_model_dir):
    argv = retool_argv(tmp_path, tiny_model_dir)
    assert argv[:2] == ["-m", "recipe.fully_async_main"]
    overrides = argv[2:]
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides=overrides))
    assert str(err.value) == ("actor_rollout_ref.actor.ulysses_sequence_parallel_size: 4: Ulysses sequence parallelism "
                              "is not implemented (FSDP2 shards parameters only); set it to 1")
    sp1 = [o.replace("ulysses_sequence_parallel_size=4", "ulysses_sequence_parallel_size=1") for o in overrides]
    cfg = validate(compose(overrides=sp1))
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.max_user_turns == mt.max_assistant_turns == 16 and mt.format == "hermes"
    assert mt.tool_config_path == str(REPO_ROOT / "recipe/retool/sandbox_fusion_tool_config.yaml")
    assert cfg.custom_reward_function.path == "recipe/retool/retool.py"
    assert cfg.custom_reward_function.name == "compute_score"
    assert cfg.actor_rollout_ref.rollout.n == 16 and cfg.data.max_response_length == 16384
    assert cfg.async_training.partial_rollout is True and cfg.async_training.trigger_parameter_sync_step == 4


def test_retool_reward_rewards_boxed_answers_and_tool_use():
    sys.path.insert(0, str(REPO_ROOT))
    from recipe.retool.retool import compute_score

    assert compute_score("math_dapo", "so \\boxed{2}", "2", {"num_turns": 3})["score"] == 1.0
    assert compute_score("math_dapo", "so \\boxed{3}", "2", {"num_turns": 2})["score"] == -1.0
    assert compute_score("math_dapo", "so \\boxed{3}", "2", {"num_turns": 8})["score"] == pytest.approx(-0.7)
    assert compute_score("math_dapo", "so \\boxed{3}", "2", {"num_turns": 40})["score"] == -0.6
