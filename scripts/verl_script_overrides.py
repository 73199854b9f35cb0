"""What a verl launch script hands to python, written down as data (tests/fixtures/verl_scripts/*.yaml).

    python scripts/verl_script_overrides.py SCRIPT.sh --source verl/experimental/fully_async_policy/shell/X.sh \
        --commit SHA [--env VERL_USE_UV=0 ...] -o tests/fixtures/verl_scripts/X.yaml

The script runs under bash with a stand-in `python`/`python3` that records its argv (and fails for
`python -c ...`, so a script probing for torch_npu takes its GPU branch; `ray job submit ... --`
runs the command after `--`); HOME is the literal `~`, so paths under the home folder come out as
`~/...`, and the folder it ran in as `./`. The YAML holds the module it runs, the
`--config-name` it asks for and every override as the script passes it: the facts about verl's
interface that tests/test_verl_scripts.py dry-runs (the scripts themselves stay verl's).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

STAND_IN = """#!/bin/sh
if [ "$1" = "-c" ]; then exit 1; fi
printf "%s\\0" "$@" > "$ARGV_OUT"
"""
# `ray job submit ... -- python3 -m ...`: the command after `--` runs (through the stand-in python)
RAY_STAND_IN = """#!/bin/sh
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do shift; done
[ "$#" -gt 0 ] && shift && exec "$@"
"""


def capture(script: Path, env: dict[str, str]) -> tuple[list[str], str | None]:
    """The argv (after `python`) of the script's last python call, and how the script failed (None: it did not).

    A script that fails after its python call (a `tee` into a folder it did not make, an Ascend
    environment file) still gives its argv; one that fails before it gives none (SystemExit)."""
    with tempfile.TemporaryDirectory() as tmp:
        bindir, out = Path(tmp, "bin"), Path(tmp, "argv")
        bindir.mkdir()
        for exe, text in (("python", STAND_IN), ("python3", STAND_IN), ("ray", RAY_STAND_IN)):
            (bindir / exe).write_text(text)
            (bindir / exe).chmod(0o755)
        full = {"PATH": f"{bindir}:/usr/bin:/bin", "ARGV_OUT": str(out), "HOME": "~", **env}
        proc = subprocess.run(["bash", str(script)], cwd=tmp, env=full, capture_output=True, text=True, timeout=60)
        errors = [line for line in proc.stderr.splitlines() if line and not line.startswith("+")]
        failure = None if proc.returncode == 0 else (errors[-1] if errors else f"exit status {proc.returncode}")
        if failure:
            failure = failure.replace(str(script), script.name)
        if not out.exists():
            raise SystemExit(f"{script.name} stopped before calling python: {failure}")
        # the folder the script ran in ($PWD) is written as ./ (where a user would run it)
        argv = [a.replace(f"{tmp}/", "./").replace(tmp, ".") for a in out.read_text().split("\0")[:-1]]
        return argv, failure


def describe(argv: list[str], *, source: str, commit: str, env: dict[str, str], failure: str | None = None) -> dict:
    if "-m" not in argv:
        raise SystemExit(f"expected `python [options] -m MODULE ...`, got {argv[:3]}")
    at = argv.index("-m")  # interpreter options before it (-X faulthandler) are not the script's overrides
    module, config_name, overrides = argv[at + 1], None, []
    for arg in argv[at + 2:]:
        if arg.startswith("--config-name"):
            config_name = arg.split("=", 1)[1] if "=" in arg else None
        elif arg.startswith("--config-path"):
            continue
        else:
            overrides.append(arg)
    return {"source": source, "commit": commit, "env": env or None, "script_failure": failure, "module": module,
            "config_name": config_name, "overrides": overrides}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("script", type=Path)
    p.add_argument("--source", required=True, help="the script's path in verl-project/verl")
    p.add_argument("--commit", required=True, help="the verl commit it was read at")
    p.add_argument("--env", action="append", default=[], help="NAME=value for the script (e.g. VERL_USE_UV=0)")
    p.add_argument("-o", "--output", type=Path, required=True)
    args = p.parse_args()
    env = dict(e.split("=", 1) for e in args.env)
    argv, failure = capture(args.script, env)
    data = describe(argv, source=args.source, commit=args.commit, env=env, failure=failure)
    args.output.write_text(yaml.safe_dump(data, sort_keys=False, width=1000, allow_unicode=True))
    print(f"{args.output}: {len(data['overrides'])} overrides", file=sys.stderr)


if __name__ == "__main__":
    main()
