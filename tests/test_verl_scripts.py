"""verl's launch scripts, as data (tests/fixtures/verl_scripts/*.yaml), through verl_async's dry run.

Each YAML is what one verl script hands to python (scripts/verl_script_overrides.py wrote it from the
script at the commit it names): the module, the `--config-name` and every override. Here every script
of verl's fully-async recipe (verl/experimental/fully_async_policy/shell/) and verl's small dense GRPO
and LoRA examples go through what `python -m recipe.fully_async_main` does with them, with the data,
model, checkpoint and reward-function paths made local:

* the trainer choice (`--config-name`, `model_engine=`) and the Hydra composition: every key the script
  sets is in the composed config with the value the script gives it;
* validation: a dense script passes, or meets the one-line refusals listed in OUTCOMES in order, each
  answered by the overrides beside it, and then passes the dry run's checks (preflight: data, model,
  reward function, resume); a MoE or vision-language script is refused in one line saying so.

docs/verl_compatibility.md is the table of the same outcomes (checked here to name every script).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from verl_async.config import ConfigError, compose, reset_compat_warnings, validate
from verl_async.config.cli import DEFAULT_CONFIG_NAME, REPO_ROOT, verl_choice
from verl_async.config.preflight import preflight

SCRIPTS = REPO_ROOT / "tests" / "fixtures" / "verl_scripts"
TABLE = REPO_ROOT / "docs" / "verl_compatibility.md"
A = "actor_rollout_ref"
_EP_GEN = "expert-parallel MoE generation is not implemented in verl_async (dense models); leave it at 1"
_EP = "MoE expert parallelism is not implemented (the Megatron trainer converts dense models); set it to 1"
_VLM = "vision-language (multi-modal) training is not implemented in verl_async; train a text-only model"
_TRT = "trtllm: TensorRT-LLM generation is not implemented; use one of: native, vllm"


def _colocated(tp: int):
    """verl's main_ppo examples share devices between training and generation; fully async gives the rollout
    devices of its own: as many per node as one engine's tensor-parallel size."""
    return (f"{A}.rollout.tensor_model_parallel_size: {tp} does not divide the rollout's 1 devices per node "
            "(rollout.n_gpus_per_node): an engine replica's devices must be on one node",
            [f"rollout.n_gpus_per_node={tp}"])


