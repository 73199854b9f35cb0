"""MATH (Hendrycks / lighteval) scorer: the last `\\boxed{...}` against the ground truth.

Extraction handles nested braces, `\\fbox{...}`, `\\boxed {...}` and the brace-less
`\\boxed 5`. Equivalence: the normalised strings match (a cheap, dependency-free
normaliser in the style of the MATH reference `strip_string` / Minerva
`normalize_final_answer`), or math-verify (a maintained symbolic checker) says the
two expressions are equal. Without math-verify, or when it errors, the normaliser's
verdict stands. math-verify's own signal-based timeouts are off: they only work in
a main thread; the reward sandbox enforces the time limit instead.
"""

from __future__ import annotations

import logging
import re
from typing import Optional

try:  # optional: `pip install verl_async[math]`
    from math_verify import LatexExtractionConfig
    from math_verify import parse as _mv_parse
    from math_verify import verify as _mv_verify

    HAVE_MATH_VERIFY = True
    # It warns on every call that its timeouts are disabled; we bound time outside.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
except Exception:  # pragma: no cover - exercised only where math-verify is absent
    HAVE_MATH_VERIFY = False

# Answers longer than this are never handed to sympy: MATH answers are short, and a
# huge pathological "answer" would only burn the time budget.
MAX_VERIFY_CHARS = 1000

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BRACES = re.compile(r"[{}]")


def _last_box_span(text: str) -> Optional[tuple[int, int, int, int]]:
    """(start, content_start, content_end, end) of the last box, or None when absent/unclosed."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd_end = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    j = cmd_end
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        depth = 0
        for m in _BRACES.finditer(text, j):
            depth += 1 if m.group() == "{" else -1
            if depth == 0:
                return start, j + 1, m.start(), m.end()
        return None
    if j > cmd_end:  # "\boxed 5$" / "\boxed 5\n": up to the closing $ or the end of the line
        stop = len(text)
        for sep in ("$", "\n"):
            k = text.find(sep, j)
            if k >= 0:
                stop = min(stop, k)
        return (start, j, stop, stop) if text[j:stop].strip() else None
    return None


def last_boxed_only_string(text: str) -> Optional[str]:
    """The last `\\boxed{...}` / `\\fbox{...}` / `\\boxed x` expression itself (verl's helper name)."""
    span = _last_box_span(text)
    return None if span is None else text[span[0] : span[3]]


def remove_boxed(boxed: str) -> str:
    """Inside of a box expression returned by `last_boxed_only_string`."""
    span = _last_box_span(boxed)
    if span is None or span[0] != 0:
        raise ValueError(f"not a box expression: {boxed[:80]!r}")
    return boxed[span[1] : span[2]].strip()


def extract_boxed_answer(text: str) -> Optional[str]:
    """Content of the last box in `text`, or None."""
    span = _last_box_span(text)
    return None if span is None else text[span[1] : span[2]].strip()


# --- normaliser -------------------------------------------------------------------

def _fix_fracs(s: str) -> str:
    r"""\frac12 -> \frac{1}{2}, \frac1{72} -> \frac{1}{72}."""
    head, *rest = s.split("\\frac")
    out = head
    for sub in rest:
        out += "\\frac"
        if sub.startswith("{") or len(sub) < 2:
            out += sub
            continue
        a, b, tail = sub[0], sub[1], sub[2:]
        out += "{" + a + "}" + (b + tail if b == "{" else "{" + b + "}" + tail)
    return out


def _fix_a_slash_b(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\{([^{}]*)\}")


def normalize_answer(answer: str) -> str:
    """Canonical string for a final answer (MATH reference normalisation, slightly extended)."""
    s = str(answer).strip().replace("\n", "")
    s = s.rstrip(".")
    for old, new in (("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""),
                     ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""), ("\\,", ""), ("\\;", ""),
                     ("\\ ", " "), ("{,}", "")):
        s = s.replace(old, new)
    # a trailing unit written as "\text{ cm}" is dropped, other \text{x} become x
    if "\\text{ " in s:
        s = s.split("\\text{ ")[0]
    s = _TEXT_CMD.sub(r"\1", s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2:  # "x = 5" -> "5"
        s = parts[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # 1,000 -> 1000
        s = s.replace(",", "")
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    except ValueError:
        return False


def is_equiv(pred: Optional[str], ground_truth: str, *, use_math_verify: bool = True) -> bool:
    """Whether an extracted answer equals the ground truth (see the module docstring)."""
    if pred is None:
        return False
    a, b = normalize_answer(pred), normalize_answer(ground_truth)
    if a == b or _same_number(a, b):
        return True
    if not (use_math_verify and HAVE_MATH_VERIFY) or len(pred) > MAX_VERIFY_CHARS:
        return False
    try:
        config = [LatexExtractionConfig()]
        gold = _mv_parse("\\boxed{" + str(ground_truth) + "}", extraction_config=config, parsing_timeout=None)
        target = _mv_parse("\\boxed{" + pred + "}", extraction_config=config, parsing_timeout=None)
        if not gold or not target:
            return False
        return bool(_mv_verify(gold, target, timeout_seconds=None))
    except Exception:  # math-verify errors: the normaliser's "not equal" stands
        return False


def compute_score(solution_str: str, ground_truth: str, *, use_math_verify: bool = True) -> float:
    """1.0 when the last boxed answer equals the ground truth, else 0.0."""
    return 1.0 if is_equiv(extract_boxed_answer(solution_str), ground_truth, use_math_verify=use_math_verify) else 0.0
