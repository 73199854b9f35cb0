"""`actor_rollout_ref.model.custom_chat_template` reaches every side that renders prompts: the preflight and the Rollouter."""

from __future__ import annotations

import time

from omegaconf import OmegaConf

from tests.fakes import FakeEngine
from verl_async.config import compose, validate
from verl_async.config.model_source import prompt_tokenizer
from verl_async.data import builtin, write_rows
from verl_async.rollout.service import RolloutService

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def _cfg(tmp_path, model_dir, template):
    write_rows(builtin.generate_rows("train", 4, seed=3), str(tmp_path / "train.parquet"))
    cfg = compose(overrides=[
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={tmp_path / 'train.parquet'}",
        "data.val_files=null", "data.max_prompt_length=256", "data.max_response_length=12",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ])
    OmegaConf.update(cfg, "actor_rollout_ref.model.custom_chat_template", template)
    return validate(cfg)


def test_the_preflight_and_the_rollouter_render_prompts_with_the_custom_template(tmp_path, tiny_model_dir):
    cfg = _cfg(tmp_path, tiny_model_dir, TEMPLATE)
    assert prompt_tokenizer(cfg).chat_template == TEMPLATE
    svc = RolloutService(cfg, None, model_path=tiny_model_dir, run_dir=str(tmp_path / "run"), run_start=time.time(),
                         engines=[FakeEngine()])
    try:
        assert svc.tokenizer.chat_template == TEMPLATE
        first = svc.dataset[0]
        text = svc.tokenizer.decode(first.prompt_ids)
        assert text.startswith("[user] ") and text.endswith("[assistant] "), text
    finally:
        svc.reward.close()


def test_without_the_key_the_models_own_template_is_used(tmp_path, tiny_model_dir):
    cfg = _cfg(tmp_path, tiny_model_dir, None)
    assert prompt_tokenizer(cfg).chat_template not in (None, TEMPLATE)