# script -> ("dense", [(the one-line refusal, the overrides that answer it), ...]) or ("refused", its one line)
OUTCOMES = {
    # the fully-async recipe's dense scripts
    "dapo_7b_math_fsdp2_4_4": ("dense", []),
    "dapo_7b_math_fsdp2_8_8": ("dense", []),
    "dapo_7b_math_fsdp2_16_16": ("dense", []),  # Ulysses sp = 4
    "dapo_7b_math_fsdp2_32_32": ("dense", []),
    "dapo_7b_math_fsdp2_64_64": ("dense", []),
    "dapo_7b_math_fsdp2_64_64_mis": ("dense", []),
    "dapo_7b_async_retool": ("dense", []),  # multi-turn tool calling, its dataset class and tool config
    # 2 nodes x (8 - 2 rollout GPUs) = 12 trainer ranks do not divide 32 * 16 responses (verl needs that too)
    "dapo_7b_math_fsdp2_4_12": ("dense", [(
        f"{A}.actor.ppo_mini_batch_size: ppo_mini_batch_size * rollout.n = 32 * 16 = 512 responses is not divisible "
        "by the trainer's data-parallel size 12 (trainer.nnodes * trainer.n_gpus_per_node = 12)",
        ["trainer.n_gpus_per_node=8"])]),
    "grpo_8b_base_math_megatron_4_4_trtllm": ("dense", [(f"{A}.rollout.name: {_TRT}", [f"{A}.rollout.name=vllm"])]),
    # the fully-async recipe's MoE and vision-language scripts
    "dapo_30b_a3b_base_math_fsdp": ("refused", f"--config-name: fully_async_dapo_trainer.yaml: no such config in "
                                               f"{REPO_ROOT / 'config'} (verl_async's: fully_async_ppo_trainer, "
                                               "fully_async_ppo_megatron_trainer; verl's ppo_trainer and "
                                               "ppo_megatron_trainer name them)"),
    "dapo_30b_a3b_math_fsdp_npu": ("refused", f"{A}.rollout.expert_parallel_size: 2: {_EP_GEN}"),
    "geo3k_qwen3vl_30b_a3b_fsdp2_32_32": ("refused", f"{A}.rollout.expert_parallel_size: 2: {_EP_GEN}"),
    "geo3k_qwen3vl_30b_megatron_6_2_npu_async": ("refused", f"{A}.actor.megatron.expert_model_parallel_size: 4: {_EP}"),
    "geo3k_qwen3vl_8b_fsdp2_16_16_npu": ("refused", f"data.image_key: 'images': {_VLM}"),
    # the script stops at its line 76 (a missing `\`): what it hands to python has no image key; the model
    # (Qwen2.5-VL) is refused by the model check (config.json has vision_config)
    "geo3k_qwen25vl_7b_megatron_4_4": ("refused", f"{A}.actor.megatron.tensor_model_parallel_size: tensor * "
                                                  "pipeline * context parallel size 2 does not divide the trainer's "
                                                  "1 devices (trainer.nnodes * trainer.n_gpus_per_node)"),
    "grpo_30b_a3b_base_math_megatron_8_8_mis_trtllm": ("refused", f"{A}.actor.megatron.expert_model_parallel_size: "
                                                                  f"4: {_EP}"),
    "grpo_30b_a3b_base_math_megatron_96_32": ("refused", f"{A}.actor.megatron.expert_model_parallel_size: 8: {_EP}"),
    "grpo_30b_a3b_base_math_megatron_96_32_mis": ("refused", f"{A}.actor.megatron.expert_model_parallel_size: 8: "
                                                             f"{_EP}"),
    "grpo_qwen35_35b_megatron_async": ("refused", f"{A}.actor.megatron.expert_model_parallel_size: 4: {_EP}"),
    "grpo_qwen3_235b_megatron_npu": ("refused", f"{A}.rollout.expert_parallel_size: 64: {_EP_GEN}"),
    "run_qwen35_35b_a3b_math_dynamic_megatron": ("refused", f"{A}.actor.megatron.expert_model_parallel_size: 8: "
                                                            f"{_EP}"),
    # verl's dense GRPO examples (verl.trainer.main_ppo, module path changed) and LoRA examples
    "examples_run_qwen3_4b_fsdp": ("dense", [_colocated(2)]),
    "examples_run_qwen3_8b_fsdp": ("dense", [_colocated(2)]),
    "examples_run_qwen2_5_32b_fsdp": ("dense", [_colocated(8)]),
    "examples_run_qwen3_8b_megatron": ("dense", [_colocated(2)]),  # model_engine=megatron
    "examples_run_qwen2-7b_math_megatron_fsdp": ("dense", [
        (f"{A}.actor.megatron.use_megatron_fsdp: True: Megatron-FSDP is not implemented in verl_async (the Megatron "
         "trainer shards its optimizer with use_distributed_optimizer); leave it false",
         [f"{A}.actor.megatron.use_megatron_fsdp=false", f"{A}.ref.megatron.use_megatron_fsdp=false"]),
        _colocated(4)]),
    "examples_run_qwen3_5_27b_fsdp": ("refused", f"data.image_key: 'images': {_VLM}"),
    "examples_run_qwen3_5_2b_openr1_fsdp": ("refused", f"data.image_key: 'images': {_VLM}"),
    "examples_lora_run_qwen3_8b_fsdp": ("dense", [_colocated(2)]),
    "examples_run_qwen2_5-3b_gsm8k_grpo_lora": ("dense", [_colocated(2)]),
}
# script -> {key: local_paths entry}: data in the shape a script's dataset class reads (the others: verl's schema)
HUB_SHAPED = {"dapo_7b_async_retool": {"data.val_files": "_aime_2024"}}
# The dry run here is on CPU, where a null micro-batch token budget means 4096 (on the scripts' GPUs it is sized to
# hold the longest sequence): a script that leaves it null with longer sequences gets one for the CPU stand-in.
CPU_BUDGET = {"grpo_8b_base_math_megatron_4_4_trtllm": [f"{A}.actor.ppo_max_token_len_per_gpu=20480"],
              "examples_run_qwen3_8b_megatron": [f"{A}.actor.ppo_max_token_len_per_gpu=4096"],
              "examples_run_qwen2-7b_math_megatron_fsdp": [f"{A}.actor.ppo_max_token_len_per_gpu=8192"]}
PATH_KEYS = ("data.train_files", "data.val_files", f"{A}.model.path", "trainer.default_local_dir")


def load(name: str) -> dict:
    return yaml.safe_load((SCRIPTS / f"{name}.yaml").read_text())


