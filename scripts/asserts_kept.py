"""Which assertions of a test file's version at REF are no longer made by this checkout's version of it.

    python scripts/asserts_kept.py REF [TEST_FILE ...]     # default: every test file changed since REF

Issue 39's rule: every assertion a test makes is still made by some test CI runs. When tests are
merged onto a shared run or moved into classes, their `assert` statements (and `pytest.raises(...)`
contexts) keep their text; this lists, per file, those of REF whose text (whitespace and quotes as
`ast.unparse` writes them) appears nowhere in the file now, so each one left is a change to explain
(a renamed variable, new numbers for a shorter run) in the closing note.
"""

from __future__ import annotations

import ast
import subprocess
import sys


def assertions(source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert):
            out.append(ast.unparse(node))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            out += [ast.unparse(i.context_expr) for i in node.items if "raises" in ast.unparse(i.context_expr)]
    return out


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    ref, files = sys.argv[1], sys.argv[2:]
    if not files:
        files = [f for f in git("diff", "--name-only", ref, "--", "tests").split() if f.endswith(".py")]
    missing_total = 0
    for path in files:
        try:
            before = assertions(git("show", f"{ref}:{path}"))
        except subprocess.CalledProcessError:
            continue  # new at this checkout
        try:
            now = set(assertions(open(path).read()))
        except FileNotFoundError:
            now = set()
        missing = [a for a in before if a not in now]
        missing_total += len(missing)
        print(f"{path}: {len(before)} assertions at {ref}, {len(missing)} not found now")
        for a in missing:
            print(f"    {a[:220]}")
    return 1 if missing_total else 0


if __name__ == "__main__":
    sys.exit(main())
