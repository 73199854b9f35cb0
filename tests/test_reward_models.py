"""Reward models on the rollout side (verl_async/reward_models/, config/reward_model.py), on CPU with tiny random
classifiers and a scripted judge: inputs, score shapes, padding and batching, the combination with the rule reward,
and failures counted in the reward manager's books."""

from __future__ import annotations

import asyncio

import pytest
from verl_async.config import ConfigError, compose, validate
from verl_async.config.reward_model import reward_model_spec
from verl_async.protocol import Response
from verl_async.reward import RewardFunctionError, build_reward_manager
from verl_async.config.reward_model import model_kind
from verl_async.reward_models.models import ClassifierModel, ClassifierReplica
from verl_async.reward_models.scorer import RewardModelScorer
from verl_async.reward_models.scoring import (
    ModelScore,
    classifier_input,
    combine,
    judge_prompt,
    parse_judgement,
    question_text,
    response_text,
)
from verl_async.rollout.engine import GenerateResult
from verl_async.rollout.task import PromptTask
from verl_async.utils.replica_plan import ReplicaPlan
from tests.test_verl_v1_scripts import make_classifier

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 * 12?"}]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, tiny_model_dir):
    return make_classifier(tmp_path_factory.mktemp("rm"), tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from verl_async.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_dir)


# --------------------------------------------------------------------------- what a model reads, what it gives
def test_inputs_follow_verls_reward_loop(tokenizer):
    ids = tokenizer("72<|im_end|>", add_special_tokens=False)["input_ids"]
    assert response_text(tokenizer, ids) == "72"  # EOS text removed, as verl's reward loop does
    assert question_text(MESSAGES) == "Be brief.\n\nWhat is 6 * 12?"
    expected = tokenizer.apply_chat_template(MESSAGES + [{"role": "assistant", "content": "72"}], tokenize=False)
    assert classifier_input(tokenizer, MESSAGES, "72") == tokenizer(expected)["input_ids"]
    chat = judge_prompt("Q: {prompt} A: {response} ref: {ground_truth} [{min_score:g}-{max_score:g}]", MESSAGES, "72",
                        None, 0, 10)
    assert chat == [{"role": "user", "content": "Q: Be brief.\n\nWhat is 6 * 12? A: 72 ref:  [0-10]"}]


def test_a_leading_bos_is_the_models_own():
    class Tok:
        bos_token = "<s>"

        def apply_chat_template(self, chat, **kw):
            return "<s>" + "|".join(m["content"] for m in chat)

        def __call__(self, text, add_special_tokens):
            assert add_special_tokens and not text.startswith("<s>")  # the tokenizer adds it once
            return {"input_ids": [1] + [ord(c) for c in text]}

    assert classifier_input(Tok(), [{"role": "user", "content": "q"}], "a") == [1, ord("q"), ord("|"), ord("a")]


@pytest.mark.parametrize("answer, expected", [("Rating: 7", 0.7), ("I'd say 11/10", 1.0), ("-3", 0.0),
                                              ("7.5 out of 10", 0.75)])
def test_judge_scores_are_mapped_onto_0_1(answer, expected):
    assert parse_judgement(answer, r"(-?\d+(?:\.\d+)?)", 0, 10).value == pytest.approx(expected)


def test_a_judge_answer_without_a_number_fails():
    score = parse_judgement("excellent!", r"(\d+)", 0, 10)
    assert not score.ok and "holds no score" in score.error


def test_combination_with_and_without_the_rule_reward():
    rule = (1.0, {"score": 1.0, "acc": 1.0})
    assert combine(ModelScore(0.5), rule, 2.0) == (2.0, {"score": 1.0, "acc": 1.0, "rm_score": 0.5, "rm_error": 0.0})
    assert combine(ModelScore(0.5), None, 2.0) == (1.0, {"rm_score": 0.5, "rm_error": 0.0, "score": 1.0})
    reward, info = combine(ModelScore(None, "boom"), rule, 2.0)
    assert reward == 1.0 and info["rm_error"] == 1.0 and info["reward_error"] == 1.0 and info["acc"] == 1.0