def test_every_fixture_has_an_outcome_and_a_row_in_the_table():
    names = sorted(p.stem for p in SCRIPTS.glob("*.yaml"))
    assert names == sorted(OUTCOMES)
    fully_async = [n for n in names if load(n)["source"].startswith("verl/experimental/fully_async_policy/shell/")]
    assert len(fully_async) == 21  # every script of the recipe at the commit the data names
    table = TABLE.read_text()
    for name in names:
        source = load(name)["source"]
        assert f"`{Path(source).name if name in fully_async else source}`" in table, name


def _write_parquet(path, rows: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {"prompt": [{"role": "user", "content": "What is 6 * 12? Put the answer after 'Answer:'."}],
           "data_source": "math_dapo", "ability": "MATH", "reward_model": {"style": "rule", "ground_truth": "72"},
           "extra_info": {"split": "train", "index": 0}}
    pq.write_table(pa.Table.from_pylist([row] * rows), path)
    return str(path)


@pytest.fixture(scope="module")
def local_paths(tmp_path_factory, tiny_model_dir) -> dict:
    """What each path-valued key becomes: a parquet with enough rows for one step of every script, ..."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("verl_scripts")
    scorer = root / "retool.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
                      "    return float(str(ground_truth) in solution_str)\n")
    fake_wandb = root / "site" / "wandb"  # scripts that log to wandb: a stand-in package for preflight
    fake_wandb.mkdir(parents=True)
    (fake_wandb / "__init__.py").write_text("")
    aime = root / "Maxwell-Jia" / "AIME_2024"  # as the hub ships it: ReTool's dataset class maps the columns
    aime.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"ID": f"2024-I-{i}", "Problem": f"What is {i} * 12?", "Solution": "...",
                                          "Answer": 12 * i} for i in range(1, 5)]), aime / "aime_2024_problems.parquet")
    return {
        "_aime_2024": str(aime / "aime_2024_problems.parquet"),
        "data.train_files": _write_parquet(root / "train.parquet", 512),
        "data.val_files": _write_parquet(root / "val.parquet", 4),
        f"{A}.model.path": tiny_model_dir,
        "trainer.default_local_dir": str(root / "ckpts"),
        "reward.custom_reward_function.path": str(scorer),
        "_site": str(fake_wandb.parent),
    }


def localize(overrides: list[str], paths: dict, script: str = "") -> list[str]:
    """Path-valued overrides set to the local files (HUB_SHAPED's for `script`); those a script leaves out are added."""
    paths = {**paths, **{key: paths[entry] for key, entry in HUB_SHAPED.get(script, {}).items()}}
    out, seen = [], set()
    for arg in overrides:
        prefix = arg[: len(arg) - len(arg.lstrip("+"))]
        key, eq, _ = arg[len(prefix):].partition("=")
        if eq and key in paths:
            seen.add(key)
            arg = f"{prefix}{key}={paths[key]}"
        out.append(arg)
    return out + [f"{k}={paths[k]}" for k in PATH_KEYS if k not in seen]


def entry_args(name: str, paths: dict) -> list[str]:
    """The command line the entry point gets: --config-name as the script gives it, then the overrides."""
    data = load(name)
    config = [f"--config-name={data['config_name']}"] if data["config_name"] else []
    return config + localize(data["overrides"], paths, name)


def split(args: list[str]) -> tuple[str, list[str]]:
    """(config name, overrides) after verl's trainer choice, as recipe.fully_async_main hands them to Hydra."""
    name, overrides = DEFAULT_CONFIG_NAME, []
    for arg in verl_choice(args):
        if arg.startswith("--config-name="):
            name = arg.split("=", 1)[1]
        elif not arg.startswith("-"):
            overrides.append(arg)
    return name, overrides


def _parsed(override: str):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (parsed,) = OverridesParser.create().parse_overrides([override])
    return parsed.key_or_group, parsed.value()


def assert_composed_as_written(config_name: str, overrides: list[str]) -> None:
    """Every key the script sets is in the composed config, with the value it gives."""
    cfg = compose(config_name, overrides)
    absent = object()
    for override in overrides:
        key, value = _parsed(override)
        found = OmegaConf.select(cfg, key, default=absent)
        assert found is not absent, key
        found = OmegaConf.to_container(found, resolve=True) if OmegaConf.is_config(found) else found
        assert found == value, (key, found, value)


@pytest.fixture(scope="module")
def retool_service():
    """ReTool's tool config names a SandboxFusion service at localhost:8080: the built-in one, as a user runs it."""
    import socket

    from tests.sandbox_server import _pong, sandbox_server

    if _pong("http://127.0.0.1:8080"):
        yield "http://127.0.0.1:8080/run_code"
        return
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 8080)) == 0:
            pytest.skip("port 8080 (ReTool's sandbox_fusion_url) is taken by something that is not SandboxFusion")
    with sandbox_server(8080) as url:
        yield url


