"""Scorers on real GSM8K / MATH-style responses: correct, wrong, malformed, empty, 10 MB junk."""

from __future__ import annotations

import math
import time

import pytest

from verl_async.data import builtin
from verl_async.reward import gsm8k, math_answer, math_dapo
from verl_async.reward.registry import UnknownDataSourceError, default_compute_score, resolve_scorer, to_score_dict

JUNK = "x7 {}#\\boxed" * (10_000_000 // 12)  # ~10 MB of digits, braces, hashes and box commands

NATALIA = (
    "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n#### 72"
)

GSM8K_TABLE = [
    # response, ground truth, method, expected score
    (NATALIA, "72", "strict", 1.0),
    ("She makes 9 * 2 = $18 every day.\n#### 18", "18", "strict", 1.0),
    ("It makes 1,250 * 4 = 5,000 toy cars.\n#### 5,000", "5000", "strict", 1.0),  # commas removed
    ("#### -3", "-3", "strict", 1.0),
    ("first guess #### 5, then I re-check.\n#### 72", "72", "strict", 1.0),  # the last #### counts
    ("Natalia sold 72 clips.\n#### 71", "72", "strict", 0.0),  # wrong -> format_score (0)
    ("Natalia sold 72 clips altogether.", "72", "strict", 0.0),  # no '####': strict finds nothing
    ("####72", "72", "strict", 0.0),  # malformed: needs '#### '
    ("#### $18", "18", "strict", 0.0),  # verl: '$' right after '#### ' is not a number
    ("", "72", "strict", 0.0),
    ("Natalia sold 72 clips altogether", "72", "flexible", 1.0),
    ("48 + 24 = 72", "72", "flexible", 1.0),
    ("48 + 24 = 71", "72", "flexible", 0.0),
    ("no numbers at all . . .", "72", "flexible", 0.0),
    ("", "72", "flexible", 0.0),
]


@pytest.mark.parametrize("response,truth,method,expected", GSM8K_TABLE)
def test_gsm8k_table(response, truth, method, expected):
    assert gsm8k.compute_score(response, truth, method=method) == expected


def test_gsm8k_format_score_and_score_args():
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1, score=2.0) == 0.1
    assert gsm8k.compute_score("#### 72", "72", format_score=0.1, score=2.0) == 2.0
    assert gsm8k.compute_score("no answer", "72", format_score=0.1) == 0.0  # nothing extracted: 0, not format
    with pytest.raises(ValueError, match="method"):
        gsm8k.extract_solution("#### 1", method="loose")


def test_gsm8k_10mb_junk_is_cheap():
    t0 = time.perf_counter()
    assert gsm8k.compute_score(JUNK, "72") == 0.0
    assert gsm8k.compute_score(JUNK + "\n#### 72", "72") == 1.0  # only the tail is searched
    assert gsm8k.compute_score(JUNK, "7", method="flexible") == 1.0  # last number of the tail
    assert time.perf_counter() - t0 < 2.0