# --------------------------------------------------------------------------- the classifier
def test_classifier_scores_one_number_per_input_whatever_the_batch(classifier_dir):
    model = ClassifierModel(classifier_dir, max_num_seqs=2, max_num_batched_tokens=40)
    inputs = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20], [30, 31, 32, 33], [40, 41]]
    batched = model.score(inputs)
    assert len(batched) == 5 and all(isinstance(v, float) for v in batched)
    one_by_one = [model.score([x])[0] for x in inputs]
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    # an input ending in the pad id (e.g. EOS used as pad) is scored at its own last token, batched or not
    ending = [5, 6, model.pad_id]
    assert model.score([ending, inputs[1]])[0] == pytest.approx(model.score([ending])[0], abs=1e-5)
    assert model.score([ending])[0] != pytest.approx(model.score([[5, 6]])[0], abs=1e-6)
    assert model_kind(classifier_dir) == "discriminative"


def test_model_kind_of_a_causal_lm_is_a_judge(tiny_model_dir):
    assert model_kind(tiny_model_dir) == "generative"


def _manager(tokenizer, **kw):
    return build_reward_manager({"reward_manager": "naive", "max_error_rate": kw.pop("max_error_rate", 1.0),
                                 "error_window": 8}, None, tokenizer)


def _spec(**over):
    cfg = validate(compose("fully_async_ppo_trainer", ["reward.reward_model.enable=true",
                                                       "reward.reward_model.model_path=/m"] + [
        f"reward.reward_model.{k}={v}" for k, v in over.items()]))
    return reward_model_spec(cfg)


def _item():
    return PromptTask("u0", 0, 0, [1, 2, 3], data_source="openai/gsm8k", ground_truth="72", messages=MESSAGES)


def _responses(tokenizer, texts):
    out = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"]
        out.append(Response(ids, [0.0] * len(ids), [0] * len(ids), "stop"))
    return out


def test_scorer_batches_the_groups_and_adds_the_rule_reward(classifier_dir, tokenizer):
    from verl_async.rollout.service import RewardScorer

    replica = ClassifierReplica(classifier_dir, ReplicaPlan("cpu"), max_num_seqs=16)
    manager = _manager(tokenizer)
    scorer = RewardModelScorer(_spec(use_task_rewards="true", reward_model_coef=0.5), "discriminative",
                               manager=manager, rule_scorer=RewardScorer(manager), policy_tokenizer=tokenizer,
                               rm_tokenizer=tokenizer, replicas=[replica], remote=False)
    groups = [_responses(tokenizer, ["#### 72", "#### 71", "no idea"]), _responses(tokenizer, ["#### 72", "x"])]

    async def run():
        return await asyncio.gather(*(scorer(_item(), g) for g in groups))

    scored = asyncio.run(run())
    assert [len(s) for s in scored] == [3, 2]
    assert replica.batcher.batches == 1 and replica.batcher.items == 5  # two groups, one forward
    for group, out in zip(groups, scored):
        for r, (reward, info) in zip(group, out):
            text = response_text(tokenizer, r.token_ids)
            model = replica.model.score([classifier_input(tokenizer, MESSAGES, text)])[0]
            assert info["rm_score"] == pytest.approx(model, abs=1e-5)
            assert reward == pytest.approx(info["score"] + 0.5 * model, abs=1e-5)  # rule (gsm8k) + 0.5 x model
    assert [info["acc"] for _, info in scored[0]] == [1.0, 0.0, 0.0]
    assert manager.summary() == {"reward_scored": 10, "reward_errors": 0}  # 5 rule scores + 5 model scores


def test_failures_are_counted_and_stop_a_broken_model(classifier_dir, tokenizer):
    replica = ClassifierReplica(classifier_dir, ReplicaPlan("cpu"))
    manager = _manager(tokenizer)
    spec = _spec(**{"rollout.prompt_length": 80})
    scorer = RewardModelScorer(spec, "discriminative", manager=manager, rule_scorer=None, policy_tokenizer=tokenizer,
                               rm_tokenizer=tokenizer, replicas=[replica], remote=False)
    out = asyncio.run(scorer(_item(), _responses(tokenizer, ["ok", "x" * 60])))
    assert out[0][1]["rm_error"] == 0.0 and out[0][0] == out[0][1]["rm_score"]  # no rule: the model's score
    assert out[1] == (0.0, {"rm_error": 1.0, "reward_error": 1.0, "score": 0.0})
    assert manager.summary()["reward_errors"] == 1 and scorer.metrics()["reward/rm_errors"] == 1.0
    strict = _manager(tokenizer, max_error_rate=0.1)
    broken = RewardModelScorer(spec, "discriminative", manager=strict, rule_scorer=None, policy_tokenizer=tokenizer,
                               rm_tokenizer=tokenizer, replicas=[replica], remote=False)
    with pytest.raises(RewardFunctionError, match="reward.reward_model.model_path=/m"):
        for _ in range(4):
            asyncio.run(broken(_item(), _responses(tokenizer, ["x" * 60, "y" * 60])))


