"""Code-execution rewards: a response's program run on the test cases of `reward_model.ground_truth`.

The data sources verl scores this way (`codecontests`, `apps`, `codeforces`, `taco`) store the
test cases as verl's code datasets do, a JSON string (or dict) of

    {"inputs": [stdin, ...], "outputs": [expected stdout, ...]}             # standard input
    {"inputs": [...], "outputs": [...], "fn_name": "f"}                     # call-based: JSON lines of
                                                                            # arguments, a JSON result
    {"assert_case": ["assert f(1) == 2", ...]}                              # the code plus an assert

The program is the last ```python block of the response (PRIME's rule: the whole text
when there is none). Each case runs in the sandbox, the built-in one (sandbox/runner.py)
or a SandboxFusion service (`reward.sandbox_fusion.url`), at most `max_concurrent` at once.

Score (verl's `prime_code` with continuous=True, its setting for these sources): 1.0 when
every case passes, else the pass rate over the first 10 cases. `acc` is 1.0 when every case
passes. The whole scoring keeps within `deadline_s` (the reward manager gives it part of
`reward_model.timeout_s`): a case that cannot run in time fails, so a slow program costs its
own score, never a scorer timeout.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

from verl_async.sandbox import SandboxLimits, run_code
from verl_async.sandbox.client import call_run_code

CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
CONTINUOUS_CASES = 10  # prime_code's partial credit: the first 10 cases
MIN_CASE_S = 0.5  # a case with less time left than this is not started


@dataclass(frozen=True)
class TestCases:
    inputs: list
    outputs: list  # None entries for assert cases: the exit code decides
    fn_name: Optional[str] = None
    asserts: Optional[list] = None

    def __len__(self) -> int:
        return len(self.inputs)


def parse_test_cases(ground_truth: Any) -> TestCases:
    """verl's test-case formats (see the module docstring); ValueError says what is wrong."""
    cases = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(cases, dict):
        raise ValueError(f"ground_truth: expected a JSON object of test cases, got {type(cases).__name__}")
    asserts = cases.get("assert_case")
    if isinstance(asserts, list):
        return TestCases([""] * len(asserts), [None] * len(asserts), asserts=[str(a) for a in asserts])
    inputs, outputs = cases.get("inputs"), cases.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError("ground_truth: test cases need 'inputs' and 'outputs' lists (or 'assert_case')")
    if len(inputs) != len(outputs):
        raise ValueError(f"ground_truth: {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError("ground_truth: no test cases")
    return TestCases(list(inputs), list(outputs), cases.get("fn_name") or None)


def extract_program(completion: str) -> str:
    """PRIME's rule: the text after the last ```python up to the next ```; the whole text without one."""
    return completion.split("```python")[-1].split("```")[0]


def _as_text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _numbers_equal(a: str, b: str) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)


def stdout_matches(actual: str, expected: Any) -> bool:
    """SandboxFusion's comparison (trailing newlines ignored), then PRIME's looser ones: per-line
    whitespace, whitespace-separated tokens, numeric tokens within 1e-6."""
    expected = _as_text(expected)
    if actual.rstrip("\n") == expected.rstrip("\n"):
        return True
    if [line.strip() for line in actual.strip().splitlines()] == [line.strip() for line in expected.strip().splitlines()]:
        return True
    got, want = actual.split(), expected.split()
    return len(got) == len(want) and all(g == w or _numbers_equal(g, w) for g, w in zip(got, want))


def result_matches(actual_stdout: str, expected: Any) -> bool:
    """Call-based cases: the printed JSON result equals the expected one (tuples as lists; PRIME also
    accepts the expected value wrapped in a list)."""
    try:
        got = json.loads(actual_stdout.strip().splitlines()[-1]) if actual_stdout.strip() else None
    except (ValueError, IndexError):
        return stdout_matches(actual_stdout, expected)
    want = json.loads(expected) if isinstance(expected, str) else expected
    return got == want or (isinstance(want, list) and len(want) == 1 and got == want[0])


