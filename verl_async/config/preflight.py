"""Checks against the machine, after validate() and before Ray starts; the dry run runs them all.

validate() looks at the config alone (fast, no torch); preflight() opens things: the Ray
cluster to join (it answers and takes this driver's token), the device, the optional packages the config asks for (vLLM, megatron-core), the model (a local folder, the HF cache or a reachable hub),
the custom reward function, and the data, tokenised with the model's tokenizer and chat
template exactly as the Rollouter will (verl_async.data.PromptDataset, or the class that
data.custom_cls names: verl_async.data.custom), so an overlong
prompt under `data.truncation=error` is reported with its file, row and length. Last it
decides what the run resumes (verl_async.config.resume) before anything is written.
Problems raise ConfigError naming the key (or the file and row) to fix.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl_async.config import derived
from verl_async.config.distillation import preflight_side_models
from verl_async.config.errors import ConfigError
from verl_async.config.model_source import prompt_tokenizer
from verl_async.config.ray_address import check_ray_address
from verl_async.config.resume import plan_resume
from verl_async.config.run_folder import claim
from verl_async.versions import check_transformers


def preflight(cfg: DictConfig) -> Dict[str, Any]:
    """Check transformers, device, packages, model, reward function, data and resume; return facts for the summary.

    An unsupported transformers raises verl_async.versions.UnsupportedTransformersError (the entry
    point prints it in one line) before anything builds a model.
    """
    check_transformers()
    check_ray_address(cfg)  # a cluster to join answers, and takes this driver's token (config/ray_address.py)
    check_device(cfg)
    check_model_folder(cfg)
    check_loggers(cfg)
    check_optional_packages(cfg)
    check_cpu_token_budgets(cfg)
    check_reward_function(cfg)
    tokenizer = prompt_tokenizer(cfg)
    preflight_side_models(cfg, tokenizer)  # distillation teachers, the reward model (config/distillation.py)
    datasets = {split: load_prompts(cfg, tokenizer, split) for split in ("train", "val")}
    rows = {split: None if d is None else d.stats.rows_read for split, d in datasets.items()}
    prompts = {split: None if d is None else len(d) for split, d in datasets.items()}
    for dataset in filter(None, datasets.values()):
        check_scorers(cfg, dataset)
    need = derived.required_samples(cfg)
    if prompts["train"] is not None and prompts["train"] < need:
        unused = "" if prompts["train"] == rows["train"] else f" (of {rows['train']} read; the rest were skipped or filtered)"
        raise ConfigError(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"one trainer step needs {need} prompts (ppo_mini_batch_size * async_training.require_batches) "
            f"but data.train_files has only {prompts['train']} rows{unused}",
        )
    resume, moved = claim(cfg, plan_resume(cfg, prompts["train"]), prompts["train"])  # a folder holds one run (config/run_folder.py)
    return {"rows": rows, "prompts": prompts, "resume": resume, "run_dir_moved": moved}


def with_run_dir(cfg: DictConfig, facts: Dict[str, Any]) -> DictConfig:
    """`cfg` writing where the preflight decided (a new folder when the configured one holds another run)."""
    if facts.get("run_dir_moved"):
        OmegaConf.update(cfg, "trainer.default_local_dir", facts["resume"].root, merge=False)
    return cfg


def check_device(cfg: DictConfig) -> None:
    """On a local run the driver's machine is the one that trains, so its device must exist."""
    if cfg.ray_init.address or os.environ.get("RAY_ADDRESS"):
        return  # joining a cluster: the workers' nodes hold the devices
    from verl_async.utils import device

    try:
        device.resolve(cfg.trainer.device)
    except device.DeviceUnavailableError as exc:
        kind = str(cfg.trainer.device)
        said = str(exc)  # a missing package (torch_npu) names its install line: kept
        why = device_missing(kind) if said.startswith(f"trainer.device={kind} but no") else said.removeprefix(
            f"trainer.device={kind} ")
        raise ConfigError("trainer.device", why) from None


def device_missing(kind: str) -> str:
    """Why `kind` cannot run here and what to do instead, in one sentence."""
    import torch

    build = ""
    if kind == "cuda" and torch.version.cuda is None:
        build = f" (torch {torch.__version__} is a CPU build)"
    return (f"{kind} is asked for, but this machine has no {kind} device{build}; run this command on a machine "
            f"with one, or use trainer.device=cpu (without rollout.colocate) to run on the CPU, as the built-in "
            "demo does: python -m recipe.fully_async_main")