class ScriptedJudge:
    """An engine replica that answers with fixed texts (the judge's generation is the engine's own code path)."""

    def __init__(self, tokenizer, answers):
        self.tokenizer, self.answers, self.prompts = tokenizer, list(answers), []

    async def generate(self, request):
        self.prompts.append(request.prompt_ids)
        ids = self.tokenizer(self.answers.pop(0), add_special_tokens=False)["input_ids"]
        return GenerateResult(request.request_id, ids, [0.0] * len(ids), [0] * len(ids), "stop")


def test_judge_path_scores_parses_and_counts(tokenizer):
    judge = ScriptedJudge(tokenizer, ["Rating: 8", "great", "3"])
    manager = _manager(tokenizer)
    spec = _spec()
    scorer = RewardModelScorer(spec, "generative", manager=manager, rule_scorer=None, policy_tokenizer=tokenizer,
                               rm_tokenizer=tokenizer, replicas=[judge], remote=False,
                               judge_request=lambda rid, ids: type("R", (), {"request_id": rid, "prompt_ids": ids})())
    out = asyncio.run(scorer(_item(), _responses(tokenizer, ["#### 72", "#### 1", "#### 3"])))
    assert [r for r, _ in out] == [pytest.approx(0.8), 0.0, pytest.approx(0.3)]
    assert out[1][1]["rm_error"] == 1.0 and manager.summary()["reward_errors"] == 1
    first = tokenizer.decode(judge.prompts[0])
    assert "What is 6 * 12?" in first and "#### 72" in first and "Reference answer" in first


# --------------------------------------------------------------------------- config
def refused(overrides):
    with pytest.raises(ConfigError) as err:
        validate(compose("fully_async_ppo_trainer", ["reward.reward_model.enable=true"] + overrides))
    return str(err.value)


@pytest.mark.parametrize("overrides, message", [
    ([], "reward.reward_model.model_path: required with reward.reward_model.enable=true"),
    (["reward.reward_model.model_path=/m", "+reward.reward_model.rollout.colour=red"],
     "reward.reward_model.rollout.colour: unknown key (verl's RolloutConfig keys)"),
    (["reward.reward_model.model_path=/m", "reward.reward_model.rollout.name=trtllm"],
     "reward.reward_model.rollout.name: trtllm: not a reward-model server here"),
    (["reward.reward_model.model_path=/m", "reward.reward_model.judge.score_pattern='\\d+'"],
     "reward.reward_model.judge.score_pattern: needs a group around the number"),
    (["reward.reward_model.model_path=/m", "reward.reward_model.judge.prompt_template='rate it'"],
     "reward.reward_model.judge.prompt_template: must hold {response}"),
    (["reward.reward_model.model_path=/m", "reward.reward_model.enable_resource_pool=true"],
     "reward.reward_model.nnodes: enable_resource_pool=true needs devices: n_gpus_per_node x nnodes = 8 x 0"),
    (["reward.reward_model.model_path=/m", "trainer.device=cuda"],
     "reward.reward_model.enable_resource_pool: false puts the reward model; a model beside the engine replicas needs "
     "rollout.colocate=true"),
])
def test_reward_model_keys_are_checked_in_one_line(overrides, message):
    assert refused(overrides).startswith(message)


def test_own_devices_and_defaults():
    s = _spec(enable_resource_pool="true", nnodes=1, n_gpus_per_node=2)
    assert (s.own_devices, s.replicas, s.use_task_rewards, s.reward_model_coef) == (True, 2, False, 1.0)
    assert (s.max_input_tokens, s.max_new_tokens, s.temperature) == (2048, 64, 0.0)
