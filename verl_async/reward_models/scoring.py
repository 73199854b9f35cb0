"""What a reward model sees and what its score becomes (pure: text in, numbers out).

* A discriminative model reads the conversation through ITS OWN chat template: the prompt's messages plus the
  response as the assistant turn, the response decoded with the policy's tokenizer, EOS text removed, and a
  leading BOS text dropped (the model's tokenizer adds its own), as verl's reward loop does
  (`_preprocess_reward_inputs`). Its score is the last label's raw logit (verl: vLLM's classify, no activation).
* A judge (an instruct model) reads `judge.prompt_template` filled with the question, the reference answer
  and the response, as a user turn; the first match of `judge.score_pattern` in its answer, clamped to
  [min_score, max_score], is mapped onto [0, 1]. No number: the score failed (counted, scored 0).
* The reward: [the rule reward, with `use_task_rewards`] + reward_model_coef x the model's score.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class ModelScore:
    value: Optional[float]  # None: it failed
    error: Optional[str] = None
    answer: str = ""  # a judge's text (for logs)

    @property
    def ok(self) -> bool:
        return self.value is not None


def question_text(messages: Sequence[dict]) -> str:
    """The prompt as a judge quotes it: the conversation's user (and system) turns, in order."""
    parts = [str(m.get("content", "")) for m in messages if m.get("role") in ("system", "user")]
    return "\n\n".join(p for p in parts if p)


def response_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """verl's reward-loop decode: special tokens kept (the RM's template sees the turn as generated), EOS removed."""
    text = tokenizer.decode(list(token_ids))
    eos = getattr(tokenizer, "eos_token", None)
    return text.replace(eos, "") if eos else text


def classifier_input(rm_tokenizer: Any, messages: Sequence[dict], response: str) -> list[int]:
    """Token ids of the discriminative model's input (module docstring)."""
    chat = [dict(m) for m in messages] + [{"role": "assistant", "content": response}]
    text = rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    bos = getattr(rm_tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        text = text[len(bos):]
    return list(rm_tokenizer(text, add_special_tokens=True)["input_ids"])


def judge_prompt(template: str, messages: Sequence[dict], response: str, ground_truth: Any, min_score: float,
                 max_score: float) -> list[dict]:
    """The judge's conversation: one user turn, the filled template."""
    content = template.format(prompt=question_text(messages), response=response,
                              ground_truth="" if ground_truth is None else str(ground_truth),
                              min_score=min_score, max_score=max_score)
    return [{"role": "user", "content": content}]


def parse_judgement(answer: str, pattern: str, min_score: float, max_score: float) -> ModelScore:
    match = re.search(pattern, answer)
    if match is None:
        return ModelScore(None, f"the judge's answer holds no score (judge.score_pattern={pattern!r}): "
                                f"{answer[:120]!r}", answer)
    try:
        value = float(match.group(1))
    except (TypeError, ValueError):
        return ModelScore(None, f"the judge's score {match.group(1)!r} is not a number", answer)
    if not math.isfinite(value):
        return ModelScore(None, f"the judge's score {value} is not finite", answer)
    value = min(max(value, min_score), max_score)
    return ModelScore((value - min_score) / (max_score - min_score), None, answer)


def combine(model: ModelScore, rule: Optional[tuple[float, dict]], coef: float) -> tuple[float, dict[str, float]]:
    """(reward, info) of one response: the model's score, weighted, plus the rule reward when there is one.

    A failed model score adds nothing and marks the response (`rm_error`, `reward_error`); the rule's own
    fields (acc, overlong penalty) stay as the rule reported them."""
    base, info = (0.0, {}) if rule is None else (float(rule[0]), dict(rule[1]))
    if model.ok:
        info["rm_score"] = float(model.value)
        info["rm_error"] = 0.0
        reward = base + coef * float(model.value)
    else:
        info["rm_error"] = 1.0
        info["reward_error"] = 1.0
        reward = base
    if rule is None:
        info["score"] = reward
    return reward, info
