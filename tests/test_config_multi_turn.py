"""actor_rollout_ref.rollout.multi_turn.*: verl's names and defaults, one-line errors naming key and file.

verl's ReTool launch script itself (its arguments: tests/fixtures/verl_scripts/dapo_7b_async_retool.yaml) is run in
tests/test_verl_scripts.py; its reward function (recipe/retool/retool.py) is tested here."""

from __future__ import annotations

import sys
import textwrap

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


# ------------------------------------------------------------------ ReTool (its script: tests/test_verl_scripts.py)
def test_retool_reward_rewards_boxed_answers_and_tool_use():
    sys.path.insert(0, str(REPO_ROOT))
    from recipe.retool.retool import compute_score

    assert compute_score("math_dapo", "so \\boxed{2}", "2", {"num_turns": 3})["score"] == 1.0
    assert compute_score("math_dapo", "so \\boxed{3}", "2", {"num_turns": 2})["score"] == -1.0
    assert compute_score("math_dapo", "so \\boxed{3}", "2", {"num_turns": 8})["score"] == pytest.approx(-0.7)
    assert compute_score("math_dapo", "so \\boxed{3}", "2", {"num_turns": 40})["score"] == -0.6


def test_prompts_are_rendered_with_the_tool_schemas_only_when_multi_turn_is_on():
    from verl_async.tools.tool_registry import multi_turn_tool_schemas

    on = check(f"{KEY}.enable=true", f"{KEY}.tool_config_path={CALCULATOR}").actor_rollout_ref.rollout.multi_turn
    (schema,) = multi_turn_tool_schemas(on)
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert multi_turn_tool_schemas(check(f"{KEY}.tool_config_path={CALCULATOR}").actor_rollout_ref.rollout.multi_turn) is None