@pytest.mark.parametrize("name", sorted(OUTCOMES))
def test_script_through_the_dry_run(name, local_paths, monkeypatch, capsys, request):
    if name == "dapo_7b_async_retool":  # its tool config's service must answer (the preflight builds the tool)
        request.getfixturevalue("retool_service")
    kind, expected = OUTCOMES[name]
    args = entry_args(name, local_paths)
    if kind == "refused" and expected.startswith("--config-name"):
        with pytest.raises(ConfigError) as err:
            split(args)
        assert str(err.value) == expected
        return
    config_name, overrides = split(args)
    assert_composed_as_written(config_name, overrides)
    if kind == "refused":
        with pytest.raises(ConfigError) as err:
            validate(compose(config_name, overrides))
        assert str(err.value) == expected
        return
    fixes: list[str] = []
    for line, fix in expected:  # each refusal in one line, in order; the fixes answer them
        with pytest.raises(ConfigError) as err:
            validate(compose(config_name, overrides + fixes))
        assert str(err.value) == line
        fixes += fix
    # then the dry run's checks pass: nothing is left unknown, nothing starts (the engine is native where vLLM is
    # not installed, as in tests/test_entry.py: the preflight refuses a missing engine package)
    engine = [] if importlib.util.find_spec("vllm") else [f"{A}.rollout.name=native"]
    monkeypatch.syspath_prepend(local_paths["_site"])
    preflight(validate(compose(config_name, overrides + fixes + engine + CPU_BUDGET.get(name, []))))
    printed = capsys.readouterr()
    assert "unknown key" not in printed.out + printed.err


