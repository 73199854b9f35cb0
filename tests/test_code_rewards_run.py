"""A code task trains on CPU with code-execution rewards (issue 36): APPS-format problems, the tiny model.

The rows come from data_preprocess.apps; every response is scored by running its problem's
test cases in the built-in sandbox (inside the reward manager's scorer processes, inside the
Rollouter's Ray actor). The saved rollouts show each score came from executed test cases:
its `cases` is the problem's count, and scoring the saved text again gives the same reward.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from data_preprocess import apps
from verl_async.config import compose, validate
from verl_async.pipeline import run
from verl_async.reward import default_compute_score
from verl_async.sandbox import isolation_problem

pytestmark = pytest.mark.slow
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "code", "apps_jsonl")


def test_a_code_task_trains_with_code_execution_rewards(ray_session, tmp_path, tiny_model_dir):
    problem = isolation_problem()
    if problem and not os.environ.get("CI"):
        pytest.skip(f"no OS sandbox on this machine: {problem}")
    data = apps.main(["--local_dir", str(tmp_path / "data"), "--local_dataset_path", FIXTURE])
    pattern = str(tmp_path / "dump" / "rollout_{rollout_id}.pt")
    cfg = validate(compose(overrides=[
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={data['train']}",
        "data.val_files=null",
        "data.max_prompt_length=512",
        "data.max_response_length=24",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.max_num_seqs=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "rollout.total_rollout_steps=4",
        "reward_model.timeout_s=30",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=[tensorboard]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"debug.save_rollout_data='{pattern}'",
        "ray_init.num_cpus=4",
    ]))
    summary = run(cfg)
    assert summary["trainer/steps"] == 2
    from verl_async.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    responses = 0
    for step in range(2):
        for group in torch.load(pattern.format(rollout_id=step), weights_only=False):
            tests = len(json.loads(group["ground_truth"])["inputs"])
            for response in group["responses"]:
                info = response["reward_info"]
                assert info.get("reward_error", 0.0) == 0.0 and info["cases"] == tests
                text = tokenizer.decode(response["token_ids"], skip_special_tokens=True)  # as the manager does
                if tokenizer.eos_token and text.endswith(tokenizer.eos_token):
                    text = text[: -len(tokenizer.eos_token)]
                again = default_compute_score("apps", text, group["ground_truth"])
                assert response["reward"] == pytest.approx(again["score"])
                responses += 1
    assert responses == 8