# config.json keys that count a mixture-of-experts model's experts (Qwen2/3-MoE, Mixtral, DeepSeek, others)
MOE_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def moe_problem(hf_config: Any) -> Optional[str]:
    """Why a model config is a mixture of experts (None for a dense model)."""
    if not isinstance(hf_config, dict):
        return None
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else hf_config
    experts = {k: text[k] for k in MOE_EXPERT_KEYS if isinstance(text.get(k), int) and text[k] > 1}
    kind = str(text.get("model_type", ""))
    if not experts and "moe" not in kind:
        return None
    said = ", ".join(f"{k} {v}" for k, v in experts.items())
    return f"model_type {kind!r}" + (f", {said}" if said else "")


def _config_file(given: str) -> Optional[str]:
    """The config.json of a local folder, or of an HF id already in the HF cache (None otherwise)."""
    path = os.path.expanduser(given)
    if os.path.isdir(path):
        return os.path.join(path, "config.json")
    from verl_async.config.model_source import is_hub_id

    if is_hub_id(given):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(given, "config.json")
        return cached if isinstance(cached, str) else None
    return None


def check_model_folder(cfg: DictConfig) -> None:
    """A local model folder (validate() made sure it exists) must hold the HF config of a dense text-only model
    (an HF id's config is checked too when it is in the HF cache)."""
    given = cfg.actor_rollout_ref.model.path
    path = os.path.expanduser(given)
    if not os.path.isdir(path):
        cached = _config_file(str(given))
        if cached is not None:
            _check_dense(given, _read_json(cached))
        return
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError("actor_rollout_ref.model.path", f"{given} has no config.json (not an HF model folder)")
    try:
        with open(config_file, encoding="utf-8") as fh:
            hf_config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError("actor_rollout_ref.model.path", f"{config_file} does not read as JSON: {exc}") from None
    if isinstance(hf_config, dict) and "vision_config" in hf_config:
        raise ConfigError("actor_rollout_ref.model.path", f"{given} is a vision-language model (config.json has "
                                                          "vision_config); VLM training is not implemented in "
                                                          "verl_async: use a text-only model")
    _check_dense(given, hf_config)
    if OmegaConf.select(cfg, "actor_rollout_ref.rollout.true_on_policy", default=False) and isinstance(hf_config, dict):
        from verl_async.invariant.model import MODEL_TYPES

        kind = hf_config.get("model_type")
        if kind not in MODEL_TYPES:
            raise ConfigError("actor_rollout_ref.rollout.true_on_policy",
                              f"model type {kind!r} of {given} is not one of {MODEL_TYPES}; its kernels have no "
                              "batch-invariant twin here")
        from verl_async.invariant.exact import length_problem

        sizes = {k: int(hf_config[k]) for k in ("hidden_size", "intermediate_size") if isinstance(hf_config.get(k), int)}
        problem = length_problem(sizes)
        if problem is not None:
            raise ConfigError("actor_rollout_ref.rollout.true_on_policy", f"{given}: {problem}")


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _check_dense(given: str, hf_config: Any) -> None:
    """Mixture-of-experts models are refused: the engine, the trainers and weight sync are built and tested for
    dense decoders (no expert routing kernels, no expert parallelism, no MoE test); a MoE model would run
    untested, slowly, on the dense code paths."""
    moe = moe_problem(hf_config)
    if moe is not None:
        raise ConfigError("actor_rollout_ref.model.path", f"{given} is a mixture-of-experts model ({moe} in its "
                                                          "config.json); verl_async trains dense models only (Qwen2, "
                                                          "Qwen3, Llama, Mistral and their kind): use a dense model")


def check_loggers(cfg: DictConfig) -> None:
    """Each trainer.logger backend's package is installed (the trainer would fail to start without it)."""
    from verl_async.utils.tracking import missing_packages

    missing = missing_packages(cfg.trainer.logger)
    if missing:
        raise ConfigError("trainer.logger", missing[0])


