"""The README is a front door that keeps its promises (issue 42, items 2 and 3).

Every command block marked `<!-- gpu-command: NAME -->` (README.md or docs/*.md; scripts/device/real_model_gpu.sh
readme:NAME runs it verbatim) states the time it took when it was run and the date; a block marked
`<!-- gpu-command-unmeasured: NAME -->` says it was not measured yet. Every link of the README and the docs pages
leads to a file that exists, and an anchor to a heading that exists. The README's two commands are the ones
`.ci/run` runs first, and the README stays under 300 lines.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- gpu-command(-unmeasured)?: ([\w.-]+) -->$")
TIME = re.compile(r"\*\*[\d,.]+ ?(s|min|minutes)\*\*|\btook \*\*[\d,.]+|\b\d+(\.\d+)? ?s\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
TWO_COMMANDS = ('bash scripts/setup.sh && .venv/bin/python -m recipe.fully_async_main',
                'bash scripts/setup.sh && .venv/bin/python -m pytest -q -m "not slow" -n 2 --dist loadscope')


def marked_blocks() -> list[tuple[Path, str, bool, str]]:
    """(page, name, measured, the text from the block's end to the next heading or marker)."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = MARKER.match(line)
            if not m:
                continue
            j = i + 1
            assert lines[j].startswith("```bash"), f"{page.name}:{i + 1}: the marker must stand right above a bash block"
            j += 1
            while not lines[j].startswith("```"):
                j += 1
            after = []
            for k in range(j + 1, len(lines)):
                if lines[k].startswith("#") or MARKER.match(lines[k]):
                    break
                after.append(lines[k])
            out.append((page, m.group(2), m.group(1) is None, "\n".join(after)))
    return out


def test_there_are_gpu_commands_and_their_names_are_unique():
    names = [name for _, name, _, _ in marked_blocks()]
    assert "real-model" in names and "multi-turn" in names, names
    assert len(names) == len(set(names)), names


@pytest.mark.parametrize("page,name,measured,after", marked_blocks(), ids=lambda v: getattr(v, "name", v))
def test_every_gpu_command_states_its_measured_time_and_date(page, name, measured, after):
    """A documented time is a promise: a marked block says how long it took when it was run, and when."""
    head = after.split("\n\n")[0] if after.strip() else ""
    head = "\n".join(after.strip().split("\n\n")[:1])
    if not measured:
        assert "not measured yet" in head.lower(), f"{page.name} {name}: an unmeasured block says so: {head[:300]}"
        return
    assert "verbatim" in head and TIME.search(head) and DATE.search(head), \
        f"{page.name} {name}: the paragraph after the block must say it ran verbatim, its time and the date: {head[:400]}"


def _slug(title: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    fence, out = False, set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^#{1,6} (.*)$", line)):
            out.add(_slug(m.group(1)))
    return out


def _links(page: Path) -> list[str]:
    fence, out = False, []
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            out.extend(re.findall(r"\]\(([^)\s]+)\)", line))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_lead_somewhere(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = page if not path else (page.parent / path).resolve()
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_the_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 300
    for command in TWO_COMMANDS:
        assert f"```bash\n{command}\n```" in text, command
    ci = (REPO / ".ci" / "run").read_text()
    assert TWO_COMMANDS[1] in ci  # CI runs the README's test command as its first step