_CALL_WRAPPER = """
{program}

def _verl_async_call():
    import json, sys
    args = [json.loads(line) for line in sys.stdin.read().split("\\n") if line.strip()]
    name = {fn_name!r}
    target = globals().get(name)
    if target is None and "Solution" in globals():
        target = getattr(globals()["Solution"](), name)
    if target is None:
        raise NameError("function " + name + " is not defined")
    result = target(*args)
    if isinstance(result, tuple):
        result = list(result)
    print(json.dumps(result))

_verl_async_call()
"""


def case_program(program: str, cases: TestCases, index: int) -> tuple[str, Optional[str]]:
    """(code, stdin) of case `index`."""
    if cases.asserts is not None:
        return program + "\n\n" + cases.asserts[index], None
    stdin = _as_text(cases.inputs[index])
    if cases.fn_name:
        return _CALL_WRAPPER.format(program=program, fn_name=cases.fn_name), stdin
    return program, stdin


def case_passed(cases: TestCases, index: int, finished: bool, exit_code: Optional[int], stdout: str) -> bool:
    if not finished or exit_code != 0:
        return False
    if cases.asserts is not None or cases.outputs[index] is None:
        return True
    if cases.fn_name:
        return result_matches(stdout, cases.outputs[index])
    return stdout_matches(stdout, cases.outputs[index])


async def _run_case(code: str, stdin: Optional[str], timeout_s: float, url: Optional[str], memory_limit_mb: int,
                    limits: SandboxLimits) -> tuple[bool, Optional[int], str]:
    """(finished, exit code, stdout) of one case, locally or on the service."""
    if url:
        response, _ = await call_run_code(url, code, stdin=stdin, run_timeout=timeout_s, memory_limit_mb=memory_limit_mb)
        run = (response or {}).get("run_result") or {}
        return run.get("status") == "Finished", run.get("return_code"), run.get("stdout") or ""
    result = await run_code(code, replace(limits, wall_time_s=timeout_s, cpu_time_s=max(1, math.ceil(timeout_s))),
                            stdin=stdin, mode="script", merge_stderr=False)
    finished = not (result.timed_out or result.truncated or result.sandbox_error)
    return finished, result.exit_code, result.stdout


async def score_program(program: str, cases: TestCases, *, url: Optional[str] = None, memory_limit_mb: int = 1024,
                        max_concurrent: int = 8, case_timeout_s: float = 10.0, deadline_s: float = 60.0,
                        limits: Optional[SandboxLimits] = None) -> list[bool]:
    """Whether each case passed, all within `deadline_s` (a case not run in time failed)."""
    limits = limits or SandboxLimits(memory_mb=memory_limit_mb)
    end = time.monotonic() + deadline_s
    slots = asyncio.Semaphore(max(1, max_concurrent))

    async def one(index: int) -> bool:
        async with slots:
            left = end - time.monotonic()
            if left < MIN_CASE_S:
                return False
            code, stdin = case_program(program, cases, index)
            finished, exit_code, stdout = await _run_case(code, stdin, min(case_timeout_s, left), url,
                                                          memory_limit_mb, limits)
            return case_passed(cases, index, finished, exit_code, stdout)

    return list(await asyncio.gather(*(one(i) for i in range(len(cases)))))


def score_from(passed: list[bool]) -> dict[str, float]:
    """prime_code (continuous): 1.0 when all pass, else the pass rate of the first 10; acc: all pass."""
    if not passed:
        return {"score": 0.0, "acc": 0.0, "pass_rate": 0.0, "cases": 0.0}
    everything = all(passed)
    first = passed[:CONTINUOUS_CASES]
    return {"score": 1.0 if everything else sum(first) / len(first), "acc": float(everything),
            "pass_rate": sum(passed) / len(passed), "cases": float(len(passed))}


def compute_score(solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, *,
                  sandbox_fusion_url: Optional[str] = None, memory_limit_mb: int = 1024, max_concurrent: int = 8,
                  case_timeout_s: float = 10.0, deadline_s: float = 60.0) -> dict[str, float]:
    """The reward of one response (see the module docstring); raises ValueError on unreadable test cases."""
    cases = parse_test_cases(ground_truth)
    passed = asyncio.run(score_program(extract_program(solution_str), cases, url=sandbox_fusion_url,
                                       memory_limit_mb=memory_limit_mb, max_concurrent=max_concurrent,
                                       case_timeout_s=case_timeout_s, deadline_s=deadline_s))
    return score_from(passed)