def check_cpu_token_budgets(cfg: DictConfig) -> None:
    """A null token budget means 4096 on CPU (trainer/token_budget.py), whatever the sequence length: the
    rule validate() applies to numbers (on an accelerator a null budget is sized to fit the longest sequence)."""
    if cfg.trainer.device != "cpu":
        return
    from verl_async.config.checks import token_budget_problem

    problem = token_budget_problem(cfg, derived.CPU_TOKEN_BUDGET)
    if problem is not None:
        raise problem


def check_optional_packages(cfg: DictConfig) -> None:
    """vLLM / megatron-core, when the config asks for them, must be installed here (a cluster's workers run the
    same environment); without this the run failed 50-100 s later inside a Ray traceback."""
    from verl_async.optional import MEGATRON, PEFT, VLLM, is_installed

    wanted = [("actor_rollout_ref.rollout.name", VLLM, "native (the built-in engine)",
               cfg.actor_rollout_ref.rollout.name == "vllm" and not cfg.debug.get("train_only")),
              ("actor_rollout_ref.actor.strategy", MEGATRON, "fsdp2", cfg.actor_rollout_ref.actor.strategy == "megatron"),
              ("actor_rollout_ref.model.lora_rank", PEFT, "0 (full fine-tuning)",
               cfg.actor_rollout_ref.model.lora_rank > 0 and not cfg.debug.get("rollout_only"))]
    for key, dependency, instead, needed in wanted:
        if needed and not is_installed(dependency):
            raise ConfigError(key, f"{OmegaConf.select(cfg, key)} needs {dependency.package}, which is not installed in "
                                   f"this Python ({sys.executable}): {dependency.install}; or use {key}={instead}")


def check_reward_function(cfg: DictConfig) -> None:
    """custom_reward_function.path/name load here, as the Rollouter loads them (verl_async.reward.registry)."""
    from verl_async.reward.registry import custom_scorer_ref

    crf = cfg.custom_reward_function
    try:
        custom_scorer_ref(crf.path, crf.name)
    except (ValueError, AttributeError) as exc:  # no name, or no function of that name
        raise ConfigError("custom_reward_function.name", _reason(exc)) from None
    except (OSError, ImportError) as exc:  # no such file, or importing it failed
        raise ConfigError("custom_reward_function.path", _reason(exc)) from None


def _reason(exc: Exception) -> str:
    """The registry's message without its leading `custom_reward_function.<key>=` (the error names the key)."""
    text = str(exc)
    head, sep, tail = text.partition(": ")
    if not (text.startswith("custom_reward_function.") and sep):
        return text
    value = head.partition("=")[2]
    return f"{value}: {tail}" if value else tail


def check_scorers(cfg: DictConfig, dataset: Any) -> None:
    """Without a custom function every data_source needs a built-in scorer (else the first group fails)."""
    if cfg.custom_reward_function.path:
        return
    from verl_async.reward import UnknownDataSourceError, resolve_scorer

    first = {}
    for item in dataset:
        first.setdefault(item.data_source, item.source)
    for data_source, source in first.items():
        try:
            resolve_scorer(data_source)
        except UnknownDataSourceError as exc:
            raise ConfigError(dataset.key, f"{source}: {exc}") from None


def load_prompts(cfg: DictConfig, tokenizer: Any, split: str) -> Optional[Any]:
    """data.<split>_files read, schema-checked and tokenised by verl_async.data (None when unset).

    builtin:// datasets are generated (and cached) here on first use.
    """
    from verl_async.data import DataError, DatasetClassError, dataset_from_config

    key, value = f"data.{split}_files", cfg.data[f"{split}_files"]
    if value is None or (isinstance(value, ListConfig) and len(value) == 0):
        return None
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("actor_rollout_ref.model.path", f"{cfg.actor_rollout_ref.model.path}: the tokenizer has no "
                          "chat template, so prompts cannot be built")
    from verl_async.tools.tool_registry import multi_turn_tool_schemas

    try:  # multi-turn: rendered with the tools' schemas, as the Rollouter renders them; data.custom_cls's class
        return dataset_from_config(cfg.data, tokenizer, split,
                                   tools=multi_turn_tool_schemas(cfg.actor_rollout_ref.rollout.multi_turn))
    except DatasetClassError as exc:
        raise ConfigError(exc.key, exc.reason) from None
    except (DataError, FileNotFoundError, ValueError) as exc:
        raise ConfigError(key, str(exc).removeprefix(f"{key}: ")) from None