def run_entry(args: list[str], paths: dict, tmp_path, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("VERL_ASYNC_DRY_RUN", "HYDRA_FULL_ERROR")}
    full_env.update(PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{paths['_site']}", TOKENIZERS_PARALLELISM="false", **env)
    return subprocess.run([sys.executable, "-m", "recipe.fully_async_main", *args, f"hydra.run.dir={tmp_path / 'h'}"],
                          cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=300)


def test_the_command_line_dry_run_of_a_script(tmp_path, local_paths):
    """VERL_ASYNC_DRY_RUN=1 python -m recipe.fully_async_main <the script's arguments>: a sequence-parallel dense
    script passes the checks and starts nothing; a refused one ends with its one line and status 2."""
    engine = [] if importlib.util.find_spec("vllm") else [f"{A}.rollout.name=native"]
    proc = run_entry(entry_args("dapo_7b_math_fsdp2_16_16", local_paths) + engine, local_paths, tmp_path,
                     VERL_ASYNC_DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing was started" in proc.stdout
    proc = run_entry(entry_args("dapo_7b_math_fsdp2_4_12", local_paths), local_paths, tmp_path, VERL_ASYNC_DRY_RUN="1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"config error: {OUTCOMES['dapo_7b_math_fsdp2_4_12'][1][0][0]}"]


def _mapped(name: str, paths: dict):
    config_name, overrides = split(entry_args(name, paths))
    _, expected = OUTCOMES[name]
    fixes = [o for _, fix in expected for o in fix]
    reset_compat_warnings()
    return validate(compose(config_name, overrides + fixes))


def test_dapo_script_maps_onto_verl_async_keys(local_paths):
    cfg = _mapped("dapo_7b_math_fsdp2_4_4", local_paths)
    arr = cfg.actor_rollout_ref
    assert arr.actor.strategy == arr.ref.strategy == "fsdp2" and arr.actor.fsdp_config.strategy == "fsdp2"
    assert cfg.reward_model.reward_manager == "dapo"
    assert OmegaConf.to_container(cfg.reward_model.reward_kwargs) == {
        "overlong_buffer_cfg": {"enable": True, "len": 4096, "penalty_factor": 1.0, "log": False}, "max_resp_len": 8192}
    assert arr.actor.clip_ratio_high == 0.28 and arr.actor.clip_ratio_c == 10.0 and arr.rollout.name == "vllm"
    assert arr.rollout.val_kwargs.top_p == 0.7 and arr.model.override_config.max_position_embeddings == 32768
    assert cfg.async_training.use_rollout_log_probs is True  # verl's fully-async default: bypass
    assert arr.actor.rollout_correction.enable is False and arr.actor.policy_loss.loss_mode == "vanilla"
    assert (cfg.trainer.n_gpus_per_node, cfg.rollout.n_gpus_per_node, cfg.rollout.total_rollout_steps) == (4, 4, 51200)


def test_long_response_scripts_split_sequences(local_paths):
    cfg = _mapped("dapo_7b_math_fsdp2_16_16", local_paths)
    arr = cfg.actor_rollout_ref
    assert arr.actor.ulysses_sequence_parallel_size == arr.ref.ulysses_sequence_parallel_size == 4
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 16  # 4 data-parallel shares of 4 ranks


def test_mis_script_maps_its_rollout_correction(local_paths):
    cfg = _mapped("dapo_7b_math_fsdp2_64_64_mis", local_paths)
    rc = cfg.actor_rollout_ref.actor.rollout_correction
    # bypass_mode=False: recompute the old log-probs (decoupled, three policies)
    assert cfg.async_training.use_rollout_log_probs is False is cfg.actor_rollout_ref.actor.use_rollout_log_probs
    assert (rc.enable, rc.level, rc.mode, rc.upper, rc.rs, rc.rs_level) == (True, "token", "truncate", 2.0, True,
                                                                           "geometric")
    # seq_mean_k1 "0.99_1.001": -mean(log r) in [log 0.99, log 1.001]  <=>  r_geo in [1/1.001, 1/0.99]
    assert rc.rs_lower == pytest.approx(1 / 1.001) and rc.rs_upper == pytest.approx(1 / 0.99)
    assert cfg.reward_model.reward_kwargs.max_resp_len == 28672


def test_megatron_script_maps_checkpoint_engine_and_correction(local_paths):
    cfg = _mapped("grpo_8b_base_math_megatron_4_4_trtllm", local_paths)
    actor = cfg.actor_rollout_ref.actor
    assert actor.strategy == "megatron" and actor.megatron.tensor_model_parallel_size == 2
    assert cfg.async_training.sync_bucket_size_mb == 4096 == cfg.async_training.checkpoint_engine.device_buffer_size_M
    assert (actor.rollout_correction.enable, actor.rollout_correction.level, actor.rollout_correction.upper) == (
        True, "token", 2.0)
    assert cfg.async_training.use_rollout_log_probs is False and cfg.reward_model.reward_manager == "naive"
    assert list(cfg.trainer.logger) == ["console", "wandb"] and cfg.trainer.log_val_generations == 10


def test_model_engine_megatron_example_runs_the_megatron_trainer(local_paths):
    cfg = _mapped("examples_run_qwen3_8b_megatron", local_paths)
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"
    assert cfg.ray_init.runtime_env.py_executable is None  # the example's ray_kwargs.ray_init.runtime_env
    assert cfg.rollout.n_gpus_per_node == 2 and cfg.trainer.n_gpus_per_node == 8


def test_retool_script_maps_its_reward_function(local_paths):
    cfg = _mapped("dapo_7b_async_retool", local_paths)
    assert cfg.custom_reward_function.path == local_paths["reward.custom_reward_function.path"]
    assert cfg.custom_reward_function.name == "compute_score"
    assert cfg.actor_rollout_ref.rollout.val_kwargs.n == 30 and cfg.data.filter_overlong_prompts is True


def test_retool_script_reads_its_data_through_its_dataset_class(local_paths, retool_service):
    from verl_async.config.model_source import prompt_tokenizer
    from verl_async.config.preflight import load_prompts

    cfg = _mapped("dapo_7b_async_retool", local_paths)
    assert (cfg.data.custom_cls.path, cfg.data.custom_cls.name) == (str(REPO_ROOT / "recipe/retool/retool.py"),
                                                                    "CustomRLHFDataset")  # made absolute
    tokenizer = prompt_tokenizer(cfg)
    train, val = (load_prompts(cfg, tokenizer, split) for split in ("train", "val"))
    answer_format = "\nThe answer format must be: \\boxed{'The final answer goes here.'}"
    assert type(train).__name__ == type(val).__name__ == "CustomRLHFDataset"
    assert train[0].messages[0]["content"].endswith("after 'Answer:'." + answer_format)
    assert [(item.data_source, item.ground_truth, item.agent_name) for item in val] == [
        ("aime_2024", str(12 * i), "tool_agent") for i in range(1, 5)]


def test_retool_script_runs_its_tool_agent_loop(local_paths):
    from verl_async.tools import tool_names

    mt = _mapped("dapo_7b_async_retool", local_paths).actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.max_user_turns == mt.max_assistant_turns == 16 and mt.format == "hermes"
    assert mt.tool_config_path == str(REPO_ROOT / "recipe/retool/sandbox_fusion_tool_config.yaml")  # made absolute
    assert tool_names(mt.tool_config_path, None) == ["code_interpreter"]  # ReTool's tool, its SandboxFusion URL
