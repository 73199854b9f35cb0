"""verl 0.9's dense fully-async launch scripts (tests/fixtures/verl09/, verbatim; SOURCE.md) run unchanged.

Each script runs under bash with a stand-in `python`/`python3` that records its argv. The
overrides, with the data, model, checkpoint and reward-function paths made local, go to
`python -m recipe.fully_async_main`: through `--cfg job` as written (they compose), then through
the dry run's checks (validation and preflight pass; nothing starts). A script that asks for
something verl_async does not implement is refused in one line naming the key; REFUSALS lists
those lines in the order they come and the override that answers each, after which the
script passes the dry run too. The ReTool script keeps its dataset class (data.custom_cls, our
recipe/retool/retool.py at the path it names), which reads its AIME data as the hub ships them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from verl_async.config import ConfigError, compose, reset_compat_warnings, validate
from verl_async.config.cli import REPO_ROOT
from verl_async.config.preflight import preflight

SCRIPTS = REPO_ROOT / "tests" / "fixtures" / "verl09"
ENTRY = ["-m", "verl.experimental.fully_async_policy.fully_async_main"]
_SP = "Ulysses sequence parallelism is not implemented (FSDP2 shards parameters only); set it to 1"
_SP_FIX = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
           "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1"]
_SP_REFUSAL = [(f"actor_rollout_ref.actor.ulysses_sequence_parallel_size: 4: {_SP}", _SP_FIX)]
# script -> [(the one-line refusal, the overrides that answer it)], in the order validation meets them
REFUSALS = {
    "dapo_7b_math_fsdp2_4_4": [],
    "dapo_7b_math_fsdp2_8_8": [],
    # 2 nodes x (8 - 2 rollout GPUs) = 12 trainer ranks do not divide 32 * 16 responses (verl needs that too)
    "dapo_7b_math_fsdp2_4_12": [(
        "actor_rollout_ref.actor.ppo_mini_batch_size: ppo_mini_batch_size * rollout.n = 32 * 16 = 512 responses is "
        "not divisible by the trainer's data-parallel size 12 (trainer.nnodes * trainer.n_gpus_per_node = 12)",
        ["trainer.n_gpus_per_node=8"])],
    "dapo_7b_math_fsdp2_16_16": _SP_REFUSAL,
    "dapo_7b_math_fsdp2_32_32": _SP_REFUSAL,
    "dapo_7b_math_fsdp2_64_64": _SP_REFUSAL,
    "dapo_7b_math_fsdp2_64_64_mis": _SP_REFUSAL,
    "grpo_8b_base_math_megatron_4_4_trtllm": [(
        "actor_rollout_ref.rollout.name: trtllm: TensorRT-LLM generation is not implemented; use one of: native, vllm",
        ["actor_rollout_ref.rollout.name=vllm"])],
    # multi-turn tool calling runs (its tool config and dataset class: recipe/retool/, the sandboxed interpreter);
    # Ulysses is refused
    "dapo_7b_async_retool": [
        (f"actor_rollout_ref.actor.ulysses_sequence_parallel_size: 4: {_SP}",
         ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"]),
    ],
}
# script -> {key: local_paths entry}: data in the shape a script's dataset class reads (the others: verl's schema)
HUB_SHAPED = {"dapo_7b_async_retool": {"data.val_files": "_aime_2024"}}
# The dry run here is on CPU, where a null micro-batch token budget means 4096 (on the scripts' GPUs it is sized to
# hold the longest sequence): a script that leaves it null with longer sequences gets one for the CPU stand-in.
CPU_BUDGET = {"grpo_8b_base_math_megatron_4_4_trtllm": ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480"]}


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

    root = tmp_path_factory.mktemp("verl09")
    scorer = root / "retool.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
                      "    return float(str(ground_truth) in solution_str)\n")
    fake_wandb = root / "site" / "wandb"  # the trtllm script logs to wandb: a stand-in package for preflight
    fake_wandb.mkdir(parents=True)
    (fake_wandb / "__init__.py").write_text("")
    aime = root / "Maxwell-Jia" / "AIME_2024"  # as the hub ships it: ReTool's dataset class maps the columns
    aime.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"ID": f"2024-I-{i}", "Problem": f"What is {i} * 12?", "Solution": "...",
                                          "Answer": 12 * i} for i in range(1, 5)]), aime / "aime_2024_problems.parquet")
    return {
        "_aime_2024": str(aime / "aime_2024_problems.parquet"),
        "data.train_files": _write_parquet(root / "dapo-math-17k.parquet", 128),
        "data.val_files": _write_parquet(root / "aime-2024.parquet", 4),
        "actor_rollout_ref.model.path": tiny_model_dir,
        "trainer.default_local_dir": str(root / "ckpts"),
        "reward.custom_reward_function.path": str(scorer),
        "_site": str(fake_wandb.parent),
    }


def script_argv(name: str, tmp_path) -> list[str]:
    """The argv the script hands to python (after the module name), captured by a stand-in."""
    bindir, out = tmp_path / "bin", tmp_path / "argv"
    bindir.mkdir(exist_ok=True)
    for exe in ("python", "python3"):
        (bindir / exe).write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGV_OUT"\n')
        (bindir / exe).chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}", ARGV_OUT=str(out), HOME=str(tmp_path))
    subprocess.run(["bash", str(SCRIPTS / f"{name}.sh")], cwd=tmp_path, env=env, check=True, capture_output=True,
                   timeout=60)
    argv = out.read_text().split("\0")[:-1]
    assert argv[:2] == ENTRY, argv[:2]
    return argv[2:]


def localize(args: list[str], paths: dict, script: str = "") -> list[str]:
    """Path-valued overrides set to the local files (HUB_SHAPED's for `script`); those a script leaves out are added."""
    paths = {**paths, **{key: paths[entry] for key, entry in HUB_SHAPED.get(script, {}).items()}}
    out, seen = [], set()
    for arg in args:
        key, eq, _ = arg.lstrip("+").partition("=")
        if eq and key in paths:
            seen.add(key)
            arg = f"{arg[: len(arg) - len(arg.lstrip('+'))]}{key}={paths[key]}"
        out.append(arg)
    missing = [k for k in ("data.train_files", "data.val_files", "actor_rollout_ref.model.path",
                           "trainer.default_local_dir") if k not in seen]
    return out + [f"{k}={paths[k]}" for k in missing]


def split_argv(args: list[str]) -> tuple[str, list[str]]:
    """(config name, overrides) as recipe.fully_async_main would see them."""
    name, overrides = "fully_async_ppo_trainer", []
    for arg in args:
        if arg.startswith("--config-name="):
            name = arg.split("=", 1)[1]
        elif not arg.startswith("-"):
            overrides.append(arg)
    return name, overrides


def run_entry(args: list[str], paths: dict, tmp_path, flags: tuple = (), **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("VERL_ASYNC_DRY_RUN", "HYDRA_FULL_ERROR")}
    full_env.update(PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{paths['_site']}", TOKENIZERS_PARALLELISM="false", **env)
    return subprocess.run([sys.executable, "-m", "recipe.fully_async_main", *args, f"hydra.run.dir={tmp_path / 'hydra'}",
                           *flags],
                          cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=180)


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


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_script_composes_and_passes_the_dry_run(name, tmp_path, local_paths, monkeypatch, capsys, request):
    if name == "dapo_7b_async_retool":  # its tool config's service must answer (the preflight builds the tool)
        request.getfixturevalue("retool_service")
    args = localize(script_argv(name, tmp_path), local_paths, name)
    # as written: it composes (--cfg job prints the config, verl 0.9's keys included)
    proc = run_entry(args, local_paths, tmp_path, ("--cfg", "job"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = OmegaConf.create(proc.stdout)
    config_name, overrides = split_argv(args)
    absent = object()
    for override in overrides:
        key = override.lstrip("+").partition("=")[0]
        assert OmegaConf.select(printed, key, default=absent) is not absent, key
    # validation meets each refusal in one line, in order; the fixes answer them
    fixes: list[str] = []
    for line, fix in REFUSALS[name]:
        with pytest.raises(ConfigError) as err:
            validate(compose(config_name, overrides + fixes))
        assert str(err.value) == line
        fixes += fix
    # ... and then the dry run's checks pass: nothing is left unknown, nothing starts (in this process: the
    # command line itself went through the entry point above; the engine is native where vLLM is not installed,
    # as in tests/test_entry.py, since the preflight refuses a missing engine package)
    engine = [] if importlib.util.find_spec("vllm") else ["actor_rollout_ref.rollout.name=native"]
    monkeypatch.syspath_prepend(local_paths["_site"])
    preflight(validate(compose(config_name, overrides + fixes + engine + CPU_BUDGET.get(name, []))))
    printed = capsys.readouterr()
    assert "unknown key" not in printed.out + printed.err


def test_a_refusal_is_one_line_on_the_command_line(tmp_path, local_paths):
    args = localize(script_argv("dapo_7b_math_fsdp2_16_16", tmp_path), local_paths)
    proc = run_entry(args, local_paths, tmp_path, VERL_ASYNC_DRY_RUN="1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"config error: {REFUSALS['dapo_7b_math_fsdp2_16_16'][0][0]}"]


def _mapped(name: str, tmp_path, paths: dict):
    config_name, overrides = split_argv(localize(script_argv(name, tmp_path), paths, name))
    fixes = [o for _, fix in REFUSALS[name] for o in fix]
    reset_compat_warnings()
    return validate(compose(config_name, overrides + fixes))


def test_dapo_script_maps_onto_verl_async_keys(tmp_path, local_paths):
    cfg = _mapped("dapo_7b_math_fsdp2_4_4", tmp_path, local_paths)
    arr = cfg.actor_rollout_ref
    assert arr.actor.strategy == arr.ref.strategy == "fsdp2" and arr.actor.fsdp_config.strategy == "fsdp2"
    assert cfg.reward_model.reward_manager == "dapo"
    assert OmegaConf.to_container(cfg.reward_model.reward_kwargs) == {
        "overlong_buffer_cfg": {"enable": True, "len": 4096, "penalty_factor": 1.0, "log": False}, "max_resp_len": 8192}
    assert arr.actor.clip_ratio_high == 0.28 and arr.actor.clip_ratio_c == 10.0 and arr.rollout.name == "vllm"
    assert arr.rollout.val_kwargs.top_p == 0.7 and arr.model.override_config.max_position_embeddings == 32768
    assert cfg.async_training.use_rollout_log_probs is True  # verl's fully-async default: bypass
    assert arr.actor.rollout_correction.enable is False
    assert (cfg.trainer.n_gpus_per_node, cfg.rollout.n_gpus_per_node, cfg.rollout.total_rollout_steps) == (4, 4, 51200)


def test_mis_script_maps_its_rollout_correction(tmp_path, local_paths):
    cfg = _mapped("dapo_7b_math_fsdp2_64_64_mis", tmp_path, local_paths)
    rc = cfg.actor_rollout_ref.actor.rollout_correction
    # bypass_mode=False: recompute the old log-probs (decoupled, three policies)
    assert cfg.async_training.use_rollout_log_probs is False is cfg.actor_rollout_ref.actor.use_rollout_log_probs
    assert (rc.enable, rc.level, rc.mode, rc.upper, rc.rs, rc.rs_level) == (True, "token", "truncate", 2.0, True,
                                                                           "geometric")
    # seq_mean_k1 "0.99_1.001": -mean(log r) in [log 0.99, log 1.001]  <=>  r_geo in [1/1.001, 1/0.99]
    assert rc.rs_lower == pytest.approx(1 / 1.001) and rc.rs_upper == pytest.approx(1 / 0.99)
    assert cfg.reward_model.reward_kwargs.max_resp_len == 28672


def test_megatron_script_maps_checkpoint_engine_and_correction(tmp_path, local_paths):
    cfg = _mapped("grpo_8b_base_math_megatron_4_4_trtllm", tmp_path, local_paths)
    actor = cfg.actor_rollout_ref.actor
    assert actor.strategy == "megatron" and actor.megatron.tensor_model_parallel_size == 2
    assert cfg.async_training.sync_bucket_size_mb == 4096 == cfg.async_training.checkpoint_engine.device_buffer_size_M
    assert (actor.rollout_correction.enable, actor.rollout_correction.level, actor.rollout_correction.upper) == (
        True, "token", 2.0)
    assert cfg.async_training.use_rollout_log_probs is False and cfg.reward_model.reward_manager == "naive"
    assert list(cfg.trainer.logger) == ["console", "wandb"] and cfg.trainer.log_val_generations == 10


def test_retool_script_maps_its_reward_function(tmp_path, local_paths):
    cfg = _mapped("dapo_7b_async_retool", tmp_path, local_paths)
    assert cfg.custom_reward_function.path == local_paths["reward.custom_reward_function.path"]
    assert cfg.custom_reward_function.name == "compute_score"
    assert cfg.actor_rollout_ref.rollout.val_kwargs.n == 30 and cfg.data.filter_overlong_prompts is True


def test_retool_script_reads_its_data_through_its_dataset_class(tmp_path, local_paths, retool_service):
    from verl_async.config.model_source import prompt_tokenizer
    from verl_async.config.preflight import load_prompts

    cfg = _mapped("dapo_7b_async_retool", tmp_path, local_paths)
    assert (cfg.data.custom_cls.path, cfg.data.custom_cls.name) == (str(REPO_ROOT / "recipe/retool/retool.py"),
                                                                    "CustomRLHFDataset")  # made absolute
    tokenizer = prompt_tokenizer(cfg)
    train, val = (load_prompts(cfg, tokenizer, split) for split in ("train", "val"))
    answer_format = "\nThe answer format must be: \\boxed{'The final answer goes here.'}"
    assert type(train).__name__ == type(val).__name__ == "CustomRLHFDataset"
    assert train[0].messages[0]["content"].endswith("after 'Answer:'." + answer_format)
    assert [(item.data_source, item.ground_truth, item.agent_name) for item in val] == [
        ("aime_2024", str(12 * i), "tool_agent") for i in range(1, 5)]


def test_retool_script_runs_its_tool_agent_loop(tmp_path, local_paths):
    from verl_async.tools import tool_names

    mt = _mapped("dapo_7b_async_retool", tmp_path, local_paths).actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.max_user_turns == mt.max_assistant_turns == 16 and mt.format == "hermes"
    assert mt.tool_config_path == str(REPO_ROOT / "recipe/retool/sandbox_fusion_tool_config.yaml")  # made absolute
    assert tool_names(mt.tool_config_path, None) == ["code_interpreter"]  # ReTool's tool, its SandboxFusion URL