MATH_TABLE = [
    # response, ground truth, expected
    ("$$\\sqrt{144} = \\boxed{12}.$$", "12", 1.0),
    ("so $\\frac{84}{144} = \\boxed{\\frac{7}{12}}.$", "\\frac{7}{12}", 1.0),
    ("$\\boxed{\\dfrac{7}{12}}$", "\\frac{7}{12}", 1.0),
    ("The answer is $\\boxed{7/12}$.", "\\frac{7}{12}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("polar: $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("$\\boxed{(3,\\frac{\\pi}{2})}$", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("the graph has $\\fbox{2}$ vertical asymptotes", "2", 1.0),
    ("The answer is $\\boxed 5$.", "5", 1.0),
    ("\\boxed {5}", "5", 1.0),
    ("$x = \\boxed{-7}$", "-7", 1.0),
    ("\\boxed{x = -7}", "-7", 1.0),
    ("\\boxed{[2, \\infty)}", "[2,\\infty)", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),  # needs math-verify
    ("First \\boxed{3}, but on reflection \\boxed{5}.", "5", 1.0),  # the last box counts
    ("First \\boxed{3}, but on reflection \\boxed{5}.", "3", 0.0),
    ("\\boxed{13}", "12", 0.0),
    ("\\boxed{\\frac{7}{13}}", "\\frac{7}{12}", 0.0),
    ("The answer is 12.", "12", 0.0),  # no box
    ("\\boxed{12", "12", 0.0),  # unclosed
    ("\\boxed{}", "12", 0.0),
    ("", "12", 0.0),
]


@pytest.mark.parametrize("response,truth,expected", MATH_TABLE)
def test_math_table(response, truth, expected):
    assert math_answer.compute_score(response, truth) == expected


def test_math_extraction_helpers():
    s = "a \\boxed{\\frac{1}{\\sqrt{2}}} b"
    assert math_answer.last_boxed_only_string(s) == "\\boxed{\\frac{1}{\\sqrt{2}}}"
    assert math_answer.remove_boxed("\\boxed{\\frac{1}{\\sqrt{2}}}") == "\\frac{1}{\\sqrt{2}}"
    assert math_answer.remove_boxed("\\fbox{2}") == "2"
    assert math_answer.remove_boxed(math_answer.last_boxed_only_string("$\\boxed 5$")) == "5"
    assert math_answer.extract_boxed_answer("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    with pytest.raises(ValueError):
        math_answer.remove_boxed("12")


def test_math_normaliser_fallback_without_math_verify(monkeypatch):
    monkeypatch.setattr(math_answer, "HAVE_MATH_VERIFY", False)
    assert math_answer.compute_score("\\boxed{\\dfrac{7}{12}}", "\\frac{7}{12}") == 1.0
    assert math_answer.compute_score("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    # symbolic equality is beyond the normaliser
    assert math_answer.compute_score("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}") == 0.0


def test_math_normaliser_fallback_when_math_verify_errors(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr(math_answer, "_mv_verify", broken)
    assert math_answer.compute_score("\\boxed{\\dfrac{7}{12}}", "\\frac{7}{12}") == 1.0
    assert math_answer.compute_score("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}") == 0.0


def test_math_10mb_junk():
    t0 = time.perf_counter()
    assert math_answer.compute_score(JUNK, "12") == 0.0
    assert math_answer.compute_score("\\boxed{" + JUNK + "}", "12") == 0.0  # huge "answer": no sympy
    assert time.perf_counter() - t0 < 5.0


def test_math_dapo_answer_line():
    assert math_dapo.compute_score("... so\nAnswer: 12", "12") == {"score": 1.0, "acc": 1.0}
    assert math_dapo.compute_score("Answer: $\\frac{7}{12}$", "\\frac{7}{12}")["acc"] == 1.0
    assert math_dapo.compute_score("Answer: 13", "12") == {"score": -1.0, "acc": 0.0}
    assert math_dapo.compute_score("", "12")["score"] == -1.0
    assert math_dapo.compute_score("\\boxed{12}", "12", strict_box_verify=True)["acc"] == 1.0


def test_builtin_scorer_values():
    info = {"word": "ab", "times": 5}
    assert builtin.compute_score("ababababab", "ababababab", info) == {"score": 1.0, "acc": 1.0}
    assert builtin.compute_score(" ababababab\n", "ababababab", info)["acc"] == 1.0
    assert builtin.compute_score("abab", "ababababab", info)["score"] == pytest.approx(0.5 * (1 - 3 / 5))
    assert builtin.compute_score("ab" * 7, "ababababab", info)["score"] == pytest.approx(0.5 * (1 - 2 / 5))
    assert builtin.compute_score("ab" * 10, "ababababab", info)["score"] == 0.0
    assert builtin.compute_score("ababa", "ababababab", info)["score"] == 0.0
    assert builtin.compute_score("", "ababababab", info)["score"] == 0.0
    assert builtin.compute_score("abab", "ababababab", None)["score"] == 0.0  # no extra_info: exact only
    assert builtin.compute_score(JUNK, "ababababab", info)["score"] == 0.0


def test_dispatch_by_data_source():
    assert default_compute_score("openai/gsm8k", NATALIA, "72") == {"score": 1.0, "acc": 1.0}
    for source in ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500"):
        assert default_compute_score(source, "\\boxed{12}", "12")["score"] == 1.0
    assert default_compute_score("aime2024", "Answer: 12", "12")["score"] == 1.0
    assert default_compute_score(builtin.DATA_SOURCE, "aa", "aa", {"word": "a", "times": 2})["acc"] == 1.0
    assert resolve_scorer("openai/gsm8k").bounded and not resolve_scorer("lighteval/MATH").bounded
    with pytest.raises(UnknownDataSourceError, match="my/dataset.*custom_reward_function"):
        default_compute_score("my/dataset", "x", "y")


def test_to_score_dict():
    assert to_score_dict(1) == {"score": 1.0, "acc": 1.0}
    assert to_score_dict(False) == {"score": 0.0, "acc": 0.0}
    assert to_score_dict({"score": -1.0, "acc": True, "pred": "12"}) == {"score": -1.0, "acc": 1.0}
    with pytest.raises(ValueError, match="without 'score'"):
        to_score_dict({"acc": 1.0})
    with pytest.raises(ValueError, match="non-finite"):
        to_score_dict(math.nan)
    with pytest.raises(TypeError):
        to_score_dict("1.0")
    with pytest.raises(TypeError):
        to_score_dict({"score": "high"})
